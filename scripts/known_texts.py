"""GT.tsv's known texts read by a system config's det/rec models on the real images, without a chain run.

The models as the chain imports them, each run by ONNX Runtime fp32 (a v4 `.pdmodel` and a translated v5 PIR
export through paddle2onnx, a v6 `.onnx` as it is), with the v4 mobile classifier, the config's detection and flow
settings, and any overrides: `python scripts/known_texts.py configs/ppocr_v5_system.yaml -d box_thresh=0.5`.
Prints each image's lines and the count of known texts read (scripts/ocr_peers.py's KNOWN and matching).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)


def onnx_of(model_cfg: dict, work: Path, role: str) -> Path:
    """The ONNX file ONNX Runtime runs for a det/rec config's model section."""
    from pipeline.engines.onnx_export import export_onnx

    src = model_cfg["source"]
    if src == "onnx":
        return Path(model_cfg["path"])
    if (work / f"{role}.onnx").is_file():        # converted by an earlier call (same config's model)
        return work / f"{role}.onnx"
    if src == "pir":
        from pipeline.models.pir import translate
        prefix = work / role / "inference"
        translate(model_cfg["path"], prefix)
    else:
        prefix = Path(model_cfg["path"]) / "inference"
    return export_onnx(prefix, work / f"{role}.onnx")


def main() -> int:
    from ocr_peers import CROPS, IMAGES, KNOWN, known as _known, pages as _pages

    from pipeline.core.config import load_config
    from pipeline.engines import registry
    from pipeline.ocr.ppocr_models import fetch
    from pipeline.ocr.system import read_crops, read_pages
    from pipeline.tasks import ppocr_system

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="an ocr_system config (configs/ppocr_v5_system.yaml)")
    ap.add_argument("-d", "--det", action="append", default=[], help="detection.KEY=VALUE override")
    ap.add_argument("-o", "--det-config", action="append", default=[], help="KEY=VALUE override of the det config")
    ap.add_argument("-s", "--system", action="append", default=[], help="system.KEY=VALUE override")
    args = ap.parse_args()
    sys_cfg = load_config([ROOT / args.config], [f"system.{o}" for o in args.system])
    s = sys_cfg.system
    det_cfg = load_config([ROOT / s.detection], [f"detection.{o}" for o in args.det] + args.det_config)
    rec_cfg = load_config([ROOT / s.recognition])
    keys = Path(rec_cfg.data.charset) if rec_cfg.data.charset else fetch()["keys"]
    spec = ppocr_system.spec_from_configs(det_cfg, sys_cfg, keys)
    cache = ROOT / ".cache" / "known_texts"       # conversions kept between calls (per run.name)
    files = {r: onnx_of(c.section("model")["model"], cache / c.run.name, r) for r, c in (("det", det_cfg),
                                                                                     ("rec", rec_cfg))}
    files["cls"] = ppocr_system.model_file(fetch(), "cls", "onnxruntime", ROOT / ".cache" / "ppocr" / "onnx")
    det, rec, cls = (registry.make("onnxruntime", files[r], "fp32", threads=1) for r in ("det", "rec", "cls"))
    read = 0
    for name, img in _pages(IMAGES).items():
        texts = read_crops([img], rec, spec, cls) if name in CROPS else \
            [ln["text"] for ln in read_pages([img], det, rec, spec, cls=cls)[0]]
        ok = _known(name, texts)
        read += int(ok and bool(KNOWN.get(name)))
        mark = "" if not KNOWN.get(name) else " [known read]" if ok else f" [MISSED {KNOWN[name]}]"
        print(f"{name}: {' | '.join(texts)[:120]}{mark}")
    print(f"known texts read: {read} of {len(KNOWN)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
