"""The one image decoder: training data, /predict, /ocr, verify and the OCR system all read images here.

- Formats are an allow-list checked by their magic bytes (FORMATS), and Pillow is only allowed the plugin
  the bytes name: an EPS or DDS body never reaches Ghostscript or a half-supported decoder, whatever the
  file name or content-type says. A content-type that names another format is refused (check_content_type).
- Every mode is converted, not clipped: 16-bit gray is scaled to 8 bits (Pillow's convert('L') clips it to
  255, a blank page); alpha (RGBA, LA, PA, palette transparency) is composited on white; 1-bit, palette,
  CMYK, YCbCr and float images are converted; EXIF orientation is applied.
- The pixel limit is checked from the header, before any pixel is decoded.
- Any decoder exception becomes one DataError (UnreadableImage) naming the input: HTTP 400, a data error
  naming the file in training.
Results are uint8 numpy arrays: [H, W] for mode "L", [H, W, 3] for "RGB" or "BGR" (PaddleOCR's models
expect OpenCV's BGR order).
"""
from __future__ import annotations

import io
import os
import re
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from pipeline.core.errors import DataError

# Pillow format name -> magic byte prefixes (WEBP: "RIFF" + 4 length bytes + "WEBP", checked in sniff)
FORMATS = {
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "JPEG": (b"\xff\xd8\xff",),
    "BMP": (b"BM",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "TIFF": (b"II*\x00", b"MM\x00*"),
    "WEBP": (b"RIFF",),
}
CONTENT_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/bmp": "BMP",
                 "image/x-ms-bmp": "BMP", "image/gif": "GIF", "image/tiff": "TIFF", "image/webp": "WEBP"}
MODES = ("L", "RGB", "BGR")
SUPPORTED = "PNG, JPEG, BMP, GIF, TIFF or WebP"


class UnreadableImage(DataError):
    """Bytes that are not an allowed image format, or that its decoder cannot read."""


class ImageTooLarge(DataError):
    """An image whose header announces more pixels than allowed (refused before decoding)."""


def sniff(data: bytes) -> str | None:
    """The allowed format the leading bytes announce, or None."""
    for fmt, magics in FORMATS.items():
        if data.startswith(magics):
            if fmt == "WEBP" and data[8:12] != b"WEBP":
                continue
            return fmt
    return None


def check_content_type(ctype: str, data: bytes) -> None:
    """Refuse a body whose image content-type names another format than its bytes (UnreadableImage)."""
    declared, actual = CONTENT_TYPES.get(ctype), sniff(data)
    if declared and actual and declared != actual:
        raise UnreadableImage(f"content-type is {ctype} but the body is a {actual} image",
                              hint=f"send it as {_ctype_of(actual)} or re-encode it")


def _ctype_of(fmt: str) -> str:
    return next(c for c, f in CONTENT_TYPES.items() if f == fmt)


def _open(data: bytes, what: str, max_pixels: int | None) -> Image.Image:
    fmt = sniff(data)
    if fmt is None:
        head = data[:8].hex(" ") if data else "nothing"
        raise UnreadableImage(f"{what} is not a readable image: not {SUPPORTED} (its first bytes are {head})",
                                hint=f"convert it to PNG or JPEG; formats read: {SUPPORTED}")
    try:
        with warnings.catch_warnings():    # PIL warns on big headers; with a limit we decide ourselves
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as exc:   # over twice PIL's own limit: refused by the header too
        count = re.search(r"\((\d+) pixels\)", str(exc))
        announced = f"{int(count.group(1)):,}" if count else f"more than {2 * Image.MAX_IMAGE_PIXELS:,}"
        raise ImageTooLarge(f"{what} announces {announced} pixels"
                            + (f"; the limit is {max_pixels:,} (serve.max_pixels)" if max_pixels else ""),
                            hint="downscale it") from None
    if max_pixels is not None and img.width * img.height > max_pixels:
        img.close()
        raise ImageTooLarge(f"{what} is {img.width}x{img.height} = {img.width * img.height:,} pixels; "
                            f"the limit is {max_pixels:,} (serve.max_pixels)",
                            hint="downscale it before sending")
    img.load()                              # decode now: a truncated file fails here, inside the guard
    return img


