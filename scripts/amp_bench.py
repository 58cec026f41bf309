"""`make amp-bench`: fp32 vs bf16 AMP training on this machine, through the pipeline's own trainer.

Rows (models): the default small CNN (configs/chars.yaml), the invoice text-line recogniser (configs/ocr_rec.yaml,
CRNN), the zoo's ViT (configs/conformance.yaml's vit), a ViT-Tiny-sized ViT (configs/vit_tiny.yaml) and the
PP-OCRv4 recogniser fine-tune (configs/ppocr_v4_rec_finetune.yaml; needs `make fetch-ppocr`, else skipped).
Modes: fp32 (train.amp.enable=false: the dygraph trainer), bf16 (train.amp.dtype=bfloat16: on a CPU with bf16
kernels, the static-bf16 route of pipeline/training/static_bf16.py) and, where bf16 took that route, "static fp32"
(the same static program without the bf16 rewrite, a bench-only mode): bf16 / static fp32 is what the bf16 kernels
bring, static fp32 / fp32 what the static executor brings.

Every (model, mode) is its own process: it trains the same epochs on the same data (validation metric, peak RSS at
the same batch), then waits. Throughput is timed afterwards in rounds, the processes of one model taking turns one
epoch each (median reported), so load from other processes on a shared machine falls on all modes alike. The largest
batch under AMP_BENCH_MEM_GB is extrapolated linearly from the peak RSS at the batch and at twice the batch (CPU
memory has no out-of-memory signal to search for). What ran is what the manifest's planning says ran: a row whose
bf16 fell back to fp32 says so, and its ratio is then noise, never a bf16 effect.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
from bench_child import LineChild

# name -> (config, overrides, batch, train samples); small data: the table compares modes, not recipes
MODELS = {
    "small_cnn": ("configs/chars.yaml", [], 128, 1536),
    "crnn_invoice_lines": ("configs/ocr_rec.yaml", ["train.warmup_epochs=0", "data.num_val=256"], 64, 768),
    "vit_zoo": ("configs/conformance.yaml", ["model.name=vit", "data.channels=3", "train.bn_recalibrate=false"],
                64, 768),
    "vit_tiny": ("configs/vit_tiny.yaml", [], 64, 512),
    "ppocr_v4_rec_finetune": ("configs/ppocr_v4_rec_finetune.yaml", ["data.num_val=64"], 16, 96),
}
MODES = {"fp32": ["train.amp.enable=false"],
         "bf16": ["train.amp.enable=true", "train.amp.dtype=bfloat16", "train.amp.level=O1"],
         "static-fp32": ["train.amp.enable=true", "train.amp.dtype=bfloat16", "train.amp.level=O1"]}


def _overrides(model: str, mode: str, epochs: int, batch: int | None = None, args=None) -> list[str]:
    _, extra, b, n = MODELS[model]             # the memory probe (batch=2B) loads the same data: RSS comparable
    b, n = getattr(args, "train_batch", None) or b, getattr(args, "num_train", None) or n
    return [*extra, *MODES[mode], f"train.epochs={epochs}", f"train.batch_size={batch or b}", f"data.num_train={n}",
            "train.resume=false", "train.nproc=1", "train.min_metric=0.0", "run.quiet=true"]


def _static_fp32() -> None:
    """Bench-only: the static route's program without the bf16 rewrite (its pre-check then finds no bf16 op)."""
    from pipeline.training import bf16_route, static_bf16

    init = static_bf16.StaticBf16Trainer.__init__
    static_bf16.StaticBf16Trainer.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "bf16": False})
    bf16_route._precheck = lambda cfg, model, trainer, x, y, plan: {"static_fp32": True, "max_abs_diff": None}


def _train(cfg, task, ds, spec, work: Path, device: str, plan_factory):
    from pipeline.models import imported
    from pipeline.training.loop import train_model

    model, _ = imported.build(task, cfg.section("model")["model"], ds.info)
    plan = plan_factory()
    ctx = types.SimpleNamespace(cfg=cfg, work_dir=work, fingerprint="amp-bench", quiet=True)
    _, history, _ = train_model(ctx, task, model, ds, spec, plan, device)
    return plan, history


