"""export: paddle.jit.to_static + jit.save (dynamic batch InputSpec) → inference.pdmodel/.pdiparams.

Gate: the exported program, reloaded with paddle.jit.load, against the trained dygraph model's
reference outputs on the validation slice (NaN/Inf, max abs diff, metric drop).
"""
from __future__ import annotations

import io
import json
import shutil
import time

import numpy as np

from pipeline.core import safe_pickle
from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text, require_file
from pipeline.core.gates import Gate, evaluate_tol
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.tasks import get_task


def _save_trained(ctx, info: dict, task, prefix) -> None:
    """jit.save the trained weights: a builder's Layer through to_static, a fine-tuned inference program
    (model.pretrained) by re-saving the loaded program. Dynamic batch, and dynamic width where the
    preprocessing feeds each line at its own width (PaddleOCR's [-1, 3, 48, -1])."""
    import paddle
    from paddle.static import InputSpec

    from pipeline.models import imported

    state = safe_pickle.load_state(require_file(ctx.input("train", "model.pdparams"), "trained parameters",
                                                "make train"), "trained parameters")     # data only: no pickle code
    model, _ = imported.build(task, info["model"], info["labels_info"], load_pretrained=False)
    model.set_state_dict(state)
    model.eval()
    shape = [None if d == -1 else d for d in info["input_shape"]]
    spec = [InputSpec(shape, "float32", "x")]
    if isinstance(model, imported.Trainable):
        paddle.jit.save(model.inner, str(prefix), input_spec=spec)
        return
    static_model = paddle.jit.to_static(model, input_spec=spec, full_graph=True)   # AST mode: honours input_spec
    paddle.jit.save(static_model, str(prefix), input_spec=spec)


def _load_and_run(prefix, x: np.ndarray, imported_program: bool) -> np.ndarray:
    """The load is verified: the saved program must reproduce the reference. An imported program is loaded the
    way its reference was computed (Paddle Inference, REFERENCE_PASSES: its dygraph run was ~5x slower)."""
    import paddle

    if imported_program:
        from pipeline.engines.paddle_infer import reference_outputs

        return reference_outputs(prefix, x)
    loaded = paddle.jit.load(str(prefix))
    loaded.eval()
    with paddle.no_grad():
        return np.concatenate([loaded(paddle.to_tensor(x[i:i + 32])).numpy() for i in range(0, len(x), 32)])


def run(ctx: StageContext) -> StageResult:
    import paddle

    info = json.loads(require_file(ctx.input("train", "info.json"), "training info", "make train").read_text())
    with np.load(require_file(ctx.input("train", "val_slice.npz"), "validation slice", "make train")) as z:
        x, labels, reference, images = z["inputs"], z["labels"], z["outputs"], z["images"]

    paddle.set_device("cpu")
    task = get_task(info["task"], info.get("postprocess"))
    prefix = ctx.out_dir / "inference"
    t0 = time.perf_counter()
    if info.get("source") == "onnx":            # an ONNX import: the file is the model, re-run by its reference
        return _export_onnx(ctx, info, task, x, labels, reference, images)
    if info.get("source") == "inference":       # imported: the program is the model; copy it as it is
        for suffix in (".pdmodel", ".pdiparams"):
            shutil.copy2(ctx.input("train", f"imported/inference{suffix}"), str(prefix) + suffix)
    else:
        _save_trained(ctx, info, task, prefix)
    seconds = time.perf_counter() - t0

    out = _load_and_run(prefix, x, imported_program=info.get("source") == "inference")
    metric = task.primary_metric
    ref_value = task.metrics(reference, labels)[metric]
    subject = "imported program reloaded vs its reference" if info.get("source") == "inference" \
        else "jit.save program vs dygraph"
    gate = Gate("export", subject, "float32", "float32", metric, reference=ref_value)
    tol = ctx.cfg.export.gate
    evaluate_tol(gate, out, reference, tol, task.metrics(out, labels)[metric], task, key="export.gate")
    gate.seconds = round(seconds, 2)
    # downstream stages read only export's folder for the reference: inputs, labels, exported outputs
    buf = io.BytesIO()
    np.savez(buf, inputs=x, labels=labels, outputs=out, images=images)
    atomic_write_bytes(ctx.out_dir / "reference.npz", buf.getvalue())
    atomic_write_text(ctx.out_dir / "info.json", json.dumps(info, indent=2))
    return StageResult(gates=[gate], precision={"requested": "float32", "effective": "float32"},
                       metrics={metric: gate.value},
                       info={"input_spec": [None if d == -1 else d for d in info["input_shape"]],
                             "source": info.get("source", "builder"), "files": ["inference.pdmodel",
                                                                                      "inference.pdiparams"]})


def _export_onnx(ctx, info: dict, task, x, labels, reference, images) -> StageResult:
    """model.source=onnx: model.onnx copied as it is, reloaded and re-run by the reference engine (ONNX Runtime
    fp32, basic optimizations), gated against train's reference like any export."""
    from pipeline.models import onnx_import

    t0 = time.perf_counter()
    model = ctx.out_dir / "model.onnx"
    shutil.copy2(ctx.input("train", "imported/model.onnx"), model)
    out = onnx_import.reference_outputs(model, x)
    metric = task.primary_metric
    gate = Gate("export", "imported ONNX model reloaded vs its reference", "float32", "float32", metric,
                reference=task.metrics(reference, labels)[metric])
    evaluate_tol(gate, out, reference, ctx.cfg.export.gate, task.metrics(out, labels)[metric], task, key="export.gate")
    gate.seconds = round(time.perf_counter() - t0, 2)
    buf = io.BytesIO()
    np.savez(buf, inputs=x, labels=labels, outputs=out, images=images)
    atomic_write_bytes(ctx.out_dir / "reference.npz", buf.getvalue())
    atomic_write_text(ctx.out_dir / "info.json", json.dumps(info, indent=2))
    return StageResult(gates=[gate], precision={"requested": "float32", "effective": "float32"},
                       metrics={metric: gate.value}, info={"source": "onnx", "files": ["model.onnx"]})


STAGE = Stage(name="export", inputs=("train",), config_keys=("export",), make_target="export", run=run,
              outputs=("reference.npz", "info.json"),
              # a Paddle program, or (model.source=onnx) the ONNX file as imported
              optional_outputs=("inference.pdmodel", "inference.pdiparams", "model.onnx",
                                "inference.pdiparams.info"),     # jit.save's pickle beside them: no stage reads it
              description="jit.save with a dynamic-batch InputSpec, gated against the trained model")
