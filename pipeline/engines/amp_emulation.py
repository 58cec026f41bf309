"""Emulate Paddle Inference's mixed-precision model (fp16 / bf16) on a CPU that has no such kernels.

What ships on a GPU (`convert_to_mixed_precision` / `enable_use_gpu(..., Half)`: Paddle 2.6's
paddle/fluid/framework/ir/auto_mixed_precision_pass.cc), applied to an fp32 program by inserting rounding
casts (cast fp32→low→fp32 has CPU kernels):
  * every op runs in low precision (its float inputs, weights and outputs rounded) unless it is on the
    pass's default black list (SetDefaultBlacklist: cast, exp, square, log, mean, sum, the cross-entropy
    ops, conv2d_transpose, reduce_sum) or on the user's black list (`keep_fp32_ops`: what
    convert_to_mixed_precision(black_list=) and Config.exp_disable_mixed_precision_ops() add to it), or has
    a `dtype`/`out_dtype` attribute other than fp32, or is a `scale` whose scale/bias overflow the low type.
    This is NOT paddle.static.amp's training list: on a GPU predictor softmax, layer_norm, sigmoid and
    interpolation run in fp16 and their outputs are rounded;
  * black-list ops compute in fp32 on their (already rounded) inputs; the next low-precision op rounds
    their output again;
  * batch_norm keeps Scale/Bias/Mean/Variance in fp32, layer_norm/instance_norm keep Scale/Bias
    (InputVarsNotConvert); integer and bookkeeping tensors are never touched;
  * batch_norm right after a convolution is folded into it, as the GPU predictor's passes do before the
    mixed-precision pass (conv_bn_fuse_pass): the convolution's raw output is never rounded, the
    normalised one is. Rounding before the normalisation would multiply the error by gamma/sigma;
  * keep_io_types: the feed stays fp32 and the fetched output is the rounded value cast back to fp32;
  * only outputs a later op reads (or the fetch) are rounded: outputs inference never fills
    (layer_norm Mean/Variance, batch_norm SavedMean/..., XShape, dropout Mask) are never touched.
Not emulated: the pass also needs a GPU low-precision kernel for the op (this CPU build has no CUDA kernel
registry to ask; common ops all have one), and GPU-only fusions (attention, fc+layer_norm) that change which
intermediates exist. Rounding is the only numerical effect emulated; the math in between runs in fp32 (GPU
fp16 kernels accumulate in fp32 as well). The result is an accuracy preview, labelled "<dtype>-emulated".
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np
import paddle

from pipeline.core.errors import PipelineError

SUFFIX = {"fp16": ".fp16emu", "bf16": ".bf16emu"}
# paddle/fluid/framework/ir/auto_mixed_precision_pass.cc SetDefaultBlacklist() (2.6): the only ops a GPU
# predictor keeps in fp32 by type (the user's mixed_black_list adds to it: server.fp16.keep_fp32_ops)
INFERENCE_BLACK = frozenset({"cast", "exp", "square", "log", "mean", "sum", "softmax_with_cross_entropy",
                             "sigmoid_cross_entropy_with_logits", "c_softmax_with_cross_entropy", "cross_entropy",
                             "cross_entropy2", "conv2d_transpose", "reduce_sum"})
# Outputs that are bookkeeping, not activations.
_SKIP_OUT_SLOTS = {"XShape", "SavedMean", "SavedVariance", "MeanOut", "VarianceOut", "ReserveSpace", "Mask",
                   "Mean", "Variance"}
# Parameters the pass keeps in fp32 when the op runs in low precision (InputVarsNotConvert).
_FP32_PARAMS = {"batch_norm": {"Scale", "Bias", "Mean", "Variance"}, "layer_norm": {"Scale", "Bias"},
                "instance_norm": {"Scale", "Bias"}}
_NON_COMPUTE = {"feed", "fetch"}
_DTYPE_ATTR_EXEMPT = {"arg_max", "arg_min"}      # their int64 `dtype` is the index type, not a precision
_LOW_MAX = {"fp16": 65504.0, "bf16": 3.38e38}
# Convolutions whose batch_norm Paddle's GPU inference folds into the weights before the AMP pass.
_FOLDS_BN = {"conv2d", "depthwise_conv2d"}


def _np_round(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)   # bf16: round to nearest even
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


class _Emulator:
    def __init__(self, block, dtype: str, black: frozenset[str] = INFERENCE_BLACK):
        vt = paddle.base.core.VarDesc.VarType
        self.block, self.dtype, self.black = block, dtype, black
        self.fp32, self.dense = vt.FP32, vt.LOD_TENSOR
        self.low = vt.FP16 if dtype == "fp16" else vt.BF16
        self.half: set[str] = set()          # vars holding low-precision values
        self.rounded: dict[str, str] = {}    # fp32 var → its rounded copy
        self.params: set[str] = set()        # persistable weights to round
        self.n_casts = 0
        self.low_ops: dict[str, int] = {}
        self.kept_ops: dict[str, int] = {}   # compute ops left in fp32 (black list, typed attributes)
        self.folded: set[str] = set()        # conv outputs only a folded batch_norm reads (never rounded)
        self.consumers: dict[str, list] = {}   # var → ops reading it (only outputs something reads are rounded)
        self.producers: dict[str, object] = {}

    def _float(self, name: str) -> bool:
        v = self.block._find_var_recursive(name)
        return v is not None and v.type == self.dense and v.dtype == self.fp32

    def _persistable(self, name: str) -> bool:
        v = self.block._find_var_recursive(name)
        return v is not None and v.persistable

    def _cast_pair(self, at: int, src: str, dst: str) -> None:
        v = self.block.var(dst if self.block.has_var(dst) else src)
        half = self.block.create_var(name=f"{dst}{SUFFIX[self.dtype]}{self.n_casts}", shape=v.shape, dtype=self.low)
        self.block._insert_op(at, type="cast", inputs={"X": [src]}, outputs={"Out": [half]},
                              attrs={"in_dtype": self.fp32, "out_dtype": self.low})
        self.block._insert_op(at + 1, type="cast", inputs={"X": [half]}, outputs={"Out": [dst]},
                              attrs={"in_dtype": self.low, "out_dtype": self.fp32})
        self.n_casts += 1

    def _runs_low(self, op) -> bool:
        """GetOpPrecision of the inference pass: low unless black-listed, typed otherwise, or out of range."""
        if op.type in self.black or op.type in _NON_COMPUTE:
            return False
        attrs = set(op.attr_names)
        for attr in ("dtype", "out_dtype"):
            if attr in attrs and op.type not in _DTYPE_ATTR_EXEMPT:
                if op.attr(attr) not in (self.fp32, -1):
                    return False
                break       # the pass checks `dtype` first, `out_dtype` only without it
        if op.type == "scale":
            return all(abs(float(op.attr(a))) <= _LOW_MAX[self.dtype] for a in ("scale", "bias") if a in attrs)
        return True

    def _round_inputs(self, i: int, op) -> int:
        """Round the op's fp32 activation inputs before it; returns how many ops were inserted."""
        inserted = 0
        for slot in op.input_names:
            for name in op.input(slot):
                if self._persistable(name):
                    if self._float(name) and slot not in _FP32_PARAMS.get(op.type, ()):
                        self.params.add(name)
                    continue
                if name in self.half or name in self.folded or not self._float(name):
                    continue
                if name not in self.rounded:
                    v = self.block.var(name)
                    self.rounded[name] = self.block.create_var(name=f"{name}.lowin{self.n_casts}", shape=v.shape,
                                                               dtype=self.fp32).name
                    self._cast_pair(i + inserted, name, self.rounded[name])
                    inserted += 2
                op._rename_input(name, self.rounded[name])
        return inserted

    def _round_outputs(self, i: int, op) -> int:
        inserted = 0
        outs = [n for slot in op.output_names if slot not in _SKIP_OUT_SLOTS for n in op.output(slot)]
        for name in dict.fromkeys(outs):
            if not self._float(name) or self._persistable(name) or name not in self.consumers or name in self.folded:
                continue
            chain = self._bn_fold_chain(name) if op.type in _FOLDS_BN else []
            if chain:
                self.folded.update(chain)    # the bias add / batch_norm reading it are the fused op's epilogue
                continue
            v = self.block.var(name)
            raw = self.block.create_var(name=f"{name}.lowraw{self.n_casts}", shape=v.shape, dtype=self.fp32)
            op._rename_output(name, raw.name)
            self._cast_pair(i + 1 + inserted, raw.name, name)
            self.half.add(name)
            inserted += 2
        return inserted

    def _only_reader(self, name: str):
        readers = self.consumers.get(name, [])
        return readers[0] if len(readers) == 1 else None

    def _constant(self, name: str) -> bool:
        """A parameter, or a parameter reshaped (jit.save writes a conv bias as reshape2(bias))."""
        if self._persistable(name):
            return True
        op = self.producers.get(name)
        return op is not None and op.type in ("reshape2", "unsqueeze2") and all(
            self._persistable(n) for n in op.input("X"))

    def _bn_fold_chain(self, conv_out: str) -> list[str]:
        """[conv_out] or [conv_out, bias_out] when a batch_norm alone reads it, directly or through a bias
        add (conv_bn_fuse_pass / conv_eltwiseadd_bn_fuse_pass); [] when nothing is folded."""
        chain, name = [conv_out], conv_out
        reader = self._only_reader(name)
        if reader is not None and reader.type == "elementwise_add" and reader.input("X") == [name] \
                and all(self._constant(n) for n in reader.input("Y")):
            name = reader.output("Out")[0]
            chain.append(name)
            reader = self._only_reader(name)
        is_bn = reader is not None and reader.type == "batch_norm" and reader.input("X") == [name]
        return chain if is_bn else []

    def _is_folded(self, op) -> bool:
        return op.type in ("batch_norm", "elementwise_add") and any(n in self.folded for n in op.input("X"))

    def run(self) -> None:
        ops = list(self.block.ops)
        for op in ops:
            for slot in op.input_names:
                for n in op.input(slot):
                    self.consumers.setdefault(n, []).append(op)
            for slot in op.output_names:
                for n in op.output(slot):
                    self.producers[n] = op
        i = 0
        while i < len(self.block.ops):
            op = self.block.ops[i]
            if not self._runs_low(op):
                if op.type not in _NON_COMPUTE:
                    self.kept_ops[op.type] = self.kept_ops.get(op.type, 0) + 1
                i += 1
                continue
            self.low_ops[op.type] = self.low_ops.get(op.type, 0) + 1
            ins = self._round_inputs(i, op)
            i += ins
            outs = self._round_outputs(i, op)
            i += 1 + outs


