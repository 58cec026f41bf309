"""Each OCR part's served row, chosen on the system's own pages (the system stage loads, gates and times; this
module holds the plain parts: which rows compete, the timing loop, the choice).

A part's own recommendation is measured on its validation inputs, one fixed shape: Paddle Inference, which pays
for every new input shape, wins there, while every real page is a new shape (issue 29: the detector's Paddle
int8 was 3.34x its fp32 on 736x736 maps and 0.57 pages/s on the real images, OpenVINO fp32 1.52). So each part's
rows that passed in its bundle are timed again inside the system, on pages of varied shapes, interleaved, each on a
fresh engine warmed alike; of the rows whose lines pass the system gates, a low-precision one is served only when
clearly beyond the fastest fp32 (server.recommend.min_speedup and the round-to-round spread: the nightly's A/B rule,
pipeline/core/ab_rule.py), else the fastest fp32 (docs/serving_choice.md).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pipeline.bundle import layout
from pipeline.core.ab_rule import clearly_beyond, spread

clock = time.perf_counter      # the timing loop's clock (a test drives a fake one)

# the fp32 chain every row is judged and timed against: each part's reference row (pipeline/bundle/reference.py), this
# one for a Paddle program's bundle; ONNX Runtime fp32 for an imported .onnx
FP32_REF = ("paddle-inference", "fp32")
MAX_LOW = 5             # low-precision rows per part (each engine's fastest passing one first), besides fp32 rows
NOT_FASTER = "not faster"   # a row that passed gates and budget but not min_speedup on the part's own inputs
# A row that passed its gates but not server.recommend's accuracy budget (drop <= 0.01, text agreement >= 0.99 on the
# part's own slice: one line of 128, below what the slice resolves) is the single bundle's user budget; inside the
# system, what users read is judged on the system's pages by the system gates (lines identical to the fp32 chain's
# >= 0.95, line and field accuracy), so such rows compete there (docs/serving_choice.md, issue 29).
OVER_BUDGET = "over budget"
TIMING_PAGES = 4        # pages per timing round (a cap: every candidate reads each of them once per round)
ROUNDS = 6              # rounds: 24 pages of varied shape, and six per-round ratios for the spread (core/ab_rule.py)
WARMUP_PAGES = 2        # real pages outside the timed set, read untimed by every set before timing
MIN_LINES_KEPT = 0.95   # lines identical to the fp32 chain's (issue 29's target for what users read)
SERVED = "as served (system.engine=auto)"   # the system row that runs what /ocr serves


def rechecked_alone_fast_enough(c: dict, min_speedup: float) -> bool:
    """A bf16 row to be read with fp32 re-reads must be min_speedup its own engine's fp32 alone, at batch 1 and at
    batch N in its row (speed_vs_fp32_in_row): re-reading only adds time (the v4 recogniser's Paddle bf16, 0.98x /
    1.22x, would only add a slow row and two Paddle predictors to the stage)."""
    speed = c.get("speed_vs_fp32_in_row") or {}
    ratios = [speed.get(p) for p in ("batch1", "batchN")]
    return all(isinstance(r, (int, float)) and r >= min_speedup for r in ratios)


def rewrites_too_much(c: dict, rechecked: bool = False, min_speedup: float = 1.0) -> str | None:
    """Why an over-budget row may not compete in the system, or None. The system asks MIN_LINES_KEPT of the lines
    users read to stay identical to the fp32 chain's; a row that rewrites more than that share of its own part's
    validation lines (strict agreement, the gate's data) cannot be expected to keep it on real pages, whatever the
    synthetic system pages say (issue 29: the v4 recogniser's ONNX Runtime int8 row, agreement 0.875 on its own
    lines, kept 0.993 of the synthetic system lines and 28 of 34 real ones). The same bound for every model; rows
    within server.recommend's budget (agreement >= 0.99) never reach it; detection rows have no agreement.
    rechecked: the system reads this part's bf16 rows with their lines in doubt re-read at fp32 (flow
    rec_recheck_margin, pipeline/ocr/recheck.py), which the part's own agreement did not: the system gates and the
    edge judge judge such a row as it will read, when it is fast enough alone to pay for the re-reads
    (rechecked_alone_fast_enough)."""
    from pipeline.ocr.recheck import RECHECKED

    a = c.get("agreement")
    if c.get("verdict") != OVER_BUDGET or a is None or a >= MIN_LINES_KEPT - 1e-12 \
            or (rechecked and c.get("precision") in RECHECKED and rechecked_alone_fast_enough(c, min_speedup)):
        return None
    return (f"over budget and rewrites {1 - a:.1%} of its own validation lines (agreement {a:.3f} < "
            f"{MIN_LINES_KEPT:g}, the share of lines the system keeps): does not compete")


def part_candidates(sub: Path, infer_cfg: dict, here: frozenset | None = None,
                    max_low: int = MAX_LOW, rechecked: bool = False, min_speedup: float = 1.0) -> list[tuple[str, str]]:
    """(engine, precision) rows of one part that may compete: the fp32 chain's row (the part's reference), the part's
    recommendation as
    this CPU runs it, every fp32 row and up to `max_low` low-precision rows that passed their gates and budget in
    its bundle (verdict chosen / slower / not faster: "not faster" was timed on the part's fixed-shape inputs, and
    is timed again here; over budget: judged by the system gates instead of the part's budget, unless it rewrites
    more of its own lines than the system may lose: rewrites_too_much, rechecked as there), each engine's
    fastest first, whose kernels this CPU runs and whose model is bundled."""
    from pipeline.core.capabilities import cpu_flags, engine_flags
    from pipeline.bundle import reference
    from pipeline.bundle.serving_choice import PASSED, built_flags, built_record, kernel_refusal, runnable_choice

    here = cpu_flags() if here is None else here
    built = built_record(sub)
    rows = [c for c in (infer_cfg.get("serving") or {}).get("candidates") or []
            if c.get("verdict") in PASSED + (NOT_FASTER, OVER_BUDGET) and rewrites_too_much(c, rechecked, min_speedup) is None
            and kernel_refusal(c["precision"], built_flags(built, c["engine"]),
                               engine_flags(c["engine"], here)) is None        # ONEDNN_MAX_CPU_ISA: as serve
            and layout.model_exists(Path(sub) / layout.serving_model(c["engine"], c["precision"], sub))]
    low = sorted((c for c in rows if c["precision"] != "fp32"), key=lambda c: -(c.get("speedup_vs_fp32") or 0.0))
    firsts = list({c["engine"]: c for c in reversed(low)}.values())     # each engine's fastest
    low = sorted(firsts, key=low.index) + [c for c in low if c not in firsts]
    ch = runnable_choice(sub, infer_cfg, here)
    pairs = [reference.pair(infer_cfg), (ch["engine"], ch["precision"])] + [(c["engine"], "fp32") for c in rows
                                                           if c["precision"] == "fp32"]
    pairs += [(c["engine"], c["precision"]) for c in low[:max_low]]
    return list(dict.fromkeys(pairs))


def not_admitted(infer_cfg: dict, rechecked: bool = False, min_speedup: float = 1.0) -> list[dict]:
    """Rows kept out of the system's choice by rewrites_too_much, as choice rows with their reason (reported in the
    bundle's served.<part>.candidates, never timed)."""
    out = []
    for c in (infer_cfg.get("serving") or {}).get("candidates") or []:
        why = rewrites_too_much(c, rechecked, min_speedup)
        if why:
            out.append({"engine": c["engine"], "precision": c["precision"], "passed": False, "verdict": "not admitted",
                        "lines_kept": None, "detail": why})
    return out


