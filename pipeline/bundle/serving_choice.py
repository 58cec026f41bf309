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
from pipeline.core.capabilities import ISA_ENV, KERNEL_TIERS, engine_flags, kernel_family

MODEL_PATHS = bundle_layout.SERVING_MODELS      # fp32 model per engine (evaluation/system_engines.py imports this name)
_DEFAULT_SETTINGS = {"batch1": {"threads": 1}, "batchN": {"threads": 0}}
log = logging.getLogger("pipeline.serving.app")


def serving_choice(infer_cfg: dict, override: str | None = None, precision: str | None = None) -> tuple[str, str, dict]:
    """(engine kind, precision, per-profile settings) to serve; bundles without a recommendation get their reference
    engine at fp32 (Paddle Inference, or ONNX Runtime for an ONNX import), bundles made before low-precision serving
    (no `precision`) their fp32 engine."""
    rec = infer_cfg.get("serving") or {}
    kind = override or rec.get("engine") or bundle_layout.reference_of(infer_cfg)[0]
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


PASSED = ("chosen", "slower")      # verdicts of rows that passed every check and min_speedup (pipeline/bundle/recommend.py)


def built_record(folder: Path) -> dict | None:
    """manifest.json hardware.capabilities of a model bundle (pipeline/core/capabilities.describe); None for bundles
    without that record."""
    from pipeline.bundle.format import read_manifest
    from pipeline.core.errors import IntegrityError

    try:
        caps = read_manifest(folder)["hardware"]["capabilities"]
        return caps if isinstance(caps, dict) else None
    except (IntegrityError, KeyError, TypeError, AttributeError):
        return None


def built_flags(caps: dict | None, engine: str | None = None) -> frozenset | None:
    """The bf16/VNNI/AMX flags of the CPU a bundle was measured on (its built_record); None without a record. With an
    engine: the flags its kernels could use there, under the ONEDNN_MAX_CPU_ISA cap the build ran with (a bundle
    built and served under the same cap runs the same kernels)."""
    if caps is None:
        return None
    flags = frozenset(caps.get("bf16") or []) | frozenset(caps.get("vnni") or [])
    cap = caps.get("onednn_isa_cap")
    return engine_flags(engine, flags, cap=cap) if engine and isinstance(cap, str) and cap else flags


def kernel_refusal(precision: str, built: frozenset | None, here: frozenset) -> str | None:
    """Why this CPU must not serve a row of `precision` measured on a CPU with `built` flags (None: it may)."""
    mine = kernel_family(precision, here)
    if mine is None:
        return f"this CPU lacks avx512_bf16/amx_bf16 ({precision} cannot run)"
    if built is None or precision not in KERNEL_TIERS:
        return None
    theirs = kernel_family(precision, built)
    if theirs != mine:
        return f"gated and timed on {theirs} {precision} kernels, this CPU runs {mine} ones (never gated here)"
    return None


def _interleaved(rec: dict) -> bool:
    """The record's ranking is one interleaved measurement (pipeline/engines/registry.rank's timing marker)."""
    from pipeline.bundle.recommend import interleaved_session

    try:
        return interleaved_session(rec.get("ranking") or []) is not None
    except ValueError:
        return False


def _rerank(folder: Path, rec: dict, built: dict | None, here: frozenset) -> dict | None:
    """The fastest row that passed and this CPU may run, by the record's own interleaved ranking (None: none,
    or the record's figures were not taken side by side)."""
    if not _interleaved(rec):
        return None
    ok = [c for c in rec.get("candidates") or [] if c.get("verdict") in PASSED
          and kernel_refusal(c["precision"], built_flags(built, c["engine"]), engine_flags(c["engine"], here)) is None
          and bundle_layout.model_exists(Path(folder) / bundle_layout.serving_model(c["engine"], c["precision"], folder))]
    if rec.get("by") == "throughput":
        ok = [c for c in ok if c.get("throughput_sps")]
        return max(ok, key=lambda c: c["throughput_sps"], default=None)
    ok = [c for c in ok if c.get("latency_ms")]
    return min(ok, key=lambda c: c["latency_ms"], default=None)


