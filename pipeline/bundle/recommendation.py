"""What a model bundle serves, decided at deploy time on the server stage's rows: every servable row screened against
server.recommend, the candidates loaded as `serve` would run them and ranked side by side (interleaved), the fastest
within budget chosen (the rules: `recommend`), and the record serving.json keeps of it (what, why, what fp32 would
have given, every candidate's verdict)."""
from __future__ import annotations

import logging

from pipeline.bundle import layout as bundle_layout
from pipeline.bundle.serving_choice import precision_settings
from pipeline.core.errors import PipelineError
from pipeline.core.gates import Gate
from pipeline.engines import evidence

log = logging.getLogger("pipeline")


def recommend_serving(ctx, ref, gates: list[Gate], served: dict, tuning: dict):
    """Every servable row screened against server.recommend, the candidates ranked side by side (interleaved),
    the fastest within budget chosen (pipeline/bundle/recommend.py) -> (serving record or None, its engine or None)."""
    from pipeline.bundle import recommend as rec
    from pipeline.engines import registry

    sc, rc = ctx.cfg.server, ctx.cfg.server.recommend
    cands = rec.screen(gates, rc, samples=len(ref.inputs))
    engines = _candidate_engines(ctx, ref, cands, served, tuning)
    rows = registry.rank(engines, ref.inputs, batch_size=ctx.batches["perf"], warmup=sc.perf.warmup,
                         repeats=sc.perf.repeats, rounds=sc.tuning.rounds, by=rc.by) if engines else []
    picked = rec.choose(cands, rows, rc)
    for c in cands:
        log.info("[server] serving candidate %s", c.line())
    for row, e in engines.items():
        if picked is None or row != picked[0].row:
            e.close()
    if picked is None:
        log.info("[server] nothing to recommend: no fp32 row passed its gate")
        return None, None
    chosen, base = picked
    record = _serving_record(ctx, chosen, base, cands, rows, tuning, ref.task.primary_metric)
    log.info("[server] serving %s: %s", chosen.row, record["why"])
    return record, engines[chosen.row]


def _serving_record(ctx, chosen, base, cands, rows: list[dict], tuning: dict, metric: str) -> dict:
    """serving.json: what is served and why, what fp32 would have given, every candidate with its verdict."""
    from pipeline.bundle import recommend as rec

    sc, rc = ctx.cfg.server, ctx.cfg.server.recommend
    tol = sc.gates[chosen.precision]
    return {"engine": chosen.engine, "precision": chosen.precision, "row": chosen.row,
            "model": bundle_layout.serving_model(chosen.engine, chosen.precision), "by": rc.by,
            "settings": precision_settings(chosen.engine, chosen.precision, tuning.get(chosen.engine),
                                          sc.fp16.keep_fp32_ops),
            "why": rec.why(chosen, base, cands, rc, metric),
            "fp32": rec.fp32_baseline(base),
            "budget": {"precisions": list(rc.precisions), "max_metric_drop": rc.max_metric_drop,
                       "min_agreement": rc.min_agreement, "min_speedup": rc.min_speedup},
            # the served row's own tolerance: `verify` checks the bundle's samples with it
            "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "prob_atol": tol.prob_atol,
                          "key": f"server.gates.{chosen.precision}"},
            "candidates": [c.to_dict() for c in cands], "ranking": rows, "tuning": tuning}


def _candidate_engines(ctx, ref, cands, served: dict, tuning: dict) -> dict:
    """Row subject -> engine as `serve` would run it, for every candidate (fp32: the tuned instances)."""
    from pipeline.bundle import recommend as rec
    from pipeline.engines import registry

    sc, engines = ctx.cfg.server, {}
    for c in (c for c in cands if c.verdict == rec.CANDIDATE):
        if c.precision == "fp32":
            if c.engine in served:
                engines[c.row] = served[c.engine]
            continue
        opts = {"mkldnn": sc.mkldnn, **({"device": "gpu"} if c.precision == "fp16" else {})} \
            if c.engine == "paddle-inference" else {}
        model = bundle_layout.server_stage_model(ctx.out_dir, ref.model_prefix, c.engine, c.precision)
        try:
            settings = precision_settings(c.engine, c.precision, tuning.get(c.engine), sc.fp16.keep_fp32_ops)
            eng = registry.make_routed(c.engine, model, c.precision, settings, spin=False, **opts)
        except PipelineError as exc:
            c.verdict, c.detail = "failed to load", exc.one_line()
            continue
        if evidence.head(eng.effective_precision) != c.precision:     # the served instance must show it too
            c.verdict, c.detail = "no evidence", f"the serving instance ran {eng.effective_precision}"
            eng.close()
            continue
        engines[c.row] = eng
    return engines

