"""Paddle Inference engine (CPU fp32/int8, emulated fp16, guarded GPU fp16) and program helpers."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import paddle
from paddle import inference as pinf

from pipeline.core import capabilities
from pipeline.engines import evidence
from pipeline.engines.base import Engine
from pipeline.engines.program import feed_name as _feed_name
from pipeline.engines.program import files as _files
from pipeline.engines.program import program_desc as _program_desc
from pipeline.engines.program import program_input_shape
from pipeline.engines.program import program_ops as program_ops  # re-exported
from pipeline.core.errors import ConfigError, PipelineError

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
# Below AVX2 (a CPU without it, ONEDNN_MAX_CPU_ISA=SSE41 or AVX) oneDNN 3.2's fp32 convolutions have blocked kernels
# only (jit:sse41/jit:avx, nChw8c); from AVX2 up brgconv runs them in the plain nhwc layout the int8 ops use. A layer an
# int8 program keeps fp32 (server.quant.skip, or an op type PTQ leaves out) then hands its nChw8c output to the
# quantize op Paddle puts in front of the next int8 op, and Paddle 2.6.2's quantize kernel builds its int8 output
# descriptor from the input's strides (ReorderOneDNNHandler::AcquireDstMemory: memory::desc(dims, s8/u8,
# src_md.get_strides())), which no blocked layout has: oneDNN refuses it. Measured on the smoke CNN (3 convs): skipping
# conv 2 or 3 fails under SSE41 and AVX, runs under AVX2 and natively; skipping conv 1 (1 input channel: oneDNN's
# reference kernel, nhwc) runs everywhere.
_STRIDES_ERROR = "could not construct a memory descriptor using strides"
_BLOCKED_FP32_CAUSE = ("a convolution the int8 program keeps fp32 writes oneDNN's blocked nChw8c layout there, which "
                       f"Paddle 2.6.2's quantize op in front of the next int8 op cannot take ('{_STRIDES_ERROR}')")
# bf16 emulation: a bf16-emulated program rounds through cast fp32->bf16->fp32 ops. Paddle 2.6.2's own CPU cast
# truncates to bf16 (phi::dtype::bfloat16(float) keeps the upper 16 bits: 1.0076 -> 1.0, not 1.0078); oneDNN's reorder,
# like real bf16 hardware paths, rounds to nearest even. Truncation is biased toward zero (mean -2^-9 relative per
# rounding, up to 2^-7) and the bias adds up layer after layer: svtr_lcnet near chance (conformance --fast, 64 lines)
# read max|diff| 1.40 of scale 8.60 (relative RMS 0.18, argmax agreement 0.84) on Paddle's kernels, 0.276 (0.024,
# 0.98) with the casts on oneDNN, the same under ONEDNN_MAX_CPU_ISA=SSE41 and natively. Below AVX2 the whole program
# cannot run on oneDNN (a bf16 cast after an fp32 conv's blocked output: _STRIDES_ERROR), so there oneDNN takes the
# casts only (Config.set_mkldnn_op): their inputs then come from Paddle's kernels in the plain layout.
_FP16_EMU_SUFFIX = ".fp16emu"       # amp_emulation.SUFFIX
_BF16_EMU_SUFFIX = ".bf16emu"
# oneDNN int8 gets conv/pool-like ops only, on every CPU. Paddle 2.6's int8 pass computes fc's per-output-channel
# weight scales from the [in, out] weight read as [out, in] (a reshape, not a transpose): measured on the default
# model, its Scale_weights equal 127/max|W.reshape(out, in)| row by row, so most output channels are clipped or
# coarse (accuracy 0.984 -> 0.941, max relative diff 0.47, the same with oneDNN limited to SSE4.1: exact integer
# math, not saturation; numpy int8 with the right scales loses nothing). That is the 3.9-point drop seen on AMX
# and 1.2 on AVX-512: fc/matmul stay fp32 (their weights keep PaddleSlim's int8 rounding). README "Int8".
# Elementwise ops stay fp32 too: with them in oneDNN int8 PP-OCRv4 det (snapped weights, 32 pages, fp32 hmean 0.977)
# read hmean 0.857, without them 0.978; PP-OCRv4 rec seq_accuracy 0.680 (text agreement 0.78) vs 0.688 (0.82) on
# 128 lines (their learnable affine x*w+b blocks and residual adds; measured 2026-12-01, AVX2).
_INT8_SAFE_OPS = {"conv2d", "depthwise_conv2d", "fused_conv2d", "pool2d", "concat", "prior_box", "reshape2",
                  "transpose2", "fused_transpose", "slice", "nearest_interp", "nearest_interp_v2", "split"}


# ir_optim="plain": Paddle's own CPU kernels with only the passes that fold ops away (batch norm into conv, dropout)
# and runtime_context_cache_pass (each op keeps its RuntimeContext instead of rebuilding it per run). A tiny model at
# batch 1 is bound by the executor's per-op cost, which oneDNN's fused kernels raise (per-run layout transforms of
# their inputs): measured on the default CNN, CPU time per call, interleaved, 9 rounds on a loaded 2-core AVX2 host:
# 0.88x of ir_optim=false, 0.65x of all passes with oneDNN. What stays (perf, 2026-12-02, default CNN, 19 ops per
# run): about half of run() is the kernels (conv 18 %, max pool 17 %, bias add 8 %, relu 3 %), the other half the
# executor rebuilding each op's InferShape (20 %) and phi KernelContext (13 %) per run plus lookups (13 %). Paddle
# 2.6.2 has a cache for both (OperatorWithKernel::CacheImpl) that never serves a run: CheckWhetherPreparePhiData is
# compiled to "if (run_phi_kernel_ && impl_) need_prepare_phi_data_ = true", so uprobes count 19 BuildPhiKernelContext
# and 0 CacheImpl::NeedInferShape calls per run (perf: the same shares without this pass). No option or flag reaches it.
# Folding more ops does not pay here: gpu_cpu_map_matmul_v2_to_mul_pass + identity_op_clean_pass (fc with relu, no
# identity scale: 15 ops) measured the same as this list (15 interleaved rounds: p10 322 vs 318 us, min 306 vs 309):
# the ops they remove cost little next to conv/pool's attribute-heavy InferShape and kernel context.
PLAIN_PASSES = ["simplify_with_basic_ops_pass", "is_test_pass", "conv_bn_fuse_pass", "fc_fuse_pass",
                "runtime_context_cache_pass"]


# ir_optim="reference": the program op by op on oneDNN's fp32 kernels, nothing fused or folded (is_test_pass only
# switches ops to their inference form). An imported model's reference outputs and its export's load check: the
# dygraph jit.load (run_program on Paddle's own kernels) took ~1.2 s per 736x736 v4 det page; this ~0.2 s, and
# its outputs matched the dygraph ones to 7e-10 (2 pages, 2026-12-02)
REFERENCE_PASSES = ["mkldnn_placement_pass", "is_test_pass"]


def reference_engine(model_prefix, threads: int) -> "InferenceEngine":
    """The fp32 program as written, fast (REFERENCE_PASSES): what an imported model's gates are measured from."""
    return InferenceEngine(model_prefix, "fp32", threads=threads, ir_optim="reference")


