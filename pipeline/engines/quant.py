"""INT8 post-training quantization (PaddleSlim) and per-layer INT8 sensitivity."""
from __future__ import annotations

import contextlib
import gc
import time
import io
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import paddle

from pipeline.engines.program import feed_name as _feed_name
from pipeline.engines.program import files as _files
from pipeline.engines.program import program_desc as _program_desc
from pipeline.engines.program import program_input_shape
from pipeline.core.errors import ConfigError, DataError, PipelineError

ALGOS = ("hist", "avg", "mse", "abs_max", "KL")  # min_max inserts no quant ops in PaddleSlim 2.6
DEFAULT_OP_TYPES = ("conv2d", "depthwise_conv2d", "mul", "matmul", "matmul_v2")
# Which input slot of each quantizable op holds the weight (what skip_tensor_list matches on).
_WEIGHT_SLOT = {"conv2d": "Filter", "depthwise_conv2d": "Filter", "conv2d_transpose": "Filter",
                "mul": "Y", "matmul": "Y", "matmul_v2": "Y"}
_NOISY_LOGGERS = ("paddle.static", "paddleslim")  # PTQ progress + "old way to load" warnings


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """Mute PaddleSlim's INFO logs and tqdm bars (stderr); the text is kept for error messages."""
    saved = {}
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_NOISY_LOGGERS):
            lg = logging.getLogger(name)
            saved[name] = lg.level
            lg.setLevel(logging.ERROR)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield buf
    finally:
        for name, lvl in saved.items():
            logging.getLogger(name).setLevel(lvl)


def _weight_ops(model_prefix: str | os.PathLike, op_types: Sequence[str]) -> list[tuple[str, str]]:
    """(weight tensor name, op type) for quantizable ops whose weight is a persistable tensor."""
    block = _program_desc(model_prefix).blocks[0]
    persistable = {v.name for v in block.vars if v.persistable}
    rows: list[tuple[str, str]] = []
    for op in block.ops:
        slot = _WEIGHT_SLOT.get(op.type)
        if op.type not in op_types or slot is None:
            continue
        for inp in op.inputs:
            if inp.parameter == slot:
                rows += [(a, op.type) for a in inp.arguments if a in persistable and (a, op.type) not in rows]
    return rows


def quantizable_layers(model_prefix: str | os.PathLike,
                       quantizable_op_type: Sequence[str] = DEFAULT_OP_TYPES) -> list[str]:
    """Weight tensor names of quantizable ops, in program order (valid `skip_tensor_list` entries)."""
    return [name for name, _ in _weight_ops(model_prefix, quantizable_op_type)]


def weights_to_quantize(model_prefix: str | os.PathLike, op_types: Sequence[str],
                        skip: Sequence[str] = ()) -> list[str] | None:
    """The weights PaddleSlim quantizes under server.quant.op_types/skip, for the ONNX Runtime and OpenVINO int8
    rows to quantize the same layers (paddle2onnx keeps weight names); None with the default op types (or more) and
    nothing skipped: those engines then quantize what they choose, as before (e.g. PP-OCRv4 det's conv2d_transpose,
    which PaddleSlim's default op types leave fp32)."""
    if not skip and set(op_types) >= set(DEFAULT_OP_TYPES):
        return None
    return [w for w in quantizable_layers(model_prefix, op_types) if w not in set(skip)]


# PaddleSlim's PTQ makes every activation persistable (no memory reuse) and fetches them all to numpy each batch,
# where the histogram pass takes |x| copies: budget 3x the program's full footprint per sample. Measured peaks
# (whole process, Paddle itself included): PP-OCRv4 rec, 9 lines x 150 MB: 2.4-2.7 GB (3x says 4.0); v4 det 736x736,
# 1 page x 743 MB: 3.0 GB (the 9-page batch of the old activation estimate reached 19 GB).
PTQ_COPIES = 3


