"""Run a pipeline command in a child process so that a kernel kill (out of memory) still gets a clear line.

A process killed with SIGKILL cannot say anything; `make` then prints only "Killed". The CLI entry point
re-runs itself as a child, watches its memory, and when the child dies by a signal names the stage that
was running (the runner writes it to PIPELINE_STAGE_MARKER) and the memory it had reached.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from pipeline.core.resources import rss_mb

SUPERVISED = "PIPELINE_SUPERVISED"
MARKER = "PIPELINE_STAGE_MARKER"
COMMANDS = ("run", "nightly", "launch")        # the ones that run stages (and can use gigabytes)


def exit_status(code: int) -> str:
    """A child's return code in words: `exit code 1`, or the signal that killed it (`SIGSEGV`; a negative code)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:  # real-time signals have no enum name
        return f"signal {-code}"


def mark_stage(stage: str) -> None:
    """Called by the runner when a stage starts: the supervisor reads it if the process is killed."""
    path = os.environ.get(MARKER)
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"stage": stage, "pid": os.getpid(), "started": time.time()}, f)
        except OSError:
            pass                                # best effort: a report aid, never a reason to fail a run


def _stage_of(path: str) -> str | None:
    try:
        with open(path) as f:
            return json.load(f).get("stage")
    except (OSError, ValueError):
        return None


def wanted(argv: list[str]) -> bool:
    return (os.environ.get(SUPERVISED) != "1" and sys.platform.startswith("linux")
            and bool(argv) and argv[0] in COMMANDS)


def run_supervised(argv: list[str], cmd: list[str] | None = None) -> int:
    """The child's exit code; a death by signal becomes one line naming the stage, and 128 + signal.
    cmd: what to run instead of `python -m pipeline argv` (tests)."""
    fd, marker = tempfile.mkstemp(prefix="pipeline-stage-", suffix=".json")
    os.close(fd)
    env = {**os.environ, SUPERVISED: "1", MARKER: marker}
    child = subprocess.Popen(cmd or [sys.executable, "-m", "pipeline", *argv], env=env)
    interrupted = []
    previous = (signal.signal(signal.SIGINT, lambda *_: interrupted.append(1)),   # Ctrl-C reaches the child too
                signal.signal(signal.SIGTERM, lambda *_: child.terminate()))
    peak = 0.0
    try:
        while child.poll() is None:
            peak = max(peak, rss_mb(child.pid) or 0.0)
            time.sleep(0.25)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        stage = _stage_of(marker)
        os.unlink(marker)
    code = child.returncode
    if code >= 0:
        return code
    sig = signal.Signals(-code)
    if sig == signal.SIGINT or interrupted:      # a crash while stopping is the stop, not a memory problem
        if sig != signal.SIGINT:
            print(f"interrupted: the child stopped with {sig.name}; finished stage outputs are intact; re-run to "
                  "resume", file=sys.stderr)
        return 130
    where = f"the {stage} stage" if stage else "the command"
    why = "the kernel killed it, most likely out of memory" if sig == signal.SIGKILL else f"it died of {sig.name}"
    print(f"error: {where} was killed ({sig.name}: {why}; its memory reached {peak / 1024:.1f} GB) "
          f"(hint: lower the batch sizes of that stage, or free memory; finished stages are intact)", file=sys.stderr)
    return 128 + int(sig)
