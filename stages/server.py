"""server: server engines and precisions side by side, each row gated against the FP32 export.

Paddle Inference rows: fp32 (oneDNN + IR), fp16 (real on a GPU build; emulated on CPU, labelled so),
bf16 (only where the CPU really has bf16; else SKIPPED — Paddle would silently run fp32), int8
(PaddleSlim PTQ run with oneDNN INT8). ONNX Runtime and OpenVINO rows on the paddle2onnx export: fp32,
and int8 from the same calibration data, OpenVINO bf16 where the CPU has it (CUDA/TensorRT providers only
where a GPU is). Every row that runs also gets latency/throughput figures; fp32 engines are tuned per batch
profile; every row that passed, low precision included, is screened against server.recommend and the fastest
within budget is recommended for serving (pipeline/bundle/recommend.py).
Writes: models/int8 (and models/fp16 on GPU), onnx/model.onnx for the bundle, serving.json, perf.json.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from pipeline.bundle import layout as bundle_layout
from pipeline.core import env, resources
from pipeline.engines import evidence
from pipeline.core.artifacts import write_json
from pipeline.core.errors import PipelineError
from pipeline.core.gates import FAIL, Gate, apply_role, evaluate_tol, run_row, skipped
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.bundle.serving_choice import precision_settings
from pipeline.tasks.base import has_labels
from pipeline.tasks.reference import load_reference

log = logging.getLogger("pipeline")


def _threads(cfg) -> int:
    return cfg.server.threads or env.cpu_count()


def batch_sizes(cfg, prefix, x) -> dict:
    """Batches that fit server.memory_budget_mb for this model (gate runs, throughput, calibration)."""
    from pipeline.engines.perf import batch_for
    from pipeline.engines.quant import calib_batch

    sc, shape = cfg.server, list(x.shape)
    return {"gate": batch_for(prefix, shape, sc.memory_budget_mb, 64),
            "perf": batch_for(prefix, shape, sc.memory_budget_mb, sc.perf.batch_size),
            "quant": batch_for(prefix, shape, sc.memory_budget_mb, sc.quant.batch_size),
            # PTQ keeps every activation of the batch alive (no memory reuse): sized by the program's full footprint
            "calib": calib_batch(prefix, shape, sc.memory_budget_mb, sc.quant.batch_size)}


def _imported_onnx(ref):
    """The export's model.onnx when model.source=onnx (pipeline/models/onnx_import.py), else None."""
    from pathlib import Path

    return Path(ref.model_prefix).with_name("model.onnx") if ref.info.get("source") == "onnx" else None


def _onnx_batch_sizes(cfg, onnx_file, x) -> dict:
    """batch_sizes for an imported ONNX model: its activations from ONNX shape inference; calibration at PTQ_COPIES x
    that footprint per sample, as for a PaddleSlim program (PTQ keeps every activation of the batch)."""
    from pipeline.engines.perf import fit_batch
    from pipeline.engines.quant import PTQ_COPIES
    from pipeline.models.onnx_import import activation_bytes

    sc, per = cfg.server, activation_bytes(onnx_file, list(x.shape))
    fit = lambda wanted, copies=1: fit_batch(copies * per, sc.memory_budget_mb, wanted)
    return {"gate": fit(64), "perf": fit(sc.perf.batch_size), "quant": fit(sc.quant.batch_size),
            "calib": fit(sc.quant.batch_size, PTQ_COPIES)}


def _paddle_rows_skipped(ctx, ref) -> list[Gate]:
    from pipeline.models.onnx_import import SKIP_ROWS

    return [skipped("server", f"paddle-inference {p}", p, ref.task.primary_metric, SKIP_ROWS["paddle"])
            for p in ctx.cfg.server.precisions]


