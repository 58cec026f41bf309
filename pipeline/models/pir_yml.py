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
    ops = (doc.get("PreProcess") or {}).get("transform_ops") or []
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
    """{dotted config key: value} the yml implies (det: detection.*, rec: data.*), plus 'dictionary' for rec."""
    doc = read(folder)
    ops, post = _ops(doc), doc.get("PostProcess") or {}
    out: dict = {}
    if "DetResizeForTest" in ops:
        r = ops["DetResizeForTest"]
        side = r.get("resize_long") or r.get("limit_side_len")
        if side:
            out.update({"detection.resize": "limit", "detection.limit_side_len": int(side),   # resize_long: the
                        "detection.limit_type": "resize_long" if "resize_long" in r    # long side becomes it,
                        else r.get("limit_type", "min")})                              # up or down (PaddleOCR)
    norm = ops.get("NormalizeImage")
    if norm:
        out.update({"detection.mean": [float(v) for v in norm["mean"]], "detection.std": [float(v) for v in norm["std"]]})
    if post.get("name") == "DBPostProcess":
        out.update({f"detection.{k}": post[k] for k in ("thresh", "box_thresh", "unclip_ratio", "max_candidates")
                    if k in post})
    if "RecResizeImg" in ops:
        c, h, w = ops["RecResizeImg"]["image_shape"]
        out.update({"data.channels": int(c), "data.height": int(h), "data.width": int(w), "data.preprocess": "ppocr"})
    if post.get("name") == "CTCLabelDecode" and isinstance(post.get("character_dict"), list):
        out["dictionary"] = [str(c) for c in post["character_dict"]]
        out["data.use_space_char"] = True          # PaddleOCR's rec default: dictionary + space + blank classes
    return out


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
        page = max(32, int(side) // 32 * 32)
        for name in ("height", "width"):
            if f"data.{name}" not in user_keys:
                sections["data"][name] = filled[f"data.{name}"] = page
    return filled


if __name__ == "__main__":
    for k, v in hints(Path(sys.argv[1])).items():
        print(f"{k}: {len(v)} characters" if k == "dictionary" else f"{k}: {v}")
