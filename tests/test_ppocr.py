"""PaddleOCR conventions (pipeline/ocr/ppocr.py, the PaddleOCR flow of pipeline/ocr/system.py) against RapidOCR's
implementation of the same rules (rapidocr_onnxruntime, pinned), "###" regions, the exported-detector error, and
cheap runs of the real PP-OCR models (pipeline/ocr/ppocr_models.py) through Paddle Inference at 1 thread."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.ocr import ppocr
from pipeline.ocr.db_post import DBParams, boxes_from_map

IMAGES = Path(__file__).resolve().parent / "data" / "real_images"
RAPID_DET = {"thresh": 0.3, "box_thresh": 0.5, "unclip_ratio": 1.6, "max_candidates": 1000, "use_dilation": True}


@pytest.mark.parametrize("h,w", [(503, 1890), (430, 323), (11, 65), (39, 445), (1000, 999), (33, 301)])
@pytest.mark.parametrize("limit,kind", [(960, "max"), (736, "min")])
def test_det_input_matches_paddleocr_rule(h, w, limit, kind):
    """Shape and values equal RapidOCR's DetPreProcess (PaddleOCR's DetResizeForTest + NormalizeImage) on odd sizes."""
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess

    img = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    x = ppocr.det_input(img, {"limit_side_len": limit, "limit_type": kind, "mean": [0.5] * 3, "std": [0.5] * 3})
    ref = DetPreProcess(limit, kind, [0.5] * 3, [0.5] * 3)(img)
    if ref is None:                     # RapidOCR gives up where a side rounds to 0; PaddleOCR keeps 32
        assert x.shape[2] == 32
        return
    assert x.shape == ref.shape and x.shape[2] % 32 == 0 and x.shape[3] % 32 == 0
    np.testing.assert_allclose(x, ref, atol=1e-5)


def test_det_resize_never_below_32_and_rejects_unknown_type():
    from pipeline.core.errors import ConfigError

    assert ppocr.det_resize_shape(5, 7, 960, "max") == (32, 32)          # PaddleOCR's max(..., 32)
    assert ppocr.det_resize_shape(100, 200, 640, "resize_long") == (320, 640)
    with pytest.raises(ConfigError, match="limit_type"):
        ppocr.det_resize_shape(100, 100, 960, "biggest")


def test_imagenet_mean_std_in_bgr_order():
    img = np.zeros((64, 64, 3), np.uint8)
    img[..., 0] = 255                                                   # blue channel (BGR index 0)
    x = ppocr.det_input(img, {"limit_side_len": 960, "limit_type": "max",
                              "mean": ppocr.IMAGENET_MEAN, "std": ppocr.IMAGENET_STD})
    np.testing.assert_allclose(x[0, :, 0, 0], [(1 - 0.485) / 0.229, -0.456 / 0.224, -0.406 / 0.225], rtol=1e-5)


@pytest.mark.parametrize("mean, std", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), (ppocr.IMAGENET_MEAN, ppocr.IMAGENET_STD)])
def test_normalize_is_bit_identical_to_paddleocr_expression(mean, std):
    img = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    m, s = np.asarray(mean, np.float32).reshape(1, 1, -1), np.asarray(std, np.float32).reshape(1, 1, -1)
    want = ((img.astype(np.float32) / 255.0 - m) / s).transpose(2, 0, 1)      # NormalizeImage, then HWC -> CHW
    got = ppocr.normalize(img, mean, std)
    assert got.dtype == np.float32 and got.flags.c_contiguous and np.array_equal(got, want)


def test_sorted_boxes_matches_paddleocr():
    from rapidocr_onnxruntime import RapidOCR

    rng = np.random.default_rng(0)
    for _ in range(20):
        tl = rng.integers(0, 200, (12, 2)).astype(np.float32)
        quads = np.stack([tl, tl + [40, 0], tl + [40, 12], tl + [0, 12]], axis=1)
        ref = RapidOCR.sorted_boxes(quads.copy())
        np.testing.assert_array_equal(quads[ppocr.sorted_boxes(quads)], np.stack(ref))


@pytest.mark.parametrize("shape", [(30, 400), (48, 100), (20, 900), (60, 59)])
def test_rec_and_cls_resize_norm_match_paddleocr(shape):
    from rapidocr_onnxruntime.ch_ppocr_cls.text_cls import TextClassifier
    from rapidocr_onnxruntime.ch_ppocr_rec.text_recognize import TextRecognizer

    img = np.random.default_rng(1).integers(0, 256, (*shape, 3), dtype=np.uint8)
    ratio = max(320 / 48, shape[1] / shape[0])
    rec = TextRecognizer.resize_norm_img(type("R", (), {"rec_image_shape": [3, 48, 320]})(), img, ratio)
    np.testing.assert_allclose(ppocr.resize_norm(img, 48, int(48 * ratio)), rec, atol=1e-6)
    cls = TextClassifier.resize_norm_img(type("C", (), {"cls_image_shape": [3, 48, 192]})(), img)
    np.testing.assert_allclose(ppocr.resize_norm(img, 48, 192), cls, atol=1e-6)


def _prob_map(h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    prob = np.zeros((h, w), np.float32)
    for _ in range(12):
        y, x = rng.integers(4, h - 20), rng.integers(4, w - 80)
        prob[y:y + rng.integers(6, 16), x:x + rng.integers(20, 76)] = rng.uniform(0.55, 0.99)
    return prob


def test_db_boxes_in_original_frame_match_paddleocr():
    """Same boxes and scores as RapidOCR's DBPostProcess, mapped to a page of another size than the map."""
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess

    prob = _prob_map(256, 320)
    src = (517, 661)                                                    # the original page (h, w)
    ours, scores = boxes_from_map(prob, DBParams.from_dict(RAPID_DET), src)
    ref, ref_scores = DBPostProcess(**{k: v for k, v in RAPID_DET.items()}, score_mode="fast")(prob[None, None], src)
    order = lambda q: np.lexsort((q[:, 0, 0], q[:, 0, 1]))
    assert len(ours) == len(ref) > 5
    np.testing.assert_allclose(ours[order(ours)], np.clip(ref, 0, [src[1] - 1, src[0] - 1])[order(ref)], atol=1.0)
    np.testing.assert_allclose(sorted(scores), sorted(ref_scores), atol=1e-6)
    assert ours[..., 0].max() > 320 and ours[..., 1].max() > 256      # really in the page's frame


