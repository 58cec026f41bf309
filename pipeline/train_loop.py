"""The epoch loop: AMP step with the correct scaler idiom, non-finite guard, telemetry, checkpoints.

Resume is exact on CPU: batches come from an RNG seeded per epoch and paddle is re-seeded at
every epoch start, so epoch e is the same whether or not the process died before it.
Under `paddle.distributed.launch` (see pipeline/distributed.py) every rank draws the same
permutation and takes its own contiguous share of each global batch (train.batch_size), so the
global batches, step count and learning rate are those of one process; DataParallel averages the
gradients and BatchNorm running statistics are averaged over ranks after every epoch. Only rank 0
writes anything.
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
from .distributed import world
from .errors import ConfigError, NonFiniteError
from .preprocess import to_tensor

log = logging.getLogger("pipeline")

NONFINITE_HINT = ("black-list unstable ops (train.amp.custom_black_list=[exp,softmax]), switch "
                  "train.amp.dtype=bfloat16, or lower train.lr")


def peak_memory_mb(device: str) -> float:
    import paddle

    if device == "gpu":
        return paddle.device.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux: KiB


def predict(model, x: np.ndarray, batch: int = 32, cast=None) -> np.ndarray:
    """Outputs as float32 numpy; `cast` (a context factory) is needed for an O2 model's fp16 weights.
    Batches of 32: a PP-OCRv4 recognizer takes ~60 MB of activations per line in dygraph."""
    import contextlib

    import paddle

    model.eval()
    outs = []
    with paddle.no_grad(), (cast or contextlib.nullcontext)():
        for i in range(0, len(x), batch):
            outs.append(model(paddle.to_tensor(x[i:i + batch])).astype("float32").numpy())
    model.train()
    return np.concatenate(outs)


def effective_lr(tr) -> tuple[float, str]:
    """(peak lr, how it was derived). Scaling follows the global batch only, never the process count."""
    if tr.lr_scaling == "none":
        return tr.lr, "train.lr as given (train.lr_scaling=none)"
    ratio = tr.batch_size / tr.lr_base_batch
    factor = ratio if tr.lr_scaling == "linear" else math.sqrt(ratio)
    return tr.lr * factor, (f"train.lr {tr.lr:g} x {factor:.4g} ({tr.lr_scaling}: batch_size {tr.batch_size} / "
                            f"lr_base_batch {tr.lr_base_batch})")


def build_optimizer(tr, model, steps_per_epoch: int):
    import paddle

    total = tr.epochs * steps_per_epoch
    peak, _ = effective_lr(tr)
    lr = paddle.optimizer.lr.CosineAnnealingDecay(peak, T_max=total) if tr.scheduler == "cosine" else \
        paddle.optimizer.lr.LambdaDecay(peak, lambda _: 1.0)
    if tr.warmup_epochs:
        lr = paddle.optimizer.lr.LinearWarmup(lr, tr.warmup_epochs * steps_per_epoch, 0.0, peak)
    decay = paddle.regularizer.L2Decay(tr.weight_decay) if tr.weight_decay else None
    if tr.optimizer == "adam":
        opt = paddle.optimizer.Adam(lr, parameters=model.parameters(), weight_decay=decay)
    else:
        opt = paddle.optimizer.Momentum(lr, momentum=0.9, parameters=model.parameters(), weight_decay=decay)
    return opt, lr


class NonFiniteGuard:
    """Counts consecutive non-finite losses; K in a row stops training with advice."""

    def __init__(self, limit: int, kept: str = "no checkpoint was written yet"):
        self.limit, self.streak, self.total = limit, 0, 0
        self.kept = kept            # what survives: updated by the loop after every checkpoint

    def check(self, loss_value: float, step: int) -> bool:
        if math.isfinite(loss_value):
            self.streak = 0
            return True
        self.streak += 1
        self.total += 1
        if self.streak >= self.limit:
            raise NonFiniteError(f"train: loss was NaN/Inf for {self.streak} consecutive steps (last at step {step}, "
                                 f"limit train.max_nonfinite_steps={self.limit}); {self.kept}",
                                 hint=NONFINITE_HINT)
        return False


def require_visualdl():
    """VisualDL's LogWriter, imported lazily: the package is optional and not in requirements.txt."""
    try:
        from visualdl import LogWriter
    except ImportError:
        raise ConfigError("train.visualdl is true but the visualdl package is not installed",
                          hint="pip install visualdl into .venv, or set train.visualdl=false") from None
    return LogWriter


def open_visualdl(logdir):
    log.info("[train] VisualDL: visualdl --logdir %s", logdir)
    return require_visualdl()(logdir=str(logdir))


