"""PaddleOCR's inference conventions, for pretrained PP-OCR models (and detectors trained like them).

The rules are PaddleOCR's own (ppocr/data/imaug/operators.py DetResizeForTest + NormalizeImage,
tools/infer/predict_system.py sorted_boxes + get_rotate_crop_image, predict_cls.py / predict_rec.py
resize_norm_img); RapidOCR (rapidocr_onnxruntime) applies the same ones. Images are OpenCV-style:
uint8 [H, W, 3] in BGR order (a gray page is [H, W] and gets replicated to 3 channels).

Detection preprocessing spec (infer_config.yaml `preprocess` of a detection bundle with resize: limit):
    {"resize": "limit", "limit_side_len": 960, "limit_type": "max", "channel_order": "BGR", "channels": 3,
     "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
"""
from __future__ import annotations

import math

import cv2
import numpy as np

from pipeline.core.errors import ConfigError, DataError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LIMIT_TYPES = ("max", "min", "resize_long")


def to_bgr(img: np.ndarray) -> np.ndarray:
    """uint8 [H, W] gray or [H, W, 3] BGR → [H, W, 3] BGR (what the PP-OCR models were trained on)."""
    if img.dtype != np.uint8 or img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[2] != 3):
        raise DataError(f"expected a uint8 image [H, W] or [H, W, 3] (BGR), got {img.dtype} {list(img.shape)}")
    return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR) if img.ndim == 2 else img


def det_resize_shape(h: int, w: int, limit_side_len: int, limit_type: str) -> tuple[int, int]:
    """PaddleOCR's DetResizeForTest (type 0): scale by the limit rule, then round each side to a multiple of 32."""
    if limit_type == "max":
        ratio = limit_side_len / max(h, w) if max(h, w) > limit_side_len else 1.0
    elif limit_type == "min":
        ratio = limit_side_len / min(h, w) if min(h, w) < limit_side_len else 1.0
    elif limit_type == "resize_long":
        ratio = limit_side_len / max(h, w)
    else:
        raise ConfigError(f"detection.limit_type must be one of {', '.join(LIMIT_TYPES)}, got {limit_type!r}")
    rh, rw = int(h * ratio), int(w * ratio)
    return max(int(round(rh / 32) * 32), 32), max(int(round(rw / 32) * 32), 32)


def normalize(img: np.ndarray, mean, std) -> np.ndarray:
    """uint8 [H, W, C] → float32 [C, H, W] (C-contiguous) as (x/255 - mean) / std per channel (PaddleOCR's
    NormalizeImage). The same float32 operations in the same order, channel by channel in place: bit-identical to
    the whole-array expression and ~7x faster on a 736x2944 page (no [H, W, C] temporaries, no strided copy)."""
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    out = np.empty((img.shape[2], img.shape[0], img.shape[1]), np.float32)
    for c in range(img.shape[2]):
        o = out[c]
        o[...] = img[:, :, c]
        np.divide(o, np.float32(255.0), out=o)
        np.subtract(o, mean[c], out=o)
        np.divide(o, std[c], out=o)
    return out


def det_input(page: np.ndarray, pre: dict, bucket: int = 0) -> np.ndarray:
    """One page → float32 [1, 3, H', W'] at the page's own limit-rule size (H', W' multiples of 32). bucket > 0:
    the same page padded at the bottom and right up to multiples of `bucket` (bucketed_size); crop the DB map back
    to the unpadded size (its top-left) before the boxes, so they are scaled back exactly as without padding."""
    img = to_bgr(page)
    rh, rw = det_resize_shape(img.shape[0], img.shape[1], int(pre["limit_side_len"]), pre["limit_type"])
    resized = cv2.resize(img, (rw, rh))
    x = normalize(resized, pre.get("mean", IMAGENET_MEAN), pre.get("std", IMAGENET_STD))
    if bucket > 0:
        bh, bw = bucketed_size(rh, rw, bucket)
        # 0 after normalisation: the page's mean colour, what the first conv's own zero padding shows it at a
        # border, so DB reads the pad as background (measured: max probability on the pad, docs/serving_choice.md)
        x = np.pad(x, ((0, 0), (0, bh - rh), (0, bw - rw)))
    return x[None]