def child(args) -> None:
    """Train once (metric, peak RSS), then one timed epoch per "speed" line (--batch: the memory probe, train only)."""
    import logging

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    from pipeline.core import env
    from pipeline.core.config import load_config
    from pipeline.tasks import get_task
    from pipeline.tasks.base import Datasets, Split
    from pipeline.training import amp

    paddle = env.import_paddle_quietly()
    if args.mode == "static-fp32":
        _static_fp32()
    config = ROOT / MODELS[args.model][0]
    cfg = load_config([config], _overrides(args.model, args.mode, 1 if args.batch else args.epochs, args.batch, args))
    paddle.set_device("cpu")
    paddle.seed(cfg.seed)
    task = get_task(cfg.task, cfg.section("detection")["detection"])
    ds = task.load_data(cfg.section("data")["data"], cfg.seed)
    spec = task.preprocess_spec(cfg.section("data")["data"], ds.info)
    caps = env.capabilities()
    with tempfile.TemporaryDirectory(prefix="amp-bench-") as work:
        plan, history = _train(cfg, task, ds, spec, Path(work) / "a", "cpu", lambda: amp.plan(cfg.train.amp, "cpu", caps))
        ev = plan.evidence or {}
        effective = "float32 (static)" if args.mode == "static-fp32" and plan.route == "static-bf16" else plan.effective
        print(json.dumps({"mode": args.mode, "effective": effective, "route": plan.route, "reason": plan.reason,
                          "batch": cfg.train.batch_size, "metric_name": task.primary_metric,
                          "metric": history[-1][task.primary_metric], "peak_rss_mb": _rss_mb(),
                          "bf16_ops": (ev.get("program") or {}).get("bf16_ops"),
                          "fp32_types": sorted(ev.get("fp32_types") or {})}), flush=True)
        b = cfg.train.batch_size
        n = min(len(ds.train.labels), b * args.speed_steps)
        small = Datasets(Split(ds.train.images[:n], ds.train.labels[:n]), Split(ds.val.images[:32], ds.val.labels[:32]),
                         ds.info)
        one = load_config([config], _overrides(args.model, args.mode, 1, None, args))
        for line in sys.stdin:
            request = line.strip()
            if request == "speed":
                _, h = _train(one, task, small, spec, Path(work) / "s", "cpu", lambda: amp.plan(one.train.amp, "cpu", caps))
                print(json.dumps({"samples_per_s": h[-1]["samples_per_s"]}), flush=True)
            else:
                break


def _rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def spawn(model: str, mode: str, args, batch: int | None = None) -> LineChild:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-model", model, "--mode", mode,
           "--epochs", str(args.epochs), "--speed-steps", str(args.speed_steps),
           *(["--batch", str(batch)] if batch else []),
           *(["--num-train", str(args.num_train)] if args.num_train else []),
           *(["--train-batch", str(args.train_batch)] if args.train_batch else [])]
    return LineChild(cmd, f"amp-bench {model} {mode}", cwd=ROOT, env=dict(os.environ))


def largest_batch(row: dict, cap_mb: float) -> int | None:
    """Linear in the batch through (B, peak RSS at B) and (2B, peak RSS at 2B); None when RSS did not grow."""
    b, m1, m2 = row["batch"], row["peak_rss_mb"], row.get("peak_rss_mb_2x")
    if not m2 or m2 <= m1:
        return None
    return max(0, int(b + (cap_mb - m1) * b / (m2 - m1)))


def bench_model(model: str, args, console) -> list[dict]:
    children, rows = {}, []
    for mode in MODES:
        console.print(f"  {model} {mode}: training {args.epochs} epochs (own process) ...", highlight=False)
        children[mode] = spawn(model, mode, args)
        rows.append(children[mode].reply())
        if mode == "bf16" and rows[-1]["route"] != "static-bf16":
            children.pop("static-fp32", None)
            break                       # no bf16 program: a static-fp32 row would be the same fp32 again
    speeds = {mode: [] for mode in children}
    for r in range(args.rounds):        # take turns, one timed epoch each, order alternating
        order = list(children) if r % 2 == 0 else list(children)[::-1]
        for mode in order:
            speeds[mode].append(children[mode].ask("speed")["samples_per_s"])
    for c in children.values():
        c.close()
    for row in rows:                    # a fresh process at twice the batch: its own peak, nothing left over
        probe = spawn(model, row["mode"], args, batch=2 * row["batch"])
        row.update(model=model, samples_per_s=statistics.median(speeds[row["mode"]]),
                   samples_per_s_rounds=speeds[row["mode"]], peak_rss_mb_2x=probe.reply()["peak_rss_mb"])
        probe.close()
        row["largest_batch"] = largest_batch(row, args.mem_gb * 1024)
    return rows


