"""The OCR system: page → DB boxes → perspective crops → [direction classifier →] CTC recognition → lines.

Engines are pipeline.engines.base.Engine objects (Paddle Inference, a Lite .nb run in a subprocess,
...), so the same flow, pre- and post-processing serve every gate row, `verify` and `serve` /ocr.
Two preprocessing conventions, chosen by the detection bundle's `preprocess.resize`:
  stretch (the built-in synthetic models): gray pages stretched to the model size, detection over all
    pages and recognition over all crops in large batches (a Lite run costs two subprocesses per call);
  limit (PaddleOCR's, pipeline/ocr/ppocr.py; pretrained PP-OCR models): each page at its own size,
    boxes in PaddleOCR's sorted_boxes order, crops optionally turned by the 0/180 classifier (`cls_thresh`;
    with `turn_check` a turn the recogniser reads worse than the crop as it stood is undone), recognised in
    batches of `rec_batch_num` grouped by width (each batch padded to its widest crop when the recogniser's width
    is dynamic), lines below `drop_score` dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np
from PIL import Image

from pipeline.core.errors import NonFiniteError
from pipeline.data.preprocess import fit_image, to_tensor
from pipeline.ocr.text_metrics import (ctc_greedy_decode, ctc_kept_steps, decode_indices, kept_means,
                                       probability_row_sums)
from pipeline.ocr import ppocr
from pipeline.data.crop import crop_quad
from pipeline.ocr.db_post import DBParams, boxes_from_map, detect_batch

# PaddleOCR's tools/infer defaults (utility.py): rec_batch_num 6, cls_batch_num 6, cls_thresh 0.9, drop_score 0.5
# RapidOCR's page steps (ppocr.prepare_page) and the empty-page retry are off unless configured
FLOW_DEFAULTS = {"rec_batch_num": 6, "cls_batch_num": 6, "cls_thresh": 0.9, "drop_score": 0.5,
                 "max_side_len": 0, "min_side_len": 0, "min_height": 0, "width_height_ratio": 0.0,
                 "retry_scale": 0.0, "turn_check": False, "det_bucket": 0, "rec_bucket": 0,
                 "rec_recheck_margin": 0.0, "det_static_shapes": 0}


def det_static_shapes(flow: dict) -> int:
    """The flow's det_static_shapes: page shapes a served OpenVINO detector keeps compiled statically (0: one model
    compiled for any shape, as PaddleOCR and RapidOCR run it)."""
    return int(flow.get("det_static_shapes", 0) or 0)


def set_opencv_threads(threads: int) -> int:
    """OpenCV's own pool (the page steps' resize and perspective crops) on the engines' thread count, so "1 thread"
    means one: threads 0 is "all cores" in the config, while cv2.setNumThreads(0) turns OpenCV's threading off, so 0
    maps to the CPU count. Process-wide, as the engines' settings are. -> the count set."""
    from pipeline.core.env import cpu_count

    n = int(threads) if threads and int(threads) > 0 else cpu_count()
    cv2.setNumThreads(n)
    return n


@dataclass
class SystemSpec:
    """The models' infer_config sections the system needs (from each sub-bundle) and the flow's settings."""
    det_pre: dict
    det_post: dict
    rec_pre: dict
    rec_post: dict
    cls_pre: dict | None = None       # the optional 0/180 direction classifier
    flow: dict = field(default_factory=lambda: dict(FLOW_DEFAULTS))

    @classmethod
    def from_infer_configs(cls, det: dict, rec: dict, cls_cfg: dict | None = None,
                           flow: dict | None = None) -> "SystemSpec":
        return cls(det["preprocess"], det["postprocess"], rec["preprocess"], rec["postprocess"],
                   cls_cfg["preprocess"] if cls_cfg else None, {**FLOW_DEFAULTS, **(flow or {})})

    @property
    def paddleocr(self) -> bool:
        return self.det_pre.get("resize") == "limit"


def _top_probabilities(out: np.ndarray, best: np.ndarray) -> np.ndarray:
    """Each step's probability of its best class [N, T], float64: exported PP-OCR recognisers end in softmax (a
    reduced-precision softmax's rows are renormalised: the best class over its row's sum), ours in logits (softmax's
    largest value, exp(0) over the row's sum of exp(z - max)). Only the best class is divided: a [N, T, C] float64
    copy of a v5 recogniser's 18385 classes cost 6x the rest of the decoding (36 ms a batch of 6, 2026-12-07)."""
    sums = probability_row_sums(out)
    if sums is not None:
        return np.take_along_axis(out, best[..., None], axis=-1)[..., 0].astype(np.float64) / sums
    z = out.astype(np.float64) - out.max(axis=-1, keepdims=True)
    return 1.0 / np.exp(z).sum(axis=-1)


