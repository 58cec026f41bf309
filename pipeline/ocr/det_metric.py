"""Detection metric: precision, recall and hmean at an IoU threshold (shapely polygons).

Predictions and ground truth are matched one-to-one, greedily by descending IoU (ICDAR-style);
a pair counts when IoU >= iou. Counts are summed over the data set before dividing.
"""
from __future__ import annotations

import numpy as np
from shapely.geometry import Polygon


def _poly(q: np.ndarray) -> Polygon:
    p = Polygon(np.asarray(q, dtype=np.float64))
    return p if p.is_valid else p.buffer(0)


def iou_matrix(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    pp, gp = [_poly(q) for q in pred], [_poly(q) for q in gt]
    out = np.zeros((len(pp), len(gp)))
    for i, a in enumerate(pp):
        for j, b in enumerate(gp):
            if a.intersects(b):
                inter = a.intersection(b).area
                union = a.area + b.area - inter
                out[i, j] = inter / union if union > 0 else 0.0
    return out


def match(pred: np.ndarray, gt: np.ndarray, iou: float = 0.5) -> list[tuple[int, int]]:
    """One-to-one (pred index, gt index) pairs with IoU >= iou, best pairs first."""
    if len(pred) == 0 or len(gt) == 0:
        return []
    m = iou_matrix(pred, gt)
    pairs, used_p, used_g = [], set(), set()
    for flat in np.argsort(-m, axis=None, kind="stable"):
        i, j = divmod(int(flat), m.shape[1])
        if m[i, j] < iou:
            break
        if i not in used_p and j not in used_g:
            pairs.append((i, j))
            used_p.add(i)
            used_g.add(j)
    return pairs


def detection_scores(preds: list[np.ndarray], gts: list[np.ndarray], iou: float = 0.5) -> dict[str, float]:
    tp = n_pred = n_gt = 0
    for p, g in zip(preds, gts):
        tp += len(match(p, g, iou))
        n_pred += len(p)
        n_gt += len(g)
    precision = tp / n_pred if n_pred else (1.0 if n_gt == 0 else 0.0)
    recall = tp / n_gt if n_gt else 1.0
    hmean = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {"hmean": float(hmean), "precision": float(precision), "recall": float(recall)}
