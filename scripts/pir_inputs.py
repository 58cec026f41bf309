"""The few inputs of the PIR reference data (tests/data/pir/inputs.npz): real images from tests/data/real_images,
decoded by OpenCV (BGR) and resized to small fixed shapes, stored as uint8 with the models' normalisation constants
from their inference.yml. `make pir-reference` runs it, then Paddle 3 and ONNX Runtime on the same arrays.

  .venv/bin/python scripts/pir_inputs.py [V5_DIR] [OUT]
"""
import zlib

import sys
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "tests" / "data" / "real_images"
DET = [("ch_en_num.jpg", (128, 160)), ("return_word_debug.jpg", (96, 128))]      # (H, W), multiples of 32
REC = [("text_rec.jpg", 48), ("test_without_det.jpg", 48)]                        # height 48, width kept to 8s


def _rec_resize(img, h):
    w = int(min(320, max(8, round(img.shape[1] * h / img.shape[0] / 8) * 8)))
    return cv2.resize(img, (w, h))


def main():
    sys.path.insert(0, str(ROOT))
    from pipeline.models.pir_yml import hints

    v5 = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".cache" / "ppocr_v5"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests" / "data" / "pir" / "inputs.npz"
    det = hints(v5 / "det")
    z = {"det_mean": np.float32(det["detection.mean"]), "det_std": np.float32(det["detection.std"]),
         "rec_mean": np.float32([0.5] * 3), "rec_std": np.float32([0.5] * 3)}       # RecResizeImg: (x/255-0.5)/0.5
    for i, (name, (h, w)) in enumerate(DET):
        z[f"det_{i}"] = cv2.resize(cv2.imread(str(IMAGES / name), cv2.IMREAD_COLOR), (w, h))
    for i, (name, h) in enumerate(REC):
        z[f"rec_{i}"] = _rec_resize(cv2.imread(str(IMAGES / name), cv2.IMREAD_COLOR), h)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **z)
    print(f"wrote {out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in z.items() if v.ndim == 3))


if __name__ == "__main__":
    main()
