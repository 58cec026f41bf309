"""Detection metric: precision, recall and hmean at an IoU threshold (shapely polygons).

Predictions and ground truth are matched one-to-one, greedily by descending IoU (ICDAR-style);
a pair counts when IoU >= iou. Counts are summed over the data set before dividing.
"###" ground truth is don't-care, as in PaddleOCR's DetectionIoUEvaluator: it is not counted, and a
detection lying mostly inside one (intersection / detection area > 0.5) is neither TP nor FP.
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


AREA_PRECISION = 0.5      # DetectionIoUEvaluator's area_precision_constraint


def _not_in_ignored(pred: np.ndarray, ignored: np.ndarray) -> np.ndarray:
    """bool per detection: False when more than half its area lies inside one ignored box."""
    keep = np.ones(len(pred), bool)
    igs = [_poly(q) for q in ignored]
    for i, q in enumerate(pred):
        p = _poly(q)
        keep[i] = not any(p.area > 0 and p.intersection(g).area / p.area > AREA_PRECISION for g in igs)
    return keep


def detection_scores(preds: list[np.ndarray], gts: list[np.ndarray], iou: float = 0.5,
                     ignores: list[np.ndarray] | None = None) -> dict[str, float]:
    """gts: per page all boxes; ignores: per page bool "###" flags (None: every box counts)."""
    tp = n_pred = n_gt = 0
    for k, (p, g) in enumerate(zip(preds, gts)):
        ign = np.zeros(len(g), bool) if ignores is None else np.asarray(ignores[k], bool)
        p = p[_not_in_ignored(p, g[ign])] if ign.any() and len(p) else p
        g = g[~ign]
        tp += len(match(p, g, iou))
        n_pred += len(p)
        n_gt += len(g)
    precision = tp / n_pred if n_pred else (1.0 if n_gt == 0 else 0.0)
    recall = tp / n_gt if n_gt else 1.0
    hmean = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {"hmean": float(hmean), "precision": float(precision), "recall": float(recall)}
