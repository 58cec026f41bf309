"""Tuning pages for a detector's text judge (issue 48): text as close to its box's edges as on real signs and receipts.

A crop edge that cuts a glyph rewrites a line (`3F】` read as `3F1` or `3FI`), so these pages put thin and bracket
glyphs ([]【】()|1Il:;.,-) at the ends of short strings, draw many of them inside tight panels or frames (1-4 px from
the ink), pack lines densely, tilt lines and pages a few degrees, and draw some at low contrast, blurred or noisy.
The lenticular brackets 【】, which no bundled font draws, are drawn as filled shapes. Pages are BGR uint8 at one
size (one detector input shape: the bf16 trials rank and time on them). Page i of a seed depends on (seed, i) only;
the renderer is its own (no validation set of the project is drawn by it), and its default seed is used nowhere else.
"""
from __future__ import annotations

import functools
import random
import re
import string

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from pipeline.data.textlines import load_fonts

EDGE_GLYPHS = "[]【】()|1Il:;.,-"
LENTICULAR = "【】"
SIZES = (14, 16, 18, 20, 22, 24, 28, 32, 36)
DEFAULT_SEED = 48_0001          # used by nothing else in the project: the pages detector keep lists are chosen on
SYSTEM_SEED = 48_0002           # the system stage's admission judge (pipeline/evaluation/edge_judge.py): other pages
# fonts drawn besides Pillow's built-in one, where installed (Debian fonts-dejavu-core)
FONT_FILES = tuple(f"/usr/share/fonts/truetype/dejavu/{n}.ttf" for n in ("DejaVuSans", "DejaVuSerif", "DejaVuSansMono"))


def _core(r: random.Random) -> str:
    """The middle of a string: sign codes, receipt fields, numbers, words."""
    up, dig = string.ascii_uppercase, string.digits
    kinds = [lambda: f"{r.randint(1, 12)}{r.choice('FBL')}",
             lambda: f"{r.choice(up)}{r.randint(1, 99)}-{r.randint(1, 99):02d}",
             lambda: f"{r.randint(0, 99999):,}.{r.randint(0, 99):02d}",
             lambda: f"Tel:{r.randint(100, 999)}-{r.randint(1000, 9999)}",
             lambda: f"{r.randint(1, 28):02d}.{r.randint(1, 12):02d}.{r.randint(2000, 2030)}",
             lambda: "".join(r.choice("Il1|") for _ in range(r.randint(2, 6))),
             lambda: r.choice(["ROOM", "EXIT", "Total", "Cash", "Qty", "No.", "Gate", "Floor", "VAT", "Item"])
             + r.choice(["", " ", ":"]) + "".join(r.choice(dig) for _ in range(r.randint(1, 4))),
             lambda: "".join(r.choice(up + dig) for _ in range(r.randint(2, 7))),
             lambda: "".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(3, 8)))]
    return r.choice(kinds)()


def edge_text(r: random.Random) -> str:
    """A short string; most start or end (or both) with a thin or bracket glyph, where a crop edge cuts first."""
    s = _core(r)
    pairs = ["[]", "【】", "()", "||", "[]", "【】"]
    u = r.random()
    if u < 0.3:
        a, b = r.choice(pairs)
        s = a + s + b
    elif u < 0.55:
        s = s + r.choice("】]1Il|):;.,-")
    elif u < 0.75:
        s = r.choice("【[(|1Il-") + s
    return s


def _draw_lenticular(draw: ImageDraw.ImageDraw, x: float, top: float, w: float, h: float, left: bool) -> None:
    """【 (left) or 】: a filled bracket whose inner side is concave; the glyph's box is (x, top, x + w, top + h)."""
    t = np.linspace(0.0, 1.0, 9)
    bow = x + w * (0.35 + 0.35 * np.sin(np.pi * t)) if left else x + w * (0.65 - 0.35 * np.sin(np.pi * t))
    arm = x + w * 0.95 if left else x + w * 0.05
    outer = x + w * 0.15 if left else x + w * 0.85
    inner = [(float(bx), top + h * float(tt)) for bx, tt in zip(bow, t)]
    pts = [(outer, top), (arm, top)] + inner[1:-1] + [(arm, top + h), (outer, top + h)]
    draw.polygon(pts, fill=255)


def _ink_mask(text: str, font, size: int) -> Image.Image:
    """The text's ink (L mask), glyph by glyph so that 【】 are drawn as shapes; tight to the ink."""
    width = int(sum(size * 0.8 if c in LENTICULAR else font.getlength(c) for c in text)) + size
    img = Image.new("L", (max(width, 1), int(size * 1.6)), 0)
    d = ImageDraw.Draw(img)
    cap = font.getbbox("H")
    x = size * 0.3
    for run in re.split(f"([{LENTICULAR}])", text):       # runs between brackets drawn in one call
        if run in LENTICULAR and run:
            _draw_lenticular(d, x, cap[1] - size * 0.08, size * 0.55, (cap[3] - cap[1]) + size * 0.16, run == "【")
            x += size * 0.8
        elif run:
            d.text((x, 0), run, fill=255, font=font)
            x += font.getlength(run)
    return img.crop(img.getbbox() or (0, 0, 1, 1))


