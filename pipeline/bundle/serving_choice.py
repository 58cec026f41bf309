"""Which engine `serve` runs for a bundle: the server stage's recommendation, or an explicit override.

infer_config.yaml's `serving` section (written by the bundle stage from server/serving.json; pipeline/bundle/recommend.py):
    engine: onnxruntime            # the fastest row within server.recommend's budget, low precision included
    precision: int8                # fp32 | bf16 | int8 | fp16 (GPU); absent in bundles made before: fp32
    model: server/onnx/model_int8.onnx   # relative to the bundle folder
    by: latency
    settings: {batch1: {threads: 1}, batchN: {threads: 2}}   # per batch profile (+ ir_optim for Paddle)
    why: "fastest within budget: 1.8x fp32 ..."; fp32: what fp32 would have given; candidates: every row's verdict
    tolerance: {atol, rtol, key}   # the served row's gate tolerance: `verify` checks the samples with it
    ranking: [...]; tuning: {kind: fp32 settings}
"""
from __future__ import annotations

import logging
from pathlib import Path

from pipeline.bundle import layout as bundle_layout
from pipeline.engines.base import Engine
from pipeline.core.errors import ConfigError, MissingArtifact
from pipeline.bundle.recommend import SERVABLE

MODEL_PATHS = bundle_layout.SERVING_MODELS      # fp32 model per engine (stages/system.py imports this name)
_DEFAULT_SETTINGS = {"batch1": {"threads": 1}, "batchN": {"threads": 0}}
log = logging.getLogger("pipeline.serving.app")


def serving_choice(infer_cfg: dict, override: str | None = None, precision: str | None = None) -> tuple[str, str, dict]:
    """(engine kind, precision, per-profile settings) to serve; bundles without a recommendation get Paddle
    Inference fp32, bundles made before low-precision serving (no `precision`) their fp32 engine."""
    rec = infer_cfg.get("serving") or {}
    kind = override or rec.get("engine") or "paddle-inference"
    if kind not in MODEL_PATHS:
        raise ConfigError(f"unknown engine {kind!r}", hint=f"one of {', '.join(MODEL_PATHS)}")
    same_engine = kind == rec.get("engine")
    prec = precision or ((rec.get("precision") or "fp32") if same_engine else "fp32")
    if (kind, prec) not in SERVABLE:
        able = sorted(p for k, p in SERVABLE if k == kind)
        raise ConfigError(f"{kind} does not serve {prec!r}", hint=f"--precision {' | '.join(able)} for {kind}")
    if same_engine and prec == (rec.get("precision") or "fp32") and "batch1" in (rec.get("settings") or {}):
        return kind, prec, rec["settings"]
    return kind, prec, precision_settings(kind, prec, rec.get("tuning", {}).get(kind))


def precision_settings(kind: str, precision: str, tuned: dict | None, keep_fp32_ops: list[str] | None = None) -> dict:
    """Per-profile settings to serve `kind` at `precision`: its fp32 row's tuned ones; another precision borrows
    that engine's thread counts (Paddle's IR passes stay on: oneDNN's bf16/int8 kernels come from them).
    keep_fp32_ops: Paddle Inference fp16's mixed-precision black list (server.fp16.keep_fp32_ops), recorded so that
    the predictor that serves the converted model gets the list it was converted with."""
    settings = tuned if tuned and "batch1" in tuned else _DEFAULT_SETTINGS
    if precision == "fp32":
        return settings
    extra = {"ir_optim": True} if kind == "paddle-inference" else {}
    if kind == "paddle-inference" and precision == "fp16" and keep_fp32_ops:
        extra["keep_fp32_ops"] = sorted(keep_fp32_ops)
    return {p: {"threads": settings[p]["threads"], **extra} for p in ("batch1", "batchN")}


def _runnable_precision(kind: str, precision: str) -> str:
    """bf16 where this CPU has none: Paddle refuses it, OpenVINO would silently run f32, so serve fp32 and say so."""
    if precision != "bf16":
        return precision
    from pipeline.core.capabilities import bf16_cpu_status

    ok, why = bf16_cpu_status()
    if not ok:
        log.warning("the bundle recommends %s bf16, but %s: serving %s fp32", kind, why, kind)
        return "fp32"
    return precision


def load_engine(folder: Path, infer_cfg: dict, override: str | None = None, threads: int = 0,
                precision: str | None = None) -> Engine:
    """The served engine at its precision, one instance per batch profile with its measured thread count (and
    engine options, e.g. Paddle Inference's ir_optim). threads > 0 forces that count for both profiles."""
    from pipeline.engines import registry
    from pipeline.core.env import cpu_count

    kind, prec, settings = serving_choice(infer_cfg, override, precision)
    prec = _runnable_precision(kind, prec)
    model = folder / bundle_layout.serving_model(kind, prec)
    if not bundle_layout.model_exists(model):
        raise MissingArtifact(f"the bundle has no {prec} model for engine {kind}: {model}",
                              hint="pick another --engine/--precision (paddle-inference fp32 is always bundled)")
    cores = cpu_count()
    pick = {p: (threads or settings[p]["threads"] or cores) for p in ("batch1", "batchN")}
    opts = {"device": "gpu"} if kind == "paddle-inference" and prec == "fp16" else {}
    # no spinning pool threads: they busy-wait after every call on cores the event loop, the HTTP stack
    # and the clients need (measured: ORT with 2 threads burnt ~1.2 ms of CPU per OCR /predict, 2.6 vs 1.4 ms)
    return registry.make_routed(kind, model, prec, {p: {**settings[p], "threads": min(t, cores)}
                                                   for p, t in pick.items()}, spin=False, **opts)