def reference_outputs(model_prefix, x: np.ndarray) -> np.ndarray:
    """An imported program's fp32 outputs on x (reference_engine, all cores), in batches whose activations stay
    within 1 GB: its reference (train) and its load check (export)."""
    from pipeline.engines.perf import batch_for
    from pipeline.core.env import cpu_count

    engine = reference_engine(model_prefix, threads=cpu_count())
    return engine.run_batched(x, batch_for(model_prefix, list(x[:1].shape), 1024, 16))


def bf16_status() -> tuple[bool, str]:
    """(True, why) only when the CPU has native BF16 *and* Paddle agrees; oneDNN otherwise silently runs FP32."""
    return capabilities.bf16_cpu_status()


@contextlib.contextmanager
def _capture_stderr_fd() -> Iterator[list[str]]:
    """oneDNN int8 passes print '--- quantized N ops' from C++ to fd 2; keep it for notes/errors."""
    sys.stderr.flush()
    saved, out = os.dup(2), []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _require_gpu(what: str) -> None:
    if not (paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0):
        raise PipelineError(f"{what} needs a CUDA build of Paddle and a visible GPU "
                            f"(compiled_with_cuda={paddle.device.is_compiled_with_cuda()})",
                            hint="install paddlepaddle-gpu on a GPU machine; on CPU use make_fp16_emulated()")


