"""Evidence for a low-precision label: a row is called bf16, int8 or fp16 only when something shows it ran.

Two kinds of evidence, kept as small functions so any engine can use them:
  * structure: op precisions in the program Paddle Inference really executes (the optimized program it
    saves with `enable_save_optim_model`; oneDNN marks each op with `mkldnn_data_type`), or the casts of
    an fp16 emulation;
  * numerics: outputs that differ from fp32 the way that precision must (bf16 keeps 8 significant bits,
    so identical-to-fp32 outputs mean bf16 did not run, whatever was asked for).
Otherwise the label says what ran and why: "fp32 (bf16 not applied: ir_optim=false)".
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np

# Relative output difference (max |a-b| / max |ref|) below which two runs are "the same precision":
# fp32 kernel reorderings stay near 1e-6; fp16 rounding (11 bits) moves outputs by >= ~1e-4, bf16 (8 bits)
# and int8 by far more. Measured on the built-in CNNs: fp32 oneDNN vs reference <= 3e-7, fp16-emulated 2e-3.
SAME_AS_FP32_REL = 1e-5
# label -> the mkldnn_data_type oneDNN writes on ops it runs in that precision
ONEDNN_TYPE = {"bf16": "bfloat16", "int8": "int8"}


def head(label: str | None) -> str:
    """The precision itself, without its explanation: "fp32 (bf16 not applied: ...)" -> "fp32"."""
    return (label or "").split(" (", 1)[0]


def not_applied(requested: str, reason: str) -> str:
    return f"fp32 ({requested} not applied: {reason})"


@contextlib.contextmanager
def optimized_program_dir(cfg) -> Iterator[Path]:
    """Make a paddle.inference.Config save the program it really runs (after IR passes) into a temp dir."""
    tmp = Path(tempfile.mkdtemp(prefix="optim-evidence-"))
    try:
        cfg.set_optim_cache_dir(str(tmp))
        cfg.enable_save_optim_model(True)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def op_precisions(folder: Path) -> dict[str, dict[str, int]]:
    """{mkldnn_data_type: {op type: count}} of the saved optimized program; {} when none was saved
    (ir_optim=false saves nothing: no pass ran)."""
    from pipeline.engines.program import parse

    files = sorted(Path(folder).glob("*.pdmodel"))
    if not files:
        return {}
    desc = parse(files[0])
    found: dict[str, Counter] = {}
    for block in desc.blocks:
        for op in block.ops:
            for a in op.attrs:
                if a.name == "mkldnn_data_type" and a.s:
                    found.setdefault(a.s, Counter())[op.type] += 1
    return {k: dict(sorted(v.items())) for k, v in found.items()}


def structural_label(requested: str, ops: dict[str, dict[str, int]], why_not: str) -> tuple[str, dict]:
    """Label from the optimized program: `requested` only if oneDNN placed ops in that precision.
    Returns (label, evidence entries for Engine.evidence)."""
    placed = ops.get(ONEDNN_TYPE.get(requested, ""), {})
    if placed:
        listing = ", ".join(f"{op}×{n}" for op, n in placed.items())
        line = f"{sum(placed.values())} ops in {ONEDNN_TYPE[requested]} ({listing})"
        return requested, {"optimized_program": line, "op_precisions": ops}
    line = f"no op in {ONEDNN_TYPE.get(requested, requested)}"
    return not_applied(requested, why_not), {"optimized_program": line, "op_precisions": ops}


def why_not_applied(requested: str, *, mkldnn: bool, ir_optim: bool, saved: bool, simulated: bool) -> str:
    """The most specific reason oneDNN did not run `requested`, from what was configured and observed."""
    if not mkldnn:
        return "mkldnn=false"
    if not ir_optim:
        return "ir_optim=false"
    if not saved:
        return "no optimized program to inspect"
    if simulated:
        return f"oneDNN placed no {requested} op; the CPU profile is simulated, the real CPU lacks it"
    return f"oneDNN placed no {requested} op on this CPU"


def relative_difference(out: np.ndarray, ref: np.ndarray) -> float:
    from pipeline.core.gates import abs_max, diff_maxima

    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape == ref.shape:      # float64 slice by slice (a recogniser's outputs whole: 0.74 GB a copy)
        return diff_maxima(out, ref)[0] / max(abs_max(ref), 1e-12) if ref.size else 0.0
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.abs(ref64).max()) if ref64.size else 0.0, 1e-12)
    return float(np.abs(out64 - ref64).max()) / scale if ref64.size else 0.0


def check_outputs(label: str, requested: str, out: np.ndarray, fp32_ref: np.ndarray) -> tuple[str, str]:
    """Numeric evidence: a low-precision label survives only if outputs differ from fp32 beyond fp32 noise.
    Returns (label, evidence line for Engine.evidence["outputs_vs_fp32"])."""
    rel = relative_difference(out, fp32_ref)
    low = head(label) in ("bf16", "int8", "fp16", "fp16-emulated")
    line = f"outputs vs fp32: max relative difference {rel:.2e} (fp32 noise < {SAME_AS_FP32_REL:g})"
    if low and rel < SAME_AS_FP32_REL:
        return not_applied(requested, f"outputs identical to fp32 (relative difference {rel:.1e})"), line
    return label, line
