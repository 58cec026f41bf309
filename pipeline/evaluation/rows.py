"""One gated server row: an engine run on the validation slice, judged against the fp32 export with its precision's
tolerance, timed, with the evidence of what it really ran; and what every row shares (device, threads, batch sizes
within server.batch_memory_mb, the stage's memory budget, the role server.roles gives a row)."""
from __future__ import annotations

import logging
import time

import numpy as np

from pipeline.core import env
from pipeline.core.errors import GateFailed, PipelineError
from pipeline.core.gates import Gate, evaluate_tol
from pipeline.engines import evidence

log = logging.getLogger("pipeline")


def server_threads(cfg) -> int:
    return cfg.server.threads or env.cpu_count()


def server_device(cfg) -> str:
    caps = env.capabilities()
    if cfg.server.device == "gpu" and not caps["gpu"]:
        raise PipelineError("server.device is 'gpu' but Paddle sees no GPU", hint="use server.device=auto")
    return "gpu" if cfg.server.device in ("auto", "gpu") and caps["gpu"] else "cpu"


LOADING = "loading the reference and calibration data"
FINISHING = "the recommendation and the HTTP row"


class MemoryBudget:
    """server.memory_budget_mb: the peak RSS the server stage keeps (and the system stage, phase by phase).
    Measured, not estimated: each row's peak is the kernel's high-water mark since the row before, and the stage
    stops with one line right after the row (or the loading) that took it past the budget. Refusing up front would
    need an estimate, and the ones at hand are upper bounds far from what runs (activations: 523 MB bound vs ~31 MB
    measured for PP-OCRv4 rec; PTQ at 3x footprint: 4.0 GB said, 2.4-2.7 GB measured), so a budget that fits would
    be refused. A row is not interrupted midway: the peak is read after it. stage: the name its line starts with;
    phases: the checked names that are phases, not rows (the server stage's: LOADING and FINISHING); fix: the hint
    (default: the server stage's advice for its loading and its rows)."""

    def __init__(self, budget_mb: int, stage: str = "server", phases: tuple[str, ...] = (LOADING, FINISHING),
                 fix: str | None = None):
        from pipeline.core import resources

        self.budget_mb, self.rows, self.stage, self.phases, self.fix = budget_mb, {}, stage, phases, fix
        resources.row_peak_mb()     # a fresh mark: what ran before the stage is not charged to its loading

    def check(self, name: str) -> None:
        """name: a row's subject, or a phase (LOADING, FINISHING)."""
        from pipeline.core import resources

        peak = resources.row_peak_mb()
        if peak is None:
            return      # no high-water mark here (not Linux): nothing measured, nothing refused
        self.rows[name] = peak
        if peak > self.budget_mb:
            where = name if name in self.phases else f"row '{name}'"
            raise GateFailed(f"{self.stage}: peak RSS {peak:.0f} MB in {where} is over server.memory_budget_mb="
                             f"{self.budget_mb} MB", hint=self._fix(name))

    def _fix(self, name: str) -> str:
        if self.fix:
            return self.fix
        if name == LOADING:
            return ("raise server.memory_budget_mb: the model, its reference outputs and the calibration data alone "
                    "take that")
        so_far = ", ".join(f"{k} {v:.0f}" for k, v in self.rows.items())
        return ("raise server.memory_budget_mb, lower server.batch_memory_mb (smaller batches) or leave the row out "
                f"(server.precisions / server.engines); peak RSS, MB: {so_far}")

    def record(self) -> dict:
        return {"budget_mb": self.budget_mb, "peak_rss_mb_by_row": dict(self.rows)}


def settle_memory(served: dict, budget: MemoryBudget | None = None, row: str = "") -> None:
    """After a row: the engines kept for serving give back their batch buffers and the row's freed heap goes back
    to the kernel, so the next row starts from what is live (the v4 det server stage, 2026-12-06: 5.5 GB with
    every tuned engine's batch-8 pools and each row's leftovers carried forward, issue 48); then the row's peak
    is checked against the stage's budget."""
    from pipeline.core import resources

    for eng in served.values():
        eng.trim()
    rss = resources.release_memory()
    if rss is not None:
        log.info("[server] RSS after the row: %.0f MB", rss)
    if budget is not None:
        budget.check(row)


def batch_sizes(cfg, prefix, x) -> dict:
    """Batches that fit server.batch_memory_mb for this model (gate runs, throughput, calibration)."""
    from pipeline.engines.perf import batch_for
    from pipeline.engines.quant import calib_batch

    sc, shape = cfg.server, list(x.shape)
    return {"gate": batch_for(prefix, shape, sc.batch_memory_mb, 64),
            "perf": batch_for(prefix, shape, sc.batch_memory_mb, sc.perf.batch_size),
            "quant": batch_for(prefix, shape, sc.batch_memory_mb, sc.quant.batch_size),
            # PTQ keeps every activation of the batch alive (no memory reuse): sized by the program's full footprint
            "calib": calib_batch(prefix, shape, sc.batch_memory_mb, sc.quant.batch_size)}


def imported_onnx(ref):
    """The export's model.onnx when model.source=onnx (pipeline/models/onnx_import.py), else None."""
    from pathlib import Path

    return Path(ref.model_prefix).with_name("model.onnx") if ref.info.get("source") == "onnx" else None


def onnx_batch_sizes(cfg, onnx_file, x) -> dict:
    """batch_sizes for an imported ONNX model: its activations from ONNX shape inference; calibration at PTQ_COPIES x
    that footprint per sample, as for a PaddleSlim program (PTQ keeps every activation of the batch)."""
    from pipeline.engines.perf import fit_batch
    from pipeline.engines.quant import PTQ_COPIES
    from pipeline.models.onnx_import import activation_bytes

    sc, per = cfg.server, activation_bytes(onnx_file, list(x.shape))
    fit = lambda wanted, copies=1: fit_batch(copies * per, sc.batch_memory_mb, wanted)
    return {"gate": fit(64), "perf": fit(sc.perf.batch_size), "quant": fit(sc.quant.batch_size),
            "calib": fit(sc.quant.batch_size, PTQ_COPIES)}


def engine_row(ctx, task, name, engine, x, ref_out, labels, ref_metric, tol, requested, batches=None) -> Gate:
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
    if np.isfinite(out).all():   # the strict share is what the serving budget reads (agreement: a required hook)
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
