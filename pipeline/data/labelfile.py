"""Users' text-line data in PaddleOCR's recognition label format.

label file (UTF-8), one sample per line:
    crops/img_001.png<TAB>INV-2024-00871
    /abs/path/img_002.jpg<TAB>12/03/2024
Relative image paths are resolved against the label file's folder (not the working
directory), so a data folder can be moved as a whole.

charset file: one character per line (PaddleOCR's `character_dict_path`).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from pipeline.core.errors import DataError
from pipeline.data.imagefolder import check_on_bad, read_image

T = TypeVar("T")


MAX_BYTES = 256 << 20        # data.max_text_bytes / data.max_text_lines in configs/defaults.yaml
MAX_LINES = 5_000_000


def text_limits(cfg: dict) -> dict:
    """data.max_text_bytes / data.max_text_lines as keyword arguments of the readers below."""
    return {"max_bytes": int(cfg.get("max_text_bytes") or MAX_BYTES),
            "max_lines": int(cfg.get("max_text_lines") or MAX_LINES)}


def _read_text(path: Path, what: str, max_bytes: int = MAX_BYTES, max_lines: int = MAX_LINES) -> str:
    """The file's text, refused before reading when it is not a regular file (a FIFO would block for ever,
    /dev/zero never ends) or is over the limits."""
    key = "data.charset" if what.startswith("charset") else "data.path / data.val_path"
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{what} {path} is not a regular file (a FIFO, socket or device)",
                            hint=f"check {key}: give a text file")
        if st.st_size > max_bytes:
            raise DataError(f"{what} {path} is {st.st_size} bytes, over data.max_text_bytes={max_bytes}",
                            hint="raise data.max_text_bytes if the file is genuine")
        # utf-8-sig: a BOM written by Windows editors must not become part of the first path
        with open(path, "rb") as f:
            text = f.read(max_bytes + 1).decode("utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{what} {path} does not exist", hint=f"check {key}") from None
    except IsADirectoryError:
        raise DataError(f"{what} {path} is a folder, expected a text file", hint=f"check {key}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                        hint="re-save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"{what} {path} cannot be read: {exc}", hint=f"check {key} and its permissions") from None
    lines = text.count("\n") + 1
    if lines > max_lines:
        raise DataError(f"{what} {path} has {lines} lines, over data.max_text_lines={max_lines}",
                        hint="raise data.max_text_lines if the file is genuine")
    return text


def load_charset(path: str | os.PathLike, **limits) -> str:
    """One character per line → the charset string (order = class order, blank excluded).

    Only the line break is stripped, so a line holding a single space means the space
    character, as in PaddleOCR's dictionaries.
    """
    p = Path(path)
    chars: list[str] = []
    first_line: dict[str, int] = {}
    lines = _read_text(p, "charset file", **limits).split("\n")
    if lines and lines[-1] == "":
        lines.pop()    # the final newline ends the last line, it does not start an empty one
    for lineno, raw in enumerate(lines, 1):
        line = raw[:-1] if raw.endswith("\r") else raw
        if line == "":
            raise DataError(f"{p}:{lineno}: empty line in charset file",
                            hint="one character per line; remove blank lines")
        if len(line) != 1:
            raise DataError(f"{p}:{lineno}: {line!r} is {len(line)} characters, expected exactly one",
                            hint="one character per line, PaddleOCR style")
        if line in first_line:
            raise DataError(f"{p}:{lineno}: duplicate character {line!r} (first on line {first_line[line]})",
                            hint="each character may appear once; remove the duplicate")
        first_line[line] = lineno
        chars.append(line)
    if not chars:
        raise DataError(f"charset file {p} is empty", hint="write one character per line")
    return "".join(chars)


def resolve_image(rel: str, base: Path) -> Path:
    """A label file's image path: absolute, or relative to the label file's folder (PaddleOCR convention)."""
    img_path = Path(rel) if Path(rel).is_absolute() else base / rel
    if not img_path.is_file():
        raise ValueError(f"image {img_path} does not exist (relative paths are resolved against {base})")
    return img_path


def _check_line(line: str, charset: str, max_len: int | None) -> tuple[str, str]:
    """Return (image path, label) or raise ValueError with the reason and how to fix it."""
    if "\t" not in line:
        raise ValueError("no TAB between image path and label "
                         "(expected 'path<TAB>label'; spaces are not a separator)")
    rel, label = line.split("\t", 1)
    if not rel.strip():
        raise ValueError("empty image path before the TAB")
    if label == "":
        raise ValueError("empty label after the TAB (every image needs its text)")
    unknown = sorted({c for c in label if c not in charset})
    if unknown:
        raise ValueError(f"label {label!r} has characters not in the charset: {unknown} "
                         "(add them to data.charset or fix the label)")
    if max_len is not None and len(label) > max_len:
        raise ValueError(f"label {label!r} has {len(label)} characters, more than "
                         f"data.max_len={max_len} (raise max_len and the width, or shorten it)")
    return rel, label


def read_label_lines(path: Path, what: str, on_bad: str, parse: Callable[[str], T], *, unit: str,
                     line_format: str, limits: dict | None = None) -> tuple[list[T], int]:
    """Every non-blank line of a label file through parse(line) → (records, skipped).

    parse raises ValueError for a bad line: DataError naming `file:line`, or with on_bad="skip" the line
    is dropped and counted. Blank lines are ignored and not counted. No usable line is an error."""
    check_on_bad(on_bad)
    records: list[T] = []
    skipped = 0
    for lineno, raw in enumerate(_read_text(path, what, **(limits or {})).split("\n"), 1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        try:
            records.append(parse(line))
        except ValueError as exc:
            if on_bad == "error":
                raise DataError(f"{path}:{lineno}: {exc}",
                                hint="fix the line, or set data.on_bad_sample: skip to drop bad lines") from None
            skipped += 1
    if not records:
        raise DataError(f"{what} {path} has no usable {unit}" + (f" ({skipped} bad lines skipped)" if skipped else ""),
                        hint=f"each line is {line_format}")
    return records, skipped


def load_label_file(path: str | os.PathLike, charset: str, height: int, width: int,
                    on_bad: str = "error", max_len: int | None = None,
                    spec: dict | None = None, limits: dict | None = None) -> tuple[np.ndarray, list[str], int]:
    """Read a PaddleOCR rec label file → (uint8 [N, H, W], labels, skipped).

    Each bad line (missing TAB, empty label, unknown characters, too long, missing or
    unreadable image) raises DataError naming `file:line`, or with on_bad="skip" is
    dropped and counted (see read_label_lines).
    """
    p = Path(path)
    spec = spec or {"height": height, "width": width, "resize": "pad_right"}     # or the task's (e.g. PaddleOCR's)

    def parse(line: str) -> tuple[np.ndarray, str]:
        rel, label = _check_line(line, charset, max_len)
        try:
            return read_image(resolve_image(rel, p.parent), spec), label
        except DataError as exc:
            raise ValueError(exc.message) from None

    records, skipped = read_label_lines(p, "label file", on_bad, parse, unit="samples",
                                        line_format="'image_path<TAB>label'", limits=limits)
    return np.stack([r[0] for r in records]).astype(np.uint8), [r[1] for r in records], skipped
