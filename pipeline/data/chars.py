"""Built-in data: single characters (0-9, A-Z) rendered with Pillow's bundled font.

Deterministic by seed, generated on demand and cached as .npz keyed by every parameter.
"""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from pipeline.core.artifacts import atomic_write_bytes
from pipeline.core.errors import DataError

CLASSES = list("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _font(size: int, fonts: list[str], rng: np.random.Generator):
    if fonts:
        path = fonts[int(rng.integers(len(fonts)))]
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            raise DataError(f"font file cannot be read: {path}", hint="fix data.fonts or leave it empty") from None
    return ImageFont.load_default(size=size)


def render_char(ch: str, rng: np.random.Generator, size: int, fonts: list[str]) -> np.ndarray:
    """One glyph with random size, stroke, rotation, offset, contrast, blur and noise → uint8 [size, size]."""
    big = size * 2                                   # draw large, rotate, then shrink: fewer jaggies
    bg = int(rng.integers(170, 256))
    fg = int(rng.integers(0, 90))
    img = Image.new("L", (big, big), bg)
    draw = ImageDraw.Draw(img)
    font = _font(int(rng.integers(int(big * 0.55), int(big * 0.85))), fonts, rng)
    left, top, right, bottom = draw.textbbox((0, 0), ch, font=font)
    w, h = right - left, bottom - top
    x = (big - w) / 2 - left + rng.uniform(-0.12, 0.12) * big
    y = (big - h) / 2 - top + rng.uniform(-0.12, 0.12) * big
    draw.text((x, y), ch, fill=fg, font=font, stroke_width=int(rng.integers(0, 2)), stroke_fill=fg)
    img = img.rotate(float(rng.uniform(-12, 12)), resample=Image.BILINEAR, fillcolor=bg)
    if rng.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.0))))
    img = img.resize((size, size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32) + rng.normal(0, rng.uniform(0, 12), (size, size))
    return np.clip(arr, 0, 255).astype(np.uint8)


def render(n: int, seed: int, size: int = 32, fonts: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """n balanced samples → (uint8 [n, size, size], int64 labels [n])."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.int64) % len(CLASSES)
    rng.shuffle(labels)
    images = np.stack([render_char(CLASSES[c], rng, size, fonts or []) for c in labels])
    return images, labels


def load_or_render(n: int, seed: int, size: int, fonts: list[str], cache_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    key = json.dumps({"v": 2, "n": n, "seed": seed, "size": size, "fonts": fonts, "classes": CLASSES})
    path = Path(cache_dir) / f"chars-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                return z["images"], z["labels"]
        except (OSError, ValueError, KeyError):
            pass                                     # damaged cache: render again
    images, labels = render(n, seed, size, fonts)
    buf = io.BytesIO()
    np.savez_compressed(buf, images=images, labels=labels)
    atomic_write_bytes(path, buf.getvalue())
    return images, labels
