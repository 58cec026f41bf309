"""train: dygraph training through the AMP API → fp32 parameters, metrics, reference outputs.

Writes: model.pdparams (the best epoch's weights, float32), info.json (labels/charset, pre/post-processing
spec), val_slice.npz (inputs, labels and the trained model's outputs: the reference every later stage is
gated on), calib.npz (INT8 calibration inputs), metrics.jsonl (per-epoch telemetry). The manifest records
requested vs effective precision. The epoch loop, checkpoints/resume and the NaN guard live in
pipeline/training/loop.py; multi-process runs in pipeline/training/distributed.py.
"""
from __future__ import annotations

import json
import logging
import io
import math
import random

import numpy as np

from pipeline.training import amp, checkpoint
from pipeline.core import env
from pipeline import ocr
from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text
from pipeline.training.distributed import launch_stage
from pipeline.core.errors import ConfigError, DataError, NonFiniteError
from pipeline.core.gates import FAIL, OK, SKIPPED, Check, Gate, count_nonfinite
from pipeline.models import imported
from pipeline.data.preprocess import to_tensor
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.tasks import get_task

log = logging.getLogger("pipeline")


def seed_everything(seed: int) -> None:
    import paddle

    paddle.seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def pick_device(wanted: str) -> str:
    import paddle

    caps = env.capabilities()
    if wanted == "gpu" and not caps["gpu"]:
        raise ConfigError("train.device is 'gpu' but Paddle sees no GPU (CPU build or no device)",
                          hint="use train.device=auto or install the GPU build (make setup DEVICE=gpu)")
    device = "gpu" if (wanted in ("auto", "gpu") and caps["gpu"]) else "cpu"
    paddle.set_device(device)
    return device


def check_data(cfg, ds) -> None:
    tr = cfg.train
    n = len(ds.train.labels)
    if n == 0 or len(ds.val.labels) == 0:
        raise DataError("training or validation set is empty", hint="check data.path / data.num_*")
    from pipeline.tasks.base import has_labels
    if not has_labels(ds.train.labels):
        raise ConfigError(f"data.source={cfg.data.source} has no labels: there is nothing to train on",
                          hint="import the model as it is (model.source=inference) or give labelled data")
    if tr.batch_size > n:
        raise ConfigError(f"train.batch_size {tr.batch_size} (the global batch) is larger than the training set "
                          f"({n} samples)", hint=f"set train.batch_size <= {n}")


def _first_line(exc: BaseException) -> str:
    text = next((l.strip() for l in str(exc).splitlines() if l.strip()), "")
    return f"{type(exc).__name__}: {text[:200]}"


def output_shape(model, x: np.ndarray, task=None, name: str = "model") -> list[int]:
    """Shape of the model's output on one sample (a fact of the model: classes, CTC time steps).

    With a task, this is also the model's entrance check: a model without parameters, one that
    fails on the configured input, or one whose output rank does not fit the task is refused here,
    in one line naming model.name, instead of deep inside the optimizer or the loss."""
    import paddle

    if task is not None and not model.parameters():
        raise ConfigError(f"model.name '{name}' has no trainable parameters: there is nothing to train",
                          hint="choose a model with weights (e.g. small_cnn or paddle.vision.models:...)")
    model.eval()
    try:
        with paddle.no_grad():
            out = model(paddle.to_tensor(x[:1]))
    except Exception as exc:               # the user's forward() on our input: any error is a config problem
        raise ConfigError(f"model.name '{name}' fails on one input of shape {list(x[:1].shape)}: {_first_line(exc)}",
                          hint="check model.args and data.channels / data.height / data.width") from None
    finally:
        model.train()
    if not hasattr(out, "shape"):
        raise ConfigError(f"model.name '{name}' returns {type(out).__name__}, not one tensor",
                          hint="the model's forward() must return the logits tensor")
    layout = getattr(task, "output_layout", None)
    rank = layout.count(",") + 1 if layout else None
    if rank is not None and len(out.shape) != rank:
        raise ConfigError(f"model.name '{name}' outputs shape {list(out.shape)} (rank {len(out.shape)}); "
                          f"the {task.name} task needs rank {rank}: {layout}",
                          hint=f"end the model with layers that produce {layout} (e.g. Flatten + Linear)")
    return [int(d) for d in out.shape]


