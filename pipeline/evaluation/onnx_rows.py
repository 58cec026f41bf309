"""ONNX Runtime and OpenVINO rows on the paddle2onnx export (or the imported .onnx): fp32 tuned per batch profile,
int8 from the same calibration data as PaddleSlim's, OpenVINO bf16 where the CPU has it (on the IR the bundle then
serves), CUDA/TensorRT providers only where a GPU is; each gated against the export like the Paddle Inference rows."""
from __future__ import annotations

import logging
import time

from pipeline.core import resources
from pipeline.core.errors import PipelineError
from pipeline.core.gates import FAIL, Gate, run_row, skipped
from pipeline.evaluation.rows import engine_row, imported_onnx, server_threads, settle_memory
from pipeline.evaluation.timing import note_speed_vs_fp32, tune

log = logging.getLogger("pipeline")


def onnx_rows(ctx, ref, calib, served: dict, tuning: dict) -> list[Gate]:
    """paddle2onnx export, then ONNX Runtime and OpenVINO rows (fp32 tuned and ranked; int8 from the
    same calibration data), each gated against the export like the Paddle Inference rows."""
    from pipeline.engines import registry
    from pipeline.engines.onnx_export import export_onnx, onnx_opset

    sc, task = ctx.cfg.server, ref.task
    kinds = [k for k in sc.engines if k != "paddle-inference"]
    if not kinds:
        return []
    args = (ref.inputs, ref.outputs, ref.labels, ref.metric)
    imported = imported_onnx(ref)
    try:
        onnx_file, why = (export_onnx(ref.model_prefix, ctx.out_dir / "onnx" / "model.onnx", opset=sc.onnx.opset)
                          if imported is None else _copy_onnx(imported, ctx.out_dir / "onnx")), ""
    except PipelineError as exc:    # not a row's failure: every ONNX row's reason; the config says FAIL or SKIPPED
        onnx_file, why = None, f"ONNX export failed: {exc.one_line()}"
    if onnx_file is None:
        if sc.onnx.required:
            return [Gate("server", f"{k} fp32", "fp32", "none", task.primary_metric, status=FAIL,
                         reason=why + " (server.onnx.required=true)") for k in kinds]
        return [skipped("server", f"{k} fp32", "fp32", task.primary_metric, why + " (set server.onnx.required=true "
                        "to fail instead)") for k in kinds]
    gates, evidence_dir = [], ctx.out_dir / "evidence"
    budget = getattr(ctx, "memory_budget", None)
    opset = onnx_opset(onnx_file)
    for kind in kinds:
        ok, why = registry.available(kind)
        if not ok:
            gates.append(skipped("server", f"{kind} fp32", "fp32", task.primary_metric, why))
            continue
        log.info("[server] %s fp32 row", kind)
        gates.append(run_row("server", f"{kind} fp32", "fp32", task.primary_metric,
                             lambda kind=kind: _tuned_row(ctx, task, kind, onnx_file, args, served, tuning), evidence_dir))
        settle_memory(served, budget, gates[-1].subject)
        if "int8" in sc.precisions:
            log.info("[server] %s int8 row", kind)
            gates.append(run_row("server", f"{kind} int8", "int8", task.primary_metric,
                                 lambda kind=kind: _onnx_int8_row(ctx, task, kind, onnx_file, calib, args,
                                                        None if imported else ref.model_prefix),
                                 evidence_dir))
            settle_memory(served, budget, gates[-1].subject)
        if kind == "openvino" and "bf16" in sc.precisions:
            log.info("[server] %s bf16 row", kind)
            gates.append(run_row("server", f"{kind} bf16", "bf16", task.primary_metric,
                                 lambda: openvino_bf16_row(ctx, task, onnx_file, args), evidence_dir))
        if kind == "onnxruntime":
            gates += _ort_gpu_rows(ctx, task, onnx_file, args)
        settle_memory(served, budget, gates[-1].subject if kind == "openvino" else f"{kind} GPU providers")
    for g in gates:
        g.extra["onnx_opset"] = opset
    return gates


