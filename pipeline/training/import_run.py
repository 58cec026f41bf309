"""model.source=inference|pir|onnx: the train stage imports instead of training. The model's files are hashed and
copied into the run, its signature checked against the task, and its fp32 outputs on the validation images (Paddle
Inference, or ONNX Runtime for an .onnx) become the reference every later stage is gated on."""
from __future__ import annotations

import logging

import numpy as np

from pipeline.core.gates import OK, Check, Gate, count_nonfinite
from pipeline.core.runner import StageResult
from pipeline.data.preprocess import to_tensor
from pipeline.core.errors import ConfigError
from pipeline.models import imported
from pipeline.tasks import get_task
from pipeline.training.checks import first_line, note_output_kind, seed_everything
from pipeline.training.reference import write_info, write_reference
from pipeline.training.validation import metric_gate

log = logging.getLogger("pipeline")


def _import_forward(model, x: np.ndarray, task, prefix) -> list[int]:
    """One forward pass of the imported program: its output must fit the task (rank, classes, CTC steps)."""
    import paddle

    try:
        with paddle.no_grad():
            out = model(paddle.to_tensor(x[:1]))
    except Exception as exc:                  # the program on our input: a configuration mismatch
        raise ConfigError(f"model.path {prefix} fails on one input of shape {list(x[:1].shape)}: {first_line(exc)}",
                          hint="check data.channels / data.height / data.width against the model") from None
    layout = getattr(task, "output_layout", None)
    if layout and len(out.shape) != layout.count(",") + 1:
        raise ConfigError(f"model.path {prefix} outputs shape {list(out.shape)}; the {task.name} task needs {layout}",
                          hint="import a model of this task (task: ...) or change task")
    return [int(d) for d in out.shape]


def import_model(ctx) -> StageResult:
    """model.source=inference: the train stage imports instead of training. The program's files are hashed
    and copied, its signature checked against the task, and its fp32 outputs on the validation images become
    the reference every later stage is gated on (labels optional: parity needs none)."""
    import paddle
    import shutil

    from pipeline.engines.paddle_infer import reference_outputs

    cfg = ctx.cfg
    data_cfg, det_cfg = cfg.section("data")["data"], cfg.section("detection")["detection"]
    filled = {}
    if cfg.model.source == "pir":                # the keys the config leaves unset, from the export's inference.yml
        filled = imported.fill_from_yml(cfg.model.path, {"data": data_cfg, "detection": det_cfg}, cfg.user_keys,
                                        ctx.out_dir)
        for k, v in filled.items():
            log.info("[train] %s: %s (from inference.yml; the config does not set it)", k, v)
    task = get_task(cfg.task, det_cfg)
    seed_everything(cfg.seed)
    paddle.set_device("cpu")
    pir = None
    if cfg.model.source == "pir":                # a Paddle 3 export: translated first, then imported as any program
        prefix, pir = imported.translate_pir(cfg.model.path, ctx.out_dir, {"data": data_cfg, "detection": det_cfg},
                                              model_cfg=cfg.model)
    else:
        prefix = imported.resolve_prefix(cfg.model.path, max_bytes=cfg.model.max_file_bytes)
    ds = task.load_data(data_cfg, cfg.seed)
    spec = task.preprocess_spec(data_cfg, ds.info)
    program_input = imported.check_input(prefix, spec, task.name)
    model = imported.load_program(prefix)       # never reads a .pdiparams.info (a pickle) beside the files
    model.eval()
    first = to_tensor(ds.val.images[:4], spec)
    shape = _import_forward(model, first, task, prefix)
    if hasattr(task, "check_output_shape"):
        task.check_output_shape(shape, ds.info)
    note_output_kind(task, model, first)
    (ctx.out_dir / "imported").mkdir()
    for suffix in imported.SUFFIXES:             # downstream stages read the run, never the user's folder
        shutil.copy2(str(prefix) + suffix, ctx.out_dir / "imported" / ("inference" + suffix))
    del model                                   # jit.load checked the signature; the reference is the program run fast
    _, val_out, val_metrics, k = write_reference(ctx, task, None, ds, spec,
                                                 forward=lambda x: reference_outputs(prefix, x))
    record = {"path": str(prefix), "sha256": imported.file_hashes(prefix), "input": program_input,
              "output_per_sample": shape[1:], "outputs": getattr(task, "outputs", "logits"),
              "inference_yml": imported.inference_yml(prefix), **({"pir": pir} if pir else {}),
              **({"filled_from_yml": filled} if filled else {})}
    write_info(ctx, task, ds, spec, source="inference", imported=record)
    metric = task.primary_metric
    # executed whatever the labels: the program loaded, fit the task's signature and gave finite outputs
    loaded = Gate("train", "imported program: signature and outputs", "float32", "float32", metric, status=OK,
                  checks=[Check("finite", float(count_nonfinite(val_out)), 0.0, "<=", True),
                          Check("input/output signature fits the task", 1.0, 1.0, ">=", True)])
    gate = metric_gate(cfg, "imported program on validation", metric, val_metrics[metric], "float32", "float32")
    return StageResult(gates=[loaded, gate], precision={"requested": "float32", "effective": "float32"},
                       metrics={**val_metrics, "val_samples": int(len(ds.val.labels))},
                       info={"imported": record, "val_slice": k})


