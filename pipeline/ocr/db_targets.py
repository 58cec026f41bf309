"""DB training targets (Liao et al., "Real-time Scene Text Detection with Differentiable Binarization").

shrink map: each text polygon shrunk by D = A(1 - r²)/L (pyclipper offset), filled with 1;
threshold map: inside the polygon dilated by D, 1 - distance-to-border / D, rescaled to
[thresh_min, thresh_max]. Distances come from OpenCV's distance transform of the drawn border,
areas and perimeters from shapely: no hand-written geometry. Same rules as PaddleOCR's
MakeShrinkMap / MakeBorderMap.
"""
from __future__ import annotations

import cv2
import numpy as np
import pyclipper
from shapely.geometry import Polygon


def _offset(poly: np.ndarray, distance: float) -> list[np.ndarray]:
    pco = pyclipper.PyclipperOffset()
    pco.AddPath([tuple(map(float, p)) for p in poly], pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    return [np.asarray(p, dtype=np.float32) for p in pco.Execute(distance)]


def _draw_border(poly: np.ndarray, distance: float, thresh: np.ndarray, mask: np.ndarray) -> None:
    dilated = _offset(poly, distance)
    if not dilated:
        return
    outer = dilated[0]
    cv2.fillPoly(mask, [np.round(outer).astype(np.int32)], 1.0)
    h, w = thresh.shape
    x0, y0 = np.floor(outer.min(axis=0)).astype(int)
    x1, y1 = np.ceil(outer.max(axis=0)).astype(int)
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w - 1), min(y1, h - 1)
    if x1 <= x0 or y1 <= y0:
        return
    # distance of every pixel in the window to the polygon's border line
    border = np.full((y1 - y0 + 1, x1 - x0 + 1), 255, np.uint8)
    cv2.polylines(border, [np.round(poly - [x0, y0]).astype(np.int32)], True, 0, 1)
    dist = cv2.distanceTransform(border, cv2.DIST_L2, 3)
    value = 1.0 - np.clip(dist / max(distance, 1e-6), 0.0, 1.0)
    region = thresh[y0:y1 + 1, x0:x1 + 1]
    np.maximum(region, value, out=region)


def make_targets(quads: np.ndarray, height: int, width: int, shrink_ratio: float = 0.4,
                 thresh_min: float = 0.3, thresh_max: float = 0.7, min_text_size: int = 4,
                 ignore: np.ndarray | None = None) -> np.ndarray:
    """Quads float [K, 4, 2] (pixels) → float32 [4, H, W]: shrink map, shrink mask, thresh map, thresh mask.

    ignore: bool [K], True for "###" regions: masked out of the shrink mask and left out of the
    threshold map, as PaddleOCR's MakeShrinkMap / MakeBorderMap do."""
    ignore = np.zeros(len(quads), bool) if ignore is None else np.asarray(ignore, bool)
    shrink = np.zeros((height, width), np.float32)
    shrink_mask = np.ones((height, width), np.float32)
    thresh = np.zeros((height, width), np.float32)
    thresh_mask = np.zeros((height, width), np.float32)
    for poly, ign in zip(np.asarray(quads, np.float32).reshape(-1, 4, 2), ignore):
        if ign:
            cv2.fillPoly(shrink_mask, [np.round(poly).astype(np.int32)], 0.0)
            continue
        shape = Polygon(poly)
        if not shape.is_valid or shape.area < 1:
            continue
        h = poly[:, 1].max() - poly[:, 1].min()
        w = poly[:, 0].max() - poly[:, 0].min()
        distance = shape.area * (1 - shrink_ratio ** 2) / max(shape.length, 1e-6)
        shrunk = _offset(poly, -distance)
        if min(h, w) < min_text_size or not shrunk:
            # too small to learn from: neither text nor background
            cv2.fillPoly(shrink_mask, [np.round(poly).astype(np.int32)], 0.0)
        else:
            cv2.fillPoly(shrink, [np.round(shrunk[0]).astype(np.int32)], 1.0)
        _draw_border(poly, distance, thresh, thresh_mask)
    thresh = thresh * (thresh_max - thresh_min) + thresh_min
    return np.stack([shrink, shrink_mask, thresh, thresh_mask])


def batch_targets(packed: np.ndarray, height: int, width: int, **kw) -> np.ndarray:
    """Packed labels [N, B, 4, 2] (-1 padded) → [N, 4, H, W]."""
    from pipeline.data.invoice_pages import unpack_with_ignore

    return np.stack([make_targets(q, height, width, ignore=ign, **kw) for q, ign in unpack_with_ignore(packed)])
