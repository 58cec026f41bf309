"""`python -m pipeline ...` — the only place that turns errors into exit codes and one-line messages."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from . import env
from .errors import PipelineError

ALIASES = {"deploy": ["server", "lite", "bundle"], "all": ["train", "export", "server", "lite", "bundle"]}


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run stages: train export server lite bundle (or 'deploy', 'all')")
    run.add_argument("stages", nargs="+")
    run.add_argument("--force", action="store_true", default=os.environ.get("FORCE") == "1",
                     help="re-run stages even when up to date (env FORCE=1)")
    _config_args(run)
    _layout_args(run)
    launch = sub.add_parser("launch", help="`run train` with an explicit process count (paddle.distributed.launch)")
    launch.add_argument("--nproc", type=int, default=2)
    launch.add_argument("--force", action="store_true", default=os.environ.get("FORCE") == "1")
    _config_args(launch)
    _layout_args(launch)
    launch.set_defaults(func=lambda a: __import__("pipeline.distributed", fromlist=["launch"]).launch(a))
    show = sub.add_parser("summary", help="print the summary table of a run")
    _config_args(show)
    from . import cli_tools              # verify / serve / history / nightly / accept
    cli_tools.register(sub, _config_args)
    from . import conformance            # make conformance
    conformance.register(sub)
    return parser


def _load(args):
    from .config import load_config
    cfg = load_config(args.config, args.override)
    if cfg.run.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(cfg.run.threads)
    return cfg


def run_stages(cfg, names: list[str], force: bool = False, layout=None):
    """Run stages, print the summary and one line per failure; returns (outcomes, exit code).

    The one way every command (run, nightly, launch) runs stages and reports them. `layout`: the
    training process layout (pipeline/layout.py); None plans it from the config."""
    from .runner import Runner, registry
    from .summary import print_summary

    outcomes = Runner(cfg, force=force, layout=layout).run(names)
    print_summary(cfg.run_dir, list(registry()), {o.stage: o.status for o in outcomes})
    errors = [o for o in outcomes if o.error is not None and o.status != "NOT RUN"]
    for o in errors:
        print(f"error: {o.error.one_line()}", file=sys.stderr)
    not_run = [o.stage for o in outcomes if o.status == "NOT RUN"]
    if not_run:
        print(f"not run (an input stage failed): {', '.join(not_run)}", file=sys.stderr)
    return outcomes, (errors[0].error.exit_code if errors else 0)


def _run(args) -> int:
    from .layout import plan

    cfg = _load(args)
    names = [n for s in args.stages for n in ALIASES.get(s, [s])]
    if cfg.task == "ocr_system":        # two part runs, then the system stage (pipeline/composite.py)
        from .composite import run_system
        env.import_paddle_quietly()
        return run_system(cfg, names, args.force, run_stages)
    layout = plan(cfg, nnodes=args.nnodes, master=args.master, node_rank=args.node_rank) if "train" in names else None
    if layout is None or not layout.needs_launch or len(names) > 1:
        env.import_paddle_quietly()      # a parent that only launches ranks does not need paddle itself
    return run_stages(cfg, names, force=args.force, layout=layout)[1]


def setup_logging() -> None:
    # our own handler: paddle reconfigures the root logger on import
    log = logging.getLogger("pipeline")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "overrides", ""):       # before -o items: an explicit -o wins
            from .config import split_overrides
            args.override = split_overrides(args.overrides) + list(args.override)
        if args.command == "run":
            return _run(args)
        if args.command == "summary":
            from .errors import MissingArtifact
            from .runner import registry
            from .summary import print_summary
            cfg = _load(args)
            if not cfg.run_dir.is_dir():
                raise MissingArtifact(f"no run folder {cfg.run_dir}",
                                      hint="run a stage first (make train), or pass the same CONFIG/O as that run")
            print_summary(cfg.run_dir, list(registry()), {})
            return 0
        return int(args.func(args) or 0)   # subcommands from cli_tools
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: finished stage outputs are intact; re-run to resume", file=sys.stderr)
        return 130
    return 0
