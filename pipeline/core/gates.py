"""Gates: NaN/Inf first, then elementwise parity and metric delta against a reference.

Observed values are recorded on pass *and* fail (Model Navigator style); a failing gate is
never a warning — the runner turns it into a non-zero exit.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.core.errors import ConfigError
from pipeline.core.task_hooks import provides

OK, FAIL, SKIPPED = "OK", "FAIL", "SKIPPED"
# produced but not executed here (e.g. an ARM .nb on an x86 host): never OK, never a failure
UNVERIFIED = "UNVERIFIED"
# a `candidate` row (server.roles) that failed its gate: reported with its checks, never served, does not fail the
# run; a `required` row's failure stays FAIL (docs/low_precision.md)
EXCLUDED = "EXCLUDED"
ROLES = ("required", "candidate")


@dataclass
class Check:
    name: str                   # "finite" | "max_abs_diff" | "<metric>_delta" | "<metric>"
    observed: float | None
    limit: float | None
    op: str = "<="              # observed op limit must hold
    passed: bool = True
    key: str = ""               # config key(s) that set the limit, e.g. "server.gates.fp16.atol/rtol"
    detail: str = ""            # how the limit was made, e.g. "atol 0.05 + rtol 0.01 x ref scale 12.3"

    def describe(self) -> str:
        if self.name == "finite":
            return f"non-finite values: {self.observed:g} (must be 0)"
        sign = ">" if self.op == "<=" else "<"
        how = f" = {self.detail}" if self.detail else ""
        where = f" (set by {self.key})" if self.key else ""
        return f"{self.name} {_fmt(self.observed)} {sign} limit {_fmt(self.limit)}{how}{where}"


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
        if what and self.reason.startswith(what):     # the reason adds advice (BN statistics, layers to skip)
            what = self.reason
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


def crashed(stage: str, subject: str, precision: str, metric: str, exc: BaseException, evidence_dir=None) -> Gate:
    """A row whose engine raised: FAIL with the exception's last line; the full traceback goes to
    <evidence_dir>/<subject>.txt (kept in <stage>.failed/ by the runner) so nothing is lost."""
    import traceback
    from pathlib import Path

    lines = [ln.strip() for ln in str(getattr(exc, "message", "") or exc).strip().splitlines() if ln.strip()]
    head = getattr(exc, "one_line", None)
    why = head() if callable(head) else f"{type(exc).__name__}: {lines[-1] if lines else repr(exc)}"
    gate = Gate(stage, subject, precision, "none", metric, status=FAIL, reason=why)
    if evidence_dir is not None:
        path = Path(evidence_dir) / (subject.replace(" ", "_").replace("/", "_") + ".txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        gate.extra["traceback_file"] = str(path.relative_to(Path(evidence_dir).parent))
    return gate


def run_row(stage: str, subject: str, precision: str, metric: str, fn, evidence_dir=None) -> Gate:
    """The one way an engine row runs (server, Lite, system pairs, HTTP): fn() -> Gate. Any exception is this
    row's FAIL with its traceback kept under evidence_dir (<stage>.failed/evidence/ when the stage fails); the
    other rows still run. A row that did not execute says so itself (SKIPPED / UNVERIFIED), never OK."""
    try:
        return fn()
    except Exception as exc:       # an engine's failure is the row's verdict, not the stage's crash
        return crashed(stage, subject, precision, metric, exc, evidence_dir)


def apply_role(gate: Gate, role: str) -> Gate:
    """A failed `candidate` row becomes EXCLUDED (checks and reason kept); a `required` row's verdict stands."""
    gate.extra["role"] = role
    if role == "candidate" and gate.status == FAIL:
        gate.status = EXCLUDED
        gate.reason = f"candidate row failed its gate, excluded from serving: {gate.reason}"
    return gate


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def count_nonfinite(x: np.ndarray) -> int:
    return int(np.size(x) - np.count_nonzero(np.isfinite(x)))


def output_kind(task) -> str:
    """"probabilities" when the model ends in softmax/sigmoid (the task records it), else "logits"."""
    return "logits" if task is None else task.outputs       # Task.outputs is declared (default "logits")


