"""Multi-process (and multi-node) data-parallel training with Paddle's own launcher (gloo on CPU, NCCL on GPU).

    make train [NPROC=2] [NNODES=2 MASTER=host:port NODE_RANK=i]
      → python -m pipeline run train ...      (the Runner plans the layout: pipeline/core/process_layout.py)
      → python -m paddle.distributed.launch --nproc_per_node N [--nnodes 2 --master host:port --rank i]
            --log_dir <run>/log pipeline/cli_rank.py -c <run>/log/config.launch.yaml

Every worker calls `init_parallel_env()`; the train loop wraps the model in `paddle.DataParallel` and
each rank takes its share of every global batch (train.batch_size is the global batch). Rank 0 alone
runs a Runner, so only rank 0 writes the stage output, its manifest and the checkpoints; the other
ranks write into a throwaway folder (the rank side is pipeline/training/rank_worker.py). Every rank writes
<log>/status.<local rank>.json: RUNNING (with its pid) when it starts, its outcome when it ends; a
rank that is still RUNNING after the launcher exits died without a word (killed, crashed), and the
error names it and its log.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.core import console
from pipeline.core.process_layout import world as world
from pipeline.core.supervise import exit_status

ROOT = Path(__file__).resolve().parents[2]
STATUS = "status.{}.json"
# a rank whose log shows one of these lost a peer (victim, not cause); a killed peer's socket can also stay silent
# until gloo's timeout (CI, 2026-12-01: rank 0 aborted on gloo::TimeoutException pair_rank = 1 after rank 1 was killed)
PEER_LOST = ("gloo::IoException", "gloo::TimeoutException", "Connection reset by peer", "Connection closed by peer",
             "Broken pipe")
# Paddle's signal handler's record of a SIGTERM: the launcher stops the surviving ranks with it once one died,
# and under load that can land before the survivor notices the lost peer (so no PEER_LOST line): stopped, not a cause
STOPPED = "*** SIGTERM"
CRASH = ("terminate called after throwing", "C++ Traceback", "Error Message Summary")


# ---------------------------------------------------------------- the parent (a Runner with a multi-process layout)

def log_dir_of(cfg, layout) -> Path:
    """Worker logs; one folder per node when several nodes share a file system."""
    base = cfg.run_dir / "log"
    return base / f"node{layout.node_rank}" if layout.nnodes > 1 else base


def _child_env(layout) -> dict:
    from pipeline.core import env

    child = dict(os.environ)
    passed = {}
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        child[key] = passed[key] = str(layout.threads)
    why = {"OMP_NUM_THREADS": f"layout: {layout.describe()}", "MKL_NUM_THREADS": f"layout: {layout.describe()}"}
    if "OMP_WAIT_POLICY" in env.APPLIED_TUNING or "OMP_WAIT_POLICY" not in os.environ:
        # the parent probed for its own thread count; decide again for the ranks' threads
        child.pop("OMP_WAIT_POLICY", None)
        policy, why["OMP_WAIT_POLICY"] = env.choose_wait_policy(
            layout.threads, os.environ.get(env.WAIT_SWITCH, "auto").lower(),
            env.busy_cores() if layout.threads > 1 else None, demand=layout.threads * layout.nproc)
        if policy:
            child["OMP_WAIT_POLICY"] = passed["OMP_WAIT_POLICY"] = policy
    child[env.LAUNCHER_MARK] = ",".join({**env.APPLIED_TUNING, **passed})
    child.pop(env.TUNED_MARK, None)
    child["PIPELINE_TUNING_WHY"] = json.dumps({**env.TUNING_WHY, **why})
    child["PIPELINE_LAYOUT_REASON"] = layout.reason
    child["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    child["PYTHONUNBUFFERED"] = "1"
    child.setdefault("GLOG_minloglevel", "1")        # hide gloo's per-connection INFO lines; warnings stay
    return child


def _follow(path: Path, pos: int, out) -> int:
    """Copy what was appended to `path` since `pos` to `out`; return the new position (-1 once the rank
    crashed: Paddle's C++ crash report stays in the log file, the diagnosis follows on the console)."""
    if pos < 0:
        return pos
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return pos
    cut = min((i for i in (data.find(m.encode()) for m in CRASH) if i >= 0), default=-1)
    if data:
        out.write(data if cut < 0 else data[:cut] + f"[rank crashed: details in {path}]\n".encode())
        out.flush()
    return pos + len(data) if cut < 0 else -1


def _last_line(path: Path) -> str:
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _launch_cmd(layout, log_dir: Path, cfg_file: Path, force: bool) -> list[str]:
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(layout.nproc),
           "--log_dir", str(log_dir), "--max_restart", "0"]
    if layout.nnodes > 1:
        cmd += ["--nnodes", str(layout.nnodes), "--master", str(layout.master), "--rank", str(layout.node_rank),
                "--job_id", "pipeline-train"]
    if layout.device == "gpu":
        cmd += ["--devices", ",".join(str(i) for i in range(layout.nproc))]
    # the rank's script sits above `stages` (it registers them), then runs rank_worker._worker
    cmd += [str(Path(__file__).resolve().parents[1] / "cli_rank.py"), "-c", str(cfg_file)]
    return cmd + (["--force"] if force else [])


def read_statuses(log_dir: Path, nproc: int) -> dict[int, dict | None]:
    out = {}
    for i in range(nproc):
        try:
            out[i] = json.loads((log_dir / STATUS.format(i)).read_text())
        except (OSError, json.JSONDecodeError):
            out[i] = None
    return out


