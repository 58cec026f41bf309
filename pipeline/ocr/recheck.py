"""Lines in doubt read again at fp32: a low-precision recogniser whose close calls are settled by its fp32 model.

bf16 makes the v4 recogniser 1.8-2x its f32 on this CPU family, and rewrites ~10 % of the text of tight crops
(issue 48: 125 of 1308 edge-page crops; no bf16 keep list holds the 1.5 % budget faster than 1.02x). A rewrite
needs a close call: a CTC step whose best two classes are near each other, where taking the other one changes the
decoded text (`3F1` / `3FI`), or a line whose score sits on `drop_score`. So each batch is read at low precision,
and only the lines with such a step are read again by the same runtime at fp32, at the batch's own padded width
(each crop's input is then exactly what the fp32 model read in the batch: rows of a batch do not interact). On the
edge tuning pages (seed 480001, v4) margin 0.2 re-read 27 % of the crops and changed 14 of 1308 lines (budget 19.6;
bf16 alone 133) at 1.22x f32; on the real images the recogniser's time fell from 0.66-0.71 to 0.50-0.53 s a pass
(docs/serving_choice.md#lines-in-doubt-read-again-at-fp32).
"""
from __future__ import annotations

import numpy as np

from pipeline.engines.base import Engine
from pipeline.engines.evidence import head
from pipeline.ocr.text_metrics import ctc_kept_steps, kept_means, probability_row_sums

# a line whose score is this close to drop_score may be kept by one precision and dropped by the other (the score is
# the mean probability of the kept characters). On the edge tuning crops the band took 2 of the 16 lines margin 0.2
# alone left changed, for 2 more re-reads of 1308; bf16 moved the score of a line it read alike by up to 0.22 there
# (0.012 on the real images), so it is a cheap guard, not a bound
SCORE_BAND = 0.05


def _collapsed(path: np.ndarray) -> list[int]:
    return path[ctc_kept_steps(path[None])[0]].tolist()


def _top_two(out: np.ndarray, best: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(best value, second value, second class) per step of [N, T, C] without a [N, T, C] copy: `out` (writable)
    is restored as it was."""
    n, t = np.indices(best.shape)
    first = out[n, t, best].copy()
    out[n, t, best] = -np.inf
    try:
        second = out.argmax(axis=-1)
        return first, out[n, t, second], second
    finally:
        out[n, t, best] = first


def doubtful_lines(out: np.ndarray, margin: float, drop_score: float | None = None) -> np.ndarray:
    """Rows of a CTC output [N, T, C] (probabilities, or logits) a close call could rewrite: a step whose best two
    classes are within `margin` in probability and where taking the second changes the collapsed text, or (with
    drop_score) a line score within SCORE_BAND of drop_score. margin 0: none. `out` must be writable (it is
    left as it was)."""
    if margin <= 0 or out.size == 0:
        return np.empty(0, dtype=int)
    best = out.argmax(axis=-1)
    top1, top2, second = _top_two(out, best)
    sums = probability_row_sums(out)
    if sums is not None:
        gap = (top1 - top2) / sums
        p_best = top1 / sums
    else:                                   # logits: softmax's p1 - p2 = (1 - exp(z2 - z1)) / sum(exp(z - z1))
        z = np.exp(out.astype(np.float64) - top1[..., None]).sum(axis=-1)
        gap = (1.0 - np.exp(top2.astype(np.float64) - top1)) / z
        p_best = 1.0 / z
    close = gap < margin
    near_drop = (np.abs(np.asarray(kept_means(p_best, ctc_kept_steps(best))) - drop_score) < SCORE_BAND
                 if drop_score is not None else np.zeros(len(out), dtype=bool))
    doubt = []
    for row in range(len(out)):
        if near_drop[row]:
            doubt.append(row)
            continue
        steps = np.flatnonzero(close[row])
        if steps.size == 0:
            continue
        text = _collapsed(best[row])
        for step in steps:
            path = best[row].copy()
            path[step] = second[row, step]
            if _collapsed(path) != text:
                doubt.append(row)
                break
    return np.asarray(doubt, dtype=int)


class RecheckedRecognizer(Engine):
    """A low-precision CTC recogniser whose lines in doubt (doubtful_lines) are read again by `exact` (the same
    runtime at fp32) within the same call. The label keeps the low precision as its head, with what was re-read:
    evidence["recheck"] counts the lines read and re-read so far."""

    def __init__(self, fast: Engine, exact: Engine, margin: float, drop_score: float | None,
                 own_exact: bool = True) -> None:
        super().__init__()
        self.fast, self.exact, self.margin, self.drop_score = fast, exact, float(margin), drop_score
        self.own_exact = own_exact      # False: exact is shared (the system stage's engine cache closes it)
        self.kind = fast.kind
        self.input_shape = fast.input_shape
        self.effective_precision = (f"{head(fast.effective_precision)} (lines in doubt re-read "
                                    f"{head(exact.effective_precision)}: top-2 margin < {self.margin:g})")
        self.notes = list(fast.notes)
        self.settings = {**fast.settings, "recheck_margin": self.margin}
        self.lines = self.reread = 0
        self.serving = dict(getattr(fast, "serving", None) or {}, recheck_margin=self.margin,
                            effective_precision=self.effective_precision)

    @property
    def evidence(self) -> dict:
        return {**self.fast.evidence, "recheck": {
            "margin": self.margin, "score_band": SCORE_BAND if self.drop_score is not None else None,
            "lines": self.lines, "reread": self.reread, "exact": self.exact.kind + " " + self.exact.effective_precision}}

    @evidence.setter
    def evidence(self, _value) -> None:     # Engine.__init__ sets it; the record is built from the counters
        pass

    def _run(self, x: np.ndarray) -> np.ndarray:
        out = self.fast._run(x)
        if not out.flags.writeable:     # doubtful_lines marks the best class in place; the re-reads are written in
            out = out.copy()
        rows = doubtful_lines(out, self.margin, self.drop_score)
        self.lines += len(x)
        if rows.size:
            self.reread += int(rows.size)
            out[rows] = self.exact._run(np.ascontiguousarray(x[rows]))
        return out

    def close(self) -> None:
        self.fast.close()
        if self.own_exact:
            self.exact.close()

    def trim(self) -> None:
        self.fast.trim()
        self.exact.trim()


RECHECKED = ("bf16",)       # the precisions a margin was measured for (int8's errors are larger: never measured)


def recheck_margin(flow: dict) -> float:
    """The flow's rec_recheck_margin (0: off)."""
    return float(flow.get("rec_recheck_margin", 0.0) or 0.0)


def rechecked(rec: Engine, flow: dict, make_exact, own_exact: bool = True) -> Engine:
    """`rec` as the system reads with it: wrapped in RecheckedRecognizer (make_exact() builds the fp32 engine) when
    flow["rec_recheck_margin"] > 0 and rec runs bf16 (RECHECKED); as it is otherwise."""
    margin = recheck_margin(flow)
    if margin <= 0 or head(rec.effective_precision) not in RECHECKED or isinstance(rec, RecheckedRecognizer):
        return rec
    return RecheckedRecognizer(rec, make_exact(), margin, float(flow["drop_score"]) if "drop_score" in flow else None,
                               own_exact=own_exact)