def _row(ctx, task, name, engine, x, ref_out, labels, ref_metric, tol, requested, batches=None) -> Gate:
    from pipeline.engines.base import ShapeRouted

    t0 = time.perf_counter()
    batches = batches or ctx.batches
    out = engine.run_batched(x, batches["gate"])
    value = task.metrics(out, labels)[task.primary_metric] if np.isfinite(out).all() else float("nan")
    checked, ref_checked, checked_labels = out, ref_out, labels
    if isinstance(engine, ShapeRouted):   # the batch-1 instance has its own settings and answers single requests
        k = min(len(x), batches["gate"])
        checked = np.concatenate([out, *(engine.run(x[i:i + 1]) for i in range(k))])
        ref_checked = np.concatenate([ref_out, ref_out[:k]])
        checked_labels = np.concatenate([labels, labels[:k]])
    label, proof = engine.effective_precision, dict(engine.evidence)
    if requested != "fp32" and np.isfinite(out).all():     # a low-precision label must show in the numbers
        label, proof["outputs_vs_fp32"] = evidence.check_outputs(label, requested, out, ref_out)
    gate = Gate("server", f"{engine.kind} {name}", requested, label, task.primary_metric, reference=ref_metric)
    evaluate_tol(gate, checked, ref_checked, tol, value, task, key=f"server.gates.{requested}", labels=checked_labels)
    if checked is not out:
        gate.extra["batch1_instance_samples"] = len(checked) - len(out)     # also inside the elementwise check
    pc = ctx.cfg.server.perf
    gate.extra.update(engine.perf(x, batches["perf"], warmup=pc.warmup, repeats=pc.repeats))
    gate.extra["notes"] = list(engine.notes)
    if hasattr(task, "agreement") and np.isfinite(out).all():   # the strict share is what the serving budget reads
        measure, _, strict = task.agreement(out, ref_out, None)
        gate.extra["agreement"] = {"name": measure, "strict": round(float(strict), 6)}
    gate.extra["evidence"] = proof                    # what proves the effective precision
    gate.extra["settings"] = dict(engine.settings)
    if getattr(engine, "int8_quantized", None):
        gate.extra["int8_ops"] = dict(engine.int8_quantized)      # what oneDNN really ran in INT8
    gate.seconds = round(time.perf_counter() - t0, 2)
    return gate


def role_of(roles: dict, subject: str) -> str:
    """server.roles by row subject ("onnxruntime int8"), else by its precision ("int8"); unnamed rows are required."""
    if subject in roles:
        return roles[subject]
    return roles.get(subject.split()[-1], "required")


def _device(cfg) -> str:
    caps = env.capabilities()
    if cfg.server.device == "gpu" and not caps["gpu"]:
        raise PipelineError("server.device is 'gpu' but Paddle sees no GPU", hint="use server.device=auto")
    return "gpu" if cfg.server.device in ("auto", "gpu") and caps["gpu"] else "cpu"


