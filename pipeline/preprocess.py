"""The one preprocessing path. Training, every engine check, `verify` and `serve` call these,
and the bundle's infer_config.yaml carries the spec, so no consumer can drift from training.

spec = {"height": H, "width": W, "channels": 1|3, "mean": m, "std": s, "resize": "stretch"|"pad_right"}
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from .errors import DataError


def to_tensor(images: np.ndarray, spec: dict) -> np.ndarray:
    """uint8 [N, H, W] → float32 [N, 1, H, W], normalised as (x/255 - mean) / std."""
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataError(f"expected uint8 images [N, H, W], got {images.dtype} {list(images.shape)}")
    h, w = spec["height"], spec["width"]
    if images.shape[1:] != (h, w):
        raise DataError(f"images are {images.shape[1]}x{images.shape[2]}, the model expects {h}x{w}",
                        hint="pass them through fit_image() first")
    x = images.astype(np.float32) / 255.0
    x = (x - float(spec["mean"])) / float(spec["std"])
    x = x[:, None, :, :]
    # models built for RGB (e.g. paddle.vision) get the gray image on every channel
    return np.repeat(x, spec.get("channels", 1), axis=1) if spec.get("channels", 1) != 1 else x


def fit_image(img: Image.Image, spec: dict) -> np.ndarray:
    """Any PIL image → uint8 [H, W] grayscale of the model's size (same rule as the data sets)."""
    img = img.convert("L")
    h, w = spec["height"], spec["width"]
    if spec.get("resize", "stretch") == "pad_right":
        # text lines keep their aspect ratio: scale to height, pad (white) or squeeze to width
        new_w = max(1, min(w, round(img.width * h / max(1, img.height))))
        img = img.resize((new_w, h), Image.BILINEAR)
        canvas = Image.new("L", (w, h), 255)
        canvas.paste(img, (0, 0))
        img = canvas
    elif img.size != (w, h):
        img = img.resize((w, h), Image.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


class ImageTooLarge(DataError):
    """An image whose header announces more pixels than allowed (refused before decoding)."""


def decode_image_bytes(data: bytes, spec: dict, max_pixels: int | None = None) -> np.ndarray:
    """PNG/JPEG bytes → uint8 [H, W]; raises DataError on anything PIL cannot read.

    max_pixels: refuse (ImageTooLarge) from the header alone — Image.open reads only the header, so a
    tiny PNG announcing 10000x10000 is never inflated to ~100 MB."""
    try:
        with warnings.catch_warnings():       # PIL warns on big headers; with a limit we decide ourselves
            if max_pixels is not None:
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        with img:
            if max_pixels is not None and img.width * img.height > max_pixels:
                raise ImageTooLarge(f"image is {img.width}x{img.height} = {img.width * img.height:,} pixels; "
                                    f"the limit is {max_pixels:,} (serve.max_pixels)",
                                    hint="downscale it before sending; the model needs only "
                                         f"{spec['width']}x{spec['height']}")
            img.load()
            return fit_image(img, spec)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        why = "unrecognised image format" if isinstance(exc, Image.UnidentifiedImageError) else str(exc)
        raise DataError(f"not a readable PNG/JPEG image ({why})", hint="send a PNG or JPEG file") from None