def test_prepare_page_boxes_come_back_to_the_original_page():
    page = np.zeros((30, 700, 3), np.uint8)                            # a 700x30 line: letterboxed
    flow = {"max_side_len": 2000, "min_side_len": 30, "min_height": 30, "width_height_ratio": 8}
    work, tr = ppocr.prepare_page(page, flow)
    assert work.shape[0] > 30 and tr[2] > 0
    quad = np.array([[[10, tr[2] + 5], [100, tr[2] + 5], [100, tr[2] + 25], [10, tr[2] + 25]]], np.float32)
    back = ppocr.page_boxes(quad, tr, page.shape[:2])
    np.testing.assert_allclose(back[0, :, 1], [5, 5, 25, 25])


def test_det_bucket_pads_the_normalised_page_with_zeros_and_boxes_come_back_exactly():
    """system.det_bucket: the detector's input is padded at the bottom and right up to the bucket (0 after
    normalisation), the DB map is cropped back before the boxes; a detector that sees only its own pixel (here:
    dark pixels are text) then gives exactly the boxes it gives without the bucket. 0 = off: PaddleOCR's input."""
    from pipeline.ocr.system import FLOW_DEFAULTS, SystemSpec, detect_page

    page = np.full((300, 701, 3), 255, np.uint8)
    page[40:70, 30:400] = 0
    page[200:260, 500:690] = 0                      # a line touching the region the pad extends
    pre = {"limit_side_len": 736, "limit_type": "min", "mean": [0.5] * 3, "std": [0.5] * 3}
    plain = ppocr.det_input(page, pre)
    for bucket in (64, 128, 256):
        x = ppocr.det_input(page, pre, bucket)
        assert x.shape[2] % bucket == 0 and x.shape[3] % bucket == 0 and x.shape[2:] >= plain.shape[2:]
        h, w = plain.shape[2:]
        assert np.array_equal(x[..., :h, :w], plain) and not x[..., h:, :].any() and not x[..., :, w:].any()
    assert ppocr.det_input(page, pre, 0).shape == plain.shape and ppocr.bucketed_size(736, 1000, 0) == (736, 1000)

    class Pointwise:                                # probability 1 on dark pixels: no receptive field
        def run(self, x):
            return (x[:, :1] < 0).astype(np.float32)

    post = {**RAPID_DET, "box_thresh": 0.5}
    spec = lambda b: SystemSpec(pre, post, {}, {}, None, {**FLOW_DEFAULTS, "det_bucket": b})
    want_q, want_s = detect_page(page, Pointwise(), spec(0))
    assert len(want_q) == 2
    for bucket in (64, 128):
        q, sc = detect_page(page, Pointwise(), spec(bucket))
        assert np.array_equal(q, want_q) and np.array_equal(sc, want_s)


