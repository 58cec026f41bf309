"""The model a training run starts from and the one it hands on: the model built and checked against the data before
any training time is spent (with the pretrained starting point's metrics), the plain fp32 model holding the best
weights (BatchNorm statistics re-estimated when asked), and the files every later stage is gated on: val_slice.npz,
calib.npz, info.json."""
from __future__ import annotations

import io
import json
import logging

import numpy as np

from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text
from pipeline.core.errors import NonFiniteError
from pipeline.data.preprocess import to_tensor
from pipeline.models import imported
from pipeline.training import amp
from pipeline.training.checks import check_labels, note_output_kind, output_shape

log = logging.getLogger("pipeline")


def checked_model(cfg, task, ds, spec):
    """The model to train, checked against the data before any training time is spent ->
    (model, pretrained, first batch, initial weights, pretrained metrics)."""
    model, pretrained = imported.build(task, cfg.section("model")["model"], ds.info)
    first = to_tensor(ds.train.images[:cfg.train.batch_size], spec)
    shape = output_shape(model, first, task, cfg.model.name)
    if hasattr(task, "check_output_shape"):
        task.check_output_shape(shape, ds.info)          # e.g. CTC time steps from the model itself
    note_output_kind(task, model, first)
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    before = pretrained_metrics(task, model, ds, spec) if pretrained else {}
    classes = shape[-1]
    if getattr(task, "labels_are_classes", True):     # detection labels are quads, not class ids
        check_labels(classes, ds.train.labels, "training set")
        check_labels(classes, ds.val.labels, "validation set")
    return model, pretrained, first, initial, before


def pretrained_metrics(task, model, ds, spec) -> dict:
    """The starting point's validation metrics, so a fine-tune reports before vs after."""
    from pipeline.training.loop import predict

    out = task.metrics(predict(model, to_tensor(ds.val.images, spec), batch=16), ds.val.labels)
    log.info("[train] pretrained model before training: %s", out)
    return {f"pretrained_{k}": v for k, v in out.items()}


def reference_model(cfg, task, ds, spec, best_state):
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

