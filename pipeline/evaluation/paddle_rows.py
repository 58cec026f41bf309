"""Paddle Inference rows, one per server.precisions entry: fp32 (oneDNN + IR, tuned per batch profile on CPU),
fp16 (real on a GPU build; emulated on CPU, labelled so), bf16 (only where the CPU really has bf16; else SKIPPED:
Paddle would silently run fp32) and its emulated preview, int8 (PaddleSlim PTQ run with oneDNN INT8)."""
from __future__ import annotations

import logging
import time

from pipeline.core import resources
from pipeline.core.gates import FAIL, Gate, run_row, skipped
from pipeline.evaluation.int8_advice import int8_advice
from pipeline.evaluation.rows import batch_sizes, engine_row, settle_memory
from pipeline.evaluation.timing import note_speed_vs_fp32, tune

log = logging.getLogger("pipeline")


def paddle_rows_skipped(ctx, ref) -> list[Gate]:
    from pipeline.models.onnx_import import SKIP_ROWS

    return [skipped("server", f"paddle-inference {p}", p, ref.task.primary_metric, SKIP_ROWS["paddle"])
            for p in ctx.cfg.server.precisions]


def paddle_rows(ctx, ref, calib, device: str, threads: int, info_out: dict, tuning: dict, served: dict) -> list[Gate]:
    """One Paddle Inference row per server.precisions entry, in that order."""
    sc, task = ctx.cfg.server, ref.task
    common = dict(threads=threads, mkldnn=sc.mkldnn, ir_optim=sc.ir_optim)
    gates: list[Gate] = []
    for prec in sc.precisions:
        tol = sc.gates[prec]
        log.info("[server] %s row", prec)
        gate = run_row("server", f"paddle-inference {prec}", prec, task.primary_metric,
                       lambda prec=prec, tol=tol: _paddle_row(ctx, ref, prec, tol, calib, device, common, info_out, tuning, served),
                       ctx.out_dir / "evidence")
        if gate is not None:        # a precision Paddle Inference has no row for adds none
            gates.append(gate)
        budget = getattr(ctx, "memory_budget", None)
        settle_memory(served, budget, f"paddle-inference {prec}")
        if prec == "bf16" and sc.bf16.emulated:
            log.info("[server] bf16-emulated row")
            gates.append(run_row("server", "paddle-inference bf16-emulated", "bf16", task.primary_metric,
                                 lambda: _bf16_emulated_row(ctx, ref, common, info_out), ctx.out_dir / "evidence"))
            settle_memory(served, budget, "paddle-inference bf16-emulated")
    return gates


def _bf16_emulated_row(ctx, ref, common: dict, info_out: dict) -> Gate:
    """Every CPU: the program with its weights and each op's output rounded to bf16, fp32 math in between
    (engines/amp_emulation.py): what bf16 costs, previewed where no bf16 kernel runs; labelled bf16-emulated,
    never served. Gated like the real row (server.gates.bf16)."""
    from pipeline.engines import paddle_infer as pi

    emu = ctx.work_dir / "bf16_emulated" / "model"
    info_out["bf16_emulation"] = pi.make_fp16_emulated(ref.model_prefix, emu, "bf16")
    eng = pi.InferenceEngine(emu, "fp32", **common)      # the program says bf16-emulated (its casts), not the request
    batches = batch_sizes(ctx.cfg, emu, ref.inputs)        # the rounding casts add tensors, as for fp16
    gate = engine_row(ctx, ref.task, "bf16-emulated", eng, ref.inputs, ref.outputs, ref.labels, ref.metric,
                      ctx.cfg.server.gates["bf16"], "bf16", batches=batches)
    gate.subject = "paddle-inference bf16-emulated"
    return gate


def _paddle_row(ctx, ref, prec: str, tol, calib, device: str, common: dict, info_out: dict, tuning: dict,
                served: dict) -> Gate | None:
    from pipeline.engines import paddle_infer as pi

    sc, task, prefix = ctx.cfg.server, ref.task, ref.model_prefix
    x, ref_out, labels, ref_metric = ref.inputs, ref.outputs, ref.labels, ref.metric
    args = (x, ref_out, labels, ref_metric, tol)
    if prec == "fp32":
        if device == "cpu":   # threads and instances per batch profile, chosen by measurement
            eng, tuning["paddle-inference"] = tune(
                ctx, "paddle-inference", prefix, x, mkldnn=sc.mkldnn,
                variants=[{"ir_optim": v} for v in dict.fromkeys(sc.tuning.paddle_ir_optim)])
        else:
            eng = pi.InferenceEngine(prefix, "fp32", device=device, **common)
        gate = engine_row(ctx, task, "fp32", eng, *args, "fp32")
        served["paddle-inference"] = eng
        return gate
    if prec == "fp16":
        return fp16_row(ctx, ref, device, common, info_out, args)
    if prec == "bf16":
        ok, why = pi.bf16_status()
        if not ok:
            return skipped("server", "paddle-inference bf16", "bf16", task.primary_metric, why)
        ops = list(sc.bf16.paddle_ops)    # set_bfloat16_op takes op types only ([] = every op)
        eng = pi.InferenceEngine(prefix, "bf16", int8_ops=ops or None, **common)
        if ops:
            eng.notes.append(f"bf16 op types (server.bf16.paddle_ops, chosen on {sc.bf16.chosen_on}): {', '.join(ops)}")
        gate = engine_row(ctx, task, "bf16", eng, *args, "bf16")
        if gate.status != FAIL:
            # the baseline of every low-precision row: a fresh fp32 engine of its kind with its threads and options
            # (not the tuned fp32 engine: its threads and ir_optim are chosen per profile)
            note_speed_vs_fp32(ctx, gate, eng, pi.InferenceEngine(prefix, "fp32", **common), x)
        return gate
    if prec == "int8":
        return _int8_row(ctx, task, prefix, calib, x, ref_out, labels, ref_metric, tol, common)
    return None


