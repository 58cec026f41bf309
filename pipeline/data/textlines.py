"""Synthetic invoice text lines for the built-in recognition task.

Nothing can be downloaded, so the data set is rendered: invoice numbers, dates, amounts and
part codes drawn with Pillow, then degraded (rotation, blur, contrast, noise) and fitted to the
model's input with `preprocess.fit_image` — the very rule inference applies to a user's crop,
so a model never sees a resize at serving time that it did not see in training.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import string
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from pipeline.core.artifacts import ordinary_mode
from pipeline.core.errors import DataError
from pipeline.data.preprocess import fit_image

DEFAULT_CHARSET = string.digits + string.ascii_uppercase + "-.,/:"

# Bump when the renderer changes so cached .npz files from an older renderer are not reused.
RENDER_VERSION = 3

_FONT_SIZES = (18, 20, 22, 24, 26, 28, 30)   # a small set, so fonts are loaded once and cached
_FontT = ImageFont.FreeTypeFont | ImageFont.ImageFont


# ----------------------------------------------------------------------------- strings
def _digits(r: random.Random, k: int) -> str:
    return "".join(r.choice(string.digits) for _ in range(k))


def _letters(r: random.Random, k: int) -> str:
    return "".join(r.choice(string.ascii_uppercase) for _ in range(k))


def _amount(r: random.Random) -> str:
    value = r.choice([r.randint(0, 99), r.randint(100, 9999), r.randint(10000, 9999999)])
    whole = f"{value:,}" if r.random() < 0.7 else str(value)
    return f"{whole}.{r.randint(0, 99):02d}"


def _date(r: random.Random) -> str:
    d, m, y = r.randint(1, 28), r.randint(1, 12), r.randint(1995, 2035)
    return r.choice([f"{d:02d}/{m:02d}/{y}", f"{y}-{m:02d}-{d:02d}", f"{d:02d}.{m:02d}.{y}",
                     f"{m}/{d}/{y % 100:02d}"])


def _invoice_no(r: random.Random) -> str:
    prefix = r.choice(["INV", "INV", "IN", "RE", "NO.", "BILL", _letters(r, 2)])
    sep = r.choice(["-", "", "/", ":"])
    if r.random() < 0.5:
        return f"{prefix}{sep}{r.randint(1995, 2035)}-{_digits(r, r.randint(3, 5))}"
    return f"{prefix}{sep}{_digits(r, r.randint(4, 8))}"


def _code(r: random.Random) -> str:
    parts = [r.choice([_letters(r, r.randint(1, 3)), _digits(r, r.randint(1, 3))])
             for _ in range(r.randint(2, 4))]
    out = parts[0]
    for p in parts[1:]:
        out += r.choice("-/:.") + p
    return out


def _random_chars(r: random.Random, charset: str) -> str:
    # uniform strings cover every character (and repeats like "00", which CTC must separate)
    return "".join(r.choice(charset) for _ in range(r.randint(1, 12)))


def random_text(r: random.Random, max_len: int, charset: str = DEFAULT_CHARSET) -> str:
    """One invoice-like string of 1..max_len characters from `charset`."""
    kind = r.random()
    if kind < 0.2:
        s = _invoice_no(r)
    elif kind < 0.4:
        s = _date(r)
    elif kind < 0.6:
        s = _amount(r)
    elif kind < 0.8:
        s = _code(r)
    else:
        s = _random_chars(r, charset)
    s = "".join(c for c in s if c in charset) or r.choice(charset)
    return s[:max_len]


# ----------------------------------------------------------------------------- fonts
def load_fonts(fonts: list[str], sizes=_FONT_SIZES) -> list[dict[int, _FontT]]:
    """One {size: font} table per font file (or one for Pillow's built-in font); text lines and pages."""
    tables: list[dict[int, _FontT]] = []
    for path in fonts:
        try:
            tables.append({s: ImageFont.truetype(str(path), size=s) for s in sizes})
        except OSError as exc:
            raise DataError(f"font file {path} cannot be read: {exc}",
                            hint="give TTF/OTF/TTC files in data.fonts, or [] for the built-in font") from None
    if not tables:
        tables.append({s: ImageFont.load_default(size=s) for s in sizes})
    return tables


_MISSING = "\U0010FFFD"      # a private-use code point no font maps: what a font draws for a character it lacks


@functools.lru_cache(maxsize=8)
def _drawable(charset: str, fonts: tuple[str, ...]) -> str:
    tables = load_fonts(list(fonts), sizes=(24,))
    return "".join(c for c in charset if c == " " or all(_has_glyph(t[24], c) for t in tables))


def drawable_chars(charset: str, fonts: list[str] | None = None) -> str:
    """The characters of `charset` that every font of `fonts` (or Pillow's built-in one) draws as a glyph of its
    own, in charset order; " " is kept (it draws as an advance). A character a font lacks is drawn as its missing-
    glyph box (or nothing): a line holding one shows no trace of its label, so training on it teaches noise.
    Pillow's built-in font draws 104 of PaddleOCR's 18383-character v5 dictionary (ASCII and a few symbols)."""
    return _drawable(charset, tuple(str(f) for f in fonts or []))


def _has_glyph(font: _FontT, char: str) -> bool:
    mask = font.getmask(char)
    if mask.getbbox() is None:                      # no ink: nothing on the line tells this character
        return False
    missing = font.getmask(_MISSING)
    return not (mask.size == missing.size and bytes(mask) == bytes(missing))


# ----------------------------------------------------------------------------- rendering
class _Glyphs:
    """Ink masks of single characters, rendered once per (font, size, char).

    Drawing a line glyph by glyph through ImageDraw costs ~1 ms; pasting cached masks with
    numpy is several times faster and keeps rendering well above 1000 lines/s.
    """

    def __init__(self, tables: list[dict[int, _FontT]]):
        self.tables = tables
        self.cache: dict[tuple[int, int, str], tuple[np.ndarray, int, float]] = {}

    def get(self, table: int, size: int, char: str) -> tuple[np.ndarray, int, float]:
        """(ink mask, x offset of the pen origin inside the mask, advance width)."""
        key = (table, size, char)
        if key not in self.cache:
            font = self.tables[table][size]
            advance = float(font.getlength(char))
            # size the mask from the glyph's bbox (user fonts may have tall ascenders or a
            # negative left bearing); every glyph is drawn at y=0 so baselines line up
            left, _, right, bottom = font.getbbox(char)
            ox = max(0, -int(left))
            img = Image.new("L", (ox + max(int(right), int(advance)) + 2, max(int(bottom), size) + 2), 0)
            ImageDraw.Draw(img).text((ox, 0), char, fill=255, font=font)
            self.cache[key] = (np.asarray(img), ox, advance)
        return self.cache[key]


def _render_one(text: str, glyphs: _Glyphs, table: int, size: int, r: random.Random,
                spec: dict, flip: bool = False) -> np.ndarray:
    # tight to airy letter spacing; tighter than -0.03 glues "," and "." into digits beyond
    # what a 4-pixel CTC time step can resolve (measured: most errors were lost punctuation)
    spacing = r.uniform(-0.03, 0.2) * size
    marks = [glyphs.get(table, size, c) for c in text]
    text_w = sum(adv + spacing for _, _, adv in marks)
    # room for a 2 degree rotation (tan 2° ≈ 0.035) plus the crop margins, and no more:
    # rotation cost grows with the canvas area
    pad = int(0.035 * text_w) + size // 4 + 3
    xs, x = [], float(pad)
    for _mask, ox, adv in marks:
        xs.append(max(0, int(round(x)) - ox))
        x += adv + spacing
    width = max(xi + m.shape[1] for xi, (m, _, _) in zip(xs, marks)) + pad
    height = max(m.shape[0] for m, _, _ in marks) + 2 * pad + 1
    alpha = np.zeros((height, width), dtype=np.uint8)
    for xi, (mask, _, _) in zip(xs, marks):
        y = pad + r.randint(0, 1)                    # a pixel of baseline jitter, like a cheap printer
        region = alpha[y:y + mask.shape[0], xi:xi + mask.shape[1]]
        np.maximum(region, mask, out=region)         # overlapping glyphs (negative spacing) merge
    ink = Image.fromarray(alpha)
    angle = r.uniform(-2.0, 2.0)
    if abs(angle) > 0.3:
        ink = ink.rotate(angle, resample=Image.BILINEAR, fillcolor=0)
    # crop around the ink with a random margin: real crops from a detector are never exact
    box = ink.getbbox() or (0, 0, width, height)
    m = size * 0.25
    left = max(0, box[0] - int(r.uniform(0, m)))
    top = max(0, box[1] - int(r.uniform(0.03, 0.3) * size))
    right = min(width, box[2] + int(r.uniform(0, m)) + 1)
    bottom = min(height, box[3] + int(r.uniform(0.03, 0.3) * size) + 1)
    a = np.asarray(ink.crop((left, top, right, bottom)), dtype=np.float32) / 255.0
    bg = r.randint(185, 255)
    fg = r.randint(0, max(0, min(90, bg - 110)))
    img = Image.fromarray((bg - (bg - fg) * a).astype(np.uint8))
    if r.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(radius=r.uniform(0.3, 1.0)))
    if flip:                         # upside down before fitting: the padding stays on the right, as on a real crop
        img = img.rotate(180)
    return fit_image(img, spec)


