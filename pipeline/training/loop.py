"""The epoch loop: AMP step with the correct scaler idiom, non-finite guard, telemetry, checkpoints.

Resume is exact on CPU: batches come from an RNG seeded per epoch and paddle is re-seeded at
every epoch start, so epoch e is the same whether or not the process died before it.
Under `paddle.distributed.launch` (see pipeline/training/distributed.py) every rank draws the same
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.training import amp, checkpoint
from pipeline.core import console, resources
from pipeline.core.artifacts import atomic_write_text
from pipeline.training.distributed import world
from pipeline.core.errors import ConfigError, IntegrityError, NonFiniteError
from pipeline.data.preprocess import to_tensor

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


@dataclass
class _Loop:
    """The fixed parts of one training run, shared by its epochs (built once: DataParallel and AMP wrap once)."""
    ctx: Any
    task: Any
    model: Any                  # the AMP-decorated model (fp16 weights under O2)
    net: Any                    # DataParallel(model) across processes, else the model itself
    opt: Any
    sched: Any
    scaler: Any
    ds: Any
    spec: Any
    plan: Any
    device: str
    rank: int
    nproc: int
    per_rank: int
    steps_per_epoch: int
    val_x: np.ndarray
    ckpt_dir: Any
    key: str
    loss_hook: Any = None
    static: Any = None          # StaticBf16Trainer on the static-bf16 route (opt/sched are then its own)


@dataclass
class _Progress:
    """What a checkpoint carries across epochs and restarts: the history and the best epoch so far."""
    start_epoch: int = 0
    history: list = field(default_factory=list)
    best: float = -math.inf
    best_state: dict | None = None
    best_bytes: bytes | None = None     # best_state serialised, kept while the best epoch is not the latest
    best_epoch: int = 0


def train_model(ctx, task, model, ds, spec, plan, device: str, loss_hook=None, epoch_hook=None):
    """Train; returns (best fp32 state_dict, per-epoch history, info). Checkpoints live in ctx.work_dir.

    loss_hook(loss, step) -> loss lets tests inject a non-finite loss; epoch_hook(record) runs on every rank
    after each epoch's checkpoint (make bench-train paces its rounds with it).
    """
    tr = ctx.cfg.train
    lp = _make_loop(ctx, task, model, ds, spec, plan, device, loss_hook)
    prog, resumed = _resume_state(lp)
    vdl = open_visualdl(ctx.work_dir / "visualdl") if (tr.visualdl and lp.rank == 0) else None
    guard = NonFiniteGuard(tr.max_nonfinite_steps)
    if resumed:
        guard.kept = f"the last good checkpoint (epoch {prog.start_epoch}) is kept in {lp.ckpt_dir}"
    try:
        for epoch in range(prog.start_epoch, tr.epochs):
            rec = _train_epoch(lp, prog, epoch, guard, vdl)
            if epoch_hook is not None:
                epoch_hook(rec)
    finally:
        if vdl is not None:
            vdl.close()
    if prog.best_state is None:                 # resumed from a finished run's last checkpoint
        prog.best_state = amp.fp32_state_dict(lp.model)
    return prog.best_state, prog.history, _train_info(lp, prog, resumed)


def _make_loop(ctx, task, model, ds, spec, plan, device: str, loss_hook) -> _Loop:
    import paddle

    from pipeline.core.process_layout import split_batch

    tr = ctx.cfg.train
    rank, nproc = world()
    n = len(ds.train.labels)
    per_rank = split_batch(tr.batch_size, nproc)    # an uneven split is a ConfigError (checked before launch too)
    steps_per_epoch = n // tr.batch_size            # drop_last: equal-size batches, equal steps on every rank
    static = None
    if plan.route == "static-bf16":
        from pipeline.training import bf16_route
        static = bf16_route.prepare(ctx, task, model, ds, spec, plan, nproc, per_rank,
                                    lambda layer: build_optimizer(tr, layer, steps_per_epoch))
    if static is not None:
        opt, sched = static, static.sched           # the program's optimizer: state_dict()/set_state_dict() as dygraph's
    else:
        opt, sched = build_optimizer(tr, model, steps_per_epoch)
    model, opt = amp.decorate(model, opt, tr.amp, plan)          # O2 first, DataParallel after (Paddle's rule)
    net = paddle.DataParallel(model) if nproc > 1 else model
    scaler = amp.make_scaler(tr.amp, plan)
    val_x = to_tensor(ds.val.images, spec)
    key = f"{ctx.fingerprint}-nproc{nproc}"           # a 2-process checkpoint is not a 1-process one
    if static is not None:
        key += "-static-bf16"                       # its optimizer state is the program's, not dygraph's
    return _Loop(ctx, task, model, net, opt, sched, scaler, ds, spec, plan, device, rank, nproc, per_rank,
                 steps_per_epoch, val_x, ctx.work_dir / "checkpoint", key, loss_hook, static)


def _resume_state(lp: _Loop) -> tuple[_Progress, bool]:
    """The progress to continue from: the last checkpoint of this very run (same fingerprint and process
    count) unless train.resume is off or the run is forced; a fresh start otherwise."""
    tr, ckpt_dir = lp.ctx.cfg.train, lp.ckpt_dir
    force = getattr(lp.ctx, "force", False)
    resumed = checkpoint.load(ckpt_dir, lp.key) if tr.resume and not force else None
    if force and tr.resume and checkpoint.current(ckpt_dir) is not None:
        log.info("[train] FORCE: not resuming from %s, training from scratch", ckpt_dir)
    if not resumed:
        return _Progress(), False
    states, meta = resumed
    try:
        amp.load_state(lp.model, states["model"])       # fp32 on disk; cast back to fp16 under O2
        lp.opt.set_state_dict(states["optimizer"])
        lp.sched.set_state_dict(states["scheduler"])
        if lp.static is not None:
            lp.static.load_weights(lp.model)
        if lp.scaler is not None and "scaler" in states:
            lp.scaler.load_state_dict(states["scaler"])
        prog = _Progress(meta["epoch"] + 1, meta["history"], meta["best"], states["best"], None, meta["best_epoch"])
    except (KeyError, ValueError, TypeError, AttributeError, IndexError, RuntimeError) as exc:
        # half-applied: the model is neither the checkpoint nor a fresh start, so stop (never train on it)
        raise IntegrityError(f"train: checkpoint {checkpoint.current(ckpt_dir)} does not fit this model "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
                             hint="delete that checkpoint folder, or run with --force to train from scratch") from None
    log.info("[train] resuming after epoch %d/%d from %s", prog.start_epoch, tr.epochs, checkpoint.current(ckpt_dir))
    return prog, True


def _train_epoch(lp: _Loop, prog: _Progress, epoch: int, guard: NonFiniteGuard, vdl) -> dict:
    """One epoch: the steps, BN statistics agreed across ranks, validation, best-epoch bookkeeping, and (rank 0)
    the checkpoint and telemetry. Returns the epoch's record."""
    task = lp.task
    epoch_seed = lp.ctx.cfg.seed * 1000 + epoch
    steps = _run_epoch(lp, epoch, epoch_seed, guard)
    if lp.static is not None:
        lp.static.store_weights(lp.model)           # fp32 master weights + BN statistics back into the model
    _average_buffers(lp.model, lp.nproc)
    rec, metric = _epoch_record(lp, epoch, steps)
    prog.history.append(rec)
    state = amp.fp32_state_dict(lp.model)
    _check_weights_finite(state, epoch + 1)
    if metric is None or metric >= prog.best:      # ties go to the later (longer-trained) epoch
        prog.best, prog.best_state, prog.best_bytes, prog.best_epoch = metric, state, None, epoch + 1
    if lp.rank == 0:
        tr = lp.ctx.cfg.train
        log.info("[train] epoch %d/%d loss %.4f %s %s  %.0f samples/s%s", epoch + 1, tr.epochs, rec["loss"],
                 task.primary_metric, "n/a" if metric is None else f"{metric:.4f}", rec["samples_per_s"],
                 f"  skipped {rec['skipped_steps']}" if rec["skipped_steps"] else "")
        _save_checkpoint(lp, prog, state, epoch, epoch_seed)
        guard.kept = f"the last good checkpoint (epoch {epoch + 1}) is kept in {lp.ckpt_dir}"
        _write_telemetry(lp, prog, rec, vdl, epoch)
    return rec


