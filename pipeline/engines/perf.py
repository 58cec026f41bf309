"""Timing helpers, a matmul roofline probe, and MAC counting from a static program."""
from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Callable

import numpy as np
import paddle
from paddle import inference as pinf

from pipeline.engines.program import program_desc as _program_desc
from pipeline.core.errors import ConfigError, PipelineError

RunFn = Callable[[np.ndarray], object]


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0 or repeats < 1:
        raise ConfigError(f"need warmup >= 0 and repeats >= 1 (got {warmup}, {repeats})")


def _timed(run_fn: RunFn, x: np.ndarray, warmup: int, repeats: int) -> np.ndarray:
    for _ in range(warmup):  # first runs build oneDNN primitives / caches
        run_fn(x)
    times = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        run_fn(x)
        times[i] = time.perf_counter() - t0
    return times


def summarize_ms(times_ms) -> dict:
    """p50/p90/p99/mean of a set of timings in milliseconds (one shape for every latency we report)."""
    t = np.asarray(times_ms, dtype=np.float64)
    p50, p90, p99 = np.percentile(t, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(t.mean())}


def latency_ms(run_fn: RunFn, x: np.ndarray, warmup: int = 5, repeats: int = 50, raw: bool = False):
    """Per-call wall time of run_fn(x): p50/p90/p99/mean in milliseconds (raw=True: the list of times)."""
    _check_counts(warmup, repeats)
    t = _timed(run_fn, x, warmup, repeats) * 1e3
    return t.tolist() if raw else summarize_ms(t)


def throughput(run_fn: RunFn, x: np.ndarray, warmup: int = 2, repeats: int = 10) -> float:
    """Samples per second (len(x) / median call time); median resists scheduler hiccups."""
    _check_counts(warmup, repeats)
    return float(len(x) / np.median(_timed(run_fn, x, warmup, repeats)))


