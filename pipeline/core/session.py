"""Loading a command's config and running stages with their summary: shared by every command that runs stages
(run, nightly, launch). The CLI imports this; nothing here imports the CLI."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.core import catalogue
from pipeline.core.runner import Runner
from pipeline.core.summary import print_summary


def load(args):
    """The validated config of a command's -c/-o arguments; run.threads reaches OpenMP/MKL before paddle loads."""
    from pipeline.core.config import load_config
    cfg = load_config(args.config, args.override)
    if cfg.run.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(cfg.run.threads)
    return cfg


def run_stages(cfg, names: list[str], force: bool = False, layout=None, summary_json: str | None = None):
    """Run stages, print the summary and one line per failure; returns (outcomes, exit code).

    The one way every command (run, nightly, launch) runs stages and reports them. `layout`: the
    training process layout (pipeline/core/process_layout.py); None plans it from the config. `summary_json`: a
    path for the machine-readable summary (pipeline/core/summary.py summary_record)."""
    outcomes = Runner(cfg, force=force, layout=layout).run(names)
    print_summary(cfg.run_dir, catalogue.for_task(cfg.task), {o.stage: o.status for o in outcomes})
    errors = [o for o in outcomes if o.error is not None and o.status != "NOT RUN"]
    for o in errors:
        print(f"error: {o.error.one_line()}", file=sys.stderr)
    not_run = [o.stage for o in outcomes if o.status == "NOT RUN"]
    if not_run:
        print(f"not run (an input stage failed): {', '.join(not_run)}", file=sys.stderr)
    code = errors[0].error.exit_code if errors else 0
    if summary_json:
        from pipeline.core.artifacts import write_json
        from pipeline.core.summary import summary_record
        try:
            write_json(Path(summary_json), summary_record(cfg.run_dir, catalogue.for_task(cfg.task), outcomes, code))
        except OSError as exc:
            print(f"error: cannot write the summary to {summary_json}: {exc.strerror or exc} "
                  f"(hint: --summary-json needs a writable path in an existing folder)", file=sys.stderr)
            code = code or 8
    return outcomes, code
