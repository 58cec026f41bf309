"""Paired bf16 vs fp32: is bf16's validation metric within a tolerance of fp32's after the same epochs?

Each seed trains twice through the pipeline's own trainer, fp32 (the dygraph trainer) and bf16 (the static-bf16
route), with everything else equal: the seed draws the same data, the same initial weights (the bf16 program starts
from the dygraph model's) and the same batch order, one process each (train.nproc=1: two data-parallel processes
would split the batches differently). The difference bf16 - fp32 per seed is what bf16 changed; its mean, a
two-sided 95 % t-interval (|bf16 - fp32| within the tolerance?) and a one-sided 95 % lower bound (bf16 no worse
than fp32 minus the tolerance?) judge it, not the seed-to-seed spread of either precision alone.

    .venv/bin/python scripts/amp_paired.py --seeds 11,12,13 --root runs/amp_paired

Default recipe: the zoo ViT of configs/conformance.yaml (78 % of its multiply-adds in Linear layers), 4096 samples
x 6 epochs, batch 32, 2048 validation samples (binomial standard error ~1.1 points). A run folder that already holds
a train manifest is reused, so more seeds can be added later. Exit 1 when a bf16 run did not train bf16.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ["-c", "configs/conformance.yaml", "-o", "model.name=vit", "-o", "data.channels=3", "-o",
          "data.num_train=4096", "-o", "data.num_val=2048", "-o", "train.epochs=6", "-o", "train.batch_size=32",
          "-o", "train.bn_recalibrate=false", "-o", "train.nproc=1"]
MODES = {"fp32": ["train.amp.enable=false"], "bf16": ["train.amp.enable=true", "train.amp.dtype=bfloat16"]}
# Student's t quantiles for df 1..10, two-sided 95 % and one-sided 95 % (beyond df 10 the df-10 value: conservative)
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]
T95_ONE_SIDED = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812]


def paired(fp32: list[float], bf16: list[float], tol: float) -> dict:
    """Differences bf16 - fp32 in points (metric x 100): mean, sd, the two-sided 95 % t-interval (is |bf16 - fp32|
    within tol?) and the one-sided 95 % lower bound (is bf16 no worse than fp32 - tol: non-inferiority)."""
    diffs = [100 * (b - f) for f, b in zip(fp32, bf16)]
    n, mean = len(diffs), statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else math.nan
    scale = sd / math.sqrt(n) if n > 1 else math.inf
    half = T95[min(n - 2, len(T95) - 1)] * scale if n > 1 else math.inf
    lower_one_sided = mean - T95_ONE_SIDED[min(n - 2, len(T95_ONE_SIDED) - 1)] * scale if n > 1 else -math.inf
    low, high = mean - half, mean + half
    if -tol <= low and high <= tol:
        verdict = f"within ±{tol:g} points (the whole interval)"
    elif high < -tol or low > tol:
        verdict = f"outside ±{tol:g} points (the whole interval)"
    else:
        verdict = f"not resolved at {n} seeds: the interval crosses ±{tol:g}"
    worse = "no worse than" if lower_one_sided >= -tol else "not shown to be no worse than"
    return {"diffs": [round(d, 2) for d in diffs], "n": n, "mean": round(mean, 2), "sd": round(sd, 2),
            "ci95": [round(low, 2), round(high, 2)], "verdict": verdict,
            "lower95_one_sided": round(lower_one_sided, 2), "higher_in": sum(d > 0 for d in diffs),
            "non_inferiority": f"bf16 {worse} fp32 - {tol:g} points (one-sided 95 % bound {lower_one_sided:+.2f})"}


def run(seed: int, mode: str, root: Path) -> dict:
    folder = root / f"s{seed}_{mode}"
    manifest = folder / "train" / "manifest.json"
    if not manifest.exists():
        cmd = [sys.executable, "-m", "pipeline", "run", "train", *RECIPE, "-o", f"seed={seed}",
               *[x for o in MODES[mode] for x in ("-o", o)], "-o", f"run.root={root}", "-o", f"run.name={folder.name}",
               "-o", "run.quiet=true"]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: seed {seed} {mode} training failed (exit {res.returncode}): {tail}")
    man = json.loads(manifest.read_text())
    return {"metric": man["metrics"]["accuracy"], "effective": man["precision"]["effective"],
            "samples_per_s": man["metrics"].get("samples_per_s")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="11,12,13", help="comma-separated seeds (each trains fp32 and bf16)")
    p.add_argument("--root", type=Path, default=ROOT / "runs" / "amp_paired", help="run folders s<seed>_<mode>")
    p.add_argument("--tol", type=float, default=0.5, help="tolerance in points (metric x 100)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"error: --seeds takes comma-separated integers, got '{args.seeds}'", file=sys.stderr)
        return 2
    rows = [{"seed": s, **{m: run(s, m, args.root.resolve()) for m in MODES}} for s in seeds]
    fell_back = [r for r in rows if r["bf16"]["effective"] != "bfloat16/O1"]
    if fell_back:
        first = fell_back[0]
        print(f"error: the bf16 run of seed {first['seed']} trained {first['bf16']['effective']}, not bfloat16/O1 "
              "(its train manifest's precision.reason says why)", file=sys.stderr)
        return 1
    for r in rows:
        print(f"seed {r['seed']}: fp32 {r['fp32']['metric']:.4f}  bf16 {r['bf16']['metric']:.4f}  "
              f"bf16 - fp32 {100 * (r['bf16']['metric'] - r['fp32']['metric']):+.2f} points")
    stats = paired([r["fp32"]["metric"] for r in rows], [r["bf16"]["metric"] for r in rows], args.tol)
    print(f"paired difference over {stats['n']} seeds: mean {stats['mean']:+.2f} points, sd {stats['sd']:.2f}, "
          f"95 % interval [{stats['ci95'][0]:+.2f}, {stats['ci95'][1]:+.2f}]: {stats['verdict']}; bf16 higher in "
          f"{stats['higher_in']} of {stats['n']}; {stats['non_inferiority']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "paired": stats}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
