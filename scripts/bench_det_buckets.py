"""Detector input buckets (`system.det_bucket`, issue 48): per-page detection time on a fresh engine's first pass
(every new input shape costs the runtime its kernel preparation) and on a repeat, with and without buckets, and the
lines each reads on the real images.

One fresh detector engine per bucket setting (the recogniser and classifier are shared, warmed by one pass first);
pages are timed interleaved, page by page, the settings' order rotating per page, so a loaded machine's drift falls
on every setting alike. `python scripts/bench_det_buckets.py --buckets 0 64 128 --passes 2 [--engine openvino]`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)

ROOT = Path(__file__).resolve().parent.parent


def build(args):
    from pipeline.core.config import load_config
    from pipeline.ocr.ppocr_models import fetch
    from pipeline.tasks import ppocr_system

    sys_cfg = load_config([ROOT / args.config])
    models = fetch()
    spec = ppocr_system.spec_from_configs(load_config([ROOT / sys_cfg.system.detection]), sys_cfg, models["keys"])
    cache = ROOT / ".cache" / "ppocr" / "onnx"
    _, rec, cls = ppocr_system.engines(models, args.engine, 1, cache)
    dets = {b: ppocr_system.engines(models, args.engine, 1, cache, use_cls=False)[0] for b in args.buckets}
    return dets, rec, cls, spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ppocr_v4_system.yaml")
    ap.add_argument("--engine", default="openvino", choices=("onnxruntime", "openvino"))
    ap.add_argument("--buckets", type=int, nargs="+", default=[0, 64, 128])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--images", default=str(ROOT / "tests" / "data" / "real_images"))
    args = ap.parse_args(argv)
    import cv2

    from pipeline.ocr import ppocr, system
    from pipeline.ocr.pages import decode_page

    cv2.setNumThreads(1)
    dets, rec, cls, spec = build(args)
    pages = {p.name: decode_page(p.read_bytes()) for p in sorted(Path(args.images).iterdir())
             if p.suffix.lower() in (".png", ".jpg", ".jpeg")}
    specs = {b: system.SystemSpec(spec.det_pre, spec.det_post, spec.rec_pre, spec.rec_post, spec.cls_pre,
                                  {**spec.flow, "det_bucket": b}) for b in args.buckets}
    timed = {b: 0.0 for b in args.buckets}
    orig = system.detect_page

    def detect_timed(page, det, sp, scale=1.0):
        t0 = time.perf_counter()
        try:
            return orig(page, det, sp, scale)
        finally:
            timed[sp.flow["det_bucket"]] += time.perf_counter() - t0

    system.detect_page = detect_timed
    lines = {}
    for k in range(args.passes):
        for b in timed:
            timed[b] = 0.0
        for i, (name, page) in enumerate(pages.items()):
            order = args.buckets[i % len(args.buckets):] + args.buckets[:i % len(args.buckets)]
            for b in order:
                got = system.read_page_ppocr(page, dets[b], rec, specs[b], cls)
                lines.setdefault(b, {})[name] = [(ln["text"], ln["box"]) for ln in got]
        print(f"pass {k + 1} ({'first: every shape new to each engine' if k == 0 else 'repeat'}), detection "
              f"ms/page over {len(pages)} pages:")
        for b in args.buckets:
            print(f"  det_bucket {b:4d}: {1000 * timed[b] / len(pages):8.1f} ms/page  "
                  f"({timed[b] / timed[args.buckets[0]]:.3f}x of det_bucket {args.buckets[0]})")
    shapes(pages, spec, args.buckets, ppocr)
    base = lines[args.buckets[0]]
    total = sum(len(v) for v in base.values())
    for b in args.buckets[1:]:
        kept = sum(len(texts_kept([t for t, _ in base[n]], [t for t, _ in lines[b][n]])) for n in pages)
        moved = sum(1 for n in pages if base[n] != lines[b][n])
        print(f"det_bucket {b}: {kept}/{total} of det_bucket {args.buckets[0]}'s line texts read the same; "
              f"{moved}/{len(pages)} pages with any box or text changed")
        for n in pages:
            a, c = [t for t, _ in base[n]], [t for t, _ in lines[b][n]]
            if a != c:
                print(f"  {n}: {a} -> {c}")
    return 0


def texts_kept(a: list[str], b: list[str]) -> list[str]:
    """The texts of `a` also in `b` (as a multiset)."""
    rest, out = list(b), []
    for t in a:
        if t in rest:
            rest.remove(t)
            out.append(t)
    return out


def shapes(pages: dict, spec, buckets: list, ppocr) -> None:
    """The detector's distinct input shapes per setting (the page steps and limit rule as the flow applies them)."""
    sizes = []
    for page in pages.values():
        work, _ = ppocr.prepare_page(ppocr.to_bgr(page), spec.flow)
        sizes.append(ppocr.det_resize_shape(*work.shape[:2], int(spec.det_pre["limit_side_len"]),
                                            spec.det_pre["limit_type"]))
    for b in buckets:
        got = [ppocr.bucketed_size(h, w, b) for h, w in sizes]
        px = sum(h * w for h, w in got) / sum(h * w for h, w in sizes)
        print(f"det_bucket {b:4d}: {len(set(got))} distinct input shapes of {len(got)} pages, {px:.3f}x the pixels")


if __name__ == "__main__":
    sys.exit(main())