def parity_limits(kind: str, atol: float | None, rtol: float, prob_atol: float | None) -> tuple:
    """(atol, rtol, key suffix) of the elementwise check for an output kind. Logits: atol + rtol x scale.
    Probabilities: as they are, max|p - p_ref| <= prob_atol. Their scale is fixed (0..1); log-probabilities
    blow up where p ~ 0 (two tiny probabilities' logs differ by anything) and a relative bound means nothing
    near 0 or 1, so the absolute bound is the meaningful one, and the decoded output (agreement, metric) is the
    sharp check."""
    if kind == "probabilities":
        return prob_atol, 0.0, "prob_atol"
    return atol, rtol, "atol/rtol" if rtol else "atol"


def parity_checks(candidate: np.ndarray, reference: np.ndarray, atol: float | None, rtol: float = 0.0,
                  key: str = "", suffix: str | None = None) -> list[Check]:
    """finite → shape → like np.allclose, per output: max|c - r| <= atol + rtol * max|r|.

    rtol is relative to the reference's scale (its largest magnitude), not elementwise: near-zero
    logits would otherwise get no tolerance at all. max_rel_diff is recorded, never gated.
    `key` names the config prefix of the limit (e.g. "server.gates.fp16") for failure messages, `suffix`
    the key(s) under it (default "atol" or "atol/rtol").
    """
    bad = count_nonfinite(candidate)
    checks = [Check("finite", float(bad), 0.0, "<=", bad == 0)]
    if bad:
        return checks
    if candidate.shape != reference.shape:
        checks.append(Check(f"shape {list(candidate.shape)} vs {list(reference.shape)}", 1.0, 0.0, "<=", False))
        return checks
    max_abs, max_rel = diff_maxima(candidate, reference)
    scale = abs_max(reference)
    limit, detail = atol, ""
    if atol is not None and rtol:
        limit = atol + rtol * scale
        detail = f"atol {atol:g} + rtol {rtol:g} x reference scale {scale:.4g}"
    suffix = suffix or ("atol/rtol" if rtol else "atol")
    keys = f"{key}.{suffix}" if key and atol is not None else ""
    checks.append(Check("max_abs_diff", max_abs, limit, "<=", limit is None or max_abs <= limit, keys, detail))
    checks.append(Check("max_rel_diff", max_rel, None, "<=", True))
    return checks


# float64 work per slice of samples: a recogniser's outputs compared whole held ~4 float64 copies (PP-OCRv5 rec, 126
# lines x 40 steps x 18385 classes: 0.74 GB each; its server stage peaked at 6.5 GB, issue 48); same values by slice
CHUNK_BYTES = 32 << 20