def test_alpha_page_is_composited_on_white():
    from PIL import Image

    rgba = np.zeros((10, 10, 4), np.uint8)
    rgba[2:4, 2:4] = [0, 0, 0, 255]                                    # opaque black text, transparent rest
    page = ppocr.page_from_pil(Image.fromarray(rgba, "RGBA"))
    assert page.shape == (10, 10, 3) and page[0, 0].tolist() == [255, 255, 255] and page[2, 2].tolist() == [0, 0, 0]


# ---------------------------------------------------------------- "###" regions (issue 21)

def test_ignored_region_is_masked_out_of_db_targets():
    from pipeline.ocr.db_targets import batch_targets
    from pipeline.data.invoice_pages import pack_quads

    quads = np.array([[[10, 10], [70, 10], [70, 30], [10, 30]], [[10, 50], [70, 50], [70, 70], [10, 70]]], np.float32)
    t = batch_targets(pack_quads([quads], 4, [np.array([False, True])]), 96, 96)[0]
    assert t[0, 18:22, 20:60].min() == 1 and t[1, 15:25, 20:60].min() == 1     # text: target 1, counted
    assert t[0, 52:68, 12:68].max() == 0 and t[1, 52:68, 12:68].max() == 0     # ###: not text, not counted
    assert t[1, 85:, 85:].min() == 1                                           # background: counted
    assert t[3, 52:68, 12:68].max() == 0                                       # no threshold target either


def test_ignored_region_counts_neither_way_in_hmean():
    from pipeline.ocr.det_metric import detection_scores

    a = np.array([[0, 0], [50, 0], [50, 10], [0, 10]], np.float32)
    b, c = a + [0, 40], a + [0, 80]
    gts, ign = [np.stack([a, b])], [np.array([False, True])]
    # a found, a detection on the ### box b: neither TP nor FP; c is a false positive
    s = detection_scores([np.stack([a, b, c])], gts, 0.5, ign)
    assert s["precision"] == 0.5 and s["recall"] == 1.0
    s = detection_scores([np.stack([a, b])], gts, 0.5, ign)
    assert s == {"hmean": 1.0, "precision": 1.0, "recall": 1.0}
    assert detection_scores([np.stack([a, b])], gts, 0.5)["recall"] == 1.0     # without flags b is just text


def test_label_file_marks_hash_regions(tmp_path):
    from PIL import Image

    from pipeline.data.det_labels import load_det_label_file
    from pipeline.data.invoice_pages import unpack_quads, unpack_with_ignore

    Image.fromarray(np.full((64, 64), 255, np.uint8)).save(tmp_path / "p.png")
    (tmp_path / "l.txt").write_text('p.png\t[{"transcription": "INV", "points": [[1,1],[30,1],[30,9],[1,9]]}, '
                                    '{"transcription": "###", "points": [[1,20],[30,20],[30,29],[1,29]]}]\n')
    _, packed, texts, _ = load_det_label_file(tmp_path / "l.txt", 64, 64, 4)
    [(quads, ign)] = unpack_with_ignore(packed)
    assert ign.tolist() == [False, True] and texts == [["INV", "###"]]
    np.testing.assert_allclose(quads[1], [[1, 20], [30, 20], [30, 29], [1, 29]])
    assert len(unpack_quads(packed)[0]) == 1


