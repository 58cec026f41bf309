"""DB post-processing: probability map → text quadrilaterals with scores.

The ONE implementation: training metrics, every engine row, the bundle's verify, `serve`
/predict and /ocr all call `boxes_from_map`; the bundle's infer_config.yaml carries `params`.
Binarize → contours (OpenCV) → min-area rectangle → mean probability inside (box score) →
unclip by D = A·ratio/L (pyclipper offset, shapely area/length) → min-area rectangle again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import cv2
import numpy as np
import pyclipper
from shapely.geometry import Polygon


@dataclass(frozen=True)
class DBParams:
    thresh: float = 0.3           # probability above which a pixel is text
    box_thresh: float = 0.6       # minimum mean probability inside a box
    unclip_ratio: float = 1.5     # how far the shrunk kernel is grown back (DB's r = 0.4 ↔ 1.5)
    max_candidates: int = 200     # contours examined per image
    min_size: float = 3.0         # boxes with a shorter side (pixels) are dropped
    use_dilation: bool = False    # dilate the binary map by a 2x2 kernel first (PaddleOCR's use_dilation)

    @classmethod
    def from_dict(cls, d: dict | None) -> "DBParams":
        d = d or {}
        return cls(**{k: d[k] for k in asdict(cls()) if k in d})

    def to_dict(self) -> dict:
        return asdict(self)


def _mini_box(contour: np.ndarray) -> tuple[np.ndarray, float]:
    """Min-area rectangle as 4 points clockwise from top-left, and its shorter side."""
    rect = cv2.minAreaRect(contour)
    pts = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = sorted(pts[:2], key=lambda p: p[1])
    right = sorted(pts[2:], key=lambda p: p[1])
    box = np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)
    return box, min(rect[1])


def _box_score(prob: np.ndarray, box: np.ndarray) -> float:
    h, w = prob.shape
    x0, y0 = np.clip(np.floor(box.min(axis=0)).astype(int), 0, [w - 1, h - 1])
    x1, y1 = np.clip(np.ceil(box.max(axis=0)).astype(int), 0, [w - 1, h - 1])
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), np.uint8)
    cv2.fillPoly(mask, [(box - [x0, y0]).astype(np.int32)], 1)      # truncation, as PaddleOCR's box_score_fast
    return float(cv2.mean(prob[y0:y1 + 1, x0:x1 + 1], mask)[0])


def _unclip(box: np.ndarray, ratio: float) -> np.ndarray | None:
    poly = Polygon(box)
    distance = poly.area * ratio / max(poly.length, 1e-6)
    pco = pyclipper.PyclipperOffset()
    pco.AddPath([tuple(map(float, p)) for p in box], pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    out = pco.Execute(distance)
    return np.asarray(out[0], dtype=np.float32) if len(out) == 1 else None


def boxes_from_map(prob: np.ndarray, params: DBParams, out_size: tuple[int, int] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """prob [H, W] (or [1, H, W]) → (quads float32 [K, 4, 2] in out_size (h, w) pixels, scores [K]).

    Quads are in reading order: top to bottom, then left to right.
    """
    prob = np.asarray(prob, dtype=np.float32).reshape(prob.shape[-2:])
    h, w = prob.shape
    oh, ow = out_size or (h, w)
    bitmap = (prob > params.thresh).astype(np.uint8)
    if params.use_dilation:
        bitmap = cv2.dilate(bitmap, np.ones((2, 2), np.uint8))
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    quads, scores = [], []
    for contour in contours[:params.max_candidates]:
        box, side = _mini_box(contour.reshape(-1, 2).astype(np.float32))
        if side < params.min_size:
            continue
        score = _box_score(prob, box)
        if score < params.box_thresh:
            continue
        grown = _unclip(box, params.unclip_ratio)
        if grown is None:
            continue
        box, side = _mini_box(grown)
        if side < params.min_size + 2:
            continue
        # back to the output frame (the original image), whole pixels as PaddleOCR's DBPostProcess
        box[:, 0] = np.clip(np.round(box[:, 0] * ow / w), 0, ow - 1)
        box[:, 1] = np.clip(np.round(box[:, 1] * oh / h), 0, oh - 1)
        quads.append(box)
        scores.append(score)
    if not quads:
        return np.zeros((0, 4, 2), np.float32), np.zeros((0,), np.float32)
    quads_a, scores_a = np.stack(quads), np.asarray(scores, np.float32)
    order = reading_order(quads_a)
    return quads_a[order], scores_a[order]


def reading_order(quads: np.ndarray) -> np.ndarray:
    """Indices sorting boxes into rows (centres within half a box height) and then by x."""
    if len(quads) == 0:
        return np.zeros((0,), int)
    cy = quads[:, :, 1].mean(axis=1)
    cx = quads[:, :, 0].mean(axis=1)
    hgt = np.maximum(quads[:, :, 1].max(axis=1) - quads[:, :, 1].min(axis=1), 1.0)
    idx = list(np.argsort(cy, kind="stable"))
    rows: list[list[int]] = []
    for i in idx:
        if rows and abs(cy[i] - np.mean([cy[j] for j in rows[-1]])) < 0.5 * hgt[i]:
            rows[-1].append(i)
        else:
            rows.append([i])
    return np.array([i for row in rows for i in sorted(row, key=lambda j: cx[j])], dtype=int)


def detect_batch(outputs: np.ndarray, params: DBParams, out_sizes: list[tuple[int, int]] | None = None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Model outputs [N, 1, H, W] → per image (quads, scores)."""
    outputs = np.asarray(outputs)
    return [boxes_from_map(outputs[i], params, out_sizes[i] if out_sizes else None) for i in range(len(outputs))]
