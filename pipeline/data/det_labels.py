"""Users' detection data in PaddleOCR's detection label format.

label file (UTF-8), one page per line:
    imgs/page_001.png<TAB>[{"transcription": "INV-2024-001", "points": [[10, 12], [120, 12], [120, 30], [10, 30]]}, ...]
Relative paths are resolved against the label file's folder. Pages are stretched to the model
size and their points scaled with them. A transcription of "###" (or "*") marks a region to ignore,
as in PaddleOCR: neither text nor background in training targets, not counted by the metric. A bad line stops
with `file:line` and how to fix it, or with data.on_bad_sample=skip is dropped and counted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from pipeline.data.imagedecode import image_size
from pipeline.core.errors import DataError
from pipeline.data.imagefolder import read_image
from pipeline.data.invoice_pages import pack_quads
from pipeline.data.labelfile import read_label_lines, resolve_image

IGNORE_TEXTS = ("###", "*")      # PaddleOCR's don't-care transcriptions (ppocr/data/imaug/label_ops.py)


def _parse_boxes(payload: str) -> list[tuple[str, np.ndarray]]:
    try:
        items = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the part after the TAB is not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(items, list):
        raise ValueError("the part after the TAB must be a JSON list of {\"transcription\", \"points\"} objects")
    out = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or "points" not in item:
            raise ValueError(f"box {k} has no \"points\" (expected {{\"transcription\": ..., \"points\": [[x, y] x 4]}})")
        try:
            pts = np.asarray(item["points"], dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"box {k}: points must be numbers [[x, y], ...]") from None
        if pts.shape != (4, 2):
            raise ValueError(f"box {k}: points must be 4 [x, y] pairs, got shape {list(pts.shape)}")
        if not np.isfinite(pts).all() or (pts < 0).any():
            raise ValueError(f"box {k}: points must be finite and non-negative")
        out.append((str(item.get("transcription", "")), pts))
    return out


def _page_size(path: Path) -> tuple[int, int]:
    return image_size(path)


def load_det_label_file(path: str | os.PathLike, height: int, width: int, max_boxes: int,
                        on_bad: str = "error") -> tuple[np.ndarray, np.ndarray, list[list[str]], int]:
    """→ (uint8 [N, H, W], packed quads [N, max_boxes, 4, 2] in model pixels ("###" boxes flagged, see
    invoice_pages.pack_quads), transcriptions, skipped)."""
    p = Path(path)
    spec = {"height": height, "width": width, "resize": "stretch"}

    def parse(line: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
        if "\t" not in line:
            raise ValueError("no TAB between image path and boxes (expected 'path<TAB>[{...}]')")
        rel, payload = line.split("\t", 1)
        boxes = _parse_boxes(payload)
        if len(boxes) > max_boxes:
            raise ValueError(f"{len(boxes)} boxes, more than data.max_boxes={max_boxes} (raise it)")
        img_path = resolve_image(rel, p.parent)
        try:
            image = read_image(img_path, spec)
            w0, h0 = _page_size(img_path)
        except (DataError, OSError) as exc:
            raise ValueError(getattr(exc, "message", str(exc))) from None
        scale = np.array([width / w0, height / h0], np.float32)
        q = np.stack([b[1] for b in boxes]) * scale if boxes else np.zeros((0, 4, 2), np.float32)
        if (q.reshape(-1, 2) > [width * 1.001 + 1, height * 1.001 + 1]).any():
            raise ValueError(f"a box lies outside the {w0}x{h0} image")
        return image, np.clip(q, 0, [width - 1, height - 1]).astype(np.float32), [b[0] for b in boxes]

    records, skipped = read_label_lines(
        p, "detection label file", on_bad, parse, unit="pages",
        line_format="'image_path<TAB>[{\"transcription\": ..., \"points\": [[x, y] x 4]}]'")
    images, quads, texts = zip(*records)
    ignore = [np.array([t in IGNORE_TEXTS for t in page], bool) for page in texts]
    return np.stack(images), pack_quads(list(quads), max_boxes, ignore), list(texts), skipped
