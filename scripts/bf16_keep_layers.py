"""Which OpenVINO layers must stay f32 for a recognizer's bf16 row to keep its text (server.bf16.openvino_keep_fp32)?

Chosen on the TUNING split (the run's train/calib.npz: training-set lines, disjoint from the validation slice the
server gate judges): each segment (a compute layer and its fused tail, pipeline/engines/ov.py layer_segments) is run
alone in bf16 and ranked by the error it adds; then the top k segments are kept f32 for k = 0, 1, 2, 4, ... and
each trial reports the tuning lines whose text changed vs f32 and its batch-8 speed vs f32 (timed interleaved,
one thread). Advised: the smallest k with the fewest changed tuning lines. Needs a CPU with bf16 (avx512_bf16/AMX).
OpenVINO 2026.4 honours the mark only on layers its CPU plugin keeps as they are: a convolution it fuses with the
next Multiply (batch norm, affine scale), a MatMul+Add it turns into FullyConnected and a layer norm it turns into
MVN are new nodes without the mark and stay bf16 (what the trials' speed and changed lines then show).

  .venv/bin/python scripts/bf16_keep_layers.py --run runs/ppocr_v4_rec [--lines 128]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeline  # noqa: E402,F401  (zlib before paddle)
import numpy as np  # noqa: E402


def changed_lines(out: np.ndarray, ref: np.ndarray) -> int:
    from pipeline.ocr.text_metrics import ctc_greedy_decode
    return sum(tuple(a) != tuple(b) for a, b in zip(ctc_greedy_decode(out), ctc_greedy_decode(ref)))


def speed(xml_f32, xml_bf16, x, rounds: int = 5, batch: int = 8) -> float:
    """f32 time / bf16 time at `batch`, one thread, the two compiled models called alternately."""
    import openvino as ov

    core = ov.Core()
    cs = [core.compile_model(str(p), "CPU", {"INFERENCE_PRECISION_HINT": h, "INFERENCE_NUM_THREADS": 1,
                                             "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1})
          for p, h in ((xml_f32, "f32"), (xml_bf16, "bf16"))]
    xb = np.ascontiguousarray(x[:batch])
    times = [[], []]
    for c in cs:
        c(xb)
    for _ in range(rounds):
        for i, c in enumerate(cs):
            t = time.perf_counter()
            c(xb)
            times[i].append(time.perf_counter() - t)
    return float(np.median(times[0]) / np.median(times[1]))


def main() -> int:
    from pipeline.engines import ov as ovx
    from pipeline.engines.onnx_export import export_onnx

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True)
    p.add_argument("--lines", type=int, default=128, help="tuning lines (from train/calib.npz)")
    p.add_argument("--out", default=None, help="write the ranking and trials as JSON here")
    args = p.parse_args()
    run = Path(args.run)
    with np.load(run / "train" / "calib.npz") as z:
        x = z["inputs"][:args.lines]
    with tempfile.TemporaryDirectory() as tmp:
        onnx = run / "server" / "onnx" / "model.onnx"
        if not onnx.is_file():
            onnx = export_onnx(run / "export" / "inference", Path(tmp) / "model.onnx")
        base = ovx.save_f32_ir(onnx, Path(tmp) / "base.xml")
        ref = ovx.run_ir(base, x, "f32")
        t0 = time.perf_counter()
        ranked = ovx.bf16_sensitivity(base, x, ref, tmp)
        print(f"ranked {len(ranked)} segments on {len(x)} tuning lines in {time.perf_counter() - t0:.0f} s")
        for s in ranked[:12]:
            print(f"  {s['error']:.3g}  {s['layer']} ({s['type']}, {len(s['names'])} layers)")
        trials, k = [], 0
        while k <= len(ranked):
            names = [n for s in ranked[:k] for n in s["names"]]
            ovx.keep_f32_ir(base, names, Path(tmp) / "keep.xml")
            out = ovx.run_ir(Path(tmp) / "keep.xml", x, "bf16")
            t = {"k": k, "layers": [s["layer"] for s in ranked[:k]], "changed": changed_lines(out, ref),
                 "speed_vs_f32_b8": round(speed(base, Path(tmp) / "keep.xml", x), 3)}
            trials.append(t)
            print(f"k={k}: {t['changed']} of {len(x)} tuning lines changed, {t['speed_vs_f32_b8']}x f32 (batch 8)")
            if t["changed"] == 0 or k == len(ranked):
                break
            k = 1 if k == 0 else min(2 * k, len(ranked))
    best = min(t["changed"] for t in trials)
    pick = next(t for t in trials if t["changed"] == best)
    print(f"advised: k={pick['k']} ({best} tuning lines changed): server.bf16.openvino_keep_fp32 = "
          f"{[s['layer'] for s in ranked[:pick['k']]]} (each with its segment's tail: ov.segment_names)")
    if args.out:
        Path(args.out).write_text(json.dumps({"ranked": ranked, "trials": trials}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
