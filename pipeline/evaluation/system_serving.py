"""What /ocr serves per part, chosen on the system's own pages: pinned parts as pinned, every other part's candidate
rows judged by the system gates, the passing ones timed interleaved on fresh engines warmed alike, on pages of varied
shape; a low-precision row serves only when clearly beyond the fastest fp32 (min_speedup and the round-to-round
spread; the rules: pipeline/bundle/system_choice.py); the chosen set is gated together, falling back part by part to
fp32."""
from __future__ import annotations

import logging

from pipeline.bundle.system_choice import SERVED
from pipeline.core.gates import OK, Gate, apply_role
from pipeline.evaluation.system_rows import Chain, chain_engine, close_engines, combo_row

log = logging.getLogger("pipeline")


def _judge_part(ctx, chain: Chain, role: str, pairs: list, threads: int) -> tuple[list[Gate], list[dict]]:
    """Each candidate row of one part, the other parts on the fp32 chain's rows: its system gate (EXCLUDED, not
    FAIL, when it misses: a candidate that does not serve)."""
    gates, rows = [], []
    for kind, prec in pairs:
        if (kind, prec) == chain.ref_of(role):
            rows.append({"engine": kind, "precision": prec, "passed": True, "lines_kept": 1.0,
                         "detail": "the fp32 chain"})
            continue
        combo = {r: (kind, prec) if r == role else chain.ref_of(r) for r in chain.subs}
        g = apply_role(combo_row(ctx, chain, f"choice {role}: {kind} {prec}", combo, threads), "candidate")
        close_engines(chain, "", role, kind)       # its engines (and an fp32 re-reader): one candidate loaded at a time
        gates.append(g)
        rows.append({"engine": kind, "precision": prec, "passed": g.status == OK,
                     "lines_kept": g.extra.get("agreement_with_fp32"), "detail": g.reason})
    return gates, rows


def time_combos(chain: Chain, combos: dict, threads: int, shared: tuple = ()) -> dict:
    """label → combo timed interleaved on the system's pages stretched to varied shapes (time_sets), with the fp32
    chain ("fp32 chain"). Every set starts from the same history: engines loaded fresh for this loop (never the ones
    that read the gate pages), each set warmed on the same real pages before timing, and closed after; a role in
    `shared` is the same fp32 engine in every set (Chain.context_of), one fresh instance all sets share: its time is
    not what this loop compares, only its crops feed the part that is (one instance per set would hold a detector
    and a recogniser per candidate)."""
    from pipeline.ocr.system import read_pages
    from pipeline.bundle.system_choice import time_sets, timing_pages

    context = {r: chain.context_of(r) for r in shared}
    every = {k: {**c, **context} for k, c in {"fp32 chain": {r: chain.ref_of(r) for r in chain.subs}, **combos}.items()}
    tag = {k: {r: "timing" if r in shared else f"timing {k}" for r in chain.subs} for k in every}
    # a bf16 recogniser's fp32 re-reads (pipeline/ocr/recheck.py) go to the fp32 set's engine of its runtime when
    # the loop has one: one engine fewer per re-read set (the stage's peak RSS), both warmed on the same pages
    chain.exact_tags = {(r, c[r][0]): tag[k][r] for k, c in every.items() for r in chain.subs
                        if r not in shared and c[r][1] == "fp32"}
    sets = {k: {r: chain_engine(chain, r, *c[r], threads, tag=tag[k][r]) for r in chain.subs}
            for k, c in every.items()}

    def read(page, e):
        read_pages([page], e["detection"], e["recognition"], chain.spec, cls=e.get("classifier"))

    rounds, warm = timing_pages(list(chain.pages["images"]))
    try:
        return time_sets(sets, rounds, read, warmup=warm)
    finally:
        chain.exact_tags = {}
        close_engines(chain, "timing")


def _choose(ctx, chain: Chain, served: dict, threads: int) -> tuple[list[Gate], dict]:
    """Parts not pinned: every candidate judged, the passing ones timed (one loop per part, fresh engines), each
    part's row chosen by the rule (choose_part: min_speedup beyond the round-to-round spread, else fp32)."""
    from pipeline.bundle.format import load_infer_config
    from pipeline.bundle.system_choice import not_admitted, part_candidates
    from pipeline.ocr.recheck import recheck_margin

    free = [r for r, p in served.items() if not str(p.get("by", "")).startswith("pinned")]
    gates, rows = [], {}
    for r in free:
        sub = chain.subs[r]
        cfg = load_infer_config(sub)
        rechecked = r == "recognition" and recheck_margin(chain.flow) > 0
        floor = ctx.cfg.server.recommend.min_speedup
        g, rows[r] = _judge_part(ctx, chain, r, part_candidates(sub, cfg, rechecked=rechecked, min_speedup=floor),
                                 threads)
        kept_out = not_admitted(cfg, rechecked, floor)
        for x in kept_out:
            log.info("[system] %s %s %s: %s", r, x["engine"], x["precision"], x["detail"])
        rows[r] += kept_out
        gates += g
    close_engines(chain, "")        # the engines that read the gate pages: timing loads its own (time_combos)
    min_speedup = ctx.cfg.server.recommend.min_speedup
    for r in free:      # one loop per part: its candidates and the fp32 chain, each on a fresh engine
        combos = {f"{r}: {x['engine']} {x['precision']}": {q: (x["engine"], x["precision"]) if q == r
                                                           else chain.ref_of(q) for q in chain.subs}
                  for x in rows[r] if x["passed"] and (x["engine"], x["precision"]) != chain.ref_of(r)}
        res = time_combos(chain, combos, threads, shared=tuple(q for q in chain.subs if q != r))
        for x in rows[r]:
            t = res.get("fp32 chain" if (x["engine"], x["precision"]) == chain.ref_of(r)
                        else f"{r}: {x['engine']} {x['precision']}")
            if t:
                x.update(part_s=t["parts"][r], part_rounds=t["part_rounds"][r], chain_s=t["seconds"])
        log.info("[system] %s on the system's pages: %s", r, ", ".join(
            f"{x['engine']} {x['precision']} {x.get('part_s', '-')} s" for x in rows[r]))
    picks = {}
    for r in free:
        picks[r], edge_gates = _admit_on_edge_pages(ctx, chain, r, rows[r], min_speedup, threads)
        gates += edge_gates
    return gates, picks


