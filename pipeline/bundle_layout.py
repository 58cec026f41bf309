"""Where things live inside a bundle: the one place that spells the bundle's paths (MLflow's MLmodel layout idea).

Every writer (bundle and system stages) and every reader (verify, serve, the nightly, benchmarks) asks here,
so a path changes in one line. Paths are relative to the bundle folder, POSIX style (they go into manifests).

    server/fp32/inference.pdmodel|.pdiparams   Paddle Inference FP32 (the reference)
    server/<precision>/model.pdmodel|...        low-precision Paddle models (int8 from PaddleSlim, fp16 on GPU)
    server/onnx/model.onnx                      paddle2onnx export (ONNX Runtime and OpenVINO fp32)
    mobile/<target>_<precision>.nb              Paddle Lite
    infer_config.yaml                           input spec, pre/post-processing, labels, serving choice
    samples/NNN.png + samples/expected.npz      sample inputs and the FP32 outputs for them
    MODEL_CARD.md, manifest.json, model.sig
"""
from __future__ import annotations

FP32_PREFIX = "server/fp32/inference"            # + .pdmodel / .pdiparams
ONNX_MODEL = "server/onnx/model.onnx"
INFER_CONFIG = "infer_config.yaml"
SAMPLES_DIR = "samples"
SAMPLES_EXPECTED = "samples/expected.npz"
SAMPLE_PNG = "samples/{:03d}.png"
MODEL_CARD = "MODEL_CARD.md"
MANIFEST = "manifest.json"

# the model file each serving engine loads (relative to the bundle folder)
SERVING_MODELS = {"paddle-inference": FP32_PREFIX, "onnxruntime": ONNX_MODEL, "openvino": ONNX_MODEL}


def server_prefix(precision: str) -> str:
    """Paddle Inference model prefix of a precision (fp32 keeps the export's `inference` name)."""
    return FP32_PREFIX if precision == "fp32" else f"server/{precision}/model"


def mobile_nb(target: str, precision: str) -> str:
    return f"mobile/{target}_{precision}.nb"
