"""What a PaddleOCR 3 export's `inference.yml` says about its pre- and post-processing, as this pipeline's config
keys: the import fills every key the user's config does not set from it (`fill`: a config with model.source: pir,
model.path and task is enough), checks the configured pre-processing against it (a mismatch is refused, naming the
key and the yml's value; post-processing thresholds and the resize rule are the export's defaults, free to tune),
and `python -m pipeline.models.pir_yml DIR` prints the keys.

The recognizer's dictionary (PostProcess.character_dict) becomes a charset file, one class a line. PP-OCRv5's has
10 entries of two code points (flag emoji such as U+1F1E9 U+1F1EA); the pipeline's charset holds one code point per
class, so each of those is written as a Supplementary Private Use Area placeholder (U+F0000 + i, listed in
`placeholders`): the class count and order stay the model's, and a flag reads as its placeholder.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.core.errors import ConfigError

PLACEHOLDER_BASE = 0xF0000


def read(folder: Path) -> dict:
    import yaml

    from pipeline.core import safe_yaml

    f = Path(folder) / "inference.yml"
    try:      # the shared reader: regular file, size, UTF-8, alias and depth limits, duplicate keys
        doc = safe_yaml.read(f, "model file") or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{f} is not readable YAML ({type(exc).__name__})",
                          hint="a PaddleOCR 3 export writes inference.yml beside inference.json") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{f}: expected a mapping at the top level", hint="a PaddleOCR 3 inference.yml")
    return doc


def _ops(doc: dict) -> dict:
    pre = doc.get("PreProcess") or {}
    if not isinstance(pre, dict):
        raise TypeError(f"PreProcess is a {type(pre).__name__}, not a mapping")
    ops = pre.get("transform_ops") or []
    if not isinstance(ops, list):
        raise TypeError("PreProcess.transform_ops is not a list")
    return {k: (v or {}) for op in ops if isinstance(op, dict) for k, v in op.items()}


def charset_lines(chars: list[str]) -> tuple[list[str], dict[str, str]]:
    """Dictionary entries -> one code point each (placeholders for longer entries), and placeholder -> entry."""
    lines, placeholders = [], {}
    for c in chars:
        if len(c) != 1:
            p = chr(PLACEHOLDER_BASE + len(placeholders))
            placeholders[p] = c
            c = p
        lines.append(c)
    return lines, placeholders


def hints(folder: Path) -> dict:
    """{dotted config key: value} the yml implies (det: detection.*, rec: data.*), plus 'dictionary' for rec.
    A value of the wrong shape or type is one ConfigError naming the file and the key; the values themselves are
    checked against the config schema where they are used (fill, validate)."""
    f = Path(folder) / "inference.yml"
    doc, out, where = read(folder), {}, ["PreProcess"]
    try:
        ops, post = _ops(doc), doc.get("PostProcess") or {}
        if not isinstance(post, dict):
            where[0] = "PostProcess"
            raise TypeError(f"a {type(post).__name__}, not a mapping")
        for key, value in _pairs(ops, post, where):
            out[key] = value
    except (KeyError, TypeError, ValueError, OverflowError, IndexError, AttributeError) as exc:
        raise ConfigError(f"{f}: {where[0]} is not what a PaddleOCR 3 export writes ({type(exc).__name__}: "
                          f"{str(exc)[:100]})", hint="fix or remove inference.yml, or set the keys in the config") \
            from None
    return out


def _pairs(ops: dict, post: dict, where: list):
    """(dotted key, value) the yml implies, one at a time; where[0] names the part being read (for the error)."""
    where[0] = "PreProcess.DetResizeForTest"
    if "DetResizeForTest" in ops:
        r = ops["DetResizeForTest"]
        side = r.get("resize_long") or r.get("limit_side_len")
        if side:
            yield "detection.limit_side_len", int(side)
            yield "detection.resize", "limit"                   # resize_long: the long side becomes it, up or down
            yield "detection.limit_type", "resize_long" if "resize_long" in r else r.get("limit_type", "min")
    where[0] = "PreProcess.NormalizeImage"
    norm = ops.get("NormalizeImage")
    if norm:
        yield "detection.mean", [float(v) for v in norm["mean"]]
        yield "detection.std", [float(v) for v in norm["std"]]
    where[0] = "PostProcess"
    if post.get("name") == "DBPostProcess":
        for k in ("thresh", "box_thresh", "unclip_ratio", "max_candidates"):
            if k in post:
                yield f"detection.{k}", post[k]
    where[0] = "PreProcess.RecResizeImg"
    if "RecResizeImg" in ops:
        shape = ops["RecResizeImg"]["image_shape"]
        if not isinstance(shape, list) or len(shape) != 3:
            raise ValueError(f"image_shape must be [channels, height, width], got {str(shape)[:40]}")
        c, h, w = (int(v) for v in shape)
        yield from (("data.channels", c), ("data.height", h), ("data.width", w), ("data.preprocess", "ppocr"))
    where[0] = "PostProcess"
    if post.get("name") == "CTCLabelDecode" and isinstance(post.get("character_dict"), list):
        yield "dictionary", [str(c) for c in post["character_dict"]]
        yield "data.use_space_char", True          # PaddleOCR's rec default: dictionary + space + blank classes


def validate(folder: Path, filled: dict) -> None:
    """Each value the yml filled in ({dotted key: value}), through its config key's schema (type, range, shape)
    and the bounds every number key has: a value the schema refuses is one ConfigError naming the key."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    from pipeline.core.config import Config, bounded_number

    for key, value in filled.items():
        sec, name = key.split(".", 1)
        field = Config.model_fields[sec].annotation.model_fields.get(name)
        try:
            if field is not None:
                TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
            bounded_number(name, value)
        except (ValidationError, ValueError) as exc:
            msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise ConfigError(f"{Path(folder) / 'inference.yml'} gives {key}={value!r}: {msg[:160]}",
                              hint=f"set {key} in the config (it then wins over inference.yml)") from None