def run(ctx: StageContext) -> StageResult:
    cfg, sc = ctx.cfg, ctx.cfg.server
    ref = load_reference(ctx.input("export"))
    x, prefix = ref.inputs, ref.model_prefix
    with np.load(ctx.input("train", "calib.npz")) as z:
        calib = z["inputs"]
        # the tuning split's labels (runs trained before they were saved: None, judged without labels)
        ctx.calib_labels = z["labels"] if "labels" in z.files else None
    onnx_model = _imported_onnx(ref)
    ctx.batches = batch_sizes(cfg, prefix, x) if onnx_model is None else _onnx_batch_sizes(cfg, onnx_model, x)
    log.info("[server] batch sizes within server.memory_budget_mb=%d: %s", sc.memory_budget_mb, ctx.batches)
    device, threads = _device(cfg), _threads(cfg)
    info_out: dict = {"device": device, "threads": threads, "batch_sizes": ctx.batches}
    tuning: dict = {}
    served: dict = {}       # engine kind -> tuned fp32 engine, candidates for serving

    gates = _paddle_rows(ctx, ref, calib, device, threads, info_out, tuning, served) if onnx_model is None \
        else _paddle_rows_skipped(ctx, ref)
    if device == "cpu":
        gates += _onnx_rows(ctx, ref, calib, served, tuning)
    gates = [apply_role(g, role_of(sc.roles, g.subject)) for g in gates]     # before serving: EXCLUDED is never served
    serving, engine = _recommend(ctx, ref, gates, served, tuning)
    if serving:
        serving["batching"] = _batching(ctx, engine, ref.info["input_shape"], ref.info["preprocess"])
    info_out["serving"] = serving
    write_json(ctx.out_dir / "serving.json", serving or {})

    if sc.http.enable:      # the recommended engine as served (Paddle Inference fp32 when nothing was recommended)
        gates.append(_http_row(ctx, ref, threads, engine, (serving or {}).get("precision", "fp32"),
                               (serving or {}).get("batching")))
    if engine is not None:
        engine.close()

    _write_perf(ctx, gates, prefix, threads, info_out, onnx_model, list(x.shape))
    return StageResult(gates=gates, precision={g.subject: g.precision_effective for g in gates},
                       metrics={g.subject: g.value for g in gates}, info=info_out)