def table(rows: list[dict], args, console) -> None:
    from rich.table import Table

    t = Table(title=f"AMP on this CPU: fp32 vs bf16 ({args.epochs} epochs, interleaved timing, {args.rounds} rounds; "
                    f"largest batch under AMP_BENCH_MEM_GB={args.mem_gb:g})", header_style="bold")
    for col in ("model", "mode", "effective", "bf16 ops", "samples/s", "vs fp32", "peak RSS", "vs fp32",
                "largest batch", "metric", "Δ vs fp32"):
        t.add_column(col)
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["mode"] == "fp32")
        t.add_row(r["model"], r["mode"], r["effective"], str(r["bf16_ops"] or "-"), f"{r['samples_per_s']:.1f}",
                  f"{r['samples_per_s'] / base['samples_per_s']:.2f}x", f"{r['peak_rss_mb']:.0f} MB",
                  f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x", str(r["largest_batch"] or "n/a"),
                  f"{r['metric_name']} {r['metric']:.4f}", f"{r['metric'] - base['metric']:+.4f}")
    console.print(t)
    for line in split_gains(rows):
        console.print(line, soft_wrap=True, highlight=False)
    for r in rows:
        if r["mode"] == "bf16" and r["route"] != "static-bf16":
            console.print(f"[yellow]{r['model']}[/]: bf16 did not run ({r['reason']}); its ratios are run-to-run "
                          "noise of identical fp32 training.", soft_wrap=True, highlight=False)


def split_gains(rows: list[dict]) -> list[str]:
    """bf16 vs fp32 mixes two effects: the static executor and the bf16 kernels. Per model with a static-fp32 row:
    bf16 / static fp32 (same executor, same program: what bf16 itself brings) and static fp32 / fp32 (the executor)."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["mode"]: r for r in rows if r["model"] == model}
        if not {"fp32", "bf16", "static-fp32"} <= set(by):
            continue
        sf, bf, fp = by["static-fp32"], by["bf16"], by["fp32"]
        kern = bf["samples_per_s"] / sf["samples_per_s"]
        exe = sf["samples_per_s"] / fp["samples_per_s"]
        rss, delta = bf["peak_rss_mb"] / sf["peak_rss_mb"], bf["metric"] - sf["metric"]
        bf.update(vs_static_fp32={"samples_per_s": round(kern, 3), "peak_rss": round(rss, 3),
                                  "metric_delta": round(delta, 4)})
        lines.append(f"{model}: bf16 vs static fp32 (same executor: the bf16 kernels' own effect) {kern:.2f}x "
                     f"samples/s, {rss:.2f}x peak RSS, metric {delta:+.4f}; "
                     f"static fp32 vs fp32 (the executor's effect) {exe:.2f}x samples/s")
    return lines


def html(rows: list[dict], path: Path) -> None:
    """One self-contained page: bars of samples/s relative to fp32 per model and mode (inline SVG)."""
    colours = {"fp32": "#888", "static-fp32": "#6a9fd4", "bf16": "#e07b39"}
    bars, y = [], 20
    for model in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == model]
        base = next(r for r in group if r["mode"] == "fp32")["samples_per_s"]
        bars.append(f'<text x="0" y="{y + 12}" font-size="13">{model}</text>')
        for r in group:
            ratio = r["samples_per_s"] / base
            bars.append(f'<rect x="200" y="{y}" width="{ratio * 150:.0f}" height="14" fill="{colours[r["mode"]]}"/>'
                        f'<text x="{205 + ratio * 150:.0f}" y="{y + 12}" font-size="12">{r["mode"]} {ratio:.2f}x '
                        f'({r["effective"]})</text>')
            y += 18
        y += 10
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{y + 10}">' \
          f'<line x1="350" y1="0" x2="350" y2="{y}" stroke="#000" stroke-dasharray="3"/>{"".join(bars)}</svg>'
    path.write_text(f"<!doctype html><meta charset='utf-8'><title>make amp-bench</title><h1>Training samples/s vs fp32"
                    f"</h1><p>dashed line: 1.0x (fp32, the dygraph trainer)</p>{svg}<p>{'<br>'.join(split_gains(rows))}</p>"
                    f"<pre>{json.dumps(rows, indent=1)}"
                    f"</pre>")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="timed epochs per mode, taken in turns")
    p.add_argument("--speed-steps", type=int, default=4, help="steps per timed epoch")
    p.add_argument("--num-train", type=int, help="training samples (default: each model's own, small)")
    p.add_argument("--train-batch", type=int, help="batch size (default: each model's own)")
    p.add_argument("--mem-gb", type=float, default=float(os.environ.get("AMP_BENCH_MEM_GB", "4")))
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--html", type=Path, help="also write an HTML page with a plot here")
    p.add_argument("--child-model", choices=tuple(MODELS), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=tuple(MODES), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_model:
        args.model = args.child_model
        child(args)
        return 0
    from rich.console import Console

    console = Console(width=160)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        console.print(f"error: unknown model '{unknown[0]}' (one of {', '.join(MODELS)})")
        return 2
    rows = []
    for model in models:
        if model.startswith("ppocr") and not (ROOT / ".cache" / "ppocr" / "ch_rec").exists():
            console.print(f"  {model}: skipped (no .cache/ppocr/ch_rec: run `make fetch-ppocr`)", highlight=False)
            continue
        rows += bench_model(model, args, console)
    table(rows, args, console)
    for out in (args.json, args.html):
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.html:
        html(rows, args.html)
        console.print(f"plot: {args.html}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
