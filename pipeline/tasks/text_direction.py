"""Text direction: PP-OCR's 0/180 degree text-line classifier (PaddleOCR's cls, e.g. ch_ppocr_mobile_v2_cls).

A two-class classification task with PaddleOCR's cls preprocessing: the line keeps its aspect ratio at
height 48, is padded on the right to 192, 3 channels in BGR order, (x/255 - 0.5)/0.5 (predict_cls.py
resize_norm_img; data.preprocess: ppocr). Data: synthetic invoice lines, every other one upside down
(label 1 = "180"), or an image folder with one subfolder per class (0/, 180/). Outputs: [N, 2]
probabilities (the exported model ends in softmax) or logits. The OCR system uses such a bundle to turn crops
whose "180" score exceeds system.cls_thresh.
"""
from __future__ import annotations

import numpy as np

from pipeline.core.errors import ConfigError
from pipeline.tasks.base import Datasets, Split
from pipeline.tasks.classification import ClassificationTask

LABELS = ["0", "180"]           # PaddleOCR's label_list


class TextDirectionTask(ClassificationTask):
    name = "text_direction"

    def load_data(self, data_cfg: dict, seed: int) -> Datasets:
        if data_cfg["source"] != "synthetic":
            return super().load_data(data_cfg, seed)
        from pipeline.data.textlines import DEFAULT_CHARSET, load_or_render

        common = dict(height=int(data_cfg["height"]), width=int(data_cfg["width"]), max_len=int(data_cfg["max_len"]),
                      fonts=list(data_cfg.get("fonts") or []), cache_dir=data_cfg.get("cache_dir"),
                      charset=DEFAULT_CHARSET, resize=self._resize(data_cfg), flip_odd=True)
        splits = []
        for n, s in ((int(data_cfg["num_train"]), seed), (int(data_cfg["num_val"]), seed + 1)):
            images, _ = load_or_render(n, s, **common)
            images = np.repeat(images[..., None], 3, axis=3) if self._color(data_cfg) else images
            splits.append(Split(images, (np.arange(n) % 2).astype(np.int64)))
        info = {"source": "synthetic", "channels": int(data_cfg["channels"]), "height": int(data_cfg["height"]),
                "width": int(data_cfg["width"]), "labels": LABELS}
        return Datasets(splits[0], splits[1], info)

    @staticmethod
    def _color(data_cfg: dict) -> bool:
        return data_cfg.get("preprocess") == "ppocr"

    @staticmethod
    def _resize(data_cfg: dict) -> str:
        return "ppocr_rec" if data_cfg.get("preprocess") == "ppocr" else "pad_right"

    def preprocess_spec(self, data_cfg: dict, info: dict) -> dict:
        if self._color(data_cfg) and int(data_cfg["channels"]) != 3:
            raise ConfigError("data.preprocess=ppocr needs data.channels=3 (PaddleOCR's cls takes BGR lines)")
        return {"height": int(data_cfg["height"]), "width": int(data_cfg["width"]), "channels": int(data_cfg["channels"]),
                "mean": 0.5, "std": 0.5, "resize": self._resize(data_cfg),
                "color": "bgr" if self._color(data_cfg) else "gray"}

    def postprocess_spec(self, info: dict) -> dict:
        return {"type": "softmax_argmax", "labels": list(info.get("labels") or LABELS), "outputs": self.outputs}