def _paddle_rows(ctx, ref, calib, device: str, threads: int, info_out: dict, tuning: dict, served: dict) -> list[Gate]:
    """One Paddle Inference row per server.precisions entry, in that order."""
    sc, task = ctx.cfg.server, ref.task
    common = dict(threads=threads, mkldnn=sc.mkldnn, ir_optim=sc.ir_optim)
    gates: list[Gate] = []
    for prec in sc.precisions:
        tol = sc.gates[prec]
        log.info("[server] %s row", prec)
        gate = run_row("server", f"paddle-inference {prec}", prec, task.primary_metric,
                       lambda: _paddle_row(ctx, ref, prec, tol, calib, device, common, info_out, tuning, served),
                       ctx.out_dir / "evidence")
        if gate is not None:        # a precision Paddle Inference has no row for adds none
            gates.append(gate)
        if prec == "bf16" and sc.bf16.emulated:
            log.info("[server] bf16-emulated row")
            gates.append(run_row("server", "paddle-inference bf16-emulated", "bf16", task.primary_metric,
                                 lambda: _bf16_emulated_row(ctx, ref, common, info_out), ctx.out_dir / "evidence"))
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
    gate = _row(ctx, ref.task, "bf16-emulated", eng, ref.inputs, ref.outputs, ref.labels, ref.metric,
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
            eng, tuning["paddle-inference"] = _tune(
                ctx, "paddle-inference", prefix, x, mkldnn=sc.mkldnn,
                variants=[{"ir_optim": v} for v in dict.fromkeys(sc.tuning.paddle_ir_optim)])
        else:
            eng = pi.InferenceEngine(prefix, "fp32", device=device, **common)
        gate = _row(ctx, task, "fp32", eng, *args, "fp32")
        served["paddle-inference"] = eng
        return gate
    if prec == "fp16":
        return _fp16_row(ctx, ref, device, common, info_out, args)
    if prec == "bf16":
        ok, why = pi.bf16_status()
        if not ok:
            return skipped("server", "paddle-inference bf16", "bf16", task.primary_metric, why)
        ops = list(sc.bf16.paddle_ops)    # set_bfloat16_op takes op types only ([] = every op)
        eng = pi.InferenceEngine(prefix, "bf16", int8_ops=ops or None, **common)
        if ops:
            eng.notes.append(f"bf16 op types (server.bf16.paddle_ops, chosen on {sc.bf16.chosen_on}): {', '.join(ops)}")
        gate = _row(ctx, task, "bf16", eng, *args, "bf16")
        if gate.status != FAIL:
            _speed_vs_fp32(ctx, gate, eng, served.get("paddle-inference") or pi.InferenceEngine(prefix, **common), x)
        return gate
    if prec == "int8":
        return _int8_row(ctx, task, prefix, calib, x, ref_out, labels, ref_metric, tol, common)
    return None


def _fp16_row(ctx, ref, device: str, common: dict, info_out: dict, args: tuple) -> Gate:
    """The GPU's mixed-precision model, or on CPU its emulation; server.fp16.keep_fp32_ops is the pass's added
    black list on both paths (the conversion and the predictor on a GPU, the emulation here)."""
    from pipeline.engines import paddle_infer as pi

    sc, task, prefix, keep = ctx.cfg.server, ref.task, ref.model_prefix, list(ctx.cfg.server.fp16.keep_fp32_ops)
    if device == "gpu":
        out_prefix = pi.convert_fp16_gpu(prefix, ctx.out_dir / "models" / "fp16" / "model", keep_fp32_ops=keep)
        eng = pi.InferenceEngine(out_prefix, "fp16", device="gpu", tensorrt=sc.tensorrt, keep_fp32_ops=keep, **common)
        return _row(ctx, task, "fp16", eng, *args, "fp16")
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
    return _row(ctx, task, "fp16", eng, *args, "fp16", batches=emu_batches)


def _write_perf(ctx, gates: list[Gate], prefix, threads: int, info_out: dict, onnx_model=None,
                shape=None) -> None:
    """Achieved GFLOP/s per row against the measured matmul peak, then perf.json."""
    from pipeline.engines import perf
    from pipeline.models.onnx_import import macs as onnx_macs

    peak = perf.matmul_peak_gflops(threads=threads)
    macs = perf.program_macs(prefix, batch=1) if onnx_model is None else onnx_macs(onnx_model, shape)
    for g in gates:
        sps = g.extra.get("throughput_sps")
        if sps:
            g.extra["gflops"] = round(2 * macs * sps / 1e9, 2)
            g.extra["fraction_of_peak"] = round(g.extra["gflops"] / peak, 3) if peak else None
    info_out.update({"macs_per_sample": macs, "matmul_peak_gflops": round(peak, 1)})
    write_json(ctx.out_dir / "perf.json", {"peak_gflops": peak, "macs": macs,
                                           "rows": {g.subject: g.extra for g in gates}})


def _tune(ctx, kind: str, model, x, **paddle_opts):
    from pipeline.engines import registry

    sc = ctx.cfg.server
    choices = registry.thread_choices(sc.tuning.threads, _threads(ctx.cfg))
    eng, record = registry.tune(kind, model, "fp32", x, batch_size=ctx.batches["perf"], threads=choices,
                                warmup=sc.perf.warmup, repeats=sc.perf.repeats, rounds=sc.tuning.rounds,
                                **paddle_opts)
    log.info("[server] %s tuned: batch-1 %s, batch-%d %s", kind, _chosen(record["batch1"]), ctx.batches["perf"],
             _chosen(record["batchN"]))
    return eng, record


def _chosen(profile: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in profile.items() if not isinstance(v, dict) and k != "batch")


def _onnx_rows(ctx, ref, calib, served: dict, tuning: dict) -> list[Gate]:
    """paddle2onnx export, then ONNX Runtime and OpenVINO rows (fp32 tuned and ranked; int8 from the
    same calibration data), each gated against the export like the Paddle Inference rows."""
    from pipeline.engines import registry
    from pipeline.engines.onnx_export import export_onnx, onnx_opset

    sc, task = ctx.cfg.server, ref.task
    kinds = [k for k in sc.engines if k != "paddle-inference"]
    if not kinds:
        return []
    args = (ref.inputs, ref.outputs, ref.labels, ref.metric)
    imported_onnx = _imported_onnx(ref)
    try:
        onnx_file, why = (export_onnx(ref.model_prefix, ctx.out_dir / "onnx" / "model.onnx", opset=sc.onnx.opset)
                          if imported_onnx is None else _copy_onnx(imported_onnx, ctx.out_dir / "onnx")), ""
    except PipelineError as exc:    # not a row's failure: every ONNX row's reason; the config says FAIL or SKIPPED
        onnx_file, why = None, f"ONNX export failed: {exc.one_line()}"
    if onnx_file is None:
        if sc.onnx.required:
            return [Gate("server", f"{k} fp32", "fp32", "none", task.primary_metric, status=FAIL,
                         reason=why + " (server.onnx.required=true)") for k in kinds]
        return [skipped("server", f"{k} fp32", "fp32", task.primary_metric, why + " (set server.onnx.required=true "
                        "to fail instead)") for k in kinds]
    gates, evidence_dir = [], ctx.out_dir / "evidence"
    opset = onnx_opset(onnx_file)
    for kind in kinds:
        ok, why = registry.available(kind)
        if not ok:
            gates.append(skipped("server", f"{kind} fp32", "fp32", task.primary_metric, why))
            continue
        log.info("[server] %s fp32 row", kind)
        gates.append(run_row("server", f"{kind} fp32", "fp32", task.primary_metric,
                             lambda: _tuned_row(ctx, task, kind, onnx_file, args, served, tuning), evidence_dir))
        if "int8" in sc.precisions:
            log.info("[server] %s int8 row", kind)
            gates.append(run_row("server", f"{kind} int8", "int8", task.primary_metric,
                                 lambda: _onnx_int8_row(ctx, task, kind, onnx_file, calib, args,
                                                        None if imported_onnx else ref.model_prefix),
                                 evidence_dir))
        if kind == "openvino" and "bf16" in sc.precisions:
            log.info("[server] %s bf16 row", kind)
            gates.append(run_row("server", f"{kind} bf16", "bf16", task.primary_metric,
                                 lambda: _openvino_bf16_row(ctx, task, onnx_file, args), evidence_dir))
        if kind == "onnxruntime":
            gates += _ort_gpu_rows(ctx, task, onnx_file, args)
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
    eng, tuning[kind] = _tune(ctx, kind, onnx_file, x)
    served[kind] = eng
    return _row(ctx, task, "fp32", eng, x, ref_out, labels, ref_metric, ctx.cfg.server.gates["fp32"], "fp32")


def _onnx_int8_row(ctx, task, kind, onnx_file, calib, args, prefix) -> Gate:
    """Calibrated in batches sized from the program's footprint, as PaddleSlim: PP-OCRv4 det's ONNX Runtime
    calibration at the gate batch (9 pages of 736x736) peaked at ~12 GB (1 page per batch: see its config)."""
    from pipeline.engines import ort, ov, quant, registry

    x, ref_out, labels, ref_metric = args
    q, threads, t0 = ctx.cfg.server.quant, _threads(ctx.cfg), time.perf_counter()
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
    gate = _row(ctx, task, "int8", eng, x, ref_out, labels, ref_metric, ctx.cfg.server.gates["int8"], "int8")
    gate.extra["ptq"] = qinfo
    _speed_vs_fp32(ctx, gate, eng, registry.make(kind, onnx_file, "fp32", threads=threads), x)
    gate.seconds = round(time.perf_counter() - t0, 2)      # calibration + gate + speed: what the row costs
    return gate


def speed_vs_fp32(low_eng, fp32_eng, x, *, batch: int, warmup: int, repeats: int, rounds: int,
                  label: str = "int8") -> dict:
    """fp32 time / low-precision time at batch 1 (p50) and at `batch` (samples/s), the two engines measured
    interleaved with the same settings: > 1 means the `label` row is faster; what the recommendation reads."""
    from pipeline.engines import registry

    rows = {r["engine"]: r for r in registry.rank({"fp32": fp32_eng, label: low_eng}, x, batch_size=batch,
                                                    warmup=warmup, repeats=repeats, rounds=rounds)}
    f, q = rows["fp32"], rows[label]
    return {"batch1": round(f["latency_ms"]["p50"] / q["latency_ms"]["p50"], 3),
            "batchN": round(q["throughput_sps"] / f["throughput_sps"], 3), "batch": batch,
            "fp32": {"p50_ms": round(f["latency_ms"]["p50"], 4), "sps": round(f["throughput_sps"], 1)},
            label: {"p50_ms": round(q["latency_ms"]["p50"], 4), "sps": round(q["throughput_sps"], 1)},
            "how": f"interleaved, {rounds} rounds, same threads"}


def _speed_vs_fp32(ctx, gate: Gate, low_eng, fp32_eng, x) -> None:
    """gate.extra["speed_vs_fp32"]; a note when the row is not faster, so no reader takes it for speed."""
    sc, label = ctx.cfg.server, gate.precision_requested
    sp = speed_vs_fp32(low_eng, fp32_eng, x, batch=ctx.batches["perf"], warmup=sc.perf.warmup,
                       repeats=sc.perf.repeats, rounds=sc.tuning.rounds, label=label)
    gate.extra["speed_vs_fp32"] = sp
    slow = [f"x{sp[k]} at batch {n}" for k, n in (("batch1", 1), ("batchN", sp["batch"])) if sp[k] <= 1.0]
    if slow:
        note = f"{label} not faster than fp32: {', '.join(slow)} (fp32 time / {label} time, interleaved)"
        gate.extra.setdefault("notes", []).append(note)
        log.info("[server] %s: %s", gate.subject, note)


def _openvino_bf16_row(ctx, task, onnx_file, args) -> Gate:
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
    eng = registry.make("openvino", model, "bf16", threads=_threads(ctx.cfg))
    eng.notes.append(why)
    if b.openvino_keep_fp32:
        eng.notes.append(f"{len(b.openvino_keep_fp32)} compute layers and their tails ({kept['marked']} IR layers) kept "
                         f"f32 (server.bf16.openvino_keep_fp32, chosen on {b.chosen_on})"
                         + (f"; not in this model: {', '.join(kept['absent'])}" if kept["absent"] else ""))
        eng.evidence["layers_kept_f32"] = kept["marked"]
    gate = _row(ctx, task, "bf16", eng, *args, ctx.cfg.server.gates["bf16"], "bf16")
    if gate.status != FAIL:
        _speed_vs_fp32(ctx, gate, eng, registry.make("openvino", onnx_file, "fp32", threads=_threads(ctx.cfg)), args[0])
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
        rows.append(run_row("server", subject, "fp32", task.primary_metric, lambda: _row(
            ctx, task, f"{p} fp32", OrtEngine(onnx_file, provider=p), x, ref_out, labels, ref_metric,
            ctx.cfg.server.gates["fp32"], "fp32"), ctx.out_dir / "evidence"))
    return rows


def _recommend(ctx, ref, gates: list[Gate], served: dict, tuning: dict):
    """Every servable row screened against server.recommend, the candidates ranked side by side (interleaved),
    the fastest within budget chosen (pipeline/bundle/recommend.py) -> (serving record or None, its engine or None)."""
    from pipeline.bundle import recommend as rec
    from pipeline.engines import registry

    sc, rc = ctx.cfg.server, ctx.cfg.server.recommend
    cands = rec.screen(gates, rc, samples=len(ref.inputs))
    engines = _candidate_engines(ctx, ref, cands, served, tuning)
    rows = registry.rank(engines, ref.inputs, batch_size=ctx.batches["perf"], warmup=sc.perf.warmup,
                         repeats=sc.perf.repeats, rounds=sc.tuning.rounds, by=rc.by) if engines else []
    picked = rec.choose(cands, rows, rc)
    for c in cands:
        log.info("[server] serving candidate %s", c.line())
    for row, e in engines.items():
        if picked is None or row != picked[0].row:
            e.close()
    if picked is None:
        log.info("[server] nothing to recommend: no fp32 row passed its gate")
        return None, None
    chosen, base = picked
    record = _serving_record(ctx, chosen, base, cands, rows, tuning, ref.task.primary_metric)
    log.info("[server] serving %s: %s", chosen.row, record["why"])
    return record, engines[chosen.row]


def _serve_batching(ctx) -> dict:
    return ctx.cfg.serve.batching.model_dump()


def _batching(ctx, engine, input_shape: list, preprocess: dict) -> dict:
    """Would concurrent requests pay to share the recommended engine's calls (serve.batching)? Recorded for the
    bundle; `serve` measures again at start-up, on the machine that serves."""
    from pipeline.serving.batching import decide, describe, served_shape

    choice = decide(engine.run, served_shape(input_shape, preprocess)[1:], _serve_batching(ctx))
    log.info("[server] %s", describe(choice))
    return choice


def _serving_record(ctx, chosen, base, cands, rows: list[dict], tuning: dict, metric: str) -> dict:
    """serving.json: what is served and why, what fp32 would have given, every candidate with its verdict."""
    from pipeline.bundle import recommend as rec

    sc, rc = ctx.cfg.server, ctx.cfg.server.recommend
    tol = sc.gates[chosen.precision]
    return {"engine": chosen.engine, "precision": chosen.precision, "row": chosen.row,
            "model": bundle_layout.serving_model(chosen.engine, chosen.precision), "by": rc.by,
            "settings": precision_settings(chosen.engine, chosen.precision, tuning.get(chosen.engine),
                                          sc.fp16.keep_fp32_ops),
            "why": rec.why(chosen, base, cands, rc, metric),
            "fp32": rec.fp32_baseline(base),
            "budget": {"precisions": list(rc.precisions), "max_metric_drop": rc.max_metric_drop,
                       "min_agreement": rc.min_agreement, "min_speedup": rc.min_speedup},
            # the served row's own tolerance: `verify` checks the bundle's samples with it
            "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "prob_atol": tol.prob_atol,
                          "key": f"server.gates.{chosen.precision}"},
            "candidates": [c.to_dict() for c in cands], "ranking": rows, "tuning": tuning}


