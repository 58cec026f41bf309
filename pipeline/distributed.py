"""Multi-process data-parallel training with Paddle's own launcher (gloo on CPU, NCCL on GPU).

    python -m pipeline launch --nproc 2 -c CONFIG -o ...      (make train NPROC=2)
      → python -m paddle.distributed.launch --nproc_per_node 2 --log_dir <run>/log \\
            pipeline/distributed.py --worker -c CONFIG -o ...

Every worker calls `init_parallel_env()` and runs the train stage's function; the train loop wraps
the model in `paddle.DataParallel` and each rank takes its share of every global batch
(train.batch_size is per process). Only rank 0 goes through the Runner, so only rank 0 writes the
stage output, its manifest and the checkpoints; the other ranks write into a throwaway folder.
Rank 0's log is streamed to this console; every rank's log is in <run>/log/workerlog.N.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATUS = "status.json"


def world() -> tuple[int, int]:
    """(rank, number of processes); (0, 1) unless init_parallel_env() has run in this process."""
    import paddle.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------- the parent: `python -m pipeline launch`

def _child_env(cfg, nproc: int) -> dict:
    from . import env

    child = dict(os.environ)
    # threads per process: the cores shared out, unless the user chose (env or run.threads)
    threads = cfg.run.threads or max(1, env.cpu_count() // nproc)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if cfg.run.threads or key in env.APPLIED_TUNING or key not in os.environ:
            child[key] = str(threads)
    child["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    child["PYTHONUNBUFFERED"] = "1"
    child.setdefault("GLOG_minloglevel", "1")        # hide gloo's per-connection INFO lines; warnings stay
    return child


def _follow(path: Path, pos: int, out) -> int:
    """Copy what was appended to `path` since `pos` to `out`; return the new position."""
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return pos
    if data:
        out.write(data)
        out.flush()
    return pos + len(data)


def _last_line(path: Path) -> str:
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def launch(args) -> int:
    from . import env
    from .config import load_config
    from .errors import ConfigError, PipelineError

    cfg = load_config(args.config, args.override)             # bad config: one line, before any process starts
    nproc = int(args.nproc)
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}", hint="make train NPROC=2")
    if nproc == 1:
        from .cli import _run
        args.stages = ["train"]
        return _run(args)
    if nproc > env.cpu_count() and not env.capabilities()["gpu"]:
        print(f"warning: {nproc} processes on {env.cpu_count()} CPU cores: they will compete for the cores",
              file=sys.stderr)

    log_dir = cfg.run_dir / "log"
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in [*log_dir.glob("workerlog.*"), log_dir / STATUS]:
        old.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", str(log_dir), "--max_restart", "0", str(Path(__file__).resolve()), "--worker"]
    for c in args.config:
        cmd += ["-c", str(c)]
    for o in args.override:
        cmd += ["-o", o]
    if args.force:
        cmd.append("--force")
    print(f"launching {nproc} processes (paddle.distributed.launch); logs: {log_dir}/workerlog.0..{nproc - 1}, "
          f"launcher: {log_dir}/launch.log", file=sys.stderr, flush=True)
    worker0 = log_dir / "workerlog.0"
    pos = 0
    out = sys.stderr.buffer
    with open(log_dir / "launch.log", "wb") as launcher_log:
        proc = subprocess.Popen(cmd, stdout=launcher_log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=_child_env(cfg, nproc))
        try:
            while proc.poll() is None:
                pos = _follow(worker0, pos, out)
                time.sleep(0.2)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=30)
            raise
    _follow(worker0, pos, out)

    status = None
    try:
        status = json.loads((log_dir / STATUS).read_text())
    except (OSError, json.JSONDecodeError):
        pass
    if status is not None and status.get("exit_code", 1) != 0:
        return int(status["exit_code"])      # rank 0 already printed its one-line error (streamed above)
    if proc.returncode != 0 or status is None:
        logs = {i: (log_dir / f"workerlog.{i}") for i in range(nproc)}
        texts = {i: (p.read_text(errors="replace") if p.is_file() else "") for i, p in logs.items()}
        crashed = [i for i, t in texts.items() if "Traceback" in t or "SIGABRT" in t or "SIGSEGV" in t]
        who = crashed[0] if crashed else 0
        peer = " (a peer process died or hung: every rank's log matters)" if "TIMEOUT" in texts[who] or \
            "SIGABRT" in texts[who] else ""
        raise PipelineError(f"distributed training failed (launcher exit code {proc.returncode}); worker {who} "
                            f"last wrote: {_last_line(logs[who]) or 'nothing'}{peer}",
                            hint=f"full logs in {log_dir}/workerlog.0..{nproc - 1} and {log_dir}/launch.log")
    return 0


# ---------------------------------------------------------------- a worker (one per process)

def _up_to_date(cfg, stage, fp: str, force: bool) -> bool:
    """The Runner's skip rule, evaluated by every rank before anyone writes (so all ranks agree)."""
    from .artifacts import load_manifest, verify_outputs
    from .errors import IntegrityError

    current = load_manifest(cfg.run_dir / stage.name)
    if force or not current or current.get("fingerprint") != fp or current.get("status") != "OK":
        return False
    try:
        verify_outputs(cfg.run_dir / stage.name, current)
    except IntegrityError:
        return False
    return True


