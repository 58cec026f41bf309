"""The OCR system stage's pages: synthetic invoice pages from a seed neither part trained or validated on, written
in what the recogniser reads."""
from __future__ import annotations


def page_charset(parts: dict, rec_cfg: dict) -> str:
    """What the unseen pages are written in: the recogniser's charset; for a dictionary far larger than the
    built-in invoice charset and no font of the part's own (PP-OCR's 6623 characters), the built-in invoice
    characters it holds (Pillow's default font draws no CJK)."""
    from pipeline.data.textlines import DEFAULT_CHARSET

    charset = rec_cfg["postprocess"]["charset"]
    if parts["detection"].data.fonts or len(charset) <= 4 * len(DEFAULT_CHARSET):
        return charset
    return "".join(c for c in DEFAULT_CHARSET if c in charset)


def eval_pages(cfg, det_cfg: dict, charset: str, parts: dict) -> dict:
    """cfg.system.pages invoice pages at the detector's input size, with their lines and fields."""
    from pipeline.data.invoice_pages import load_or_render

    d = parts["detection"].data
    pre = det_cfg["preprocess"]
    # a seed neither part trained or validated on (they use seed and seed + 1)
    return load_or_render(cfg.system.pages, cfg.seed + 7919, pre["height"], pre["width"],
                          max_boxes=64, fonts=list(d.fonts), charset=charset,
                          max_len=parts["recognition"].data.max_len, cache_dir=d.cache_dir)