def _line_scores(out: np.ndarray) -> list[float]:
    """PaddleOCR's rec score: mean probability of the characters kept by greedy CTC decoding."""
    best = out.argmax(axis=-1)
    return kept_means(_top_probabilities(out, best), ctc_kept_steps(best))


def _finite(out: np.ndarray, what: str, engine) -> None:
    """NaN/Inf fail first: boxes or text decoded from them would look like a plain accuracy drop."""
    bad = int(out.size - np.count_nonzero(np.isfinite(out)))
    if bad:
        raise NonFiniteError(f"system: the {what} model ({getattr(engine, 'kind', 'engine')} "
                             f"{getattr(engine, 'effective_precision', '')}) produced {bad} NaN/Inf values")


def read_pages(pages: list[np.ndarray], det, rec, spec: SystemSpec, batch: int = 16, cls=None) -> list[list[dict]]:
    """uint8 pages [H, W] or [H, W, 3] BGR (any size) → per page, lines {"box", "text", "score", "det_score"
    [, "angle"]} in reading order, boxes in the page's own pixels.

    det, rec, cls: engines (pipeline.engines.base.Engine) for the detection, recognition and (optional)
    direction-classifier models."""
    if spec.paddleocr:
        return [read_page_ppocr(p, det, rec, spec, cls) for p in pages]
    pages = _gray(pages)
    return _read_builtin(pages, _detect_builtin(pages, det, spec, batch), rec, spec, 4 * batch)


def read_page(page: np.ndarray, det, rec, spec: SystemSpec, cls=None, max_boxes: int = 0) -> tuple[list[dict], int]:
    """One page as read_pages reads it, but at most max_boxes boxes recognised (0: all): the first ones in the
    flow's order (PaddleOCR's: reading order; built-in: detection order). → (lines, boxes detected)."""
    if spec.paddleocr:
        return _ppocr_page(page, det, rec, spec, cls, max_boxes)
    pages = _gray([page])
    found = _detect_builtin(pages, det, spec, 1)
    n = len(found[0][0])
    if max_boxes and n > max_boxes:
        found = [(q[:max_boxes], s[:max_boxes]) for q, s in found]
    return _read_builtin(pages, found, rec, spec, 64)[0], n


def _gray(pages: list[np.ndarray]) -> list[np.ndarray]:
    return [cv2.cvtColor(p, cv2.COLOR_BGR2GRAY) if p.ndim == 3 else p for p in pages]


def _detect_builtin(pages: list[np.ndarray], det, spec: SystemSpec, batch: int) -> list:
    """The built-in flow's detection: gray pages stretched to the model size → per page (quads, scores)."""
    det_in = np.stack([fit_image(Image.fromarray(p), spec.det_pre) for p in pages])
    maps = det.run_batched(to_tensor(det_in, spec.det_pre), batch)
    _finite(maps, "detection", det)
    return detect_batch(maps, DBParams.from_dict(spec.det_post), [p.shape[:2] for p in pages])


def _read_builtin(pages: list[np.ndarray], found: list, rec, spec: SystemSpec, batch: int) -> list[list[dict]]:
    """The built-in flow's recognition: every crop of every page in batches of `batch` → lines per page."""
    crops = [fit_image(Image.fromarray(crop_quad(pages[i], q)), spec.rec_pre)
             for i, (quads, _) in enumerate(found) for q in quads]
    texts: list[str] = []
    scores: list[float] = []
    if crops:
        x = to_tensor(np.stack(crops), spec.rec_pre)
        logits = rec.run_batched(x, batch)
        _finite(logits, "recognition", rec)
        texts = decode_indices(ctc_greedy_decode(logits), spec.rec_post["charset"])
        scores = _line_scores(logits)
    result: list[list[dict]] = [[] for _ in pages]
    k = 0
    for i, (quads, det_scores) in enumerate(found):
        for q, s in zip(quads, det_scores):
            result[i].append(_line(q, texts[k], scores[k], s))
            k += 1
    return result


def _line(quad: np.ndarray, text: str, score: float, det_score: float) -> dict:
    # float64 before rounding: a float32 66.8 prints as 66.80000305 in JSON
    return {"box": np.round(quad.astype(np.float64), 1).tolist(), "text": text, "score": round(score, 4),
            "det_score": round(float(det_score), 4)}


