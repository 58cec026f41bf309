"""Classification: built-in rendered characters, or the user's image folder."""
from __future__ import annotations

import numpy as np

from pipeline.data import chars
from pipeline.core.errors import ConfigError, DataError
from pipeline.tasks.base import Datasets, Split, Task, has_labels, unlabelled


class ClassificationTask(Task):
    name = "classification"
    primary_metric = "accuracy"
    output_layout = "[N, classes]"      # rank checked with one forward pass before training

    def __init__(self, post: dict | None = None):
        # "probabilities": the model ends in softmax (PaddleOCR's cls); detected on its first output
        self.outputs = (post or {}).get("outputs", "logits")

    def load_data(self, data_cfg: dict, seed: int) -> Datasets:
        h, w = data_cfg["height"], data_cfg["width"]
        info = {"source": data_cfg["source"], "channels": data_cfg["channels"], "height": h, "width": w}
        if data_cfg["source"] == "synthetic":
            if h != w:
                raise ConfigError(f"synthetic characters are square: data.height ({h}) must equal data.width ({w})",
                                  hint=f"set data.width={h}, or use data.source=folder for other shapes")
            tr = chars.load_or_render(data_cfg["num_train"], seed, h, data_cfg["fonts"], data_cfg["cache_dir"])
            va = chars.load_or_render(data_cfg["num_val"], seed + 1, h, data_cfg["fonts"], data_cfg["cache_dir"])
            return Datasets(Split(*tr), Split(*va), {**info, "labels": chars.CLASSES})
        if data_cfg["source"] == "images":
            return self._unlabelled(data_cfg, info)
        from pipeline.data.imagefolder import load_image_folder
        if not data_cfg["path"]:
            raise ConfigError("data.source is 'folder' but data.path is empty", hint="set data.path=/path/to/images")
        images, labels, names, skipped = load_image_folder(data_cfg["path"], h, w, data_cfg["on_bad_sample"])
        info["labels"] = names
        if data_cfg["val_path"]:
            vi, vl, vnames, vskip = load_image_folder(data_cfg["val_path"], h, w, data_cfg["on_bad_sample"])
            if vnames != names:
                raise DataError(f"class folders differ between {data_cfg['path']} and {data_cfg['val_path']}")
            return Datasets(Split(images, labels, skipped), Split(vi, vl, vskip), info)
        order = np.random.default_rng(seed).permutation(len(labels))
        n_val = max(1, int(round(len(order) * data_cfg["val_fraction"])))
        va, tr = order[:n_val], order[n_val:]
        return Datasets(Split(images[tr], labels[tr], skipped), Split(images[va], labels[va]), info)

    def _unlabelled(self, data_cfg: dict, info: dict) -> Datasets:
        """data.source=images: a folder of images without classes, for validating an imported model (parity
        gates need no labels); the same images calibrate INT8 unless data.val_path names a second folder."""
        from pipeline.data.imagefolder import load_unlabelled

        if not data_cfg["path"]:
            raise ConfigError("data.source is 'images' but data.path is empty", hint="set data.path=/path/to/images")
        spec = self.preprocess_spec(data_cfg, info)
        images, skipped = load_unlabelled(data_cfg["path"], spec, data_cfg["on_bad_sample"])
        vi, vskip = load_unlabelled(data_cfg["val_path"], spec, data_cfg["on_bad_sample"]) if data_cfg["val_path"] \
            else (images, 0)
        return Datasets(Split(images, unlabelled(len(images)), skipped), Split(vi, unlabelled(len(vi)), vskip),
                        {**info, "labels": []})

    def build_model(self, model_cfg: dict, info: dict):
        from pipeline.models.registry import build_model
        h, w = info.get("height", 32), info.get("width", 32)
        return build_model(self.name, model_cfg["name"], dict(model_cfg["args"] or {}),
                           {"num_classes": len(info["labels"]), "in_channels": info.get("channels", 1),
                            "height": h, "width": w, "image_size": h})

    def loss(self, logits, labels):
        import paddle
        import paddle.nn.functional as F

        logits = logits.astype("float32")
        if self.outputs == "probabilities":      # softmax(log p) = p: no second softmax
            logits = paddle.log(paddle.clip(logits, min=1e-6))
        return F.cross_entropy(logits, labels)

    def metrics(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        if not has_labels(labels):          # no ground truth: say so (None), never invent a number
            return {"accuracy": None}
        pred = outputs.reshape(len(outputs), -1).argmax(axis=1)
        return {"accuracy": float((pred == labels).mean()) if len(labels) else 0.0}

    def agreement(self, candidate: np.ndarray, reference: np.ndarray, band: float | None = None) -> tuple[str, float, float]:
        """(name, agreement, strict agreement): share of samples whose predicted class equals the reference's.
        With a band (the gate passes the reference's own noise, gates.reference_tie_band), picking a class the
        reference scores within the band of its top class is a tie, not a disagreement."""
        a = candidate.reshape(len(candidate), -1)
        r = reference.reshape(len(reference), -1)
        pick = a.argmax(axis=1)
        strict = pick == r.argmax(axis=1)
        tie = r[np.arange(len(r)), pick] >= r.max(axis=1) - band if band is not None else strict
        n = max(len(a), 1)
        return "argmax_agreement", float((strict | tie).sum() / n) if len(a) else 1.0, float(strict.sum() / n) if len(a) else 1.0

    def decode(self, outputs: np.ndarray, info: dict) -> list:
        probs = outputs.reshape(len(outputs), -1).astype(np.float64)
        if self.outputs != "probabilities":      # a second softmax would flatten PaddleOCR's scores
            probs = np.exp(probs - probs.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
        idx = probs.argmax(axis=1)
        names = info.get("labels") or []              # an unlabelled import knows no class names
        return [{"label": names[i] if i < len(names) else str(i), "index": int(i), "score": float(probs[k, i])} for k, i in enumerate(idx)]

    def preprocess_spec(self, data_cfg: dict, info: dict) -> dict:
        return {"height": data_cfg["height"], "width": data_cfg["width"], "channels": data_cfg["channels"],
                "mean": 0.5, "std": 0.5, "resize": "stretch", "color": "L"}

    def postprocess_spec(self, info: dict) -> dict:
        return {"type": "softmax_argmax", "labels": list(info["labels"]), "outputs": self.outputs}
