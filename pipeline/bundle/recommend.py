"""Which server row to serve: every row that passed, low precision included, within the user's budget.

Two steps, both plain functions of gate rows and measurements (the server stage does the loading and timing):
  screen()  one verdict per servable row: failed / skipped gate, precision not allowed, emulated, no evidence that
            the requested precision ran, over budget (metric drop, agreement with fp32) -> or a candidate;
  choose()  the candidates ranked side by side (registry.rank, interleaved): a low-precision row is chosen only
            when it is at least `min_speedup` x faster than the fastest fp32 row, else it is "not faster" (screen()
            already says so, unranked, of a row not that much faster than its own engine's fp32).
The record says why the chosen row won and what fp32 would have given (server.recommend in configs/defaults.yaml).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.engines.evidence import head
from pipeline.core.gates import OK, SKIPPED, Gate, metric_check

# (engine, precision) rows a bundle can serve; bf16 is the fp32 model with the engine's bf16 switch
SERVABLE = {("paddle-inference", p) for p in ("fp32", "bf16", "int8", "fp16")} | \
           {("onnxruntime", "fp32"), ("onnxruntime", "int8"), ("openvino", "fp32"), ("openvino", "bf16"),
            ("openvino", "int8")}
CANDIDATE, CHOSEN = "candidate", "chosen"


@dataclass
class Candidate:
    row: str                        # the server gate's subject, e.g. "onnxruntime int8"
    engine: str
    precision: str
    # chosen | slower | not faster | over budget | no evidence | emulated | skipped | failed gate | not allowed |
    # failed to load | not compared; "candidate" only between screen() and choose()
    verdict: str
    detail: str = ""                # why (every verdict but "chosen" says it)
    metric: float | None = None         # the row's primary metric on the gate slice
    metric_drop: float | None = None
    agreement: float | None = None
    latency_ms: float | None = None     # batch-1 p50, interleaved ranking
    throughput_sps: float | None = None
    speedup_vs_fp32: float | None = None    # vs the fastest fp32 row, by recommend.by
    speed_vs_fp32_in_row: dict | None = None   # the row's own measurement (int8 rows): under min_speedup -> not ranked

    def line(self) -> str:
        speed = f", {self.speedup_vs_fp32:.2f}x the fastest fp32" if self.speedup_vs_fp32 is not None else ""
        return f"{self.row}: {self.verdict}{speed}" + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_row(subject: str) -> tuple[str, str] | None:
    """(engine, precision) of a servable row subject ("openvino int8"), None for others (HTTP, GPU providers)."""
    parts = subject.split(" ")
    return (parts[0], parts[1]) if len(parts) == 2 and (parts[0], parts[1]) in SERVABLE else None


def strict_agreement(gate: Gate) -> tuple[str, float] | None:
    """(name, share) of samples whose argmax / decoded text equals fp32's, strictly (a tie-aware share is 1.0 by
    construction under int8's wide band); None for tasks without an agreement measure (detection)."""
    rec = gate.extra.get("agreement")
    if rec:
        return rec["name"], float(rec["strict"])
    found = [c for c in gate.checks if c.name.endswith("agreement") and c.observed is not None]
    return (found[0].name, float(found[0].observed)) if found else None


def _budget(c: Candidate, gate: Gate, rc, samples: int | None) -> Candidate:
    """Metric drop and agreement against the user's limits; the first one over names its key. Agreement is recorded
    even when the drop is over already: the OCR system admits over-budget rows by it (system_choice)."""
    agree = strict_agreement(gate)
    if agree is not None:
        c.agreement = round(agree[1], 6)
    if gate.value is not None and gate.reference is not None:
        drop = metric_check(gate.metric, gate.value, gate.reference, rc.max_metric_drop, samples=samples)
        c.metric_drop = round(float(drop.observed), 6)
        if not drop.passed:
            c.verdict = "over budget"
            c.detail = (f"{gate.metric} drop {drop.observed:.4g} > {drop.limit:.4g} (server.recommend.max_metric_drop"
                        + (f"; {drop.detail}" if drop.detail else "") + ")")
            return c
    if agree is not None and agree[1] < rc.min_agreement - 1e-12:
        c.verdict = "over budget"
        c.detail = f"{agree[0]} {agree[1]:.4g} < {rc.min_agreement:g} (server.recommend.min_agreement)"
    return c


