"""OpenVINO engine (CPU plugin) on the ONNX export, and NNCF int8 from the same calibration data.

OpenVINO's CPU plugin silently runs bf16 on CPUs with AVX-512 BF16/AMX unless told otherwise, so the
fp32 row pins INFERENCE_PRECISION_HINT=f32 and the label is checked against the precisions the
compiled (runtime) model reports per op. The bf16 row asks for INFERENCE_PRECISION_HINT=bf16; on a CPU
without bf16 OpenVINO silently runs f32, and the runtime model then says so: the label follows it.
"""
from __future__ import annotations

import functools

import os
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Collection

import numpy as np

from pipeline.engines import onnx_files
from pipeline.engines.base import Engine
from pipeline.engines.evidence import not_applied
from pipeline.core.errors import ConfigError, MissingArtifact, PipelineError


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


# what each row asks the CPU plugin for: int8 models carry their own precision, the rest is pinned
_HINT = {"fp32": "f32", "int8": "f32", "bf16": "bf16"}


def _label(label: str, precs: Counter) -> str:
    """The precision the runtime model shows for the compute ops (never the requested label without it)."""
    if label == "int8":
        return "int8" if {"i8", "u8"} & set(precs) else "int8-simulated"
    if label == "bf16":
        if precs.get("bf16"):
            return "bf16"
        return not_applied("bf16", f"OpenVINO's runtime model runs {dict(precs) or 'no compute op'}, no bf16 op")
    if not precs or set(precs) - {"f32"}:
        raise PipelineError(f"OpenVINO fp32 row runs {dict(precs)}: not fp32")
    return "fp32"


def _type_name(t) -> str:
    return t.get_type_name() if hasattr(t, "get_type_name") else str(t)


@functools.lru_cache(maxsize=None)
def shared_core():
    """One ov.Core per process. A Core's first compile gives the calling thread an alternate signal stack (20 KB)
    and its destruction puts back the one it found: Cores destroyed out of order (an engine per server row) left
    the main thread's alternate stack pointing at freed memory, and the next signal handled there (Ctrl-C during
    the bundle stage) died of SIGSEGV. One Core that lives as long as the process never restores a stale stack."""
    import openvino as ov

    return ov.Core()