def load(data: bytes, *, mode: str = "L", max_pixels: int | None = None, what: str = "image") -> Image.Image:
    """Bytes -> a PIL image in mode "L" or "RGB" (BGR is an array order: see decode), orientation applied."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    try:
        img = _open(data, what, max_pixels)
        ImageOps.exif_transpose(img, in_place=True)      # in place: no copy when there is nothing to turn
        return to_mode(img, "L" if mode == "L" else "RGB")
    except DataError:
        raise
    except Exception as exc:
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        why = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", why)      # no "<_io.BytesIO object at 0x…>"
        raise UnreadableImage(f"{what} is not a readable {sniff(data)} image ({why})",
                              hint="re-save it as PNG or JPEG") from None


def decode(data: bytes, *, mode: str = "L", max_pixels: int | None = None, what: str = "image") -> np.ndarray:
    """Bytes -> uint8 [H, W] (mode "L") or [H, W, 3] ("RGB", "BGR")."""
    arr = np.asarray(load(data, mode=mode, max_pixels=max_pixels, what=what), dtype=np.uint8)
    return np.ascontiguousarray(arr[..., ::-1]) if mode == "BGR" else arr


def printable(path: str | os.PathLike) -> str:
    """A path as text, bytes that are not UTF-8 shown as \\xNN (never lone surrogates)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def read_file(path: str | os.PathLike) -> bytes:
    """A file's bytes, or a DataError naming it."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"image {printable(path)} does not exist") from None
    except OSError as exc:
        raise DataError(f"image {printable(path)} cannot be read: {exc.strerror or exc}",
                        hint="check the path and its permissions") from None


def load_file(path: str | os.PathLike, *, mode: str = "L", max_pixels: int | None = None) -> Image.Image:
    return load(read_file(path), mode=mode, max_pixels=max_pixels, what=f"image {printable(path)}")


def decode_file(path: str | os.PathLike, *, mode: str = "L", max_pixels: int | None = None) -> np.ndarray:
    return decode(read_file(path), mode=mode, max_pixels=max_pixels, what=f"image {printable(path)}")


# ------------------------------------------------------------------------------------ modes

def _scale16(img: Image.Image) -> Image.Image:
    """16-bit (or 32-bit int) gray -> 8-bit by scaling 0..65535 onto 0..255, rounded."""
    a = np.clip(np.asarray(img), 0, 65535).astype(np.uint32)
    return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), "L")


def _float_to_l(img: Image.Image) -> Image.Image:
    """Float images: 0..1 when every value is within it (the usual convention), else 0..255; clipped."""
    a = np.nan_to_num(np.asarray(img, dtype=np.float64))
    if a.size and a.min() >= 0.0 and a.max() <= 1.0:
        a = a * 255.0
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L")


def _on_white(img: Image.Image) -> Image.Image:
    """Alpha composited on a white background (a transparent PNG reads as the page it shows)."""
    rgba = img.convert("RGBA")
    canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(canvas, rgba).convert("RGB")


def to_mode(img: Image.Image, mode: str) -> Image.Image:
    """Any decoded PIL image -> mode "L" or "RGB", every source mode converted correctly."""
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        img = _scale16(img)
    elif img.mode == "F":
        img = _float_to_l(img)
    elif "A" in img.mode or "a" in img.mode or "transparency" in img.info:
        img = _on_white(img)
    if img.mode == mode:
        return img
    return img.convert("RGB").convert(mode) if img.mode not in ("L", "RGB") else img.convert(mode)


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) of an image file as decoded here (EXIF orientation applied)."""
    img = load_file(path)
    return img.size


# a page is read at full resolution and resized to the detector's input: a side under PAGE_MIN_SIDE, or one
# side PAGE_MAX_ASPECT times the other, leaves text lines less than a pixel high there (boxes of zero height)
PAGE_MIN_SIDE = 16
PAGE_MAX_ASPECT = 64


def decode_page(data: bytes, *, mode: str = "L", max_pixels: int | None = None, what: str = "page") -> np.ndarray:
    """A document page: decode() plus a refusal of shapes no text can be read from."""
    page = decode(data, mode=mode, max_pixels=max_pixels, what=what)
    h, w = page.shape[:2]
    if min(h, w) < PAGE_MIN_SIDE or max(h, w) > PAGE_MAX_ASPECT * min(h, w):
        raise DataError(f"{what} is {w}x{h} pixels: too thin to read text from (each side must be at least "
                        f"{PAGE_MIN_SIDE} px and at most {PAGE_MAX_ASPECT}x the other)",
                        hint="send the page itself, or crop a strip to a readable shape")
    return page