def program_footprint_bytes(model_prefix: str | os.PathLike, input_shape: Sequence[int]) -> int:
    """Bytes of every non-persistable float var for one sample of `input_shape`, from Paddle's own shape
    inference on the program (PP-OCRv4 det at 736x736: 743 MB; rec 48x320: 150 MB). Ops whose shapes do not
    infer keep their recorded dims (-1 counted as 1)."""
    from paddle.base import core

    shape = [1, *[int(d) for d in input_shape[1:]]]
    paddle.enable_static()
    try:
        prog = paddle.static.Program.parse_from_string(Path(f"{model_prefix}.pdmodel").read_bytes())
        block = prog.global_block()
        block.var(_feed_name(_program_desc(model_prefix).blocks[0], model_prefix)).desc.set_shape(shape)
        for op in block.ops:
            if op.type not in ("feed", "fetch"):
                with contextlib.suppress(Exception):      # e.g. shape-from-tensor ops: recorded dims stay
                    op.desc.infer_shape(block.desc)
        floats = (paddle.float32, paddle.float16)
        return int(sum(math.prod(abs(d) for d in v.shape) * (2 if v.dtype == paddle.float16 else 4)
                       for v in block.vars.values()
                       if not v.persistable and v.type == core.VarDesc.VarType.LOD_TENSOR and v.dtype in floats))
    finally:
        paddle.disable_static()


def calib_batch(model_prefix: str | os.PathLike, input_shape: Sequence[int], budget_mb: int, wanted: int) -> int:
    """The largest calibration batch <= wanted whose PTQ peak (PTQ_COPIES x footprint) fits budget_mb (>= 1)."""
    from pipeline.engines.perf import fit_batch

    return fit_batch(PTQ_COPIES * program_footprint_bytes(model_prefix, input_shape), budget_mb, wanted)


class _CalibSet(paddle.io.Dataset):
    # quant_post_static only accepts a paddle.io.DataLoader; samples keyed by feed name.
    def __init__(self, feed: str, x: np.ndarray) -> None:
        self.feed, self.x = feed, x

    def __getitem__(self, i: int) -> dict:
        return {self.feed: self.x[i]}

    def __len__(self) -> int:
        return len(self.x)


def _check_calib(model_prefix: str, calib_inputs: np.ndarray) -> np.ndarray:
    if not isinstance(calib_inputs, np.ndarray) or calib_inputs.dtype != np.float32:
        raise DataError("calibration inputs must be a float32 numpy array",
                        hint="np.asarray(x, dtype=np.float32)")
    want = program_input_shape(model_prefix)
    ok = calib_inputs.ndim == len(want) and all(w < 0 or g == w for g, w in zip(calib_inputs.shape, want))
    if not ok or len(calib_inputs) == 0:
        raise DataError(f"calibration inputs shape {list(calib_inputs.shape)} do not fit model input {want}")
    return np.ascontiguousarray(calib_inputs)