def detect_page(page: np.ndarray, det, spec: SystemSpec, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """PaddleOCR detection of one page at its own limit-rule size (times scale, for the retry) → (quads in page
    pixels, scores), in sorted_boxes order."""
    pre = spec.det_pre
    if scale != 1.0:        # scale the size the rule gives, never above the page's own
        rh, rw = ppocr.det_resize_shape(*page.shape[:2], int(pre["limit_side_len"]), pre["limit_type"])
        pre = {**pre, "limit_type": "max", "limit_side_len": max(32, int(max(rh, rw) * scale))}
    rh, rw = ppocr.det_resize_shape(*page.shape[:2], int(pre["limit_side_len"]), pre["limit_type"])
    out = det.run(ppocr.det_input(page, pre, int(spec.flow.get("det_bucket", 0))))
    _finite(out, "detection", det)
    prob = out[0].reshape(out[0].shape[-2:])[:rh, :rw]        # a bucket's padding cropped off (none: all of it)
    quads, scores = boxes_from_map(prob, DBParams.from_dict(spec.det_post), page.shape[:2])
    order = ppocr.sorted_boxes(quads)
    return quads[order], scores[order]


def classify_crops(crops: list[np.ndarray], cls, spec: SystemSpec) -> list[int]:
    """0/180 direction of each crop (PaddleOCR's predict_cls: batches sorted by width, [3, 48, 192] inputs);
    crops whose 180 score exceeds cls_thresh are turned in place. → angle per crop (0 or 180)."""
    h, w = int(spec.cls_pre["height"]), int(spec.cls_pre["width"])
    angles = [0] * len(crops)
    for idx in ppocr.width_batches(crops, int(spec.flow["cls_batch_num"])):
        probs = cls.run(np.stack([ppocr.resize_norm(crops[i], h, w) for i in idx]))
        _finite(probs, "direction classifier", cls)
        for i, p in zip(idx, probs):
            if int(p.argmax()) == 1 and float(p[1]) > float(spec.flow["cls_thresh"]):
                crops[i] = cv2.rotate(crops[i], cv2.ROTATE_180)
                angles[i] = 180
    return angles


def settle_turns(crops: list, angles: list | None, texts: list, scores: list, rec, spec: SystemSpec) -> None:
    """turn_check: each crop the classifier turned by 180 is read once more as it stood, and the reading the
    recogniser scores higher is kept (its angle back to 0). The mobile v2 classifier turns upright lines unlike its
    training ones: return_word_debug.jpg's sign line at 0.98, after which the v4, v5 and v6 recognisers read noise
    (scores 0.00, 0.53, 0.60) where the line as it stood reads 0.93, 0.91, 0.92; text_cls.jpg's upside-down line
    reads 0.95-0.99 turned and at most 0.09 as it stood. One extra recognition per turned crop. In place."""
    turned = _turns_to_check(angles, spec)
    if not turned:
        return
    back = [cv2.rotate(crops[i], cv2.ROTATE_180) for i in turned]      # exact: a 180 turn only moves pixels
    for i, c, t, s in zip(turned, back, *recognize_crops(back, rec, spec)):
        if s > scores[i]:
            crops[i], angles[i], texts[i], scores[i] = c, 0, t, s


def _turns_to_check(angles: list | None, spec: SystemSpec) -> list[int]:
    """The crops settle_turns reads again: those turned by 180, when turn_check is on."""
    return [i for i, a in enumerate(angles or []) if a == 180] if spec.flow.get("turn_check") else []


def needs_turn_check(pc: "PageCrops", spec: SystemSpec) -> bool:
    """settle_turns has a crop to read again (lets /ocr skip a trip to its worker pool)."""
    return bool(_turns_to_check(pc.angles, spec))


def recognize_crops(crops: list[np.ndarray], rec, spec: SystemSpec) -> tuple[list[str], list[float]]:
    """Texts and scores of crops, recognised in width-sorted batches of rec_batch_num; results in input order."""
    return recognize_pages([crops], rec, spec)[0]


def recognize_pages(crop_sets: list[list[np.ndarray]], rec, spec: SystemSpec,
                    max_crops: int = 0) -> list[tuple[list[str], list[float]]]:
    """The crops of several pages: each page's crops batched as alone (PaddleOCR's width groups of
    rec_batch_num, each padded to its widest crop), so every crop sees the very input it would alone; batches
    of equal width, of any page, then share engine calls of up to max_crops (default rec_batch_num: one page
    runs exactly as PaddleOCR's batches). → per page (texts, scores) in input order."""
    height, base = int(spec.rec_pre["height"]), int(spec.rec_pre["width"])
    dynamic, n = int(rec.input_shape[-1]) <= 0, int(spec.flow["rec_batch_num"])
    bucket = int(spec.flow.get("rec_bucket", 0))
    by_width: dict[int, list[tuple[int, int]]] = {}
    for p, crops in enumerate(crop_sets):
        for idx in ppocr.width_batches(crops, n):
            width = ppocr.bucketed_width(ppocr.batch_width(crops, idx, height, base), bucket) if dynamic else base
            by_width.setdefault(width, []).extend((p, int(i)) for i in idx)
    out = [([""] * len(c), [0.0] * len(c)) for c in crop_sets]
    step = max(int(max_crops), n)      # only the last batch of a page is partial: chunks keep batches whole
    for width, pairs in by_width.items():
        for s in range(0, len(pairs), step):
            chunk = pairs[s:s + step]
            res = rec.run(np.stack([ppocr.resize_norm(crop_sets[p][i], height, width) for p, i in chunk]))
            _finite(res, "recognition", rec)
            texts = decode_indices(ctc_greedy_decode(res), spec.rec_post["charset"])
            for (p, i), t, sc in zip(chunk, texts, _line_scores(res)):
                out[p][0][i], out[p][1][i] = t, sc
    return out


@dataclass
class PageCrops:
    """A page between detection and recognition: boxes in the page's pixels, their crops, angles if turned."""
    quads: np.ndarray
    det_scores: np.ndarray
    crops: list
    angles: list | None
    found: int = 0            # boxes detected, before any max_boxes cap


def page_crops(page: np.ndarray, det, spec: SystemSpec, cls=None, max_boxes: int = 0,
               scale: float = 1.0) -> PageCrops:
    """Detection, crops and the optional classifier of one page (PaddleOCR's flow); recognition is left to
    the caller, so that `/ocr` can recognise the crops of concurrent pages together. max_boxes: keep only
    the first boxes in reading order (0: all), before any crop is cut (`serve.max_boxes_per_page`).
    scale: the detector's input size relative to the limit rule's (retry_needed)."""
    img = ppocr.to_bgr(page)
    work, transform = ppocr.prepare_page(img, spec.flow)
    quads, det_scores = detect_page(work, det, spec, scale)
    found = len(quads)
    if max_boxes and found > max_boxes:
        quads, det_scores = quads[:max_boxes], det_scores[:max_boxes]
    crops = [crop_quad(work, q) for q in quads]
    quads = ppocr.page_boxes(quads, transform, img.shape[:2])
    angles = classify_crops(crops, cls, spec) if cls is not None and crops else None
    return PageCrops(quads, det_scores, crops, angles, found)


def page_lines(pc: PageCrops, texts: list[str], scores: list[float], spec: SystemSpec) -> list[dict]:
    """The lines of a page whose crops were recognised; lines below drop_score dropped."""
    lines = []
    for k, q in enumerate(pc.quads):
        if scores[k] >= float(spec.flow["drop_score"]):
            lines.append(_line(q, texts[k], scores[k], pc.det_scores[k]) | ({"angle": pc.angles[k]} if pc.angles else {}))
    return lines


def retry_needed(lines: list[dict], spec: SystemSpec) -> bool:
    """A page on which no line was read gets one more detection at retry_scale of its size (0: never): letters
    far larger than the scale a detector was trained at leave no box, or only fragments its recogniser drops
    (PP-OCRv5 mobile on issue_170.png's 190-pixel TEST: one dash, score 0.43, at the page's size; TEST at half)."""
    return not lines and 0 < float(spec.flow.get("retry_scale", 0)) < 1


def read_page_ppocr(page: np.ndarray, det, rec, spec: SystemSpec, cls=None) -> list[dict]:
    """One page through PaddleOCR's flow (see the module docstring); crops are cut from the prepared page
    (as RapidOCR does), boxes reported in the original page's pixels."""
    return _ppocr_page(page, det, rec, spec, cls)[0]


def _ppocr_page(page: np.ndarray, det, rec, spec: SystemSpec, cls=None, max_boxes: int = 0) -> tuple[list[dict], int]:
    for scale in (1.0, float(spec.flow["retry_scale"])):
        pc = page_crops(page, det, spec, cls, max_boxes, scale)
        texts, scores = recognize_crops(pc.crops, rec, spec) if pc.crops else ([], [])
        settle_turns(pc.crops, pc.angles, texts, scores, rec, spec)
        lines = page_lines(pc, texts, scores, spec)
        if not retry_needed(lines, spec):
            break
    return lines, pc.found


def read_crops(crops: list[np.ndarray], rec, spec: SystemSpec, cls=None) -> list[str]:
    """Text-line images read without detection (direction classifier first when given), in input order."""
    crops = [ppocr.to_bgr(c) for c in crops]
    angles = classify_crops(crops, cls, spec) if cls is not None else None
    texts, scores = recognize_crops(crops, rec, spec)
    settle_turns(crops, angles, texts, scores, rec, spec)
    return texts
