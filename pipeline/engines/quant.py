"""INT8 post-training quantization (PaddleSlim) and per-layer INT8 sensitivity."""
from __future__ import annotations

import zlib  # noqa: F401  (must precede paddle: libpaddle exports its own zlib symbols)
import contextlib
import io
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import paddle

from pipeline.engines.paddle_infer import _feed_name, _files, _program_desc, program_input_shape
from pipeline.errors import ConfigError, DataError, PipelineError

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
                 quantizable_op_type: Sequence[str] = DEFAULT_OP_TYPES) -> str:
    """Static PTQ with PaddleSlim; writes out_dir/model.pdmodel/.pdiparams and returns prefix out_dir/model.

    onnx_format=False keeps fake-quant ops that Paddle Inference's oneDNN INT8 path and Lite both read
    (and keeps flatten's XShape).
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
    paddle.enable_static()
    try:
        scope = paddle.static.Scope()  # PTQ loads params via the executor into the *guarded* scope
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
    prefix = out_dir / "model"
    _files(prefix)  # PaddleSlim returned without writing: surface it here, not at load time
    return str(prefix)


def int8_sensitivity(model_prefix: str | os.PathLike, work_dir: str | os.PathLike, calib_inputs: np.ndarray,
                     eval_fn: Callable[[str, str], float], *, algo: str = "hist", batch_size: int = 32,
                     batch_nums: int = 10, top_k: int | None = 5, fp32_metric: float | None = None,
                     quantizable_op_type: Sequence[str] = DEFAULT_OP_TYPES) -> list[dict]:
    """Quantize one layer at a time (all other quantizable layers skipped) and score it.

    eval_fn(prefix, precision) -> metric, higher is better; called as (fp32 prefix, "fp32") once unless
    fp32_metric is given, then (single-layer quant prefix, "int8") per layer. Returns the top_k rows
    (all if top_k is None) by drop, largest first: {"layer", "op", "metric", "drop"}.
    Cost: one PTQ + one eval per layer.
    """
    model_prefix = str(model_prefix)
    layers = _weight_ops(model_prefix, quantizable_op_type)
    if not layers:
        raise PipelineError(f"{model_prefix} has no quantizable layers of types {list(quantizable_op_type)}")
    base = float(eval_fn(model_prefix, "fp32")) if fp32_metric is None else float(fp32_metric)
    names = [n for n, _ in layers]
    rows = []
    for i, (name, op) in enumerate(layers):
        prefix = quantize_ptq(model_prefix, Path(work_dir) / f"layer{i:03d}", calib_inputs, algo=algo,
                              batch_size=batch_size, batch_nums=batch_nums,
                              skip_tensor_list=[n for n in names if n != name], quantizable_op_type=quantizable_op_type)
        m = float(eval_fn(prefix, "int8"))
        rows.append({"layer": name, "op": op, "metric": m, "drop": base - m})
    rows.sort(key=lambda r: r["drop"], reverse=True)
    return rows[:top_k] if top_k else rows
