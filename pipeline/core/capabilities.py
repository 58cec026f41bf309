"""What this host can run: CPU ISA flags (bf16, VNNI), GPU, host architecture. One module, used by the
product (server/lite/train decisions) and by the tests (which branch on it instead of assuming a machine).

Test-only override: PIPELINE_TEST_CPU_PROFILE="bf16,vnni" (comma list of PROFILES) makes this module
*report* another machine's flags. Only the report changes: oneDNN still runs on the real CPU, so the
product must prove a precision with evidence (pipeline/engines/evidence.py), never with these flags.
"""
from __future__ import annotations

import os
import platform
from functools import lru_cache

from pipeline.core.errors import ConfigError

PROFILE_ENV = "PIPELINE_TEST_CPU_PROFILE"
CPUINFO = "/proc/cpuinfo"          # tests point this at synthetic cpuinfo files (tests/cpuinfo/)
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_AVX512_BASE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})

# name -> (flags added, flags removed, gpu forced off)
PROFILES: dict[str, tuple[frozenset, frozenset, bool]] = {
    "avx2": (frozenset(), None, False),                # AVX2-only box: every avx512*/amx*/avx_vnni flag removed
    "no-bf16": (frozenset(), BF16_FLAGS, False),
    "bf16": (_AVX512_BASE | {"avx512_bf16"}, frozenset(), False),
    "vnni": (_AVX512_BASE | {"avx512_vnni", "avx_vnni"}, frozenset(), False),
    "no-vnni": (frozenset(), VNNI_FLAGS, False),
    "no-gpu": (frozenset(), frozenset(), True),
}


def real_cpu_flags() -> frozenset[str]:
    """The flags line of the host's cpuinfo (empty where there is none, e.g. macOS)."""
    return _flags_of(CPUINFO)


