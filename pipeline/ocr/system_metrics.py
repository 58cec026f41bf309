"""End-to-end OCR metrics on invoice pages.

line_accuracy: ground-truth lines read exactly, after matching predicted boxes to ground-truth
  quads one-to-one at IoU >= iou (pipeline/ocr/det_metric.match); a missed line counts as wrong.
field_accuracy: invoice number, date and amount read from the predicted lines the way a user
  would (the value is the nearest line right of the field's key on the same row) and compared
  exactly with the page's true values.
agreement: share of lines two runs of the system read identically (texts at matched boxes).
"""
from __future__ import annotations

import numpy as np

from pipeline.data.invoice_pages import FIELDS
from pipeline.ocr.det_metric import match


def _quads(lines: list[dict]) -> np.ndarray:
    return np.array([ln["box"] for ln in lines], dtype=np.float32).reshape(-1, 4, 2)


def extract_fields(lines: list[dict], keys: dict[str, str]) -> dict[str, str]:
    """{field: value text} for each key found among the lines."""
    out: dict[str, str] = {}
    boxes = _quads(lines)
    if not len(boxes):
        return out
    cy, cx = boxes[:, :, 1].mean(axis=1), boxes[:, :, 0].mean(axis=1)
    height = boxes[:, :, 1].max(axis=1) - boxes[:, :, 1].min(axis=1)
    right = boxes[:, :, 0].max(axis=1)
    for field, key in keys.items():
        hits = [i for i, ln in enumerate(lines) if ln["text"] == key]
        if not hits:
            continue
        k = hits[0]
        cands = [j for j in range(len(lines)) if j != k and cx[j] > right[k] - 2
                 and abs(cy[j] - cy[k]) < 0.6 * max(height[k], 1.0)]
        if cands:
            out[field] = lines[min(cands, key=lambda j: cx[j])]["text"]
    return out


def system_scores(pred: list[list[dict]], gt_quads: list[np.ndarray], gt_texts: list[list[str]],
                  gt_fields: list[dict[str, str]], keys: dict[str, str], iou: float = 0.5) -> dict[str, float]:
    read = total = fields_ok = fields_total = 0
    for lines, quads, texts, fields in zip(pred, gt_quads, gt_texts, gt_fields):
        pairs = match(_quads(lines), quads, iou)
        read += sum(lines[i]["text"] == texts[j] for i, j in pairs)
        total += len(quads)
        found = extract_fields(lines, keys)
        for name in FIELDS:
            if fields.get(name):
                fields_total += 1
                fields_ok += found.get(name) == fields[name]
    return {"line_accuracy": read / total if total else 0.0,
            "field_accuracy": fields_ok / fields_total if fields_total else 0.0,
            "lines": float(total), "fields": float(fields_total)}


def agreement(a: list[list[dict]], b: list[list[dict]], iou: float = 0.5) -> float:
    """Share of lines (the larger count of the two runs) read at matching boxes with identical text."""
    same = total = 0
    for la, lb in zip(a, b):
        pairs = match(_quads(la), _quads(lb), iou)
        same += sum(la[i]["text"] == lb[j]["text"] for i, j in pairs)
        total += max(len(la), len(lb))
    return same / total if total else 1.0