def _candidate_engines(ctx, ref, cands, served: dict, tuning: dict) -> dict:
    """Row subject -> engine as `serve` would run it, for every candidate (fp32: the tuned instances)."""
    from pipeline.bundle import recommend as rec
    from pipeline.engines import registry

    sc, engines = ctx.cfg.server, {}
    for c in (c for c in cands if c.verdict == rec.CANDIDATE):
        if c.precision == "fp32":
            if c.engine in served:
                engines[c.row] = served[c.engine]
            continue
        opts = {"mkldnn": sc.mkldnn, **({"device": "gpu"} if c.precision == "fp16" else {})} \
            if c.engine == "paddle-inference" else {}
        model = bundle_layout.server_stage_model(ctx.out_dir, ref.model_prefix, c.engine, c.precision)
        try:
            settings = precision_settings(c.engine, c.precision, tuning.get(c.engine), sc.fp16.keep_fp32_ops)
            eng = registry.make_routed(c.engine, model, c.precision, settings, spin=False, **opts)
        except PipelineError as exc:
            c.verdict, c.detail = "failed to load", exc.one_line()
            continue
        if evidence.head(eng.effective_precision) != c.precision:     # the served instance must show it too
            c.verdict, c.detail = "no evidence", f"the serving instance ran {eng.effective_precision}"
            eng.close()
            continue
        engines[c.row] = eng
    return engines


