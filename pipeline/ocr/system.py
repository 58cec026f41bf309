"""The OCR system: page → DB boxes → perspective crops → CTC recognition → lines with boxes and scores.

Engines are pipeline.engines.base.Engine objects (Paddle Inference, a Lite .nb run in a subprocess,
...), so the same flow, pre- and post-processing serve every gate row, `verify` and `serve` /ocr.
Pages are batched per model: detection over all pages, recognition over all crops (with a large
`batch`, a Lite run costs two subprocesses per call, not two per line).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import NonFiniteError
from ..preprocess import fit_image, to_tensor
from ..text_metrics import ctc_greedy_decode, decode_indices
from .crop import crop_quad
from .db_post import DBParams, detect_batch

@dataclass
class SystemSpec:
    """The two models' infer_config sections the system needs (from each sub-bundle)."""
    det_pre: dict
    det_post: dict
    rec_pre: dict
    rec_post: dict

    @classmethod
    def from_infer_configs(cls, det: dict, rec: dict) -> "SystemSpec":
        return cls(det["preprocess"], det["postprocess"], rec["preprocess"], rec["postprocess"])


def _softmax_max(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return (p / p.sum(axis=-1, keepdims=True)).max(axis=-1)


def _line_scores(logits: np.ndarray) -> list[float]:
    """Mean max-probability over the non-blank steps of each line (PaddleOCR's rec score)."""
    best, conf = logits.argmax(axis=-1), _softmax_max(logits)
    out = []
    for b, c in zip(best, conf):
        keep = b != 0
        out.append(float(c[keep].mean()) if keep.any() else 0.0)
    return out


def _finite(out: np.ndarray, what: str, engine) -> None:
    """NaN/Inf fail first: boxes or text decoded from them would look like a plain accuracy drop."""
    bad = int(out.size - np.count_nonzero(np.isfinite(out)))
    if bad:
        raise NonFiniteError(f"system: the {what} model ({getattr(engine, 'kind', 'engine')} "
                             f"{getattr(engine, 'effective_precision', '')}) produced {bad} NaN/Inf values")


def read_pages(pages: list[np.ndarray], det, rec, spec: SystemSpec, batch: int = 16) -> list[list[dict]]:
    """uint8 pages [H, W] (any size) → per page, lines {"box", "text", "score", "det_score"} in reading order.

    det, rec: engines (pipeline.engines.base.Engine) for the detection and recognition models."""
    det_in = np.stack([fit_image(Image.fromarray(p), spec.det_pre) for p in pages])
    maps = det.run_batched(to_tensor(det_in, spec.det_pre), batch)
    _finite(maps, "detection", det)
    found = detect_batch(maps, DBParams.from_dict(spec.det_post), [p.shape[:2] for p in pages])
    crops, owner = [], []
    for i, (quads, _) in enumerate(found):
        for q in quads:
            crops.append(fit_image(Image.fromarray(crop_quad(pages[i], q)), spec.rec_pre))
            owner.append(i)
    texts: list[str] = []
    scores: list[float] = []
    if crops:
        x = to_tensor(np.stack(crops), spec.rec_pre)
        logits = rec.run_batched(x, 4 * batch)
        _finite(logits, "recognition", rec)
        texts = decode_indices(ctc_greedy_decode(logits), spec.rec_post["charset"])
        scores = _line_scores(logits)
    result: list[list[dict]] = [[] for _ in pages]
    k = 0
    for i, (quads, det_scores) in enumerate(found):
        for q, s in zip(quads, det_scores):
            # float64 before rounding: a float32 66.8 prints as 66.80000305 in JSON
            result[i].append({"box": np.round(q.astype(np.float64), 1).tolist(), "text": texts[k],
                              "score": round(scores[k], 4), "det_score": round(float(s), 4)})
            k += 1
    return result
