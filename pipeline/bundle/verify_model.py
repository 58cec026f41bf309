"""Verifying one model bundle that is already open and signature-checked: hashes, then every runnable model
in it on the bundled samples, with the bundle's own sample tolerance. `pipeline/bundle/verify.py` opens bundles and
dispatches on their kind; the OCR system's verifier (pipeline/bundle/system.py) calls this for its parts.

Parameter files are parsed by Paddle, so nothing is loaded before every hash matched.
"""
from __future__ import annotations

import zipfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pipeline.bundle import layout as layout
from pipeline.bundle.format import inside_bundle, load_infer_config, verify_hashes
from pipeline.core.errors import DataError, IntegrityError
from pipeline.engines import onnx_files
from pipeline.core.gates import Check, output_kind, parity_checks, parity_limits
from pipeline.data.preprocess import decode_image_bytes, to_tensor

# bundles written before bundle.sample_atol/rtol existed carry no sample_check: their tolerance was this; those
# written before bundle.sample_prob_atol compared probabilities as log-probabilities: they get its default
LEGACY_SAMPLE_CHECK = {"atol": 1e-4, "rtol": 0.0, "prob_atol": 1e-3}


def load_samples(folder: Path, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, expected fp32 outputs) of the bundle's samples, read through the path `serve` uses for uploads."""
    try:
        with np.load(folder / layout.SAMPLES_EXPECTED, allow_pickle=False) as z:
            files, expected = [str(f) for f in z["files"]], z["outputs"]
        for f in files:                     # the sample list is data too: it must not point outside
            inside_bundle(folder, f, layout.SAMPLES_EXPECTED)
        # the same decode → fit → normalise path `serve` uses for uploaded images
        images = np.stack([decode_image_bytes((folder / f).read_bytes(), cfg["preprocess"]) for f in files])
        return to_tensor(images, cfg["preprocess"]), expected
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile, DataError) as exc:
        msg = exc.one_line() if isinstance(exc, DataError) else f"{type(exc).__name__}: {exc}"
        raise IntegrityError(f"bundle samples are unreadable ({msg})", hint="rebuild the bundle with `make deploy`") from None


def _checks(engine: str, out: np.ndarray, expected: np.ndarray, cfg: dict, tol: dict | None = None) -> list[dict]:
    """The gates' own parity checks (NaN/Inf, shape, max abs diff), named for the engine, with the bundle's
    sample tolerance for the model's output kind (logits: sample_atol/rtol; probabilities: sample_prob_atol), or
    `tol`: a served low-precision row's own gate tolerance (its prob_atol is null in fp16/bf16/int8: NaN/Inf only,
    the server stage judged its decoded output); the limit-less max_rel_diff is left out of a pass/fail report."""
    from pipeline.tasks import get_task

    if tol is None:
        tol, key, prefix = {**LEGACY_SAMPLE_CHECK, **(cfg.get("sample_check") or {})}, "bundle", "sample_"
    else:
        key, prefix = tol.get("key", "bundle.sample"), ""
    kind = output_kind(get_task(cfg["task"], cfg.get("postprocess")))
    atol, rtol, suffix = parity_limits(kind, tol["atol"], tol.get("rtol", 0.0), tol.get("prob_atol"))
    keys = "/".join(f"{prefix}{k}" for k in suffix.split("/"))     # bundle.sample_atol/sample_rtol, ...
    return [{**asdict(c), "name": f"{engine} {c.name} on samples"}
            for c in parity_checks(out, expected, atol, rtol, key=key, suffix=keys) if c.limit is not None]


def _engines(folder: Path, cfg: dict, timeout: float, threads: int) -> dict:
    """Every runnable model in the bundle, behind the one engine interface: name -> Engine factory; the fp32
    reference first (Paddle Inference on the program, or ONNX Runtime at basic optimizations on an imported .onnx)."""
    from pipeline.bundle import reference
    from pipeline.engines import lite
    from pipeline.core.env import cpu_count

    ref_kind, _ = layout.reference_of(cfg)
    ref_threads = threads or (cpu_count() if ref_kind == "paddle-inference" else 1)
    found = {reference.label(cfg): lambda: reference.engine(folder, cfg, ref_threads)}
    nb = folder / layout.mobile_nb("x86", "fp32")
    if nb.is_file() and lite.fp32_nb_runs_correctly_here("x86"):
        found["lite x86 fp32"] = lambda: lite.LiteEngine(nb, cfg["input"]["shape"], timeout=timeout)
    onnx = folder / layout.ONNX_MODEL
    if onnx.is_file():
        from pipeline.engines.ort import OrtEngine

        found["onnxruntime fp32"] = lambda: OrtEngine(onnx, threads=threads or 1)
    return found