@lru_cache(maxsize=8)
def _flags_of(path: str) -> frozenset[str]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):       # x86 / arm spelling
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def profile() -> list[str]:
    """The simulated profile names (tests only); [] on a real run."""
    names = [p.strip() for p in os.environ.get(PROFILE_ENV, "").replace("+", ",").split(",") if p.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise ConfigError(f"{PROFILE_ENV}={os.environ[PROFILE_ENV]!r}: unknown profile '{unknown[0]}'",
                          hint=f"one or more of {', '.join(PROFILES)}, comma-separated")
    return names


def cpu_flags() -> frozenset[str]:
    flags = set(real_cpu_flags())
    for name in profile():
        add, remove, _ = PROFILES[name]
        if remove is None:
            flags = {f for f in flags if not f.startswith(("avx512", "amx")) and f != "avx_vnni"}
        else:
            flags -= remove
        flags |= add
    return frozenset(flags)


def has_bf16() -> bool:
    return bool(cpu_flags() & BF16_FLAGS)


def has_vnni() -> bool:
    return bool(cpu_flags() & VNNI_FLAGS)


def simulated(flags: frozenset[str] | set[str]) -> bool:
    """Whether any of `flags` is reported differently from the real CPU (a test profile is active)."""
    return bool((cpu_flags() ^ real_cpu_flags()) & set(flags))


def host_arch() -> str:
    """'x86' | 'arm' | the raw machine name: which Lite .nb target this host can execute."""
    machine = platform.machine().lower()
    return {"x86_64": "x86", "amd64": "x86", "i686": "x86", "aarch64": "arm", "arm64": "arm"}.get(machine, machine)


@lru_cache(maxsize=1)
def _real_gpu() -> dict:
    import paddle

    cuda = paddle.device.is_compiled_with_cuda()
    gpu = cuda and paddle.device.cuda.device_count() > 0
    caps = {"cuda_build": cuda, "gpu": gpu, "gpu_name": None, "compute_capability": None,
            "fp16": False, "bf16": False}
    if gpu:
        props = paddle.device.cuda.get_device_properties(0)
        caps.update(gpu_name=props.name, compute_capability=f"{props.major}.{props.minor}",
                    fp16=props.major >= 7 and paddle.amp.is_float16_supported(),
                    bf16=paddle.amp.is_bfloat16_supported())
    return caps


def gpu() -> dict:
    """GPU facts from Paddle (imported lazily); a 'no-gpu' profile reports none."""
    if any(PROFILES[n][2] for n in profile()):
        return {"cuda_build": _real_gpu()["cuda_build"], "gpu": False, "gpu_name": None,
                "compute_capability": None, "fp16": False, "bf16": False}
    return dict(_real_gpu())


ISA_ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN ISA caps at or above the first one with bf16 instructions (oneDNN's cpu_isa names; ALL/DEFAULT = no cap)
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")


def _isa_cap() -> str:
    """ONEDNN_MAX_CPU_ISA as oneDNN reads it (upper case; empty: no cap)."""
    return os.environ.get(ISA_ENV, "").strip().upper()


def isa_cap_without_bf16() -> str | None:
    """The ONEDNN_MAX_CPU_ISA value when it caps oneDNN below bf16 (e.g. AVX2, SSE41), else None. Paddle's oneDNN
    and OpenVINO's CPU plugin both honour it: a bf16 primitive then fails to build ("could not create a primitive
    descriptor") or OpenVINO refuses the bf16 hint, whatever the CPU's flags."""
    cap = _isa_cap()
    return cap if cap and not cap.startswith(_BF16_ISAS) else None


# what each ONEDNN_MAX_CPU_ISA cap still lets oneDNN use (its cpu_isa hierarchy; avx2_vnni is not part of
# avx512_core..avx512_core_bf16, it comes back with avx512_core_fp16's avx2_vnni_2)
_AVX2, _AVX512 = {"avx", "avx2"}, {"avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_ISA_ALLOWS = {"SSE41": set(), "AVX": {"avx"}, "AVX2": _AVX2, "AVX2_VNNI": _AVX2 | {"avx_vnni"},
               "AVX2_VNNI_2": _AVX2 | {"avx_vnni"}, "AVX512_CORE": _AVX512,
               "AVX512_CORE_VNNI": _AVX512 | {"avx512_vnni"},
               "AVX512_CORE_BF16": _AVX512 | {"avx512_vnni", "avx512_bf16"},
               "AVX512_CORE_FP16": _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni"}}
_ISA_ALLOWS["AVX512_CORE_AMX"] = _ISA_ALLOWS["AVX512_CORE_FP16"] | {"amx_bf16", "amx_int8", "amx_tile"}
_CAPPED = {f for allowed in _ISA_ALLOWS.values() for f in allowed} | BF16_FLAGS | VNNI_FLAGS
ONEDNN_ENGINES = ("paddle-inference", "openvino")      # their CPU kernels come from oneDNN (ORT's from MLAS)


def engine_flags(engine: str, flags: frozenset | None = None, cap: str | None = None) -> frozenset:
    """The CPU flags `engine`'s kernels may use here: ONEDNN_MAX_CPU_ISA caps Paddle Inference's and OpenVINO's
    (oneDNN), not ONNX Runtime's. An unknown cap name is taken as no cap (oneDNN ignores it too). cap: another
    host's recorded cap (a bundle's build) instead of this process's."""
    flags = frozenset(cpu_flags() if flags is None else flags)
    allowed = _ISA_ALLOWS.get(_isa_cap() if cap is None else cap.strip().upper())
    if engine not in ONEDNN_ENGINES or allowed is None:
        return flags
    return frozenset(f for f in flags if f not in _CAPPED or f in allowed)


def onednn_below_avx2() -> bool:
    """oneDNN runs under AVX2 here (a CPU without it, or ONEDNN_MAX_CPU_ISA=SSE41/AVX): its bf16 reorders then cannot
    be built ("could not construct a memory descriptor using strides"), so a bf16-rounding program runs without it."""
    return "avx2" not in cpu_flags() or _isa_cap() in ("SSE41", "AVX")


def bf16_cpu_status() -> tuple[bool, str]:
    """(True, why) when the CPU reports native bf16 and Paddle's oneDNN can use it.

    Under a simulated bf16 profile Paddle's own hardware check is skipped (it would veto the
    simulation); the evidence check after the run then shows what oneDNN really did."""
    native = sorted(cpu_flags() & BF16_FLAGS)
    if not native:
        return False, "CPU lacks avx512_bf16/amx_bf16; oneDNN would silently run FP32"
    import paddle

    if not paddle.base.core.is_compiled_with_mkldnn():
        return False, "this Paddle build has no oneDNN (MKLDNN); bf16 kernels unavailable"
    if simulated(BF16_FLAGS):
        return True, f"simulated CPU profile reports {'/'.join(native)} (real CPU: none); evidence decides the label"
    if isa_cap_without_bf16():
        return False, f"{ISA_ENV}={isa_cap_without_bf16()} caps oneDNN below bf16 (CPU has {'/'.join(native)})"
    if not paddle.base.core.supports_bfloat16():
        return False, f"CPU has {'/'.join(native)} but Paddle reports bf16 unsupported"
    return True, f"CPU has {'/'.join(native)} and Paddle supports bf16"


# The kernels a low precision runs with, strongest first (oneDNN, OpenVINO and ONNX Runtime pick the strongest the
# CPU has). A row's gate and its interleaved timing hold for the family it ran on: bf16 on AMX tiles vs avx512_bf16
# dot products (other speed, other accumulation order), int8 with VNNI (exact int32 dot products) vs without (u8*s8
# pair sums saturate in int16: other numbers; issue 29: ONNX Runtime int8 0.742 on AVX2, 0.633 on VNNI).
KERNEL_TIERS = {"bf16": (("amx_bf16", frozenset({"amx_bf16"})), ("avx512_bf16", frozenset({"avx512_bf16"}))),
                "int8": (("amx_int8", frozenset({"amx_int8"})), ("vnni", frozenset({"avx512_vnni", "avx_vnni"})))}


def kernel_family(precision: str, flags: frozenset | set) -> str | None:
    """The kernel family a CPU with `flags` runs `precision` on: "fp32" for fp32 (and fp16, a GPU precision),
    "no-vnni" for int8 without VNNI, None for bf16 without bf16 (it cannot run)."""
    tiers = KERNEL_TIERS.get(precision)
    if tiers is None:
        return "fp32"
    hit = next((name for name, need in tiers if set(flags) & need), None)
    return hit or (None if precision == "bf16" else "no-vnni")


def describe() -> dict:
    """For manifests: what the product believed about the host, and whether that was simulated."""
    flags = cpu_flags()
    return {"arch": host_arch(), "bf16": sorted(flags & BF16_FLAGS), "vnni": sorted(flags & VNNI_FLAGS),
            "avx512": any(f.startswith("avx512") for f in flags), "profile": profile() or None,
            "onednn_isa_cap": _isa_cap() or None}     # the rows' oneDNN kernels ran under it (serving re-applies it)


def kernel_key() -> dict:
    """The kernels this host's engines pick for each precision: what a measured row (its gate, its timing, the
    ranking it enters) holds for. Two hosts with equal keys run the same kernel families; a stage whose results
    depend on them (Stage.machine_bound) re-runs when the key changes (pipeline/core/runner.py)."""
    flags = cpu_flags()
    vector = next((n for n, f in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx")) if f in flags), "baseline")
    return {"arch": host_arch(), "vector": vector, "bf16": kernel_family("bf16", flags),
            "int8": kernel_family("int8", flags), "onednn_isa_cap": _isa_cap() or None}