def _patch(r: random.Random, text: str, font, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(panel mask, ink mask), float [h, w] in 0..1: the ink with a 1-4 px margin, sometimes a filled panel or a
    frame line that close to it, tilted by up to 4 degrees half the time."""
    ink = _ink_mask(text, font, size)
    m = r.randint(1, 4)
    w, h = ink.size[0] + 2 * m + 4, ink.size[1] + 2 * m + 4
    inks = Image.new("L", (w, h), 0)
    inks.paste(ink, (m + 2, m + 2))
    panel = Image.new("L", (w, h), 0)
    style = r.random()
    if style < 0.35:
        ImageDraw.Draw(panel).rectangle((2, 2, w - 3, h - 3), fill=255)
    elif style < 0.55:          # a frame line m px from the ink, as on a sign or a receipt's box
        ImageDraw.Draw(inks).rectangle((1, 1, w - 2, h - 2), outline=255, width=r.choice((1, 1, 2)))
    if r.random() < 0.5:
        angle = r.uniform(-4.0, 4.0)
        inks = inks.rotate(angle, resample=Image.BILINEAR, expand=True)
        panel = panel.rotate(angle, resample=Image.BILINEAR, expand=True)
    return np.asarray(panel, np.float32) / 255.0, np.asarray(inks, np.float32) / 255.0


def _colours(r: random.Random) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page, panel, ink) BGR colours; a quarter of the pages low contrast (ink 35-70 levels from its ground)."""
    base = np.array([r.randint(0, 255) for _ in range(3)], np.float32)
    light = r.random() < 0.6
    page = 255 - base * 0.25 if light else base * 0.35
    panel = np.clip(page + r.choice([-1, 1]) * r.uniform(20, 70), 0, 255).astype(np.float32)
    delta = r.uniform(35, 70) if r.random() < 0.25 else r.uniform(110, 220)
    ink = np.clip(page - delta if light else page + delta, 0, 255).astype(np.float32)
    return page.astype(np.float32), panel, ink


@functools.lru_cache(maxsize=4)
def _tables(fonts: tuple[str, ...]) -> list:
    """Pillow's built-in font and any font files given, at SIZES (loaded once)."""
    return load_fonts([], SIZES) + (load_fonts(list(fonts), SIZES) if fonts else [])


def render_edge_page(seed: int, index: int, size: int = 736, fonts: list[str] | None = None) -> np.ndarray:
    """Page `index` of `seed`: uint8 [size, size, 3] BGR."""
    r = random.Random(f"edge-pages:{seed}:{index}")
    tables = _tables(tuple(str(f) for f in fonts or []))
    page_c, panel_c, ink_c = _colours(r)
    img = np.empty((size, size, 3), np.float32)
    img[...] = page_c
    y = r.randint(2, 12)
    while y < size - 12:
        fs = r.choice(SIZES)
        font = r.choice(tables)[fs]
        x, row = r.randint(2, 14), 0
        while x < size - 20:
            pm, im = _patch(r, edge_text(r), font, fs)
            h, w = pm.shape
            if x + w > size - 2 or y + h > size - 2:
                break
            for mask, colour in ((pm, panel_c), (im, ink_c)):
                region = img[y:y + h, x:x + w]
                region += (colour - region) * mask[..., None]
            x += w + r.randint(3, 28)
            row = max(row, h)
        y += max(int(row * r.uniform(0.85, 1.15)), fs) + r.randint(0, 4)     # dense: lines nearly touch
    return _finish(r, img, size)


def _finish(r: random.Random, img: np.ndarray, size: int) -> np.ndarray:
    """A page tilt of up to 2 degrees, blur on a third of the pages, sensor noise."""
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    if r.random() < 0.6:
        fill = tuple(int(v) for v in img[0, 0])
        pil = pil.rotate(r.uniform(-2.0, 2.0), resample=Image.BILINEAR, fillcolor=fill)
    if r.random() < 0.33:
        pil = pil.filter(ImageFilter.GaussianBlur(radius=r.uniform(0.3, 0.9)))
    out = np.asarray(pil, np.float32)
    rng = np.random.default_rng(r.randrange(2 ** 32))
    out += rng.standard_normal(out.shape, dtype=np.float32) * r.uniform(0.0, 6.0)
    return np.clip(out, 0, 255).astype(np.uint8)


def installed_fonts() -> list[str]:
    """FONT_FILES that exist here (the pages of a seed depend on them: the judges record which were drawn)."""
    from pathlib import Path

    return [f for f in FONT_FILES if Path(f).is_file()]


def render_edge_pages(n: int, seed: int = DEFAULT_SEED, size: int = 736,
                      fonts: list[str] | None = None) -> list[np.ndarray]:
    """n tuning pages (render_edge_page 0..n-1 of seed)."""
    return [render_edge_page(seed, i, size, fonts) for i in range(n)]