def _served_checks(folder: Path, cfg: dict, x: np.ndarray, expected: np.ndarray, threads: int) -> list[dict]:
    """The recommended row as `serve` loads it, when it is not one of the fp32 models checked above, with its
    own gate's tolerance (an int8 row is held to server.gates.int8, not to fp32's sample tolerance)."""
    from pipeline.bundle.serving_choice import load_engine

    rec = cfg.get("serving") or {}
    prec = rec.get("precision") or "fp32"
    if prec == "fp32" and rec.get("engine") in (None, "paddle-inference", "onnxruntime"):    # checked in _engines
        return []
    from pipeline.engines.evidence import head

    engine = load_engine(folder, cfg, threads=threads or 1)
    ran = head(engine.effective_precision)      # bf16 on a CPU without it is served (and checked) as fp32
    tol = rec.get("tolerance") if ran != "fp32" else None
    return _checks(f"served {engine.kind} {ran}", engine.run(x), expected, cfg, tol)


# low-precision rows that load a file of their own (bf16 runs the fp32 files, checked above at fp32)
OWN_FILE_ROWS = (("paddle-inference", "int8"), ("paddle-inference", "fp16"), ("onnxruntime", "int8"),
                 ("openvino", "int8"))


def _gate_tolerance(manifest: dict, precision: str) -> dict | None:
    """The tolerance the server stage gated `precision` with (server.gates.<precision> of the bundle's config)."""
    tol = (((manifest.get("config") or {}).get("server") or {}).get("gates") or {}).get(precision)
    return {**tol, "key": f"server.gates.{precision}"} if isinstance(tol, dict) and "atol" in tol else None


def _other_rows_checks(folder: Path, cfg: dict, x: np.ndarray, expected: np.ndarray, threads: int,
                       manifest: dict) -> tuple[list[dict], dict]:
    """Every low-precision model file `serve --engine/--precision` could load besides the recommended row, run on
    the samples with its own gate's tolerance: a swapped int8 file with a rehashed manifest fails here.
    -> (checks, {file: why it was not run}) (fp16 needs a GPU; a bundle without gate tolerances is older)."""
    from pipeline.bundle.serving_choice import load_engine
    from pipeline.core import capabilities
    from pipeline.engines.evidence import head

    rec = cfg.get("serving") or {}
    served = (rec.get("engine") or layout.reference_of(cfg)[0], rec.get("precision") or "fp32")
    checks, not_run = [], {}
    for kind, prec in OWN_FILE_ROWS:
        rel = layout.serving_model(kind, prec, folder)
        if (kind, prec) == served or not layout.model_exists(folder / rel):
            continue
        tol = _gate_tolerance(manifest, prec)
        if tol is None:
            not_run[rel] = f"{kind} {prec}: the bundle records no server.gates.{prec} tolerance (made before verify ran it)"
        elif prec == "fp16" and not capabilities.gpu()["gpu"]:
            not_run[rel] = f"{kind} fp16 needs a GPU; this machine has none"
        else:
            engine = load_engine(folder, cfg, override=kind, threads=threads or 1, precision=prec)
            checks += _checks(f"{kind} {head(engine.effective_precision)}", engine.run(x), expected, cfg, tol)
    return checks, not_run


def verify_model_folder(folder: Path, timeout: float = 120, threads: int = 0, manifest: dict | None = None) -> dict:
    """Hashes (unless the caller checked them: `manifest`), then each runnable model on the samples; a report
    dict (no exception for a failed check)."""
    manifest = manifest if manifest is not None else verify_hashes(folder)
    for rel in sorted(manifest["files"]):       # every ONNX file, before any engine opens one (issue 47)
        if rel.endswith(".onnx"):
            onnx_files.confine(folder / rel)
    cfg = load_infer_config(folder)
    x, expected = load_samples(folder, cfg)
    checks = [asdict(Check("sha256 of every file", 0.0, 0.0))]       # verify_hashes raised otherwise
    for name, make in _engines(folder, cfg, timeout, threads).items():
        checks += _checks(name, make().run(x), expected, cfg)
    checks += _served_checks(folder, cfg, x, expected, threads)
    others, not_run = _other_rows_checks(folder, cfg, x, expected, threads, manifest)
    failed = [c for c in checks + others if not c["passed"]]
    return {"bundle": manifest.get("name"), "files": len(manifest["files"]), "checks": checks + others,
            "ok": not failed, "unverified": {**manifest.get("unverified", {}), **not_run}}
