"""Which engine `serve` runs for a bundle: the server stage's recommendation, or an explicit override.

infer_config.yaml's `serving` section (written by the bundle stage from server/serving.json):
    engine: onnxruntime            # fastest fp32 engine that passed its gate
    precision: fp32
    model: server/onnx/model.onnx  # relative to the bundle folder
    by: latency
    settings: {batch1: {threads: 1}, batchN: {threads: 2}}   # measured per batch profile (+ ir_optim for Paddle)
    ranking: [...]                 # every candidate, interleaved measurement, ratios to the fastest
"""
from __future__ import annotations

from pathlib import Path

from . import bundle_layout
from .engines.base import Engine
from .errors import ConfigError, MissingArtifact

MODEL_PATHS = bundle_layout.SERVING_MODELS      # the name stages/system.py imports


def serving_choice(infer_cfg: dict, override: str | None = None) -> tuple[str, dict]:
    """(engine kind, per-profile settings) to serve; bundles without a recommendation get Paddle Inference."""
    rec = infer_cfg.get("serving") or {}
    kind = override or rec.get("engine") or "paddle-inference"
    if kind not in MODEL_PATHS:
        raise ConfigError(f"unknown engine {kind!r}", hint=f"one of {', '.join(MODEL_PATHS)}")
    tuned = rec.get("tuning", {}).get(kind) or {}
    settings = tuned if "batch1" in tuned else {"batch1": {"threads": 1}, "batchN": {"threads": 0}}
    return kind, settings


def load_engine(folder: Path, infer_cfg: dict, override: str | None = None, threads: int = 0) -> Engine:
    """The served engine, one instance per batch profile with its measured thread count (and engine options,
    e.g. Paddle Inference's ir_optim). threads > 0 forces that count for both profiles."""
    from .engines import registry
    from .env import cpu_count

    kind, settings = serving_choice(infer_cfg, override)
    model = folder / MODEL_PATHS[kind]
    exists = Path(str(model) + ".pdmodel") if kind == "paddle-inference" else model
    if not exists.is_file():
        raise MissingArtifact(f"the bundle has no model for engine {kind}: {exists}",
                              hint="pick another --engine (paddle-inference is always bundled)")
    cores = cpu_count()
    pick = {p: (threads or settings[p]["threads"] or cores) for p in ("batch1", "batchN")}
    # no spinning pool threads: they busy-wait after every call on cores the event loop, the HTTP stack
    # and the clients need (measured: ORT with 2 threads burnt ~1.2 ms of CPU per OCR /predict, 2.6 vs 1.4 ms)
    return registry.make_routed(kind, model, "fp32", {p: {**settings[p], "threads": min(t, cores)}
                                                     for p, t in pick.items()}, spin=False)
