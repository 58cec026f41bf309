"""One rank of a launched training (started by paddle.distributed.launch through pipeline/cli_rank.py, which
registers the stages; see pipeline/training/distributed.py).

Rank 0 decides whether the stage is up to date and broadcasts it (nodes may not share a disk), then runs
a Runner (the only writer); the other ranks run the stage into a throwaway folder, taking part in the
same collectives. Every rank records RUNNING (with its pid) in <log>/status.<local rank>.json when it
starts and its outcome when it ends, which is how the parent tells a rank that died from its victims.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path


class _Terminated(BaseException):
    """SIGTERM from the launcher (a peer failed): unwind, record it, exit."""


def _write_status(log_dir: Path, local: int, rank: int, status: str, code: int = 0, error: str | None = None) -> None:
    from pipeline.core.artifacts import write_json
    from pipeline.training.distributed import STATUS
    try:
        write_json(log_dir / STATUS.format(local), {"rank": rank, "local_rank": local, "pid": os.getpid(),
                                                    "status": status, "exit_code": code, "error": error})
    except OSError:
        pass


def _decide_skip(runner, stage, fp: str, rank: int) -> bool:
    """Rank 0 applies the Runner's skip rule and every rank follows it (nodes may not share a disk)."""
    import paddle
    import paddle.distributed as dist

    skip = rank == 0 and runner.up_to_date(stage, {}, runner.layout, fp) is not None
    flag = paddle.to_tensor([1.0 if skip else 0.0])
    dist.broadcast(flag, src=0)
    return bool(flag.numpy()[0] > 0.5)


def _run_rank(cfg, force: bool, rank: int) -> tuple[str, int, str | None]:
    from pipeline.core.process_layout import current
    from pipeline.core.runner import Runner, StageContext, fingerprint, registry

    layout = current()
    stage = registry()["train"]
    fp = fingerprint(cfg, stage, {}, layout.key())
    runner = Runner(cfg, force=force, layout=layout)
    skip = _decide_skip(runner, stage, fp, rank)
    if rank == 0:
        (outcome,) = runner.run(["train"])
        err = outcome.error
        return outcome.status, (err.exit_code if err else 0), (err.one_line() if err else None)
    if not skip:
        scratch = Path(tempfile.mkdtemp(prefix=f"pipeline-rank{rank}-"))
        try:
            ctx = StageContext(cfg, stage.name, scratch / "out", cfg.run_dir / ".work" / stage.name, {}, {}, fp, force)
            ctx.out_dir.mkdir(parents=True)
            stage.run(ctx)              # same collectives as rank 0; outputs thrown away
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return "OK", 0, None


def _worker(argv: list[str]) -> int:
    import argparse
    import traceback

    from pipeline.core import env
    from pipeline.core.console import keep_native_output_here, setup_logging
    from pipeline.core.config import load_config
    from pipeline.core.errors import PipelineError

    setup_logging()
    keep_native_output_here()     # this rank's fds are its workerlog.N already: gloo's abort text is read from there
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", action="append", default=[])
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    local = int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")))
    log_dir = Path(os.environ.get("PADDLE_LOG_DIR", "."))
    _write_status(log_dir, local, rank, "RUNNING")        # also the readiness signal tests wait on

    def on_term(signum, frame):
        raise _Terminated()
    signal.signal(signal.SIGTERM, on_term)
    status, code, error = "ERROR", 1, None
    try:
        cfg = load_config(args.config)
        env.import_paddle_quietly()
        import paddle.distributed as dist

        dist.init_parallel_env()
        status, code, error = _run_rank(cfg, args.force, dist.get_rank())
    except PipelineError as exc:
        code, error = exc.exit_code, exc.one_line()
    except _Terminated:
        status, code, error = "TERMINATED", 143, "stopped by the launcher (a peer failed)"
    except KeyboardInterrupt:
        code, error = 130, "interrupted: finished stage outputs are intact; re-run to resume"
    except Exception as exc:
        (log_dir / f"traceback.{local}.txt").write_text(traceback.format_exc())
        status, error = "PEER_LOST" if _peer_error(exc) else "ERROR", f"{type(exc).__name__}: {exc}".splitlines()[0]
    if error and (rank != 0 or status in ("PEER_LOST", "TERMINATED")):
        # for the log; the parent prints the one error line (rank 0's stage errors come through its status file)
        print(f"[rank {rank}] stopped: {error}", file=sys.stderr, flush=True)
    _write_status(log_dir, local, rank, status, code, error)
    return code


def _peer_error(exc: Exception) -> bool:
    """A collective failed because a peer went away (gloo raises these as RuntimeError text)."""
    text = str(exc).lower()
    return any(w in text for w in ("connection", "gloo", "peer", "socket", "timed out", "broken pipe"))

