"""Put PaddleSlim's int8 conv weights on the grid oneDNN really runs them on.

On a CPU without VNNI (AVX2, AVX-512 without avx512_vnni) oneDNN runs an int8 convolution whose input is signed
(s8) with its weights scaled by 0.5 (oneDNN's `scale_adjust`: u8 x s8 products are summed in pairs into int16 by
vpmaddubsw, and halving the weights keeps that sum from saturating). Paddle Inference hands oneDNN the fake-quant
program's weights dequantized to fp32 with the per-channel scale 127 / max|W|, so oneDNN rounds every weight a
second time, to W * 63.5 / max|W|: each odd 8-bit value of PaddleSlim becomes a tie, settled by float noise, so
whole channels shrink or grow together. Measured on PP-OCRv4 rec (128 lines, fp32 seq_accuracy 0.711): the
fake-quant program keeps 0.719 in fp32; with the weights oneDNN derives (63.5 levels, rounded from PaddleSlim's
8-bit values) it falls to 0.578, and Paddle's oneDNN int8 row to 0.445; the same program with the weights rounded
once, from fp32, onto oneDNN's 63.5-level grid keeps 0.734. Hence this repair: every quantized conv's weights
are re-rounded from the fp32 model onto that grid (even values of PaddleSlim's int8 scale, the channel's largest
weight staying at +-127), so oneDNN's own rounding is exact on every CPU: on VNNI CPUs (no adjustment)
127/max|W| maps them onto exact even integers, without VNNI 63.5/max|W| onto exact integers; only each channel's
largest weight (63.5) is still rounded there. The fake-quant program then computes what oneDNN computes, so the
sensitivity search and the simulated check see the engine's numbers. Cost: one bit of weight resolution.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import paddle

LEVELS = 63.5                  # 127 x oneDNN's 0.5 weight scale_adjust for s8 inputs without VNNI
CONV_TYPES = ("conv2d", "depthwise_conv2d")


def snap(w: np.ndarray, levels: float = LEVELS) -> np.ndarray:
    """fp32 weights [out, ...] -> values on PaddleSlim's 8-bit scale (127 = the channel's max|w|) that are
    2 x round(w * levels / max|w|): even integers, the channel's largest weight(s) at +-127, all-zero channels 0."""
    w = np.asarray(w, dtype=np.float64)
    m = np.abs(w).reshape(len(w), -1).max(axis=1).reshape(-1, *([1] * (w.ndim - 1)))
    with np.errstate(invalid="ignore", divide="ignore"):
        k = np.where(m > 0, np.clip(np.round(w * levels / np.where(m > 0, m, 1)), -63, 63), 0.0)
    out = k * (127.0 / levels)
    out = np.where((m > 0) & (np.abs(w) == m), np.sign(w) * 127.0, out)
    return out.astype(np.float32)


def _channel_scales(block, weight: str) -> list[str]:
    """Scale var names of the channel-wise dequantize op after the conv reading `weight` ([] if none)."""
    conv_out = [a for op in block.ops if op.type in CONV_TYPES and weight in op.input_arg_names
                for a in op.output_arg_names]
    return [op.input("Scales")[0] for op in block.ops
            if op.type == "fake_channel_wise_dequantize_max_abs" and set(op.input("X")) & set(conv_out)]


def snap_conv_weights(quant_prefix: str | os.PathLike, fp32_prefix: str | os.PathLike) -> list[str]:
    """Rewrite quant_prefix.pdiparams in place: each channel-wise quantized conv gets snap(its fp32 weights),
    when PaddleSlim's channel scales are the fp32 weights' max|w| (abs_max channel-wise; anything else is left
    alone). The .pdmodel is untouched. Returns the weight names rewritten."""
    paddle.enable_static()
    try:
        ref = paddle.static.Scope()
        with paddle.static.scope_guard(ref):
            paddle.static.load_inference_model(str(fp32_prefix), paddle.static.Executor(paddle.CPUPlace()))
        scope, done = paddle.static.Scope(), []
        with paddle.static.scope_guard(scope):
            exe = paddle.static.Executor(paddle.CPUPlace())
            prog, feeds, fetches = paddle.static.load_inference_model(str(quant_prefix), exe)
            block = prog.global_block()
            weights = {a for op in block.ops if op.type in CONV_TYPES for a in op.input("Filter")}
            for name in sorted(weights):
                scales = _channel_scales(block, name)
                if not scales or ref.find_var(name) is None:
                    continue
                w = np.array(ref.find_var(name).get_tensor())
                cs = np.array(scope.find_var(scales[0]).get_tensor()).ravel()
                if cs.shape[0] != w.shape[0] or not np.allclose(cs, np.abs(w).reshape(len(w), -1).max(1), rtol=1e-5):
                    continue
                scope.find_var(name).get_tensor().set(snap(w), paddle.CPUPlace())
                done.append(name)
            if done:
                data = paddle.static.serialize_persistables([block.var(feeds[0])], fetches, exe, program=prog)
                tmp = Path(f"{quant_prefix}.pdiparams.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, f"{quant_prefix}.pdiparams")
    finally:
        paddle.disable_static()
    return done