def _slices(x: np.ndarray) -> list:
    """Slices over the first axis holding about CHUNK_BYTES of float64 each (the whole array when 0-d)."""
    if x.ndim == 0 or len(x) == 0:
        return [...]
    step = max(1, CHUNK_BYTES // max(8, 8 * x[0].size))
    return [slice(i, i + step) for i in range(0, len(x), step)]


def abs_max(x: np.ndarray) -> float:
    """max|x| in float64 (0.0 for an empty array; NaN propagates), slice by slice."""
    if x.size == 0:
        return 0.0
    return float(np.max([np.abs(x[s].astype(np.float64)).max() for s in _slices(x) if x[s].size]))


def diff_maxima(candidate: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(max|c - r|, max|c - r| / max(|r|, 1e-6)) in float64, slice by slice (0.0 when empty; NaN propagates)."""
    if candidate.size == 0:
        return 0.0, 0.0
    abs_d, rel_d = [], []
    for s in _slices(candidate):
        r = reference[s].astype(np.float64)
        if not r.size:
            continue
        d = np.abs(candidate[s].astype(np.float64) - r)
        abs_d.append(d.max())
        rel_d.append((d / np.maximum(np.abs(r), 1e-6)).max())
    return float(np.max(abs_d)), float(np.max(rel_d))


def metric_check(metric: str, value: float, reference: float, max_drop: float, key: str = "",
                 samples: int | None = None) -> Check:
    """The candidate may lose at most `max_drop` of the primary metric (absolute, e.g. 0.01 = 1 pt).

    On `samples` samples the metric moves in steps of 1/samples: a non-zero limit below one step is
    raised to one step (else "1 %" on 64 samples would mean "no sample may change"); 0 stays exact."""
    k = f"{key}.metric_delta" if key else ""
    limit, detail = max_drop, ""
    if samples and 0 < max_drop < 1.0 / samples:
        limit = 1.0 / samples
        detail = f"metric_delta {max_drop:g} < one sample of {samples} ({limit:.4g}): one sample allowed"
    if not math.isfinite(value):
        return Check(f"{metric}_drop", value, limit, "<=", False, k, detail)
    drop = reference - value
    # tiny epsilon: identical accuracies computed in float must not fail a 0.0 tolerance
    return Check(f"{metric}_drop", drop, limit, "<=", drop <= limit + 1e-12, k, detail)


def correct_lost_check(lost: int, of: int, max_share: float, key: str = "") -> Check:
    """What a user loses: of the `of` samples the reference reads correctly, the share the candidate reads wrongly.
    As metric_check, a non-zero limit below one sample of `of` is raised to one sample; 0 stays exact."""
    k = f"{key}.max_correct_lost" if key else ""
    limit, detail = max_share, f"{lost} of {of} correctly read samples turn wrong"
    if of and 0 < max_share < 1.0 / of:
        limit = 1.0 / of
        detail += f"; max_correct_lost {max_share:g} < one sample of {of}: one sample allowed"
    share = lost / of if of else 0.0
    return Check("correct_lost", share, limit, "<=", share <= limit + 1e-12, k, detail)


def agreement_check(name: str, value: float, minimum: float | None, key: str = "", detail: str = "") -> Check:
    """Share of samples whose task-level prediction (argmax class / decoded text) equals the reference's."""
    k = f"{key}.min_agreement" if key and minimum is not None else ""
    ok = minimum is None or (math.isfinite(value) and value >= minimum - 1e-12)
    return Check(name, value, minimum, ">=", ok, k, detail)


# The reference's own noise, relative to its scale: what two honest fp32 runs of one model differ by (the fp32
# gate's rtol). A candidate's pick the reference scores within this of its top class is a tie in the reference itself
REFERENCE_NOISE_RTOL = 1.0e-5


def reference_tie_band(reference: np.ndarray, measured: float | None = None) -> tuple[float, str]:
    """(band, how it was made) for agreement ties: the reference's own noise, never the candidate's tolerance.
    measured: an observed fp32-vs-fp32 max|diff| (e.g. the fp32 row's), used when larger than the epsilon."""
    scale = abs_max(reference)
    eps = REFERENCE_NOISE_RTOL * scale
    if measured is not None and math.isfinite(measured) and measured > eps:
        return float(measured), f"fp32-vs-fp32 max|diff| {measured:.3g}"
    return eps, f"reference noise {REFERENCE_NOISE_RTOL:g} x scale {scale:.4g}"


def _agreement(gate: Gate, agreement, candidate, reference, min_agreement, key: str, tie_band) -> Check:
    """The gated share counts ties only within the reference's own noise; the share with ties inside the row's
    elementwise tolerance is information (int8's 0.75 x scale band makes nearly any runner-up a tie)."""
    band, how = reference_tie_band(reference, tie_band)
    name, gated, strict = agreement(candidate, reference, band)
    tol_band = gate.checks[1].limit                  # atol + rtol x scale (None: no elementwise bound)
    ties = getattr(getattr(agreement, "__self__", None), "agreement_has_ties", True)
    within_tol = agreement(candidate, reference, tol_band)[1] if tol_band is not None and ties else None
    gate.extra["agreement_gate"] = {"name": name, "gated": float(gated), "strict": float(strict),
                                    "tie_band": float(f"{band:.4g}"), "tie_band_from": how,
                                    "within_tolerance": None if within_tol is None else float(within_tol),
                                    "tolerance_band": tol_band}
    detail = f"strict {strict:.6g}" + (f"; ties within {how}" if gated != strict else "")
    if within_tol is not None and within_tol != gated:
        detail += f"; {within_tol:.4g} counting ties within the tolerance ({tol_band:.3g}): not gated"
    return agreement_check(name, float(gated), min_agreement, key, detail)


def evaluate(gate: Gate, candidate: np.ndarray, reference: np.ndarray, atol: float | None,
             value: float | None, max_drop: float, *, rtol: float = 0.0,
             agreement=None, min_agreement: float | None = None, key: str = "", suffix: str | None = None,
             correct_lost: tuple[int, int] | None = None, max_correct_lost: float | None = None,
             tie_band: float | None = None) -> Gate:
    """Fill gate.checks from a candidate/reference pair and decide the verdict.

    agreement: task.agreement(candidate, reference, band) -> (name, share, strict share), gated when min_agreement
    is set, with a tie band from the reference's own noise (reference_tie_band; tie_band: a measured fp32-vs-fp32
    max|diff|), never from the row's tolerance. gate.extra["agreement_gate"] keeps the numbers.
    key: the config prefix of the tolerance (e.g. "server.gates.fp16"), named in failure messages.
    correct_lost: (lost, of) from task.correct_lost, gated when max_correct_lost is set.
    """
    gate.checks = parity_checks(candidate, reference, atol, rtol, key, suffix)
    if gate.checks[0].passed and agreement is not None and len(gate.checks) > 2:
        gate.checks.append(_agreement(gate, agreement, candidate, reference, min_agreement, key, tie_band))
    if gate.checks[0].passed and value is not None and gate.reference is not None:
        gate.value = value
        gate.checks.append(metric_check(gate.metric, value, gate.reference, max_drop, key, len(candidate)))
    if gate.checks[0].passed and correct_lost is not None and max_correct_lost is not None:
        gate.checks.append(correct_lost_check(*correct_lost, max_correct_lost, key))
    gate.status = OK if all(c.passed for c in gate.checks) else FAIL
    if gate.status == FAIL:
        gate.reason = "; ".join(c.describe() for c in gate.checks if not c.passed)
    return gate


def unlabelled_min_agreement(tol, unlabelled: bool) -> tuple[float | None, bool]:
    """(least strict agreement, raised?). Without labels no metric or lost-lines gate sees what a disagreement costs,
    so each one counts as a loss: a row allowed a metric drop d (fp16/bf16 0.03, int8 0.04) must agree on at least
    1 - d. Otherwise a 5 % planted flip passed int8's min_agreement 0.85 unseen. Rows allowed no drop (fp32) keep
    min_agreement: their elementwise bound (1e-4) already fails any moved score."""
    floor = getattr(tol, "min_agreement", None)
    drop = float(getattr(tol, "metric_delta", 0.0) or 0.0)
    if not unlabelled or floor is None or not 0.0 < drop < 1.0 or 1.0 - drop <= floor:
        return floor, False
    return 1.0 - drop, True


def _note_unlabelled(gate: Gate, key: str, tol) -> None:
    for c in gate.checks:
        if c.name.endswith("agreement"):
            c.detail += (f"; no labels: every disagreement counts as a loss, limit 1 - metric_delta "
                         f"{tol.metric_delta:g} (min_agreement {tol.min_agreement:g})")
            c.key = f"{key}.metric_delta" if key else c.key


def evaluate_tol(gate: Gate, candidate: np.ndarray, reference: np.ndarray, tol, value: float | None,
                 task=None, key: str = "", labels: np.ndarray | None = None, tie_band: float | None = None) -> Gate:
    """evaluate() with a config Tolerance and the task's agreement measure (argmax for classification, decoded
    text for recognition, boxes for detection), with the elementwise bound of the task's output kind
    (logits: atol/rtol; probabilities: prob_atol, see parity_limits). With labels, a task that reads text
    (task.correct_lost) is also gated on the correctly read lines it loses (tol.max_correct_lost)."""
    agreement = task.agreement if task is not None else None        # a required Task hook
    kind = output_kind(task)
    atol, rtol, suffix = parity_limits(kind, tol.atol, getattr(tol, "rtol", 0.0), getattr(tol, "prob_atol", None))
    if atol is None and tol.metric_delta >= 1.0 and not getattr(tol, "min_agreement", None):
        raise ConfigError(f"{key or 'gate'}: cannot fail for a model whose outputs are {kind} ({suffix.split('/')[0]} "
                          f"null, metric_delta >= 1 and no min_agreement)",
                          hint=f"set {key}.{suffix.split('/')[0]}, a metric_delta below 1 or a min_agreement above 0")
    gate.extra["compared_as"] = kind
    lost = None
    if labels is not None and provides(task, "correct_lost") and len(labels) == len(candidate):
        lost = task.correct_lost(candidate, reference, labels)
    min_agree, unlabelled = unlabelled_min_agreement(tol, value is None or gate.reference is None)
    evaluate(gate, candidate, reference, atol, value, tol.metric_delta, rtol=rtol, agreement=agreement,
             min_agreement=min_agree, key=key, suffix=suffix,
             correct_lost=lost, max_correct_lost=getattr(tol, "max_correct_lost", None), tie_band=tie_band)
    if unlabelled:
        _note_unlabelled(gate, key, tol)
    if kind == "probabilities" and gate.checks[0].passed:
        _probability_range(gate, candidate)
    return _note_same_decoding(gate)


def judge_try(task, tol, out: np.ndarray, ref_out: np.ndarray, labels: np.ndarray | None, precision: str,
              key: str, effective: str | None = None) -> dict:
    """One trial of a keep/skip list (the server stage's int8 advice, scripts/int8_skip_layers.py,
    scripts/fp16_keep_ops.py): the gate `key` judges `out` against fp32's `ref_out`, labels when there are any
    (metric, drop, correct lines lost). -> {passed, status, reason, metric, ref, drop, lost, of, agreement, strict}
    (None where the task or the labels do not give one)."""
    m = task.primary_metric
    with_labels = labels is not None        # callers pass None for unlabelled samples (tasks.base.has_labels)
    finite = bool(np.isfinite(out).all())
    value = task.metrics(out, labels)[m] if with_labels and finite else (float("nan") if with_labels else None)
    ref = task.metrics(ref_out, labels)[m] if with_labels else None
    g = evaluate_tol(Gate("server", f"{precision} try", precision, effective or precision, m, reference=ref), out,
                     ref_out, tol, value, task, key=key, labels=labels if with_labels else None)
    lost = task.correct_lost(out, ref_out, labels) if with_labels and provides(task, "correct_lost") else (None, None)
    share = strict = None
    if finite:
        _, share, strict = task.agreement(out, ref_out, None)
    return {"passed": g.status == OK, "status": g.status, "reason": g.reason, "metric": value, "ref": ref,
            "drop": ref - value if value is not None and ref is not None else None, "lost": lost[0], "of": lost[1],
            "agreement": share, "strict": strict}


PROB_SLACK = 0.01     # rounding of p ~ 0 or 1 (bf16 has 8 bits of mantissa); a logit is almost never in [0, 1]


def _probability_range(gate: Gate, candidate: np.ndarray) -> None:
    """Outputs the reference gives as probabilities must be probabilities: a dropped softmax/sigmoid keeps every
    argmax (agreement and metric cannot see it) and low precision has no elementwise bound (prob_atol null)."""
    out = int(np.count_nonzero((candidate < -PROB_SLACK) | (candidate > 1 + PROB_SLACK)))
    gate.checks.append(Check("values_outside_0_1", float(out), 0.0, "<=", out == 0,
                             detail=f"the reference's outputs are probabilities (slack {PROB_SLACK:g})"))
    if out:
        gate.status = FAIL
        gate.reason = "; ".join(c.describe() for c in gate.checks if not c.passed)


def _note_same_decoding(gate: Gate) -> Gate:
    """An elementwise failure whose task-level output is identical everywhere (strict agreement 1.0) says so:
    the numbers moved, the answers did not (decide whether the tolerance or the engine is wrong)."""
    agree = [c for c in gate.checks if c.name.endswith("agreement")]
    elementwise = [c for c in gate.checks if c.name == "max_abs_diff" and not c.passed]
    strict = gate.extra.get("agreement_gate", {}).get("strict")
    strict_all = bool(agree) and strict is not None and float(strict) == 1.0      # a number: 0.99996 is not 1
    if gate.status == FAIL and elementwise and strict_all:
        gate.reason += (f"; the decoded output ({agree[0].name}) is identical on every sample: only the elementwise "
                        f"values differ beyond {elementwise[0].key or 'the tolerance'}")
    return gate
