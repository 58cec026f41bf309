"""The task interface: everything model- and data-specific that stages need.

Stages never know whether they carry a classifier or a CTC recogniser; they ask the task.
A task works on numpy at its boundaries so that every engine (dygraph, Paddle Inference,
Paddle Lite, HTTP) feeds the *same* preprocessed arrays and decodes with the *same* code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class Split:
    """Raw images (uint8, N x H x W grayscale) and labels.

    labels: classification → int64 [N]; recognition → int64 [N, L] padded with -1.
    """
    images: np.ndarray
    labels: np.ndarray
    skipped: int = 0          # samples dropped by `data.on_bad_sample: skip`


def unlabelled(n: int) -> np.ndarray:
    """Labels of n samples without ground truth (data.source=images): an int64 [n, 0] array."""
    return np.zeros((n, 0), dtype=np.int64)


def has_labels(labels: np.ndarray) -> bool:
    """False for unlabelled samples: metrics are then None (reported as such), never invented."""
    labels = np.asarray(labels)
    return labels.size > 0 and not (labels.ndim == 2 and labels.shape[1] == 0)


@dataclass
class Datasets:
    train: Split
    val: Split
    info: dict[str, Any] = field(default_factory=dict)   # e.g. class names / charset, source


class Task(Protocol):
    name: str                 # "classification" | "recognition"
    primary_metric: str       # "accuracy" | "seq_accuracy"

    def load_data(self, data_cfg: dict, seed: int) -> Datasets: ...
    def build_model(self, model_cfg: dict, info: dict) -> "paddle.nn.Layer": ...
    def loss(self, logits, labels): ...                       # paddle tensors → scalar tensor
    def metrics(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]: ...
    def decode(self, outputs: np.ndarray, info: dict) -> list: ...  # predictions users see
    def preprocess_spec(self, data_cfg: dict, info: dict) -> dict: ...  # → infer_config.yaml
    def postprocess_spec(self, info: dict) -> dict: ...       # → infer_config.yaml (labels/charset, decoder)