def _copy_onnx(src, out_dir):
    """model.source=onnx: the imported file, as it is, where the bundle takes the ORT/OpenVINO model from."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    return shutil.copy2(src, out_dir / "model.onnx")


def _tuned_row(ctx, task, kind, onnx_file, args, served, tuning) -> Gate:
    x, ref_out, labels, ref_metric = args
    eng, tuning[kind] = tune(ctx, kind, onnx_file, x)
    served[kind] = eng
    return engine_row(ctx, task, "fp32", eng, x, ref_out, labels, ref_metric, ctx.cfg.server.gates["fp32"], "fp32")


def _onnx_int8_row(ctx, task, kind, onnx_file, calib, args, prefix) -> Gate:
    """Calibrated in batches sized from the program's footprint, as PaddleSlim: PP-OCRv4 det's ONNX Runtime
    calibration at the gate batch (9 pages of 736x736) peaked at ~12 GB (1 page per batch: see its config)."""
    from pipeline.engines import ort, ov, quant, registry

    x, ref_out, labels, ref_metric = args
    q, threads, t0 = ctx.cfg.server.quant, server_threads(ctx.cfg), time.perf_counter()
    # the layers server.quant.op_types/skip leave fp32 stay fp32 here too (None: the defaults, every layer)
    # an imported ONNX model (prefix None) has no Paddle program to name layers by: every node the engine quantizes
    weights = quant.weights_to_quantize(prefix, q.op_types, q.skip) if prefix else None
    if kind == "onnxruntime":
        model = ctx.out_dir / "onnx" / "model_int8.onnx"
        qinfo = ort.quantize_int8(onnx_file, model, calib, batch_size=ctx.batches["calib"], batch_nums=q.batch_nums,
                                  weights=weights)
    else:
        ok, why = ov.nncf_status()
        if not ok:
            return skipped("server", f"{kind} int8", "int8", task.primary_metric, why)
        model = ctx.out_dir / "openvino" / "model_int8.xml"
        qinfo = ov.quantize_int8(onnx_file, model, calib, batch_size=ctx.batches["calib"], batch_nums=q.batch_nums,
                                 weights=weights, preset=q.nncf_preset, activation_range=q.nncf_activation_range)
    qinfo.update(seconds=round(time.perf_counter() - t0, 1), op_types=list(q.op_types), skipped_layers=list(q.skip))
    resources.release_memory()          # calibration's freed tensors (as after PaddleSlim's PTQ)
    eng = registry.make(kind, model, "int8", threads=threads)
    gate = engine_row(ctx, task, "int8", eng, x, ref_out, labels, ref_metric, ctx.cfg.server.gates["int8"], "int8")
    gate.extra["ptq"] = qinfo
    note_speed_vs_fp32(ctx, gate, eng, registry.make(kind, onnx_file, "fp32", threads=threads), x)
    gate.seconds = round(time.perf_counter() - t0, 2)      # calibration + gate + speed: what the row costs
    return gate


def openvino_bf16_row(ctx, task, onnx_file, args) -> Gate:
    """OpenVINO with INFERENCE_PRECISION_HINT bf16: only where the CPU has bf16 (else SKIPPED with the reason);
    labelled bf16 only when the runtime model shows bf16 compute ops."""
    from pipeline.engines import ov, registry

    ok, why = ov.bf16_status()
    if not ok:
        return skipped("server", "openvino bf16", "bf16", task.primary_metric, why)
    b = ctx.cfg.server.bf16
    # the IR the row is gated on, bundled and served as it is (bundle.layout.OPENVINO_BF16): chosen layers stay f32
    # inside the bf16 model (the IR's `precise` mark); without a keep list, the same fused IR with no mark
    base = ov.save_f32_ir(onnx_file, ctx.work_dir / "openvino_bf16" / "base.xml")
    model = ctx.out_dir / "openvino" / "model_bf16.xml"
    kept = ov.keep_f32_ir(base, ov.segment_names(base, b.openvino_keep_fp32), model)
    eng = registry.make("openvino", model, "bf16", threads=server_threads(ctx.cfg))
    eng.notes.append(why)
    if b.openvino_keep_fp32:
        eng.notes.append(f"{len(b.openvino_keep_fp32)} compute layers and their tails ({kept['marked']} IR layers) kept "
                         f"f32 (server.bf16.openvino_keep_fp32, chosen on {b.chosen_on})"
                         + (f"; not in this model: {', '.join(kept['absent'])}" if kept["absent"] else ""))
        eng.evidence["layers_kept_f32"] = kept["marked"]
    gate = engine_row(ctx, task, "bf16", eng, *args, ctx.cfg.server.gates["bf16"], "bf16")
    if gate.status != FAIL:
        fp32 = registry.make("openvino", onnx_file, "fp32", threads=server_threads(ctx.cfg))
        note_speed_vs_fp32(ctx, gate, eng, fp32, args[0])
    return gate


def _ort_gpu_rows(ctx, task, onnx_file, args) -> list[Gate]:
    """CUDA / TensorRT execution providers: run where a GPU build sees a GPU, SKIPPED (not run here) elsewhere."""
    from pipeline.engines.ort import OrtEngine, provider_status

    x, ref_out, labels, ref_metric = args
    rows = []
    for p in ctx.cfg.server.onnx.gpu_providers:
        subject = f"onnxruntime {p} fp32"
        ok, why = provider_status(p)
        if not ok:
            rows.append(skipped("server", subject, "fp32", task.primary_metric, why))
            continue
        rows.append(run_row("server", subject, "fp32", task.primary_metric, lambda p=p: engine_row(
            ctx, task, f"{p} fp32", OrtEngine(onnx_file, provider=p), x, ref_out, labels, ref_metric,
            ctx.cfg.server.gates["fp32"], "fp32"), ctx.out_dir / "evidence"))
    return rows