def quantize_ptq(model_prefix: str | os.PathLike, out_dir: str | os.PathLike, calib_inputs: np.ndarray, *,
                 algo: str = "hist", batch_size: int = 32, batch_nums: int = 10, onnx_format: bool = False,
                 skip_tensor_list: Sequence[str] | None = None,
                 quantizable_op_type: Sequence[str] = DEFAULT_OP_TYPES, onednn_grid: bool = True) -> str:
    """Static PTQ with PaddleSlim; writes out_dir/model.pdmodel/.pdiparams and returns prefix out_dir/model.

    onnx_format=False keeps fake-quant ops that Paddle Inference's oneDNN INT8 path and Lite both read
    (and keeps flatten's XShape). onednn_grid=True re-rounds the quantized convs' weights onto the grid oneDNN
    runs them on (engines/onednn_grid.py: without it PP-OCRv4 rec's Paddle int8 row fell 0.711 -> 0.445 on AVX2).
    """
    with warnings.catch_warnings():  # setuptools/distutils noise. Not under _quiet: loggers created
        warnings.simplefilter("ignore")  # there would keep the redirected stderr as their stream forever
        from paddleslim.quant import quant_post_static

    if algo not in ALGOS:
        raise ConfigError(f"unknown PTQ algo {algo!r}", hint=f"one of {', '.join(ALGOS)} (KL is slow)")
    if batch_size < 1 or batch_nums < 1:
        raise ConfigError(f"batch_size and batch_nums must be >= 1 (got {batch_size}, {batch_nums})")
    model_prefix = str(model_prefix)
    _files(model_prefix)
    x = _check_calib(model_prefix, calib_inputs)
    if skip_tensor_list:
        known = set(quantizable_layers(model_prefix, quantizable_op_type))
        unknown = [t for t in skip_tensor_list if t not in known]
        if unknown:
            raise ConfigError(f"skip_tensor_list names not quantizable weights: {unknown}",
                              hint=f"choose from {sorted(known)}")
    feed = _feed_name(_program_desc(model_prefix).blocks[0], model_prefix)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_size = min(batch_size, len(x))
    batch_nums = min(batch_nums, math.ceil(len(x) / batch_size))
    model_dir, base = os.path.split(os.path.abspath(model_prefix))
    scope = paddle.static.Scope()  # PTQ loads params via the executor into the *guarded* scope
    paddle.enable_static()
    try:
        # Fresh name counter: otherwise the fetch var is named ...scale_0.tmp_N, N = PTQ runs so far.
        with _quiet() as log, paddle.static.scope_guard(scope), paddle.utils.unique_name.guard():
            loader = paddle.io.DataLoader(_CalibSet(feed, x), batch_size=batch_size, shuffle=False,
                                          drop_last=False, num_workers=0)
            try:
                quant_post_static(
                    executor=paddle.static.Executor(paddle.CPUPlace()), model_dir=model_dir,
                    quantize_model_path=str(out_dir), data_loader=loader,
                    model_filename=base + ".pdmodel", params_filename=base + ".pdiparams",
                    save_model_filename="model.pdmodel", save_params_filename="model.pdiparams",
                    batch_size=batch_size, batch_nums=batch_nums, scope=scope, algo=algo,
                    quantizable_op_type=list(quantizable_op_type), onnx_format=onnx_format,
                    skip_tensor_list=list(skip_tensor_list) if skip_tensor_list else None)
            except Exception as e:
                tail = log.getvalue().strip().splitlines()[-3:]
                raise PipelineError(f"PaddleSlim PTQ ({algo}) failed: {type(e).__name__}: {e}",
                                    hint=" | ".join(tail) or "check the model and calibration data") from e
    finally:
        paddle.disable_static()
        del scope
        gc.collect()    # the scope holds every calibration activation of a batch: give it back before the gate runs
    return _written(out_dir / "model", model_prefix, onednn_grid and not onnx_format)


def _written(prefix: Path, model_prefix: str, snap: bool) -> str:
    _files(prefix)  # PaddleSlim returned without writing: surface it here, not at load time
    if snap:
        from pipeline.engines.onednn_grid import snap_conv_weights
        snap_conv_weights(prefix, model_prefix)
    return str(prefix)


# ---------------------------------------------------------------- advice when int8 fails its gate
# 1. Rank (one calibrated pass): run the fp32 program and the already-quantized (fake-quant) program
#    once on the same samples, fetch every quantizable layer's input and output in both, and score each
#    layer by the error it adds itself: rel_err(output) - rel_err(input), rel_err = ||q - f|| / ||f||.
#    Ties are broken by the output error, then by program order (later first: nearer the logits).
#    Cost: two forward passes instead of one PTQ per layer (54 PTQs, 293 s on mobilenet_v3_small).
# 2. Check: re-quantize with the top-k layers skipped (k = 1, 2, 4, ...) and judge each candidate with
#    the int8 gate itself; advise the first set that passes, or say that none does.
_SUFFIXES = (".quantized", ".dequantized")