class Timed:
    """An engine that adds up the wall time of its own calls (the part's share of a chain's time)."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, x):
        t0 = clock()
        try:
            return self.engine.run(x)
        finally:
            self.seconds += clock() - t0

    def run_batched(self, x, batch_size):
        t0 = clock()
        try:
            return self.engine.run_batched(x, batch_size)
        finally:
            self.seconds += clock() - t0


def varied_pages(pages: list[np.ndarray], n: int = TIMING_PAGES, rounds: int = ROUNDS, step: float = 0.05,
                 start: int = 0) -> list:
    """rounds x n pages, each round on the next n of `pages` (cycling), each page stretched to its own aspect ratio
    (the k-th page's width for odd k, height for even k, by 1 + ceil(k/2)*step: 24 pages stay within 1.6x, as the
    8 pages at 1 + k*0.09 did; stretched further, the built-in detector found no boxes and the recogniser never
    ran), so no input shape repeats within the timing loop: as real pages, each a new shape for the detector
    (start: the first k)."""
    import cv2

    out, k = [], start
    for j in range(rounds):
        row = []
        for i in range(n):
            p = pages[(j * n + i) % len(pages)]
            k += 1
            h, w = p.shape[:2]
            f = 1.0 + (k + 1) // 2 * step
            size = (int(round(w * f)), h) if k % 2 else (w, int(round(h * f)))
            row.append(cv2.resize(p, size, interpolation=cv2.INTER_LINEAR))
        out.append(row)
    return out


def timing_pages(pages: list[np.ndarray]) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
    """(timed rounds, warm-up pages): the warm-up pages are the last real pages, unstretched (a shape the timed
    set never has); the timed ones the pages before them, stretched (varied_pages), or every page when fewer than
    the loop needs remain (the smoke system has 3 pages: its recogniser never ran on the first one alone)."""
    rest = len(pages) - WARMUP_PAGES
    timed = pages[:rest] if rest >= TIMING_PAGES * ROUNDS else pages
    return varied_pages(list(timed)), list(pages[-WARMUP_PAGES:])


def time_sets(sets: dict, rounds_pages: list[list[np.ndarray]], read, warmup=None) -> dict:
    """Interleaved: page by page, every set in a rotating order; sets: label -> {role: engine}; read(page, engines)
    reads one page; warmup: pages (or one page) every set reads untimed first, in the same order. -> label ->
    {"seconds": the chain's total, "parts": {role: that engine's own seconds}, "part_rounds": {role: [seconds per
    round]}} (per-round figures: the spread of the ratios, pipeline/core/ab_rule.py)."""
    timed = {k: {r: Timed(e) for r, e in engines.items()} for k, engines in sets.items()}
    labels, total = list(sets), {k: 0.0 for k in sets}
    warm = [] if warmup is None else ([warmup] if isinstance(warmup, np.ndarray) else list(warmup))
    for page in warm:
        for k in labels:
            read(page, timed[k])
    per_round = {k: {r: [] for r in timed[k]} for k in labels}
    i = 0
    for pages in rounds_pages:
        start = {k: {r: t.seconds for r, t in timed[k].items()} for k in labels}
        for page in pages:
            order = labels[i % len(labels):] + labels[:i % len(labels)]
            i += 1
            for k in order:
                t0 = clock()
                read(page, timed[k])
                total[k] += clock() - t0
        for k in labels:
            for r, t in timed[k].items():
                per_round[k][r].append(round(t.seconds - start[k][r], 5))
    return {k: {"seconds": round(total[k], 4),
                "parts": {r: round(sum(per_round[k][r]), 4) for r in timed[k]},
                "part_rounds": per_round[k]} for k in labels}


def _ratios(base: dict, row: dict) -> list[float]:
    """Per-round base time / row time of one part (one ratio from the totals when no rounds were kept)."""
    a, b = base.get("part_rounds"), row.get("part_rounds")
    if a and b and len(a) == len(b) and all(x > 0 for x in b):
        return [x / y for x, y in zip(a, b)]
    return [base["part_s"] / row["part_s"]]


# A part's choice moves only for a saving of at least this share of the whole chain's time on the timing pages: the
# v4 classifier's part is under 4 % of the chain, and its bf16 row (0.11 s of 14 s over 24 pages) was served in one
# run and not the next on the spread of its own tiny time. A user reads pages/s, not one part's ratio.
MATERIAL_CHAIN_SHARE = 0.02


def _material(base: dict, row: dict, chain: float) -> bool:
    """row saves a material share of the chain's time over base (always, when the chain was not timed)."""
    return chain <= 0 or base["part_s"] - row["part_s"] >= MATERIAL_CHAIN_SHARE * chain


