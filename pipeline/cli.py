"""`python -m pipeline ...` — the only place that turns errors into exit codes and one-line messages."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from pipeline.core import catalogue, env
from pipeline.core.composite import PARTS, part_configs
from pipeline.core.errors import PipelineError
from pipeline.core.console import set_quiet, setup_logging
from pipeline.core.session import load, run_stages

import stages


INTERRUPTED = 130


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="nodes of a multi-node run (make train NNODES=2)")
    p.add_argument("--master", default=None, help="host:port of the rendezvous on node 0 (make train MASTER=...)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index 0..nnodes-1 (make train NODE_RANK=i)")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", action="append", default=[], help="config file(s), merged over configs/defaults.yaml")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. -o train.epochs=3 (repeatable)")
    p.add_argument("-O", "--overrides", default="", metavar="'K=V K2=V2'",
                   help="several overrides in one string with shell-like quoting (what `make O=...` passes), "
                        "e.g. -O 'data.path=\"/data/my set\" model.args={a: 1, b: 2}'")


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="only warnings, errors and the final summary on the console")
    p.add_argument("--summary-json", metavar="PATH", help="also write the summary (each stage's outcome, every gate) "
                                                          "as JSON to PATH, for scripts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run stages by name or alias ('deploy', 'all'); `stages` lists them")
    run.add_argument("stages", nargs="+")
    run.add_argument("--force", action="store_true", default=os.environ.get("FORCE") == "1",
                     help="re-run stages even when up to date (env FORCE=1)")
    _config_args(run)
    _layout_args(run)
    _output_args(run)
    run.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)   # one part of an OCR system (its own process)
    launch = sub.add_parser("launch", help="`run train` with an explicit process count (paddle.distributed.launch)")
    launch.add_argument("--nproc", type=int, default=2)
    launch.add_argument("--force", action="store_true", default=os.environ.get("FORCE") == "1")
    _config_args(launch)
    _layout_args(launch)
    _output_args(launch)
    launch.set_defaults(func=_launch)
    show = sub.add_parser("summary", help="print the summary table of a run")
    _config_args(show)
    st = sub.add_parser("stages", help="the stage catalogue: order, inputs, outputs (or the names a task runs)")
    st.add_argument("--task", help="print only the stage names a run of this task goes through (one line)")
    st.add_argument("--alias", default="all", help="with --task: the stages this alias runs (all, deploy)")
    st.set_defaults(func=_stages)
    from pipeline import cli_tools  # verify / serve / history / nightly / accept
    cli_tools.register(sub, _config_args, _output_args)
    from pipeline.nightly import conformance  # make conformance
    conformance.register(sub)
    return parser


def _launch(args) -> int:
    from pipeline.training.distributed import launch
    return launch(args)


def _run(args) -> int:
    from pipeline.core.process_layout import plan

    cfg = load(args)
    if cfg.task == "ocr_system" and args.part:      # a system's part, spawned by _run_system below
        cfg = part_configs(cfg)[args.part]
    elif cfg.task == "ocr_system":
        return _run_system(args, cfg)
    names = catalogue.expand(args.stages, cfg.task)       # refuses unknown / inapplicable stages in one line
    layout = plan(cfg, nnodes=args.nnodes, master=args.master, node_rank=args.node_rank) if "train" in names else None
    if layout is None or not layout.needs_launch or len(names) > 1:
        env.import_paddle_quietly(trains=_trains(cfg, names, layout))   # a launcher of ranks does not need paddle itself
    return run_stages(cfg, names, force=args.force, layout=layout, summary_json=args.summary_json)[1]


def _run_system(args, cfg) -> int:
    """The parts' runs, each in its own supervised process (`run ... --part ROLE`: a kill names its stage, and
    its memory is returned before the next part starts), then the system stage here (pipeline/core/composite.py)."""
    from pipeline.core import supervise
    from pipeline.core.composite import run_system

    def run_part(role: str, names: list[str]) -> int:
        argv = ["run", *names, "--part", role, *(a for c in args.config for a in ("-c", c)),
                *(a for o in args.override for a in ("-o", o)), *(["--force"] if args.force else [])]
        if args.nnodes != 1:
            argv += ["--nnodes", str(args.nnodes), "--master", str(args.master)] + \
                (["--node-rank", str(args.node_rank)] if args.node_rank is not None else [])
        return supervise.run_supervised(argv)

    def run_system_stages(cfg, names, force):
        env.import_paddle_quietly(trains=False)
        return run_stages(cfg, names, force, summary_json=args.summary_json)   # parts: the system's run writes last
    return run_system(cfg, args.stages, args.force, run_system_stages, run_part)


def _trains(cfg, names: list[str], layout=None) -> bool:
    """Whether these stages train in this process (an imported model's `train` stage only loads and checks it; a
    launcher of ranks trains nothing itself). A launcher probed as a trainer chose ACTIVE on a quiet host, and Intel
    OpenMP's ACTIVE threads never sleep: its idle team spun in sched_yield beside its ranks and through every later
    stage (make conformance: 550 s of system time, 239 M involuntary context switches in 24.7 min)."""
    launched = layout is not None and layout.needs_launch
    return "train" in names and cfg.model.source not in ("inference", "pir", "onnx") and not launched


def _stages(args) -> int:
    """The catalogue as a table, or (--task) the names a run goes through: what the Makefile asks."""
    if args.task:
        print(" ".join(catalogue.expand([args.alias], args.task)))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stages (order from their declared inputs)")
    for col in ("stage", "inputs", "outputs (? = when its row ran)", "make", "tasks"):
        table.add_column(col)
    for s in catalogue.describe():
        outs = ", ".join(s["outputs"] + [f"{o}?" for o in s["optional"]])
        table.add_row(s["name"], ", ".join(s["inputs"]), outs, s["make"], ", ".join(s["tasks"]))
    Console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    if getattr(args, "quiet", False):
        set_quiet(True)
    try:
        if getattr(args, "overrides", ""):       # before -o items: an explicit -o wins
            from pipeline.core.config import split_overrides
            args.override = split_overrides(args.overrides) + list(args.override)
        if args.command == "run":
            return _run(args)
        if args.command == "summary":
            from pipeline.core.errors import MissingArtifact
            from pipeline.core.summary import print_summary
            cfg = load(args)
            if not cfg.run_dir.is_dir():
                raise MissingArtifact(f"no run folder {cfg.run_dir}",
                                      hint="run a stage first (make train), or pass the same CONFIG/O as that run")
            print_summary(cfg.run_dir, catalogue.for_task(cfg.task), {})
            return 0
        return int(args.func(args) or 0)   # subcommands from cli_tools
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # a second Ctrl-C must not turn this into a traceback
        print("interrupted: finished stage outputs are intact; re-run to resume", file=sys.stderr)
        return INTERRUPTED
    return 0