# what the weights were trained with: a different value reads garbage. The resize rule and the DB thresholds are
# the export's defaults, a deployment's to tune (hints only).
BINDING = ("detection.mean", "detection.std", "data.channels", "data.height", "data.preprocess")


def mismatches(folder: Path, sections: dict) -> list[str]:
    """'key=X but inference.yml says Y' for each configured value of BINDING that the yml contradicts."""
    bad = []
    for key, want in hints(folder).items():
        if key not in BINDING:
            continue
        sec, name = key.split(".", 1)
        have = (sections.get(sec) or {}).get(name)
        same = [round(float(v), 6) for v in have] == [round(float(v), 6) for v in want] \
            if isinstance(want, list) and isinstance(have, list) else have == want
        if have is not None and not same:
            bad.append(f"{key}={have!r} but inference.yml says {want!r}")
    return bad


def fill(folder: Path, sections: dict, user_keys) -> dict:
    """Set in `sections` ({'data': {...}, 'detection': {...}}, dicts changed in place) every key the yml implies
    that the user's config did not set (user_keys: dotted keys; None = treat every key as set, fill nothing)
    -> {dotted key: value filled}. A detector's validation pages, when unset, get the yml's side length (a
    multiple of 32: a size its resize rule keeps). The dictionary is the caller's to write (a charset file)."""
    if user_keys is None:
        return {}
    filled = {}
    for key, value in hints(folder).items():
        if key == "dictionary" or key in user_keys:
            continue
        sec, name = key.split(".", 1)
        sections.setdefault(sec, {})[name] = value
        filled[key] = value
    side = filled.get("detection.limit_side_len")
    if side:
        page = max(32, min(int(side), 1 << 16) // 32 * 32)
        for name in ("height", "width"):
            if f"data.{name}" not in user_keys:
                sections.setdefault("data", {})[name] = filled[f"data.{name}"] = page
    validate(folder, filled)
    return filled


if __name__ == "__main__":
    for k, v in hints(Path(sys.argv[1])).items():
        print(f"{k}: {len(v)} characters" if k == "dictionary" else f"{k}: {v}")
