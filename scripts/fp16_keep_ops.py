"""Which op types must stay fp32 for a model's fp16 row to pass its default gate (server.fp16.keep_fp32_ops)?

For each candidate set (comma-separated op types; "" = the pass's default black list alone) the exported
program of a run folder is emulated as Paddle Inference's mixed-precision pass runs it with that set added to
its black list (pipeline/engines/amp_emulation.py) and judged by the run's own server.gates.fp16 (from
config.resolved.yaml). --split tune (default) chooses on the TUNING split: the run's train/calib.npz (training
lines, never the validation slice the server stage gates), against fp32's outputs there, with the lines' labels
rebuilt from the run's data set (scripts/tuning_split.py: correct lines lost and metric drop are judged as well). --split val runs the validation slice (what the gate will say; not for choosing).
One table: verdict, agreement (tie-aware and strict), metric drop, max|diff|, lines/samples that changed, seconds.

  .venv/bin/python scripts/fp16_keep_ops.py --run runs/ppocr_v4_rec "" softmax matmul_v2,elementwise_add,softmax
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
import numpy as np
import yaml

import tuning_split


def judge(run_dir: Path, keep: list[str], tmp: Path, batch: int, threads: int, split=None) -> dict:
    from pipeline.core.config import Tolerance
    from pipeline.core.gates import judge_try
    from pipeline.engines.paddle_infer import InferenceEngine, make_fp16_emulated
    from pipeline.tasks.reference import load_reference

    cfg = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    tol = Tolerance(**cfg["server"]["gates"]["fp16"])
    ref = load_reference(run_dir / "export")
    task, t0 = ref.task, time.perf_counter()
    emu = tmp / ("_".join(keep) or "default") / "model"
    info = make_fp16_emulated(ref.model_prefix, emu, "fp16", keep_fp32_ops=keep)
    x, ref_out, labels = split if split is not None else (ref.inputs, ref.outputs, ref.labels)
    out = InferenceEngine(emu, "fp16", threads=threads).run_batched(x, batch)
    r = judge_try(task, tol, out, ref_out, labels, "fp16", key="server.gates.fp16", effective="fp16-emulated")
    return {"keep": ",".join(keep) or "(default black list)", "status": r["status"], "agreement": r["agreement"],
            "strict": r["strict"], "changed": int(round((1 - r["strict"]) * len(out))), "n": len(out),
            "drop": r["drop"] if r["drop"] is not None else float("nan"),
            "lost": f"{r['lost']}/{r['of']}" if r["lost"] is not None else "-",
            "max_abs": float(np.abs(out.astype(np.float64) - ref_out).max()),
            "casts": info["casts_inserted"], "absent": info["fp32_ops_user_absent"],
            "seconds": round(time.perf_counter() - t0, 1), "reason": r["reason"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run folder with export/ and config.resolved.yaml")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--split", choices=("tune", "val"), default="tune")
    p.add_argument("--lines", type=int, default=256, help="tuning lines (--split tune; calib.npz holds num_train)")
    p.add_argument("sets", nargs="+", help='op-type sets, comma-separated ("" = none added)')
    args = p.parse_args()
    run_dir = Path(args.run)
    print("| op types kept fp32 (added) | verdict | text agreement (strict) | lines changed | correct lost "
          "| seq_acc drop | max abs diff | casts | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    split = tuning_split.load(run_dir, args.lines, args.batch, args.threads) if args.split == "tune" else None
    with tempfile.TemporaryDirectory(prefix="fp16keep-") as tmp:
        for s in args.sets:
            keep = [k.strip() for k in s.split(",") if k.strip()]
            r = judge(run_dir, keep, Path(tmp), args.batch, args.threads, split)
            absent = f" (not in program: {','.join(r['absent'])})" if r["absent"] else ""
            print(f"| {r['keep']}{absent} | {r['status']} | {r['agreement']:.4f} ({r['strict']:.4f}) | "
                  f"{r['changed']}/{r['n']} | {r['lost']} | {r['drop']:+.4f} | {r['max_abs']:.3g} | {r['casts']} | {r['seconds']} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
