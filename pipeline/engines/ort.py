"""ONNX Runtime engine (CPU execution provider; CUDA / TensorRT providers on GPU machines) and
static int8 quantization from the same calibration data as PaddleSlim PTQ.

Precision evidence for int8 is read from the graph ORT really executes (its optimized model): QDQ
pairs folded into QLinearConv/QLinearMatMul/ConvInteger... mean int8 kernels ran; QDQ nodes left
standing mean fp32 math on int8-rounded values, which is labelled "int8-simulated", never "int8".
"""
from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Collection

import numpy as np

from pipeline.core import capabilities
from pipeline.engines import onnx_files
from pipeline.engines.base import Engine
from pipeline.core.errors import ConfigError, MissingArtifact, PipelineError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
# graph optimization levels by name: "all" (every fusion: the served rows), "basic" (constant folding and redundant-node
# removal only: an imported model's fp32 reference, pipeline/models/onnx_import.py)
OPT_LEVELS = ("none", "basic", "extended", "all")
_INT8_KERNELS = {"QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QGemm", "QLinearAdd",
                 "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearConcat", "QLinearMul", "MatMulIntegerToFloat",
                 "DynamicQuantizeMatMul"}


def provider_status(provider: str) -> tuple[bool, str]:
    """(runnable here, why). GPU providers need an onnxruntime-gpu build and a visible device."""
    import onnxruntime as ort

    name = PROVIDERS.get(provider)
    if name is None:
        raise ConfigError(f"unknown ONNX Runtime provider {provider!r}", hint=f"one of {', '.join(PROVIDERS)}")
    avail = ort.get_available_providers()
    if name not in avail:
        return False, f"not run here: {name} is not in this onnxruntime build ({', '.join(avail)})"
    if provider != "cpu":
        from pipeline.core import env

        if not env.capabilities()["gpu"]:
            return False, f"not run here: {name} is built in but no GPU is visible"
    return True, f"{name} available"