def render_lines(n: int, seed: int, height: int = 32, width: int = 256, max_len: int = 16,
                 fonts: list[str] | None = None,
                 charset: str = DEFAULT_CHARSET, resize: str = "pad_right",
                 flip_odd: bool = False) -> tuple[np.ndarray, list[str]]:
    """Render n text lines → (uint8 [n, height, width], labels). Same arguments → same bytes.
    resize: preprocess.fit_image's rule (pad_right, or ppocr_rec for PaddleOCR's recognizers).
    flip_odd: lines 1, 3, 5 ... upside down (text-direction data: label = index % 2).

    Labels of render_lines(50, s) are the first 50 of render_lines(100, s); pixels are not
    (the noise is drawn for the whole batch at once, which is what makes it cheap).
    """
    if n < 0 or max_len < 1:
        raise DataError(f"cannot render n={n} lines with max_len={max_len}")
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    tables = load_fonts(list(fonts or []))
    glyphs = _Glyphs(tables)
    spec = {"height": height, "width": width, "resize": resize}
    images = np.empty((n, height, width), dtype=np.uint8)
    labels: list[str] = []
    for i in range(n):
        text = random_text(r, max_len, charset)
        table, size = r.randrange(len(tables)), r.choice(_FONT_SIZES)
        images[i] = _render_one(text, glyphs, table, size, r, spec, flip_odd and i % 2 == 1)
        labels.append(text)
    # sensor noise, vectorised over the batch; a third of the lines stay clean
    if n:
        sigma = rng.uniform(0.0, 10.0, size=(n, 1, 1)) * (rng.random((n, 1, 1)) < 0.67)
        noisy = images.astype(np.float32) + rng.standard_normal(images.shape, dtype=np.float32) * sigma
        images = np.clip(noisy, 0, 255).astype(np.uint8)
    return images, labels