def _run_epoch(lp: _Loop, epoch: int, epoch_seed: int, guard: NonFiniteGuard) -> dict:
    """The optimisation steps of one epoch; returns what the epoch record needs (losses, skips, lr, time)."""
    import paddle

    tr, ds, global_batch = lp.ctx.cfg.train, lp.ds, lp.ctx.cfg.train.batch_size
    # dropout etc. independent of where we resumed; each rank its own stream (rank 0's = one process's)
    paddle.seed(epoch_seed + lp.rank * 7_919_000)
    order = np.random.default_rng(epoch_seed).permutation(len(ds.train.labels))
    t0, nonfinite, scaler_skipped, losses, lr_used = time.perf_counter(), 0, 0, [], float(lp.sched.get_lr())
    # a bar on a terminal only: in a file or CI log the epoch line below is the record (no carriage returns)
    bar = tqdm(range(lp.steps_per_epoch), desc=f"train {epoch + 1}/{tr.epochs}", file=console.stream(),
               disable=lp.ctx.quiet or lp.rank != 0 or console.quiet() or not console.is_terminal(),
               leave=False, unit="batch", dynamic_ncols=True)
    heap = resources.HeapGuard()        # large models fragment the heap step by step: give it back as it grows
    for step in bar:
        gstep = epoch * lp.steps_per_epoch + step
        start = step * global_batch + lp.rank * lp.per_rank   # this rank's share of the global batch
        idx = order[start:start + lp.per_rank]
        if lp.static is not None:               # forward, backward and update in one program run
            value = _static_step(lp, to_tensor(ds.train.images[idx], lp.spec), ds.train.labels[idx], gstep)
            if not guard.check(value, gstep):   # Adam skipped the update itself (SkipUpdate)
                nonfinite += 1
                continue
            lr_used = float(lp.sched.get_lr())
            lp.sched.step()
            heap()
            losses.append(value)
            continue
        x = paddle.to_tensor(to_tensor(ds.train.images[idx], lp.spec))
        y = paddle.to_tensor(ds.train.labels[idx])
        with amp.autocast(tr.amp, lp.plan):
            loss = lp.task.loss(lp.net(x), y)
        if lp.loss_hook is not None:
            loss = lp.loss_hook(loss, gstep)
        value = _global_loss(loss, lp.nproc)     # the NaN guard needs the value: one small sync per step
        if not guard.check(value, gstep):
            nonfinite += 1
            lp.opt.clear_grad()
            continue
        lr_used = float(lp.sched.get_lr())
        scaler_skipped += _optimizer_step(lp, loss)
        heap()
        losses.append(value)
        if not bar.disable and step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}",
                            sps=f"{(step + 1) * global_batch / (time.perf_counter() - t0):.0f}", refresh=False)
    bar.close()
    return {"seconds": time.perf_counter() - t0, "nonfinite": nonfinite, "scaler_skipped": scaler_skipped,
            "losses": losses, "lr_used": lr_used}