class OrtEngine(Engine):
    kind = "onnxruntime"

    def __init__(self, onnx_file: str | os.PathLike, *, threads: int = 1, provider: str = "cpu",
                 label: str = "fp32", spin: bool = True, graph_optimization: str = "all") -> None:
        """spin: ORT's intra-op pool threads busy-wait for the next call (its default; best for a tight
        loop). A server turns it off: the spinning threads take cores from its event loop and HTTP stack.
        graph_optimization: one of OPT_LEVELS ("basic": an ONNX import's fp32 reference)."""
        import onnxruntime as ort

        super().__init__()
        path = Path(onnx_file)
        if not path.is_file():
            raise MissingArtifact(f"ONNX model not found: {path}", hint="the server stage writes onnx/model.onnx")
        ok, why = provider_status(provider)
        if not ok:
            raise PipelineError(why)
        if graph_optimization not in OPT_LEVELS:
            raise ConfigError(f"unknown ONNX Runtime graph optimization {graph_optimization!r}",
                              hint=f"one of {', '.join(OPT_LEVELS)}")
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
        levels = ort.GraphOptimizationLevel
        so.graph_optimization_level = {"none": levels.ORT_DISABLE_ALL, "basic": levels.ORT_ENABLE_BASIC,
                                       "extended": levels.ORT_ENABLE_EXTENDED, "all": levels.ORT_ENABLE_ALL}[graph_optimization]
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        onnx_files.confine(path)            # no external data from outside the model's folder (issue 47)
        with tempfile.TemporaryDirectory(prefix="ort-opt-") as tmp:
            so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")   # what ORT really runs
            try:
                self._sess = ort.InferenceSession(str(path), so, providers=[PROVIDERS[provider]])
            except Exception as e:  # ORT raises its own Fail/InvalidGraph/... classes
                raise PipelineError(f"ONNX Runtime could not load {path}: {str(e).splitlines()[0]}") from e
            ops = _op_counts(so.optimized_model_filepath)
        self._probe = None          # one sample of the last large input (trim)
        inp, outs = self._sess.get_inputs(), self._sess.get_outputs()
        if len(inp) != 1:
            raise PipelineError(f"engine supports one input, {path} has {[i.name for i in inp]}")
        self.input_name, self.output_name = inp[0].name, outs[0].name
        self.input_shape = [d if isinstance(d, int) else -1 for d in inp[0].shape]
        self.settings = {"threads": int(threads), "provider": PROVIDERS[provider], "graph_optimization": graph_optimization,
                         "spinning": bool(spin) and int(threads) > 1}
        int8_ops = {k: v for k, v in ops.items() if k in _INT8_KERNELS}
        qdq_left = ops.get("QuantizeLinear", 0) + ops.get("DequantizeLinear", 0)
        if label == "int8":
            self.evidence = {"int8_kernels": int8_ops, "qdq_nodes_left": qdq_left}
            self.effective_precision = "int8" if int8_ops else "int8-simulated"
            if not int8_ops:
                self.notes.append("ORT folded no QDQ pair into an int8 kernel: fp32 math on int8-rounded values")
        elif label == "fp32":
            if int8_ops or qdq_left:
                raise PipelineError(f"{path} holds quantized nodes; load it with label='int8'")
            self.effective_precision = "fp32"
        else:
            raise ConfigError(f"ONNX Runtime rows are fp32 or int8, not {label!r}")

    def _run(self, x: np.ndarray) -> np.ndarray:
        if x.nbytes >= SHRINK_INPUT_BYTES and self._probe is None:   # the arena grew: trim() can shrink it back
            self._probe = np.ascontiguousarray(x[:1]).copy()
        return self._sess.run([self.output_name], {self.input_name: x})[0]

    def trim(self) -> None:
        """ORT's arena shrinks only at the end of a run that asks for it: one sample of the large input is run so
        (shrinking on every large run instead cost 1.16x the time of a batch-8 736x736 det run)."""
        probe, self._probe = self._probe, None
        if probe is not None:
            self._sess.run([self.output_name], {self.input_name: probe}, _shrink_options())


# After a run whose input is this large, trim() hands the arena's chunks back: ORT's arena otherwise keeps the largest
# batch's activations for the session's life (the v4 det server stage kept its ORT sessions' batch-8 arenas alive
# through every later row); page- and crop-sized runs (a 736x2944 page is 26 MB) never need it.
SHRINK_INPUT_BYTES = 32 << 20


def _shrink_options():
    import onnxruntime as ort

    opts = ort.RunOptions()
    opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return opts


def _op_counts(onnx_file: str) -> Counter:
    import onnx

    if not os.path.isfile(onnx_file):
        return Counter()
    return Counter(n.op_type for n in onnx.load(onnx_file, load_external_data=False).graph.node)


COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def excluded_compute_nodes(onnx_file: str | os.PathLike, weights: Collection[str]) -> list[str]:
    """Names of the compute nodes (Conv/MatMul/Gemm) whose weight is not in `weights` (Paddle weight names, which
    paddle2onnx keeps as initializer names; read before quant_pre_process, which renames a conv's weight when it
    folds a batch norm into it, but keeps node names); nodes without a weight initializer (activation x activation
    MatMuls) are excluded too."""
    import onnx

    allowed = set(weights)
    return [n.name for n in onnx.load(str(onnx_file), load_external_data=False).graph.node
            if n.op_type in COMPUTE_OPS and not (len(n.input) > 1 and n.input[1] in allowed)]


QDQ_MIN_OPSET = 13     # per-channel DequantizeLinear (its `axis`) exists from opset 13