def screen_row(gate: Gate, rc, samples: int | None = None) -> Candidate | None:
    """One row's verdict before any timing; None for rows that are not servable (HTTP, GPU providers)."""
    parsed = parse_row(gate.subject)
    if parsed is None:
        return None
    kind, prec = parsed
    c = Candidate(gate.subject, kind, prec, CANDIDATE, metric=gate.value,
                  speed_vs_fp32_in_row=gate.extra.get("speed_vs_fp32"))
    eff = gate.precision_effective or ""
    if gate.status != OK:
        c.verdict, c.detail = ("skipped" if gate.status == SKIPPED else "failed gate"), gate.reason
    elif prec not in rc.precisions:
        c.verdict, c.detail = "not allowed", f"{prec} is not in server.recommend.precisions {list(rc.precisions)}"
    elif "emulated" in eff or "simulated" in eff:
        c.verdict, c.detail = "emulated", f"ran {eff}: rounding previewed in fp32 math, never served"
    elif head(eff) != prec:
        c.verdict, c.detail = "no evidence", f"requested {prec}, ran {eff}"
    elif prec != "fp32" and not gate.extra.get("evidence"):
        c.verdict, c.detail = "no evidence", f"the row recorded no evidence that {prec} ran"
    else:
        _budget(c, gate, rc, samples)
        _slower_than_own_fp32(c, rc)
    return c


def _own_fp32_ratio(c: Candidate, rc) -> float | None:
    """fp32 time / this row's time on its own engine, in the profile server.recommend.by ranks (None: not measured,
    or not measured interleaved: such a ratio is ignored and the row goes to the ranking)."""
    sp = c.speed_vs_fp32_in_row or {}
    if not str(sp.get("how", "")).startswith("interleaved"):
        return None
    return sp.get("batch1" if rc.by == "latency" else "batchN")


def _slower_than_own_fp32(c: Candidate, rc) -> None:
    """A row not min_speedup x faster than its own engine's fp32 (measured interleaved in the row) cannot be that
    much faster than the fastest fp32 row either: "not faster" without the ranking (building and timing the v4
    det's Paddle and ONNX Runtime int8 engines again cost the server stage ~30 s for rows that could not win)."""
    sp, ratio = c.speed_vs_fp32_in_row, _own_fp32_ratio(c, rc)
    if c.verdict == CANDIDATE and c.precision != "fp32" and ratio is not None and ratio < rc.min_speedup:
        c.speedup_vs_fp32 = None
        profile = "batch-1 p50" if rc.by == "latency" else f"batch-{sp.get('batch')} samples/s"
        c.verdict = "not faster"
        c.detail = (f"{c.precision} not faster than {c.engine}'s own fp32: {ratio:.2f}x ({profile}, interleaved in its "
                    f"row), so not {rc.min_speedup:g}x the fastest fp32 (server.recommend.min_speedup); not ranked")


def screen(gates: list[Gate], rc, samples: int | None = None) -> list[Candidate]:
    return [c for c in (screen_row(g, rc, samples) for g in gates) if c is not None]


def _speed(c: Candidate, by: str) -> float:
    return 1.0 / c.latency_ms if by == "latency" else c.throughput_sps


def _versus(c: Candidate, base: Candidate, by: str) -> str:
    if by == "latency":
        return f"{c.latency_ms:.4g} vs {base.latency_ms:.4g} ms batch-1 p50"
    return f"{c.throughput_sps:.4g} vs {base.throughput_sps:.4g} samples/s"


def interleaved_session(ranking: list[dict]) -> str | None:
    """The one interleaved timing session the rows were measured in (registry.rank's `timing` marker); None for
    no rows. Rows timed at different moments cannot be ranked against each other: a mix raises ValueError."""
    from pipeline.engines.registry import INTERLEAVED

    sessions = {(r.get("timing") or {}).get("session") if (r.get("timing") or {}).get("how") == INTERLEAVED
                else None for r in ranking}
    if None in sessions and ranking:
        bad = [r.get("engine") for r in ranking if (r.get("timing") or {}).get("how") != INTERLEAVED]
        raise ValueError(f"ranking rows {bad} were not timed interleaved (registry.rank): figures taken at "
                         "different moments are never ranked")
    if len(sessions) > 1:
        raise ValueError(f"ranking mixes {len(sessions)} timing sessions: rank the candidates side by side in one "
                         "interleaved loop (registry.rank)")
    return next(iter(sessions), None)