def _static_step(lp: _Loop, x: np.ndarray, y: np.ndarray, gstep: int) -> float:
    """One step of the static-bf16 program; a test's loss_hook scales the program's loss by hook(1)."""
    factor = 1.0
    if lp.loss_hook is not None:
        import paddle

        factor = float(lp.loss_hook(paddle.ones([1]), gstep))
    return lp.static.step(x, y, factor)


def _optimizer_step(lp: _Loop, loss) -> int:
    """Backward and update; returns 1 when the AMP scaler skipped the update (inf/nan gradients), else 0."""
    skipped = 0
    if lp.scaler is not None:
        scaled = lp.scaler.scale(loss)
        scaled.backward()
        lp.scaler.minimize(lp.opt, scaled)      # unscales, skips the update on inf/nan, updates the scale
        skipped = amp.step_skipped(lp.scaler)
    else:
        loss.backward()
        lp.opt.step()
    lp.opt.clear_grad()
    lp.sched.step()
    return skipped


def _epoch_record(lp: _Loop, epoch: int, steps: dict) -> tuple[dict, float | None]:
    """Validate the epoch's weights and describe the epoch (the line of metrics.jsonl) -> (record, metric)."""
    tr, task, seconds = lp.ctx.cfg.train, lp.task, steps["seconds"]
    outputs = predict(lp.model, lp.val_x, cast=lambda: amp.autocast(tr.amp, lp.plan))
    metric = task.metrics(outputs, lp.ds.val.labels)[task.primary_metric]
    nonfinite, scaler_skipped, losses = steps["nonfinite"], steps["scaler_skipped"], steps["losses"]
    return {"epoch": epoch + 1, "loss": float(np.mean(losses)) if losses else float("nan"),
            task.primary_metric: metric, "lr": steps["lr_used"], "loss_scale": amp.loss_scale(lp.scaler),
            "skipped_steps": nonfinite + scaler_skipped, "scaler_skipped_steps": scaler_skipped,
            "nonfinite_loss_steps": nonfinite,
            "samples_per_s": round(lp.steps_per_epoch * tr.batch_size / seconds, 1),
            "peak_memory_mb": round(peak_memory_mb(lp.device), 1), "precision": lp.plan.effective,
            "nproc": lp.nproc, "seconds": round(seconds, 2)}, metric


