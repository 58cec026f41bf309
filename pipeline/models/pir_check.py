"""The reference check of a translated PIR model: run the Paddle 2.6 program on the stored inputs and compare with
outputs an independent runtime produced from the original (Paddle 3 on the json, `make pir-reference`; an ONNX
conversion), slice by slice. NaN/Inf fail first; any difference above `atol` fails with the output named.

  .venv/bin/python -m pipeline.models.pir_check DET_PREFIX REC_PREFIX REF.npz [REF2.npz ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pipeline.core.errors import GateFailed, NonFiniteError, PipelineError
from pipeline.models.pir_slices import input_keys, normalise

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "pir"
ATOL = 1e-4       # the bound; measured: see docs/pir_import.md


def run(prefix: str | Path, x: np.ndarray) -> np.ndarray:
    from pipeline.engines.paddle_infer import reference_outputs
    return np.asarray(reference_outputs(prefix, x))


def differences(prefixes: dict[str, Path], ref: dict, inputs: dict) -> dict[str, float]:
    """{output key: max |ours - reference|} over what the reference kept (whole det maps, rec top-k + columns)."""
    out = {}
    for role, prefix in prefixes.items():
        for key in input_keys(inputs, role):
            y = run(prefix, normalise(role, inputs[key], inputs))
            if not np.isfinite(y).all():
                raise NonFiniteError(f"pir check: {role} output {key} has {int((~np.isfinite(y)).sum())} NaN/Inf",
                                     hint="the translated program is broken")
            if role == "det":
                out[key] = float(np.abs(y - ref[key]).max())
                continue
            shape = tuple(int(v) for v in ref[f"{key}.shape"])
            if y.shape != shape:
                raise GateFailed(f"pir check: {key} output shape {list(y.shape)}, reference {list(shape)}")
            from pipeline.models.pir_slices import columns
            top = np.take_along_axis(y, ref[f"{key}.top_idx"].astype(np.int64), -1)
            out[key] = float(max(np.abs(top - ref[f"{key}.top_val"]).max(),
                                 np.abs(y[..., columns(y.shape[-1])] - ref[f"{key}.cols"]).max()))
    return out


def check(prefixes: dict[str, Path], ref_file: Path, inputs_file: Path = DATA / "inputs.npz",
          atol: float = ATOL) -> dict[str, float]:
    """differences(), and GateFailed naming the worst output when one exceeds atol."""
    with np.load(inputs_file) as zi, np.load(ref_file) as zr:
        diffs = differences(prefixes, dict(zr), dict(zi))
    worst = max(diffs, key=diffs.get)
    if diffs[worst] > atol:
        raise GateFailed(f"pir check vs {Path(ref_file).name}: {worst} max|diff| {diffs[worst]:.3g} > {atol:g}",
                         hint="the translation or the parameter binding is wrong (tampered order, wrong op)")
    return diffs


if __name__ == "__main__":
    det, rec, *refs = sys.argv[1:]
    try:
        for r in refs:
            d = check({"det": Path(det), "rec": Path(rec)}, Path(r))
            print(f"{Path(r).name}: " + ", ".join(f"{k} {v:.2g}" for k, v in d.items()) + f" (<= {ATOL:g}: OK)")
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        sys.exit(exc.exit_code)