def output_classes(model, x: np.ndarray, task=None, name: str = "model") -> int | None:
    """Size of the model's last output dimension, from one forward pass on one sample."""
    return output_shape(model, x, task, name)[-1]


def check_labels(classes: int | None, labels: np.ndarray, where: str) -> None:
    """Labels must index the model's outputs: a label past the last class crashes (or silently
    corrupts) cross-entropy deep inside Paddle, so say which label and which model size instead."""
    if classes is None:
        return
    valid = labels[labels >= 0] if labels.ndim > 1 else labels     # recognition pads with -1
    bad = valid[(valid < 0) | (valid >= classes)] if valid.size else valid
    if bad.size:
        raise DataError(f"{where}: label {int(bad[0])} is out of range for a model with {classes} outputs "
                        f"({bad.size} such labels)", hint="check the label files / class folders against the model")


def precheck_amp(cfg, model, plan, x: np.ndarray):
    """Ultralytics-style: an AMP forward must agree with fp32 before we trust AMP for a whole run."""
    import paddle

    pc = cfg.train.amp.precheck
    if not (plan.enabled and pc.enable):
        return plan, None
    model.eval()
    with paddle.no_grad():
        ref = model(paddle.to_tensor(x)).astype("float32").numpy()
        with amp.autocast(cfg.train.amp, plan):
            low = model(paddle.to_tensor(x)).astype("float32").numpy()
    model.train()
    diff = float(np.abs(ref - low).max()) if np.isfinite(low).all() else math.inf
    if diff <= pc.atol:
        return plan, diff
    msg = f"AMP pre-check: max |fp32 - {plan.effective}| = {diff:.3g} > {pc.atol}"
    if pc.on_fail == "fail":
        raise NonFiniteError(f"train: {msg}", hint="black-list unstable ops (train.amp.custom_black_list) or use bfloat16")
    log.warning("[train] %s: falling back to float32", msg)
    plan.enabled, plan.effective, plan.reason = False, "float32", msg
    return plan, diff


def _bn_diagnosis(cfg, task, model, x: np.ndarray, labels: np.ndarray, gate: Gate) -> str:
    """When the train gate fails: is it BatchNorm's running statistics rather than the weights?
    Train mode (batch statistics) far above eval mode (running statistics) on the same batch says so."""
    from pipeline.training import bn

    if not bn.bn_layers(model):
        return ""
    n = min(len(x), cfg.train.batch_size)
    train_m, eval_m = bn.train_vs_eval(model, task, x[:n], labels[:n])
    gate.extra["bn_check"] = {"train_mode": train_m, "eval_mode": eval_m, "samples": n}
    if train_m - eval_m < bn.UNSETTLED_GAP:
        return (f"the weights are undertrained (train-mode {task.primary_metric} {train_m:.2f} on the same samples): "
                "raise train.epochs or tune train.lr")
    done = " (already re-estimated: train longer or lower train.lr)" if cfg.train.bn_recalibrate else \
        ": set train.bn_recalibrate=true to re-estimate them on training batches after training, or train longer"
    return (f"BatchNorm running statistics have not settled: on the same {n} validation samples train-mode "
            f"{task.primary_metric} is {train_m:.2f} but eval-mode {eval_m:.2f}{done}")


