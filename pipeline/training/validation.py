"""The train stage's verdicts: the validation metric against train.min_metric (SKIPPED without labels), and when it
fails, whether BatchNorm's running statistics rather than the weights are the cause."""
from __future__ import annotations

import numpy as np

from pipeline.core.gates import FAIL, OK, SKIPPED, Check, Gate


def validation_gate(cfg, task, model, val_x, ds, plan, value, history) -> Gate:
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