def _int8_ops_done(log: str) -> dict[str, int]:
    """Op type -> count that oneDNN really quantized, from the cpu_quantize_pass printout."""
    done: dict[str, int] = {}
    for n, op in re.findall(r"quantized (\d+) (\w+) ops", re.sub(r"\x1b\[[0-9;]*m", "", log)):
        if int(n):
            done[op] = done.get(op, 0) + int(n)
    return done


def _check_options(precision: str, device: str, ir_optim) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}", hint=f"one of {', '.join(PRECISIONS)}")
    if device not in ("cpu", "gpu"):
        raise ConfigError(f"unknown device {device!r}", hint="cpu or gpu")
    if ir_optim not in (True, False, "plain", "reference"):
        raise ConfigError(f"unknown ir_optim {ir_optim!r}", hint="true, false or plain")


class InferenceEngine(Engine):
    """A paddle.inference predictor for a one-input/one-output model.

    `effective_precision` says what really runs (e.g. "fp16-emulated" on CPU); `notes` explain why.
    """

    kind = "paddle-inference"

    def __init__(self, model_prefix: str | os.PathLike, precision: str = "fp32", threads: int = 2,
                 mkldnn: bool = True, ir_optim: bool | str = True, device: str = "cpu",
                 tensorrt: bool = False, max_batch: int = 64, int8_ops: Iterable[str] | None = None,
                 keep_fp32_ops: Iterable[str] = ()) -> None:
        _check_options(precision, device, ir_optim)
        plain = ir_optim == "plain" and device == "cpu" and precision == "fp32"
        reference = ir_optim == "reference" and device == "cpu" and precision == "fp32"
        mkldnn = (mkldnn and not plain) or reference
        super().__init__()
        self.model_prefix, self.requested_precision = str(model_prefix), precision
        model, params = _files(model_prefix)
        self.input_shape = program_input_shape(model_prefix)
        self.settings = {"threads": int(threads), "mkldnn": mkldnn, "ir_optim": ir_optim, "device": device}
        self.op_precisions: dict[str, dict[str, int]] = {}   # oneDNN data type -> op counts (evidence)
        cfg = pinf.Config(model, params)
        cfg.disable_glog_info()  # GLOG_minloglevel does not silence the pass printout
        cfg.switch_ir_optim(bool(ir_optim))
        # without it every intermediate tensor keeps its own buffer: PP-OCRv4 rec needs ~2.2 GB at batch 16
        # (~0.5 GB with it; STACK.md), and the server stage was OOM-killed at 22 GB
        cfg.enable_memory_optim()
        # this pass dies with SIGILL (uncatchable) on transformer blocks (PP-OCRv4 rec's SVTR neck) on an AVX2
        # CPU here; it only fuses attention, so it is off everywhere rather than guessed per CPU
        cfg.delete_pass("self_attention_fuse_pass")
        if device == "gpu":
            self.effective_precision = self._config_gpu(cfg, precision, tensorrt, max_batch, sorted(keep_fp32_ops))
        else:
            self.effective_precision = self._config_cpu(cfg, precision, threads, mkldnn, int8_ops)
        if device == "cpu" and not self.settings["mkldnn"] and not plain:
            # Paddle 2.6 enables oneDNN in every CPU Config by default (Config().mkldnn_enabled() is True), so not
            # calling enable_mkldnn() is not enough: mkldnn=false still got the oneDNN passes and fused oneDNN
            # kernels (fused_conv2d in the optimized program of the default CNN). plain keeps the default on purpose:
            # after disable_mkldnn() create_predictor resets a custom pass list to the full CPU one, and PLAIN_PASSES
            # has no mkldnn_placement_pass, so no op of a plain predictor runs oneDNN (checked in its optimized program)
            cfg.disable_mkldnn()
        self.onednn_config = bool(cfg.mkldnn_enabled())
        if plain or reference:
            cfg.pass_builder().set_passes(PLAIN_PASSES if plain else REFERENCE_PASSES)
        log: list[str] = []
        # bf16/int8 labels need evidence: keep the program oneDNN really runs (see engines/evidence.py)
        want_evidence = device == "cpu" and precision in evidence.ONEDNN_TYPE
        try:  # only int8 is captured: a fatal abort elsewhere must still show its message
            with evidence.optimized_program_dir(cfg) if want_evidence else contextlib.nullcontext() as optdir, \
                    _capture_stderr_fd() if precision == "int8" else contextlib.nullcontext(log) as log:
                self._predictor = pinf.create_predictor(cfg)
                ops = evidence.op_precisions(optdir) if want_evidence else {}
                saved = bool(want_evidence and list(optdir.glob("*.pdmodel")))
        except Exception as e:  # Paddle raises RuntimeError/ValueError/OSError subclasses
            msg = str(e).strip().splitlines()
            raise PipelineError(f"Paddle Inference could not load {self.model_prefix}: {msg[-1] if msg else e!r}",
                                hint="check the model was exported by paddle.jit.save / PaddleSlim") from e
        self.int8_quantized = _int8_ops_done("".join(log))  # op type -> count the pass printout reports
        if precision == "int8":
            self.evidence["onednn_int8_ops"] = dict(self.int8_quantized)
            self.notes.append(f"oneDNN int8 ops: {self.int8_quantized}")
        if want_evidence:
            self._label_from_program(precision, ops, mkldnn, ir_optim, saved)
        self._bind_io()

    def _label_from_program(self, precision: str, ops: dict, mkldnn: bool, ir_optim, saved: bool) -> None:
        """effective_precision from the optimized program oneDNN really runs (bf16/int8 need that evidence)."""
        why = evidence.why_not_applied(precision, mkldnn=mkldnn, ir_optim=ir_optim, saved=saved,
                                       simulated=capabilities.simulated(capabilities.BF16_FLAGS)
                                       if precision == "bf16" else False)
        self.effective_precision, proof = evidence.structural_label(precision, ops, why)
        self.evidence.update(proof)
        self.op_precisions = ops

    def _bind_io(self) -> None:
        ins, outs = self._predictor.get_input_names(), self._predictor.get_output_names()
        if len(ins) != 1 or len(outs) != 1:
            raise PipelineError(f"engine supports one input/one output, model has {ins} -> {outs}")
        self.input_name, self.output_name = ins[0], outs[0]
        self._in = self._predictor.get_input_handle(self.input_name)
        self._last_shape: tuple | None = None
        self._out = self._predictor.get_output_handle(self.output_name)

    def _config_cpu(self, cfg: pinf.Config, precision: str, threads: int, mkldnn: bool,
                    int8_ops: Iterable[str] | None) -> str:
        cfg.disable_gpu()
        cfg.set_cpu_math_library_num_threads(int(threads))
        desc = _program_desc(self.model_prefix)
        quant = any("quantize" in op.type for op in desc.blocks[0].ops)
        fp16_emulated = any(_FP16_EMU_SUFFIX in v.name for v in desc.blocks[0].vars)
        if any(_BF16_EMU_SUFFIX in v.name for v in desc.blocks[0].vars):
            cfg.enable_mkldnn()     # its rounding casts need oneDNN on every CPU (bf16 emulation note above)
            if not mkldnn or capabilities.onednn_below_avx2():
                cfg.set_mkldnn_op({"cast"})
                self.settings["mkldnn"] = "casts only"
                self.notes.append("bf16 rounding casts on oneDNN (round to nearest even), every other op on Paddle's "
                                  "kernels (" + ("server.mkldnn=false" if not mkldnn else "oneDNN below AVX2") + ")")
            self.notes.append("bf16 emulated on CPU: bf16-rounded white-list ops, fp32 math")
            return "bf16-emulated"
        if precision == "int8":
            if not quant:
                raise PipelineError(f"{self.model_prefix} has no quantize ops; int8 needs a PaddleSlim quant model",
                                    hint="run quant.quantize_ptq() first")
            # Without enable_mkldnn_int8 a fake-quant model runs simulated (~10x slower, still fp32 math).
            if not mkldnn:      # the user's setting wins; the label then says int8 was not applied
                self.notes.append("server.mkldnn=false: fake-quant ops simulated in fp32 (no oneDNN int8)")
                return "int8"
            cfg.enable_mkldnn()
            if int8_ops is None:
                int8_ops = _INT8_SAFE_OPS
                self.notes.append("fc/matmul kept fp32: Paddle 2.6's oneDNN int8 pass mis-scales fc weights")
            cfg.enable_mkldnn_int8(set(int8_ops or ()))  # empty set = every op oneDNN can quantize
            return "int8"
        if precision == "bf16":
            ok, why = bf16_status()
            if not ok:
                raise PipelineError(f"bf16 not available: {why}", hint="report bf16 as SKIPPED (see bf16_status())")
            self.notes.append(why)
            if mkldnn:          # bf16 kernels are oneDNN only; the label tells when it was not applied
                cfg.enable_mkldnn()
                cfg.enable_mkldnn_bfloat16()
                if int8_ops:    # bf16 reads int8_ops as its op types (set_bfloat16_op: by type, never by layer)
                    cfg.set_bfloat16_op(set(int8_ops))
            return "bf16"
        if mkldnn:
            cfg.enable_mkldnn()
        if precision == "fp16":
            if not fp16_emulated:
                raise PipelineError("fp16 predictors need a GPU build of Paddle (no CPU fp16 conv/matmul kernels)",
                                    hint="on CPU build an emulated model with make_fp16_emulated() and load that")
            self.notes.append("fp16 emulated on CPU: fp16-rounded weights/activations, fp32 math")
            self.evidence["fp16_emulation"] = (f"program carries {sum(_FP16_EMU_SUFFIX in v.name for v in desc.blocks[0].vars)}"
                                               " fp16 cast outputs")
            return "fp16-emulated"
        if fp16_emulated:
            self.notes.append("model carries fp16-emulation casts")
            return "fp16-emulated"
        if quant:
            self.notes.append("fake-quant model run as fp32 (simulated int8; pass precision='int8' for real int8)")
            return "int8-simulated"
        return "fp32"

    def _config_gpu(self, cfg: pinf.Config, precision: str, tensorrt: bool, max_batch: int,
                    keep_fp32_ops: list[str]) -> str:
        _require_gpu(f"GPU {precision} inference")
        if precision not in ("fp32", "fp16"):
            raise ConfigError(f"GPU engine supports fp32/fp16, not {precision}", hint="use device=cpu for int8")
        half = pinf.PrecisionType.Half
        mode = half if precision == "fp16" else pinf.PrecisionType.Float32
        if precision == "fp16":
            self._keep_fp32(cfg, keep_fp32_ops, tensorrt)
        if tensorrt:
            cfg.enable_use_gpu(256, 0)
            cfg.enable_tensorrt_engine(workspace_size=1 << 30, max_batch_size=max_batch, min_subgraph_size=3,
                                       precision_mode=mode, use_static=False, use_calib_mode=False)
            shp = [max(d, 1) for d in self.input_shape]  # dynamic dims: let TRT see 1..max_batch
            lo, hi = [1] + shp[1:], [max_batch] + shp[1:]
            feed = _feed_name(_program_desc(self.model_prefix).blocks[0], self.model_prefix)
            cfg.set_trt_dynamic_shape_info({feed: lo}, {feed: hi}, {feed: lo})
            self.notes.append(f"TensorRT {precision}")
        else:
            # precision_mode=Half turns on Paddle's GPU auto-mixed-precision pass.
            cfg.enable_use_gpu(256, 0, mode)
        return precision

    def _keep_fp32(self, cfg: pinf.Config, ops: list[str], tensorrt: bool) -> None:
        """The user's black list for the predictor's mixed-precision pass: Paddle's API says it must equal the one
        the model was converted with (convert_fp16_gpu(keep_fp32_ops=)); TensorRT gets those ops kept out of its
        engines (they then run the converted program's fp32 ops)."""
        self.evidence["fp32_ops_user_black_list"] = list(ops)
        if not ops:
            return
        cfg.exp_disable_mixed_precision_ops(set(ops))
        if tensorrt:
            cfg.exp_disable_tensorrt_ops(list(ops))
        self.notes.append(f"kept in fp32 (server.fp16.keep_fp32_ops): {', '.join(ops)}")

    def trim(self) -> None:
        self._predictor.try_shrink_memory()     # the predictor's memory pool, grown to the largest batch run

    def _run(self, x: np.ndarray) -> np.ndarray:
        if self._last_shape is not None and x.shape != self._last_shape:
            # Paddle's allocator keeps every input shape's buffers until shrunk: fed varied shapes (pages, crop
            # widths) the v4 det + rec references grew to 3.8 GB over 24 page shapes; shrinking at each change of
            # shape held them to 2.0 GB, and the 24 pages read no slower (20.0 vs 22.3 s)
            self._predictor.try_shrink_memory()
        self._last_shape = x.shape
        self._in.copy_from_cpu(x)       # reshapes the input tensor to x.shape itself (no separate reshape() call)
        try:
            self._predictor.run()
        except RuntimeError as e:
            if self.requested_precision == "int8" and _STRIDES_ERROR in str(e) and capabilities.onednn_below_avx2():
                raise PipelineError(f"Paddle Inference int8 cannot run {self.model_prefix} where oneDNN is below AVX2: "
                                    f"{_BLOCKED_FP32_CAUSE}", hint="quantize every convolution (no server.quant.skip) "
                                    "or run int8 on an AVX2 CPU") from e
            raise
        return self._out.copy_to_cpu()