def run(ctx: StageContext) -> StageResult:
    import paddle  # noqa: F401  (loaded before the model code, as the stage always did)

    from pipeline.training.distributed import world
    from pipeline.training.loop import require_visualdl, train_model

    cfg = ctx.cfg
    if cfg.model.source == "onnx":
        return import_onnx(ctx)
    if cfg.model.source in ("inference", "pir"):
        return import_model(ctx)
    if cfg.train.visualdl:
        require_visualdl()                  # missing package: fail now, not after training
    task = get_task(cfg.task, cfg.section("detection")["detection"])
    seed_everything(cfg.seed)
    device = pick_device(cfg.train.device)
    _, nproc = world()
    ds = task.load_data(cfg.section("data")["data"], cfg.seed)
    check_data(cfg, ds)
    spec = task.preprocess_spec(cfg.section("data")["data"], ds.info)
    model, pretrained, first, initial, before = _checked_model(cfg, task, ds, spec)
    plan = amp.plan(cfg.train.amp, device, env.capabilities())
    plan, precheck_diff = precheck_amp(cfg, model, plan, first)

    best_state, history, train_info = train_model(ctx, task, model, ds, spec, plan, device)
    moved = check_weights_moved(model, initial, best_state, cfg.train.lr)
    model, best_state, bn_info = _reference_model(cfg, task, ds, spec, best_state)

    val_x, val_out, val_metrics, k = write_reference(ctx, task, model, ds, spec)
    atomic_write_bytes(ctx.out_dir / "model.pdparams", checkpoint.stable_state_bytes(best_state))
    write_info(ctx, task, ds, spec)
    atomic_write_text(ctx.out_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))

    gate = _validation_gate(cfg, task, model, val_x, ds, plan, val_metrics[task.primary_metric], history)
    return StageResult(
        gates=[gate],
        precision={**plan.as_record(), "device": device, "amp_precheck_max_abs_diff": precheck_diff},
        metrics={**val_metrics, **moved, **before, "epochs": len(history), "best_epoch": train_info["best_epoch"],
                 "skipped_steps": sum(h["skipped_steps"] for h in history),
                 "scaler_skipped_steps": sum(h.get("scaler_skipped_steps", 0) for h in history),
                 "nonfinite_loss_steps": sum(h.get("nonfinite_loss_steps", 0) for h in history),
                 "samples_per_s": gate.extra["samples_per_s"],
                 "train_samples": int(len(ds.train.labels)), "val_samples": int(len(ds.val.labels)),
                 "skipped_samples": int(ds.train.skipped + ds.val.skipped)},
        info={"pretrained": pretrained, "bn_recalibrated": bn_info, "device": device, "val_slice": k, "nproc": nproc, "global_batch": train_info["global_batch"],
              "per_process_batch": train_info["per_process_batch"], "lr": train_info["lr"],
              "resumed_after_epoch": train_info["resumed_after_epoch"], "checkpoint": train_info["checkpoint"]},
    )


def _checked_model(cfg, task, ds, spec):
    """The model to train, checked against the data before any training time is spent ->
    (model, pretrained, first batch, initial weights, pretrained metrics)."""
    model, pretrained = imported.build(task, cfg.section("model")["model"], ds.info)
    first = to_tensor(ds.train.images[:cfg.train.batch_size], spec)
    shape = output_shape(model, first, task, cfg.model.name)
    if hasattr(task, "check_output_shape"):
        task.check_output_shape(shape, ds.info)          # e.g. CTC time steps from the model itself
    _note_output_kind(task, model, first)
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    before = _pretrained_metrics(task, model, ds, spec) if pretrained else {}
    classes = shape[-1]
    if getattr(task, "labels_are_classes", True):     # detection labels are quads, not class ids
        check_labels(classes, ds.train.labels, "training set")
        check_labels(classes, ds.val.labels, "validation set")
    return model, pretrained, first, initial, before


