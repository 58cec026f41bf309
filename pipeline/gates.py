"""Gates: NaN/Inf first, then elementwise parity and metric delta against a reference.

Observed values are recorded on pass *and* fail (Model Navigator style); a failing gate is
never a warning — the runner turns it into a non-zero exit.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

OK, FAIL, SKIPPED = "OK", "FAIL", "SKIPPED"
# produced but not executed here (e.g. an ARM .nb on an x86 host): never OK, never a failure
UNVERIFIED = "UNVERIFIED"


@dataclass
class Check:
    name: str                   # "finite" | "max_abs_diff" | "<metric>_delta" | "<metric>"
    observed: float | None
    limit: float | None
    op: str = "<="              # observed op limit must hold
    passed: bool = True

    def describe(self) -> str:
        if self.name == "finite":
            return f"non-finite values: {self.observed:g} (must be 0)"
        sign = ">" if self.op == "<=" else "<"
        return f"{self.name} {_fmt(self.observed)} {sign} limit {_fmt(self.limit)}"


@dataclass
class Gate:
    stage: str
    subject: str                        # what was checked, e.g. "paddle-inference fp32"
    precision_requested: str
    precision_effective: str
    metric: str
    value: float | None = None          # primary metric of the candidate
    reference: float | None = None      # primary metric of the reference
    checks: list[Check] = field(default_factory=list)
    status: str = OK
    reason: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)   # latency, size, notes ...

    @property
    def delta(self) -> float | None:
        if self.value is None or self.reference is None:
            return None
        return self.value - self.reference

    def failure_line(self) -> str:
        bad = [c for c in self.checks if not c.passed]
        what = "; ".join(c.describe() for c in bad) or self.reason
        return f"{self.stage}: {self.subject} ({self.precision_effective}) failed: {what}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["delta"] = self.delta
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Gate":
        d = dict(d)
        d.pop("delta", None)
        d["checks"] = [Check(**c) for c in d.get("checks", [])]
        return cls(**d)


def skipped(stage: str, subject: str, precision: str, metric: str, reason: str) -> Gate:
    return Gate(stage, subject, precision, "none", metric, status=SKIPPED, reason=reason)


def unverified(gate: Gate, why: str, vouched_by: str) -> Gate:
    """Mark a produced-but-not-executed artifact: the reason says why, and what vouches for it instead."""
    gate.status = UNVERIFIED
    gate.reason = f"converted, not executed ({why}); vouched for by {vouched_by}"
    gate.extra["vouched_by"] = vouched_by
    return gate


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def count_nonfinite(x: np.ndarray) -> int:
    return int(np.size(x) - np.count_nonzero(np.isfinite(x)))


def parity_checks(candidate: np.ndarray, reference: np.ndarray, atol: float | None) -> list[Check]:
    """finite → shape → max_abs_diff (≤ atol when given) and max_rel_diff (recorded only)."""
    bad = count_nonfinite(candidate)
    checks = [Check("finite", float(bad), 0.0, "<=", bad == 0)]
    if bad:
        return checks
    if candidate.shape != reference.shape:
        checks.append(Check(f"shape {list(candidate.shape)} vs {list(reference.shape)}", 1.0, 0.0, "<=", False))
        return checks
    diff = np.abs(candidate.astype(np.float64) - reference.astype(np.float64))
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = diff / np.maximum(np.abs(reference.astype(np.float64)), 1e-6)
    checks.append(Check("max_abs_diff", max_abs, atol, "<=", atol is None or max_abs <= atol))
    checks.append(Check("max_rel_diff", float(rel.max()) if rel.size else 0.0, None, "<=", True))
    return checks


def metric_check(metric: str, value: float, reference: float, max_drop: float) -> Check:
    """The candidate may lose at most `max_drop` of the primary metric (absolute, e.g. 0.01 = 1 pt)."""
    if not math.isfinite(value):
        return Check(f"{metric}_drop", value, max_drop, "<=", False)
    drop = reference - value
    # tiny epsilon: identical accuracies computed in float must not fail a 0.0 tolerance
    return Check(f"{metric}_drop", drop, max_drop, "<=", drop <= max_drop + 1e-12)


def evaluate(gate: Gate, candidate: np.ndarray, reference: np.ndarray, atol: float | None,
             value: float | None, max_drop: float) -> Gate:
    """Fill gate.checks from a candidate/reference pair and decide the verdict."""
    gate.checks = parity_checks(candidate, reference, atol)
    if gate.checks[0].passed and value is not None and gate.reference is not None:
        gate.value = value
        gate.checks.append(metric_check(gate.metric, value, gate.reference, max_drop))
    gate.status = OK if all(c.passed for c in gate.checks) else FAIL
    if gate.status == FAIL:
        gate.reason = "; ".join(c.describe() for c in gate.checks if not c.passed)
    return gate
