"""DB loss: balanced BCE (OHEM 3:1) on the probability map, masked L1 on the threshold map,
dice on the approximate binary map: L = alpha·L_s + beta·L_t + L_b (the paper's weights)."""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from pipeline.core.errors import ConfigError

EPS = 1e-6


def _balanced_bce(prob, gt, mask, pos_count: int, neg_avail: int, ratio: float):
    positive, negative = gt * mask, (1 - gt) * mask
    neg_count = int(min(neg_avail, pos_count * ratio)) if pos_count else int(min(neg_avail, 100))
    loss = F.binary_cross_entropy(prob, gt, reduction="none")
    pos_loss = paddle.sum(loss * positive)
    if neg_count > 0:
        neg_loss, _ = paddle.topk(paddle.reshape(loss * negative, [-1]), k=neg_count)   # hardest negatives
        neg_sum = paddle.sum(neg_loss)
    else:
        neg_sum = paddle.zeros([], dtype=prob.dtype)
    return (pos_loss + neg_sum) / (pos_count + neg_count + EPS)


def check_train_maps(shape) -> None:
    """An exported DB detector keeps only the probability map; the loss needs all three: say so in one line."""
    if len(shape) != 4 or shape[1] != 3:
        raise ConfigError(
            f"detection: DB training needs probability, threshold and binary maps [N, 3, H, W]; the model gives "
            f"{list(shape)} (an exported/inference detector keeps only the probability map)",
            hint="fine-tune from the training checkpoint of a DB model (model.name: dbnet or your own "
                 "'package.module:callable'), not from an inference.pdmodel")


def db_loss(maps, targets: np.ndarray, alpha: float = 5.0, beta: float = 10.0, ohem_ratio: float = 3.0):
    """maps: tensor [N, 3, H, W] (P, T, B); targets: numpy [N, 4, H, W] from db_targets.batch_targets."""
    check_train_maps(maps.shape)
    maps = paddle.cast(maps, "float32")
    prob, thresh, binary = maps[:, 0], maps[:, 1], maps[:, 2]
    # counts come from numpy: top-k needs a Python int, and reading it back from a tensor would sync
    pos = int(round(float((targets[:, 0] * targets[:, 1]).sum())))
    neg = int(round(float(((1 - targets[:, 0]) * targets[:, 1]).sum())))
    t = paddle.to_tensor(targets.astype(np.float32))
    gt, mask, tmap, tmask = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    l_shrink = _balanced_bce(prob, gt, mask, pos, neg, ohem_ratio)
    l_thresh = paddle.sum(paddle.abs(thresh - tmap) * tmask) / (paddle.sum(tmask) + EPS)
    inter = paddle.sum(binary * gt * mask)
    union = paddle.sum(binary * mask) + paddle.sum(gt * mask) + EPS
    l_binary = 1 - 2 * inter / union
    return alpha * l_shrink + beta * l_thresh + l_binary