def make_emulated(model_prefix: str | os.PathLike, out_prefix: str | os.PathLike, dtype: str = "fp16",
                  keep_fp32_ops: Iterable[str] = ()) -> dict:
    """Write an emulated mixed-precision copy of an fp32 inference model (see the module docstring).

    keep_fp32_ops: op types added to the pass's default black list (the user's mixed_black_list).
    Feed and fetch names are unchanged. Returns what was done (op counts, casts, rounded params).
    """
    if dtype not in SUFFIX:
        raise PipelineError(f"cannot emulate {dtype!r}", hint="fp16 or bf16")
    user = frozenset(keep_fp32_ops)
    from pipeline.engines.program import program_desc as _program_desc

    desc = _program_desc(model_prefix)
    if any(s in v.name for s in SUFFIX.values() for v in desc.blocks[0].vars):
        raise PipelineError(f"{model_prefix} is already emulating low precision", hint="emulate the fp32 model")
    paddle.enable_static()
    try:
        scope, place = paddle.static.Scope(), paddle.CPUPlace()
        with paddle.static.scope_guard(scope):
            exe = paddle.static.Executor(place)
            prog, feed_names, fetch_vars = paddle.static.load_inference_model(str(model_prefix), exe)
            emu = _Emulator(prog.global_block(), dtype, INFERENCE_BLACK | user)
            emu.run()
            for name in sorted(emu.params):
                var = scope.find_var(name)
                if var is not None:
                    t = var.get_tensor()
                    t.set(_np_round(np.array(t), dtype), place)
            feed_vars = [prog.global_block().var(n) for n in feed_names]
            Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
            # Serialize the edited desc as is: save_inference_model would append another scale op
            # whose output name depends on the global unique_name counter (fetch name could drift).
            model_bytes = prog.desc.serialize_to_string()
            params_bytes = paddle.static.serialize_persistables(feed_vars, fetch_vars, exe, program=prog)
            Path(f"{out_prefix}.pdmodel").write_bytes(model_bytes)
            Path(f"{out_prefix}.pdiparams").write_bytes(params_bytes)
    finally:
        paddle.disable_static()
    present = {op.type for op in prog.global_block().ops}
    return {"label": f"{dtype}-emulated", "casts_inserted": 2 * emu.n_casts, "params_rounded": len(emu.params),
            "batch_norms_folded": sum(op.type == "batch_norm" and emu._is_folded(op) for op in prog.global_block().ops),
            "low_precision_ops": dict(sorted(emu.low_ops.items())),
            "fp32_ops_black_list": sorted(present & INFERENCE_BLACK),
            # the user's additions (server.fp16.keep_fp32_ops), and those the program does not have (no effect)
            "fp32_ops_user_black_list": sorted(user), "fp32_ops_user_absent": sorted(user - present),
            "fp32_ops_kept": dict(sorted(emu.kept_ops.items()))}
