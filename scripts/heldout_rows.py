"""Is a failed low-precision row real damage or a draw near its limit? Re-judge a run's quantized models on a FRESH
held-out sample (issue 51).

The server gate judges one validation slice (train.val_slice samples, seed+1). A row that fails by a few samples may
be the instance's int8 damage or a slice that happened to hold a few more near-ties. This script renders a sample
from another seed (neither the training lines nor the gate's slice; never used to choose anything), runs the run's
own fp32 export and its int8 models (Paddle Inference PTQ, ONNX Runtime, OpenVINO: the very files the server stage
gated) and judges each with the run's server.gates.int8, labels included, on the gate slice again (it must reproduce
the rows) and on the fresh sample. It prints the correct lines lost with a 95 % Wilson interval, the metric drop with
a paired bootstrap interval, and strict agreement: an interval wholly past the limit is damage, one that holds the
limit is a draw. Results of the zoo: docs/conformance.md "The int8 failures".

  .venv/bin/python scripts/heldout_rows.py --run runs/conformance/svtr_lcnet --seed 2042 --n 2048
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)

MODELS = {"paddle-inference int8": "models/int8/model", "onnxruntime int8": "onnx/model_int8.onnx",
          "openvino int8": "openvino/model_int8.xml"}


def server_dir(run: Path) -> Path:
    return run / "server" if (run / "server").is_dir() else run / "server.failed"


def openvino_int8(run: Path, cfg, x_shape, out: Path) -> Path:
    """The stage's OpenVINO int8 model again (a failed row's file is not kept): the same export, calibration lines,
    batch and NNCF settings (deterministic: the gate slice reproduces the row, printed beside it)."""
    import numpy as np
    from pipeline.engines import ov, quant

    q, prefix = cfg.server.quant, run / "export" / "inference"
    with np.load(run / "train" / "calib.npz") as z:
        calib = z["inputs"]
    cb = quant.calib_batch(prefix, list(x_shape), cfg.server.memory_budget_mb, q.batch_size)
    ov.quantize_int8(server_dir(run) / "onnx" / "model.onnx", out, calib, batch_size=cb, batch_nums=q.batch_nums,
                     weights=quant.weights_to_quantize(prefix, q.op_types, q.skip), preset=q.nncf_preset,
                     activation_range=q.nncf_activation_range)
    return out


def drop_interval(task, out, ref, labels, rounds: int = 200) -> tuple[float, float]:
    """95 % bootstrap interval of the metric drop (paired: the same resampled samples for both)."""
    import numpy as np

    m, rng, drops = task.primary_metric, np.random.default_rng(0), []
    for _ in range(rounds):
        i = rng.integers(0, len(ref), len(ref))
        drops.append(task.metrics(ref[i], labels[i])[m] - task.metrics(out[i], labels[i])[m])
    return float(np.percentile(drops, 2.5)), float(np.percentile(drops, 97.5))


def main() -> int:
    from pipeline.core.config import load_config
    from pipeline.core.gates import judge_try
    from pipeline.data.preprocess import to_tensor
    from pipeline.engines import registry
    from pipeline.nightly.conformance_rules import wilson
    from pipeline.tasks.reference import load_reference

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run folder with export/, server/ and config.resolved.yaml")
    p.add_argument("--seed", type=int, default=2042, help="held-out samples come from seed+1 (the gate's: run seed+1)")
    p.add_argument("--n", type=int, default=2048, help="held-out samples")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    run = Path(args.run)
    cfg = load_config([run / "config.resolved.yaml"])
    if args.seed == cfg.seed:
        raise SystemExit(f"heldout_rows: --seed {args.seed} is the run's own (its training and gate samples); pick another")
    gate = load_reference(run / "export")          # the gate's slice: its inputs, fp32 outputs and labels
    task = gate.task
    data_cfg = {**cfg.section("data")["data"], "num_train": 64, "num_val": args.n}
    ds = task.load_data(data_cfg, args.seed)
    x, labels = to_tensor(ds.val.images, task.preprocess_spec(data_cfg, ds.info)), ds.val.labels
    ref = registry.make("paddle-inference", run / "export" / "inference", "fp32", threads=args.threads).run_batched(x, args.batch)
    tol = cfg.server.gates["int8"]
    m = task.primary_metric
    print(f"{run.name}: gate slice {len(gate.inputs)} samples (fp32 {m} {gate.metric:.4f}), held-out {len(x)} samples "
          f"(seed {args.seed + 1}, fp32 {m} {task.metrics(ref, labels)[m]:.4f}); int8 limits: metric_delta "
          f"{tol.metric_delta}, max_correct_lost {tol.max_correct_lost}")
    samples = {"gate slice": (gate.inputs, gate.outputs, gate.labels), f"held-out (seed {args.seed + 1})": (x, ref, labels)}
    print("| row | sample | verdict | correct lost | share (95 % interval) | drop (95 % interval) | strict agreement |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        for row, rel in MODELS.items():
            kind, path = row.split()[0], server_dir(run) / rel
            if kind == "openvino" and not path.is_file():
                path = openvino_int8(run, cfg, gate.inputs.shape, Path(tmp) / "model_int8.xml")
            eng = registry.make(kind, path, "int8", threads=args.threads)
            for name, (xs, ref_out, lab) in samples.items():
                out = eng.run_batched(xs, args.batch)
                r = judge_try(task, tol, out, ref_out, lab, "int8", key="server.gates.int8")
                lo, hi = drop_interval(task, out, ref_out, lab)
                lost = share = ""
                if r["lost"] is not None:
                    lost = f"{r['lost']} of {r['of']}"
                    share = "{:.3f} ({:.3f}-{:.3f})".format(r["lost"] / max(r["of"], 1), *wilson(r["lost"], r["of"]))
                print(f"| {row} | {name} | {'OK' if r['passed'] else 'FAIL'} | {lost} | {share} | "
                      f"{r['drop']:+.4f} ({lo:+.4f} to {hi:+.4f}) | {r['strict']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
