"""model.source=onnx: an ONNX model imported as it is, for the ONNX Runtime and OpenVINO rows.

The pipeline has no ONNX -> Paddle 2.6 program converter that has been through its gates (x2paddle, the one
that exists, has not been tried here), so the Paddle Inference and Lite rows are SKIPPED with that reason.
The fp32 reference is ONNX Runtime fp32 on its CPU execution provider with graph optimizations at BASIC
(constant folding and redundant-node removal only, no fusions), one thread: the model as written, not an engine's
rewrite of it. The served rows (ORT at ORT_ENABLE_ALL, OpenVINO) are then gated against that reference.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from pipeline.core.artifacts import sha256_file
from pipeline.core.errors import ConfigError

REFERENCE_SETTINGS = {"engine": "onnxruntime", "provider": "CPUExecutionProvider", "graph_optimization": "basic",
                      "threads": 1}
PADDLE_SKIP = ("model.source=onnx: Paddle {what} needs a Paddle program and no ONNX -> Paddle 2.6 converter has "
               "passed this chain's gates (x2paddle not tried); the ONNX Runtime and OpenVINO rows run the model")
SKIP_ROWS = {"paddle": PADDLE_SKIP.format(what="Inference"), "lite": PADDLE_SKIP.format(what="Lite opt")}


def resolve(path: str | os.PathLike, max_bytes: int | None = None) -> Path:
    """model.path -> the .onnx file (a file, or a folder holding exactly one), size-checked."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.onnx"))
        if len(found) != 1:
            raise ConfigError(f"model.path {p} holds {len(found)} .onnx files; model.source=onnx needs exactly one",
                              hint="point model.path at the .onnx file itself")
        p = found[0]
    if not p.is_file() or p.suffix != ".onnx":
        raise ConfigError(f"model.path {p} is not an .onnx file", hint="set model.path to the model's .onnx file")
    if max_bytes and p.stat().st_size > max_bytes:
        raise ConfigError(f"model.path {p} is {p.stat().st_size} bytes, over model.max_file_bytes={max_bytes}",
                          hint="raise model.max_file_bytes if the file is trusted")
    return p


def _load(path: Path):
    import onnx

    from pipeline.engines.onnx_files import external_tensors

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:        # a foreign or truncated file: one line, not a protobuf traceback
        raise ConfigError(f"model.path {path} is not a valid ONNX model ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]})", hint="export the model again") from None
    found = external_tensors(model)              # any tensor: initializers, Constant attributes, subgraphs
    if found:                                    # (before the checker, which would open the files)
        where, location = found[0]
        raise ConfigError(f"model.path {path} keeps weights in external files ({where[:100]}: {location[:60]!r})",
                          hint="save it as one .onnx file")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ConfigError(f"model.path {path} is not a valid ONNX model ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]})", hint="export the model again") from None
    return model


def _dims(value_info) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value_info.type.tensor_type.shape.dim]


def signature(path: Path) -> dict:
    """{'input': name, 'input_shape': [-1, C, H, W] (-1 where dynamic), 'outputs': n, 'opset': k, 'metadata': {}}"""
    model = _load(path)
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise ConfigError(f"model.path {path} has {len(inputs)} inputs; the pipeline feeds one image tensor",
                          hint="import a model with a single [N, C, H, W] input")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    return {"input": inputs[0].name, "input_shape": _dims(inputs[0]), "outputs": len(model.graph.output),
            "opset": int(opset), "metadata": {p.key: p.value for p in model.metadata_props}}


def check_input(path: Path, spec, task_name: str) -> dict:
    """The model's input against the task's preprocessing: 4-D, channels and any fixed height/width equal."""
    sig = signature(path)
    shape, want = sig["input_shape"], [spec.get("channels", 1), spec["height"], spec["width"]]
    if len(shape) != 4:
        raise ConfigError(f"model.path {path} input {sig['input']!r} has shape {shape}; the {task_name} task feeds "
                          "[N, C, H, W]", hint="import an image model")
    for axis, got, need in zip(("channels", "height", "width"), shape[1:], want):
        if got > 0 and need and got != need and not (axis == "width" and task_name == "recognition"):
            raise ConfigError(f"model.path {path} input {sig['input']!r} has {axis} {got}; data.{axis} is {need}",
                              hint=f"set data.{axis}: {got}")
    return sig


def file_hashes(path: Path) -> dict:
    return {path.name: sha256_file(path)}


def reference_session(path: str | os.PathLike):
    import onnxruntime as ort

    from pipeline.engines.onnx_files import confine

    confine(path)                   # nothing read from outside the model's folder (issue 47)

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.intra_op_num_threads, so.inter_op_num_threads = REFERENCE_SETTINGS["threads"], 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def reference_outputs(path: str | os.PathLike, x: np.ndarray, batch: int = 8) -> np.ndarray:
    """ONNX Runtime fp32, CPU EP, basic graph optimizations: the import's reference (first output)."""
    sess = reference_session(path)
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: np.ascontiguousarray(x[i:i + batch], np.float32)})[0]
                           for i in range(0, len(x), batch)])


def _inferred(path: Path, input_shape: list[int]):
    """The graph with every tensor's shape inferred for one concrete input shape."""
    import onnx

    model = _load(path)
    inits = {t.name for t in model.graph.initializer}
    inp = next(i for i in model.graph.input if i.name not in inits)
    for d, n in zip(inp.type.tensor_type.shape.dim, input_shape):
        d.Clear()
        d.dim_value = int(n)
    return onnx.shape_inference.infer_shapes(model, data_prop=True)


def _shapes(model) -> dict[str, list[int]]:
    g = model.graph
    out = {t.name: list(t.dims) for t in g.initializer}
    for v in list(g.value_info) + list(g.input) + list(g.output):
        dims = _dims(v)
        if dims and all(d > 0 for d in dims):
            out[v.name] = dims
    return out


def activation_bytes(path: Path, input_shape: list[int]) -> int:
    """fp32 bytes of every intermediate tensor for one sample (tensors whose shape stays unknown count as the
    largest known one: a bound, as the Paddle program's footprint is for batch sizing)."""
    model = _inferred(path, [1, *input_shape[1:]])
    shapes, inits = _shapes(model), {t.name for t in model.graph.initializer}
    sizes = [math.prod(s) for n, s in shapes.items() if n not in inits]
    biggest = max(sizes, default=1)
    unknown = sum(1 for node in model.graph.node for o in node.output if o and o not in shapes)
    return 4 * (sum(sizes) + unknown * biggest)


def macs(path: Path, input_shape: list[int]) -> int:
    """Multiply-accumulates of Conv, ConvTranspose, MatMul and Gemm for one sample (as perf.program_macs)."""
    model = _inferred(path, [1, *input_shape[1:]])
    shapes, total = _shapes(model), 0
    for node in model.graph.node:
        ins = [shapes.get(n) for n in node.input[:2]]
        out = shapes.get(node.output[0])
        if out is None or None in ins:
            continue
        if node.op_type == "Conv":
            total += math.prod(out) * math.prod(ins[1][1:])
        elif node.op_type == "ConvTranspose":
            total += math.prod(ins[0]) * math.prod(ins[1][1:])
        elif node.op_type in ("MatMul", "Gemm"):
            total += math.prod(out) * ins[0][-1]
    return int(total)
