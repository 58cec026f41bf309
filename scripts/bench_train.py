"""`make bench-train`: is the pipeline's trainer as fast as a plain Paddle loop, and does the CPU tuning pay?

Measured in one run, on the same model (configs/chars.yaml: small_cnn) and the same batch:
  (a) trainer   pipeline.train_loop.train_model, the code the train stage runs (NaN guard, telemetry, ...)
  (b) plain     a hand-written loop: to_tensor → forward → cross_entropy → backward → step (same optimizer)
  (c) untuned   (b) in a fresh process without MKL_DEBUG_CPU_TYPE / OMP / MKL thread variables
                (PIPELINE_NO_TUNING=1): MKL reads its environment once, at load time
plus, unless --no-knobs, (b) in a fresh process per tuning knob, to show what each one is worth.
(a) and (b) alternate epoch by epoch in this process and the median is reported: the machine may be
shared, and alternating spreads other processes' load over both. Synthetic data (speed does not
depend on pixel values).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: E402,F401  -- zlib before paddle; CPU tuning unless PIPELINE_NO_TUNING=1

import numpy as np  # noqa: E402

TUNING_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")
KNOBS = {  # name → environment for a fresh process (on top of an environment without TUNING_VARS)
    "untuned (Paddle defaults)": {},
    "MKL_DEBUG_CPU_TYPE=5 only": {"MKL_DEBUG_CPU_TYPE": "5"},
    "OMP_NUM_THREADS=cores only": {"OMP_NUM_THREADS": "{cores}"},
    "OMP+MKL_NUM_THREADS=cores only": {"OMP_NUM_THREADS": "{cores}", "MKL_NUM_THREADS": "{cores}"},
    "all three (pipeline/env.py)": {"OMP_NUM_THREADS": "{cores}", "MKL_NUM_THREADS": "{cores}",
                                    "MKL_DEBUG_CPU_TYPE": "5"},
}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def setup(batch: int, steps: int):
    from pipeline.config import load_config
    from pipeline.data.chars import CLASSES
    from pipeline.tasks import get_task
    from pipeline.tasks.base import Datasets, Split

    cfg = load_config([ROOT / "configs" / "chars.yaml"],
                      [f"train.batch_size={batch}", "train.epochs=1", "train.resume=false", "run.quiet=true"])
    task = get_task(cfg.task)
    rng = np.random.default_rng(0)
    n, h, w = batch * steps, cfg.data.height, cfg.data.width
    ds = Datasets(Split(rng.integers(0, 256, (n, h, w), dtype=np.uint8), np.arange(n, dtype=np.int64) % len(CLASSES)),
                  Split(rng.integers(0, 256, (256, h, w), dtype=np.uint8), np.arange(256, dtype=np.int64) % len(CLASSES)),
                  {"labels": CLASSES})
    spec = task.preprocess_spec(cfg.section("data")["data"], ds.info)
    return cfg, task, ds, spec


class Plain:
    """What a user writes by hand: same model, Adam + L2 + cosine schedule, same batch and preprocessing."""

    def __init__(self, cfg, task, ds, spec):
        import paddle

        paddle.seed(cfg.seed)
        self.model = task.build_model(cfg.section("model")["model"], ds.info)
        steps = len(ds.train.labels) // cfg.train.batch_size
        self.sched = paddle.optimizer.lr.CosineAnnealingDecay(cfg.train.lr, T_max=100 * steps)
        self.opt = paddle.optimizer.Adam(self.sched, parameters=self.model.parameters(),
                                         weight_decay=paddle.regularizer.L2Decay(cfg.train.weight_decay))
        self.cfg, self.ds, self.spec, self.steps = cfg, ds, spec, steps

    def epoch(self, seed: int) -> tuple[float, float]:
        import paddle
        import paddle.nn.functional as F

        from pipeline.preprocess import to_tensor

        b, images, labels = self.cfg.train.batch_size, self.ds.train.images, self.ds.train.labels
        t0, c0 = time.perf_counter(), _cpu_seconds()
        order = np.random.default_rng(seed).permutation(len(labels))
        for s in range(self.steps):
            idx = order[s * b:(s + 1) * b]
            x = paddle.to_tensor(to_tensor(images[idx], self.spec))
            y = paddle.to_tensor(labels[idx])
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.clear_grad()
            self.sched.step()
        dt = time.perf_counter() - t0
        return self.steps * b / dt, (_cpu_seconds() - c0) / dt


class Trainer:
    """pipeline.train_loop.train_model, one epoch per call (its own samples/s covers the step loop only)."""

    def __init__(self, cfg, task, ds, spec, work: Path):
        import paddle

        from pipeline import amp, env

        paddle.seed(cfg.seed)
        self.model = task.build_model(cfg.section("model")["model"], ds.info)
        self.plan = amp.plan(cfg.train.amp, "cpu", env.capabilities())
        self.ctx = types.SimpleNamespace(cfg=cfg, work_dir=work, fingerprint="bench", quiet=True)
        self.task, self.ds, self.spec = task, ds, spec

    def epoch(self, seed: int) -> tuple[float, float]:
        from pipeline.train_loop import train_model

        c0, t0 = _cpu_seconds(), time.perf_counter()
        _, history, _ = train_model(self.ctx, self.task, self.model, self.ds, self.spec, self.plan, "cpu")
        wall = time.perf_counter() - t0
        sps = history[-1]["samples_per_s"]
        # cpu share over the whole call (includes its validation pass and checkpoint: close enough)
        return sps, (_cpu_seconds() - c0) / wall


def child(args) -> None:
    """Fresh process: the plain loop only; one JSON line on stdout."""
    import logging

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    from pipeline import env

    env.import_paddle_quietly()
    cfg, task, ds, spec = setup(args.batch, args.steps)
    plain = Plain(cfg, task, ds, spec)
    plain.epoch(0)                                   # warm-up
    runs = [plain.epoch(r + 1) for r in range(args.rounds)]
    print(json.dumps({"sps": [r[0] for r in runs], "cpu": [r[1] for r in runs],
                      "env": {k: os.environ.get(k) for k in TUNING_VARS}}))


def run_child(extra_env: dict, args) -> dict:
    from pipeline import env

    child_env = {k: v for k, v in os.environ.items() if k not in TUNING_VARS}
    child_env["PIPELINE_NO_TUNING"] = "1"
    child_env.update({k: v.format(cores=env.cpu_count()) for k, v in extra_env.items()})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--batch", str(args.batch),
           "--steps", str(args.steps), "--rounds", str(args.rounds)]
    res = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"bench child failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=None, help="batch size (default: configs/chars.yaml train.batch_size)")
    p.add_argument("--steps", type=int, default=20, help="steps per measured epoch")
    p.add_argument("--rounds", type=int, default=4, help="measured epochs per loop (after one warm-up)")
    p.add_argument("--no-knobs", action="store_true", help="skip the per-knob breakdown (fresh processes)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch is None:
        from pipeline.config import load_config
        args.batch = load_config([ROOT / "configs" / "chars.yaml"]).train.batch_size
    if args.child:
        child(args)
        return 0

    import logging

    from rich.console import Console
    from rich.table import Table

    from pipeline import env

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    console = Console(width=130)
    load0 = os.getloadavg()
    env.import_paddle_quietly()
    cfg, task, ds, spec = setup(args.batch, args.steps)
    console.print(f"model {cfg.model.name} (configs/chars.yaml), batch {args.batch}, {args.steps} steps/epoch, "
                  f"{args.rounds} measured epochs each after 1 warm-up; {env.cpu_count()} cores, "
                  f"{env.cpu_vendor()}; tuning applied here: {env.APPLIED_TUNING or 'none (set by user or disabled)'}")

    with tempfile.TemporaryDirectory(prefix="bench-train-") as work:
        trainer, plain = Trainer(cfg, task, ds, spec, Path(work)), Plain(cfg, task, ds, spec)
        trainer.epoch(0), plain.epoch(0)                                       # warm-up both
        res = {"trainer": [], "plain": []}
        for r in range(args.rounds):                                           # alternate: same load on both
            first, second = (("trainer", trainer), ("plain", plain)) if r % 2 == 0 else (("plain", plain), ("trainer", trainer))
            for name, loop in (first, second):
                res[name].append(loop.epoch(r + 1))

    knobs = {"untuned (Paddle defaults)": KNOBS["untuned (Paddle defaults)"]} if args.no_knobs else KNOBS
    children = {}
    for name, extra in knobs.items():
        console.print(f"  fresh process: plain loop, {name} ...", highlight=False)
        children[name] = run_child(extra, args)
    load1 = os.getloadavg()

    med = lambda xs: statistics.median(xs)  # noqa: E731
    trainer_sps, plain_sps = med([s for s, _ in res["trainer"]]), med([s for s, _ in res["plain"]])
    untuned_sps = med(children["untuned (Paddle defaults)"]["sps"])

    t = Table(title="training throughput (samples/s, median)", header_style="bold")
    for col in ("loop", "process", "samples/s", "min … max", "CPU use (cores)"):
        t.add_column(col)

    def row(name, where, runs_sps, runs_cpu):
        t.add_row(name, where, f"{med(runs_sps):.0f}", f"{min(runs_sps):.0f} … {max(runs_sps):.0f}",
                  f"{med(runs_cpu):.2f}")

    row("(a) trainer: pipeline.train_loop", "this (tuned)", [s for s, _ in res["trainer"]], [c for _, c in res["trainer"]])
    row("(b) plain hand-written loop", "this (tuned)", [s for s, _ in res["plain"]], [c for _, c in res["plain"]])
    for name, c in children.items():
        label = "(c) plain loop, untuned" if name.startswith("untuned") else f"    plain loop, {name}"
        row(label, "fresh", c["sps"], c["cpu"])
    console.print(t)

    r1, r2 = trainer_sps / plain_sps, trainer_sps / untuned_sps
    v = Table(title="ratios", header_style="bold")
    for col in ("ratio", "value", "goal", "verdict"):
        v.add_column(col)
    v.add_row("trainer / plain (same settings)", f"{r1:.2f}x", ">= 1.0x",
              "[green]met[/]" if r1 >= 1.0 else ("[yellow]within noise (5%)[/]" if r1 >= 0.95 else "[red]missed[/]"))
    v.add_row("tuned trainer / untuned plain", f"{r2:.2f}x", ">= 1.6x", "[green]met[/]" if r2 >= 1.6 else "[red]missed[/]")
    console.print(v)
    console.print(f"load average (1 min) before/after: {load0[0]:.2f} / {load1[0]:.2f} on {env.cpu_count()} cores"
                  + ("  [yellow]— the machine is shared: other processes' load depresses multi-thread numbers[/]"
                     if max(load0[0], load1[0]) > 0.5 * env.cpu_count() else ""))
    if args.json:
        args.json.write_text(json.dumps({"batch": args.batch, "trainer": res["trainer"], "plain": res["plain"],
                                         "children": children, "ratios": {"trainer_vs_plain": r1,
                                                                          "tuned_trainer_vs_untuned_plain": r2},
                                         "loadavg": [load0, load1]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
