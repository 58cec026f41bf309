"""`make bench-deploy`: every engine and precision of a finished run, measured in one process.

Reads runs/<name>/{train,export,server} (run `make train export deploy` first). Prints batch-1
latency percentiles, throughput at a larger batch, achieved GFLOP/s, the fraction of a matmul
peak measured in the same run, and the speedup over eager dygraph.
Goals on the default model: Paddle Inference FP32 at batch 64 >= 70 % of peak and >= 5x eager.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import pipeline  # noqa: E402,F401  (zlib + CPU tuning before paddle)
from pipeline import env  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-c", "--config", action="append", default=["configs/chars.yaml"])
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    cfg = load_config(a.config[-1:], a.override)
    paddle = env.import_paddle_quietly()
    from rich.console import Console
    from rich.table import Table

    from pipeline.engines import perf
    from pipeline.engines.paddle_infer import InferenceEngine
    from pipeline.tasks import get_task

    run = cfg.run_dir
    exp = run / "export"
    if not (exp / "inference.pdmodel").is_file():
        raise PipelineError(f"no exported model in {exp}", hint="run `make train export deploy` first")
    info = json.loads((exp / "info.json").read_text())
    with np.load(exp / "reference.npz") as z:
        x = z["inputs"]
    xb = np.concatenate([x] * (a.batch // len(x) + 1))[:a.batch]
    threads = cfg.server.threads or env.cpu_count()
    prefix = str(exp / "inference")
    macs = perf.program_macs(prefix)
    peak = perf.matmul_peak_gflops(threads=threads)

    task = get_task(info["task"])
    model = task.build_model(info["model"], info["labels_info"])
    model.set_state_dict(paddle.load(str(run / "train" / "model.pdparams")))
    model.eval()

    def eager(batch):
        with paddle.no_grad():
            return model(paddle.to_tensor(batch)).numpy()

    engines = {"eager dygraph fp32": eager,
               "inference fp32 (oneDNN+IR)": InferenceEngine(prefix, "fp32", threads=threads).run,
               "inference fp32 (no IR, no oneDNN)": InferenceEngine(prefix, "fp32", threads=threads, mkldnn=False,
                                                                    ir_optim=False).run}
    int8 = run / "server" / "models" / "int8" / "model"
    if Path(str(int8) + ".pdmodel").is_file():
        engines["inference int8 (oneDNN)"] = InferenceEngine(int8, "int8", threads=threads).run

    rows = {}
    for name, fn in engines.items():
        lat = perf.latency_ms(fn, x[:1], warmup=5, repeats=a.repeats * 2)
        sps = perf.throughput(fn, xb, warmup=3, repeats=a.repeats)
        rows[name] = (lat, sps)
    base = rows["eager dygraph fp32"][1]
    t = Table(title=f"bench-deploy: {run.name} · {macs / 1e6:.2f} MMAC/sample · matmul peak {peak:.1f} GFLOP/s "
                    f"· {threads} threads · tuning {env.APPLIED_TUNING or 'none'}")
    for col in ("engine", "p50 ms", "p90 ms", "p99 ms", f"samples/s @b{a.batch}", "GFLOP/s", "% of peak",
                "× eager"):
        t.add_column(col, justify="right" if col != "engine" else "left")
    for name, (lat, sps) in rows.items():
        gf = 2 * macs * sps / 1e9
        t.add_row(name, f"{lat['p50']:.3f}", f"{lat['p90']:.3f}", f"{lat['p99']:.3f}", f"{sps:,.0f}",
                  f"{gf:.1f}", f"{100 * gf / peak:.0f} %", f"{sps / base:.1f}×")
    Console(width=150).print(t)
    fp32 = rows["inference fp32 (oneDNN+IR)"][1]
    print(f"goal: inference fp32 @b{a.batch} = {100 * 2 * macs * fp32 / 1e9 / peak:.0f} % of peak (goal ≥ 70 %), "
          f"{fp32 / base:.1f}× eager (goal ≥ 5×)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        sys.exit(exc.exit_code)
