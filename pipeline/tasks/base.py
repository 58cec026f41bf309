"""The task interface: everything model- and data-specific that stages need.

Stages never know whether they carry a classifier or a CTC recogniser; they ask the task.
A task works on numpy at its boundaries so that every engine (dygraph, Paddle Inference,
Paddle Lite, HTTP) feeds the *same* preprocessed arrays and decodes with the *same* code.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.task_hooks import OPTIONAL_HOOKS as OPTIONAL_HOOKS, provides as provides


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


class Task(abc.ABC):
    """What a task provides: every hook the pipeline calls, declared here with its default (docs/extending.md).

    Required (abstract): data, model, loss, metrics, the agreement measure gates read, decoding and the
    pre/post-processing written into a bundle's infer_config.yaml. Declared with defaults (override what differs):
    `outputs`, `output_layout`, `labels_are_classes`, `check_output_shape`. Optional: the hooks in OPTIONAL_HOOKS,
    which a task defines only when it has them (callers ask `provides`).
    """
    name: str = ""                      # "classification" | "recognition" | ... (config `task:`)
    primary_metric: str = ""            # "accuracy" | "seq_accuracy" | "hmean" ...
    outputs: str = "logits"             # "probabilities": the model ends in softmax/sigmoid; gates compare them as such
    output_layout: str | None = None    # e.g. "[N, classes]": its rank is checked with one forward pass before training
    labels_are_classes: bool = True     # False: labels are not class ids (detection quads): no label-range check

    @abc.abstractmethod
    def load_data(self, data_cfg: dict, seed: int) -> Datasets:
        """The train/val splits (numpy) and their info (labels, charset, source)."""

    @abc.abstractmethod
    def build_model(self, model_cfg: dict, info: dict):
        """A paddle.nn.Layer for model.name (built-in or package.module:callable)."""

    @abc.abstractmethod
    def loss(self, logits, labels):
        """Paddle tensors -> scalar tensor."""

    @abc.abstractmethod
    def metrics(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
        """{primary_metric: value, ...}; None for unlabelled samples (has_labels), never invented."""

    @abc.abstractmethod
    def agreement(self, candidate: np.ndarray, reference: np.ndarray,
                  band: float | None = None) -> tuple[str, float, float]:
        """(measure name, tie-aware share, strict share) of samples on which candidate and reference agree: what an
        engine row's gate compares besides the elementwise bound."""

    @abc.abstractmethod
    def decode(self, outputs: np.ndarray, info: dict) -> list:
        """The predictions users see (class names, text, boxes)."""

    @abc.abstractmethod
    def preprocess_spec(self, data_cfg: dict, info: dict) -> dict:
        """Input spec and preprocessing for infer_config.yaml (every engine feeds the same arrays)."""

    @abc.abstractmethod
    def postprocess_spec(self, info: dict) -> dict:
        """Labels/charset and decoder for infer_config.yaml."""

    def check_output_shape(self, shape: list[int], info: dict) -> None:
        """Refuse, in one line, a model whose output cannot serve this task (e.g. CTC: fewer time steps than the
        longest label needs). Default: nothing beyond output_layout's rank."""