class OpenVinoEngine(Engine):
    kind = "openvino"

    def __init__(self, model_file: str | os.PathLike, *, threads: int = 1, label: str = "fp32",
                 hint: str = "LATENCY", static_batch: int | None = None, static_shapes: int = 0) -> None:
        import openvino as ov

        super().__init__()
        path = Path(model_file)
        if not path.is_file():
            raise MissingArtifact(f"OpenVINO model not found: {path}")
        if label not in _HINT:
            raise ConfigError(f"OpenVINO rows are {', '.join(_HINT)}, not {label!r}")
        if path.suffix == ".onnx":
            onnx_files.confine(path)        # no external data from outside the model's folder (issue 47)
        core = shared_core()
        try:
            model = core.read_model(str(path))
            if static_batch:   # a static shape lets the CPU plugin pick its kernels once
                pshape = model.input(0).get_partial_shape()
                pshape[0] = static_batch
                model.reshape({model.input(0): pshape})
            # no CPU pinning: the plugin pins each process's threads from core 0, so two 1-thread workers (Ray
            # batch, several `serve` processes) shared one core: 2 at once ran 80-90 ms per call vs 46 alone, 46-47
            # unpinned (a 64-channel 3x3 conv, 1 thread, Zen 4); alone the two are equal
            cfg = {"INFERENCE_NUM_THREADS": int(threads), "PERFORMANCE_HINT": hint, "NUM_STREAMS": 1,
                   "INFERENCE_PRECISION_HINT": _HINT[label], "ENABLE_CPU_PINNING": False}
            self._compiled = core.compile_model(model, "CPU", cfg)
            self._cfg = cfg
        except Exception as e:  # OpenVINO raises RuntimeError with multi-line C++ context
            raise PipelineError(f"OpenVINO could not load {path}: {str(e).strip().splitlines()[0]}") from e
        self._req = self._compiled.create_infer_request()
        self.input_shape = [d.get_length() if d.is_static else -1 for d in model.input(0).get_partial_shape()]
        precs = _runtime_precisions(self._compiled)
        self.evidence = {"runtime_precision_ops": dict(precs), "inference_precision_hint_requested": _HINT[label],
                         "inference_precision_hint": _type_name(self._compiled.get_property("INFERENCE_PRECISION_HINT"))}
        self.settings = {"threads": int(threads), "performance_hint": hint, "streams": 1,
                         "static_batch": static_batch, "version": ov.get_version()}
        self.effective_precision = _label(label, precs)
        self._label, self._path = label, path
        self._shapes = ShapeCache(model, static_shapes) if static_shapes and -1 in self.input_shape else None
        if self._shapes is not None:
            self.settings["static_shapes"] = int(static_shapes)
        if label == "int8" and self.effective_precision != "int8":
            self.notes.append("no compute op runs in i8/u8 on this CPU: fp32 math on int8-rounded values")

    def _run(self, x: np.ndarray) -> np.ndarray:
        req = self._req if self._shapes is None else self._static_request(tuple(x.shape))
        return req.infer({0: x}, share_inputs=True)[0].copy()

    def _static_request(self, shape: tuple) -> object:
        """The request of a model compiled for exactly this input shape (compiled on first sight). Each one must run
        the precision the engine reports: a shape whose kernels fall back (e.g. no bf16 kernel for it) fails loudly
        instead of serving another precision under this label."""
        req = self._shapes.get(shape)
        if req is None:
            try:
                compiled = shared_core().compile_model(self._shapes.reshaped(shape), "CPU", self._cfg)
            except Exception as e:
                raise PipelineError(f"OpenVINO could not compile {self._path} for input {list(shape)}: "
                                    f"{str(e).strip().splitlines()[0]}") from e
            precs = _runtime_precisions(compiled)
            try:
                same = _label(self._label, precs) == self.effective_precision
            except PipelineError:       # an fp32 row whose shape runs anything but f32
                same = False
            if not same:
                raise PipelineError(f"OpenVINO compiled {self._path.name} for input {list(shape)}: its runtime model "
                                    f"runs {dict(precs)}, not the {self.effective_precision} this engine reports")
            req = self._shapes.put(shape, compiled.create_infer_request())
            self.evidence["static_shapes_compiled"] = self._shapes.compiled
        return req

    def trim(self) -> None:
        if self._shapes is not None:
            self._shapes.clear()                # each shape's model holds its own buffers: compiled again if seen
        try:
            self._compiled.release_memory()     # the CPU plugin's intermediate buffers (no request is running)
        except RuntimeError:                    # a plugin that cannot release now keeps them: memory, not a fault
            pass


class ShapeCache:
    """Infer requests of a model compiled for one input shape each, the `size` most recently used kept. The CPU
    plugin's kernels for a dynamic shape are slower than those it picks for a static one (the v4 detector at bf16
    with its f32 prefix: 1.47 against 1.72 s for the 7 real pages, repeated), at a compile of ~0.15 s per new shape;
    pages of a few shapes (one scanner, one camera) repeat them."""

    def __init__(self, model, size: int) -> None:
        self._model, self.size, self.compiled = model, int(size), 0
        self._requests: OrderedDict = OrderedDict()

    def get(self, shape: tuple):
        req = self._requests.get(shape)
        if req is not None:
            self._requests.move_to_end(shape)
        return req

    def reshaped(self, shape: tuple):
        m = self._model.clone()
        m.reshape({m.input(0): list(shape)})
        return m

    def put(self, shape: tuple, req):
        self._requests[shape] = req
        self.compiled += 1
        while len(self._requests) > self.size:
            self._requests.popitem(last=False)
        return req

    def clear(self) -> None:
        self._requests.clear()


