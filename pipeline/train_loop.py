"""The epoch loop: AMP step with the correct scaler idiom, non-finite guard, telemetry, checkpoints.

Resume is exact on CPU: batches come from an RNG seeded per epoch and paddle is re-seeded at
every epoch start, so epoch e is the same whether or not the process died before it.
"""
from __future__ import annotations

import json
import logging
import math
import resource
import time

import numpy as np
from tqdm import tqdm

from . import amp, checkpoint
from .artifacts import atomic_write_text
from .errors import NonFiniteError
from .preprocess import to_tensor

log = logging.getLogger("pipeline")

NONFINITE_HINT = ("black-list unstable ops (train.amp.custom_black_list=[exp,softmax]), switch "
                  "train.amp.dtype=bfloat16, or lower train.lr")


def peak_memory_mb(device: str) -> float:
    import paddle

    if device == "gpu":
        return paddle.device.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux: KiB


def predict(model, x: np.ndarray, batch: int = 256) -> np.ndarray:
    import paddle

    model.eval()
    outs = []
    with paddle.no_grad():
        for i in range(0, len(x), batch):
            outs.append(model(paddle.to_tensor(x[i:i + batch])).astype("float32").numpy())
    model.train()
    return np.concatenate(outs)


def build_optimizer(tr, model, steps_per_epoch: int):
    import paddle

    total = tr.epochs * steps_per_epoch
    lr = paddle.optimizer.lr.CosineAnnealingDecay(tr.lr, T_max=total) if tr.scheduler == "cosine" else \
        paddle.optimizer.lr.LambdaDecay(tr.lr, lambda _: 1.0)
    if tr.warmup_epochs:
        lr = paddle.optimizer.lr.LinearWarmup(lr, tr.warmup_epochs * steps_per_epoch, 0.0, tr.lr)
    decay = paddle.regularizer.L2Decay(tr.weight_decay) if tr.weight_decay else None
    if tr.optimizer == "adam":
        opt = paddle.optimizer.Adam(lr, parameters=model.parameters(), weight_decay=decay)
    else:
        opt = paddle.optimizer.Momentum(lr, momentum=0.9, parameters=model.parameters(), weight_decay=decay)
    return opt, lr


class NonFiniteGuard:
    """Counts consecutive non-finite losses; K in a row stops training with advice."""

    def __init__(self, limit: int):
        self.limit, self.streak, self.total = limit, 0, 0

    def check(self, loss_value: float, step: int) -> bool:
        if math.isfinite(loss_value):
            self.streak = 0
            return True
        self.streak += 1
        self.total += 1
        if self.streak >= self.limit:
            raise NonFiniteError(f"train: loss was NaN/Inf for {self.streak} consecutive steps (last at step {step}, "
                                 f"limit train.max_nonfinite_steps={self.limit}); the last good checkpoint is kept",
                                 hint=NONFINITE_HINT)
        return False


def train_model(ctx, task, model, ds, spec, plan, device: str, loss_hook=None):
    """Train; returns (best fp32 state_dict, per-epoch history). Checkpoints live in ctx.work_dir.

    loss_hook(loss, step) lets tests inject a non-finite loss.
    """
    import paddle

    cfg, tr = ctx.cfg, ctx.cfg.train
    n = len(ds.train.labels)
    steps_per_epoch = n // tr.batch_size            # drop_last: equal-size batches, stable BN statistics
    opt, sched = build_optimizer(tr, model, steps_per_epoch)
    if plan.enabled and plan.level == "O2":
        model, opt = paddle.amp.decorate(models=model, optimizers=opt, level="O2", master_weight=True,
                                         dtype=plan.dtype)
    scaler = amp.make_scaler(tr.amp, plan)
    val_x = to_tensor(ds.val.images, spec)
    ckpt_dir = ctx.work_dir / "checkpoint"
    key = ctx.fingerprint
    start_epoch, history, best, best_state = 0, [], -1.0, None

    resumed = checkpoint.load(ckpt_dir, key) if tr.resume else None
    if resumed:
        states, meta = resumed
        model.set_state_dict(states["model"])
        opt.set_state_dict(states["optimizer"])
        if scaler is not None and "scaler" in states:
            scaler.load_state_dict(states["scaler"])
        best_state = states.get("best")
        start_epoch, history, best = meta["epoch"] + 1, meta["history"], meta["best"]
        log.info("[train] resuming after epoch %d from %s", meta["epoch"] + 1, ckpt_dir)

    guard = NonFiniteGuard(tr.max_nonfinite_steps)
    for epoch in range(start_epoch, tr.epochs):
        paddle.seed(cfg.seed * 1000 + epoch)          # dropout etc. independent of where we resumed
        order = np.random.default_rng(cfg.seed * 1000 + epoch).permutation(n)
        t0, skipped, losses = time.perf_counter(), 0, []
        bar = tqdm(range(steps_per_epoch), desc=f"train {epoch + 1}/{tr.epochs}", disable=ctx.quiet,
                   leave=False, unit="batch", dynamic_ncols=True)
        for step in bar:
            idx = order[step * tr.batch_size:(step + 1) * tr.batch_size]
            x = paddle.to_tensor(to_tensor(ds.train.images[idx], spec))
            y = paddle.to_tensor(ds.train.labels[idx])
            with amp.autocast(tr.amp, plan):
                loss = task.loss(model(x), y)
            if loss_hook is not None:
                loss = loss_hook(loss, epoch * steps_per_epoch + step)
            value = float(loss)
            if not guard.check(value, epoch * steps_per_epoch + step):
                skipped += 1
                opt.clear_grad()
                continue
            if scaler is not None:
                scaled = scaler.scale(loss)
                scaled.backward()
                scaler.minimize(opt, scaled)          # unscales, skips on inf/nan, updates the scale
                if bool(getattr(scaler, "_found_inf", False)):
                    skipped += 1
            else:
                loss.backward()
                opt.step()
            opt.clear_grad()
            sched.step()
            losses.append(value)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}",
                                sps=f"{(step + 1) * tr.batch_size / (time.perf_counter() - t0):.0f}")
        bar.close()
        seconds = time.perf_counter() - t0
        metric = task.metrics(predict(model, val_x), ds.val.labels)[task.primary_metric]
        rec = {"epoch": epoch + 1, "loss": float(np.mean(losses)) if losses else float("nan"),
               task.primary_metric: metric, "lr": float(sched.get_lr()),
               "loss_scale": float(scaler._scale.item()) if scaler is not None else None,
               "skipped_steps": skipped, "samples_per_s": round(steps_per_epoch * tr.batch_size / seconds, 1),
               "peak_memory_mb": round(peak_memory_mb(device), 1), "precision": plan.effective,
               "seconds": round(seconds, 2)}
        history.append(rec)
        log.info("[train] epoch %d/%d loss %.4f %s %.4f  %.0f samples/s", epoch + 1, tr.epochs, rec["loss"],
                 task.primary_metric, metric, rec["samples_per_s"])
        state = amp.fp32_state_dict(model)
        if metric > best:
            best, best_state = metric, state
        parts = {"model": state, "optimizer": opt.state_dict(), "best": best_state}
        if scaler is not None:
            parts["scaler"] = scaler.state_dict()
        checkpoint.save(ckpt_dir, key, parts, {"epoch": epoch, "history": history, "best": best,
                                               "parts": list(parts)})
    return best_state, history
