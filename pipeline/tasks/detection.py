"""Built-in task 3: text detection on invoice pages with a DB detector.

Data: synthetic invoice pages (pipeline/data/invoice_pages.py) or a PaddleOCR detection label
file (pipeline/data/det_labels.py). Labels are quads float32 [N, data.max_boxes, 4, 2] in model
pixels, padded with -1. Outputs: probability map [N, 1, H, W]. Post-processing
(pipeline/ocr/db_post.py) turns maps into boxes for the metric, every engine and `serve`;
its parameters (config section `detection`) travel in info.json and infer_config.yaml.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.errors import ConfigError, DataError
from pipeline.ocr.db_post import DBParams, detect_batch
from pipeline.ocr.det_metric import detection_scores
from pipeline.tasks.base import Datasets, Split, Task

PRE_KEYS = ("resize", "limit_side_len", "limit_type", "mean", "std")


class DetectionTask(Task):
    name = "detection"
    primary_metric = "hmean"
    labels_are_classes = False        # quads, not class ids: the trainer's label-range check does not apply
    output_layout = "[N, 1, H, W]"    # probability map (eval); rank checked with one forward pass before training
    outputs = "probabilities"         # a sigmoid map: gates compare probabilities (pipeline/core/gates.py parity_limits)
    agreement_has_ties = False        # box agreement takes no tie band: the gate need not measure it twice

    def __init__(self, post: dict | None = None):
        post = dict(post or {})
        self.pre = {k: post[k] for k in PRE_KEYS if k in post}     # config section `detection` only
        self.params = DBParams.from_dict(post)
        self.iou = float(post.get("iou", 0.5))
        self.shrink_ratio = float(post.get("shrink_ratio", 0.4))

    # ------------------------------------------------------------------ data
    def load_data(self, data_cfg: dict, seed: int) -> Datasets:
        cfg = data_cfg
        h, w, max_boxes = int(cfg["height"]), int(cfg["width"]), int(cfg.get("max_boxes", 32))
        if h % 32 or w % 32:
            raise ConfigError(f"detection pages must be multiples of 32 pixels, got data.height={h} data.width={w}",
                              hint="e.g. data.height=320 data.width=320")
        skipped = [0, 0]
        if cfg["source"] == "synthetic":
            from pipeline.data.invoice_pages import load_or_render

            common = dict(height=h, width=w, max_boxes=max_boxes, fonts=list(cfg.get("fonts") or []),
                          cache_dir=cfg.get("cache_dir"), max_len=int(cfg["max_len"]), charset=self._charset(cfg))
            tr = load_or_render(int(cfg["num_train"]), seed, **common)
            va = load_or_render(int(cfg["num_val"]), seed + 1, **common)
            train, val = (tr["images"], tr["quads"]), (va["images"], va["quads"])
        elif cfg["source"] == "folder":
            from pipeline.data.det_labels import load_det_label_file

            if not cfg.get("path"):
                raise ConfigError("data.source is 'folder' but data.path (the detection label file) is empty")
            images, quads, _, skipped[0] = load_det_label_file(cfg["path"], h, w, max_boxes, cfg["on_bad_sample"])
            if cfg.get("val_path"):
                vi, vq, _, skipped[1] = load_det_label_file(cfg["val_path"], h, w, max_boxes, cfg["on_bad_sample"])
                train, val = (images, quads), (vi, vq)
            else:
                n_val = max(1, int(round(len(images) * float(cfg["val_fraction"]))))
                if n_val >= len(images):
                    raise DataError(f"{len(images)} pages cannot be split into train and validation",
                                    hint="add pages or set data.val_path")
                order = np.random.default_rng(seed).permutation(len(images))
                train = (images[order[n_val:]], quads[order[n_val:]])
                val = (images[order[:n_val]], quads[order[:n_val]])
        else:
            raise ConfigError(f"data.source must be synthetic or folder for detection, got {cfg['source']!r}")
        info: dict[str, Any] = {"source": cfg["source"], "height": h, "width": w, "max_boxes": max_boxes}
        return Datasets(Split(train[0], train[1], skipped[0]), Split(val[0], val[1], skipped[1]), info)

    @staticmethod
    def _charset(cfg: dict) -> str:
        from pipeline.data.labelfile import load_charset, text_limits
        from pipeline.data.textlines import DEFAULT_CHARSET

        return load_charset(cfg["charset"], **text_limits(cfg)) if cfg.get("charset") else DEFAULT_CHARSET

    # ------------------------------------------------------------------ model + loss
    def build_model(self, model_cfg: dict, info: dict):
        name, args = model_cfg.get("name"), dict(model_cfg.get("args") or {})
        if name == "dbnet":
            from pipeline.models.dbnet import DBNet

            args.setdefault("in_channels", int(info.get("channels", 1)))
            try:
                return DBNet(**args)
            except TypeError as exc:
                raise ConfigError(f"bad model.args for dbnet: {exc}",
                                  hint="valid: in_channels, channels, neck, head, k") from None
        if isinstance(name, str) and ":" in name:
            from pipeline.models.registry import build_user_model
            return build_user_model(name, args, {})
        raise ConfigError(f"model.name {name!r} is not a detection model",
                          hint="use model.name: dbnet, or 'package.module:callable' (train: [N,3,H,W] P/T/B maps, "
                               "eval: [N,1,H,W] probabilities)")

    def loss(self, maps, labels):
        from pipeline.ocr.db_loss import db_loss
        from pipeline.ocr.db_targets import batch_targets

        h, w = maps.shape[-2], maps.shape[-1]
        targets = batch_targets(labels.numpy(), h, w, shrink_ratio=self.shrink_ratio)
        return db_loss(maps, targets)

    # ------------------------------------------------------------------ numpy side
    def boxes(self, outputs: np.ndarray, out_sizes=None):
        return detect_batch(outputs, self.params, out_sizes)

    def metrics(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        from pipeline.data.invoice_pages import unpack_with_ignore

        preds = [q for q, _ in self.boxes(outputs)]
        gts = unpack_with_ignore(labels)
        return detection_scores(preds, [g for g, _ in gts], self.iou, [i for _, i in gts])

    def agreement(self, candidate: np.ndarray, reference: np.ndarray, band: float | None = None) -> tuple[str, float, float]:
        """(name, agreement, strict agreement): hmean of the candidate's boxes scored against the reference's
        boxes as ground truth (IoU >= detection.iou): 1.0 when both maps give the same boxes. No tie band."""
        got = [q for q, _ in self.boxes(candidate)]
        want = [q for q, _ in self.boxes(reference)]
        share = float(detection_scores(got, want, self.iou)["hmean"]) if len(candidate) else 1.0
        return "box_agreement", share, share

    def decode(self, outputs: np.ndarray, info: dict, sizes: list | None = None) -> list[dict]:
        """Boxes per image; sizes: the images' original (h, w), so boxes come back in their pixels."""
        res = detect_batch(outputs, DBParams.from_dict(info), sizes)
        return [{"boxes": np.round(q.astype(np.float64), 1).tolist(), "scores": np.round(s.astype(np.float64), 4).tolist()}
                for q, s in res]

    def preprocess_spec(self, data_cfg: dict, info: dict) -> dict:
        """stretch (gray, 0.5/0.5) or PaddleOCR's limit rule (BGR, per-channel mean/std); height/width are the
        size the gated validation pages have (with limit, a page already at multiples of 32 within the limit)."""
        size = {"height": int(data_cfg["height"]), "width": int(data_cfg["width"])}
        if self.pre.get("resize") == "limit":
            _check_limit_size(size["height"], size["width"], int(self.pre["limit_side_len"]), self.pre["limit_type"])
            return {**size, "resize": "limit", "limit_side_len": int(self.pre["limit_side_len"]),
                    "limit_type": self.pre["limit_type"], "channels": 3, "channel_order": "BGR",
                    "mean": [float(v) for v in self.pre["mean"]], "std": [float(v) for v in self.pre["std"]]}
        return {**size, "channels": int(data_cfg.get("channels", 1)), "mean": 0.5, "std": 0.5,
                "resize": "stretch", "color": "L"}

    def postprocess_spec(self, info: dict) -> dict:
        return {"type": "db", **self.params.to_dict(), "iou": self.iou, "shrink_ratio": self.shrink_ratio}


def _check_limit_size(h: int, w: int, limit: int, kind: str) -> None:
    """The gated validation pages are arrays of one size: the limit rule must keep that size, or HTTP /predict
    and the system (which apply the rule to each page) would feed the model another input than the gates."""
    from pipeline.ocr.ppocr import det_resize_shape

    got = det_resize_shape(h, w, limit, kind)
    if got != (h, w):
        raise ConfigError(f"detection.resize=limit (limit_side_len {limit}, limit_type {kind}) resizes the "
                          f"{h}x{w} validation pages to {got[0]}x{got[1]}",
                          hint="set data.height/data.width to a size the rule keeps (multiples of 32; for "
                               f"limit_type {kind}: {'no side above' if kind == 'max' else 'no side below'} {limit})")
