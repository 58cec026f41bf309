"""Does the nightly's A/B latency judgement cry wolf? And does it catch a real slowdown?

Runs the nightly's latency comparison step (pipeline.nightly.regression.latency_ab: baseline and new artifacts
re-measured in one process, alternating rounds, same input) N times in a row on unchanged artifacts
while a competing process keeps one core busy, and counts false latency failures (want 0). Then N more
times with a planted 1.5x slowdown on the new side (a wrapper that busy-waits half of each call's own
time, i.e. throughput halved to 2/3) and counts the times it was caught (want N of N).

It re-runs the comparison step, not N whole nightlies: training and conversion are deterministic and
do not touch latency; what varies from night to night is the measurement, and that is what is repeated.

    .venv/bin/python scripts/ab_nightly_experiment.py --baseline runs/nightly-A --current runs/nightly-B
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.core.config import load_config
from pipeline.nightly.regression import latency_ab

LOAD = "import time\nend = time.time() + {s}\nx = 0\nwhile time.time() < end:\n    x += 1\n"


def planted_slowdown(factor: float):
    """Test-only: the new side's calls take `factor` times as long (busy-wait, so load slows it too)."""
    def wrap(fn):
        def run(x):
            t0 = time.perf_counter()
            out = fn(x)
            end = time.perf_counter() + (factor - 1.0) * (time.perf_counter() - t0)
            while time.perf_counter() < end:
                pass
            return out
        return run
    return wrap


def series(base: Path, cur: Path, n: int, growth: float, rounds: int, runs: int, threads: int,
           wrap=None) -> list[dict]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        comps = [c for c in latency_ab(base, cur, growth=growth, rounds=rounds, runs=runs, threads=threads,
                                       wrap_current=wrap) if c.baseline is not None]
        ratios = {c.name: float(c.message.split("A/B ratio ")[1].split(" ")[0]) for c in comps}
        failed = [c.name for c in comps if not c.passed]
        out.append({"i": i + 1, "rows": len(comps), "failed": failed, "ratios": ratios,
                    "seconds": round(time.perf_counter() - t0, 1)})
        print(f"  {i + 1:2d}: {len(failed)}/{len(comps)} rows flagged; ratios "
              + ", ".join(f"{k.split(': ')[1].split(' (')[0]} {v:.2f}" for k, v in ratios.items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="run folder (e.g. the accepted nightly)")
    ap.add_argument("--current", type=Path, help="run folder to compare (default: the baseline itself)")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--factor", type=float, default=1.5, help="planted slowdown")
    ap.add_argument("--load-procs", type=int, default=1, help="competing busy processes during the experiment")
    ap.add_argument("--out", type=Path, help="write the raw results as JSON here")
    a = ap.parse_args()
    cfg = load_config(["configs/nightly.yaml"]).regression
    cur = a.current or a.baseline
    load = [subprocess.Popen([sys.executable, "-c", LOAD.format(s=3600)]) for _ in range(a.load_procs)]
    try:
        print(f"unchanged artifacts, {a.load_procs} competing busy process(es): {a.n} comparisons")
        same = series(a.baseline, cur, a.n, cfg.latency_growth, cfg.ab_rounds, cfg.ab_runs, cfg.ab_threads)
        print(f"planted {a.factor}x slowdown on the new side: {a.n} comparisons")
        slow = series(a.baseline, cur, a.n, cfg.latency_growth, cfg.ab_rounds, cfg.ab_runs, cfg.ab_threads,
                      wrap=planted_slowdown(a.factor))
    finally:
        for p in load:              # only the processes started here
            p.kill()
            p.wait()
    false = sum(bool(r["failed"]) for r in same)
    false_rows = sum(len(r["failed"]) for r in same)
    rows = sum(r["rows"] for r in slow)
    caught = sum(bool(r["failed"]) for r in slow)          # the nightly fails when any row regresses
    caught_rows = sum(len(r["failed"]) for r in slow)
    all_same = [v for r in same for v in r["ratios"].values()]
    all_slow = [v for r in slow for v in r["ratios"].values()]
    print(f"\nRESULT unchanged: {false}/{a.n} comparisons with a false latency failure "
          f"({false_rows}/{sum(r['rows'] for r in same)} rows); ratios {min(all_same):.2f}-{max(all_same):.2f}")
    print(f"RESULT planted {a.factor}x: nightly failed in {caught}/{a.n} comparisons ({caught_rows}/{rows} rows flagged); "
          f"ratios {min(all_slow):.2f}-{max(all_slow):.2f}")
    print(f"(limit: ratio > {1 + cfg.latency_growth:.2f} with p10 > 1; {cfg.ab_rounds} rounds x {cfg.ab_runs} "
          f"interleaved pairs, {cfg.ab_threads or 'recorded'} thread(s); "
          f"{sum(r['seconds'] for r in same + slow):.0f} s of comparisons)")
    if a.out:
        a.out.write_text(json.dumps({"unchanged": same, "planted": slow, "factor": a.factor}, indent=1))
    return 0 if false == 0 and caught == a.n else 1


if __name__ == "__main__":
    sys.exit(main())
