"""A detector judged by the text the system reads through its boxes (issue 48), not by its boxes alone.

A box judge (DB boxes matched at IoU >= 0.5, the detection gate's hmean) cannot see a crop edge that moves by a few
pixels and cuts a glyph: `3F】` read as `3F1` on f32's box and as `3FI` on a bf16 box that still matches it. This
judge reads every page through the system's flow (pipeline/ocr/system.py: boxes -> crops -> direction classifier ->
recogniser) twice, once on a reference detector's boxes and once on a trial detector's, with the SAME classifier and
recogniser, and counts the lines that change: a reference line whose box the trial matches (IoU >= 0.5, one to one)
with a different text, a reference line with no match (missing), a trial line with no match (extra).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.ocr.det_metric import match
from pipeline.ocr.system import (SystemSpec, classify_crops, page_crops, page_lines, read_page_ppocr,
                                 recognize_crops, retry_needed, settle_turns)


@dataclass
class PageReading:
    """One page as the system read it: the detector's boxes (page pixels, the key of the reading) and the lines."""
    quads: np.ndarray
    lines: list[dict]


def _quads(lines: list[dict]) -> np.ndarray:
    return np.array([ln["box"] for ln in lines], np.float32).reshape(-1, 4, 2)


def line_changes(ref: list[dict], got: list[dict], iou: float = 0.5) -> dict:
    """Lines of `got` against `ref` (each {"box", "text", ...}): {"text": matched with another text, "missing": ref
    lines unmatched, "extra": got lines unmatched, "changed": their sum, "of": len(ref)}."""
    pairs = match(_quads(got), _quads(ref), iou) if ref and got else []
    text = sum(got[i]["text"] != ref[j]["text"] for i, j in pairs)
    missing, extra = len(ref) - len(pairs), len(got) - len(pairs)
    return {"text": text, "missing": missing, "extra": extra, "changed": text + missing + extra, "of": len(ref)}


def read_system_page(page: np.ndarray, det, rec, spec: SystemSpec, cls=None,
                     reference: PageReading | None = None) -> PageReading:
    """The page through read_page_ppocr's flow with `det`; when its boxes equal `reference`'s to the bit, the crops,
    turns and texts are the same too, so the reference's lines are returned without reading them again."""
    pc = page_crops(page, det, spec, None)
    if reference is not None and reference.quads.shape == pc.quads.shape \
            and np.array_equal(reference.quads, pc.quads):
        return reference
    if cls is not None and pc.crops:
        pc.angles = classify_crops(pc.crops, cls, spec)
    texts, scores = recognize_crops(pc.crops, rec, spec) if pc.crops else ([], [])
    settle_turns(pc.crops, pc.angles, texts, scores, rec, spec)
    lines = page_lines(pc, texts, scores, spec)
    if retry_needed(lines, spec):       # the flow's second detection: read as the system reads it
        lines = read_page_ppocr(page, det, rec, spec, cls)
    return PageReading(pc.quads, lines)


def judge_detector(pages: list[np.ndarray], det, references: list[PageReading], rec, spec: SystemSpec,
                   cls=None) -> dict:
    """A trial detector's pages against the references (read_system_page with the reference detector): totals of
    line_changes, boxes not reproduced to the bit (+ new ones: the box judge's count), and the changed lines."""
    total = {"text": 0, "missing": 0, "extra": 0, "changed": 0, "of": 0, "boxes_changed": 0}
    examples: list[str] = []
    for i, (page, ref) in enumerate(zip(pages, references)):
        got = read_system_page(page, det, rec, spec, cls, ref)
        if got is ref:
            total["of"] += len(ref.lines)
            continue
        for k, v in line_changes(ref.lines, got.lines).items():
            total[k] += v
        a = {q.tobytes() for q in ref.quads}
        b = {q.tobytes() for q in got.quads}
        total["boxes_changed"] += len(a ^ b)
        examples += changed_texts(i, ref.lines, got.lines)
    total["examples"] = examples[:12]
    return total


def changed_texts(page, ref: list[dict], got: list[dict]) -> list[str]:
    """`page: ref text -> trial text` for matched lines whose text changed (the judge's evidence)."""
    pairs = match(_quads(got), _quads(ref), 0.5) if ref and got else []
    return [f"{page}: {ref[j]['text']!r} -> {got[i]['text']!r}" for i, j in pairs if got[i]["text"] != ref[j]["text"]]