def _first_of_the_best(cands: list[dict], chain: float) -> dict | None:
    """Among cands (kept in candidate order: the part bundle's recommendation comes first, part_candidates) whose
    time is within a material share of the fastest, the first: rows the chain cannot tell apart never swap places
    between runs."""
    if not cands:
        return None
    fastest = min(r["part_s"] for r in cands)
    return next(r for r in cands if chain <= 0 or r["part_s"] - fastest < MATERIAL_CHAIN_SHARE * chain)


def choose_part(role: str, rows: list[dict], ref_pair: tuple[str, str] = FP32_REF,
                min_speedup: float = 1.0) -> tuple[dict, list[dict]]:
    """rows: {"engine", "precision", "passed", "detail", "lines_kept", "part_s", "part_rounds", "chain_s"} of one
    part, one of them the fp32 chain's row (ref_pair: the part's reference). The A/B rule (pipeline/core/ab_rule.py)
    on per-round ratios: the fastest fp32 is the reference unless another fp32 row is clearly faster (median > 1,
    p10 > 1); a low-precision row is served only when clearly beyond that fastest fp32 (median > min_speedup,
    p10 > 1); else the fastest fp32 serves. A row must also save MATERIAL_CHAIN_SHARE of the chain's time, and rows
    within that share of the fastest are taken in candidate order: rows inside the spread, or saving too little of
    the chain to be measured, never move the choice, so two runs on one machine serve the same rows.
    -> (chosen row with its speed ratios and spread, every row with a verdict: chosen | slower | not faster |
    failed gate)."""
    ref = next(r for r in rows if (r["engine"], r["precision"]) == tuple(ref_pair))
    ok = [r for r in rows if r["passed"] and r.get("part_s")]
    if not ref.get("part_s"):
        return _untimed(ref, rows, ref_pair, min_speedup)
    chain = ref.get("chain_s") or 0.0
    vs_ref = {id(r): spread(_ratios(ref, r)) for r in ok if r["precision"] == "fp32" and r is not ref}
    faster = [r for r in ok if id(r) in vs_ref and clearly_beyond(vs_ref[id(r)].median, vs_ref[id(r)].p10, 1.0)
              and _material(ref, r, chain)]
    fp32 = _first_of_the_best(faster, chain) or ref
    vs_fp32 = {id(r): spread(_ratios(fp32, r)) for r in ok}
    low = [r for r in ok if r["precision"] != "fp32" and _material(fp32, r, chain)
           and clearly_beyond(vs_fp32[id(r)].median, vs_fp32[id(r)].p10, min_speedup)]
    best = _first_of_the_best(low, chain) or fp32
    out, ok_ids = [], {id(r) for r in ok}
    for r in rows:
        v = "chosen" if r is best else (r.get("verdict") or ("not timed" if r["passed"] else "failed gate"))
        if id(r) in ok_ids and r is not best:
            v = "not faster" if r["precision"] != "fp32" and vs_fp32[id(r)].median > 1.0 else "slower"
        d = {**r, "verdict": v}
        if r.get("part_s"):
            d["speedup_vs_fp32"] = round(ref["part_s"] / r["part_s"], 3)
        if id(r) in ok_ids:
            d["vs_fastest_fp32"] = vs_fp32[id(r)].as_dict()
        out.append(d)
    s = vs_fp32[id(best)]
    chosen = {**best, "speedup_vs_fp32": round(ref["part_s"] / best["part_s"], 3),
              "speedup_vs_fastest_fp32": round(s.median, 3), "spread": s.as_dict(), "min_speedup": min_speedup,
              "chain_speedup_vs_fp32": round(ref["chain_s"] / best["chain_s"], 3) if best.get("chain_s") else None,
              "fastest_fp32": f"{fp32['engine']} fp32", "reference": " ".join(ref_pair)}
    return chosen, out


