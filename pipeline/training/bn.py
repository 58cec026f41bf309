"""BatchNorm running statistics: re-estimate them after training, and tell when they have not settled.

A short training run leaves BN's running mean/variance (momentum 0.9: an exponential average over
the last ~10 steps of a moving network) far from the statistics of the final weights. Eval mode
then uses wrong normalisation: train-mode accuracy on a batch can be 1.00 while eval mode says 0.08.
"""
from __future__ import annotations

import numpy as np

RECALIBRATE_BATCHES = 32     # enough batches for a stable average, cheap next to training
UNSETTLED_GAP = 0.2          # train-mode metric this far above eval-mode on the same batch: BN is off


def bn_layers(model) -> list:
    from paddle import nn

    kinds = tuple(k for k in (getattr(nn.layer.norm, "_BatchNormBase", None), nn.BatchNorm) if k is not None)
    return [m for m in model.sublayers(include_self=True) if isinstance(m, kinds)]


def recalibrate(model, x: np.ndarray, batch_size: int, max_batches: int = RECALIBRATE_BATCHES) -> dict:
    """Reset every BN layer's running statistics and re-estimate them as the plain average over up to
    max_batches training batches (forward only, train mode, no gradients), like torch's update_bn."""
    import paddle

    layers = bn_layers(model)
    if not layers:
        return {"layers": 0, "batches": 0, "samples": 0}
    saved = [layer._momentum for layer in layers]
    for layer in layers:
        layer._mean.set_value(paddle.zeros_like(layer._mean))
        layer._variance.set_value(paddle.ones_like(layer._variance))
    model.train()
    n = 0
    with paddle.no_grad():
        for i in range(0, len(x), batch_size):
            if n == max_batches or len(x[i:i + batch_size]) < 2:
                break
            for layer in layers:        # running = (n/(n+1)) running + (1/(n+1)) batch: a cumulative mean
                layer._momentum = n / (n + 1)
            model(paddle.to_tensor(x[i:i + batch_size]))
            n += 1
    for layer, m in zip(layers, saved):
        layer._momentum = m
    model.eval()
    return {"layers": len(layers), "batches": n, "samples": int(min(len(x), n * batch_size))}


def train_vs_eval(model, task, x: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(train-mode, eval-mode) primary metric of the same batch; no weights change (no_grad), but BN
    running statistics would, so they are restored afterwards."""
    import paddle

    layers = bn_layers(model)
    saved = [(layer._mean.numpy().copy(), layer._variance.numpy().copy()) for layer in layers]
    metric = task.primary_metric
    with paddle.no_grad():
        model.train()
        train_out = model(paddle.to_tensor(x)).astype("float32").numpy()
        model.eval()
        eval_out = model(paddle.to_tensor(x)).astype("float32").numpy()
    for layer, (m, v) in zip(layers, saved):
        layer._mean.set_value(m)
        layer._variance.set_value(v)
    return task.metrics(train_out, labels)[metric], task.metrics(eval_out, labels)[metric]