def _reference_model(cfg, task, ds, spec, best_state):
    """-> (plain fp32 model with the best weights, its state, BN recalibration info or None)."""
    # the reference outputs come from a plain fp32 model holding the exported weights (not the O2 model)
    model, _ = imported.build(task, cfg.section("model")["model"], ds.info, load_pretrained=False)
    amp.load_state(model, best_state)
    bn_info = None
    if cfg.train.bn_recalibrate:       # before the reference outputs: every later stage sees these statistics
        from pipeline.training import bn
        n = min(len(ds.train.labels), cfg.train.batch_size * bn.RECALIBRATE_BATCHES)
        bn_info = bn.recalibrate(model, to_tensor(ds.train.images[:n], spec), cfg.train.batch_size)
        best_state = amp.fp32_state_dict(model)
        log.info("[train] BatchNorm statistics re-estimated: %d layers, %d batches", bn_info["layers"],
                 bn_info["batches"])
    return model, best_state, bn_info


def _validation_gate(cfg, task, model, val_x, ds, plan, value, history) -> Gate:
    metric = task.primary_metric
    gate = metric_gate(cfg, "dygraph validation", metric, value, plan.requested, plan.effective)
    if plan.differs:        # the summary prints the reason as a note: requested vs what really ran
        gate.reason = plan.reason
    if gate.status == FAIL and value is not None:
        diagnosis = _bn_diagnosis(cfg, task, model, val_x, ds.val.labels, gate)
        gate.reason = "; ".join(filter(None, [gate.checks[0].describe(), diagnosis, gate.reason]))
    gate.seconds = sum(h["seconds"] for h in history)
    steady = [h["samples_per_s"] for h in history[1:]] or [h["samples_per_s"] for h in history]
    gate.extra = {"samples_per_s": float(np.median(steady)) if steady else None}
    return gate


def _note_output_kind(task, model, x: np.ndarray) -> None:
    """A model ending in softmax (PaddleOCR's recognizers and cls) gets a loss and gates that know it."""
    from pipeline.training.loop import predict

    if getattr(task, "outputs", None) == "logits":        # detection maps are probabilities by definition
        from pipeline.ocr.text_metrics import is_probabilities
        if is_probabilities(predict(model, x[:4])):
            task.outputs = "probabilities"
            log.info("[train] the model outputs probabilities (softmax): the loss gets log-probabilities, gates "
                     "compare probabilities")


def _pretrained_metrics(task, model, ds, spec) -> dict:
    """The starting point's validation metrics, so a fine-tune reports before vs after."""
    from pipeline.training.loop import predict

    out = task.metrics(predict(model, to_tensor(ds.val.images, spec), batch=16), ds.val.labels)
    log.info("[train] pretrained model before training: %s", out)
    return {f"pretrained_{k}": v for k, v in out.items()}


def check_weights_moved(model, initial: dict, final: dict, lr: float) -> dict:
    """A training run that changed no weight fails, naming the likely cause (a jit.load-ed program's
    outputs with stop_gradient=True were the real case): exit 0 with the start weights is worse than an error."""
    changed, total = imported.changed_tensors(initial, final)
    if total and changed == 0:
        rounding = imported.rounding_only(initial, final)
        raise NonFiniteError(f"train: no weight changed in training (0 of {total} tensors): "
                             f"{imported.unchanged_cause(model, lr, rounding)}")
    log.info("[train] %d of %d weight tensors changed (%.1f %%)", changed, total, 100.0 * changed / max(total, 1))
    return {"tensors_changed": changed, "tensors_total": total}


def metric_gate(cfg, subject: str, metric: str, value, requested: str, effective: str) -> Gate:
    """validation metric >= train.min_metric; without labels the gate says so (SKIPPED) instead of a number."""
    gate = Gate("train", subject, requested, effective, metric, value=value)
    if value is None:
        gate.status, gate.reason = SKIPPED, (f"no labels (data.source={cfg.data.source}): {metric} not measured; "
                                             "the parity gates of later stages still hold")
        return gate
    gate.checks = [Check(metric, value, cfg.train.min_metric, ">=", value >= cfg.train.min_metric, key="train.min_metric")]
    gate.status = OK if gate.checks[0].passed else FAIL
    return gate


