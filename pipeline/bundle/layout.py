"""Where things live inside a bundle: the one place that spells the bundle's paths (MLflow's MLmodel layout idea).

Every writer (bundle and system stages) and every reader (verify, serve, the nightly, benchmarks) asks here,
so a path changes in one line. Paths are relative to the bundle folder, POSIX style (they go into manifests).

    server/fp32/inference.pdmodel|.pdiparams   Paddle Inference FP32 (the reference)
    server/<precision>/model.pdmodel|...        low-precision Paddle models (int8 from PaddleSlim, fp16 on GPU)
    server/onnx/model.onnx                      paddle2onnx export (ONNX Runtime and OpenVINO fp32; OpenVINO bf16);
                                                model.source=onnx: the imported file, and the reference (no Paddle
                                                program: ONNX Runtime fp32 at basic graph optimizations)
    server/onnx/model_int8.onnx                 ONNX Runtime static int8 (QDQ)
    server/openvino/model_int8.xml|.bin         OpenVINO int8 (NNCF)
    server/openvino/model_bf16.xml|.bin         OpenVINO bf16: the fused f32 IR with server.bf16.openvino_keep_fp32's
                                                layers marked `precise` (a bundle from before it is refused when
                                                that row is loaded)
    mobile/<target>_<precision>.nb              Paddle Lite
    infer_config.yaml                           input spec, pre/post-processing, labels, serving choice
    samples/NNN.png + samples/expected.npz      sample inputs and the FP32 outputs for them
    MODEL_CARD.md, manifest.json, model.sig
"""
from __future__ import annotations

from pathlib import Path

FP32_PREFIX = "server/fp32/inference"            # + .pdmodel / .pdiparams
ONNX_MODEL = "server/onnx/model.onnx"
INFER_CONFIG = "infer_config.yaml"
SAMPLES_DIR = "samples"
SAMPLES_EXPECTED = "samples/expected.npz"
SAMPLE_PNG = "samples/{:03d}.png"
SYSTEM_SAMPLE_PNG = "samples/page_{:03d}.png"     # OCR system bundle: sample pages
SYSTEM_SAMPLES_EXPECTED = "samples/expected.json"  # ... and the fp32 chain's lines on them
MODEL_CARD = "MODEL_CARD.md"
MANIFEST = "manifest.json"

ONNX_INT8 = "server/onnx/model_int8.onnx"
OPENVINO_INT8 = "server/openvino/model_int8.xml"  # + .bin next to it
OPENVINO_BF16 = "server/openvino/model_bf16.xml"  # + .bin: the IR the bf16 row was gated on (its keep list marked)

# the fp32 reference of a model bundle (what its samples' expected outputs come from, `verify` runs first and the OCR
# system's fp32 chain runs): engine -> its model; infer_config.yaml `reference` names the engine (absent in bundles
# made before ONNX imports were bundled: Paddle Inference)
REFERENCE_MODELS = {"paddle-inference": FP32_PREFIX, "onnxruntime": ONNX_MODEL}
DEFAULT_REFERENCE = "paddle-inference"

# the model file each serving engine loads at fp32 (relative to the bundle folder)
SERVING_MODELS = {"paddle-inference": FP32_PREFIX, "onnxruntime": ONNX_MODEL, "openvino": ONNX_MODEL}
# low-precision rows that load another file; Paddle bf16 is the fp32 model with the engine's bf16 switch, OpenVINO
# bf16 the IR its row was gated on (the layers kept f32 are marked in it: serving the ONNX model with the bf16 hint
# would run every layer bf16, which is not what the gate judged)
_LOW_PRECISION_MODELS = {("paddle-inference", "int8"): "server/int8/model", ("paddle-inference", "fp16"): "server/fp16/model",
                         ("onnxruntime", "int8"): ONNX_INT8, ("openvino", "int8"): OPENVINO_INT8,
                         ("openvino", "bf16"): OPENVINO_BF16}
# where the server stage writes those (relative to its run folder) -> where the bundle keeps them
SERVER_STAGE_MODELS = {"onnx/model_int8.onnx": ONNX_INT8, "openvino/model_int8.xml": OPENVINO_INT8,
                       "openvino/model_int8.bin": "server/openvino/model_int8.bin",
                       "openvino/model_bf16.xml": OPENVINO_BF16, "openvino/model_bf16.bin": "server/openvino/model_bf16.bin"}


def server_stage_model(server_dir, export_prefix, kind: str, precision: str):
    """Where the server stage wrote the model a row runs, inside its run (a Paddle prefix for paddle-inference;
    bf16 runs the fp32 model with the engine's bf16 switch); None for an engine without server-stage files."""
    if kind == "paddle-inference":
        return export_prefix if precision in ("fp32", "bf16") else server_dir / "models" / precision / "model"
    if kind not in ("onnxruntime", "openvino"):
        return None
    if precision == "int8":
        return server_dir / ("onnx/model_int8.onnx" if kind == "onnxruntime" else "openvino/model_int8.xml")
    if (kind, precision) == ("openvino", "bf16"):       # the IR the row was gated on (a declared server output)
        return server_dir / "openvino" / "model_bf16.xml"
    return server_dir / "onnx" / "model.onnx"


def serving_model(kind: str, precision: str, folder=None) -> str:
    """The bundle path an engine loads at a precision (a Paddle prefix for paddle-inference); always that row's own
    file, never a stand-in: a bundle made before OpenVINO bf16 had its own IR lacks it, and loading that row says so
    (missing_model_line). `folder` is accepted for callers that pass the bundle; the path does not depend on it."""
    return _LOW_PRECISION_MODELS.get((kind, precision), SERVING_MODELS[kind])


def missing_model_line(folder, kind: str, precision: str) -> str:
    """One line for a bundle that lacks the file its row loads (e.g. one made before the OpenVINO bf16 IR was bundled:
    serving the ONNX model with the bf16 hint would run every layer bf16, not what the gate judged)."""
    rel = serving_model(kind, precision)
    why = " (a bundle made before that row's own IR was bundled)" if rel == OPENVINO_BF16 else ""
    return f"the bundle has no {precision} model for engine {kind}: {Path(folder) / rel}{why}"


def model_exists(path) -> bool:
    """A Paddle prefix exists when its .pdmodel does; any other model is one file."""
    p = Path(path)
    return p.is_file() or Path(str(p) + ".pdmodel").is_file()


def server_prefix(precision: str) -> str:
    """Paddle Inference model prefix of a precision (fp32 keeps the export's `inference` name)."""
    return FP32_PREFIX if precision == "fp32" else f"server/{precision}/model"


def mobile_nb(target: str, precision: str) -> str:
    return f"mobile/{target}_{precision}.nb"


def reference_of(infer_cfg: dict) -> tuple[str, str]:
    """(engine, model path) of a model bundle's fp32 reference, from its infer_config's `reference` record; the path
    comes from REFERENCE_MODELS, never from the file."""
    from pipeline.core.errors import IntegrityError

    ref = infer_cfg.get("reference") or {}
    kind = ref.get("engine", DEFAULT_REFERENCE) if isinstance(ref, dict) else None
    if kind not in REFERENCE_MODELS:
        raise IntegrityError(f"{INFER_CONFIG}: reference engine {kind!r} is not one a bundle can hold",
                             hint=f"one of {', '.join(REFERENCE_MODELS)}; rebuild the bundle with `make deploy`")
    return kind, REFERENCE_MODELS[kind]