# ----------------------------------------------------------------------------- cache
def _cache_key(params: dict, fonts: list[str]) -> str:
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for path in fonts:   # the font's bytes, not its name: replacing a file invalidates the cache
        try:
            h.update(Path(path).read_bytes())
        except OSError as exc:
            raise DataError(f"font file {path} cannot be read: {exc}") from None
    return h.hexdigest()[:16]


def load_or_render(n: int, seed: int, height: int = 32, width: int = 256, max_len: int = 16,
                   fonts: list[str] | None = None, cache_dir: str | os.PathLike | None = None,
                   charset: str = DEFAULT_CHARSET, resize: str = "pad_right",
                   flip_odd: bool = False) -> tuple[np.ndarray, list[str]]:
    """render_lines() with an .npz cache keyed by every parameter (and the renderer version)."""
    fonts = [str(f) for f in (fonts or [])]
    if cache_dir is None:
        return render_lines(n, seed, height, width, max_len, fonts, charset, resize, flip_odd)
    params = {"n": n, "seed": seed, "height": height, "width": width, "max_len": max_len,
              "fonts": fonts, "charset": charset, "version": RENDER_VERSION}
    if resize != "pad_right":        # only then: existing caches stay valid
        params["resize"] = resize
    if flip_odd:
        params["flip_odd"] = True
    cache = Path(cache_dir)
    target = cache / f"textlines-{_cache_key(params, fonts)}.npz"
    if target.is_file():
        try:
            with np.load(target, allow_pickle=False) as z:
                return z["images"], [str(s) for s in z["labels"]]
        except (OSError, ValueError, KeyError):
            pass   # a corrupt cache entry is re-rendered and overwritten below
    images, labels = render_lines(n, seed, height, width, max_len, fonts, charset, resize, flip_odd)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".textlines-", suffix=".tmp")
    try:
        ordinary_mode(fd)                # mkstemp makes 0600: a cache others may read too
        with os.fdopen(fd, "wb") as f:   # a file object, so numpy does not append ".npz" to tmp
            np.savez(f, images=images, labels=np.array(labels, dtype=str))
        os.replace(tmp, target)          # atomic: readers see the old file or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return images, labels