def choose(cands: list[Candidate], ranking: list[dict], rc) -> tuple[Candidate, Candidate] | None:
    """(chosen, fastest fp32) from the interleaved ranking (registry.rank rows, `engine` = row subject); every
    ranked candidate's verdict and speed-up are filled in. None when no fp32 row is left to compare with.
    A ranking whose rows were not all timed in one interleaved loop is refused (ValueError)."""
    interleaved_session(ranking)
    measured = {r["engine"]: r for r in ranking}
    ranked = [c for c in cands if c.verdict == CANDIDATE and c.row in measured]
    for c in ranked:       # a ranking by one profile leaves the other None (registry.rank by=...)
        lat, sps = measured[c.row]["latency_ms"], measured[c.row]["throughput_sps"]
        c.latency_ms = round(float(lat["p50"]), 5) if lat else None
        c.throughput_sps = round(float(sps), 1) if sps is not None else None
    fp32 = [c for c in ranked if c.precision == "fp32"]
    if not fp32:
        for c in ranked:
            c.verdict, c.detail = "not compared", "no fp32 row passed to compare it with"
        return None
    base = max(fp32, key=lambda c: _speed(c, rc.by))
    worth = [base]
    for c in ranked:
        c.speedup_vs_fp32 = round(_speed(c, rc.by) / _speed(base, rc.by), 3)
        if c.precision != "fp32" and c.speedup_vs_fp32 < rc.min_speedup:
            c.verdict = "not faster"
            c.detail = (f"{c.precision} not faster than fp32 {base.engine}: {c.speedup_vs_fp32:.2f}x "
                        f"({_versus(c, base, rc.by)}), needs >= {rc.min_speedup:g}x (server.recommend.min_speedup)")
        elif c.precision != "fp32":
            worth.append(c)
    chosen = max(worth, key=lambda c: _speed(c, rc.by))
    chosen.verdict = CHOSEN
    for c in ranked:
        if c.verdict == CANDIDATE:
            c.verdict, c.detail = "slower", f"within budget, {_speed(c, rc.by) / _speed(chosen, rc.by):.2f}x the chosen row"
    return chosen, base


def why(chosen: Candidate, base: Candidate, cands: list[Candidate], rc, metric: str) -> str:
    """One sentence: why this row is served (and, for fp32, why no low-precision row was)."""
    if chosen.precision != "fp32":
        agree = "" if chosen.agreement is None else f", agreement {chosen.agreement:.4g} >= {rc.min_agreement:g}"
        return (f"fastest within budget: {chosen.speedup_vs_fp32:.2f}x fp32 {base.engine} ({_versus(chosen, base, rc.by)}), "
                f"{metric} drop {chosen.metric_drop or 0.0:.4g} <= {rc.max_metric_drop:g}{agree}")
    low = [c for c in cands if c.precision != "fp32"]
    reasons = ", ".join(f"{c.row} {c.verdict}" + _speed_note(c, rc) for c in low)
    return f"fastest fp32 engine that passed ({rc.by}); no low-precision row qualified" + \
        (f": {reasons} (each candidate's detail in `candidates`)" if reasons else " (none ran)")


def _speed_note(c: Candidate, rc) -> str:
    if c.verdict != "not faster":
        return ""
    if c.speedup_vs_fp32 is not None:
        return f" ({c.speedup_vs_fp32:.2f}x)"
    ratio = _own_fp32_ratio(c, rc)
    return f" ({ratio:.2f}x its own fp32)" if ratio is not None else ""


def fp32_baseline(base: Candidate) -> dict:
    """What serving fp32 would have given: the fastest fp32 row, its speed and metric."""
    return {"engine": base.engine, "row": base.row, "latency_ms_p50": base.latency_ms,
            "throughput_sps": base.throughput_sps, "metric": base.metric}
