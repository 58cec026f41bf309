"""Where a page's time goes in the OCR system (pipeline/ocr/system.read_pages, PaddleOCR's flow) on the real images.

Each step of the flow is timed by wrapping the function the flow calls (inclusive wall time, 1 thread):
det pre (resize + normalize), det model, det post (DB: binarize, contours, box score, unclip), box order, crops
(perspective warps), cls (pre + model), rec pre (resize + normalize + padding), rec model, rec decode (CTC, scores),
and the rest (page steps, box mapping, lines). Engines come from a system bundle (--bundle, each part as served) or
from the fetched models on one runtime (--engine). Reports seconds per step and its share of the pages' total, and
per rec batch the padded input width against the crops' own widths (padding waste). --passes N repeats the pages
(shapes repeat from the second pass on: a runtime's shape cache then shows as the first pass's extra time).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)

ROOT = Path(__file__).resolve().parent.parent
T: dict[str, float] = defaultdict(float)
N: dict[str, int] = defaultdict(int)
PAD: list[tuple[int, int, int]] = []        # (batch size, input width, sum of the crops' own widths at height 48)


def _timed(name: str, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            T[name] += time.perf_counter() - t0
            N[name] += 1
    return wrapper


class _Engine:
    def __init__(self, name: str, engine):
        self.name, self.engine = name, engine

    def __getattr__(self, attr):
        return getattr(self.engine, attr)

    def run(self, x):
        if self.name == "rec model":
            PAD.append((len(x), x.shape[-1], int(((x != 0).any(axis=(1, 2))).sum())))
        return _timed(self.name, self.engine.run)(x)


def instrument() -> None:
    """Wrap the steps the flow calls (the names pipeline/ocr/system.py and db_post.py look up at call time)."""
    from pipeline.ocr import db_post, ppocr, system

    for mod, attr, name in ((ppocr, "det_input", "det pre"), (system, "boxes_from_map", "det post"),
                            (db_post, "_unclip", "det post: unclip"), (db_post, "_box_score", "det post: box score"),
                            (db_post, "_mini_box", "det post: min-area box"), (ppocr, "sorted_boxes", "box order"),
                            (system, "crop_quad", "crops (warps)"), (system, "classify_crops", "cls (pre+model)"),
                            (ppocr, "resize_norm", "resize_norm (rec+cls pre)"),
                            (system, "ctc_greedy_decode", "rec decode"), (system, "decode_indices", "rec decode"),
                            (system, "_line_scores", "rec decode"), (system, "recognize_pages", "rec (all)"),
                            (system, "read_page_ppocr", "page total")):
        setattr(mod, attr, _timed(name, getattr(mod, attr)))


def engines(args):
    from pipeline.tasks import ppocr_system

    if args.bundle:
        from pipeline.bundle.system import served_system
        det, rec, cls, spec = served_system(Path(args.bundle), threads=1, kind=None)
    else:
        from pipeline.core.config import load_config
        from pipeline.ocr.ppocr_models import fetch

        sys_cfg = load_config([ROOT / args.config])
        models = fetch()
        spec = ppocr_system.spec_from_configs(load_config([ROOT / sys_cfg.system.detection]), sys_cfg, models["keys"])
        det, rec, cls = ppocr_system.engines(models, args.engine, 1, ROOT / ".cache" / "ppocr" / "onnx")
    return _Engine("det model", det), _Engine("rec model", rec), _Engine("cls model", cls), spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ppocr_v4_system.yaml")
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--engine", default="openvino", choices=("paddle-inference", "onnxruntime", "openvino"))
    ap.add_argument("--images", default=str(ROOT / "tests" / "data" / "real_images"))
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--cprofile", default=None, help="also write a cProfile of the timed pass here")
    args = ap.parse_args(argv)
    from pipeline.ocr.pages import decode_page
    from pipeline.ocr.system import read_pages

    det, rec, cls, spec = engines(args)
    pages = [decode_page(p.read_bytes()) for p in sorted(Path(args.images).iterdir())
             if p.suffix.lower() in (".png", ".jpg", ".jpeg")]
    read_pages([np.full((480, 640, 3), 255, np.uint8)], det, rec, spec, cls=cls)      # warm-up, not counted
    instrument()
    prof = None
    if args.cprofile:
        import cProfile
        prof = cProfile.Profile()
    for k in range(args.passes):
        for acc in (T, N, PAD):
            acc.clear()
        if prof and k == args.passes - 1:
            prof.enable()
        for page in pages:
            read_pages([page], det, rec, spec, cls=cls)
        if prof:
            prof.disable()
        report(k, len(pages))
    if prof:
        prof.dump_stats(args.cprofile)
    return 0


def report(k: int, pages: int) -> None:
    total = T["page total"]
    cls_pre = T["cls (pre+model)"] - T["cls model"]
    rec_pre = T["rec (all)"] - T["rec model"] - T["rec decode"]
    dpost = T["det post"]
    rows = [("det pre (resize+normalize)", T["det pre"]), ("det model", T["det model"]),
            ("det post (DB) total", dpost), ("  of which unclip", T["det post: unclip"]),
            ("  of which box score", T["det post: box score"]), ("  of which min-area box", T["det post: min-area box"]),
            ("box order", T["box order"]), ("crops (perspective warps)", T["crops (warps)"]),
            ("cls pre (resize_norm, batching)", cls_pre), ("cls model", T["cls model"]),
            ("rec pre (resize_norm, padding)", rec_pre), ("rec model", T["rec model"]), ("rec decode", T["rec decode"])]
    parts = T["det pre"] + T["det model"] + dpost + T["box order"] + T["crops (warps)"] + T["cls (pre+model)"] \
        + T["rec (all)"]
    rows.append(("rest (page steps, box mapping, lines)", total - parts))
    print(f"pass {k + 1}: {pages} pages, {total:.2f} s ({pages / total:.2f} pages/s)")
    for name, s in rows:
        print(f"  {name:40s} {s:7.3f} s  {100 * s / total:5.1f} %")
    if PAD:
        n = sum(b for b, _, _ in PAD)
        used = sum(u for _, _, u in PAD)
        print(f"  rec: {len(PAD)} calls, {n} crops, input columns {sum(b * w for b, w, _ in PAD)}, "
              f"columns with content {used} ({100 * used / max(1, sum(b * w for b, w, _ in PAD)):.0f} %), "
              f"distinct widths {len({w for _, w, _ in PAD})}")


if __name__ == "__main__":
    sys.exit(main())