def fp16_row(ctx, ref, device: str, common: dict, info_out: dict, args: tuple) -> Gate:
    """The GPU's mixed-precision model, or on CPU its emulation; server.fp16.keep_fp32_ops is the pass's added
    black list on both paths (the conversion and the predictor on a GPU, the emulation here)."""
    from pipeline.engines import paddle_infer as pi

    sc, task, prefix, keep = ctx.cfg.server, ref.task, ref.model_prefix, list(ctx.cfg.server.fp16.keep_fp32_ops)
    if device == "gpu":
        out_prefix = pi.convert_fp16_gpu(prefix, ctx.out_dir / "models" / "fp16" / "model", keep_fp32_ops=keep)
        eng = pi.InferenceEngine(out_prefix, "fp16", device="gpu", tensorrt=sc.tensorrt, keep_fp32_ops=keep, **common)
        return engine_row(ctx, task, "fp16", eng, *args, "fp16")
    # not deployable: an accuracy preview of fp16 rounding, kept out of models/
    emu = ctx.work_dir / "fp16_emulated" / "model"
    emu_info = pi.make_fp16_emulated(prefix, emu, "fp16", keep_fp32_ops=keep)
    eng = pi.InferenceEngine(emu, "fp16", **common)
    eng.evidence["fp32_ops_user_black_list"] = emu_info["fp32_ops_user_black_list"]
    if keep:
        eng.notes.append(f"kept in fp32 (server.fp16.keep_fp32_ops): {', '.join(keep)}"
                         + (f"; not in this program: {', '.join(emu_info['fp32_ops_user_absent'])}"
                            if emu_info["fp32_ops_user_absent"] else ""))
    info_out["fp16_emulation"] = emu_info
    # its rounding casts add tensors (~2.5x the activations): batches sized on the fp32 program took the
    # v4 det server stage to 7.5 GB
    emu_batches = batch_sizes(ctx.cfg, emu, ref.inputs)
    info_out["fp16_emulation"]["batch_sizes"] = emu_batches
    return engine_row(ctx, task, "fp16", eng, *args, "fp16", batches=emu_batches)


def _int8_row(ctx, task, prefix, calib, x, ref_out, labels, ref_metric, tol, common) -> Gate:
    from pipeline.engines import paddle_infer as pi
    from pipeline.engines import quant

    q, t0 = ctx.cfg.server.quant, time.perf_counter()
    out_dir = ctx.out_dir / "models" / "int8"
    qprefix = quant.quantize_ptq(prefix, out_dir, calib, algo=q.algo, batch_size=ctx.batches["calib"],
                                 batch_nums=q.batch_nums, onnx_format=q.onnx_format, skip_tensor_list=q.skip or None,
                                 quantizable_op_type=q.op_types)
    ptq_s = round(time.perf_counter() - t0, 1)
    # PTQ's freed activations stay in glibc's heap: the ONNX Runtime fp32 row after it then peaked at 5.0 GB in
    # `make real-ocr`'s rec server stage (3.4 GB alone)
    resources.release_memory()
    eng = pi.InferenceEngine(qprefix, "int8", **common)
    gate = engine_row(ctx, task, "int8", eng, x, ref_out, labels, ref_metric, tol, "int8")
    gate.extra["ptq"] = {"algo": q.algo, "op_types": list(q.op_types), "batch_size": ctx.batches["calib"],
                         "calibration_samples": int(min(len(calib), ctx.batches["calib"] * q.batch_nums)),
                         "skipped_layers": list(q.skip), "seconds": ptq_s}
    note_speed_vs_fp32(ctx, gate, eng, pi.InferenceEngine(prefix, "fp32", **common), x)
    if gate.status == FAIL and q.sensitivity_on_fail:
        log.info("[server] int8 gate failed: ranking layers and checking skip sets (server.quant.sensitivity_on_fail)")
        try:
            advice = int8_advice(ctx, task, prefix, qprefix, calib, x, ref_out, labels, ref_metric, tol, common)
        except Exception as exc:    # advice is a bonus: the int8 verdict above stands either way
            advice = {"message": f"int8 advice failed: {type(exc).__name__}: {exc}"}
        gate.extra["int8_advice"] = advice
        gate.reason += f"; {advice['message']}"
    gate.seconds = round(time.perf_counter() - t0, 2)      # PTQ + gate + speed (+ advice): what the row costs
    return gate
