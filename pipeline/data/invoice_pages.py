"""Synthetic invoice pages for the built-in detection task and the OCR system.

A page holds a header, key/value fields (invoice number, date, total), a ruled table of item
rows and noise; each text item is one ground-truth quadrilateral (clockwise from top-left).
The whole page is slightly rotated, as a scanned sheet is. Text comes from the recognition
task's generator (pipeline/data/textlines.py), so the two models of the OCR system see the
same kind of strings. Deterministic by seed and cached in .cache/data keyed by every parameter.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageDraw

from pipeline.core.artifacts import ordinary_mode
from pipeline.core.errors import DataError
from pipeline.data.textlines import DEFAULT_CHARSET, load_fonts, random_text

RENDER_VERSION = 3
FIELDS = ("invoice_no", "date", "amount")
# Field keys per script: the default charset has no space, so keys are single words.
KEYS_LATIN = {"invoice_no": "INVOICE:", "date": "DATE:", "amount": "TOTAL:"}
KEYS_CJK = {"invoice_no": "发票号码:", "date": "开票日期:", "amount": "合计:"}


@dataclass
class Page:
    image: np.ndarray            # uint8 [H, W]
    quads: np.ndarray            # float32 [K, 4, 2]
    texts: list[str]
    fields: dict[str, str]       # field name → value text


def keys_for(charset: str) -> dict[str, str]:
    """CJK keys when the charset can spell them (a Chinese dictionary), Latin keys otherwise."""
    return KEYS_CJK if all(c in charset for k in KEYS_CJK.values() for c in k) else KEYS_LATIN


class _Painter:
    """Draws text items on a page, remembering each item's box (the ground truth)."""

    def __init__(self, draw: ImageDraw.ImageDraw, fonts: dict, r: random.Random, width: int, height: int):
        self.draw, self.fonts, self.r, self.w, self.h = draw, fonts, r, width, height
        self.boxes: list[tuple[float, float, float, float]] = []
        self.texts: list[str] = []

    def fits(self, x: float, y: float, text: str, size: int) -> bool:
        l, t, rr, b = self.draw.textbbox((x, y), text, font=self.fonts[size])
        return rr < self.w - 4 and b < self.h - 4

    def text(self, x: float, y: float, text: str, size: int, ink: int) -> tuple[float, float, float, float]:
        font = self.fonts[size]
        self.draw.text((x, y), text, fill=ink, font=font)
        l, t, rr, b = self.draw.textbbox((x, y), text, font=font)
        box = (l - 1.5, t - 1.5, rr + 1.5, b + 1.5)     # a thin margin, like hand-made labels
        self.boxes.append(box)
        self.texts.append(text)
        return box

    def width(self, text: str, size: int) -> float:
        l, _, rr, _ = self.draw.textbbox((0, 0), text, font=self.fonts[size])
        return rr - l


def _cjk_word(r: random.Random, charset: str, k: int) -> str:
    cjk = [c for c in charset if "\u4e00" <= c <= "\u9fff"]
    return "".join(r.choice(cjk) for _ in range(k)) if cjk else ""


