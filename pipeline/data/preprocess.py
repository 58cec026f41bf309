"""The one preprocessing path. Training, every engine check, `verify` and `serve` call these,
and the bundle's infer_config.yaml carries the spec, so no consumer can drift from training.

spec = {"height": H, "width": W, "channels": 1|3, "mean": m, "std": s, "resize": "stretch"|"pad_right"|"ppocr_rec",
        "color": "gray"|"bgr", "dynamic_width": bool}

color "bgr" (PaddleOCR's models, trained on OpenCV-decoded images) keeps uint8 images as RGB [N, H, W, 3]
(so PNGs round-trip) and feeds channels in B, G, R order. resize "ppocr_rec" is PaddleOCR's resize_norm_img:
scale to the model height keeping the aspect ratio (width rounded up), pad right. With dynamic_width a
line wider than `width` keeps its own width (the exported program takes any width), as PaddleOCR's
predictor grows its batch width to the widest line.
"""
from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from pipeline.data import imagedecode
from pipeline.core.errors import DataError
from pipeline.data.imagedecode import ImageTooLarge as ImageTooLarge


def png_bytes(img: np.ndarray) -> bytes:
    """A uint8 image as PNG (bundle samples, HTTP gate bodies): lossless, so served inputs equal gated ones."""
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


# PaddleOCR pads a normalised line with 0 (mid-grey); the nearest uint8 grey, (128/255 - 0.5)/0.5 = 0.004
PPOCR_PAD = 128


def is_color(spec: dict) -> bool:
    return spec.get("color", "gray") == "bgr"


def _check_size(images: np.ndarray, spec: dict) -> None:
    h, w = spec["height"], spec["width"]
    ok = images.shape[1] == h and (images.shape[2] >= w if spec.get("dynamic_width") else images.shape[2] == w)
    if not ok:
        wide = f"{w}+ (dynamic width)" if spec.get("dynamic_width") else str(w)
        raise DataError(f"images are {images.shape[1]}x{images.shape[2]}, the model expects {h}x{wide}",
                        hint="pass them through fit_image() first")


def to_tensor(images: np.ndarray, spec: dict) -> np.ndarray:
    """uint8 [N, H, W] (or RGB [N, H, W, 3] for color "bgr") → float32 [N, C, H, W], (x/255 - mean) / std."""
    rgb = is_color(spec)
    if images.dtype != np.uint8 or images.ndim != (4 if rgb else 3) or (rgb and images.shape[3] != 3):
        want = "[N, H, W, 3] (RGB)" if rgb else "[N, H, W]"
        raise DataError(f"expected uint8 images {want}, got {images.dtype} {list(images.shape)}")
    _check_size(images, spec)
    x = images.astype(np.float32) / 255.0
    if rgb:
        x = np.ascontiguousarray(x[..., ::-1].transpose(0, 3, 1, 2))    # RGB → B, G, R planes
    else:
        x = x[:, None, :, :]
        # models built for RGB (e.g. paddle.vision) get the gray image on every channel
        x = np.repeat(x, spec.get("channels", 1), axis=1) if spec.get("channels", 1) != 1 else x
    # mean/std: one number, or one per channel (PaddleOCR's detection spec)
    mean = np.asarray(spec["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec["std"], np.float32).reshape(1, -1, 1, 1)
    return (x - mean) / std


def _fit_ppocr_rec(img: Image.Image, spec: dict) -> Image.Image:
    """PaddleOCR's resize_norm_img: height fixed, width ceil(h x aspect) (capped at `width` unless the
    model takes dynamic widths), padded right to at least `width`."""
    h, w = spec["height"], spec["width"]
    new_w = max(1, math.ceil(h * img.width / max(1, img.height)))
    if not spec.get("dynamic_width"):
        new_w = min(w, new_w)
    img = img.resize((new_w, h), Image.BILINEAR)
    canvas = Image.new(img.mode, (max(w, new_w), h), (PPOCR_PAD,) * 3 if img.mode == "RGB" else PPOCR_PAD)
    canvas.paste(img, (0, 0))
    return canvas


def fit_image(img: Image.Image, spec: dict) -> np.ndarray:
    """Any PIL image → uint8 [H, W] grayscale (RGB [H, W, 3] for color "bgr") of the model's size
    (same rule as the data sets)."""
    img = imagedecode.to_mode(img, _mode(spec))   # 16-bit scaled, alpha on white: convert('L') would clip
    h, w = spec["height"], spec["width"]
    if spec.get("resize") == "ppocr_rec":
        img = _fit_ppocr_rec(img, spec)
    elif spec.get("resize", "stretch") == "pad_right":
        # text lines keep their aspect ratio: scale to height, pad (white) or squeeze to width
        new_w = max(1, min(w, round(img.width * h / max(1, img.height))))
        img = img.resize((new_w, h), Image.BILINEAR)
        canvas = Image.new("L", (w, h), 255)
        canvas.paste(img, (0, 0))
        img = canvas
    elif img.size != (w, h):
        img = img.resize((w, h), Image.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


def _mode(spec: dict) -> str:
    return "RGB" if is_color(spec) else "L"


_PNG_SIG = b"\x89PNG\r\n\x1a\n"


def _png_gray_at_size(data: bytes, spec: dict, max_pixels: int | None = None) -> np.ndarray | None:
    """An 8-bit grayscale PNG already at the model size needs no conversion or resize: OpenCV decodes it
    ~5x faster than PIL (30 vs 150 us, the largest cost of a /predict request) and PNG is lossless, so the
    pixels are identical. Anything else (colour, 16-bit, other sizes, JPEG) takes the PIL path."""
    if is_color(spec) or len(data) < 33 or not data.startswith(_PNG_SIG) or data[12:16] != b"IHDR":
        return None
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if (h, w) != (spec["height"], spec["width"]) or data[24] != 8 or data[25] != 0:   # depth 8, colour type 0
        return None
    if max_pixels is not None and h * w > max_pixels:       # the PIL path refuses it with the usual message
        return None
    if b"tRNS" in data or b"eXIf" in data:    # transparency or an orientation: imagedecode applies them
        return None
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    return img if img is not None and img.dtype == np.uint8 and img.shape == (h, w) else None


def decode_image_bytes(data: bytes, spec: dict, max_pixels: int | None = None, what: str = "image") -> np.ndarray:
    """Image bytes → uint8 [H, W] fitted to spec, through pipeline.data.imagedecode (formats, modes, errors).

    max_pixels: refuse (ImageTooLarge) from the header alone, so a tiny PNG announcing 10000x10000 is never
    inflated to ~100 MB."""
    fast = _png_gray_at_size(data, spec, max_pixels)
    if fast is not None:
        return fast
    return fit_image(imagedecode.load(data, mode=_mode(spec), max_pixels=max_pixels, what=what), spec)