def _base(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def _layer_io(quant_prefix: str, op_types: Sequence[str], weight_slot: dict) -> list[dict]:
    """Quantizable layers of the fake-quant program: weight name, op type, activation input (fp32
    name) and the var holding its dequantized output there."""
    from pipeline.engines.program import program_desc as _program_desc

    block = _program_desc(quant_prefix).blocks[0]
    persistable = {v.name for v in block.vars if v.persistable}
    deq = {}   # raw output → dequantized var (fake_*dequantize* op after the layer)
    for op in block.ops:
        if "dequantize" in op.type:
            xs = [a for i in op.inputs if i.parameter == "X" for a in i.arguments]
            outs = [a for o in op.outputs if o.parameter == "Out" for a in o.arguments]
            if xs and outs:
                deq[xs[0]] = outs[0]
    layers = []
    for op in block.ops:
        slot = weight_slot.get(op.type)
        if op.type not in op_types or slot is None:
            continue
        ins = {i.parameter: list(i.arguments) for i in op.inputs}
        weights = [_base(w) for w in ins.get(slot, []) if _base(w) in persistable]
        acts = [a for k, v in ins.items() if k != slot for a in v if _base(a) not in persistable]
        outs = [a for o in op.outputs for a in o.arguments]
        if not weights or not acts or not outs:
            continue
        layers.append({"layer": weights[0], "op": op.type, "input": _base(acts[0]), "output": outs[0],
                       "output_q": deq.get(outs[0], outs[0])})
    return layers


def quantized_layers(quant_prefix: str | os.PathLike) -> list[str]:
    """Weight names of the layers PaddleSlim really quantized (their output is dequantized), program order."""
    return [l["layer"] for l in _layer_io(str(quant_prefix), tuple(_WEIGHT_SLOT), _WEIGHT_SLOT)
            if l["output_q"] != l["output"]]


def _fetch(prefix: str, x: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    paddle.enable_static()
    try:
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            exe = paddle.static.Executor(paddle.CPUPlace())
            prog, feeds, _ = paddle.static.load_inference_model(prefix, exe)
            block = prog.global_block()
            names = [n for n in dict.fromkeys(names) if block.has_var(n)]
            vals = exe.run(prog, feed={feeds[0]: x}, fetch_list=names)
    finally:
        paddle.disable_static()
    return dict(zip(names, vals))


def _rel(q: np.ndarray | None, f: np.ndarray | None) -> float:
    if q is None or f is None or q.shape != f.shape:
        return float("nan")
    f64 = f.astype(np.float64)
    return float(np.linalg.norm(q.astype(np.float64) - f64) / (np.linalg.norm(f64) + 1e-12))


def rank_layers(fp32_prefix: str, quant_prefix: str, x: np.ndarray, op_types: Sequence[str],
                weight_slot: dict) -> list[dict]:
    """Layers by the error each adds itself, largest first (see the module docstring)."""
    layers = _layer_io(quant_prefix, op_types, weight_slot)
    f = _fetch(fp32_prefix, x, [n for l in layers for n in (l["input"], l["output"])])
    q = _fetch(quant_prefix, x, [n for l in layers for n in (l["input"], l["output_q"])])
    for i, l in enumerate(layers):
        err_in = _rel(q.get(l["input"]), f.get(l["input"]))
        err_out = _rel(q.get(l["output_q"]), f.get(l["output"]))
        l.update(order=i, input_error=err_in, output_error=err_out,
                 added_error=(err_out - err_in) if np.isfinite(err_in) else err_out)
    ok = [l for l in layers if np.isfinite(l["added_error"])]
    ok.sort(key=lambda l: (-round(l["added_error"], 6), -l["output_error"], -l["order"]))
    return [{k: l[k] for k in ("layer", "op", "added_error", "output_error", "input_error")} for l in ok]


def advise(ranked: list[dict], requantize: Callable[[list[str]], str], judge: Callable[[str], dict],
           max_trials: int = 4, budget_s: float = 45.0) -> dict:
    """Skip the top-k ranked layers for k = 1, 2, 4, ... (never all of them: nothing would be int8);
    judge(prefix) -> {"passed": bool, ...}. A trial that raises is recorded and ends the search.
    A trial starts only while budget_s has not run out (the one running then finishes).
    Returns {"recommended": [...] | None, "trials": [...], "stopped": passed|budget|error|exhausted}."""
    t0, trials = time.perf_counter(), []
    k = 1
    while k < len(ranked) and len(trials) < max_trials:
        if time.perf_counter() - t0 >= budget_s:
            return {"recommended": None, "trials": trials, "stopped": "budget"}
        skip = [r["layer"] for r in ranked[:k]]
        try:
            verdict = judge(requantize(skip))
        except PipelineError as exc:
            trials.append({"skip": skip, "passed": False, "reason": exc.one_line()})
            return {"recommended": None, "trials": trials, "stopped": "error"}
        trials.append({"skip": skip, "seconds": round(time.perf_counter() - t0, 1), **verdict})
        if verdict["passed"]:
            return {"recommended": skip, "trials": trials, "stopped": "passed"}
        k *= 2
    return {"recommended": None, "trials": trials, "stopped": "exhausted"}
