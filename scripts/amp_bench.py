"""`make amp-bench`: fp32 vs AMP O1 vs AMP O2 on the same model, through the pipeline's own trainer.

Each mode lives in its own process (so peak memory is that mode's alone): it trains for a few epochs
(validation accuracy, peak memory: GPU max_memory_allocated / CPU peak RSS, and on a GPU the largest
batch that fits, found by doubling until out-of-memory), then waits. Throughput is measured afterwards
in rounds, the three processes taking turns one epoch each (median reported), so load from other
processes on a shared machine falls evenly on all three.
What ran is what AMP planning says ran: on a CPU all three are float32 and the table says so; the
ratios are then run-to-run noise, never an AMP speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: E402,F401  -- zlib before paddle, CPU tuning before paddle loads
from bench_child import LineChild  # noqa: E402  (scripts/ is sys.path[0] when run as a script)

MODES = {
    "fp32": ["train.amp.enable=false"],
    "O1": ["train.amp.enable=true", "train.amp.level=O1"],
    "O2": ["train.amp.enable=true", "train.amp.level=O2"],
}


def _overrides(args, mode: str) -> list[str]:
    return [*MODES[mode], f"train.amp.dtype={args.dtype}", f"train.epochs={args.epochs}",
            f"data.num_train={args.num_train}", f"data.num_val={args.num_val}", "train.resume=false",
            "run.quiet=true", *([f"train.batch_size={args.batch}"] if args.batch else [])]


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in text or "resourceexhausted" in text


def largest_batch(cfg, task, ds, spec, plan, start: int, limit: int = 1 << 15) -> int | None:
    """GPU only: double the batch until a training step runs out of memory."""
    import paddle

    from pipeline.training import amp
    from pipeline.data.preprocess import to_tensor

    model = task.build_model(cfg.section("model")["model"], ds.info)
    opt = paddle.optimizer.Adam(1e-4, parameters=model.parameters())
    model, opt = amp.decorate(model, opt, cfg.train.amp, plan)
    scaler = amp.make_scaler(cfg.train.amp, plan)
    best, b = None, start
    while b <= limit:
        idx = (list(range(len(ds.train.labels))) * (b // len(ds.train.labels) + 1))[:b]
        try:
            x = paddle.to_tensor(to_tensor(ds.train.images[idx], spec))
            y = paddle.to_tensor(ds.train.labels[idx])
            with amp.autocast(cfg.train.amp, plan):
                loss = task.loss(model(x), y)
            if scaler is not None:
                scaled = scaler.scale(loss)
                scaled.backward()
                scaler.minimize(opt, scaled)
            else:
                loss.backward()
                opt.step()
            opt.clear_grad()
            float(loss)
            best = b
        except Exception as exc:  # noqa: BLE001 -- only out-of-memory ends the search; anything else is a bug
            if not _is_oom(exc):
                raise
            break
        finally:
            x = y = loss = None  # noqa: F841
        b *= 2
    return best


def child(args) -> None:
    """Train once (accuracy, memory, largest batch), then one timed epoch per "speed" line on stdin."""
    import logging

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    from pipeline.training import amp
    from pipeline.core import env
    from pipeline.core.config import load_config
    from pipeline.tasks import get_task
    from pipeline.tasks.base import Datasets, Split
    from pipeline.training.loop import train_model

    paddle = env.import_paddle_quietly()
    cfg = load_config([ROOT / "configs" / "chars.yaml"], _overrides(args, args.child))
    caps = env.capabilities()
    device = "gpu" if caps["gpu"] else "cpu"
    paddle.set_device(device)
    paddle.seed(cfg.seed)
    task = get_task(cfg.task)
    ds = task.load_data(cfg.section("data")["data"], cfg.seed)
    spec = task.preprocess_spec(cfg.section("data")["data"], ds.info)
    model = task.build_model(cfg.section("model")["model"], ds.info)
    plan = amp.plan(cfg.train.amp, device, caps)
    with tempfile.TemporaryDirectory(prefix="amp-bench-") as work:
        ctx = types.SimpleNamespace(cfg=cfg, work_dir=Path(work), fingerprint=args.child, quiet=True)
        _, history, _ = train_model(ctx, task, model, ds, spec, plan, device)
        out = {"mode": args.child, "requested": plan.requested, "effective": plan.effective, "reason": plan.reason,
               "device": device, "batch": cfg.train.batch_size,
               "peak_memory_mb": max(h["peak_memory_mb"] for h in history),
               "memory_kind": "GPU max_memory_allocated" if device == "gpu" else "peak RSS",
               "accuracy": history[-1][task.primary_metric], "max_batch": None}
        if device == "gpu":
            out["max_batch"] = largest_batch(cfg, task, ds, spec, plan, cfg.train.batch_size)
        print(json.dumps(out), flush=True)
        # timed epochs: a fresh model of the same mode, a fixed slice of the data, one epoch per request
        n = min(len(ds.train.labels), cfg.train.batch_size * args.speed_steps)
        small = Datasets(Split(ds.train.images[:n], ds.train.labels[:n]),
                         Split(ds.val.images[:256], ds.val.labels[:256]), ds.info)
        one = types.SimpleNamespace(cfg=load_config([ROOT / "configs" / "chars.yaml"],
                                                    _overrides(args, args.child) + ["train.epochs=1"]),
                                    work_dir=Path(work) / "speed", fingerprint=args.child, quiet=True)
        speed_model = task.build_model(cfg.section("model")["model"], ds.info)
        for line in sys.stdin:
            if line.strip() != "speed":
                break
            _, h, _ = train_model(one, task, speed_model, small, spec, plan, device)
            print(json.dumps({"samples_per_s": h[-1]["samples_per_s"]}), flush=True)


def spawn(mode: str, args) -> LineChild:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--dtype", args.dtype,
           "--epochs", str(args.epochs), "--num-train", str(args.num_train), "--num-val", str(args.num_val),
           "--speed-steps", str(args.speed_steps), *(["--batch", str(args.batch)] if args.batch else [])]
    return LineChild(cmd, f"amp-bench {mode}", cwd=ROOT, env=dict(os.environ))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-train", type=int, default=3600)
    p.add_argument("--num-val", type=int, default=720)
    p.add_argument("--batch", type=int, default=None, help="default: configs/chars.yaml train.batch_size")
    p.add_argument("--rounds", type=int, default=3, help="timed epochs per mode, taken in turns")
    p.add_argument("--speed-steps", type=int, default=12, help="steps per timed epoch")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    children, rows = [], []
    for mode in MODES:            # one at a time: each trains alone
        console.print(f"  {mode}: training {args.epochs} epochs on {args.num_train} samples (own process) ...",
                      highlight=False)
        children.append(spawn(mode, args))
        rows.append(children[-1].reply())
    speeds = {mode: [] for mode in MODES}
    for r in range(args.rounds):  # then take turns: one timed epoch each per round
        console.print(f"  speed round {r + 1}/{args.rounds} ...", highlight=False)
        pairs = list(zip(MODES, children))
        for mode, c in (pairs if r % 2 == 0 else pairs[::-1]):
            speeds[mode].append(c.ask("speed")["samples_per_s"])
    for c in children:
        c.close()
    for row in rows:
        row["samples_per_s"] = statistics.median(speeds[row["mode"]])
        row["samples_per_s_rounds"] = speeds[row["mode"]]

    base = rows[0]
    t = Table(title=f"AMP benchmark: small_cnn, batch {base['batch']}, {args.epochs} epochs, device {base['device']}",
              header_style="bold")
    for col in ("mode", "requested", "effective", "samples/s (median)", "vs fp32", f"peak memory ({base['memory_kind']})",
                "vs fp32", "largest batch", "accuracy"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["mode"], r["requested"], r["effective"], f"{r['samples_per_s']:.0f}",
                  f"{r['samples_per_s'] / base['samples_per_s']:.2f}x", f"{r['peak_memory_mb']:.0f} MB",
                  f"{r['peak_memory_mb'] / base['peak_memory_mb']:.2f}x",
                  "n/a (CPU)" if r["device"] == "cpu" else str(r["max_batch"]), f"{r['accuracy']:.4f}")
    console.print(t)
    if all(r["effective"] == "float32" for r in rows):
        why = next((r["reason"] for r in rows if r["reason"] and r["mode"] != "fp32"), "")
        console.print(f"[yellow]AMP is unavailable here[/]: all three modes ran float32 ({why}). "
                      "The ratios above are run-to-run variation of identical fp32 training, not an AMP effect.",
                      soft_wrap=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