def _save_checkpoint(lp: _Loop, prog: _Progress, state: dict, epoch: int, epoch_seed: int) -> None:
    tr = lp.ctx.cfg.train
    if prog.best_state is None or prog.best_epoch == epoch + 1:
        best_part = checkpoint.SameAs("model")
    else:
        if prog.best_bytes is None:
            prog.best_bytes = checkpoint.to_bytes(prog.best_state)   # serialised once, reused every epoch
        best_part = prog.best_bytes
    parts = {"model": state, "optimizer": lp.opt.state_dict(), "scheduler": lp.sched.state_dict(),
             "best": best_part}
    if lp.scaler is not None:
        parts["scaler"] = lp.scaler.state_dict()
    checkpoint.save(lp.ckpt_dir, lp.key, parts, {
        "epoch": epoch, "history": prog.history, "best": prog.best, "best_epoch": prog.best_epoch,
        "epochs": tr.epochs, "nproc": lp.nproc,
        # the RNG state at an epoch boundary is fully given by these seeds (re-seeded every epoch)
        "rng": {"paddle_seed": epoch_seed + 1, "permutation_seed": epoch_seed + 1}})


def _write_telemetry(lp: _Loop, prog: _Progress, rec: dict, vdl, epoch: int) -> None:
    atomic_write_text(lp.ctx.work_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in prog.history))
    if vdl is not None:
        for k in ("loss", lp.task.primary_metric, "lr", "samples_per_s", "skipped_steps", "loss_scale"):
            if rec.get(k) is not None:
                vdl.add_scalar(tag=f"train/{k}", value=float(rec[k]), step=epoch + 1)


def _train_info(lp: _Loop, prog: _Progress, resumed: bool) -> dict:
    tr = lp.ctx.cfg.train
    peak, lr_how = effective_lr(tr)
    return {"resumed_after_epoch": prog.start_epoch if resumed else None, "best_epoch": prog.best_epoch,
            "nproc": lp.nproc, "global_batch": tr.batch_size, "per_process_batch": lp.per_rank,
            "lr": {"configured": tr.lr, "effective_peak": peak, "scaling": tr.lr_scaling, "how": lr_how},
            "checkpoint": str(lp.ckpt_dir)}