def runnable_choice(folder: Path, infer_cfg: dict, here: frozenset | None = None) -> dict:
    """What a bundle serves on THIS CPU: its recommendation when this CPU runs the kernels it was gated and timed on,
    else the fastest other row that passed (the recorded interleaved ranking), else fp32. Returns {"engine",
    "precision", "settings", "why", "cpu"}; "cpu" says what changed, in one line (load_engine logs it)."""
    from pipeline.core.capabilities import cpu_flags

    here = cpu_flags() if here is None else here
    rec = infer_cfg.get("serving") or {}
    kind, prec, settings = serving_choice(infer_cfg)
    why = rec.get("why") or (f"no recommendation recorded: the reference engine, {kind} fp32" if not rec
                             else "recommended")
    built = built_record(folder)
    refused = kernel_refusal(prec, built_flags(built, kind), engine_flags(kind, here))   # the cap: oneDNN engines
    if refused is not None and engine_flags(kind, here) != here:
        refused += f" ({ISA_ENV} caps {kind}'s oneDNN kernels)"
    if refused is None:
        return {"engine": kind, "precision": prec, "settings": settings, "why": why, "cpu": None}
    alt = _rerank(folder, rec, built, here)
    if alt is not None:
        kind2, prec2 = alt["engine"], alt["precision"]
        how = f"next fastest that passed, {alt.get('speedup_vs_fp32', 1.0):.2f}x fp32 in the bundle's interleaved ranking"
    else:
        kind2, prec2 = (rec.get("fp32") or {}).get("engine") or kind, "fp32"
        how = "fp32 fallback (no other row passed, or the ranking was not interleaved)"
    _, _, settings2 = serving_choice(infer_cfg, kind2, prec2)
    note = f"the bundle recommends {kind} {prec}, but {refused}: serving {kind2} {prec2} ({how})"
    return {"engine": kind2, "precision": prec2, "settings": settings2, "why": f"re-ranked on this CPU: {how}",
            "cpu": note}


def _runnable_precision(kind: str, precision: str) -> str:
    """An explicitly asked precision this CPU cannot run (bf16 without bf16: Paddle refuses it, OpenVINO would
    silently run f32): serve fp32 and say so."""
    from pipeline.core.capabilities import cpu_flags

    if kernel_family(precision, engine_flags(kind, cpu_flags())) is None:
        log.warning("%s %s asked for, but this CPU (or %s) has no avx512_bf16/amx_bf16: serving %s fp32", kind,
                    precision, ISA_ENV, kind)
        return "fp32"
    return precision


def load_engine(folder: Path, infer_cfg: dict, override: str | None = None, threads: int = 0,
                precision: str | None = None, label: str = "", static_shapes: int = 0) -> Engine:
    """The served engine at its precision, one instance per batch profile with its measured thread count (and
    engine options, e.g. Paddle Inference's ir_optim). threads > 0 forces that count for both profiles. Without
    override/precision: the recommendation as this CPU may run it (runnable_choice). `engine.serving` records
    what was chosen and why (GET /health shows it). static_shapes: an OpenVINO engine compiles each input shape it
    meets, keeping that many (ov.ShapeCache; the flow's det_static_shapes); other runtimes have no such step."""
    from pipeline.engines import registry
    from pipeline.core.env import cpu_count

    if override or precision:
        kind, prec, settings = serving_choice(infer_cfg, override, precision)
        prec = _runnable_precision(kind, prec)
        if prec == "fp32" and precision not in (None, "fp32"):
            settings = serving_choice(infer_cfg, kind, "fp32")[2]
        chosen = {"engine": kind, "precision": prec, "why": "pinned: " + " ".join(p for p in (override, precision)
                                                                                   if p), "cpu": None}
    else:
        chosen = runnable_choice(folder, infer_cfg)
        kind, prec, settings = chosen.pop("engine"), chosen.pop("precision"), chosen.pop("settings")
        chosen = {"engine": kind, "precision": prec, **chosen}
    if chosen.get("cpu"):
        log.warning("%s%s", f"{label}: " if label else "", chosen["cpu"])
    model = folder / bundle_layout.serving_model(kind, prec, folder)
    if not bundle_layout.model_exists(model):
        ref_kind, _ = bundle_layout.reference_of(infer_cfg)
        raise MissingArtifact(bundle_layout.missing_model_line(folder, kind, prec),
                              hint=f"rebuild it with `make deploy`, or pick another --engine/--precision ({ref_kind} "
                                   "fp32, its reference, is always bundled)")
    cores = cpu_count()
    pick = {p: (threads or settings[p]["threads"] or cores) for p in ("batch1", "batchN")}
    opts = {"device": "gpu"} if kind == "paddle-inference" and prec == "fp16" else {}
    if kind == "openvino" and static_shapes:    # the only runtime here that compiles per shape (ov.ShapeCache)
        opts["static_shapes"] = int(static_shapes)
    # no spinning pool threads: they busy-wait after every call on cores the event loop, the HTTP stack
    # and the clients need (measured: ORT with 2 threads burnt ~1.2 ms of CPU per OCR /predict, 2.6 vs 1.4 ms)
    eng = registry.make_routed(kind, model, prec, {p: {**settings[p], "threads": min(t, cores)}
                                                  for p, t in pick.items()}, spin=False, **opts)
    eng.serving = {**chosen, "effective_precision": eng.effective_precision}
    return eng