def _layout(p: _Painter, r: random.Random, charset: str, max_len: int, sizes: range) -> dict[str, str]:
    """Header, fields, ruled table, total; returns the field values."""
    keys = keys_for(charset)
    margin = r.randint(6, 16)
    ink = r.randint(0, 70)
    y = float(r.randint(4, 12))
    big = r.choice([s for s in sizes if s >= sizes[len(sizes) // 2]])
    header = (_cjk_word(r, charset, r.randint(3, 8)) if keys is KEYS_CJK else
              "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(r.randint(4, 10))))
    hx = r.uniform(margin, max(margin, p.w / 2 - p.width(header, big) / 2))
    y = p.text(hx, y, header, big, ink)[3] + r.uniform(6, 12)
    values = {"invoice_no": lambda: random_text_of(r, "invoice_no", max_len, charset),
              "date": lambda: random_text_of(r, "date", max_len, charset),
              "amount": lambda: random_text_of(r, "amount", max_len, charset)}
    fields: dict[str, str] = {}
    order = ["invoice_no", "date"]
    r.shuffle(order)
    for name in order:
        size = r.choice(sizes)
        key, value = keys[name], values[name]()
        vx = margin + p.width(key, size) + r.uniform(1.2, 3.0) * size
        if not p.fits(vx, y, value, size):
            continue
        box = p.text(margin, y, key, size, ink)
        p.text(vx, y, value, size, ink)
        fields[name] = value
        y = box[3] + r.uniform(5, 12)
    y = _table(p, r, charset, max_len, sizes, margin, y, ink)
    size = r.choice(sizes)
    amount = values["amount"]()
    key = keys["amount"]
    ax = p.w - margin - p.width(amount, size)
    kx = ax - p.width(key, size) - r.uniform(1.2, 2.5) * size
    if kx > margin and p.fits(ax, y, amount, size):
        p.text(kx, y, key, size, ink)
        p.text(ax, y, amount, size, ink)
        fields["amount"] = amount
    return fields


def random_text_of(r: random.Random, kind: str, max_len: int, charset: str) -> str:
    """A value of one field kind, via the recognition generator (redrawn until it is that kind)."""
    from pipeline.data import textlines

    maker = {"invoice_no": textlines._invoice_no, "date": textlines._date, "amount": textlines._amount}[kind]
    for _ in range(20):        # redraw rather than cut: "5,399,610." is no amount
        text = "".join(c for c in maker(r) if c in charset)
        if 0 < len(text) <= max_len:
            return text
    return random_text(r, max_len, charset)


def _table(p: _Painter, r: random.Random, charset: str, max_len: int, sizes: range, margin: int,
           y: float, ink: int) -> float:
    """Item rows between horizontal rules; columns: code, quantity, amount."""
    size = r.choice(sizes)
    row_h = size * 1.25 + r.uniform(8, 14)
    rule = r.randint(90, 160)
    rows = r.randint(2, 5)
    cols = [margin + 2, margin + 2 + p.w * r.uniform(0.42, 0.5), p.w - margin - 2]
    p.draw.line([(margin, y), (p.w - margin, y)], fill=rule, width=1)
    for _ in range(rows):
        if y + row_h > p.h - 2 * row_h:
            break
        ty = y + (row_h - size * 1.2) / 2
        cjk = keys_for(charset) is KEYS_CJK and r.random() < 0.6      # item names on Chinese invoices
        code = _cjk_word(r, charset, r.randint(2, 6)) if cjk else random_text(r, min(max_len, 10), charset)
        qty = str(r.randint(1, 999))
        amount = random_text_of(r, "amount", min(max_len, 10), charset)
        if cols[0] + p.width(code, size) < cols[1] - size:
            p.text(cols[0], ty, code, size, ink)
        p.text(cols[1], ty, qty, size, ink)
        ax = cols[2] - p.width(amount, size)
        if ax > cols[1] + p.width(qty, size) + size:
            p.text(ax, ty, amount, size, ink)
        y += row_h
        p.draw.line([(margin, y), (p.w - margin, y)], fill=rule, width=1)
    if r.random() < 0.5:      # vertical rules between the columns
        top = y - rows * row_h
        x = cols[1] - r.uniform(4, 8)
        p.draw.line([(x, top), (x, y)], fill=rule, width=1)
    return y + r.uniform(6, 12)


def _rotate(img: np.ndarray, quads: np.ndarray, angle: float, bg: int) -> tuple[np.ndarray, np.ndarray]:
    h, w = img.shape
    m = cv2.getRotationMatrix2D((w / 2, h / 2), angle, 1.0)
    out = cv2.warpAffine(img, m, (w, h), flags=cv2.INTER_LINEAR, borderValue=int(bg))
    pts = np.concatenate([quads.reshape(-1, 2), np.ones((quads.size // 2, 1))], axis=1) @ m.T
    return out, pts.reshape(quads.shape).astype(np.float32)


def render_page(r: random.Random, rng: np.random.Generator, height: int, width: int, fonts: list[dict],
                charset: str, max_len: int, sizes: range, max_angle: float = 3.0) -> Page:
    bg = r.randint(205, 255)
    img = Image.new("L", (width, height), bg)
    painter = _Painter(ImageDraw.Draw(img), r.choice(fonts), r, width, height)
    fields = _layout(painter, r, charset, max_len, sizes)
    quads = np.array([[[a, b], [c, b], [c, d], [a, d]] for a, b, c, d in painter.boxes], np.float32).reshape(-1, 4, 2)
    arr, quads = _rotate(np.asarray(img), quads, r.uniform(-max_angle, max_angle), bg)
    quads = np.clip(quads, 0, [width - 1, height - 1]).astype(np.float32)     # a corner may rotate off the page
    if r.random() < 0.4:
        arr = cv2.GaussianBlur(arr, (3, 3), r.uniform(0.3, 0.8))
    sigma = rng.uniform(0, 8) if r.random() < 0.7 else 0.0
    noisy = arr.astype(np.float32) + rng.standard_normal(arr.shape, dtype=np.float32) * sigma
    # specks: scanner dust the detector must not call text
    for _ in range(r.randint(0, 6)):
        cy, cx = r.randrange(height), r.randrange(width)
        noisy[max(0, cy - 1):cy + 1, max(0, cx - 1):cx + 1] = r.randint(0, 120)
    return Page(np.clip(noisy, 0, 255).astype(np.uint8), quads, painter.texts, fields)


def render_pages(n: int, seed: int, height: int, width: int, fonts: list[str] | None = None,
                 charset: str = DEFAULT_CHARSET, max_len: int = 16,
                 sizes: tuple[int, int] = (16, 24)) -> list[Page]:
    # font sizes: below ~16 px, ',' '.' ':' shrink to 1-2 pixels on a 320 px page and crops lose them
    if n < 0 or height < 64 or width < 64:
        raise DataError(f"cannot render {n} pages of {height}x{width} (pages need at least 64x64 pixels)")
    r, rng = random.Random(seed), np.random.default_rng(seed)
    size_range = range(sizes[0], sizes[1] + 1)
    tables = load_fonts(list(fonts or []), size_range)
    return [render_page(r, rng, height, width, tables, charset, max_len, size_range) for _ in range(n)]


# ----------------------------------------------------------------------------- packing + cache
def pack_quads(quads: list[np.ndarray], max_boxes: int, ignore: list[np.ndarray] | None = None) -> np.ndarray:
    """Per-page quads → float32 [N, max_boxes, 4, 2], padded with -1 (boxes are clipped to the page,
    so an all -1 row is never a real box). ignore: per page, True for "###" boxes (PaddleOCR: don't care),
    stored as -(q + 2), all <= -2, so one array still carries everything."""
    out = np.full((len(quads), max_boxes, 4, 2), -1.0, dtype=np.float32)
    for i, q in enumerate(quads):
        if len(q) > max_boxes:
            raise DataError(f"page {i} has {len(q)} text boxes, more than data.max_boxes={max_boxes}",
                            hint="raise data.max_boxes")
        q = np.asarray(q, np.float32).reshape(-1, 4, 2)
        if ignore is not None and len(q):
            q = np.where(np.asarray(ignore[i], bool)[:, None, None], -(q + 2), q)
        out[i, :len(q)] = q
    return out


def unpack_with_ignore(packed: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per page (all quads, bool "###" ignore flag per quad)."""
    out = []
    for p in np.asarray(packed):
        p = p[~(p == -1).all(axis=(1, 2))]
        ign = (p <= -2).all(axis=(1, 2))
        out.append((np.where(ign[:, None, None], -p - 2, p).astype(np.float32), ign))
    return out


def unpack_quads(packed: np.ndarray) -> list[np.ndarray]:
    """Per page the quads that count ("###" boxes left out)."""
    return [q[~ign] for q, ign in unpack_with_ignore(packed)]


def _cache_path(cache_dir: str | os.PathLike, params: dict, fonts: list[str]) -> Path:
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for f in fonts:
        try:
            h.update(Path(f).read_bytes())
        except OSError as exc:
            raise DataError(f"font file {f} cannot be read: {exc}") from None
    return Path(cache_dir) / f"invoice-pages-{h.hexdigest()[:16]}.npz"


def load_or_render(n: int, seed: int, height: int, width: int, max_boxes: int, fonts: list[str] | None = None,
                   charset: str = DEFAULT_CHARSET, max_len: int = 16,
                   cache_dir: str | os.PathLike | None = None) -> dict:
    """{"images": uint8 [N,H,W], "quads": float32 [N,B,4,2], "texts": str [N,B], "fields": str [N,3]}."""
    fonts = [str(f) for f in (fonts or [])]
    params = {"n": n, "seed": seed, "height": height, "width": width, "max_boxes": max_boxes, "fonts": fonts,
              "charset": charset, "max_len": max_len, "version": RENDER_VERSION}
    target = _cache_path(cache_dir, params, fonts) if cache_dir else None
    if target is not None and target.is_file():
        try:
            with np.load(target, allow_pickle=False) as z:
                return {k: z[k] for k in ("images", "quads", "texts", "fields")}
        except (OSError, ValueError, KeyError):
            pass                                   # corrupt entry: re-render and overwrite
    pages = render_pages(n, seed, height, width, fonts, charset, max_len)
    texts = np.full((n, max_boxes), "", dtype=object)
    for i, pg in enumerate(pages):
        texts[i, :len(pg.texts)] = pg.texts[:max_boxes]
    data = {"images": np.stack([p.image for p in pages]) if pages else np.zeros((0, height, width), np.uint8),
            "quads": pack_quads([p.quads for p in pages], max_boxes),
            "texts": texts.astype(str),
            "fields": np.array([[p.fields.get(f, "") for f in FIELDS] for p in pages], dtype=str).reshape(n, 3)}
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".pages-", suffix=".tmp")
        try:
            ordinary_mode(fd)                # mkstemp makes 0600: a cache others may read too
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return data
