"""Kill a child process with SIGKILL at a moment it announces: the resume tests' "kill -9 mid-run"."""
from __future__ import annotations

import signal
import subprocess
import threading


def kill_at_marker(cmd: list[str], cwd, marker: str = "HOLDING", timeout_s: float = 300) -> tuple[bool, int]:
    """Start cmd, SIGKILL it when a line of its stderr holds `marker` -> (marker seen, return code)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(timeout_s, proc.kill)          # a hung child must not hang the suite
    watchdog.start()
    held = False
    try:
        for line in proc.stderr:                              # blocks until the child reports (or dies)
            if marker in line:
                held = True
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        proc.stderr.close()
    return held, proc.returncode
