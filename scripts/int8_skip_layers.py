"""Which layers must stay fp32 for a model's int8 rows (server.quant.skip), chosen on the TUNING split (issue 31).

The server stage's own sensitivity code, run on the run's train/calib.npz (training lines, never the validation
slice the server gate judges): quantize once with --base skipped (a principle, e.g. the first conv on the image),
rank the layers by the error each adds itself (pipeline/engines/quant.py rank_layers, on the first tuning lines),
then skip the top k for each --k and judge Paddle Inference int8 by the run's own server.gates.int8 on the tuning
lines, labels included (scripts/tuning_split.py: correct lines lost, metric drop, agreement). PTQ calibrates on the
same tuning lines as the server stage does (server.quant.batch_nums batches of its calibration batch).
One table: k, layers skipped, verdict, correct lines lost, metric drop, text agreement, seconds.

  .venv/bin/python scripts/int8_skip_layers.py --run runs/ppocr_v4_rec --base conv2d_10.w_0 --k 0 1 2 3 4
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

import tuning_split


def judge(task, tol, prefix: str, x, ref_out, labels, batch: int, threads: int) -> dict:
    from pipeline.core.gates import judge_try
    from pipeline.engines.paddle_infer import InferenceEngine

    out = InferenceEngine(prefix, "int8", threads=threads).run_batched(x, batch)
    r = judge_try(task, tol, out, ref_out, labels, "int8", key="server.gates.int8")
    return {**r, "lost": f"{r['lost']}/{r['of']}"}


def main() -> int:
    from pipeline.core.config import load_config
    from pipeline.engines import quant
    from pipeline.tasks.reference import load_reference

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run folder with train/, export/ and config.resolved.yaml")
    p.add_argument("--lines", type=int, default=256, help="tuning lines judged (calib.npz holds num_train)")
    p.add_argument("--base", nargs="*", default=[], help="weights skipped in every trial (a principle)")
    p.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    run_dir = Path(args.run)
    cfg = load_config([run_dir / "config.resolved.yaml"])
    q, tol = cfg.server.quant, cfg.server.gates["int8"]
    task = load_reference(run_dir / "export").task      # knows its outputs are probabilities, as the stage's
    x, ref_out, labels = tuning_split.load(run_dir, args.lines, args.batch, args.threads)
    if labels is None:
        raise SystemExit("int8_skip_layers: no labels for the tuning lines; cannot judge lines lost")
    with np.load(run_dir / "train" / "calib.npz") as z:
        calib = z["inputs"]
    prefix = str(run_dir / "export" / "inference")
    cb = quant.calib_batch(prefix, list(x.shape), cfg.server.batch_memory_mb, q.batch_size)

    def ptq(out: Path, skip: list[str]) -> str:
        return quant.quantize_ptq(prefix, out, calib, algo=q.algo, batch_size=cb, batch_nums=q.batch_nums,
                                  onnx_format=q.onnx_format, skip_tensor_list=skip or None,
                                  quantizable_op_type=q.op_types)

    with tempfile.TemporaryDirectory(prefix="int8skip-") as tmp:
        base_q = ptq(Path(tmp) / "base", args.base)
        ranked = quant.rank_layers(prefix, base_q, x[:min(32, cb)], q.op_types, quant._WEIGHT_SLOT)
        print("ranked on the tuning split (error each layer adds): " +
              ", ".join(f"{r['layer']} +{r['added_error']:.3f}" for r in ranked[:8]), flush=True)
        print(f"tuning lines {len(x)}, calibration batch {cb} x {q.batch_nums}; fp32 {task.primary_metric} "
              f"{task.metrics(ref_out, labels)[task.primary_metric]:.4f}")
        print("| k | skipped (besides the base) | verdict | correct lost | drop | text agreement | s | why |")
        print("|---|---|---|---|---|---|---|---|")
        for k in args.k:
            t0 = time.perf_counter()
            top = [r["layer"] for r in ranked[:k]]
            qp = base_q if k == 0 else ptq(Path(tmp) / f"k{k}", sorted(set(args.base) | set(top)))
            r = judge(task, tol, qp, x, ref_out, labels, args.batch, args.threads)
            print(f"| {k} | {','.join(top) or '-'} | {r['status']} | {r['lost']} | {r['drop']:+.4f} | "
                  f"{r['agreement']:.4f} | {time.perf_counter() - t0:.0f} | {r['reason'] or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