def bf16_status() -> tuple[bool, str]:
    """(True, why) when the CPU reports bf16 (avx512_bf16/amx_bf16); elsewhere OpenVINO silently runs f32.
    Under a simulated profile the row runs and the runtime model's precisions decide the label."""
    from pipeline.core import capabilities

    native = sorted(capabilities.cpu_flags() & capabilities.BF16_FLAGS)
    if not native:
        return False, "CPU lacks avx512_bf16/amx_bf16; OpenVINO would silently run f32"
    if capabilities.simulated(capabilities.BF16_FLAGS):
        return True, f"simulated CPU profile reports {'/'.join(native)} (real CPU: none); the runtime model decides the label"
    if capabilities.isa_cap_without_bf16():     # OpenVINO's CPU plugin honours the oneDNN cap too
        return False, (f"{capabilities.ISA_ENV}={capabilities.isa_cap_without_bf16()} caps the CPU plugin below bf16 "
                       f"(CPU has {'/'.join(native)})")
    return True, f"CPU has {'/'.join(native)}"


def nncf_status() -> tuple[bool, str]:
    try:
        import nncf
    except Exception as e:  # ImportError, or a broken dependency
        return False, f"NNCF not importable ({type(e).__name__}: {e})"
    return True, "nncf " + nncf.__version__


_WEIGHT_PATH_OPS = {"Reshape", "Convert", "Unsqueeze", "Squeeze", "Transpose"}   # between a weight Constant and its op


def _weight_name(op) -> str | None:
    """Friendly name of the Constant feeding a compute op's weight input (the Paddle weight name: paddle2onnx keeps
    it, OpenVINO's ONNX frontend names the Constant after it); GroupConvolution reads it through a Reshape."""
    if op.get_input_size() < 2:
        return None
    node = op.input(1).get_source_output().get_node()
    while node.get_type_name() in _WEIGHT_PATH_OPS:
        node = node.input(0).get_source_output().get_node()
    return node.get_friendly_name() if node.get_type_name() == "Constant" else None


def ignored_scope(model, weights: Collection[str]) -> tuple[list[str], list[str]]:
    """(names of the compute ops whose weight is not in `weights` (as ort.excluded_compute_nodes), every other op
    type of the model): NNCF then quantizes those compute ops alone, elementwise ops stay fp32 as in Paddle's row."""
    allowed = set(weights)
    ops = model.get_ordered_ops()
    names = [op.get_friendly_name() for op in ops if op.get_type_name() in _COMPUTE_OPS and _weight_name(op) not in allowed]
    return names, sorted({op.get_type_name() for op in ops} - _COMPUTE_OPS - {"Parameter", "Result", "Constant"})


PRESETS = ("performance", "mixed")
ACTIVATION_RANGES = ("mean_minmax", "minmax")


def quantize_int8(onnx_file: str | os.PathLike, out_xml: str | os.PathLike, calib: np.ndarray, *,
                  batch_size: int = 32, batch_nums: int = 10, weights: Collection[str] | None = None,
                  preset: str = "performance", activation_range: str = "mean_minmax") -> dict:
    """NNCF post-training quantization (symmetric per-channel weights) to OpenVINO IR.
    weights: quantize only the compute ops with these weights (server.quant.op_types/skip, as PaddleSlim does);
    the others go to NNCF's ignored scope. None = every op NNCF quantizes.
    preset: performance (symmetric activations, NNCF's default) | mixed (asymmetric activations, as ONNX Runtime's uint8).
    activation_range: mean_minmax (NNCF's default: the MEAN over calibration batches of each batch's min/max, so the
    ranges shrink with the batch size) | minmax (the min/max over all samples, as PaddleSlim abs_max and ORT MinMax)."""
    import nncf
    import openvino as ov

    if preset not in PRESETS or activation_range not in ACTIVATION_RANGES:
        raise ConfigError(f"NNCF preset {preset!r} / activation range {activation_range!r}",
                          hint=f"preset one of {', '.join(PRESETS)}; activation range one of {', '.join(ACTIVATION_RANGES)}")

    if calib.ndim != 4 or len(calib) == 0:
        raise ConfigError(f"calibration data must be [N, C, H, W], got {list(calib.shape)}")
    n = min(len(calib), batch_size * batch_nums)
    batches = [np.ascontiguousarray(calib[i:min(i + batch_size, n)], np.float32) for i in range(0, n, batch_size)]
    onnx_files.confine(onnx_file)
    model = shared_core().read_model(str(onnx_file))
    ignored, types = ignored_scope(model, weights) if weights is not None else ([], [])
    scope = nncf.IgnoredScope(names=ignored, types=types, validate=False) if weights is not None else None
    kw = {}
    if activation_range == "minmax":
        from nncf.quantization.range_estimator import RangeEstimatorParametersSet

        kw["advanced_parameters"] = nncf.AdvancedQuantizationParameters(
            activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX)
    q = nncf.quantize(model, nncf.Dataset(batches), subset_size=len(batches),   # counted in dataset items (batches)
                      ignored_scope=scope, preset=nncf.QuantizationPreset(preset), **kw)
    Path(out_xml).parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(q, str(out_xml))
    return {"calibration_samples": int(n), "tool": "nncf " + nncf.__version__, "preset": preset,
            "activation_range": activation_range,
            **({"ignored_compute_ops": len(ignored), "ignored_op_types": len(types)} if weights is not None else {})}


