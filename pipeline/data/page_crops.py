"""Recognition data as the OCR system sees it: text lines cropped out of synthetic invoice pages.

Each ground-truth quad of a rendered page is jittered by a few pixels (a detector's boxes are
never exact), cut out with the system's own perspective crop (pipeline/data/crop.py) and fitted
to the recogniser's input with preprocess.fit_image — exactly what happens at inference.
"""
from __future__ import annotations

import numpy as np

from pipeline.data.preprocess import fit_image
from pipeline.data.invoice_pages import load_or_render, unpack_quads


def _jitter(quad: np.ndarray, rng: np.random.Generator, height: float) -> np.ndarray:
    # grow/shrink the box by up to ~25 % of its height per side, corners moved independently
    grow = rng.uniform(-0.05, 0.25, size=(4, 1)) * height
    center = quad.mean(axis=0)
    direction = np.sign(quad - center)
    return (quad + direction * grow + rng.normal(0, 0.04 * height, size=(4, 2))).astype(np.float32)


def load_crops(n_pages: int, seed: int, page_h: int, page_w: int, height: int, width: int, max_len: int,
               fonts: list[str], charset: str, cache_dir: str | None) -> tuple[np.ndarray, list[str]]:
    """→ (uint8 [N, height, width] crops, labels) from n_pages pages; empty lines are skipped."""
    from pipeline.data.crop import crop_quad

    pages = load_or_render(n_pages, seed, page_h, page_w, max_boxes=64, fonts=fonts, charset=charset,
                           max_len=max_len, cache_dir=cache_dir)
    rng = np.random.default_rng(seed + 7)
    spec = {"height": height, "width": width, "resize": "pad_right"}
    from PIL import Image

    images, labels = [], []
    for img, quads, texts in zip(pages["images"], unpack_quads(pages["quads"]), pages["texts"]):
        for quad, text in zip(quads, texts):
            if not text:
                continue
            h = float(np.linalg.norm(quad[0] - quad[3]))
            crop = crop_quad(img, np.clip(_jitter(quad, rng, h), 0, [page_w - 1, page_h - 1]))
            images.append(fit_image(Image.fromarray(crop), spec))
            labels.append(str(text))
    return np.stack(images).astype(np.uint8), labels