def test_exported_detector_in_db_loss_is_one_clear_error():
    import paddle

    from pipeline.core.errors import ConfigError
    from pipeline.ocr.db_loss import db_loss

    with pytest.raises(ConfigError, match=r"probability, threshold and binary maps.*\[2, 1, 32, 32\]") as exc:
        db_loss(paddle.zeros([2, 1, 32, 32]), np.zeros((2, 4, 32, 32), np.float32))
    assert "\n" not in exc.value.one_line()


# ---------------------------------------------------------------- the real PP-OCR models (cheap)

@pytest.fixture(scope="module")
def real():
    from pipeline.engines.paddle_infer import InferenceEngine
    from pipeline.core.errors import PipelineError
    from pipeline.tasks.ppocr_system import read_charset
    from pipeline.ocr.system import SystemSpec
    from pipeline.ocr.ppocr_models import fetch

    try:
        m = fetch()
    except PipelineError as exc:
        pytest.skip(f"PP-OCR models not available: {exc.one_line()}")
    eng = {k: InferenceEngine(m[k] / "inference", "fp32", threads=1) for k in ("det", "rec", "cls")}
    spec = SystemSpec({"resize": "limit", "limit_side_len": 736, "limit_type": "min", "mean": [0.5] * 3,
                       "std": [0.5] * 3}, RAPID_DET, {"height": 48, "width": 320}, {"charset": read_charset(m["keys"])},
                      {"height": 48, "width": 192})
    return eng, spec


@pytest.fixture(scope="module")
def worker():
    """/ocr's worker pool as the server holds it: one thread for the engines' whole life (a Paddle predictor run
    again on a new thread, after the thread that ran it before exited, failed here with oneDNN's 'could not
    execute a primitive')."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def _page(name: str) -> np.ndarray:
    from pipeline.ocr.pages import decode_page

    return decode_page((IMAGES / name).read_bytes())


def test_real_cls_turns_the_upside_down_line(real):
    from pipeline.ocr.system import classify_crops

    eng, spec = real
    crops = [_page("text_cls.jpg")]
    assert classify_crops(crops, eng["cls"], spec) == [180]
    assert classify_crops(crops, eng["cls"], spec) == [0]          # turned in place: now upright


def test_real_det_on_a_real_page_in_its_own_frame(real):
    from pipeline.ocr.system import detect_page

    eng, spec = real
    page = _page("ch_en_num.jpg")                                   # 323x430, 18 lines (GT.tsv)
    quads, scores = detect_page(page, eng["det"], spec)
    assert len(quads) == 18 and (scores >= 0.5).all()
    assert quads[..., 0].max() <= page.shape[1] and quads[..., 1].max() <= page.shape[0]
    assert quads[..., 1].max() > 0.8 * page.shape[0]                # the last line near the bottom: not model frame
    tops = quads[:, 0, 1]
    assert tops[0] == tops.min()                                     # sorted_boxes: reading starts at the top


def test_width_grouped_batches_read_as_one_by_one(real):
    """Grouping by width, padding each batch to its widest crop and putting results back in reading order gives
    exactly what each crop alone gives at its batch's width. Against each crop alone at PaddleOCR's base width
    320 at most one line in ten may differ: SVTR's global attention sees the padding (measured on
    return_word_debug.jpg: '3F1' in PaddleOCR's batch of 6, as RapidOCR reads it, '3FI' alone)."""
    import csv

    from pipeline.data.crop import crop_quad
    from pipeline.ocr.system import _line_scores, detect_page, recognize_crops
    from pipeline.ocr.text_metrics import ctc_greedy_decode, decode_indices

    eng, spec = real
    page = _page("ch_en_num.jpg")
    quads, _ = detect_page(page, eng["det"], spec)
    crops = [crop_quad(page, q) for q in quads]
    spec.flow = {**spec.flow, "rec_batch_num": 6}                   # 18 crops: three batches
    batched, sb = recognize_crops(crops, eng["rec"], spec)
    widths = {}
    for idx in ppocr.width_batches(crops, 6):
        widths.update({int(i): ppocr.batch_width(crops, idx, 48, 320) for i in idx})
    assert len(set(widths.values())) == 2                           # base width 320, and wider
    alone = [eng["rec"].run(ppocr.resize_norm(c, 48, widths[i])[None]) for i, c in enumerate(crops)]
    assert batched == [decode_indices(ctc_greedy_decode(o), spec.rec_post["charset"])[0] for o in alone]
    np.testing.assert_allclose(sb, [_line_scores(o)[0] for o in alone], atol=1e-4)
    rows = {r[0]: r[3] for r in csv.reader(open(IMAGES / "GT.tsv", encoding="utf-8"), delimiter="\t")}
    kept = [t for t, sc in zip(batched, sb) if sc >= spec.flow["drop_score"]]
    assert kept == rows["ch_en_num.jpg"].split(" | ")               # RapidOCR's 18 lines, in reading order
    spec.flow = {**spec.flow, "rec_batch_num": 1}
    single, _ = recognize_crops(crops, eng["rec"], spec)
    assert sum(a != b for a, b in zip(batched, single)) <= len(crops) // 10


