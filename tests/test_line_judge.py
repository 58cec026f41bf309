"""The detector's text judge (pipeline/ocr/line_judge.py) and its tuning pages (pipeline/data/edge_pages.py), with
engines that need no model: a box that shrinks by a few pixels and cuts a glyph is a changed line to the text judge,
while the box judge (boxes matched at IoU >= 0.5, the detection gate's hmean) sees nothing."""
from __future__ import annotations

import numpy as np

from pipeline.ocr.db_post import DBParams, boxes_from_map
from pipeline.ocr.det_metric import detection_scores
from pipeline.ocr.line_judge import judge_detector, line_changes, read_system_page
from pipeline.ocr.system import SystemSpec, read_page_ppocr

H, W = 96, 320                  # multiples of 32 at limit_side_len 96 (min): the detector sees the page as it is
TOP, BOTTOM = 36, 60            # the text line's rows
POST = {"thresh": 0.3, "box_thresh": 0.5, "unclip_ratio": 1.5, "max_candidates": 10}


class BoxDetector:
    """A DB 'model' whose probability map is 1 on one rectangle (x0, x1) of the text rows, 0 elsewhere."""
    kind, effective_precision = "fake", "fp32"

    def __init__(self, x0: int, x1: int):
        self.x0, self.x1 = x0, x1

    def prob(self) -> np.ndarray:
        m = np.zeros((H, W), np.float32)
        m[TOP + 6:BOTTOM - 6, self.x0:self.x1] = 1.0
        return m

    def run(self, x: np.ndarray) -> np.ndarray:
        assert x.shape[-2:] == (H, W)
        return self.prob()[None, None]


class BarReader:
    """A CTC 'recogniser' that reads each run of dark columns as one 'A' (a glyph cut off the crop is one A less)."""
    kind, effective_precision, input_shape = "fake", "fp32", [-1, 3, 48, -1]

    def run(self, x: np.ndarray) -> np.ndarray:
        dark = (x[:, 0] < 0).any(axis=1)                             # [N, W]: a column with ink
        starts = dark & ~np.pad(dark, ((0, 0), (1, 0)))[:, :-1]
        out = np.zeros((*dark.shape, 3), np.float32)
        out[..., 0] = ~starts                                        # blank
        out[..., 1] = starts                                         # 'A'
        return out


def _spec() -> SystemSpec:
    pre = {"resize": "limit", "limit_side_len": H, "limit_type": "min", "mean": [0.5] * 3, "std": [0.5] * 3}
    return SystemSpec(pre, POST, {"height": 48, "width": 64}, {"charset": "AB"})


def _right_edge(det: BoxDetector) -> float:
    quads, _ = boxes_from_map(det.prob(), DBParams.from_dict(POST), (H, W))
    return float(quads[0][:, 0].max())


def _page(last_bar: int) -> np.ndarray:
    page = np.full((H, W, 3), 255, np.uint8)
    for x in list(range(60, last_bar - 8, 16)) + [last_bar]:
        page[TOP:BOTTOM, x:x + 4] = 0
    return page


def test_a_box_a_few_pixels_short_cuts_a_glyph_the_text_judge_counts_it_the_box_judge_does_not():
    spec, rec = _spec(), BarReader()
    ref_det, trial_det = BoxDetector(64, 220), BoxDetector(64, 210)       # the trial's box 10 px shorter
    cut = int(np.ceil(_right_edge(trial_det))) + 1
    assert _right_edge(ref_det) > cut + 6           # the last glyph is inside f32's box, just outside the trial's
    page = _page(cut)
    ref = read_system_page(page, ref_det, rec, spec)
    assert ref.lines == read_page_ppocr(page, ref_det, rec, spec)          # the system's own flow, line for line
    got = read_system_page(page, trial_det, rec, spec, reference=ref)
    assert got.lines[0]["text"] == ref.lines[0]["text"][:-1]              # one 'A' (the cut glyph) less
    box = detection_scores([got.quads], [ref.quads])
    assert box["hmean"] == 1.0                                            # the box judge: nothing changed
    verdict = judge_detector([page], trial_det, [ref], rec, spec)
    assert (verdict["changed"], verdict["text"], verdict["of"], verdict["boxes_changed"]) == (1, 1, 1, 2)
    assert verdict["examples"] == [f"0: {ref.lines[0]['text']!r} -> {got.lines[0]['text']!r}"]


def test_the_same_boxes_reuse_the_reference_and_change_nothing():
    spec, rec, det = _spec(), BarReader(), BoxDetector(64, 220)
    page = _page(200)
    ref = read_system_page(page, det, rec, spec)
    assert read_system_page(page, det, rec, spec, reference=ref) is ref
    assert judge_detector([page], det, [ref], rec, spec) == {"text": 0, "missing": 0, "extra": 0, "changed": 0,
                                                              "of": 1, "boxes_changed": 0, "examples": []}


def test_line_changes_counts_missing_and_extra_lines():
    box = lambda x: [[x, 0], [x + 50, 0], [x + 50, 20], [x, 20]]
    ref = [{"box": box(0), "text": "3F1"}, {"box": box(100), "text": "EXIT"}]
    got = [{"box": box(2), "text": "3FI"}, {"box": box(300), "text": "new"}]
    assert line_changes(ref, got) == {"text": 1, "missing": 1, "extra": 1, "changed": 3, "of": 2}
    assert line_changes(ref, [])["changed"] == 2 and line_changes([], got)["extra"] == 2


def test_edge_pages_are_seeded_and_hold_edge_glyphs():
    from pipeline.data.edge_pages import edge_text, render_edge_page
    import random

    a, b = render_edge_page(7, 0, size=256), render_edge_page(7, 0, size=256)
    assert a.shape == (256, 256, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    assert not np.array_equal(a, render_edge_page(7, 1, size=256))
    assert a.std() > 5                              # text was drawn
    r = random.Random(0)
    texts = [edge_text(r) for _ in range(200)]
    ends = sum(t[0] in "[]【】()|1Il:;.,-" or t[-1] in "[]【】()|1Il:;.,-" for t in texts)
    assert ends > 0.6 * len(texts) and any("【" in t or "】" in t for t in texts)