def bucketed_size(h: int, w: int, bucket: int) -> tuple[int, int]:
    """(h, w) rounded up to multiples of `bucket` (0: unchanged): fewer distinct input shapes, so a runtime that
    prepares kernels per shape (OpenVINO, ONNX Runtime) reuses them across pages."""
    if bucket <= 0:
        return h, w
    return -(-h // bucket) * bucket, -(-w // bucket) * bucket


def sorted_boxes(quads: np.ndarray) -> np.ndarray:
    """PaddleOCR's sorted_boxes: indices ordering quads by top-left (y, x), then swapping neighbours whose
    top-left y differ by < 10 px so a row reads left to right."""
    order = sorted(range(len(quads)), key=lambda i: (quads[i][0][1], quads[i][0][0]))
    for i in range(len(order) - 1):
        for j in range(i, -1, -1):
            a, b = quads[order[j]][0], quads[order[j + 1]][0]
            if abs(b[1] - a[1]) < 10 and b[0] < a[0]:
                order[j], order[j + 1] = order[j + 1], order[j]
            else:
                break
    return np.asarray(order, dtype=int)


def resize_norm(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """PaddleOCR's resize_norm_img for rec and cls: keep aspect at `height`, at most `width` wide,
    (x/255 - 0.5)/0.5, zero-padded on the right to `width` → float32 [3, height, width]."""
    img = to_bgr(img)
    h, w = img.shape[:2]
    new_w = min(width, int(math.ceil(height * w / float(max(h, 1)))))
    resized = cv2.resize(img, (max(new_w, 1), height))
    out = np.zeros((3, height, width), np.float32)
    out[:, :, :max(new_w, 1)] = normalize(resized, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    return out


def width_batches(crops: list[np.ndarray], batch_num: int) -> list[np.ndarray]:
    """Crop indices in batches of `batch_num`, sorted by width/height ratio (PaddleOCR's rec_batch_num
    rule): crops of similar width share a batch, so padding to the batch's widest crop wastes little."""
    ratios = np.array([c.shape[1] / float(max(c.shape[0], 1)) for c in crops])
    order = np.argsort(ratios, kind="stable")
    return [order[i:i + batch_num] for i in range(0, len(order), batch_num)]


def batch_width(crops: list[np.ndarray], idx: np.ndarray, height: int, base_width: int) -> int:
    """Input width of one rec batch: its widest crop's aspect at `height`, never below base_width."""
    ratio = max([base_width / height] + [crops[i].shape[1] / float(max(crops[i].shape[0], 1)) for i in idx])
    return int(height * ratio)


def bucketed_width(width: int, bucket: int) -> int:
    """A rec batch's input width rounded up to a multiple of `bucket` (0: unchanged): fewer distinct widths, so a
    runtime that prepares kernels per input shape (OpenVINO) reuses them; the extra columns are resize_norm's zero
    padding, as a batch's narrower crops already get."""
    return width if bucket <= 0 else -(-width // bucket) * bucket


def page_from_pil(img) -> np.ndarray:
    """A decoded PIL image → uint8 [H, W, 3] BGR, converted as pipeline/imagedecode does (transparency on white)."""
    from pipeline.data.imagedecode import to_mode

    return np.ascontiguousarray(np.asarray(to_mode(img, "RGB"))[..., ::-1])


def _resize32(img: np.ndarray, ratio: float) -> tuple[np.ndarray, float, float]:
    h, w = img.shape[:2]
    rh, rw = int(round(int(h * ratio) / 32) * 32), int(round(int(w * ratio) / 32) * 32)
    if rh <= 0 or rw <= 0:
        raise DataError(f"page {w}x{h} is too small to read")
    return cv2.resize(img, (rw, rh)), h / rh, w / rw


def prepare_page(img: np.ndarray, flow: dict) -> tuple[np.ndarray, tuple[float, float, int]]:
    """RapidOCR's page steps before detection (off when the keys are 0): scale a page whose longer side exceeds
    max_side_len down / whose shorter side is below min_side_len up (multiples of 32); pad a page that is at most
    min_height high or wider than width_height_ratio x its height with black above and below, so a single
    line is not blown up by limit_type min. → (page, (scale_y, scale_x, pad_top)) for page_boxes()."""
    sy = sx = 1.0
    big, small = int(flow.get("max_side_len", 0)), int(flow.get("min_side_len", 0))
    if big and max(img.shape[:2]) > big:
        img, sy, sx = _resize32(img, big / max(img.shape[:2]))
    if small and min(img.shape[:2]) < small:
        img, sy, sx = _resize32(img, small / min(img.shape[:2]))
    h, w = img.shape[:2]
    min_h, ratio = int(flow.get("min_height", 0)), float(flow.get("width_height_ratio", 0))
    pad = 0
    if (min_h and h <= min_h) or (ratio > 0 and w / h > ratio):
        pad = int(abs(max(int(w / ratio) if ratio > 0 else 0, min_h) * 2 - h) / 2)
        img = cv2.copyMakeBorder(img, pad, pad, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0))
    return img, (sy, sx, pad)


def page_boxes(quads: np.ndarray, transform: tuple[float, float, int], size: tuple[int, int]) -> np.ndarray:
    """Quads found on a prepare_page() page → the original page's pixels (clipped to it)."""
    sy, sx, pad = transform
    out = np.asarray(quads, np.float32).copy().reshape(-1, 4, 2)
    out[..., 1] = (out[..., 1] - pad) * sy
    out[..., 0] *= sx
    return np.clip(out, 0, [size[1], size[0]])