# --- bf16 with chosen layers kept f32 -------------------------------------------------------------------------
# OpenVINO's CPU plugin honours a per-node f32 request inside a bf16 model only through the IR: rt_info set from
# Python (disable_fp16_compression_0, precise_0) changes nothing, but `<rt_info><attribute name="precise"
# version="0"/></rt_info>` on a <layer> of an IR saved with compress_to_fp16=False does (../shared/STACK.md).
# The mark is not copied to a node a transformation makes (DisableFP16Compression is not copyable): a convolution
# the plugin fuses with its batch-norm Multiply, a MatMul+Add turned FullyConnected came out bf16 whatever was
# marked. So the base IR is saved already fused (OpenVINO's own MOC transformations, as `ovc` runs them): the marks
# then sit on the nodes the plugin compiles (PP-OCRv4 det, rec and cls: every compute layer marked -> every one
# runs f32, was 16 of 64 det and 20 of 38 rec convolutions still bf16). Fusing renames a fused convolution after
# its Multiply (Multiply_18141): a copyable string in rt_info carries each compute layer's ONNX name through the
# fusions, and the layer is named back, so keep lists name the layers as the ONNX model does.
_ORIGIN = "pipeline_origin"
_NOT_SEGMENT = {"Const", "Parameter", "Result", "ShapeOf"}
_COMPUTE_IR = {"Convolution", "GroupConvolution", "MatMul", "ConvolutionBackpropData"}


def save_f32_ir(onnx_file: str | os.PathLike, out_xml: str | os.PathLike) -> Path:
    """The ONNX model as an f32 OpenVINO IR (weights not compressed to f16), fused as the CPU plugin would fuse it,
    each compute layer under its ONNX name: the base the `precise` marks go on (see above)."""
    import openvino as ov
    from openvino._offline_transformations import apply_moc_transformations

    out = Path(out_xml)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx_files.confine(onnx_file)
    model = shared_core().read_model(str(onnx_file))
    for op in model.get_ordered_ops():
        if op.get_type_name() in _COMPUTE_IR:
            op.get_rt_info()[_ORIGIN] = op.get_friendly_name()
    apply_moc_transformations(model, cf=True)
    carriers: dict[str, list] = {}
    for op in model.get_ordered_ops():
        rt = op.get_rt_info()
        if _ORIGIN in rt:
            if op.get_type_name() in _COMPUTE_IR:
                carriers.setdefault(rt[_ORIGIN].astype(str), []).append(op)
            del rt[_ORIGIN]
    for name, ops in carriers.items():
        if len(ops) == 1:           # two nodes from one layer (never seen): both keep the names fusion gave them
            ops[0].set_friendly_name(name)
    ov.save_model(model, str(out), compress_to_fp16=False)
    return out