def test_concurrent_pages_recognised_together_read_as_alone(real, worker):
    """/ocr with batching on: the crops of pages that wait for the recogniser together share its calls
    (ocr/system.recognize_pages), each crop with the very input it has alone, so every page reads as it does
    alone (a blank page among them reads as no lines)."""
    import asyncio
    from pipeline.serving.ocr_routes import _PageRunner
    from pipeline.ocr.system import read_page_ppocr

    eng, spec = real
    spec.flow = {**spec.flow, "rec_batch_num": 6}
    pages = [_page(n) for n in ("ch_en_num.jpg", "return_word_debug.jpg", "issue_170.png")] + [np.full((64, 256, 3), 255, np.uint8)]
    alone = [read_page_ppocr(p, eng["det"], eng["rec"], spec) for p in pages]
    runner = _PageRunner(eng["det"], eng["rec"], None, spec, worker,
                         {"mode": "on", "max_batch": 16, "max_wait_ms": 0, "min_saving_ms": 0}, max_pages=8)

    async def together():
        return await asyncio.gather(*(runner(p) for p in pages))

    got = [lines for lines, _found in asyncio.run(together())]
    assert got == alone and len(alone[0]) == 18 and len(alone[1]) > 0 and len(alone[2]) > 0 and alone[3] == []
    # the first page finds the recogniser idle and runs alone; the two behind it share one call
    assert runner.coalescer.stats["largest"] >= 2


def test_page_lanes_read_every_page_as_one_engine_set_does(real):
    """Both cores (issue 48): two lanes, each its own engine set on its own thread, read pages side by side; every
    page's lines are exactly read_page's on one set, in the pages' order, and a lane's engines stay on its thread."""
    import threading

    from pipeline.engines.paddle_infer import InferenceEngine
    from pipeline.ocr.lanes import PageLanes
    from pipeline.ocr.ppocr_models import fetch
    from pipeline.ocr.system import read_page

    eng, spec = real
    pages = [_page(n) for n in ("return_word_debug.jpg", "issue_170.png")] + [np.full((64, 256, 3), 255, np.uint8)]
    alone = [read_page(p, eng["det"], eng["rec"], spec) for p in pages]
    m, threads_of = fetch(), {}

    class Watched(InferenceEngine):       # records the threads each lane's engine ran on
        def run(self, x):
            threads_of.setdefault(id(self), set()).add(threading.get_ident())
            return super().run(x)

    lanes = PageLanes(lambda: (*(Watched(m[k] / "inference", "fp32", threads=1) for k in ("det", "rec")), None,
                               spec), 2)
    try:
        got = lanes.read(pages + pages[:1])
    finally:
        lanes.close()
    assert got == alone + alone[:1] and got[2] == ([], 0) and len(got[0][0]) >= 4 and len(got[1][0]) == 1
    # both lanes read (the first two pages start at once: both detectors ran), each engine on one thread, the two
    # lanes on two; which lane's recogniser runs depends on timing (the blank page, the largest detector input at
    # limit min 736, starts first and may keep its lane busy while the other reads every page with text)
    assert len(threads_of) >= 3 and all(len(t) == 1 for t in threads_of.values())
    assert len(set().union(*threads_of.values())) == 2


