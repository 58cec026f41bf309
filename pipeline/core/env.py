"""Machine facts: versions, devices, capabilities, and the CPU tuning applied before Paddle loads.

`apply_cpu_tuning()` runs from `pipeline/__init__` — it must happen before `import paddle`,
because MKL reads its environment once at load time.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
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
    """CPU flags as the product sees them (pipeline/core/capabilities.py owns the detection)."""
    from pipeline.core import capabilities as caps
    return set(caps.cpu_flags())


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


TUNING_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE", "OMP_WAIT_POLICY")
TUNING_WHY: dict[str, str] = {}       # var → why the pipeline chose its value (recorded in manifests)
WAIT_SWITCH = "PIPELINE_OMP_WAIT"     # auto (probe) | active | passive; OMP_WAIT_POLICY itself always wins
TUNED_MARK = "PIPELINE_TUNED_VARS"    # var=value this process set by default (children decide those again)
LAUNCHER_MARK = "PIPELINE_TUNING_FROM"   # vars a launcher set on purpose for its ranks (kept)


_PROBED: list[float | None] = []


def probed_busy() -> float | None:
    """busy_cores(), measured once per process (the import-time probe, or now)."""
    if not _PROBED:
        _PROBED.append(busy_cores())
    return _PROBED[0]


def busy_cores(seconds: float = 0.1) -> float | None:
    """Cores kept busy by other processes, sampled from /proc/stat (this process sleeps meanwhile)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)       # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 0.0 if t1 == t0 else (1 - (i1 - i0) / (t1 - t0)) * cpu_count()


def choose_wait_policy(threads: int, switch: str, busy: float | None, demand: int | None = None
                       ) -> tuple[str | None, str]:
    """OpenMP wait policy by measurement. Spinning between parallel regions is what makes a thread team
    fast on a quiet machine (PASSIVE cost 1.8x there); on a busy one the spinning threads fight other
    processes for the cores and PASSIVE was 1.6x faster (make bench-train measures both).
    `demand`: threads of all our processes together (default `threads`)."""
    if threads <= 1:
        return None, "one thread per process: no OpenMP team waits, the policy does not matter"
    if switch in ("active", "passive"):
        return switch.upper(), f"{WAIT_SWITCH}={switch}"
    if busy is None:
        return None, "no /proc/stat to probe: OpenMP default"
    idle = cpu_count() - busy
    if idle >= (demand or threads) - 0.5:
        return "ACTIVE", f"probe: other processes kept {busy:.1f} of {cpu_count()} cores busy (quiet): threads spin"
    return "PASSIVE", f"probe: other processes kept {busy:.1f} of {cpu_count()} cores busy: idle threads sleep"


def apply_cpu_tuning() -> dict[str, str]:
    """Set env defaults that make Paddle's bundled MKL/OpenMP fast here; never override the user's choice.

    - MKL_DEBUG_CPU_TYPE=5: MKL takes a slow generic path on AMD CPUs; 5 selects the AVX2 path
      (paddle.matmul ~18 → ~61 GFLOP/s measured on these machines).
    - OMP/MKL threads = available cores: Paddle's CPU kernels default to one thread.
    - OMP_WAIT_POLICY by a short load probe (choose_wait_policy) when paddle is about to load
      (settle_wait_policy), or PIPELINE_OMP_WAIT=active|passive.
    Child processes decide again (a launcher passes its per-process choices itself).
    """
    if os.environ.get("PIPELINE_NO_TUNING") == "1":   # benchmarks measure the untuned baseline
        return {}
    launcher = set(os.environ.get(LAUNCHER_MARK, "").split(","))
    for item in filter(None, os.environ.get(TUNED_MARK, "").split(",")):
        key, _, value = item.partition("=")
        if key not in launcher and os.environ.get(key) == value:
            os.environ.pop(key, None)     # an ancestor pipeline process's default, not the user's choice: decide here
    wanted = {"OMP_NUM_THREADS": str(cpu_count()), "MKL_NUM_THREADS": str(cpu_count())}
    why = {"OMP_NUM_THREADS": "threads = available cores", "MKL_NUM_THREADS": "threads = available cores"}
    if cpu_vendor() == "AuthenticAMD":
        wanted["MKL_DEBUG_CPU_TYPE"] = "5"
        why["MKL_DEBUG_CPU_TYPE"] = "AMD CPU: MKL's AVX2 path instead of its generic one"
    for key, value in wanted.items():
        if key not in os.environ:
            os.environ[key] = value
            APPLIED_TUNING[key] = value
            TUNING_WHY[key] = why[key]
    _mark()
    if os.environ.get(WAIT_SWITCH, "auto").lower() in ("active", "passive"):
        settle_wait_policy()          # no probe needed: decide now
    return dict(APPLIED_TUNING)


