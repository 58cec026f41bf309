"""Built-in task 2: invoice text-line recognition with a CTC-trained CRNN.

Data: synthetic invoice lines (pipeline/data/textlines.py), a user's PaddleOCR label file
(pipeline/data/labelfile.py) or a folder of unlabelled line images. Labels are int64 [N, max_len],
class = charset index + 1, padded with -1; class 0 is the CTC blank. Outputs are logits [N, T, num_classes],
or probabilities (PaddleOCR's exported recognizers end in softmax): the loss then works on log-probabilities
(see `log_probs`) and the gates compare probabilities (pipeline/core/gates.py parity_limits).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.data.labelfile import load_charset, load_label_file, text_limits
from pipeline.data.textlines import DEFAULT_CHARSET, drawable_chars, load_or_render
from pipeline.core.errors import ConfigError, DataError
from pipeline.ocr.text_metrics import (char_accuracy, ctc_greedy_decode, decode_indices, encode_labels,
                            seq_accuracy)
from pipeline.tasks.base import Datasets, Split, Task, has_labels, unlabelled

_SOURCES = ("synthetic", "folder", "pages", "images")
# CTC on probabilities takes log(max(p, floor)): a class below the floor is out of the race either way
PROB_FLOOR = 1e-6


def log_probs(outputs: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(np.asarray(outputs, dtype=np.float32), PROB_FLOOR))


def charset_of(cfg: dict) -> str:
    """The charset file (or the built-in one), plus PaddleOCR's appended space with data.use_space_char
    (CTCLabelDecode: blank at 0, dictionary, then " ")."""
    charset = load_charset(cfg["charset"], **text_limits(cfg)) if cfg.get("charset") else DEFAULT_CHARSET
    if cfg.get("use_space_char") and " " not in charset:
        charset += " "
    return charset


def data_spec(cfg: dict) -> dict:
    """How data sets are fitted: the serving spec, but at a fixed width (arrays of one shape)."""
    ppocr = cfg.get("preprocess") == "ppocr"
    return {"height": int(cfg["height"]), "width": int(cfg["width"]),
            "resize": "ppocr_rec" if ppocr else "pad_right", "color": "bgr" if ppocr else "gray"}


def _check_geometry(cfg: dict) -> None:
    # Only what holds for any model; time steps per width are a fact of the model, checked on its
    # first output (check_output_shape): the CRNN keeps width/4, PP-OCRv3/SVTR keep width/8.
    height, width, max_len = int(cfg["height"]), int(cfg["width"]), int(cfg["max_len"])
    if height < 8 or width < 8:
        raise ConfigError(f"data.height and data.width must be >= 8, got {height}x{width}")
    if max_len < 1:
        raise ConfigError(f"data.max_len must be >= 1, got {max_len}")


def _drawable_charset(cfg: dict, charset: str, split: str) -> str:
    """data.train_drawable_only / data.val_drawable_only: that split's rendered lines drawn only from the characters
    every font can draw (a line with a missing glyph shows a box, not its label: noise to train on, and a line no
    model can read to judge on). Off, the split keeps the whole charset (the same lines as a run without the key)."""
    key = f"{split}_drawable_only"
    if not cfg.get(key):
        return charset
    fonts = list(cfg.get("fonts") or [])
    drawable = drawable_chars(charset, fonts)
    if not drawable.strip():
        raise DataError(f"data.{key}: no character of the charset ({len(charset)}) can be drawn by "
                        f"{fonts or 'the built-in font'}", hint="add a font that covers the charset to data.fonts")
    return drawable


def _split_fraction(images: np.ndarray, labels: list[str], fraction: float,
                    seed: int) -> tuple[tuple[np.ndarray, list[str]], tuple[np.ndarray, list[str]]]:
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be between 0 and 1 (exclusive), got {fraction}",
                          hint="or give a separate validation label file in data.val_path")
    n_val = int(round(len(labels) * fraction))
    if n_val < 1 or n_val >= len(labels):
        raise DataError(f"{len(labels)} samples cannot be split with val_fraction={fraction} "
                        "into non-empty train and validation sets",
                        hint="add samples, change data.val_fraction, or set data.val_path")
    order = np.random.default_rng(seed).permutation(len(labels))   # seeded: same split every run
    val_idx, train_idx = order[:n_val], order[n_val:]
    pick = (lambda idx: (images[idx], [labels[i] for i in idx]))
    return pick(train_idx), pick(val_idx)


def _info(cfg: dict, charset: str, source: str) -> dict[str, Any]:
    return {"charset": charset, "max_len": int(cfg["max_len"]), "source": source, "height": int(cfg["height"]),
            "width": int(cfg["width"]), "channels": int(cfg.get("channels", 1)), "num_classes": len(charset) + 1,
            "use_space_char": bool(cfg.get("use_space_char"))}


def _color_ref(cfg: dict) -> bool:
    return data_spec(cfg)["color"] == "bgr"


def _like(images: np.ndarray, color: bool) -> np.ndarray:
    """Rendered lines are grey [N, H, W]; a colour (bgr) model gets them as RGB [N, H, W, 3]."""
    if color and images.ndim == 3:
        return np.repeat(images[..., None], 3, axis=3)
    return images


def _unlabelled_lines(cfg: dict, charset: str) -> Datasets:
    """data.source=images: line images without text. Parity gates need no labels; metric gates say so.
    Nothing is trained on them: the same images serve as INT8 calibration set unless data.val_path names
    a second folder for validation."""
    from pipeline.data.imagefolder import load_unlabelled

    if not cfg.get("path"):
        raise ConfigError("data.source is 'images' but data.path (a folder of line images) is empty",
                          hint="set data.path=/path/to/line/images")
    spec = data_spec(cfg)
    images, skipped = load_unlabelled(cfg["path"], spec, cfg["on_bad_sample"])
    vi, vskip = load_unlabelled(cfg["val_path"], spec, cfg["on_bad_sample"]) if cfg.get("val_path") else (images, 0)
    return Datasets(train=Split(images, unlabelled(len(images)), skipped), val=Split(vi, unlabelled(len(vi)), vskip),
                    info=_info(cfg, charset, "images"))


class RecognitionTask(Task):
    name = "recognition"
    primary_metric = "seq_accuracy"
    output_layout = "[N, T, classes]"   # rank checked with one forward pass before training

    def __init__(self, post: dict | None = None):
        # "probabilities": the model ends in softmax (PaddleOCR exports); detected on its first output
        self.outputs = (post or {}).get("outputs", "logits")

    # ------------------------------------------------------------------ data
    def load_data(self, data_cfg: dict, seed: int) -> Datasets:
        cfg = data_cfg
        _check_geometry(cfg)
        height, width, max_len = int(cfg["height"]), int(cfg["width"]), int(cfg["max_len"])
        charset = charset_of(cfg)
        source = cfg["source"]
        skipped = {"train": 0, "val": 0}
        if source == "synthetic":
            common = dict(height=height, width=width, max_len=max_len, fonts=list(cfg.get("fonts") or []),
                          cache_dir=cfg.get("cache_dir"), charset=charset, resize=data_spec(cfg)["resize"])
            # different seeds: validation lines are never copies of training lines
            train = load_or_render(int(cfg["num_train"]), seed,
                                   **{**common, "charset": _drawable_charset(cfg, charset, "train")})
            val = load_or_render(int(cfg["num_val"]), seed + 1, **{**common, "charset": _drawable_charset(cfg, charset, "val")})
        elif drawn := [k for k in ("train_drawable_only", "val_drawable_only") if cfg.get(k)]:
            raise ConfigError(f"data.{drawn[0]} applies to rendered lines (data.source synthetic), not to "
                              f"data.source {source}", hint=f"set data.{drawn[0]}=false")
        elif source == "pages":          # crops of synthetic invoice pages: what the OCR system feeds
            from pipeline.data.page_crops import load_crops

            page = int(cfg.get("page_size", 320))
            common = dict(page_h=page, page_w=page, height=height, width=width, max_len=max_len,
                          fonts=list(cfg.get("fonts") or []), charset=charset, cache_dir=cfg.get("cache_dir"))
            # ~14 lines per page; different seeds keep validation pages out of training
            ti, tl = load_crops(int(cfg["num_train"]) // 12 + 1, seed, **common)
            vi, vl = load_crops(int(cfg["num_val"]) // 12 + 1, seed + 1, **common)
            train = (ti[:int(cfg["num_train"])], tl[:int(cfg["num_train"])])
            val = (vi[:int(cfg["num_val"])], vl[:int(cfg["num_val"])])
        elif source == "folder":
            if not cfg.get("path"):
                raise ConfigError("data.source is 'folder' but data.path (the label file) is empty")
            read = dict(charset=charset, height=height, width=width, on_bad=cfg["on_bad_sample"],
                        max_len=max_len, spec=data_spec(cfg), limits=text_limits(cfg))
            images, labels, skipped["train"] = load_label_file(cfg["path"], **read)
            if cfg.get("val_path"):
                train = (images, labels)
                vi, vl, skipped["val"] = load_label_file(cfg["val_path"], **read)
                val = (vi, vl)
            else:
                train, val = _split_fraction(images, labels, float(cfg["val_fraction"]), seed)
        elif source == "images":
            return _unlabelled_lines(cfg, charset)
        else:
            raise ConfigError(f"data.source must be one of {_SOURCES} for recognition, got {source!r}")
        color = _color_ref(cfg)
        train, val = (_like(train[0], color), train[1]), (_like(val[0], color), val[1])
        if source != "folder" and cfg.get("val_path"):      # real labelled lines next to the rendered ones
            vi, vl, skipped["val"] = load_label_file(cfg["val_path"], charset=charset, height=height, width=width,
                                                     on_bad=cfg["on_bad_sample"], max_len=max_len, spec=data_spec(cfg),
                                                     limits=text_limits(cfg))
            val = (np.concatenate([vi, val[0]]), [*vl, *val[1]])
        if len(train[1]) == 0 or len(val[1]) == 0:
            raise DataError(f"recognition needs non-empty train and validation sets, got "
                            f"{len(train[1])} and {len(val[1])} lines",
                            hint="raise data.num_train / data.num_val")
        info = _info(cfg, charset, source)
        return Datasets(
            train=Split(train[0], encode_labels(train[1], charset, max_len), skipped["train"]),
            val=Split(val[0], encode_labels(val[1], charset, max_len), skipped["val"]),
            info=info)

    # ------------------------------------------------------------------ model
    def build_model(self, model_cfg: dict, info: dict):
        from pipeline.models.registry import build_model   # lazy: data-only users need not import paddle

        # a user's "package.module:callable" must return logits [N, T, num_classes]; T comes from
        # the model (check_output_shape), not from an assumed downsampling factor
        return build_model(self.name, model_cfg.get("name"), dict(model_cfg.get("args") or {}),
                           {"num_classes": len(info["charset"]) + 1,        # + the CTC blank
                            "in_channels": info.get("channels", 1), "height": info.get("height", 32)})

    def check_output_shape(self, shape: list[int], info: dict) -> None:
        """The model's own output on one sample tells T; CTC needs 2·max_len − 1 steps in the worst
        case (a blank between repeated characters), else some labels are unlearnable (inf loss)."""
        classes, width, max_len = len(info["charset"]) + 1, int(info["width"]), int(info["max_len"])
        if len(shape) != 3 or shape[2] != classes:
            raise ConfigError(f"recognition models must output [N, T, {classes}] (charset of {classes - 1} + "
                              f"CTC blank), this one outputs {list(shape)}", hint=_classes_hint(shape, info))
        steps, need = int(shape[1]), 2 * max_len - 1
        if steps < need:
            per = width / max(steps, 1)
            raise ConfigError(f"data.width={width} gives {steps} CTC time steps with this model "
                              f"(it keeps 1 step per {per:g} pixels), too few for data.max_len={max_len} "
                              f"(need >= {need})",
                              hint=f"raise data.width to at least {int(per * need + 0.999)} or lower data.max_len")

    def loss(self, logits, labels):
        import paddle
        import paddle.nn.functional as F

        if self.outputs == "probabilities":      # warpctc applies softmax itself: softmax(log p) = p
            logits = paddle.log(paddle.clip(paddle.cast(logits, "float32"), min=PROB_FLOOR))

        # CTC stays FP32 even under AMP: its forward/backward run log-sum-exp recursions over
        # T steps; in fp16 the per-step probabilities underflow to 0 (loss = inf) and the
        # exponentials overflow, so the cast is not optional.
        logits = paddle.cast(logits, "float32")
        n, t = logits.shape[0], logits.shape[1]
        label_lengths = paddle.sum(paddle.cast(labels >= 0, "int64"), axis=1)
        # padding (-1) is ignored past label_lengths, but warpctc reads it as a class id: use 0
        targets = paddle.cast(paddle.clip(labels, min=0), "int32")
        input_lengths = paddle.full([n], t, dtype="int64")
        # raw logits: paddle's warpctc applies the softmax itself; input must be [T, N, C]
        return F.ctc_loss(paddle.transpose(logits, [1, 0, 2]), targets, input_lengths, label_lengths,
                          blank=0, reduction="mean")

    # ------------------------------------------------------------------ numpy side
    def metrics(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
        if not has_labels(labels):       # no ground truth: say so (None), never invent a number
            return {"seq_accuracy": None, "char_accuracy": None}
        # compared as class-index tuples: no charset needed, and identical to comparing strings
        preds = [tuple(p) for p in ctc_greedy_decode(np.asarray(outputs))]
        gts = [tuple(int(v) for v in row if v >= 0) for row in np.asarray(labels)]
        return {"seq_accuracy": float(seq_accuracy(preds, gts)),
                "char_accuracy": float(char_accuracy(preds, gts))}

    def agreement(self, candidate: np.ndarray, reference: np.ndarray, band: float | None = None) -> tuple[str, float, float]:
        """(name, agreement, strict agreement): share of lines whose greedy-decoded text equals the reference's.
        With a band (the gate passes the reference's own noise, gates.reference_tie_band), a line also agrees when
        at every time step the candidate's class scores within the band of the reference's top class there."""
        c, r = np.asarray(candidate), np.asarray(reference)
        strict = np.array([tuple(x) == tuple(y) for x, y in zip(ctc_greedy_decode(c), ctc_greedy_decode(r))])
        if band is not None and len(c):
            picked = np.take_along_axis(r, c.argmax(axis=2)[..., None], axis=2)[..., 0]     # [N, T]
            strict_or_tie = strict | (picked >= r.max(axis=2) - band).all(axis=1)
        else:
            strict_or_tie = strict
        n = max(len(c), 1)
        return "text_agreement", float(strict_or_tie.sum() / n) if len(c) else 1.0, float(strict.sum() / n) if len(c) else 1.0

    def correct_lost(self, candidate: np.ndarray, reference: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
        """(lost, of): of the lines the reference reads exactly right, how many the candidate reads wrongly (what
        a user of the candidate loses; a wrong line changing into another wrong line loses nothing). (0, 0)
        without labels."""
        if not has_labels(labels):
            return 0, 0
        gts = [tuple(int(v) for v in row if v >= 0) for row in np.asarray(labels)]
        ref_ok = [tuple(p) == g for p, g in zip(ctc_greedy_decode(np.asarray(reference)), gts)]
        cand_ok = [tuple(p) == g for p, g in zip(ctc_greedy_decode(np.asarray(candidate)), gts)]
        return sum(r and not c for r, c in zip(ref_ok, cand_ok)), sum(ref_ok)

    def decode(self, outputs: np.ndarray, info: dict) -> list[str]:
        return decode_indices(ctc_greedy_decode(np.asarray(outputs)), info["charset"])

    def preprocess_spec(self, data_cfg: dict, info: dict) -> dict:
        spec = {**data_spec(data_cfg), "channels": int(data_cfg.get("channels", 1)), "mean": 0.5, "std": 0.5}
        if data_cfg.get("preprocess") == "ppocr":      # exported [N, 3, H, -1]: each line at its own width
            spec.update(channels=3, dynamic_width=True)
        return spec

    def postprocess_spec(self, info: dict) -> dict:
        return {"type": "ctc_greedy", "blank": 0, "charset": info["charset"], "outputs": self.outputs,
                "use_space_char": bool(info.get("use_space_char"))}


def _classes_hint(shape: list[int], info: dict) -> str:
    """PaddleOCR's dictionaries are one class short of their models: CTCLabelDecode appends a space."""
    if len(shape) == 3 and shape[2] == len(info["charset"]) + 2 and not info.get("use_space_char"):
        return ("the model has one class more than charset + blank: PaddleOCR appends a space to its dictionary "
                "(use_space_char); set data.use_space_char=true")
    return "check model.name / the model's head size, data.charset and data.use_space_char"


def labels_to_strings(labels: np.ndarray, charset: str) -> list[str]:
    """int64 [N, L] (-1 padded) → strings; handy for reports and tests."""
    return decode_indices(labels, charset)


__all__ = ["RecognitionTask", "labels_to_strings"]