def qdq_opset(onnx_file: str | os.PathLike, tmp_file: Path) -> tuple[Path, dict | None]:
    """The model to quantize: as it is at opset >= QDQ_MIN_OPSET, else converted to it (onnx.version_converter) into
    tmp_file. quantize_static writes per-channel QDQ nodes of the model's own opset: at 11 (PP-OCRv6 small as
    RapidOCR 3.10 ships it) the result does not load (INVALID_GRAPH on a DequantizeLinear of an int32 bias).
    -> (file, {"from", "to"} or None when nothing was converted)."""
    import onnx
    from onnx import version_converter

    model = onnx.load(str(onnx_file), load_external_data=False)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset >= QDQ_MIN_OPSET:
        return Path(onnx_file), None
    try:
        newer = version_converter.convert_version(model, QDQ_MIN_OPSET)
        onnx.checker.check_model(newer)
    except Exception as exc:        # an op the converter has no adapter for: the row fails with this line
        raise PipelineError(f"ONNX Runtime int8 needs opset >= {QDQ_MIN_OPSET} (per-channel QDQ); converting "
                            f"{Path(onnx_file).name} from opset {opset} failed: {str(exc).splitlines()[0][:160]}") from None
    onnx.save(newer, str(tmp_file))
    return tmp_file, {"from": int(opset), "to": QDQ_MIN_OPSET}


def quantize_int8(onnx_file: str | os.PathLike, out_file: str | os.PathLike, calib: np.ndarray, *,
                  batch_size: int = 32, batch_nums: int = 10, weights: Collection[str] | None = None) -> dict:
    """Static (calibrated) QDQ int8: per-channel int8 weights, uint8 activations.

    reduce_range (7-bit weights) on every CPU: without VNNI, x86 int8 GEMM sums u8*s8 pairs into saturating int16
    (vpmaddubsw), and ORT's remedy was applied only there, so the model quantized depended on the CPU that built it.
    Measured on PP-OCRv4 rec (128 lines, fp32 0.711, 2026-12-02, Xeon with avx512_vnni + AMX): reduce_range 0.742,
    0 of 91 correctly read lines lost; 8-bit weights 0.633, 10 lost (an AVX2 CPU: 0.742 and 0.648). A bundle is
    served on other CPUs than it was built on: one model for all, the one that holds on both.
    weights: quantize only the compute nodes with these weights (server.quant.op_types/skip, as PaddleSlim
    does: quant.weights_to_quantize); None = every node ORT quantizes.
    """
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if calib.ndim != 4 or len(calib) == 0:
        raise ConfigError(f"calibration data must be [N, C, H, W], got {list(calib.shape)}")
    n = min(len(calib), batch_size * batch_nums)
    name = OrtEngine(onnx_file).input_name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(range(0, n, batch_size))

        def get_next(self):
            i = next(self._it, None)
            return None if i is None else {name: np.ascontiguousarray(calib[i:min(i + batch_size, n)], np.float32)}

    reduce_range = True
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ortq-", dir=out.parent) as tmp:
        src, converted = qdq_opset(onnx_file, Path(tmp) / "opset.onnx")
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        scoped = {}
        if weights is not None:     # only these compute nodes; elementwise and other ops stay fp32, as in Paddle's row
            excluded = excluded_compute_nodes(src, weights)
            scoped = {"nodes_to_exclude": excluded, "op_types_to_quantize": list(COMPUTE_OPS)}
        q = Path(tmp) / out.name
        # no CalibMaxIntermediateOutputs to bound calibration memory: onnxruntime 1.23.2's MinMax collect_data clears
        # each full chunk without merging its ranges (only the last chunk would count)
        quantize_static(str(pre), str(q), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, **scoped)
        os.replace(q, out)
    return {"calibration_samples": int(n), "format": "QDQ", "per_channel": True, "reduce_range": reduce_range,
            "cpu_has_vnni": capabilities.has_vnni(),
            "calibrate_method": "MinMax", **({"opset_converted": converted} if converted else {}),
            **({"onnx_op_types": list(COMPUTE_OPS), "excluded_compute_nodes": len(scoped["nodes_to_exclude"])} if scoped else {})}