class _BigTextDetector:
    """A detector that, like PP-OCRv5 mobile on issue_170.png's 190-pixel letters, finds nothing at the page's own
    size and the word's box (TEST, page pixels 90..760 x 165..420) once the input is at most `below` pixels wide."""
    kind, effective_precision = "fake", "fp32"

    def __init__(self, page_w: int, below: int):
        self.page_w, self.below, self.widths = page_w, below, []

    def run(self, x: np.ndarray) -> np.ndarray:
        h, w = x.shape[2:]
        self.widths.append(w)
        prob = np.zeros((1, 1, h, w), np.float32)
        if w <= self.below:
            f = w / self.page_w
            prob[..., int(175 * f):int(410 * f), int(100 * f):int(750 * f)] = 0.9
        return prob


def test_page_with_no_line_read_is_detected_again_at_retry_scale(real, worker):
    """retry_scale: a page on which no line was read gets one more detection at that fraction of the rule's size,
    in the flow read_pages runs and in /ocr's coalesced one alike; off (0) it reads nothing, and a page whose
    first pass reads a line is detected once."""
    import asyncio
    from pipeline.serving.ocr_routes import _PageRunner
    from pipeline.ocr.system import read_page_ppocr

    eng, spec = real
    page = _page("issue_170.png")                                   # 800x566: the rule (min 736) gives 1024x736
    det = _BigTextDetector(page.shape[1], below=600)
    spec.flow = {**spec.flow, "retry_scale": 0.0}
    assert read_page_ppocr(page, det, eng["rec"], spec) == [] and det.widths == [1024]
    spec.flow = {**spec.flow, "retry_scale": 0.5}
    det.widths.clear()
    lines = read_page_ppocr(page, det, eng["rec"], spec)
    assert [ln["text"] for ln in lines] == ["TEST"] and det.widths == [1024, 512]
    det.below = 2000                                                 # found at once: no second detection
    det.widths.clear()
    assert [ln["text"] for ln in read_page_ppocr(page, det, eng["rec"], spec)] == ["TEST"] and det.widths == [1024]
    det.below, det.widths = 600, []
    runner = _PageRunner(det, eng["rec"], None, spec, worker,
                         {"mode": "on", "max_batch": 16, "max_wait_ms": 0, "min_saving_ms": 0}, max_pages=8)
    got, _found = asyncio.run(runner(page))
    assert got == lines and det.widths == [1024, 512]


@pytest.mark.parametrize("pre", [{"resize": "stretch", "height": 96, "width": 128, "mean": 0.5, "std": 0.5},
                                 {"resize": "limit", "limit_side_len": 960, "limit_type": "max",
                                  "mean": [0.5] * 3, "std": [0.5] * 3}])