def _worker(argv: list[str]) -> int:
    import argparse

    from . import env
    from .cli import setup_logging
    from .config import load_config
    from .errors import PipelineError

    setup_logging()
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("-c", "--config", action="append", default=[])
    p.add_argument("-o", "--override", action="append", default=[])
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    code, error, stage_error = 0, None, None      # error: still to print; stage_error: printed already
    try:
        cfg = load_config(args.config, args.override)
        env.import_paddle_quietly()
        import paddle.distributed as dist

        from .runner import StageContext, fingerprint, registry

        dist.init_parallel_env()
        rank = dist.get_rank()
        stage = registry()["train"]
        fp = fingerprint(cfg, stage, {})
        skip = _up_to_date(cfg, stage, fp, args.force)
        dist.barrier()                      # every rank has decided before rank 0 may write anything
        if rank == 0:
            from .cli import run_stages

            outcomes, code = run_stages(cfg, ["train"], force=args.force)    # prints its own error lines
            stage_error = next((o.error.one_line() for o in outcomes if o.error is not None), None)
        elif not skip:
            scratch = Path(tempfile.mkdtemp(prefix=f"pipeline-rank{rank}-"))
            try:
                ctx = StageContext(cfg, stage.name, scratch / "out", cfg.run_dir / ".work" / stage.name, {}, {},
                                   fp, args.force)
                ctx.out_dir.mkdir(parents=True)
                stage.run(ctx)              # same collectives as rank 0; outputs thrown away
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    except PipelineError as exc:
        code, error = exc.exit_code, exc.one_line()
    except KeyboardInterrupt:
        code, error = 130, "interrupted: finished stage outputs are intact; re-run to resume"
    if error:
        print(f"error: {error}" + (f" (rank {rank})" if rank else ""), file=sys.stderr, flush=True)
    if rank == 0:
        from .artifacts import write_json
        try:
            write_json(Path(os.environ.get("PADDLE_LOG_DIR", ".")) / STATUS, {"exit_code": code,
                                                                                  "error": error or stage_error})
        except OSError:
            pass
    return code


if __name__ == "__main__":
    # started as a script by paddle.distributed.launch: import the package from the repo root,
    # never from this folder (pipeline/ would shadow nothing useful and break relative imports)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, str(ROOT))
    import pipeline  # noqa: F401  -- zlib before paddle, CPU tuning before paddle loads
    from pipeline.distributed import _worker as _main

    sys.exit(_main(sys.argv[1:]))