def _untimed(ref: dict, rows: list[dict], ref_pair: tuple[str, str], min_speedup: float) -> tuple[dict, list]:
    """The part ran for no measurable time on the timing pages (e.g. no box found, so no recognition call): no row
    can be shown beyond its reference, which serves; the other rows say why they were not chosen."""
    why = "not timed: the part ran for no measurable time on the timing pages, so its reference serves"
    out = [{**r, "verdict": "chosen" if r is ref else ("not timed" if r["passed"] else r.get("verdict") or
                                                      "failed gate")} for r in rows]
    one = {"median": 1.0, "p10": 1.0, "p90": 1.0, "rounds": 0}
    chosen = {**ref, "speedup_vs_fp32": 1.0, "speedup_vs_fastest_fp32": 1.0, "spread": one, "min_speedup": min_speedup,
              "chain_speedup_vs_fp32": None, "fastest_fp32": f"{ref['engine']} fp32", "reference": " ".join(ref_pair),
              "detail": why}
    return chosen, out


def why_chosen(role: str, chosen: dict, pages: int, recommended: str) -> str:
    """The one-line reason a part serves its row (infer_config served.<part>.why)."""
    sp = chosen.get("spread") or {}
    rule = (f"a low-precision row needs > {chosen.get('min_speedup', 1.0):g}x the fastest fp32 with its per-round "
            f"p10 > 1")
    return (f"chosen on the system's pages: {role} {chosen['speedup_vs_fp32']:.2f}x "
            f"{chosen.get('reference', ' '.join(FP32_REF))} "
            f"({chosen['speedup_vs_fastest_fp32']:.2f}x the fastest fp32, {chosen['fastest_fp32']}, p10-p90 "
            f"{sp.get('p10', 0):.2f}-{sp.get('p90', 0):.2f} over {sp.get('rounds', 1)} rounds; {rule}; part time "
            f"on fresh engines, interleaved on {pages} pages of varied shape), lines kept {chosen['lines_kept']:.3f} "
            f"vs the fp32 chain; the bundle recommended {recommended}")


