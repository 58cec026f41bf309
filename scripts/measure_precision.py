"""Measure low-precision error over a conformance run (make conformance first): where the defaults of
server.gates.{fp16,bf16,int8} in configs/defaults.yaml come from.

For every architecture folder under --root: fp16 and bf16 emulation (Paddle's mixed-precision op lists,
see pipeline/engines/amp_emulation.py) of the exported program against its fp32 Paddle Inference output
on the validation slice, plus the int8 row the server stage recorded. Prints one table:
max|diff|, reference scale max|ref|, their ratio (what rtol must cover), agreement, metric drop; for models
ending in softmax/sigmoid (PP-OCR) max|diff| is in probability space (what prob_atol bounds).
bf16 is emulated rounding (this CPU may lack bf16 kernels): label it so wherever it is quoted.
`--run runs/ppocr_v4_det --batch 2` measures single run folders (the real PP-OCR models) instead of a root.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
import numpy as np
from rich.console import Console
from rich.table import Table


def measure(run_dir: Path, batch: int = 64) -> list[dict]:
    from pipeline.engines.paddle_infer import InferenceEngine, make_fp16_emulated
    from pipeline.tasks.reference import load_reference

    ref = load_reference(run_dir / "export")
    task, x, labels = ref.task, ref.inputs, ref.labels
    fp32 = InferenceEngine(ref.model_prefix, "fp32", threads=1).run_batched(x, batch)
    base = task.metrics(fp32, labels)[task.primary_metric]
    rows = [_row(run_dir.name, "export vs fp32", ref.outputs, fp32, task, labels, base)]
    with tempfile.TemporaryDirectory() as tmp:
        for dt in ("fp16", "bf16"):
            make_fp16_emulated(ref.model_prefix, Path(tmp) / dt / "model", dt)
            out = InferenceEngine(Path(tmp) / dt / "model", "fp16" if dt == "fp16" else "fp32", threads=1).run_batched(x, batch)
            rows.append(_row(run_dir.name, f"{dt}-emulated", out, fp32, task, labels, base))
    if not (run_dir / "server").is_dir() and not (run_dir / "server.failed").is_dir():
        return rows
    server = json.loads((run_dir / "server" / "manifest.json").read_text()) if (run_dir / "server" / "manifest.json").is_file() \
        else json.loads((run_dir / "server.failed" / "manifest.json").read_text())
    int8 = next((g for g in server["gates"] if g["subject"] == "paddle-inference int8"), None)
    if int8 and int8["status"] != "SKIPPED":
        c = {ch["name"]: ch["observed"] for ch in int8["checks"]}
        rows.append({"arch": run_dir.name, "precision": int8["precision_effective"], "max_abs": c.get("max_abs_diff"),
                     "scale": None, "ratio": None,
                     "agreement": next((v for k, v in c.items() if k.endswith("_agreement")), None),
                     "drop": next((v for k, v in c.items() if k.endswith("_drop")), None)})
    return rows


def _row(arch, precision, out, ref, task, labels, base) -> dict:
    diff = float(np.abs(out.astype(np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    return {"arch": arch, "precision": precision, "max_abs": diff, "scale": scale, "ratio": diff / max(scale, 1e-12),
            "agreement": task.agreement(out, ref)[2], "drop": base - task.metrics(out, labels)[task.primary_metric]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="runs/conformance")
    p.add_argument("--run", nargs="*", default=[], help="run folders to measure instead of --root")
    p.add_argument("--batch", type=int, default=64, help="batch size (v4 det at 736x736: 2 keeps it under 3 GB)")
    args = p.parse_args()
    rows = []
    dirs = [Path(r) for r in args.run] or sorted(Path(args.root).iterdir())
    for d in dirs:
        if (d / "export" / "manifest.json").is_file():
            rows += measure(d, args.batch)
    t = Table(title=f"low-precision error over {args.root} (validation slice vs Paddle Inference fp32)")
    for col in ("architecture", "precision", "max|diff|", "max|ref|", "ratio", "strict agreement", "metric drop"):
        t.add_column(col)
    f = (lambda v: "" if v is None else f"{v:.3g}")
    for r in rows:
        t.add_row(r["arch"], r["precision"], f(r["max_abs"]), f(r["scale"]), f(r["ratio"]), f(r["agreement"]), f(r["drop"]))
    Console(width=140).print(t)
    for prec in sorted({r["precision"] for r in rows}):
        sel = [r for r in rows if r["precision"] == prec]
        worst = {k: max((r[k] for r in sel if r[k] is not None), default=None) for k in ("max_abs", "ratio", "drop")}
        low = min((r["agreement"] for r in sel if r["agreement"] is not None), default=None)
        print(f"{prec}: worst max|diff| {f(worst['max_abs'])}, worst ratio {f(worst['ratio'])}, "
              f"lowest agreement {f(low)}, worst drop {f(worst['drop'])} over {len(sel)} architectures")
    if not args.run:
        Path(args.root, "precision_measurements.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