def write_reference(ctx, task, model, ds, spec, forward=None):
    """val_slice.npz (inputs, images, labels, fp32 outputs) and calib.npz (the tuning split: INT8 calibration
    inputs and their labels, so keep/skip lists are judged by the whole gate there, lines lost included).
    forward(x) -> outputs replaces the dygraph model's (an import's reference engine)."""
    from pipeline.training.loop import predict

    cfg = ctx.cfg
    val_x = to_tensor(ds.val.images, spec)
    val_out = forward(val_x) if forward else predict(model, val_x, batch=16)
    if not np.isfinite(val_out).all():
        raise NonFiniteError("train: the model produces NaN/Inf on the validation set",
                             hint="lower train.lr or black-list exp/softmax under AMP")
    k = min(cfg.train.val_slice, len(val_x))
    buf = io.BytesIO()
    np.savez(buf, inputs=val_x[:k], images=ds.val.images[:k], labels=ds.val.labels[:k], outputs=val_out[:k])
    atomic_write_bytes(ctx.out_dir / "val_slice.npz", buf.getvalue())
    # calibration samples for INT8 (PTQ) come from the training set, never from validation
    n_cal = min(len(ds.train.labels), 512)
    buf = io.BytesIO()
    np.savez(buf, inputs=to_tensor(ds.train.images[:n_cal], spec), labels=ds.train.labels[:n_cal])
    atomic_write_bytes(ctx.out_dir / "calib.npz", buf.getvalue())
    return val_x, val_out, task.metrics(val_out, ds.val.labels), k


def write_info(ctx, task, ds, spec, **extra) -> dict:
    cfg = ctx.cfg
    width = -1 if spec.get("dynamic_width") else spec["width"]
    info = {"task": cfg.task, "model": cfg.section("model")["model"], "labels_info": ds.info,
            "preprocess": spec, "postprocess": task.postprocess_spec(ds.info), "primary_metric": task.primary_metric,
            "input_shape": [-1, spec.get("channels", 1), spec["height"], width], **extra}
    atomic_write_text(ctx.out_dir / "info.json", json.dumps(info, indent=2))
    return info


def _import_forward(model, x: np.ndarray, task, prefix) -> list[int]:
    """One forward pass of the imported program: its output must fit the task (rank, classes, CTC steps)."""
    import paddle

    try:
        with paddle.no_grad():
            out = model(paddle.to_tensor(x[:1]))
    except Exception as exc:                  # the program on our input: a configuration mismatch
        raise ConfigError(f"model.path {prefix} fails on one input of shape {list(x[:1].shape)}: {_first_line(exc)}",
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
        prefix, pir = imported.translate_pir(cfg.model.path, ctx.out_dir, {"data": data_cfg, "detection": det_cfg})
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
    _note_output_kind(task, model, first)
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
        raise ConfigError(f"model.path {path} fails on inputs of shape {list(first.shape)}: {_first_line(exc)}",
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


STAGE = Stage(name="train", inputs=(), config_keys=("task", "seed", "data", "model", "train", "detection"),
              make_target="train", run=run, layout_keys=("train.nproc",), launcher=launch_stage,
              outputs=("info.json", "val_slice.npz", "calib.npz"),
              # trained: weights and telemetry; imported (model.source=inference): the program's files
              optional_outputs=("model.pdparams", "metrics.jsonl", "imported/inference.pdmodel",
                                "imported/inference.pdiparams", "imported/model.onnx"),
              code_deps=("pipeline/training/loop.py", "pipeline/training/amp.py", "pipeline/training/bn.py", "pipeline/training/checkpoint.py", "pipeline/training/static_bf16.py",
                         "pipeline/training/bf16_route.py", "pipeline/tasks",
                         *ocr.TRAIN_DEPS, "pipeline/models", "pipeline/data", "pipeline/data/preprocess.py",
                         "pipeline/ocr/text_metrics.py", "pipeline/core/process_layout.py"),
              description="AMP training on the configured task")