def launch_stage(cfg, stage: str, layout, force: bool) -> dict | None:
    """Start the ranks, stream rank 0's log, wait. Returns rank 0's status (None on a node other than
    node 0: its rank 0 writes the outputs); raises PipelineError naming the rank that failed."""
    from pipeline.core.config import save_resolved
    from pipeline.core.errors import PipelineError

    log_dir = log_dir_of(cfg, layout)
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in [*log_dir.glob("workerlog.*"), *log_dir.glob("status.*.json"), *log_dir.glob("envlog.*")]:
        old.unlink(missing_ok=True)
    cfg_file = log_dir / "config.launch.yaml"
    save_resolved(cfg, cfg_file)          # every rank reads exactly the config this parent resolved
    where = f" (this is node {layout.node_rank}, master {layout.master})" if layout.nnodes > 1 else ""
    print(f"[{stage}] launching {layout.describe()}{where} ({layout.reason}); logs: {log_dir}/workerlog.0.."
          f"{layout.nproc - 1}, launcher: {log_dir}/launch.log", file=console.stream(), flush=True)
    worker0, pos, out = log_dir / "workerlog.0", 0, console.binary_stream()    # rank 0's lines: the console
    with open(log_dir / "launch.log", "wb") as launcher_log:
        proc = subprocess.Popen(_launch_cmd(layout, log_dir, cfg_file, force), stdout=launcher_log,
                                stderr=subprocess.STDOUT, cwd=ROOT, env=_child_env(layout))
        try:
            while proc.poll() is None:
                pos = _follow(worker0, pos, out)
                time.sleep(0.2)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)           # the launcher stops its ranks
            proc.wait(timeout=60)
            raise
    _follow(worker0, pos, out)
    statuses = read_statuses(log_dir, layout.nproc)
    finished = all(s is not None and s["status"] not in ("RUNNING", "TERMINATED") for s in statuses.values())
    if proc.returncode == 0 and finished:
        return statuses[0] if not layout.node_rank else None
    if statuses[0] is not None and statuses[0]["status"] not in ("RUNNING", "TERMINATED", "PEER_LOST") \
            and statuses[0].get("error") and not layout.node_rank:
        return statuses[0]        # rank 0 failed on its own (gate, bad data...) and said why: its error
    raise PipelineError(*diagnose(log_dir, layout, statuses, proc.returncode))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def diagnose(log_dir: Path, layout, statuses: dict, returncode: int) -> tuple[str, str]:
    """(message, hint) naming the rank that failed first and its log.

    The launcher names the lowest failed rank, not the first one, so the ranks' own records decide: a rank
    whose status file still says RUNNING died without a word; if its log shows it lost a peer (gloo
    aborts the process when a peer's socket closes) or that the launcher stopped it (STOPPED), it is a victim,
    not the cause, unless every silent rank was one."""
    logs = {i: log_dir / f"workerlog.{i}" for i in statuses}
    silent = [i for i, s in statuses.items() if s is None or s["status"] == "RUNNING"]
    text = {i: _read(logs[i]) for i in silent}
    victims = {i for i in silent if any(m in text[i] for m in (*PEER_LOST, STOPPED))}
    if victims and not set(silent) - victims:      # all stopped or cut off: the ones that only lost a peer are victims
        victims = {i for i in silent if any(m in text[i] for m in PEER_LOST)}
    spoke = [i for i, s in statuses.items() if s is not None and s["status"] not in ("RUNNING", "TERMINATED", "PEER_LOST")
             and s.get("error")]
    codes = {int(m[0]): int(m[1]) for m in re.findall(r"Container rank (\d+) status failed cmd .*? code (-?\d+)",
                                                      _read(log_dir / "launch.log"))}
    culprits = [i for i in silent if i not in victims] or spoke
    rank_of = lambda i: (layout.node_rank or 0) * layout.nproc + i
    if culprits:
        local = culprits[0]
        code = codes.get(local)
        how = (f"failed: {statuses[local].get('error')}" if local in spoke else
               f"died without reporting (exit code {code}{_signal_name(code)})" if code is not None else
               "died without reporting (killed, e.g. SIGKILL or out of memory, or crashed)")
        last = _last_line(logs[local]) if local not in spoke else ""
        msg = f"distributed training: rank {rank_of(local)} {how}; its log: {logs[local]}" + \
            (f" (last line: {last})" if last else "")
    else:                         # every local rank lost a peer: the cause is on another node
        local = min(statuses)
        msg = (f"distributed training: rank {rank_of(local)} lost its connection to a peer (a rank on another node "
               f"died or was stopped); its log: {logs[local]}")
    others = [str(logs[i]) for i in statuses if i != local]
    run_dir = log_dir.parent.parent if layout.nnodes > 1 else log_dir.parent
    hint = (f"all ranks stopped (launcher exit code {returncode}); the last good checkpoint is kept in "
            f"{run_dir / '.work' / 'train' / 'checkpoint'} and the next run resumes from it; other logs: "
            f"{', '.join(others) or 'none'}, {log_dir}/launch.log")
    return msg, hint


def _signal_name(code: int | None) -> str:
    return f", {exit_status(code)}" if code is not None and code < 0 else ""


def launch(args) -> int:
    """`python -m pipeline launch --nproc N`: `run train` with an explicit layout (kept for old command lines)."""
    from pipeline.core.session import load as _load, run_stages
    from pipeline.core.process_layout import plan

    cfg = _load(args)                     # bad config: one line, before any process starts
    layout = plan(cfg, nproc=args.nproc, nnodes=args.nnodes, master=args.master, node_rank=args.node_rank)
    return run_stages(cfg, ["train"], force=args.force, layout=layout, summary_json=args.summary_json)[1]
