"""OpenVINO engine (CPU plugin) on the ONNX export, and NNCF int8 from the same calibration data.

OpenVINO's CPU plugin silently runs bf16 on CPUs with AVX-512 BF16/AMX unless told otherwise, so the
fp32 row pins INFERENCE_PRECISION_HINT=f32 and the label is checked against the precisions the
compiled (runtime) model reports per op.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.engines.base import Engine
from pipeline.errors import ConfigError, MissingArtifact, PipelineError


_COMPUTE_OPS = {"Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul", "RNNSeq", "RNNCell"}


def _runtime_precisions(compiled) -> Counter:
    """Op count per runtime precision of the compute ops (Convolution, FullyConnected, MatMul ...)."""
    seen: Counter = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        kind = rt["layerType"].astype(str) if "layerType" in rt else op.get_type_name()
        if kind in _COMPUTE_OPS:
            seen[rt["runtimePrecision"].astype(str).lower() if "runtimePrecision" in rt else "unknown"] += 1
    return seen


def _type_name(t) -> str:
    return t.get_type_name() if hasattr(t, "get_type_name") else str(t)


class OpenVinoEngine(Engine):
    kind = "openvino"

    def __init__(self, model_file: str | os.PathLike, *, threads: int = 1, label: str = "fp32",
                 hint: str = "LATENCY", static_batch: int | None = None) -> None:
        import openvino as ov

        super().__init__()
        path = Path(model_file)
        if not path.is_file():
            raise MissingArtifact(f"OpenVINO model not found: {path}")
        if label not in ("fp32", "int8"):
            raise ConfigError(f"OpenVINO rows are fp32 or int8, not {label!r}")
        core = ov.Core()
        try:
            model = core.read_model(str(path))
            if static_batch:   # a static shape lets the CPU plugin pick its kernels once
                pshape = model.input(0).get_partial_shape()
                pshape[0] = static_batch
                model.reshape({model.input(0): pshape})
            cfg = {"INFERENCE_NUM_THREADS": int(threads), "PERFORMANCE_HINT": hint, "NUM_STREAMS": 1,
                   "INFERENCE_PRECISION_HINT": "f32"}
            self._compiled = core.compile_model(model, "CPU", cfg)
        except Exception as e:  # OpenVINO raises RuntimeError with multi-line C++ context
            raise PipelineError(f"OpenVINO could not load {path}: {str(e).strip().splitlines()[0]}") from e
        self._req = self._compiled.create_infer_request()
        self.input_shape = [d.get_length() if d.is_static else -1 for d in model.input(0).get_partial_shape()]
        precs = _runtime_precisions(self._compiled)
        self.evidence = {"runtime_precision_ops": dict(precs),
                         "inference_precision_hint": _type_name(self._compiled.get_property("INFERENCE_PRECISION_HINT"))}
        self.settings = {"threads": int(threads), "performance_hint": hint, "streams": 1,
                         "static_batch": static_batch, "version": ov.get_version()}
        low = {p for p in precs if p in ("i8", "u8")}
        if label == "int8":
            self.effective_precision = "int8" if low else "int8-simulated"
            if not low:
                self.notes.append("no compute op runs in i8/u8 on this CPU: fp32 math on int8-rounded values")
        else:
            if not precs or set(precs) - {"f32"}:
                raise PipelineError(f"OpenVINO fp32 row runs {dict(precs)}: not fp32")
            self.effective_precision = "fp32"

    def _run(self, x: np.ndarray) -> np.ndarray:
        return self._req.infer({0: x}, share_inputs=True)[0].copy()


def nncf_status() -> tuple[bool, str]:
    try:
        import nncf  # noqa: F401
    except Exception as e:  # ImportError, or a broken dependency
        return False, f"NNCF not importable ({type(e).__name__}: {e})"
    return True, "nncf " + nncf.__version__


def quantize_int8(onnx_file: str | os.PathLike, out_xml: str | os.PathLike, calib: np.ndarray, *,
                  batch_size: int = 32, batch_nums: int = 10) -> dict:
    """NNCF post-training quantization (default preset: symmetric weights, per-channel) to OpenVINO IR."""
    import nncf
    import openvino as ov

    if calib.ndim != 4 or len(calib) == 0:
        raise ConfigError(f"calibration data must be [N, C, H, W], got {list(calib.shape)}")
    n = min(len(calib), batch_size * batch_nums)
    batches = [np.ascontiguousarray(calib[i:min(i + batch_size, n)], np.float32) for i in range(0, n, batch_size)]
    model = ov.Core().read_model(str(onnx_file))
    q = nncf.quantize(model, nncf.Dataset(batches), subset_size=len(batches))   # counted in dataset items (batches)
    Path(out_xml).parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(q, str(out_xml))
    return {"calibration_samples": int(n), "tool": "nncf " + nncf.__version__, "preset": "performance"}
