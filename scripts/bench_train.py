"""`make bench-train`: is the pipeline's trainer as fast as a plain Paddle loop, and does the CPU tuning pay?

Measured in one run, on the same model (configs/chars.yaml: small_cnn) and the same batch:
  (a) trainer   pipeline.train_loop.train_model, the code the train stage runs (NaN guard, telemetry, ...)
  (b) plain     a hand-written loop: to_tensor → forward → cross_entropy → backward → step (same optimizer)
  (c) untuned   (b) in a fresh process without MKL_DEBUG_CPU_TYPE / OMP / MKL thread variables
                (PIPELINE_NO_TUNING=1): MKL reads its environment once, at load time
plus, unless --no-knobs, (b) in a fresh process per tuning knob, to show what each one is worth.
All loops take turns, one epoch each per round (one process computes at a time; the others wait on
their stdin), and the median over rounds is reported: the machine may be shared, and taking turns
spreads other processes' load evenly over every loop. Synthetic data (speed does not depend on pixels).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: E402,F401  -- zlib before paddle; CPU tuning unless PIPELINE_NO_TUNING=1
from bench_child import LineChild  # noqa: E402  (scripts/ is sys.path[0] when run as a script)

import numpy as np  # noqa: E402

TUNING_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")
KNOBS = {  # name → environment for a fresh process (on top of an environment without TUNING_VARS)
    "untuned (Paddle defaults)": {},
    "MKL_DEBUG_CPU_TYPE=5 only": {"MKL_DEBUG_CPU_TYPE": "5"},
    "OMP/MKL_NUM_THREADS=cores only": {"OMP_NUM_THREADS": "{cores}", "MKL_NUM_THREADS": "{cores}"},
    "all three (pipeline/env.py)": {"OMP_NUM_THREADS": "{cores}", "MKL_NUM_THREADS": "{cores}",
                                    "MKL_DEBUG_CPU_TYPE": "5"},
    # candidate: OpenMP threads sleep instead of spinning between parallel regions (busy machines)
    "all three + OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": "{cores}", "MKL_NUM_THREADS": "{cores}",
                                            "MKL_DEBUG_CPU_TYPE": "5", "OMP_WAIT_POLICY": "PASSIVE"},
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
        t0, c0, m0 = time.perf_counter(), _cpu_seconds(), time.thread_time()
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
        return self.steps * b / dt, (_cpu_seconds() - c0) / dt, self.steps * b / (time.thread_time() - m0)


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
        return sps, (_cpu_seconds() - c0) / wall, None


def child(args) -> None:
    """Fresh process holding a plain loop; runs one epoch per "epoch <seed>" line on stdin (JSON reply)."""
    import logging

    logging.getLogger("pipeline").setLevel(logging.ERROR)
    from pipeline import env

    env.import_paddle_quietly()
    cfg, task, ds, spec = setup(args.batch, args.steps)
    plain = Plain(cfg, task, ds, spec)
    plain.epoch(0)                                   # warm-up
    print(json.dumps({"ready": True, "env": {k: os.environ.get(k) for k in TUNING_VARS}}), flush=True)
    for line in sys.stdin:
        if not line.startswith("epoch"):
            break
        sps, cpu, main_sps = plain.epoch(int(line.split()[1]))
        print(json.dumps({"sps": sps, "cpu": cpu, "main_sps": main_sps}), flush=True)


class Child(LineChild):
    """A plain loop in its own process with its own environment (MKL reads it once, at load)."""

    def __init__(self, name: str, extra_env: dict, args):
        from pipeline import env

        child_env = {k: v for k, v in os.environ.items() if k not in TUNING_VARS}
        child_env["PIPELINE_NO_TUNING"] = "1"
        child_env.update({k: v.format(cores=env.cpu_count()) for k, v in extra_env.items()})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--batch", str(args.batch),
               "--steps", str(args.steps)]
        super().__init__(cmd, f"bench-train {name}", env=child_env)
        self.env = self.reply()["env"]

    def epoch(self, seed: int) -> tuple[float, float, float]:
        r = self.ask(f"epoch {seed}")
        return r["sps"], r["cpu"], r["main_sps"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=None, help="batch size (default: configs/chars.yaml train.batch_size)")
    p.add_argument("--steps", type=int, default=12, help="steps per measured epoch")
    p.add_argument("--rounds", type=int, default=3, help="measured epochs per loop (after one warm-up)")
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

    knobs = {"untuned (Paddle defaults)": KNOBS["untuned (Paddle defaults)"]} if args.no_knobs else KNOBS
    console.print(f"  starting {len(knobs)} fresh processes (plain loop, one per environment) ...")
    children = {name: Child(name, extra, args) for name, extra in knobs.items()}
    loops = {"trainer": None, "plain": None, **{name: c for name, c in children.items()}}
    res = {name: [] for name in loops}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as work:
        loops["trainer"], loops["plain"] = Trainer(cfg, task, ds, spec, Path(work)), Plain(cfg, task, ds, spec)
        loops["trainer"].epoch(0), loops["plain"].epoch(0)                     # warm-up (children did theirs)
        names = list(loops)
        for r in range(args.rounds):          # round robin, one process computing at a time: same load on all
            console.print(f"  round {r + 1}/{args.rounds} ...", highlight=False)
            for name in (names if r % 2 == 0 else names[::-1]):
                res[name].append(loops[name].epoch(r + 1))
    for c in children.values():
        c.close()
    load1 = os.getloadavg()

    med = lambda xs: statistics.median(xs)  # noqa: E731
    sps = {name: med([x[0] for x in runs]) for name, runs in res.items()}
    trainer_sps, plain_sps, untuned_sps = sps["trainer"], sps["plain"], sps["untuned (Paddle defaults)"]

    t = Table(title="training throughput (samples/s, median of rounds)", header_style="bold")
    for col in ("loop", "process", "samples/s", "min … max", "CPU use (cores)", "per main-thread CPU-s*"):
        t.add_column(col)
    labels = {"trainer": ("(a) trainer: pipeline.train_loop", "this (tuned)"),
              "plain": ("(b) plain hand-written loop", "this (tuned)")}
    for name, runs in res.items():
        label, where = labels.get(name, ("(c) plain loop, untuned" if name.startswith("untuned")
                                         else f"    plain loop, {name}", "own"))
        mains = [x[2] for x in runs if x[2]]
        t.add_row(label, where, f"{sps[name]:.0f}", f"{min(x[0] for x in runs):.0f} … {max(x[0] for x in runs):.0f}",
                  f"{med([x[1] for x in runs]):.2f}", f"{med(mains):.0f}" if mains else "")
    console.print(t)
    console.print("* samples per CPU-second of the calling thread: roughly what the loop would do with the cores "
                  "to itself (spin-waiting on a busy machine makes it pessimistic for multi-threaded runs)",
                  style="dim", soft_wrap=True)

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
        args.json.write_text(json.dumps({"batch": args.batch, "steps": args.steps, "results": res,
                                         "ratios": {"trainer_vs_plain": r1, "tuned_trainer_vs_untuned_plain": r2},
                                         "loadavg": [load0, load1]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
