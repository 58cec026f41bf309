"""Detection pieces without training: pages, DB targets ↔ post-processing, metric, label files, system metrics."""
import json

import numpy as np
import pytest
from PIL import Image

from pipeline.data.det_labels import load_det_label_file
from pipeline.data.invoice_pages import FIELDS, KEYS_LATIN, load_or_render, unpack_quads
from pipeline.core.errors import DataError
from pipeline.ocr.db_post import DBParams, boxes_from_map, detect_batch
from pipeline.ocr.db_targets import batch_targets
from pipeline.ocr.det_metric import detection_scores, match
from pipeline.ocr.system_metrics import agreement, extract_fields, system_scores


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    return load_or_render(6, 11, 320, 320, max_boxes=32, cache_dir=tmp_path_factory.mktemp("cache"))


def test_pages_are_deterministic_and_cached(pages, tmp_path):
    again = load_or_render(6, 11, 320, 320, max_boxes=32, cache_dir=tmp_path)
    assert np.array_equal(again["images"], pages["images"]) and np.array_equal(again["quads"], pages["quads"])
    assert list(tmp_path.glob("invoice-pages-*.npz"))           # cached by parameters
    other = load_or_render(6, 12, 320, 320, max_boxes=32)
    assert not np.array_equal(other["images"], pages["images"])
    for quads, texts, fields in zip(unpack_quads(pages["quads"]), pages["texts"], pages["fields"]):
        assert len(quads) == sum(1 for t in texts if t) >= 8        # header, fields, table, total
        assert (quads >= 0).all() and (quads < 320).all()
        assert all(fields)                                         # invoice number, date, amount present


def test_shrink_map_through_post_processing_recovers_ground_truth(pages):
    """The DB pair: shrink by r = 0.4, unclip by 1.5 → the original boxes (IoU ≥ 0.5 for all)."""
    gts = unpack_quads(pages["quads"])
    targets = batch_targets(pages["quads"], 320, 320)
    assert targets.shape == (6, 4, 320, 320)
    assert set(np.unique(targets[:, 0])) <= {0.0, 1.0}
    assert 0.3 <= targets[:, 2].min() and targets[:, 2].max() <= 0.7 + 1e-6
    found = detect_batch(targets[:, :1], DBParams())
    scores = detection_scores([q for q, _ in found], gts)
    assert scores["hmean"] >= 0.98, scores
    # boxes come back in reading order and scaled to another output size on request
    quads, _ = boxes_from_map(targets[0, 0], DBParams(), out_size=(640, 960))
    assert quads[:, :, 0].max() > 320 and quads[:, :, 1].max() > 320
    cy = quads[:, :, 1].mean(axis=1)
    assert cy[0] <= cy[-1]


def test_post_processing_thresholds():
    prob = np.zeros((64, 64), np.float32)
    prob[10:20, 5:40] = 0.9              # a confident line
    prob[40:50, 5:40] = 0.45             # above thresh, below box_thresh
    prob[30, 50] = 0.99                  # a speck: smaller than min_size
    quads, scores = boxes_from_map(prob, DBParams(thresh=0.3, box_thresh=0.6))
    assert len(quads) == 1 and scores[0] == pytest.approx(0.9, abs=1e-3)
    assert quads[:, :, 1].min() < 10 and quads[:, :, 1].max() > 19        # unclipped beyond the kernel
    assert len(boxes_from_map(prob, DBParams(thresh=0.3, box_thresh=0.4))[0]) == 2
    assert len(boxes_from_map(np.zeros((32, 32), np.float32), DBParams())[0]) == 0


def _box(x0, y0, x1, y1):
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float32)


def test_metric_precision_recall_hmean():
    gt = [np.stack([_box(0, 0, 100, 20), _box(0, 40, 100, 60)])]
    assert detection_scores(gt, gt)["hmean"] == 1.0
    shifted = [np.stack([_box(30, 0, 130, 20), _box(0, 40, 100, 60), _box(200, 200, 220, 220)])]
    s = detection_scores(shifted, gt)                # IoU(first) = 70/130 ≥ 0.5; third is a false positive
    assert s["precision"] == pytest.approx(2 / 3) and s["recall"] == 1.0
    assert s["hmean"] == pytest.approx(0.8)
    far = [np.stack([_box(60, 0, 160, 20)])]         # IoU 40/160 < 0.5
    assert detection_scores(far, [gt[0][:1]])["hmean"] == 0.0
    # one prediction cannot match two ground-truth boxes
    assert len(match(np.stack([_box(0, 0, 100, 60)]), gt[0], iou=0.1)) == 1
    assert detection_scores([np.zeros((0, 4, 2))], gt)["recall"] == 0.0