def make_fp16_emulated(model_prefix: str | os.PathLike, out_prefix: str | os.PathLike, dtype: str = "fp16",
                       keep_fp32_ops: Iterable[str] = ()) -> dict:
    """Write a copy that emulates Paddle's mixed-precision inference (fp16/bf16 op lists, keep_io_types)
    by rounding casts; see pipeline/engines/amp_emulation.py. Feed and fetch names are unchanged.
    keep_fp32_ops: op types added to the pass's black list, as convert_fp16_gpu(keep_fp32_ops=) adds them."""
    from pipeline.engines.amp_emulation import make_emulated
    return make_emulated(model_prefix, out_prefix, dtype, keep_fp32_ops)


def convert_fp16_gpu(model_prefix: str | os.PathLike, out_prefix: str | os.PathLike,
                     keep_fp32_ops: Iterable[str] = ()) -> str:
    """Real FP16 model for GPU predictors; Paddle refuses PlaceType.CPU, so only on a CUDA build.
    keep_fp32_ops: the pass's black_list (added to its default one); the predictor that loads the result must
    be given the same set (InferenceEngine(keep_fp32_ops=): Paddle asks for the same list at both places)."""
    model, params = _files(model_prefix)
    _require_gpu("convert_to_mixed_precision(fp16)")
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    pinf.convert_to_mixed_precision(model, params, f"{out_prefix}.pdmodel", f"{out_prefix}.pdiparams",
                                    pinf.PrecisionType.Half, pinf.PlaceType.GPU, keep_io_types=True,
                                    black_list=set(keep_fp32_ops))
    return str(out_prefix)


def program_io(model_prefix: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(feed names, fetch names) of the main block, in order."""
    block = _program_desc(model_prefix).blocks[0]
    feeds = [a for op in block.ops if op.type == "feed" for o in op.outputs for a in o.arguments]
    fetches = [a for op in block.ops if op.type == "fetch" for i in op.inputs for a in i.arguments]
    return feeds, fetches
