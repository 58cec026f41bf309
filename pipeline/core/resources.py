"""Per-stage peak memory (Linux): the kernel's high-water mark of this process, reset at each stage start.

Stages run one after another in one process, so `ru_maxrss` alone would report the largest stage for every
later one; writing 5 to /proc/self/clear_refs resets VmHWM (Linux >= 4.0), which makes the peak per stage.
Subprocesses report their own high-water mark (note_child: Lite opt and run children): RUSAGE_CHILDREN cannot be
used, a child's ru_maxrss starts at its parent's size when it was spawned (Linux carries the forked memory's
high-water mark across exec), so every Lite child of a 5.5 GB stage read 5.5 GB (issue 48).
A stage's rows may take their own peaks (row_peak_mb); the stage's peak stays the largest of them.
Before a stage starts, the memory earlier stages freed is given back to the kernel (release_memory), so a stage
neither carries nor is charged for its predecessors' freed heap.
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


def release_memory() -> float | None:
    """Collect garbage, then hand glibc's free heap back to the kernel (malloc_trim); -> RSS after, in MB.
    Paddle's CPU tensors come from malloc, and glibc keeps freed chunks: `train export deploy` in one process
    (PP-OCRv4 rec fine-tune, 2026-12-01) carried 3.9 GB of it into the server stage (0.6 GB live after
    gc + trim), whose peak then read 7.15 GB. Without glibc (macOS, musl) only the collection happens."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):       # not glibc: nothing to trim
            pass
    return rss_mb()


class HeapGuard:
    """Calls release_memory() whenever the process grew by `step_mb` since the last release: a training loop whose
    steps free and re-allocate large, unevenly sized tensors fragments glibc's heap. Measured on the PP-OCRv4 rec
    fine-tune (batch 16 of 48x320 lines): RSS climbed 1.4 -> 3.0 -> 4.4 GB over three steps (the train stage peaked at
    6.3-7.7 GB) while ~0.45 GB was live; released after each step it peaked at 2.1 GB. A small model never grows
    that much, so it never pays for a release (reading VmRSS costs microseconds)."""

    def __init__(self, step_mb: float = 512.0):
        self.step_mb = step_mb
        self.mark = rss_mb() or 0.0

    def __call__(self) -> None:
        now = rss_mb()
        if now is not None and now - self.mark >= self.step_mb:
            self.mark = release_memory() or now


_STAGE = {"peak_mb": 0.0, "child_mb": 0.0}     # since reset_peak(): peaks taken by row_peak_mb, children noted


def _clear_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def reset_peak() -> bool:
    """Start a new high-water mark; False where the kernel does not offer it (then the peak is process-wide)."""
    _STAGE.update(peak_mb=0.0, child_mb=0.0)
    return _clear_hwm()


def hwm_mb(pid: int | str = "self") -> float | None:
    """A live process's high-water mark of RSS (VmHWM), MB; None once it has exited or off Linux."""
    kb = _status_kb("VmHWM", str(pid))
    return None if kb is None else round(kb / 1024, 1)


def row_peak_mb() -> float | None:
    """The peak since the last row_peak_mb (or reset_peak), then a new mark for the next row; the stage's peak
    keeps the largest. None where the kernel keeps no high-water mark."""
    peak = hwm_mb()
    if peak is not None and _clear_hwm():
        _STAGE["peak_mb"] = max(_STAGE["peak_mb"], peak)
    return peak


def stage_peak_mb() -> float | None:
    """This process's peak since reset_peak(), rows' peaks included."""
    now = hwm_mb()
    return None if now is None else max(now, _STAGE["peak_mb"])


def note_child(peak_mb: float | None) -> None:
    """A child process's own high-water mark (read from its /proc status before it exits)."""
    if peak_mb is not None:
        _STAGE["child_mb"] = max(_STAGE["child_mb"], float(peak_mb))


def rss_mb(pid: int | str = "self") -> float | None:
    kb = _status_kb("VmRSS", str(pid))
    return None if kb is None else round(kb / 1024, 1)


def peak_record(reset_ok: bool) -> dict:
    """For the stage manifest: this process's peak since reset_peak(), and the largest child that reported its own
    (None: no child did)."""
    hwm = stage_peak_mb()
    self_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024       # ru_maxrss: bytes on macOS, kB on Linux
    peak = hwm if hwm is not None and reset_ok else self_max / scale
    return {"peak_rss_mb": round(peak, 1), "peak_is_per_stage": bool(reset_ok and hwm is not None),
            "largest_child_rss_mb": round(_STAGE["child_mb"], 1) or None}