def _http_row(ctx, ref, threads, engine=None, precision: str = "fp32", decided: dict | None = None) -> Gate:
    """The HTTP service users will run (the recommended engine at its precision), started on a free local port
    and gated like an engine with that precision's tolerance. decided: the batching choice _batching measured a
    moment ago on this engine, taken as is (measuring it again cost the v4 det row ~10 s)."""
    # one subject whatever is served: the nightly matches gates by subject, and the served row is a timed choice that
    # may change between nights (its precision is the gate's; a change is reported by the nightly, not a missing row)
    subject = "http /predict as served"
    batching = _serve_batching(ctx)
    if decided:
        batching["mode"] = "on" if decided["enabled"] else "off"
    gate = run_row("server", subject, precision, ref.task.primary_metric,
                   lambda: _http_gate_row(ctx, ref, threads, engine, subject, precision, batching),
                   ctx.out_dir / "evidence")
    gate.extra["served"] = True         # a timed choice: the nightly reports a change of its precision
    return gate


def _http_gate_row(ctx, ref, threads, engine, subject: str, precision: str, batching: dict) -> Gate:
    from pipeline.serving.predict import http_gate

    sc, task, info, labels, ref_out = ctx.cfg.server, ref.task, ref.info, ref.labels, ref.outputs
    t0 = time.perf_counter()
    infer_cfg = {"task": info["task"], "input": {"shape": [None] + info["input_shape"][1:]},
                 "preprocess": info["preprocess"], "postprocess": info["postprocess"]}
    res = http_gate(ref.model_prefix, infer_cfg, ref.images, labels, info["task"], max_requests=sc.http.max_requests,
                    threads=threads, engine=engine, batching=batching)
    n = res["n"]
    effective = engine.effective_precision if engine is not None else "fp32"
    gate = Gate("server", subject, precision, effective, task.primary_metric,
                reference=task.metrics(ref_out[:n], labels[:n])[task.primary_metric])
    # images go through PNG decode + preprocessing on the server: same code path, the served precision's tolerance
    evaluate_tol(gate, res["outputs"], ref_out[:n], sc.gates[precision], res["metric"], task,
                 key=f"server.gates.{precision}")
    gate.extra.update(latency_ms=res["latency_ms"], requests=n, engine=res["engine"])
    gate.seconds = round(time.perf_counter() - t0, 2)
    return gate


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
    gate = _row(ctx, task, "int8", eng, x, ref_out, labels, ref_metric, tol, "int8")
    gate.extra["ptq"] = {"algo": q.algo, "op_types": list(q.op_types), "batch_size": ctx.batches["calib"],
                         "calibration_samples": int(min(len(calib), ctx.batches["calib"] * q.batch_nums)),
                         "skipped_layers": list(q.skip), "seconds": ptq_s}
    _speed_vs_fp32(ctx, gate, eng, pi.InferenceEngine(prefix, "fp32", **common), x)
    if gate.status == FAIL and q.sensitivity_on_fail:
        log.info("[server] int8 gate failed: ranking layers and checking skip sets (server.quant.sensitivity_on_fail)")
        try:
            advice = _int8_advice(ctx, task, prefix, qprefix, calib, x, ref_out, labels, ref_metric, tol, common)
        except Exception as exc:    # advice is a bonus: the int8 verdict above stands either way
            advice = {"message": f"int8 advice failed: {type(exc).__name__}: {exc}"}
        gate.extra["int8_advice"] = advice
        gate.reason += f"; {advice['message']}"
    gate.seconds = round(time.perf_counter() - t0, 2)      # PTQ + gate + speed (+ advice): what the row costs
    return gate


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


def _int8_advice(ctx, task, prefix, qprefix, calib, x, ref_out, labels, ref_metric, tol, common) -> dict:
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
        msg = (f"the calibration is not the cause: the fake-quant program run in fp32 passes on the tuning split, so the loss is in Paddle Inference's oneDNN int8 path "
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
            "message": _advice_message(q, metric, ref_metric, ranked, res), "seconds": round(time.perf_counter() - t0, 1),
            "stopped": res["stopped"]}


def _advice_message(q, metric: str, ref_metric: float, ranked: list[dict], res: dict) -> str:
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
