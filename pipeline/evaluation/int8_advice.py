"""When the Paddle Inference int8 row fails its gate (server.quant.sensitivity_on_fail): is it the calibration or the
engine's int8 path, and which layers, skipped, recover the gate on the tuning split? Advice that was checked, or a
plain 'none recovers'."""
from __future__ import annotations

import time

from pipeline.tasks.base import has_labels


def _int8_judge(ctx, task, x, ref_out, labels, tol, common, precision: str = "int8"):
    """prefix -> the int8 gate's verdict on that quantized program, run as `precision` ("fp32": the fake-quant
    program simulated in fp32, i.e. what the calibration alone gives)."""
    from pipeline.core.gates import judge_try
    from pipeline.engines import paddle_infer as pi

    def judge(p: str) -> dict:
        out = pi.InferenceEngine(p, precision, **common).run_batched(x, ctx.batches["gate"])
        r = judge_try(task, tol, out, ref_out, labels, "int8", key="server.gates.int8")
        return {"passed": r["passed"], task.primary_metric: r["metric"], "reason": r["reason"]}
    return judge


def int8_advice(ctx, task, prefix, qprefix, calib, x, ref_out, labels, ref_metric, tol, common) -> dict:
    """First the calibration alone (the fake-quant program in fp32): if it passes, the loss is Paddle
    Inference's int8 path and no skip set ranked on that program can find it: say so and stop. Else rank
    layers from one calibrated pass, re-quantize with the top ones skipped, judge each try with the int8
    gate itself; the advice printed is one that was checked (or a plain 'none recovers').
    Ranking and trials run on the TUNING split (calibration lines, training set), judged against fp32's outputs
    there by the int8 gate, labels included (correct lines lost, metric drop) when calib.npz holds them: the
    validation slice stays the gate's alone (issue 31)."""
    from pipeline.engines import paddle_infer as pi
    from pipeline.engines import quant

    q, metric, t0 = ctx.cfg.server.quant, task.primary_metric, time.perf_counter()
    tune = calib[:len(x)]
    tune_ref = pi.InferenceEngine(prefix, "fp32", **common).run_batched(tune, ctx.batches["gate"])
    tune_labels = getattr(ctx, "calib_labels", None)
    tune_labels = tune_labels[:len(tune)] if tune_labels is not None and has_labels(tune_labels) else None
    args = (ctx, task, tune, tune_ref, tune_labels, tol, common)
    sim = _int8_judge(*args, precision="fp32")(qprefix)
    if sim["passed"]:
        msg = ("the calibration is not the cause: the fake-quant program run in fp32 passes on the tuning split, so the loss is in Paddle Inference's oneDNN int8 path "
               "and skipping layers ranked on that program cannot find it; serve the ONNX Runtime/OpenVINO int8 rows "
               "if they passed, or drop int8 from server.precisions")
        return {"simulated": sim, "message": msg, "seconds": round(time.perf_counter() - t0, 1),
                "stopped": "engine"}
    # every layer's input and output of both programs at once: as many samples as a calibration batch holds
    ranked = quant.rank_layers(prefix, qprefix, tune[:min(32, ctx.batches["calib"])], q.op_types, quant._WEIGHT_SLOT)

    def requantize(skip: list[str]) -> str:
        return quant.quantize_ptq(prefix, ctx.work_dir / "int8_advice" / f"skip{len(skip)}", calib, algo=q.algo,
                                  batch_size=ctx.batches["calib"], batch_nums=q.batch_nums, onnx_format=q.onnx_format,
                                  skip_tensor_list=sorted(set(skip) | set(q.skip)), quantizable_op_type=q.op_types)

    res = quant.advise(ranked, requantize, _int8_judge(*args),
                       budget_s=max(0.0, q.sensitivity_budget_s - (time.perf_counter() - t0)))
    return {"simulated": sim, "ranked": ranked[:10], "trials": res["trials"], "recommended": res["recommended"],
            "message": advice_message(q, metric, ref_metric, ranked, res), "seconds": round(time.perf_counter() - t0, 1),
            "stopped": res["stopped"]}


def advice_message(q, metric: str, ref_metric: float, ranked: list[dict], res: dict) -> str:
    top = ", ".join(f"{r['layer']} ({r['op']}, +{r['added_error']:.3f})" for r in ranked[:3])
    if res["recommended"]:
        skip = sorted(set(res["recommended"]) | set(q.skip))
        return (f"checked on the tuning split (calibration lines vs fp32): skipping {len(res['recommended'])} layer(s) "
                f"keeps the int8 gate's agreement: set server.quant.skip=[{','.join(skip)}] (the validation gate then "
                "judges it)")
    # a trial that raised ends the search (quant.advise): it was not judged, its reason says why (e.g. oneDNN below
    # AVX2 cannot run a program with a convolution kept fp32 between int8 ones: paddle_infer._BLOCKED_FP32_CAUSE)
    broken = res["trials"][-1] if res["stopped"] == "error" else None
    judged = [t for t in res["trials"] if t is not broken]
    what = f"skipped the top {', '.join(str(len(t['skip'])) for t in judged) or 'none'} of {len(ranked)} ranked layers"
    if res["stopped"] == "budget":
        what += f"; stopped at server.quant.sensitivity_budget_s={q.sensitivity_budget_s:g}"
    if broken:
        what = (f"{what}; " if judged else "") + (f"skipping the top {len(broken['skip'])} of {len(ranked)} ranked "
                                                  f"layers could not be judged: {broken['reason']}")
    lead = "no skip set recovers" if judged or not broken else "no skip set could be checked against"
    return (f"{lead} the int8 gate on the tuning split ({what}; fp32 {metric} {ref_metric:.4f}; most error added by: "
            f"{top}). Try other "
            f"calibration: server.quant.algo=mse or abs_max (now {q.algo}), more batches server.quant.batch_nums "
            f"(now {q.batch_nums}); weights are already per-channel (channel_wise_abs_max); else "
            "quantization-aware training (paddleslim QAT), or drop int8 from server.precisions")