def import_onnx(ctx) -> StageResult:
    """model.source=onnx: the .onnx file is hashed, copied and checked against the task; its reference is ONNX
    Runtime fp32 (CPU EP, basic graph optimizations: pipeline/models/onnx_import.py), as import_model's is
    Paddle Inference. The Paddle rows downstream are SKIPPED with the reason; ORT and OpenVINO rows run it."""
    import shutil

    from pipeline.models import onnx_import

    cfg = ctx.cfg
    task = get_task(cfg.task, cfg.section("detection")["detection"])
    seed_everything(cfg.seed)
    data_cfg = cfg.section("data")["data"]
    path = onnx_import.resolve(cfg.model.path, max_bytes=cfg.model.max_file_bytes)
    ds = task.load_data(data_cfg, cfg.seed)
    spec = task.preprocess_spec(data_cfg, ds.info)
    sig = onnx_import.check_input(path, spec, task.name)
    first = to_tensor(ds.val.images[:4], spec)
    try:
        out = onnx_import.reference_outputs(path, first)
    except Exception as exc:                  # the model on our input: a configuration mismatch
        raise ConfigError(f"model.path {path} fails on inputs of shape {list(first.shape)}: {first_line(exc)}",
                          hint="check data.channels / data.height / data.width against the model") from None
    layout = getattr(task, "output_layout", None)
    if layout and out.ndim != layout.count(",") + 1:
        raise ConfigError(f"model.path {path} outputs shape {list(out.shape)}; the {task.name} task needs {layout}",
                          hint="import a model of this task (task: ...) or change task")
    if hasattr(task, "check_output_shape"):
        task.check_output_shape(list(out.shape), ds.info)
    if getattr(task, "outputs", None) == "logits":
        from pipeline.ocr.text_metrics import is_probabilities
        if is_probabilities(out):
            task.outputs = "probabilities"
    (ctx.out_dir / "imported").mkdir()
    shutil.copy2(path, ctx.out_dir / "imported" / "model.onnx")     # downstream stages read the run
    _, val_out, val_metrics, k = write_reference(ctx, task, None, ds, spec,
                                                 forward=lambda x: onnx_import.reference_outputs(path, x))
    record = {"path": str(path), "sha256": onnx_import.file_hashes(path), "input": sig["input"],
              "input_shape": sig["input_shape"], "opset": sig["opset"], "output_per_sample": list(out.shape[1:]),
              "outputs": getattr(task, "outputs", "logits"), "reference": onnx_import.REFERENCE_SETTINGS}
    write_info(ctx, task, ds, spec, source="onnx", imported=record)
    metric = task.primary_metric
    loaded = Gate("train", "imported ONNX model: signature and outputs", "float32", "float32", metric, status=OK,
                  checks=[Check("finite", float(count_nonfinite(val_out)), 0.0, "<=", True),
                          Check("input/output signature fits the task", 1.0, 1.0, ">=", True)])
    gate = metric_gate(cfg, "imported ONNX model on validation (ORT fp32, basic opt)", metric,
                       val_metrics[metric], "float32", "float32")
    return StageResult(gates=[loaded, gate], precision={"requested": "float32", "effective": "float32"},
                       metrics={**val_metrics, "val_samples": int(len(ds.val.labels))},
                       info={"imported": record, "val_slice": k})

