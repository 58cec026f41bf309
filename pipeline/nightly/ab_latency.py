"""Nightly latency judged A/B: the baseline's own artifacts and the new ones, measured in one process,
on the same input, interleaved call by call (AB, BA, AB, ...), so machine load hits both sides alike.

A round is `runs` such pairs; each side's lower quartile in the round gives one paired ratio B/A (the
lower quartile, because under a competing load a call that gets preempted pays the other process's time
slice, and a longer call is preempted more often: medians then inflate a 1.5x slowdown to 2-9x and
scatter it). Reported: the median ratio over the rounds, its 10-90 % spread, and each side's per-round
values (median and interquartile range). A row
regresses only when the median ratio exceeds 1 + latency_growth AND its spread is clearly apart from
"no change": B was slower than A in at least 90 % of the rounds (ratio p10 > 1). Block-wise timing
(20 A calls, then 20 B calls) was tried first: under a competing load its ratios spanned 0.3-3.6 for
identical artifacts; pairing adjacent calls is what makes the ratio steady.
A row that regresses is timed again from scratch, and fails only when the second A/B regresses too: a real
slowdown shows twice, while a burst of load that lands on one side's calls (a 0.53 -> 0.68 ms "regression" of
unchanged artifacts at 3 rounds under a load of 9 on 2 cores) seldom does.
(scripts/ab_nightly_experiment.py measures false alarms and detection; README quotes the result).
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.bundle import layout as bundle_layout
from pipeline.core.ab_rule import clearly_beyond, spread
from pipeline.core.artifacts import load_manifest

log = logging.getLogger("pipeline")
ROUND_QUANTILE = 25      # per side and round: the lower quartile of its call times (see above)


@dataclass
class ABResult:
    key: str
    ratio: float                 # median of per-round B/A
    ratio_p10: float
    ratio_p90: float
    a_ms: tuple[float, float, float]     # baseline per-round medians: p25, p50, p75
    b_ms: tuple[float, float, float]
    rounds: int
    runs: int
    first_ratio: float | None = None     # set when this is the confirming re-measurement of a flagged row

    def regressed(self, growth: float) -> bool:
        return clearly_beyond(self.ratio, self.ratio_p10, 1.0 + growth)

    def message(self, growth: float) -> str:
        a, b = self.a_ms, self.b_ms
        return (f"{self.key}: p50 {a[1]:.3f} → {b[1]:.3f} ms, A/B ratio {self.ratio:.2f} "
                f"(p10-p90 {self.ratio_p10:.2f}-{self.ratio_p90:.2f}; IQR A {a[0]:.3f}-{a[2]:.3f}, "
                f"B {b[0]:.3f}-{b[2]:.3f} ms; {self.rounds} rounds x {self.runs} interleaved pairs; "
                f"limit ratio {1 + growth:.2f} with p10 > 1)" + self._confirmation(growth))

    def _confirmation(self, growth: float) -> str:
        if self.first_ratio is None:
            return ""
        verdict = "confirmed by" if self.regressed(growth) else "not confirmed by"
        return f"; a first A/B read ratio {self.first_ratio:.2f}, {verdict} this second one"


def measure(a_run: Callable, b_run: Callable, x: np.ndarray, *, rounds: int = 21, runs: int = 20,
            warmup: int = 10, key: str = "") -> ABResult:
    """Interleaved timing of two callables on the same input; see the module docstring."""
    for _ in range(warmup):          # oneDNN builds its primitives on the first calls
        a_run(x)
        b_run(x)
    med_a, med_b = [], []
    for r in range(rounds):
        ta, tb = np.empty(runs), np.empty(runs)
        for i in range(runs):
            order = ((ta, a_run), (tb, b_run)) if (r + i) % 2 == 0 else ((tb, b_run), (ta, a_run))
            for times, fn in order:
                t0 = time.perf_counter()
                fn(x)
                times[i] = time.perf_counter() - t0
        med_a.append(float(np.percentile(ta, ROUND_QUANTILE)) * 1e3)
        med_b.append(float(np.percentile(tb, ROUND_QUANTILE)) * 1e3)
    a, b = np.asarray(med_a), np.asarray(med_b)
    s = spread(b / a)
    q = lambda v: tuple(float(t) for t in np.percentile(v, [25, 50, 75]))
    return ABResult(key, s.median, s.p10, s.p90, q(a), q(b), rounds, runs)


def measure_confirmed(a_run: Callable, b_run: Callable, x: np.ndarray, *, growth: float, **kw) -> ABResult:
    """measure(); a row that regresses is timed again from scratch and judged on that second A/B (see above)."""
    res = measure(a_run, b_run, x, **kw)
    if not res.regressed(growth):
        return res
    log.info("[nightly] A/B latency %s: ratio %.2f, timing it again to confirm", kw.get("key", ""), res.ratio)
    again = measure(a_run, b_run, x, **kw)
    again.first_ratio = res.ratio
    return again


# ------------------------------------------------------------------------------------ rebuilding engines

def _server_rows(run_dir: Path) -> dict[str, dict]:
    man = load_manifest(Path(run_dir) / "server") or {}
    return {g["subject"]: g for g in man.get("gates", [])}


def _model_file(run_dir: Path, kind: str, precision: str, scratch: Path, keep_fp32_ops=()) -> Path | None:
    """Where a server row's model lives among the run's declared outputs (pipeline/core/catalogue.py);
    the fp16-emulated model is not an output (not deployable): it is derived again from the export."""
    from pipeline.engines import paddle_infer as pi

    run_dir = Path(run_dir)
    export = run_dir / "export" / "inference"
    if kind == "paddle-inference" and precision == "fp16":
        emu = scratch / run_dir.name / "fp16_emulated"
        pi.make_fp16_emulated(export, emu, keep_fp32_ops=keep_fp32_ops)     # the op types the row kept fp32
        return emu
    return bundle_layout.server_stage_model(run_dir / "server", export, kind, precision)


def rebuild(run_dir: Path, gate: dict, settings: dict, scratch: Path):
    """A server row's engine from that run's own files, with the settings it was gated and served with: a
    tuned row records one instance per batch profile, and single requests (what A/B times) go to `batch1`."""
    from pipeline.engines import paddle_infer as pi
    from pipeline.engines import registry

    kind, prec = gate["subject"].split(" ")[0], gate["precision_requested"]
    if kind == "paddle-inference" and prec == "bf16" and not pi.bf16_status()[0]:
        return None
    model = _model_file(run_dir, kind, prec, scratch,
                        (gate.get("extra") or {}).get("evidence", {}).get("fp32_ops_user_black_list") or ())
    if model is None:
        raise KeyError(f"no rebuild recipe for '{kind}' rows")
    one = dict(settings.get("batch1", settings))
    opts = {k: one[k] for k in ("mkldnn", "ir_optim") if k in one} if kind == "paddle-inference" else {}
    return registry.make(kind, model, prec, threads=int(one.get("threads") or 1), batch=1, spin=False, **opts)


def comparable_rows(base_dir: Path, cur_dir: Path) -> list[tuple[str, dict, dict]]:
    """Server rows with latency that both runs measured and that can be served (engine rows)."""
    base, cur = _server_rows(base_dir), _server_rows(cur_dir)
    out = []
    for subject, c in cur.items():
        b = base.get(subject)
        # not the HTTP row (it would need two servers) nor an emulated preview (never served; its model is scratch)
        if (b and b["status"] != "SKIPPED" and c["status"] != "SKIPPED" and not subject.startswith("http ")
                and not subject.endswith("-emulated")
                and (b.get("extra") or {}).get("latency_ms") and (c.get("extra") or {}).get("latency_ms")):
            out.append((subject, b, c))
    return out


def ab_compare(base_dir: Path, cur_dir: Path, x: np.ndarray, *, growth: float, rounds: int, runs: int,
               threads: int = 0, wrap_current: Callable | None = None,
               wrap_rows: set[str] | None = None) -> list[tuple[str, ABResult | None, str]]:
    """A/B every comparable row; (key, result or None, note). `wrap_current` is for experiments/tests:
    it wraps the new side's run function (e.g. a planted slowdown) of the rows named in `wrap_rows`
    (server row subjects; None = every row)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="ab-latency-") as tmp:
        for subject, b_gate, c_gate in comparable_rows(base_dir, cur_dir):
            key = f"server: {subject}"
            c_set = dict((c_gate.get("extra") or {}).get("settings") or {})
            b_set = dict((b_gate.get("extra") or {}).get("settings") or c_set)
            if threads:        # both sides alike, both profiles; see regression.ab_threads
                c_set, b_set = _with_threads(c_set, threads), _with_threads(b_set, threads)
            try:
                a_eng = rebuild(base_dir, b_gate, b_set, Path(tmp))
                b_eng = rebuild(cur_dir, c_gate, c_set, Path(tmp))
            except Exception as exc:          # a vanished/damaged artifact: say so, do not guess a latency
                results.append((key, None, f"not A/B-measured: {str(exc).splitlines()[0][:200]}"))
                continue
            if a_eng is None or b_eng is None:
                results.append((key, None, "not A/B-measured: this machine cannot run the row"))
                continue
            planted = wrap_current and (wrap_rows is None or subject in wrap_rows)
            b_fn = wrap_current(b_eng.run) if planted else b_eng.run
            log.info("[nightly] A/B latency %s", key)
            results.append((key, measure_confirmed(a_eng.run, b_fn, x[:1], growth=growth, rounds=rounds,
                                                   runs=runs, key=key), ""))
            for e in (a_eng, b_eng):
                with contextlib.suppress(Exception):
                    e.close()
    return results


def _with_threads(settings: dict, threads: int) -> dict:
    if "batch1" in settings:
        return {p: ({**v, "threads": threads} if isinstance(v, dict) else v) for p, v in settings.items()}
    return {**settings, "threads": threads}


def sample_input(run_dir: Path) -> np.ndarray | None:
    """One validation sample from the run's export reference (both sides get this same array)."""
    p = Path(run_dir) / "export" / "reference.npz"
    if not p.is_file():
        return None
    with np.load(p) as z:
        return np.ascontiguousarray(z["inputs"][:1])