def test_detection_task_decodes_boxes_in_the_page_frame(pre):
    """What serve /predict does for a detection bundle: page → model input → map → boxes in the page's pixels."""
    from pipeline.ocr.pages import detection_input
    from pipeline.tasks.detection import DetectionTask

    page = np.zeros((250, 390, 3), np.uint8)
    x = detection_input(page, pre)
    assert x.shape[2:] == ((96, 128) if pre["resize"] == "stretch" else (256, 384))
    prob = np.zeros((1, 1) + x.shape[2:], np.float32)
    h, w = x.shape[2:]
    prob[0, 0, h // 4:h // 4 + 12, w // 4:w // 2] = 0.9
    [pred] = DetectionTask({"box_thresh": 0.5}).decode(prob, {"box_thresh": 0.5}, [page.shape[:2]])
    box = np.asarray(pred["boxes"][0])
    # the text region's centre, in page pixels (unclip grows the box around it)
    assert abs(box[:, 0].mean() - 390 * 3 / 8) < 390 / w * 2 and abs(box[:, 1].mean() - (h / 4 + 6) * 250 / h) < 250 / h * 2
    assert box[:, 0].max() > w or box[:, 1].max() > h or pre["resize"] == "limit"    # stretch: beyond the model frame


def test_real_upside_down_line_reads_after_the_classifier(real):
    from pipeline.ocr.system import read_crops

    eng, spec = real
    assert read_crops([_page("text_cls.jpg")], eng["rec"], spec, eng["cls"]) == ["怪我咯"]   # GT.tsv: 180 / 怪我咯


def test_turn_check_undoes_a_turn_the_recogniser_reads_worse(real, worker):
    """return_word_debug.jpg's upright sign line: the v2 classifier turns it by 180 and the recogniser then reads it
    as nothing it keeps; with turn_check the line is read as it stands, in read_page and in /ocr's coalesced flow
    alike, every other line unchanged. text_cls.jpg's line, truly upside down, stays turned."""
    import asyncio

    from pipeline.ocr.system import read_crops, read_page
    from pipeline.serving.ocr_routes import _PageRunner

    eng, spec = real
    page = _page("return_word_debug.jpg")
    spec.flow = {**spec.flow, "turn_check": False}
    trusted, _ = read_page(page, eng["det"], eng["rec"], spec, eng["cls"])
    spec.flow = {**spec.flow, "turn_check": True}
    checked, _ = read_page(page, eng["det"], eng["rec"], spec, eng["cls"])
    undone = [ln for ln in checked if "24H" in ln["text"]]
    assert len(undone) == 1 and undone[0]["angle"] == 0 and undone[0]["score"] > 0.8
    assert not any("24H" in ln["text"] for ln in trusted)
    assert [ln for ln in checked if ln is not undone[0]] == trusted
    assert read_crops([_page("text_cls.jpg")], eng["rec"], spec, eng["cls"]) == ["怪我咯"]

    runner = _PageRunner(eng["det"], eng["rec"], eng["cls"], spec, worker,
                         {"mode": "on", "max_batch": 16, "max_wait_ms": 0, "min_saving_ms": 0}, max_pages=8)

    async def together():
        return await asyncio.gather(*(runner(p) for p in (page, _page("ch_en_num.jpg"))))

    served = asyncio.run(together())
    assert served[0][0] == checked


def test_system_classifier_part_is_optional_and_checked():
    from pipeline.core.composite import part_configs
    from pipeline.core.config import load_config
    from pipeline.core.errors import ConfigError

    base = ["configs/ppocr_v4_system.yaml"]
    assert list(part_configs(load_config(base))) == ["detection", "recognition", "classifier"]
    assert list(part_configs(load_config(base, ["system.classifier=null"]))) == ["detection", "recognition"]
    with pytest.raises(ConfigError, match="expected text_direction"):
        part_configs(load_config(base, ["system.classifier=configs/ocr_det.yaml"]))


def test_text_direction_data_alternates_upright_and_upside_down(tmp_path):
    from pipeline.core.config import load_config
    from pipeline.data.preprocess import to_tensor
    from pipeline.tasks import get_task

    cfg = load_config(["configs/ppocr_v4_cls.yaml"], ["data.num_train=4", "data.num_val=4",
                                                      f"data.cache_dir={tmp_path}"]).section("data")["data"]
    task = get_task("text_direction")
    ds = task.load_data(cfg, 0)
    assert ds.val.labels.tolist() == [0, 1, 0, 1] and ds.info["labels"] == ["0", "180"]
    spec = task.preprocess_spec(cfg, ds.info)
    assert ds.val.images.shape == (4, 48, 192, 3) and to_tensor(ds.val.images, spec).shape == (4, 3, 48, 192)
    # PaddleOCR's padding stays on the right of an upside-down line too
    assert (ds.val.images[1][:, -8:].std() < ds.val.images[1][:, :40].std())


def test_limit_spec_refuses_validation_pages_the_rule_would_resize():
    from pipeline.core.errors import ConfigError
    from pipeline.tasks.detection import DetectionTask

    task = DetectionTask({"resize": "limit", "limit_side_len": 736, "limit_type": "min", "mean": [0.5] * 3,
                          "std": [0.5] * 3})
    assert task.preprocess_spec({"height": 736, "width": 768}, {})["limit_type"] == "min"
    with pytest.raises(ConfigError, match="resizes the 640x640 validation pages to 736x736"):
        task.preprocess_spec({"height": 640, "width": 640}, {})


def test_rec_bucket_pads_batch_widths_to_its_multiples_and_0_keeps_paddleocrs():
    """system.rec_bucket (issue 48): a rec batch's width rounded up to a multiple (fewer distinct input shapes);
    0 is PaddleOCR's width, the widest crop's aspect at the rec height."""
    import dataclasses

    from pipeline.ocr.system import FLOW_DEFAULTS, SystemSpec, recognize_crops

    assert ppocr.bucketed_width(321, 64) == 384 and ppocr.bucketed_width(320, 64) == 320
    assert ppocr.bucketed_width(321, 0) == 321

    class Rec:
        kind, input_shape, widths = "stub", [-1, 3, 48, -1], []

        def run(self, x):
            self.widths.append(x.shape[3])
            out = np.zeros((len(x), x.shape[3] // 8, 3), np.float32)
            out[..., 0] = 1.0
            return out

    crops = [np.full((48, w, 3), 255, np.uint8) for w in (100, 350, 700)]
    spec = SystemSpec({}, {}, {"height": 48, "width": 320}, {"charset": ["a", "b"]}, None,
                      {**FLOW_DEFAULTS, "rec_batch_num": 1})
    rec = Rec()
    recognize_crops(crops, rec, spec)
    assert sorted(rec.widths) == [320, 350, 700]
    rec.widths.clear()
    recognize_crops(crops, rec, dataclasses.replace(spec, flow={**spec.flow, "rec_bucket": 128}))
    assert sorted(rec.widths) == [384, 384, 768]


def test_lanes_start_the_largest_page_first_and_answer_in_order():
    """PageLanes.read starts pages by the detector input's size, largest first (a big page left for last keeps one
    lane busy while the others idle), and returns each page's reading in the pages' own order."""
    from pipeline.ocr.lanes import PageLanes, page_cost
    from pipeline.ocr.system import SystemSpec

    class _BlobDetector:      # one text blob per 64 columns of its input; records the widths it is asked for
        kind, effective_precision = "fake", "fp32"

        def __init__(self, seen):
            self.seen = seen

        def run(self, x):
            self.seen.append(x.shape[-1])
            prob = np.zeros((1, 1, *x.shape[2:]), np.float32)
            for j in range(x.shape[-1] // 64):
                prob[..., 20:44, j * 64 + 8:j * 64 + 56] = 0.9
            return prob

    class _Reader:            # every crop reads the charset's one character
        kind, effective_precision, input_shape = "fake", "fp32", [-1, 3, 48, -1]

        def run(self, x):
            return np.tile(np.array([0.0, 1.0], np.float32), (len(x), 8, 1))

    spec = SystemSpec({"resize": "limit", "limit_side_len": 64, "limit_type": "min"},
                      {"thresh": 0.3, "box_thresh": 0.6, "unclip_ratio": 1.5, "max_candidates": 10},
                      {"height": 48, "width": 320}, {"charset": ["x"]})
    pages = [np.full((64, w, 3), 255, np.uint8) for w in (128, 512, 64, 256)]
    assert [page_cost(p, spec) for p in pages] == [64 * 128, 64 * 512, 64 * 64, 64 * 256]
    seen: list[int] = []
    lanes = PageLanes(lambda: (_BlobDetector(seen), _Reader(), None, spec), 1)
    try:
        got = lanes.read(pages)
    finally:
        lanes.close()
    assert seen == [512, 256, 128, 64]                      # started largest first
    assert [n for _, n in got] == [2, 8, 1, 4]              # answered in the pages' order
    assert all(ln["text"] == "x" for lines, _ in got for ln in lines)