def fallbacks(chosen: dict[str, dict]) -> list[dict[str, tuple[str, str]]]:
    """Combinations to try in order when the chosen one fails its gate together: the chosen rows, then low-precision
    parts put back one by one on their fastest fp32 row, the smallest gain first."""
    combo = {r: (c["engine"], c["precision"]) for r, c in chosen.items()}
    out = [dict(combo)]
    low = sorted((r for r, c in chosen.items() if c["precision"] != "fp32"),
                 key=lambda r: chosen[r]["speedup_vs_fastest_fp32"])
    for r in low:
        combo[r] = (chosen[r]["fastest_fp32"].split()[0], "fp32")
        out.append(dict(combo))
    return out


def served_entry(sub: Path, role: str, chosen: dict, rows: list, rec: dict) -> dict:
    """infer_config served.<role> for a part chosen on the system's pages: what, why, vs what it recommended alone."""
    from pipeline.bundle.system import measured_on

    keep = ("engine", "precision", "verdict", "speedup_vs_fp32", "vs_fastest_fp32", "lines_kept", "edge_lines_kept",
            "part_s", "detail")
    return {"engine": chosen["engine"], "precision": chosen["precision"], "by": "system pages",
            "why": why_chosen(role, chosen, TIMING_PAGES * ROUNDS, f"{rec['engine']} {rec['precision']}"),
            **{k: chosen[k] for k in ("speedup_vs_fp32", "speedup_vs_fastest_fp32", "spread", "min_speedup",
                                      "chain_speedup_vs_fp32", "lines_kept")},
            **({"edge_lines_kept": chosen["edge_lines_kept"]} if "edge_lines_kept" in chosen else {}),
            "recommended": {k: rec[k] for k in ("engine", "precision", "why") if k in rec},
            "candidates": [{k: x[k] for k in keep if x.get(k) not in (None, "")} for x in rows],
            "model": layout.serving_model(chosen["engine"], chosen["precision"], sub), "measured_on": measured_on(sub)}

