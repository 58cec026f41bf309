"""What a training run checks before and after it spends time: seed and device, the data set, the model's output on
one input (parameters, rank, classes), labels against the model's outputs, the AMP pre-check, and that training
changed some weight; each refusal is one line naming the key to change."""
from __future__ import annotations

import logging
import math
import random

import numpy as np

from pipeline.core import env
from pipeline.core.errors import ConfigError, DataError, NonFiniteError
from pipeline.models import imported
from pipeline.training import amp

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


def first_line(exc: BaseException) -> str:
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
        raise ConfigError(f"model.name '{name}' fails on one input of shape {list(x[:1].shape)}: {first_line(exc)}",
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


def note_output_kind(task, model, x: np.ndarray) -> None:
    """A model ending in softmax (PaddleOCR's recognizers and cls) gets a loss and gates that know it."""
    from pipeline.training.loop import predict

    if getattr(task, "outputs", None) == "logits":        # detection maps are probabilities by definition
        from pipeline.ocr.text_metrics import is_probabilities
        if is_probabilities(predict(model, x[:4])):
            task.outputs = "probabilities"
            log.info("[train] the model outputs probabilities (softmax): the loss gets log-probabilities, gates "
                     "compare probabilities")


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

