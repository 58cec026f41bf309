"""The TUNING split of a run, with its labels: the lines lists and tolerances are chosen on (issue 31).

train/calib.npz holds the first calibration inputs of the training set (never the validation slice the server gate
judges) and their labels. For runs trained before calib.npz kept labels, they come from the same data set the train
stage built (task.load_data with the run's resolved config and seed); the inputs are checked to be calib.npz's byte
for byte, so the labels belong to them.
With labels a choice can be judged by the gate's own checks (correct lines lost, metric drop, agreement), not by
agreement alone. Used by scripts/fp16_keep_ops.py and scripts/int8_skip_layers.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def load(run_dir: Path, n: int, batch: int, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(inputs, fp32 outputs, labels or None) of the first n tuning lines of run_dir."""
    from pipeline.core.config import load_config
    from pipeline.data.preprocess import to_tensor
    from pipeline.engines.paddle_infer import InferenceEngine
    from pipeline.tasks import get_task

    with np.load(run_dir / "train" / "calib.npz") as z:
        x = z["inputs"][:n]
        saved = z["labels"][:n] if "labels" in z.files else None
    if len(x) < n:
        raise SystemExit(f"tuning split: {run_dir}/train/calib.npz holds {len(x)} lines, {n} asked: "
                         "raise data.num_train (the calibration count) and re-run train")
    ref = InferenceEngine(run_dir / "export" / "inference", threads=threads).run_batched(x, batch)
    if saved is not None:
        return x, ref, saved
    cfg = load_config([run_dir / "config.resolved.yaml"])
    task = get_task(cfg.task, cfg.section("detection")["detection"])
    data_cfg = cfg.section("data")["data"]
    ds = task.load_data(data_cfg, cfg.seed)
    mine = to_tensor(ds.train.images[:n], task.preprocess_spec(data_cfg, ds.info))
    labels = ds.train.labels[:n] if mine.shape == x.shape and np.array_equal(mine, x) else None
    if labels is None:
        print(f"tuning split: the rebuilt training inputs differ from {run_dir}/train/calib.npz; "
              "judging without labels (agreement and elementwise bounds only)")
    return x, ref, labels