def _mark() -> None:
    os.environ[TUNED_MARK] = ",".join(f"{k}={v}" for k, v in APPLIED_TUNING.items())


NO_TRAINING_WHY = ("no training in this process: its engines (ONNX Runtime, OpenVINO) and Paddle Lite children "
                   "need the cores Paddle's spinning OpenMP threads would take (an x86 Lite run of the v4 rec: 17.3 s "
                   "PASSIVE vs 21.0 s ACTIVE, with 19 s of the parent's CPU spent spinning)")


def settle_wait_policy(trains: bool = True) -> None:
    """Choose OMP_WAIT_POLICY just before paddle loads (import_paddle_quietly calls this): the probe costs
    0.1 s, so processes that never load paddle through the pipeline's entry points do not pay it.
    `trains=False` (the process runs no training: deploy stages, imports): PASSIVE without a probe. ACTIVE pays
    when one Paddle thread team runs back to back (training); Intel OpenMP then never sleeps, so in a process that
    also runs other runtimes or waits on Lite children the idle team keeps spinning on their cores."""
    if "OMP_WAIT_POLICY" in os.environ or "OMP_WAIT_POLICY" in TUNING_WHY or "paddle" in sys.modules \
            or os.environ.get("PIPELINE_NO_TUNING") == "1":
        return
    threads = os.environ.get("OMP_NUM_THREADS", str(cpu_count()))
    switch = os.environ.get(WAIT_SWITCH, "auto").lower()
    if not trains and switch not in ("active", "passive"):
        os.environ["OMP_WAIT_POLICY"] = APPLIED_TUNING["OMP_WAIT_POLICY"] = "PASSIVE"
        TUNING_WHY["OMP_WAIT_POLICY"] = NO_TRAINING_WHY
        _mark()
        return
    needs_probe = switch not in ("active", "passive") and threads.isdigit() and int(threads) > 1
    policy, TUNING_WHY["OMP_WAIT_POLICY"] = choose_wait_policy(int(threads) if threads.isdigit() else 1, switch,
                                                               probed_busy() if needs_probe else None)
    if policy:
        os.environ["OMP_WAIT_POLICY"] = APPLIED_TUNING["OMP_WAIT_POLICY"] = policy
        _mark()


def tuning_record() -> dict:
    """The CPU tuning in effect in this process, for manifests: each variable's value and who set it."""
    inherited = os.environ.get(LAUNCHER_MARK)          # what a launcher set for its ranks
    rec = {k: os.environ.get(k) for k in TUNING_VARS}
    rec["set_by"] = {k: ("pipeline" if k in APPLIED_TUNING else "pipeline (launcher)" if inherited and k in inherited.split(",")
                         else "user") for k in TUNING_VARS if os.environ.get(k) is not None}
    rec["why"] = dict(TUNING_WHY)
    if os.environ.get("PIPELINE_TUNING_WHY"):
        import json
        rec["why"] = {**json.loads(os.environ["PIPELINE_TUNING_WHY"]), **rec["why"]}
    return rec


@lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("paddlepaddle", "paddlepaddle-gpu", "paddlelite", "paddleslim", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    from pipeline.core.version import __version__
    out["pipeline"] = __version__
    return out


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if res.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
            return res.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def capabilities() -> dict:
    """GPU facts (gpu, fp16, bf16, ...): see pipeline/core/capabilities.py, which also owns CPU flags."""
    from pipeline.core import capabilities as caps
    return caps.gpu()


def hardware() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    from pipeline.core import capabilities as caps
    return {"machine": platform.machine(), "cpu": model, "cpu_vendor": cpu_vendor(), "cores": cpu_count(),
            "avx512": any(f.startswith("avx512") for f in cpu_flags()), "system": platform.system(),
            "capabilities": caps.describe(), "argv0": os.path.basename(sys.argv[0])}


def import_paddle_quietly(trains: bool = True):
    """Import paddle once with its import-time chatter (OMP_NUM_THREADS banner, warnings) silenced.
    `trains`: whether this process will train (settle_wait_policy)."""
    import contextlib
    import io
    import warnings

    settle_wait_policy(trains)
    with contextlib.redirect_stderr(io.StringIO()):
        import paddle
    # BatchNorm in train mode always tracks global stats; Paddle warns about it on every call
    warnings.filterwarnings("ignore", message="When training, we now always track")
    warnings.filterwarnings("ignore", category=UserWarning, module="paddle.amp")
    return paddle
