"""Machine facts: versions, devices, capabilities, and the CPU tuning applied before Paddle loads.

`apply_cpu_tuning()` runs from `pipeline/__init__` — it must happen before `import paddle`,
because MKL reads its environment once at load time.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from functools import lru_cache

APPLIED_TUNING: dict[str, str] = {}


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    """CPU flags as the product sees them (pipeline/capabilities.py owns the detection)."""
    from . import capabilities as caps
    return set(caps.cpu_flags())


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def apply_cpu_tuning() -> dict[str, str]:
    """Set env defaults that make Paddle's bundled MKL fast here; never override the user's choice.

    - MKL_DEBUG_CPU_TYPE=5: MKL takes a slow generic path on AMD CPUs; 5 selects the AVX2 path
      (paddle.matmul ~18 → ~61 GFLOP/s measured on these machines).
    - OMP/MKL threads = available cores: Paddle's CPU kernels default to one thread.
    - OMP_WAIT_POLICY=PASSIVE: spinning idle threads steal the other core from everything else.
    """
    wanted = {"OMP_NUM_THREADS": str(cpu_count()), "MKL_NUM_THREADS": str(cpu_count())}
    if cpu_vendor() == "AuthenticAMD":
        wanted["MKL_DEBUG_CPU_TYPE"] = "5"
    if cpu_count() > 1:
        # idle OpenMP threads otherwise spin: on a shared 2-core box that cost 20-45 % (measured)
        wanted["OMP_WAIT_POLICY"] = "PASSIVE"
    if os.environ.get("PIPELINE_NO_TUNING") == "1":   # benchmarks measure the untuned baseline
        return {}
    for key, value in wanted.items():
        if key not in os.environ:
            os.environ[key] = value
            APPLIED_TUNING[key] = value
    return dict(APPLIED_TUNING)


@lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("paddlepaddle", "paddlepaddle-gpu", "paddlelite", "paddleslim", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    from . import __version__
    out["pipeline"] = __version__
    return out


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if res.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
            return res.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def capabilities() -> dict:
    """GPU facts (gpu, fp16, bf16, ...): see pipeline/capabilities.py, which also owns CPU flags."""
    from . import capabilities as caps
    return caps.gpu()


def hardware() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    from . import capabilities as caps
    return {"machine": platform.machine(), "cpu": model, "cpu_vendor": cpu_vendor(), "cores": cpu_count(),
            "avx512": any(f.startswith("avx512") for f in cpu_flags()), "system": platform.system(),
            "capabilities": caps.describe(), "argv0": os.path.basename(sys.argv[0])}


def import_paddle_quietly():
    """Import paddle once with its import-time chatter (OMP_NUM_THREADS banner, warnings) silenced."""
    import contextlib
    import io
    import warnings

    with contextlib.redirect_stderr(io.StringIO()):
        import paddle
    # BatchNorm in train mode always tracks global stats; Paddle warns about it on every call
    warnings.filterwarnings("ignore", message="When training, we now always track")
    warnings.filterwarnings("ignore", category=UserWarning, module="paddle.amp")
    return paddle