def _global_loss(loss, nproc: int) -> float:
    """The loss every rank agrees on (mean over ranks): one NaN anywhere stops all ranks together."""
    if nproc == 1:
        return float(loss)
    import paddle.distributed as dist

    value = loss.detach().astype("float32").reshape([1])
    dist.all_reduce(value)
    return float(value) / nproc


def _average_buffers(model, nproc: int) -> None:
    """BatchNorm running statistics are per rank (each saw its shard): average them so every rank, the
    checkpoint and the validation pass hold the statistics of the whole global batch stream."""
    if nproc == 1:
        return
    import paddle
    import paddle.distributed as dist

    for buf in model.buffers():
        if buf.dtype in (paddle.float32, paddle.float64):
            total = buf.clone()
            dist.all_reduce(total)
            paddle.assign(total / nproc, output=buf)


def _check_weights_finite(state: dict, epoch: int) -> None:
    bad = [k for k, v in state.items() if hasattr(v, "numpy") and not np.isfinite(v.numpy()).all()]
    if bad:
        raise NonFiniteError(f"train: weights became NaN/Inf during epoch {epoch} ({bad[0]} and {len(bad) - 1} more); "
                             "nothing was checkpointed for this epoch", hint=NONFINITE_HINT)


def train_model(ctx, task, model, ds, spec, plan, device: str, loss_hook=None, epoch_hook=None):
    """Train; returns (best fp32 state_dict, per-epoch history, info). Checkpoints live in ctx.work_dir.

    loss_hook(loss, step) -> loss lets tests inject a non-finite loss; epoch_hook(record) runs on every rank
    after each epoch's checkpoint (make bench-train paces its rounds with it).
    """
    import paddle

    cfg, tr = ctx.cfg, ctx.cfg.train
    from .layout import split_batch

    rank, nproc = world()
    n = len(ds.train.labels)
    global_batch = tr.batch_size
    per_rank = split_batch(global_batch, nproc)    # an uneven split is a ConfigError (checked before launch too)
    steps_per_epoch = n // global_batch            # drop_last: equal-size batches, equal steps on every rank
    opt, sched = build_optimizer(tr, model, steps_per_epoch)
    model, opt = amp.decorate(model, opt, tr.amp, plan)          # O2 first, DataParallel after (Paddle's rule)
    net = paddle.DataParallel(model) if nproc > 1 else model
    scaler = amp.make_scaler(tr.amp, plan)
    val_x = to_tensor(ds.val.images, spec)
    ckpt_dir = ctx.work_dir / "checkpoint"
    key = f"{ctx.fingerprint}-nproc{nproc}"           # a 2-process checkpoint is not a 1-process one
    start_epoch, history, best, best_state, best_bytes, best_epoch = 0, [], -math.inf, None, None, 0

    force = getattr(ctx, "force", False)
    resumed = checkpoint.load(ckpt_dir, key) if tr.resume and not force else None
    if force and tr.resume and checkpoint.current(ckpt_dir) is not None:
        log.info("[train] FORCE: not resuming from %s, training from scratch", ckpt_dir)
    if resumed:
        states, meta = resumed
        amp.load_state(model, states["model"])       # fp32 on disk; cast back to fp16 under O2
        opt.set_state_dict(states["optimizer"])
        sched.set_state_dict(states["scheduler"])
        if scaler is not None and "scaler" in states:
            scaler.load_state_dict(states["scaler"])
        best_state, best_bytes = states["best"], None
        start_epoch, history, best, best_epoch = meta["epoch"] + 1, meta["history"], meta["best"], meta["best_epoch"]
        log.info("[train] resuming after epoch %d/%d from %s", start_epoch, tr.epochs, checkpoint.current(ckpt_dir))

    vdl = open_visualdl(ctx.work_dir / "visualdl") if (tr.visualdl and rank == 0) else None
    guard = NonFiniteGuard(tr.max_nonfinite_steps)
    if resumed:
        guard.kept = f"the last good checkpoint (epoch {start_epoch}) is kept in {ckpt_dir}"
    try:
        for epoch in range(start_epoch, tr.epochs):
            epoch_seed = cfg.seed * 1000 + epoch
            # dropout etc. independent of where we resumed; each rank its own stream (rank 0's = one process's)
            paddle.seed(epoch_seed + rank * 7_919_000)
            order = np.random.default_rng(epoch_seed).permutation(n)
            t0, nonfinite, scaler_skipped, losses, lr_used = time.perf_counter(), 0, 0, [], float(sched.get_lr())
            bar = tqdm(range(steps_per_epoch), desc=f"train {epoch + 1}/{tr.epochs}",
                       disable=ctx.quiet or rank != 0, leave=False, unit="batch", dynamic_ncols=True)
            for step in bar:
                gstep = epoch * steps_per_epoch + step
                start = step * global_batch + rank * per_rank   # this rank's share of the global batch
                idx = order[start:start + per_rank]
                x = paddle.to_tensor(to_tensor(ds.train.images[idx], spec))
                y = paddle.to_tensor(ds.train.labels[idx])
                with amp.autocast(tr.amp, plan):
                    loss = task.loss(net(x), y)
                if loss_hook is not None:
                    loss = loss_hook(loss, gstep)
                value = _global_loss(loss, nproc)     # the NaN guard needs the value: one small sync per step
                if not guard.check(value, gstep):
                    nonfinite += 1
                    opt.clear_grad()
                    continue
                lr_used = float(sched.get_lr())
                if scaler is not None:
                    scaled = scaler.scale(loss)
                    scaled.backward()
                    scaler.minimize(opt, scaled)      # unscales, skips the update on inf/nan, updates the scale
                    scaler_skipped += amp.step_skipped(scaler)
                else:
                    loss.backward()
                    opt.step()
                opt.clear_grad()
                sched.step()
                losses.append(value)
                if not bar.disable and step % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}",
                                    sps=f"{(step + 1) * global_batch / (time.perf_counter() - t0):.0f}", refresh=False)
            bar.close()
            seconds = time.perf_counter() - t0
            _average_buffers(model, nproc)
            outputs = predict(model, val_x, cast=lambda: amp.autocast(tr.amp, plan))
            metric = task.metrics(outputs, ds.val.labels)[task.primary_metric]
            rec = {"epoch": epoch + 1, "loss": float(np.mean(losses)) if losses else float("nan"),
                   task.primary_metric: metric, "lr": lr_used, "loss_scale": amp.loss_scale(scaler),
                   "skipped_steps": nonfinite + scaler_skipped, "scaler_skipped_steps": scaler_skipped,
                   "nonfinite_loss_steps": nonfinite,
                   "samples_per_s": round(steps_per_epoch * global_batch / seconds, 1),
                   "peak_memory_mb": round(peak_memory_mb(device), 1), "precision": plan.effective,
                   "nproc": nproc, "seconds": round(seconds, 2)}
            history.append(rec)
            state = amp.fp32_state_dict(model)
            _check_weights_finite(state, epoch + 1)
            if metric is None or metric >= best:      # ties go to the later (longer-trained) epoch
                best, best_state, best_bytes, best_epoch = metric, state, None, epoch + 1
            if rank == 0:
                log.info("[train] epoch %d/%d loss %.4f %s %s  %.0f samples/s%s", epoch + 1, tr.epochs, rec["loss"],
                         task.primary_metric, "n/a" if metric is None else f"{metric:.4f}", rec["samples_per_s"],
                         f"  skipped {rec['skipped_steps']}" if rec["skipped_steps"] else "")
                if best_state is None or best_epoch == epoch + 1:
                    best_part = checkpoint.SameAs("model")
                else:
                    if best_bytes is None:
                        best_bytes = checkpoint.to_bytes(best_state)   # serialised once, reused every epoch
                    best_part = best_bytes
                parts = {"model": state, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "best": best_part}
                if scaler is not None:
                    parts["scaler"] = scaler.state_dict()
                checkpoint.save(ckpt_dir, key, parts, {
                    "epoch": epoch, "history": history, "best": best, "best_epoch": best_epoch,
                    "epochs": tr.epochs, "nproc": nproc,
                    # the RNG state at an epoch boundary is fully given by these seeds (re-seeded every epoch)
                    "rng": {"paddle_seed": epoch_seed + 1, "permutation_seed": epoch_seed + 1}})
                guard.kept = f"the last good checkpoint (epoch {epoch + 1}) is kept in {ckpt_dir}"
                atomic_write_text(ctx.work_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
                if vdl is not None:
                    for k in ("loss", task.primary_metric, "lr", "samples_per_s", "skipped_steps", "loss_scale"):
                        if rec.get(k) is not None:
                            vdl.add_scalar(tag=f"train/{k}", value=float(rec[k]), step=epoch + 1)
            if epoch_hook is not None:
                epoch_hook(rec)
    finally:
        if vdl is not None:
            vdl.close()
    if best_state is None:                      # resumed from a finished run's last checkpoint
        best_state = amp.fp32_state_dict(model)
    peak, lr_how = effective_lr(tr)
    info = {"resumed_after_epoch": start_epoch if resumed else None, "best_epoch": best_epoch,
            "nproc": nproc, "global_batch": global_batch, "per_process_batch": per_rank,
            "lr": {"configured": tr.lr, "effective_peak": peak, "scaling": tr.lr_scaling, "how": lr_how},
            "checkpoint": str(ckpt_dir)}
    return best_state, history, info
