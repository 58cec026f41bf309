"""A model bundle's fp32 reference: the engine and model its samples' expected outputs came from, which `verify` runs
first, `serve` falls back to, and the OCR system's fp32 chain runs.

A Paddle program's bundle: Paddle Inference fp32 on server/fp32/inference (every bundle made before ONNX imports were
bundled, which records nothing). An imported ONNX model's (model.source=onnx: no Paddle program exists): ONNX Runtime
fp32 on server/onnx/model.onnx, CPU execution provider, at the graph optimization level the import's own reference
used (basic: constant folding and redundant-node removal, no fusions; pipeline/models/onnx_import.py), i.e. the
engine that wrote the export's reference outputs, from which the samples come.
infer_config.yaml `reference` and manifest.json `reference` say which (written by the bundle stage from `record`).
"""
from __future__ import annotations

from pathlib import Path

from pipeline.bundle import layout
from pipeline.engines.base import Engine

ONNX_WHY = ("model.source=onnx: no Paddle program; the import's own reference engine, which wrote the samples' "
            "expected outputs")


def record(info: dict) -> dict:
    """The `reference` record of a bundle made from an export whose info.json is `info`."""
    if info.get("source") != "onnx":
        return {"engine": "paddle-inference", "precision": "fp32", "model": layout.REFERENCE_MODELS["paddle-inference"]}
    imported = (info.get("imported") or {}).get("reference") or {}
    return {"engine": "onnxruntime", "precision": "fp32", "model": layout.REFERENCE_MODELS["onnxruntime"],
            "provider": imported.get("provider", "CPUExecutionProvider"),
            "graph_optimization": imported.get("graph_optimization", "basic"), "why": ONNX_WHY}


def pair(infer_cfg: dict) -> tuple[str, str]:
    """(engine, "fp32") of the reference, as serving rows are named."""
    return layout.reference_of(infer_cfg)[0], "fp32"


def label(infer_cfg: dict) -> str:
    """What `verify` calls the reference's check: "server fp32" for Paddle Inference (as always), else
    "reference onnxruntime fp32 (basic)"."""
    kind, _ = layout.reference_of(infer_cfg)
    if kind == layout.DEFAULT_REFERENCE:
        return "server fp32"
    return f"reference {kind} fp32 ({(infer_cfg.get('reference') or {}).get('graph_optimization', 'basic')})"


def engine(folder: Path, infer_cfg: dict, threads: int) -> Engine:
    """The reference engine on the bundle's reference model (ONNX Runtime's pool threads sleep between calls)."""
    kind, rel = layout.reference_of(infer_cfg)
    if kind == "paddle-inference":
        from pipeline.engines.paddle_infer import InferenceEngine

        return InferenceEngine(Path(folder) / rel, "fp32", threads=threads)
    from pipeline.engines.ort import OrtEngine

    opt = (infer_cfg.get("reference") or {}).get("graph_optimization", "basic")
    return OrtEngine(Path(folder) / rel, threads=threads, graph_optimization=opt, spin=False)
