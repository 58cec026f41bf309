"""server: server engines and precisions side by side, each row gated against the FP32 export.

Paddle Inference rows: fp32 (oneDNN + IR), fp16 (real on a GPU build; emulated on CPU, labelled so),
bf16 (only where the CPU really has bf16; else SKIPPED — Paddle would silently run fp32), int8
(PaddleSlim PTQ run with oneDNN INT8). ONNX Runtime and OpenVINO rows on the paddle2onnx export: fp32,
and int8 from the same calibration data, OpenVINO bf16 where the CPU has it (CUDA/TensorRT providers only
where a GPU is). Every row that runs also gets latency/throughput figures; fp32 engines are tuned per batch
profile; every row that passed, low precision included, is screened against server.recommend and the fastest
within budget is recommended for serving (pipeline/bundle/recommend.py).
Writes: models/int8 (and models/fp16 on GPU), onnx/model.onnx for the bundle, serving.json, perf.json.
The rows, their tuning and timing and the HTTP row live in pipeline/evaluation/; the recommendation in
pipeline/bundle/recommendation.py (docs/stages.md, "Where each stage's jobs live").
"""
from __future__ import annotations

import logging

import numpy as np

from pipeline.bundle.recommendation import recommend_serving
from pipeline.core.artifacts import write_json
from pipeline.core.gates import apply_role
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.evaluation.http_rows import predict_http_row, served_batching
from pipeline.evaluation.onnx_rows import onnx_rows
from pipeline.evaluation.paddle_rows import paddle_rows, paddle_rows_skipped
from pipeline.evaluation.rows import (FINISHING, LOADING, MemoryBudget, batch_sizes, imported_onnx, onnx_batch_sizes,
                                      role_of, server_device, server_threads)
from pipeline.evaluation.timing import perf_figures
from pipeline.tasks.reference import load_reference

log = logging.getLogger("pipeline")


def run(ctx: StageContext) -> StageResult:
    cfg, sc = ctx.cfg, ctx.cfg.server
    ctx.memory_budget = MemoryBudget(sc.memory_budget_mb)      # kept after every row, or the stage stops there
    ref = load_reference(ctx.input("export"))
    x, prefix = ref.inputs, ref.model_prefix
    with np.load(ctx.input("train", "calib.npz")) as z:
        calib = z["inputs"]
        # the tuning split's labels (runs trained before they were saved: None, judged without labels)
        ctx.calib_labels = z["labels"] if "labels" in z.files else None
    ctx.memory_budget.check(LOADING)
    onnx_model = imported_onnx(ref)
    ctx.batches = batch_sizes(cfg, prefix, x) if onnx_model is None else onnx_batch_sizes(cfg, onnx_model, x)
    log.info("[server] batch sizes within server.batch_memory_mb=%d: %s", sc.batch_memory_mb, ctx.batches)
    device, threads = server_device(cfg), server_threads(cfg)
    info_out: dict = {"device": device, "threads": threads, "batch_sizes": ctx.batches}
    tuning: dict = {}
    served: dict = {}       # engine kind -> tuned fp32 engine, candidates for serving

    gates = paddle_rows(ctx, ref, calib, device, threads, info_out, tuning, served) if onnx_model is None \
        else paddle_rows_skipped(ctx, ref)
    if device == "cpu":
        gates += onnx_rows(ctx, ref, calib, served, tuning)
    gates = [apply_role(g, role_of(sc.roles, g.subject)) for g in gates]     # before serving: EXCLUDED is never served
    serving, engine = recommend_serving(ctx, ref, gates, served, tuning)
    if serving:
        serving["batching"] = served_batching(ctx, engine, ref.info["input_shape"], ref.info["preprocess"])
    info_out["serving"] = serving
    write_json(ctx.out_dir / "serving.json", serving or {})

    if sc.http.enable:      # the recommended engine as served (Paddle Inference fp32 when nothing was recommended)
        gates.append(predict_http_row(ctx, ref, threads, engine, (serving or {}).get("precision", "fp32"),
                                      (serving or {}).get("batching")))
    if engine is not None:
        engine.close()
    ctx.memory_budget.check(FINISHING)
    info_out["memory"] = ctx.memory_budget.record()

    write_json(ctx.out_dir / "perf.json", perf_figures(gates, prefix, threads, info_out, onnx_model, list(x.shape)))
    return StageResult(gates=gates, precision={g.subject: g.precision_effective for g in gates},
                       metrics={g.subject: g.value for g in gates}, info=info_out)


STAGE = Stage(name="server", inputs=("train", "export"), config_keys=("server", "serve"), make_target="deploy",
              machine_bound=True,     # its rows ran (gated, timed) on this CPU's kernels
              outputs=("serving.json", "perf.json"),
              # each row's model: Paddle int8/fp16 programs, ONNX (fp32, int8 QDQ), OpenVINO int8 (NNCF) and the bf16
              # IR with its keep list marked (pipeline/bundle/layout.py SERVER_STAGE_MODELS)
              optional_outputs=("models", "models/int8", "models/fp16", "onnx/model.onnx", "onnx/model_int8.onnx",
                                "openvino/model_int8.xml", "openvino/model_int8.bin",
                                "openvino/model_bf16.xml", "openvino/model_bf16.bin"),
              run=run,
              description="Paddle Inference, ONNX Runtime, OpenVINO rows with gates, latency and a recommended engine")