def _admit_on_edge_pages(ctx, chain: Chain, role: str, rows: list, min_speedup: float, threads: int) -> tuple:
    """choose_part, then the edge judge on the low-precision row it picks (system.edge_pages > 0): a row that
    rewrites the text of tight boxes is EXCLUDED and the part chosen again without it, down to its fp32 row.
    -> ((chosen, rows with verdicts), the edge gate rows)."""
    from pipeline.bundle.system_choice import choose_part
    from pipeline.evaluation.edge_judge import admitted, edge_row

    gates = []
    while True:
        chosen, out = choose_part(role, rows, chain.ref_of(role), min_speedup)
        if chosen["precision"] == "fp32" or not ctx.cfg.system.edge_pages:
            return (chosen, out), gates
        g = edge_row(ctx, chain, role, (chosen["engine"], chosen["precision"]), threads)
        close_engines(chain, "")       # its engines and the fp32 chain's: the stage's peak RSS (issue 48's 4 GB)
        gates.append(g)
        row = next(x for x in rows if (x["engine"], x["precision"]) == (chosen["engine"], chosen["precision"]))
        row["edge_lines_kept"] = g.value
        if admitted(g):
            chosen["edge_lines_kept"] = g.value
            return (chosen, [dict(x, edge_lines_kept=g.value) if x["verdict"] == "chosen" else x for x in out]), gates
        log.info("[system] %s %s %s rewrites the edge pages' text: %s", role, row["engine"], row["precision"],
                 g.reason)
        row.update(passed=False, verdict="rewrites edge text", detail=g.reason)


def served_rows(ctx, chain: Chain, threads: int) -> list[Gate]:
    """What /ocr serves: pinned parts as pinned, the others chosen on the system's pages; the set is gated together
    (falling back part by part to fp32 when it fails together) and timed against the fp32 chain."""
    from pipeline.bundle.system import parts_served
    from pipeline.bundle.system_choice import fallbacks, served_entry

    served = parts_served(ctx.cfg.system, chain.subs)
    gates, picks = _choose(ctx, chain, served, threads)
    for r, (chosen, rows) in picks.items():
        served[r] = served_entry(chain.subs[r], r, chosen, rows, served[r])
    tries = fallbacks({r: c for r, (c, _) in picks.items()})
    for i, combo in enumerate(tries):
        full = {r: combo.get(r) or (p["engine"], p["precision"]) for r, p in served.items()}
        g = combo_row(ctx, chain, SERVED, full, threads)
        g.extra["served"] = True        # a timed choice: the nightly reports a change of its precision
        if g.status == OK or i == len(tries) - 1:
            break
        log.warning("[system] the chosen set %s failed together (%s): the next one puts a part back on fp32",
                    full, g.reason)
    for r, (kind, prec) in full.items():
        if (served[r]["engine"], served[r]["precision"]) != (kind, prec):
            served[r].update(engine=kind, precision=prec, by="system pages (fallback)",
                             why=f"fp32 fallback: the chosen set failed its gate together ({g.reason})")
    for r, p in served.items():
        log.info("[system] %s serves %s %s (%s): %s", r, p["engine"], p["precision"], p["by"], p["why"])
    if ctx.cfg.system.edge_pages and any(p != "fp32" for _, p in full.values()):
        from pipeline.evaluation.edge_judge import served_set_reading

        close_engines(chain, "")    # the served row's engines: the edge reading loads the fp32 chain's first
        try:
            e = served_set_reading(ctx, chain, full, threads)
            log.info("[system] the served set on the edge pages (recorded, not gated): %s of %s lines changed",
                     e["changed"], e["of"])
        except Exception as exc:    # a record, not a gate: its failure is written down, the stage goes on
            e = {"error": f"{type(exc).__name__}: {exc}"}
            log.warning("[system] the served set could not read the edge pages: %s", e["error"])
        g.extra["edge_pages"] = e
        close_engines(chain, "")
    t = time_combos(chain, {"as served": full}, threads)
    g.extra.update(served=served, timing={**t, "how": "interleaved, fresh engines warmed on the same pages, pages "
                                                      "of varied shape"},
                   chain_speedup_vs_fp32=round(t["fp32 chain"]["seconds"] / t["as served"]["seconds"], 3))
    chain.served = served
    close_engines(chain, "")       # the HTTP row and verify load their own
    return gates + [g]
