"""Per-stage peak memory (Linux): the kernel's high-water mark of this process, reset at each stage start.

Stages run one after another in one process, so `ru_maxrss` alone would report the largest stage for every
later one; writing 5 to /proc/self/clear_refs resets VmHWM (Linux >= 4.0), which makes the peak per stage.
Subprocesses (Lite runs, launched ranks) are reported by RUSAGE_CHILDREN: the largest child so far.
"""
from __future__ import annotations

import resource
import sys


def _status_kb(field: str, pid: str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak() -> bool:
    """Start a new high-water mark; False where the kernel does not offer it (then the peak is process-wide)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb(pid: int | str = "self") -> float | None:
    kb = _status_kb("VmRSS", str(pid))
    return None if kb is None else round(kb / 1024, 1)


def peak_record(reset_ok: bool) -> dict:
    """For the stage manifest: this process's peak since reset_peak(), and the largest child process so far."""
    hwm = _status_kb("VmHWM")
    self_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024       # ru_maxrss: bytes on macOS, kB on Linux
    peak = hwm / 1024 if hwm is not None and reset_ok else self_max / scale
    return {"peak_rss_mb": round(peak, 1), "peak_is_per_stage": bool(reset_ok and hwm is not None),
            "largest_child_rss_mb": round(children / scale, 1)}