def keep_f32_ir(base_xml: str | os.PathLike, names: Collection[str], out_xml: str | os.PathLike) -> dict:
    """Copy of an IR whose layers named `names` carry the `precise` mark (run f32 under a bf16 hint); the weights
    file is shared (a link). Returns {"marked": n, "absent": [names not in the IR]}."""
    import xml.etree.ElementTree as ET

    base, out = Path(base_xml), Path(out_xml)
    tree = ET.parse(base)
    want, marked = set(names), set()
    for layer in tree.getroot().iter("layer"):
        if layer.get("name") not in want:
            continue
        rt = layer.find("rt_info")
        if rt is None:
            rt = ET.SubElement(layer, "rt_info")
        ET.SubElement(rt, "attribute", {"name": "precise", "version": "0"})
        marked.add(layer.get("name"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tree.write(out)
    weights = out.with_suffix(".bin")
    if weights.resolve() != base.with_suffix(".bin").resolve():
        weights.unlink(missing_ok=True)
        try:
            os.link(base.with_suffix(".bin"), weights)
        except OSError:         # another file system: copy
            import shutil
            shutil.copyfile(base.with_suffix(".bin"), weights)
    return {"marked": len(marked), "absent": sorted(want - marked)}


def layer_segments(base_xml: str | os.PathLike) -> list[dict]:
    """The IR's layers cut at each compute layer (Convolution, MatMul ...), in the IR's topological order: a segment
    is one compute layer and the layers after it up to the next one (its bias, norm, activation ...), so keeping a
    segment f32 keeps a layer and the elementwise tail the plugin fuses into it."""
    import xml.etree.ElementTree as ET

    segments: list[dict] = []
    for layer in ET.parse(base_xml).getroot().iter("layer"):
        kind, name = layer.get("type"), layer.get("name")
        if kind in _NOT_SEGMENT:
            continue
        if kind in _COMPUTE_IR or not segments:
            segments.append({"layer": name, "type": kind, "names": []})
        segments[-1]["names"].append(name)
    return segments


def segment_names(base_xml: str | os.PathLike, layers: Collection[str]) -> list[str]:
    """Every IR layer of the segments headed by `layers` (compute layer names, as layer_segments reports them);
    a name that heads no segment is passed through (keep_f32_ir then reports it absent)."""
    segments = {s["layer"]: s["names"] for s in layer_segments(base_xml)}
    return [n for name in layers for n in segments.get(name, [name])]


def run_ir(xml: str | os.PathLike, x: np.ndarray, hint: str, *, batch: int = 8, threads: int = 1) -> np.ndarray:
    """Outputs of an IR compiled with INFERENCE_PRECISION_HINT `hint` (f32 | bf16), in batches."""
    c = shared_core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads})
    return np.concatenate([c(np.ascontiguousarray(x[i:i + batch]))[0] for i in range(0, len(x), batch)])


def top_class_error(out: np.ndarray, reference: np.ndarray) -> float:
    """mean |p - p_ref| of the reference's top class (classifiers, CTC recognizers: the class axis is the last)."""
    top = reference.argmax(-1)[..., None]
    return float(np.abs(np.take_along_axis(out, top, -1) - np.take_along_axis(reference, top, -1)).mean())


def map_error(out: np.ndarray, reference: np.ndarray) -> float:
    """mean |p - p_ref| over every pixel of a probability map (detectors: DB maps [N, 1, H, W])."""
    return float(np.abs(out - reference).mean())


def flip_error(thresh: float):
    """error(out, reference) -> the share of DB-map pixels whose binarisation at `thresh` flips (detectors): the binary
    map's edges are the boxes' edges, so a flip near a line is a crop edge that moves; map_error's mean |dp| is mostly
    the text's interior, which no box sees."""
    def error(out: np.ndarray, reference: np.ndarray) -> float:
        return float(((out > thresh) != (reference > thresh)).mean())
    return error


def bf16_sensitivity(base_xml: str | os.PathLike, x: np.ndarray, reference: np.ndarray, work: str | os.PathLike,
                     *, batch: int = 8, threads: int = 1, error=top_class_error) -> list[dict]:
    """Each segment's own bf16 error: the model with only that segment bf16 (every other layer `precise`), run on
    `x` (a TUNING split, never the data a gate judges), error(out, reference) (top_class_error, map_error).
    Largest first."""
    segments, work = layer_segments(base_xml), Path(work)
    every = [n for s in segments for n in s["names"]]
    for s in segments:
        own = set(s["names"])
        keep_f32_ir(base_xml, [n for n in every if n not in own], work / "only.xml")
        s["error"] = error(run_ir(work / "only.xml", x, "bf16", batch=batch, threads=threads), reference)
    return sorted(segments, key=lambda s: -s["error"])
