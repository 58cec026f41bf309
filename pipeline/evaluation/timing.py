"""What the server rows measure besides their gates: fp32 engines tuned per batch profile (threads, ir_optim), a
low-precision row's speed vs fp32 measured interleaved, and each row's GFLOP/s against the measured matmul peak
(perf.json)."""
from __future__ import annotations

import logging

from pipeline.core.gates import Gate
from pipeline.evaluation.rows import server_threads

log = logging.getLogger("pipeline")


def tune(ctx, kind: str, model, x, **paddle_opts):
    from pipeline.engines import registry

    sc = ctx.cfg.server
    choices = registry.thread_choices(sc.tuning.threads, server_threads(ctx.cfg))
    eng, record = registry.tune(kind, model, "fp32", x, batch_size=ctx.batches["perf"], threads=choices,
                                warmup=sc.perf.warmup, repeats=sc.perf.repeats, rounds=sc.tuning.rounds,
                                **paddle_opts)
    log.info("[server] %s tuned: batch-1 %s, batch-%d %s", kind, _chosen(record["batch1"]), ctx.batches["perf"],
             _chosen(record["batchN"]))
    return eng, record


def _chosen(profile: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in profile.items() if not isinstance(v, dict) and k != "batch")


BASELINE = "a fresh {kind} fp32 engine with the same threads and options"   # every low-precision row's


def speed_vs_fp32(low_eng, fp32_eng, x, *, batch: int, warmup: int, repeats: int, rounds: int,
                  label: str = "int8", kind: str = "") -> dict:
    """fp32 time / low-precision time at batch 1 (p50) and at `batch` (samples/s), the two engines measured
    interleaved: > 1 means the `label` row is faster; what the recommendation reads. fp32_eng is always BASELINE
    (the callers build it so), and `how` says so."""
    from pipeline.engines import registry

    rows = {r["engine"]: r for r in registry.rank({"fp32": fp32_eng, label: low_eng}, x, batch_size=batch,
                                                    warmup=warmup, repeats=repeats, rounds=rounds)}
    f, q = rows["fp32"], rows[label]
    return {"batch1": round(f["latency_ms"]["p50"] / q["latency_ms"]["p50"], 3),
            "batchN": round(q["throughput_sps"] / f["throughput_sps"], 3), "batch": batch,
            "fp32": {"p50_ms": round(f["latency_ms"]["p50"], 4), "sps": round(f["throughput_sps"], 1)},
            label: {"p50_ms": round(q["latency_ms"]["p50"], 4), "sps": round(q["throughput_sps"], 1)},
            "how": f"interleaved, {rounds} rounds; baseline: {BASELINE.format(kind=kind or 'same-kind')}"}


def note_speed_vs_fp32(ctx, gate: Gate, low_eng, fp32_eng, x) -> None:
    """gate.extra["speed_vs_fp32"]; a note when the row is not faster, so no reader takes it for speed."""
    sc, label = ctx.cfg.server, gate.precision_requested
    sp = speed_vs_fp32(low_eng, fp32_eng, x, batch=ctx.batches["perf"], warmup=sc.perf.warmup,
                       repeats=sc.perf.repeats, rounds=sc.tuning.rounds, label=label, kind=gate.subject.split()[0])
    gate.extra["speed_vs_fp32"] = sp
    slow = [f"x{sp[k]} at batch {n}" for k, n in (("batch1", 1), ("batchN", sp["batch"])) if sp[k] <= 1.0]
    if slow:
        note = f"{label} not faster than fp32: {', '.join(slow)} (fp32 time / {label} time, interleaved)"
        gate.extra.setdefault("notes", []).append(note)
        log.info("[server] %s: %s", gate.subject, note)


def perf_figures(gates: list[Gate], prefix, threads: int, info_out: dict, onnx_model=None, shape=None) -> dict:
    """Achieved GFLOP/s per row against the measured matmul peak (into each row's extra) -> perf.json's content."""
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
    return {"peak_gflops": peak, "macs": macs, "rows": {g.subject: g.extra for g in gates}}