def matmul_peak_gflops(threads: int = 2, n: int = 1024, repeats: int = 10, backend: str = "onednn") -> float:
    """Best-of-repeats fp32 GFLOP/s of an n x n x n matmul run by a Paddle Inference predictor.

    A one-op inference program configured like InferenceEngine (IR optim, same threads) measures what
    the engines can reach; dygraph paddle.matmul adds eager dispatch and its own thread setting.
    backend="onednn" (default): matmul + bias is fused into `fc`, which runs oneDNN's brgemm inner
    product, the kernel family the engines' conv/fc use. backend="mkl": a bias-free matmul stays on
    MKL sgemm (what dygraph/training matmuls use); MKL is slow on AMD unless MKL_DEBUG_CPU_TYPE=5 is
    set before paddle loads (the framework does that, not this module).
    """
    if n < 16 or threads < 1 or repeats < 1 or backend not in ("onednn", "mkl"):
        raise ConfigError(f"bad probe settings n={n} threads={threads} repeats={repeats} backend={backend!r}")
    with tempfile.TemporaryDirectory(prefix="mmprobe_") as d:
        prefix = os.path.join(d, "mm")
        paddle.enable_static()
        try:
            main, start = paddle.static.Program(), paddle.static.Program()
            with paddle.static.program_guard(main, start), paddle.utils.unique_name.guard():
                x = paddle.static.data("x", [-1, n], "float32")
                y = paddle.matmul(x, paddle.create_parameter([n, n], "float32"))
                if backend == "onednn":
                    y = y + paddle.create_parameter([n], "float32", is_bias=True)
            with paddle.static.scope_guard(paddle.static.Scope()):
                exe = paddle.static.Executor(paddle.CPUPlace())
                exe.run(start)
                paddle.static.save_inference_model(prefix, [x], [y], exe, program=main)
        finally:
            paddle.disable_static()
        cfg = pinf.Config(prefix + ".pdmodel", prefix + ".pdiparams")
        cfg.disable_glog_info()
        cfg.switch_ir_optim(True)
        cfg.set_cpu_math_library_num_threads(threads)
        if backend == "onednn":
            cfg.enable_mkldnn()
        pred = pinf.create_predictor(cfg)
    inp = pred.get_input_handle("x")
    inp.reshape([n, n])
    inp.copy_from_cpu(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    t = _timed(lambda _: pred.run(), None, warmup=2, repeats=repeats)
    return float(2 * n ** 3 / t.min() / 1e9)  # bias add (n^2) is noise next to 2n^3


# -------- MACs from the ProgramDesc --------------------------------------------------------

def _shapes(desc) -> dict[str, list[int]]:
    return {v.name: list(v.type.lod_tensor.tensor.dims) for b in desc.blocks for v in b.vars
            if v.type.HasField("lod_tensor")}


def _attr(op, name: str, default):
    for a in op.attrs:
        if a.name == name:
            return {0: a.i, 1: a.f, 6: a.b}.get(a.type, default)
    return default


def program_macs(model_prefix: str | os.PathLike, batch: int = 1) -> int:
    """Multiply-accumulates of conv/matmul-like ops (bias, BN, activations, pooling not counted).

    Uses the var shapes recorded in the program; -1 is read as `batch` (dynamic spatial dims
    therefore also become `batch`: export with fixed H/W for exact numbers).
    """
    desc = _program_desc(model_prefix)
    shapes = _shapes(desc)

    def shp(op, slot: str, out: bool = False) -> list[int]:
        for v in (op.outputs if out else op.inputs):
            if v.parameter == slot and v.arguments:
                s = shapes.get(v.arguments[0])
                if s is None:
                    raise PipelineError(f"{op.type}: no shape recorded for {v.arguments[0]!r}")
                return [batch if d < 0 else d for d in s]
        raise PipelineError(f"{op.type} has no {slot!r} slot in {model_prefix}.pdmodel")

    total = 0
    for block in desc.blocks:
        for op in block.ops:
            t = op.type
            if t in ("conv2d", "depthwise_conv2d", "conv3d"):
                f = shp(op, "Filter")  # [Cout, Cin/groups, k...]
                total += math.prod(shp(op, "Output", out=True)) * math.prod(f[1:])
            elif t == "conv2d_transpose":
                f = shp(op, "Filter")  # [Cin, Cout/groups, k...]: every input pixel scatters a kernel
                total += math.prod(shp(op, "Input")) * math.prod(f[1:])
            elif t in ("mul", "fc"):
                w = shp(op, "Y" if t == "mul" else "W")
                total += math.prod(shp(op, "Out", out=True)) * w[0]
            elif t in ("matmul", "matmul_v2"):
                xs = shp(op, "X")
                trans = _attr(op, "trans_x" if t == "matmul_v2" else "transpose_X", False)
                k = xs[-2] if (trans and len(xs) > 1) else xs[-1]
                total += math.prod(shp(op, "Out", out=True)) * k
    return int(total)


def activation_bytes(model_prefix: str | os.PathLike, input_shape: list[int]) -> int:
    """Upper bound of the float activations one sample creates: every non-persistable float var of the program
    at once (memory reuse only lowers it), batch dim 1, its first other dynamic dim as the input's largest
    spatial size (a width-derived dim never exceeds the width). Sizes batches so a big model cannot run out
    of memory; PP-OCRv4 rec at 48x320: 523 MB bound vs ~31 MB measured (STACK.md), small_cnn: 0.3 MB."""
    desc = _program_desc(model_prefix)
    fill = max([d for d in input_shape[2:] if d > 0] or [1])
    total = 0
    for v in desc.blocks[0].vars:
        t = v.type.lod_tensor.tensor
        if v.persistable or not t.dims or t.data_type not in (4, 5):       # FP16 = 4, FP32 = 5
            continue
        dyn = [i for i, d in enumerate(t.dims) if d < 0 and i > 0]
        dims = [fill if dyn and i == dyn[0] else max(d, 1) for i, d in enumerate(t.dims)]
        total += math.prod(dims) * (2 if t.data_type == 4 else 4)
    return int(total)


def fit_batch(per_sample_bytes: int, budget_mb: int, wanted: int) -> int:
    """The largest batch <= wanted whose per-sample bytes stay within budget_mb (at least 1)."""
    return max(1, min(int(wanted), int(budget_mb * 2 ** 20 // max(1, per_sample_bytes))))


def batch_for(model_prefix: str | os.PathLike, input_shape: list[int], budget_mb: int, wanted: int) -> int:
    """The largest batch <= wanted whose activations stay within budget_mb (at least 1)."""
    return fit_batch(activation_bytes(model_prefix, input_shape), budget_mb, wanted)
