"""The translated PP-OCRv5 det and rec on every engine row (Paddle Inference, ONNX Runtime and OpenVINO on the
paddle2onnx export, a Paddle Lite x86 fp32 .nb) against the Paddle 3.3.1 reference of tests/data/pir: max |diff| per
input, fp32, 1 thread. `make pir-check` runs it after the reference check. Exit 1 above 1e-4.

  .venv/bin/python scripts/pir_rows.py [WORKDIR]
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "pir"


def diff(role, key, y, ref):
    from pipeline.models.pir_slices import columns

    if role == "det":
        return float(np.abs(y - ref[key]).max())
    top = np.take_along_axis(y, ref[f"{key}.top_idx"].astype(np.int64), -1)
    return float(max(np.abs(top - ref[f"{key}.top_val"]).max(),
                     np.abs(y[..., columns(y.shape[-1])] - ref[f"{key}.cols"]).max()))


def rows(work: Path, role: str):
    """(row name, run(x)) for each engine on the translated program of `role`."""
    from pipeline.engines import lite, registry
    from pipeline.engines.onnx_export import export_onnx
    from pipeline.models.pir import translate
    from pipeline.ocr.ppocr_models import fetch_v5

    prefix = work / role / "inference"
    translate(fetch_v5()[role], prefix)
    onnx = export_onnx(prefix, work / f"{role}.onnx")
    for kind, f in (("paddle-inference", prefix), ("onnxruntime", onnx), ("openvino", onnx)):
        yield kind, registry.make(kind, f, "fp32", threads=1).run
    nb = lite.convert(str(prefix) + ".pdmodel", str(prefix) + ".pdiparams", work / f"{role}_x86", target="x86")
    yield f"lite x86 {nb.precision_effective} .nb", lambda x: lite.run(nb.path, x, expected_shape=list(x.shape))


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", nargs="?", type=Path, help="keep the translated programs here (default: a temp folder)")
    args = ap.parse_args()
    if args.workdir is not None:
        return check(args.workdir)
    with tempfile.TemporaryDirectory(prefix="pir-rows-") as work:
        return check(Path(work))


def check(work: Path) -> int:
    from pipeline.models.pir_check import ATOL
    from pipeline.models.pir_slices import input_keys, normalise

    inputs, ref = dict(np.load(DATA / "inputs.npz")), dict(np.load(DATA / "paddle3_ref.npz"))
    worst = 0.0
    for role in ("det", "rec"):
        for name, run in rows(work, role):
            d = {k: diff(role, k, np.asarray(run(normalise(role, inputs[k], inputs))), ref)
                 for k in input_keys(inputs, role)}
            worst = max(worst, *d.values())
            print(f"{role} {name}: " + ", ".join(f"{k} {v:.2g}" for k, v in d.items()))
    print(f"worst max|diff| vs Paddle {ref['paddle_version']}: {worst:.2g} (limit {ATOL:g})")
    return 0 if worst <= ATOL else 1


if __name__ == "__main__":
    sys.exit(main())