def _write_page(folder, name="p.png", size=(200, 100)):
    Image.new("L", size, 255).save(folder / name)
    return name


BOX = {"transcription": "INV-1", "points": [[10, 10], [90, 10], [90, 30], [10, 30]]}


def test_detection_label_file_reads_and_scales(tmp_path):
    name = _write_page(tmp_path)
    f = tmp_path / "det_gt.txt"
    f.write_text(f"{name}\t{json.dumps([BOX, BOX])}\n\n{name}\t[]\n")
    images, quads, texts, skipped = load_det_label_file(f, 64, 128, max_boxes=4)
    assert images.shape == (2, 64, 128) and skipped == 0 and texts[0] == ["INV-1", "INV-1"]
    got = unpack_quads(quads)
    assert len(got[0]) == 2 and len(got[1]) == 0
    assert got[0][0][1].tolist() == pytest.approx([90 * 128 / 200, 10 * 64 / 100])


@pytest.mark.parametrize("line, why", [
    ("{name} [{box}]", "no TAB"),
    ("{name}\tnot json", "not JSON"),
    ('{name}\t{{"points": 1}}', "JSON list"),
    ('{name}\t[{{"transcription": "x"}}]', "no \"points\""),
    ('{name}\t[{{"points": [[1, 2], [3, 4], [5, 6]]}}]', "4 [x, y] pairs"),
    ('{name}\t[{{"points": [[1, 2], [3, 4], [5, 6], [-1, 0]]}}]', "non-negative"),
    ("missing.png\t[{box}]", "does not exist"),
    ('{name}\t[{{"points": [[1, 2], [900, 4], [5, 6], [1, 0]]}}]', "outside"),
])
def test_detection_label_file_errors_name_file_and_line(tmp_path, line, why):
    name = _write_page(tmp_path)
    f = tmp_path / "det_gt.txt"
    good = f"{name}\t{json.dumps([BOX])}"
    f.write_text(good + "\n" + line.format(name=name, box=json.dumps(BOX)) + "\n")
    with pytest.raises(DataError) as exc:
        load_det_label_file(f, 64, 128, max_boxes=4)
    assert f"{f}:2:" in exc.value.message and why in exc.value.message
    images, _, _, skipped = load_det_label_file(f, 64, 128, max_boxes=4, on_bad="skip")
    assert len(images) == 1 and skipped == 1


def test_too_many_boxes_and_empty_file(tmp_path):
    name = _write_page(tmp_path)
    f = tmp_path / "det_gt.txt"
    f.write_text(f"{name}\t{json.dumps([BOX] * 3)}\n")
    with pytest.raises(DataError, match="max_boxes=2"):
        load_det_label_file(f, 64, 128, max_boxes=2)
    f.write_text("\n")
    with pytest.raises(DataError, match="no usable pages"):
        load_det_label_file(f, 64, 128, max_boxes=2)


def _line(box, text):
    return {"box": box.tolist(), "text": text, "score": 1.0, "det_score": 1.0}


def test_system_metrics_lines_and_fields():
    keys = KEYS_LATIN
    gt_quads = [np.stack([_box(0, 0, 60, 20), _box(80, 0, 200, 20), _box(0, 40, 60, 60), _box(80, 40, 200, 60)])]
    gt_texts = [[keys["invoice_no"], "INV-7", keys["date"], "01/02/2024"]]
    gt_fields = [{"invoice_no": "INV-7", "date": "01/02/2024", "amount": ""}]
    pred = [[_line(gt_quads[0][0], keys["invoice_no"]), _line(gt_quads[0][1], "INV-7"),
             _line(gt_quads[0][2], keys["date"]), _line(gt_quads[0][3] + 1, "01/02/2O24")]]
    s = system_scores(pred, gt_quads, gt_texts, gt_fields, keys)
    assert s["line_accuracy"] == 0.75 and s["field_accuracy"] == 0.5 and s["fields"] == 2
    assert extract_fields(pred[0], keys) == {"invoice_no": "INV-7", "date": "01/02/2O24"}
    assert agreement(pred, pred) == 1.0
    assert agreement(pred, [pred[0][:2]]) == 0.5
    assert set(FIELDS) == set(keys)
