"""lite: Paddle Lite `opt` → arm .nb files (+ an x86 fp32 .nb that is run and gated here).

Every opt run and every Lite run happens in a subprocess (Lite aborts the process on bad input);
a crash becomes a FAIL row with the signal and the child's last stderr lines, and the other rows
still run. ARM and quantized .nb files are "converted, not executed": on x86 they would run
and print garbage, so their accuracy is vouched for by the Paddle Inference rows instead.
Writes: arm_<precision>.nb, x86_fp32.nb, lite.json (sizes, repairs, ops).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import numpy as np

from pipeline.bundle import layout as bundle_layout
from pipeline.core.artifacts import write_json
from pipeline.core.capabilities import host_arch
from pipeline.core.gates import FAIL, OK, Check, Gate, evaluate_tol, run_row, skipped, unverified
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.tasks.reference import load_reference

log = logging.getLogger("pipeline")


def _source(ctx, precision: str):
    """(model, params) to convert: the PTQ model for int8, the exported FP32 program otherwise."""
    if precision == "int8":
        qdir = ctx.input("server", "models/int8")
        if not (qdir / "model.pdmodel").is_file():
            return None
        return qdir / "model.pdmodel", qdir / "model.pdiparams"
    exp = ctx.input("export")
    return exp / "inference.pdmodel", exp / "inference.pdiparams"


def _int8_gate_passed(ctx) -> bool:
    return any(g["subject"] == "paddle-inference int8" and g["status"] == OK
               for g in ctx.input_manifests["server"]["gates"])


def _no_fp16_evidence(ctx) -> str:
    """Why no executed row speaks for an arm fp16 .nb ("" when one does): the fp32 row says nothing about fp16
    kernels, so only a passing Paddle Inference fp16 row (run, emulated on a CPU) that kept no op in fp32 may."""
    rows = {g["subject"]: g for g in ctx.input_manifests["server"]["gates"]}
    g = rows.get("paddle-inference fp16")
    if g is None or g["status"] != OK:
        state = "no such row ran" if g is None else f"it is {g['status']}"
        return f"no passing Paddle Inference fp16 row to vouch for fp16 kernels ({state}; add fp16 to server.precisions)"
    kept = g.get("extra", {}).get("evidence", {}).get("fp32_ops_user_black_list")
    if kept:    # Lite's opt --fp16 picks fp16 kernels by its own rules: it has no black list to honour these
        return (f"server 'paddle-inference fp16' ran {', '.join(kept)} in fp32 (server.fp16.keep_fp32_ops), which "
                "Paddle Lite's fp16 conversion cannot keep")
    return ""


def _voucher(ctx, precision: str) -> str:
    """The executed row that speaks for a .nb we cannot run: the Paddle Inference row of its precision (same
    program before opt); the fp32 row only for fp32 and weight-only files (int8 and fp16 are refused before
    conversion without their own passing row: _convert)."""
    rows = {g["subject"]: g for g in ctx.input_manifests["server"]["gates"]}
    want = {"int8": "int8", "fp16": "fp16"}.get(precision, "fp32")
    for subject in [f"paddle-inference {want}"] + (["paddle-inference fp32"] if want == "fp32" else []):
        g = rows.get(subject)
        if g and g["status"] == OK:
            value = f", {g['metric']} {g['value']:.4f}" if g.get("value") is not None else ""
            return f"server '{subject}' ({g['precision_effective']}{value}) on the same program before opt"
    return "nothing: no passing Paddle Inference row for it"


def run(ctx: StageContext) -> StageResult:
    from pipeline.engines.program_repair import list_ops

    lc = ctx.cfg.lite
    exp = ctx.input("export")
    ref = load_reference(exp)
    if ref.info.get("source") == "onnx":       # no Paddle program to convert: every row says why
        return _onnx_skipped(ctx, ref)
    ops = list_ops(exp / "inference.pdmodel")
    made = _Made()
    gates = []
    for precision in lc.arm:
        log.info("[lite] arm %s", precision)
        gates.append(_convert_row(ctx, ref.task, ops, "arm", precision, made))

    if lc.verify_x86:
        log.info("[lite] x86 fp32 (run and gated)")
        g = _convert_row(ctx, ref.task, ops, "x86", "fp32", made)
        if g.status == OK:
            converted = g
            g = run_row("lite", converted.subject, "fp32", ref.task.primary_metric,
                        lambda: _run_x86(ctx, ref, converted), ctx.out_dir / "evidence")
        gates.append(g)

    _note_sizes(gates, made.sizes.get(("arm", "fp32")))
    # what program_repair restored (attributes/outputs jit.save dropped), once per op across all .nb files
    restored = sorted(r[len("repaired: "):] for r in made.repairs)
    write_json(ctx.out_dir / "lite.json", {"ops": ops, "files": made.files, "restored_for_lite": restored})
    return StageResult(gates=gates, precision={g.subject: g.precision_effective for g in gates},
                       metrics={g.subject: g.extra.get("bytes") for g in gates},
                       info={"ops": ops, "restored_for_lite": restored})


def _onnx_skipped(ctx, ref) -> StageResult:
    from pipeline.models.onnx_import import SKIP_ROWS

    lc, metric = ctx.cfg.lite, ref.task.primary_metric
    rows = [("arm", p) for p in lc.arm] + ([("x86", "fp32")] if lc.verify_x86 else [])
    gates = [skipped("lite", f"lite {t} {p}", p, metric, SKIP_ROWS["lite"]) for t, p in rows]
    # what the skips rest on, checked: the export holds the ONNX file and no Paddle program opt could convert
    exp = ctx.input("export")
    programs = sum((exp / f).is_file() for f in ("inference.pdmodel", "inference.pdiparams"))
    ok = programs == 0 and (exp / "model.onnx").is_file()
    gates.append(Gate("lite", "nothing to convert: the export is an ONNX model", "fp32", "none", metric,
                      status=OK if ok else FAIL, reason="" if ok else "model.source=onnx but the export holds a "
                      "Paddle program or no model.onnx: re-run `make export`",
                      checks=[Check("Paddle program files in the export", float(programs), 0.0, "<=", programs == 0),
                              Check("export model.onnx present", float((exp / "model.onnx").is_file()), 1.0, ">=",
                                    (exp / "model.onnx").is_file())]))
    write_json(ctx.out_dir / "lite.json", {"ops": [], "files": {}, "restored_for_lite": [],
                                           "skipped": SKIP_ROWS["lite"]})
    return StageResult(gates=gates, precision={g.subject: g.precision_effective for g in gates},
                       metrics={g.subject: None for g in gates}, info={"ops": [], "restored_for_lite": []})


@dataclass
class _Made:
    """What the conversions produced, for lite.json and the size notes."""
    files: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)      # (target, precision) -> bytes
    repairs: set = field(default_factory=set)


def _nb_stem(target: str, precision: str) -> str:
    # the stage's .nb is named as in the bundle (mobile/<target>_<precision>.nb): bundle copies it as is
    return PurePosixPath(bundle_layout.mobile_nb(target, precision)).stem


def _convert_row(ctx, task, ops: list, target: str, precision: str, made: _Made) -> Gate:
    subject = f"lite {target} {precision}"
    return run_row("lite", subject, precision, task.primary_metric,
                   lambda: _convert(ctx, task, ops, target, precision, made), ctx.out_dir / "evidence")


def _convert(ctx, task, ops: list, target: str, precision: str, made: _Made) -> Gate:
    """One opt conversion row: SKIPPED when there is nothing (passing) to convert or opt cannot do it,
    FAIL on unsupported ops, else OK for a .nb executed later on this host, UNVERIFIED for the others."""
    from pipeline.engines import lite

    subject = f"lite {target} {precision}"
    if precision == "int8" and not _int8_gate_passed(ctx):
        return skipped("lite", subject, precision, task.primary_metric,
                       "no INT8 model that passed its Paddle Inference gate (server int8 row)")
    no_fp16 = _no_fp16_evidence(ctx) if precision == "fp16" else ""
    if no_fp16:
        return skipped("lite", subject, precision, task.primary_metric, no_fp16)
    src = _source(ctx, precision)
    if src is None:
        return skipped("lite", subject, precision, task.primary_metric, "server stage made no INT8 model")
    missing = lite.unsupported_ops(ops, target)
    if missing:
        return Gate("lite", subject, precision, "none", task.primary_metric, status=FAIL,
                    reason=f"ops not supported by Lite on {target}: {', '.join(missing)}")
    t0 = time.perf_counter()
    try:
        res = lite.convert(src[0], src[1], ctx.out_dir / _nb_stem(target, precision), target=target,
                           precision=precision, timeout=ctx.cfg.lite.timeout)
    except lite.Unsupported as exc:
        return skipped("lite", subject, precision, task.primary_metric, exc.message)
    made.sizes[(target, precision)] = res.size_bytes
    made.repairs.update(n for n in res.notes if n.startswith("repaired: "))
    made.files[res.path.name] = {"bytes": res.size_bytes, "precision_effective": res.precision_effective,
                                 "notes": res.notes}
    g = Gate("lite", subject, precision, res.precision_effective, task.primary_metric,
             seconds=round(time.perf_counter() - t0, 2),
             extra={"file": res.path.name, "bytes": res.size_bytes, "notes": res.notes})
    if not lite.fp32_nb_runs_correctly_here(target, res.precision_effective):
        why = (f"no {target} device here" if target != host_arch()
               else f"a {res.precision_effective} .nb gives wrong numbers on this host")
        unverified(g, why, _voucher(ctx, res.precision_effective))
    return g


def _run_x86(ctx, ref, g: Gate) -> Gate:
    """Run the converted x86 fp32 .nb on the validation slice and gate it against the export."""
    from pipeline.engines import lite

    lc, task = ctx.cfg.lite, ref.task
    eng = lite.LiteEngine(ctx.out_dir / (_nb_stem("x86", "fp32") + ".nb"), ref.info["input_shape"], timeout=lc.timeout)
    out = eng.run(ref.inputs)
    value = task.metrics(out, ref.labels)[task.primary_metric] if np.isfinite(out).all() else float("nan")
    g.reference = ref.metric
    evaluate_tol(g, out, ref.outputs, lc.gate, value, task, key="lite.gate")
    if g.status == OK:        # a FAIL keeps the failure evaluate_tol wrote
        g.reason = "executed on the validation slice"
    return g


def _note_sizes(gates: list[Gate], arm_fp32_bytes: int | None) -> None:
    """Each converted row's reason ends with its size (and its ratio to the arm fp32 .nb)."""
    for g in gates:
        if "bytes" in g.extra:
            size = f"{g.extra['bytes'] / 1024:.0f} KiB"
            if arm_fp32_bytes:
                g.extra["size_ratio_vs_fp32"] = round(g.extra["bytes"] / arm_fp32_bytes, 3)
                size += f", {g.extra['size_ratio_vs_fp32']:.2f}× arm fp32"
            g.reason = f"{g.reason}; {size}" if g.reason else size


STAGE = Stage(name="lite", inputs=("export", "server"), config_keys=("lite",), make_target="deploy", run=run,
              machine_bound=True,     # its rows ran (gated, timed) on this CPU's kernels
              outputs=("lite.json",), optional_outputs=("*.nb",),
              description="Paddle Lite opt to arm/x86 .nb, x86 run gated against export")
