"""The export stage's reference, as every downstream stage reads it.

export writes info.json (task, pre/post-processing, input shape) and reference.npz (validation
slice inputs, raw images, labels and the exported program's outputs); server, lite and bundle
gate against exactly these arrays.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.artifacts import require_file
from pipeline.tasks import get_task


@dataclass
class Reference:
    info: dict
    task: object
    inputs: np.ndarray        # preprocessed float32 [N, C, H, W]
    images: np.ndarray        # raw uint8 [N, H, W] (for PNG round trips: HTTP, bundle samples)
    labels: np.ndarray
    outputs: np.ndarray       # the exported program's outputs on `inputs`
    metric: float             # the task's primary metric of `outputs`
    model_prefix: str         # export/inference (without suffix)


def load_reference(export_dir: Path) -> Reference:
    export_dir = Path(export_dir)
    info = json.loads(require_file(export_dir / "info.json", "export info", "make export").read_text())
    task = get_task(info["task"], info.get("postprocess"))
    with np.load(require_file(export_dir / "reference.npz", "export reference", "make export")) as z:
        x, images, labels, out = z["inputs"], z["images"], z["labels"], z["outputs"]
    return Reference(info, task, x, images, labels, out, task.metrics(out, labels)[task.primary_metric],
                     str(export_dir / "inference"))
