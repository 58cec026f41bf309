"""The A/B rule shared by the nightly's latency check (pipeline/nightly/ab_latency.py) and the OCR system's serving
choice (pipeline/bundle/system_choice.py): per-round paired ratios of two sides timed interleaved; one side is
clearly beyond the other only when the median ratio passes the limit AND the ratio's 10th percentile over the rounds
is above 1 (the side won in at least 90 % of the rounds), so a difference inside the round-to-round spread never
counts, however large its median."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spread:
    median: float
    p10: float
    p90: float
    rounds: int

    def as_dict(self) -> dict:
        return {"median": round(self.median, 3), "p10": round(self.p10, 3), "p90": round(self.p90, 3),
                "rounds": self.rounds}


def spread(ratios) -> Spread:
    """Median and 10-90 % spread of per-round ratios."""
    r = np.asarray(list(ratios), dtype=float)
    if r.size == 0 or not np.isfinite(r).all():
        raise ValueError(f"per-round ratios must be finite and non-empty, got {r.tolist()}")
    p10, med, p90 = (float(v) for v in np.percentile(r, [10, 50, 90]))
    return Spread(med, p10, p90, int(r.size))


def clearly_beyond(median: float, p10: float, limit: float) -> bool:
    """The rule: median ratio above `limit` and its 10th percentile above 1 (beyond the round-to-round spread)."""
    return median > limit and p10 > 1.0
