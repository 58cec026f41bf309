"""CTC decoding, label encoding and text-recognition metrics, all in numpy.

Kept free of paddle so that every engine (dygraph, Paddle Inference, Paddle Lite, the HTTP
server) decodes raw logits with exactly the same code.

Class indices: 0 is the CTC blank, character `charset[i]` is class i + 1.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.core.errors import DataError

BLANK = 0
PAD = -1
# How far a softmax row's sum may be from 1 and still count as probabilities: a bf16 softmax (oneDNN's AVX-512 bf16
# kernels, AMD Zen 4, 2026-12-02) rounds each probability to 8 bits of mantissa and its rows sum to 1 +- 0.003;
# at 1e-3 they were taken for logits and softmaxed again, and every line's score fell under drop_score.
PROB_SUM_ATOL = 0.01


def is_probabilities(outputs: np.ndarray) -> bool:
    """PaddleOCR's exported recognizers end in softmax: every row is in [0, 1] and sums to 1 (to PROB_SUM_ATOL)."""
    return probability_row_sums(outputs) is not None


def probability_row_sums(outputs: np.ndarray) -> np.ndarray | None:
    """The rows' sums in float64 when `outputs` are probabilities (is_probabilities), else None: a caller that
    renormalises the rows needs them anyway."""
    # min/max in the output's own dtype, row sums accumulated in float64: no float64 copy of [N, T, C] per batch
    o = np.asarray(outputs)
    if not o.size or float(o.min()) < 0.0 or float(o.max()) > 1.0 + PROB_SUM_ATOL:
        return None
    sums = o.sum(axis=-1, dtype=np.float64)
    return sums if np.allclose(sums, 1.0, rtol=0.0, atol=PROB_SUM_ATOL) else None


def ctc_greedy_decode(logits: np.ndarray, blank: int = BLANK) -> list[list[int]]:
    """[N, T, C] scores → per sample the class path with repeats collapsed and blanks dropped.

    Softmax is monotonic, so raw logits and probabilities decode identically.
    """
    if logits.ndim != 3:
        raise DataError(f"CTC decoding expects [N, T, C] outputs, got shape {list(logits.shape)}")
    best = logits.argmax(axis=2)                                   # [N, T]
    return [row[k].tolist() for row, k in zip(best, ctc_kept_steps(best, blank))]


def ctc_kept_steps(best: np.ndarray, blank: int = BLANK) -> np.ndarray:
    """[N, T] class paths → the steps greedy CTC decoding keeps: a step that differs from the previous one (the
    first always) and is not blank."""
    keep = np.ones_like(best, dtype=bool)
    keep[:, 1:] = best[:, 1:] != best[:, :-1]
    return keep & (best != blank)


def kept_means(conf: np.ndarray, keep: np.ndarray) -> list[float]:
    """PaddleOCR's rec score per line: the mean of `conf` [N, T] over the kept steps (0 for a line with none)."""
    return [float(c[k].mean()) if k.any() else 0.0 for c, k in zip(conf, keep)]


def decode_indices(seqs: Sequence[Sequence[int]] | np.ndarray, charset: str) -> list[str]:
    """Class indices (1-based characters; blank and -1 padding ignored) → strings."""
    out: list[str] = []
    for seq in seqs:
        out.append("".join(charset[i - 1] for i in (int(v) for v in seq) if 0 < i <= len(charset)))
    return out


def encode_labels(strings: Sequence[str], charset: str, max_len: int) -> np.ndarray:
    """Strings → int64 [N, max_len], class = charset index + 1, padded with -1.

    Raises DataError for characters outside the charset or strings longer than max_len,
    rather than silently truncating (a truncated label teaches the model to drop characters).
    """
    index = {c: i + 1 for i, c in enumerate(charset)}
    out = np.full((len(strings), max_len), PAD, dtype=np.int64)
    for row, s in enumerate(strings):
        if len(s) > max_len:
            raise DataError(f"label {s!r} has {len(s)} characters, more than max_len={max_len}",
                            hint="raise data.max_len (and the image width) or shorten the label")
        try:
            out[row, :len(s)] = [index[c] for c in s]
        except KeyError as exc:
            raise DataError(f"label {s!r} contains {exc.args[0]!r}, which is not in the charset") from None
    return out


def label_lengths(labels: np.ndarray) -> np.ndarray:
    """Length of each -1-padded label row (padding only at the end)."""
    return (labels != PAD).sum(axis=1).astype(np.int64)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (insert, delete, substitute all cost 1); two-row DP."""
    if a == b:
        return 0
    # strip the common prefix and suffix: predictions are mostly right, so the DP shrinks to
    # the differing middle (often a single character)
    start = 0
    while start < len(a) and start < len(b) and a[start] == b[start]:
        start += 1
    end_a, end_b = len(a), len(b)
    while end_a > start and end_b > start and a[end_a - 1] == b[end_b - 1]:
        end_a, end_b = end_a - 1, end_b - 1
    a, b = a[start:end_a], b[start:end_b]
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _check_pairs(preds: Sequence[str], gts: Sequence[str]) -> None:
    if len(preds) != len(gts):
        raise DataError(f"{len(preds)} predictions for {len(gts)} ground-truth labels")


def seq_accuracy(preds: Sequence[str], gts: Sequence[str]) -> float:
    """Fraction of lines recognised exactly (0.0 for an empty set)."""
    _check_pairs(preds, gts)
    if not gts:
        return 0.0
    return sum(p == g for p, g in zip(preds, gts)) / len(gts)


def char_accuracy(preds: Sequence[str], gts: Sequence[str]) -> float:
    """1 − normalised edit distance over the whole set, clipped at 0:

        1 − Σ edit_distance(pred, gt) / Σ max(len(gt), 1)

    Summing before dividing weights long lines by their length (unlike a per-line mean);
    the clip keeps the score in [0, 1] when predictions are much longer than the truth.
    """
    _check_pairs(preds, gts)
    if not gts:
        return 0.0
    errors = sum(edit_distance(p, g) for p, g in zip(preds, gts))
    total = sum(max(len(g), 1) for g in gts)
    return max(0.0, 1.0 - errors / total)
