"""The HTTP gates: the service users will run, started on a free local port and gated like an engine row (/predict
on the server stage's recommended engine, /ocr on the OCR system bundle as served); and whether the served engine
pays to batch concurrent requests (serve.batching), recorded for the bundle."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.bundle.system_choice import SERVED
from pipeline.core.gates import FAIL, OK, Check, Gate, evaluate_tol, run_row
from pipeline.evaluation.system_rows import METRIC, Chain, precision_label

log = logging.getLogger("pipeline")


def _serve_batching(ctx) -> dict:
    return ctx.cfg.serve.batching.model_dump()


def served_batching(ctx, engine, input_shape: list, preprocess: dict) -> dict:
    """Would concurrent requests pay to share the recommended engine's calls (serve.batching)? Recorded for the
    bundle; `serve` measures again at start-up, on the machine that serves."""
    from pipeline.serving.batching import decide, describe, served_shape

    choice = decide(engine.run, served_shape(input_shape, preprocess)[1:], _serve_batching(ctx))
    log.info("[server] %s", describe(choice))
    return choice


def predict_http_row(ctx, ref, threads, engine=None, precision: str = "fp32", decided: dict | None = None) -> Gate:
    """The HTTP service users will run (the recommended engine at its precision), started on a free local port
    and gated like an engine with that precision's tolerance. decided: the batching choice served_batching measured a
    moment ago on this engine, taken as is (measuring it again cost the v4 det row ~10 s)."""
    # one subject whatever is served: the nightly matches gates by subject, and the served row is a timed choice that
    # may change between nights (its precision is the gate's; a change is reported by the nightly, not a missing row)
    subject = "http /predict as served"
    batching = _serve_batching(ctx)
    if decided:
        batching["mode"] = "on" if decided["enabled"] else "off"
    gate = run_row("server", subject, precision, ref.task.primary_metric,
                   lambda: _http_gate_row(ctx, ref, threads, engine, subject, precision, batching),
                   ctx.out_dir / "evidence")
    gate.extra["served"] = True         # a timed choice: the nightly reports a change of its precision
    return gate


def _http_gate_row(ctx, ref, threads, engine, subject: str, precision: str, batching: dict) -> Gate:
    from pipeline.serving.predict import http_gate

    sc, task, info, labels, ref_out = ctx.cfg.server, ref.task, ref.info, ref.labels, ref.outputs
    t0 = time.perf_counter()
    infer_cfg = {"task": info["task"], "input": {"shape": [None] + info["input_shape"][1:]},
                 "preprocess": info["preprocess"], "postprocess": info["postprocess"]}
    res = http_gate(ref.model_prefix, infer_cfg, ref.images, labels, info["task"], max_requests=sc.http.max_requests,
                    threads=threads, engine=engine, batching=batching)
    n = res["n"]
    effective = engine.effective_precision if engine is not None else "fp32"
    gate = Gate("server", subject, precision, effective, task.primary_metric,
                reference=task.metrics(ref_out[:n], labels[:n])[task.primary_metric])
    # images go through PNG decode + preprocessing on the server: same code path, the served precision's tolerance
    evaluate_tol(gate, res["outputs"], ref_out[:n], sc.gates[precision], res["metric"], task,
                 key=f"server.gates.{precision}")
    gate.extra.update(latency_ms=res["latency_ms"], requests=n, engine=res["engine"])
    gate.seconds = round(time.perf_counter() - t0, 2)
    return gate


def ocr_http_row(ctx, folder: Path, chain: Chain, threads) -> Gate:
    """/ocr over HTTP must read as the same engines did in process (the fp32 chain, or the system.engine row)."""
    from pipeline.serving.app import http_ocr_gate
    from pipeline.ocr.system_metrics import agreement

    pages, auto = chain.pages, ctx.cfg.system.engine == "auto"
    ref_lines = chain.row_lines.get(SERVED if auto else f"{ctx.cfg.system.engine} fp32", chain.lines)
    n = min(ctx.cfg.system.http_pages, len(pages["images"]))
    subject = "http /ocr as served" if auto else "http /ocr fp32"
    engine = "served" if auto else ctx.cfg.system.engine
    limit = ctx.cfg.system.gates["http"]

    # requested: what the system stage chose to serve (chain.served); effective: what the loaded engines ran
    requested = (precision_label(chain.served[r]["precision"] for r in chain.subs) if auto and chain.served
                 else "fp32")

    def serve() -> Gate:
        res = http_ocr_gate(folder, list(pages["images"][:n]), threads=threads)
        diff = 1.0 - agreement(res["lines"], ref_lines[:n])
        effective = precision_label(res["parts"][r]["precision"] for r in chain.subs if r in res["parts"])
        g = Gate("system", subject, requested, effective, "lines_differing", value=diff,
                 checks=[Check(f"lines_differing_from_{engine}_chain", diff, limit, "<=",
                               diff <= limit + 1e-12, "system.gates.http")])
        g.status = OK if g.checks[0].passed else FAIL
        g.reason = "" if g.status == OK else g.checks[0].describe()
        g.extra = {"latency_ms": res["latency_ms"], "requests": n, "parts": res["parts"]}
        return g

    t0 = time.perf_counter()
    g = run_row("system", subject, requested, METRIC, serve, chain.evidence)
    g.seconds = round(time.perf_counter() - t0, 2)
    return g

