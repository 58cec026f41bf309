"""The OCR system bundle: two verified model bundles plus the system's own config, samples and gates.

    <name>/
      detection/   the detection run's bundle, unchanged (own manifest, infer_config with DB parameters, its fp32
                   reference: Paddle Inference, or ONNX Runtime for an imported .onnx)
      recognition/ the recognition run's bundle, unchanged (charset, CTC decoding)
      classifier/  optional: the 0/180 text-direction classifier's bundle
      infer_config.yaml   task: ocr_system, sub-bundle folders, field keys, flow settings, serving engine,
                          verify tolerance
      samples/page_NNN.png, samples/expected.json   sample pages and the fp32 chain's lines
      MODEL_CARD.md, manifest.json   (sha256 of every file, sub-bundles included; every gate)
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pipeline.bundle import layout
from pipeline.bundle.format import load_infer_config, read_manifest, verify_hashes
from pipeline.data.imagedecode import decode_file
from pipeline.core.errors import ConfigError, IntegrityError, MissingArtifact
from pipeline.core.gates import Check
from pipeline.ocr.system import SystemSpec, read_pages, set_opencv_threads
from pipeline.ocr.system_metrics import agreement

VERIFY_MAX_DISAGREEMENT = 0.05     # share of sample lines an engine may read differently from the bundle's record


def sub_bundle(folder: Path, cfg: dict, role: str) -> Path:
    """The model bundle folder a system bundle names for `role`: a plain sub-folder, nothing else."""
    name = cfg.get(role)
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise IntegrityError(f"{folder}/{layout.INFER_CONFIG}: {role} must name a sub-folder of the bundle, got {name!r}",
                             hint="rebuild the bundle with `make deploy CONFIG=configs/ocr_system.yaml`")
    if not (Path(folder) / name / layout.INFER_CONFIG).is_file():
        raise IntegrityError(f"{folder}/{name} is not a model bundle (no {layout.INFER_CONFIG})")
    return Path(folder) / name


def roles_of(cfg: dict) -> tuple[str, ...]:
    """The model bundles a system bundle holds, in flow order of the engines (det, rec[, cls])."""
    return ("detection", "recognition") + (("classifier",) if cfg.get("classifier") else ())


def spec_of(folder: Path) -> tuple[SystemSpec, dict, dict]:
    folder = Path(folder)
    cfg = load_infer_config(folder)
    det = load_infer_config(sub_bundle(folder, cfg, "detection"))
    rec = load_infer_config(sub_bundle(folder, cfg, "recognition"))
    cls = load_infer_config(sub_bundle(folder, cfg, "classifier")) if cfg.get("classifier") else None
    return SystemSpec.from_infer_configs(det, rec, cls, cfg.get("flow")), det, rec


def engine_set(make, subs: dict[str, Path]) -> tuple:
    """(det, rec, cls or None): make(role, sub-bundle folder) for every part the system has."""
    return (make("detection", subs["detection"]), make("recognition", subs["recognition"]),
            make("classifier", subs["classifier"]) if "classifier" in subs else None)


def subs_of(folder: Path, cfg: dict) -> dict[str, Path]:
    return {r: sub_bundle(folder, cfg, r) for r in roles_of(cfg)}


def measured_on(sub: Path) -> dict | None:
    """The CPU a model bundle's rows were gated and timed on (its manifest's hardware record)."""
    try:
        hw = read_manifest(sub)["hardware"]
    except (IntegrityError, KeyError, TypeError):
        return None
    if not isinstance(hw, dict):
        return None
    caps = hw.get("capabilities") or {}
    return {"cpu": hw.get("cpu"), "cores": hw.get("cores"), "avx512": hw.get("avx512"),
            "bf16": caps.get("bf16") or [], "vnni": caps.get("vnni") or []}


# verdicts (pipeline/bundle/recommend.py) of a low-precision row a pin must not serve: it failed or skipped its gate,
# or ran something else than it was asked for (a pin overrides the choice, never the gates)
_NOT_SERVABLE = ("failed gate", "skipped", "emulated", "no evidence", "not allowed", "failed to load")


def pin_refusal(rec: dict, kind: str, prec: str) -> str | None:
    """Why the part's bundle refuses a pinned low-precision row (its verdict there), None when it may serve it."""
    row = next((c for c in rec.get("candidates") or [] if c.get("engine") == kind and c.get("precision") == prec), None)
    if prec == "fp32" or row is None or row.get("verdict") not in _NOT_SERVABLE:
        return None
    return f"was not served: its row's verdict in the part's bundle is {row['verdict']} ({row.get('detail', '')})"


def part_serving(sub: Path, pin: str | None = None, role: str = "") -> dict:
    """What one part serves and why: {"engine", "precision", "model", "by", "why", "measured_on"[, "cpu",
    "speedup_vs_fp32"]}. pin ("openvino fp32", system.pin.<role>) overrides the part's own recommendation, which
    is otherwise taken as THIS CPU may run it (pipeline/bundle/serving_choice.runnable_choice)."""
    from pipeline.bundle.layout import serving_model
    from pipeline.bundle.serving_choice import runnable_choice, serving_choice

    cfg = load_infer_config(sub)
    rec = cfg.get("serving") or {}
    if pin:
        kind, prec = pin.split()
        serving_choice(cfg, kind, prec)         # a pair the bundle cannot serve fails here, with the choices
        out = {"engine": kind, "precision": prec, "by": f"pinned (system.pin.{role})",
               "why": f"pinned by the config (system.pin.{role}: {pin}); recommended: "
                      f"{rec.get('engine', 'paddle-inference')} {rec.get('precision', 'fp32')}"}
        refused = pin_refusal(rec, kind, prec)
        if refused:
            import logging

            logging.getLogger("pipeline").warning("[system] %s: system.pin %s %s; serving %s fp32", role, pin, refused,
                                                  kind)
            out.update(precision="fp32", why=f"system.pin.{role} {pin} {refused}: that engine's fp32 instead")
    else:
        ch = runnable_choice(sub, cfg)
        out = {"engine": ch["engine"], "precision": ch["precision"], "by": "recommendation", "why": ch["why"],
               **({"cpu": ch["cpu"]} if ch["cpu"] else {})}
        row = next((c for c in rec.get("candidates") or [] if c.get("engine") == out["engine"]
                    and c.get("precision") == out["precision"]), {})
        if row.get("speedup_vs_fp32") is not None:
            out["speedup_vs_fp32"] = row["speedup_vs_fp32"]
    return {**out, "model": serving_model(out["engine"], out["precision"], sub), "measured_on": measured_on(sub)}


def served_engine(sub: Path, threads: int, kind: str = "auto", part: dict | None = None, role: str = "",
                  flow: dict | None = None):
    """One part's engine as `/ocr` runs it: auto = its bundle's recommended engine at its precision as this CPU may
    run it (per batch profile, as `serve` loads it), or the row the system bundle pinned (part["by"] pinned); an
    engine name = that runtime on the part's fp32 model (the pre-auto behaviour); "reference" = the part's fp32
    reference engine (pipeline/bundle/reference.py). ONNX Runtime's pool threads
    sleep between calls, as in `serve`. engine.serving says what runs and why (GET /health). flow: the system's
    (its det_static_shapes applies to the detector's served row, not to a reference)."""
    from pipeline.engines import registry
    from pipeline.bundle.serving_choice import MODEL_PATHS, load_engine
    from pipeline.ocr.system import det_static_shapes

    shapes = det_static_shapes(flow or {}) if role == "detection" else 0
    if kind == "auto" and part and part.get("by", "recommendation") != "recommendation":   # pinned, system pages
        eng = load_engine(sub, load_infer_config(sub), part["engine"], threads, part["precision"], label=role,
                          static_shapes=shapes)
        eng.serving["why"] = part.get("why", eng.serving["why"])
        return eng
    if kind == "auto":
        return load_engine(sub, load_infer_config(sub), threads=threads, label=role, static_shapes=shapes)
    if kind == "reference":     # the part's fp32 reference, as verify and the system stage's fp32 chain run it
        eng = reference_engine(sub, threads)
        eng.serving = {"engine": eng.kind, "precision": "fp32", "why": "the part's fp32 reference (its bundle's "
                       "`reference`)", "cpu": None, "effective_precision": eng.effective_precision}
        return eng
    eng = registry.make(kind, sub / MODEL_PATHS[kind], "fp32", threads=threads, spin=False)
    eng.serving = {"engine": kind, "precision": "fp32", "why": f"system.engine={kind}: every part's fp32 model "
                   "on that runtime", "cpu": None, "effective_precision": eng.effective_precision}
    return eng


def served_system(folder: Path, threads: int, kind: str | None = None) -> tuple:
    """(det, rec, cls or None, spec) as `/ocr` runs them: system.engine as built (auto: each part's recommendation
    or its pin, infer_config `served`; bundles from before `auto` name one runtime, run on each part's fp32 model)."""
    folder = Path(folder)
    cfg = load_infer_config(folder)
    kind = kind or cfg.get("engine", "paddle-inference")
    served = cfg.get("served") or {}
    spec, _, _ = spec_of(folder)
    set_opencv_threads(threads)
    subs = subs_of(folder, cfg)
    det, rec, cls = engine_set(lambda r, b: served_engine(b, threads, kind, served.get(r), r, spec.flow), subs)
    return det, recheck_served(rec, subs["recognition"], spec.flow, threads), cls, spec


def recheck_served(rec, sub: Path, flow: dict, threads: int):
    """The served recogniser with the flow's fp32 re-read of its lines in doubt (rec_recheck_margin,
    pipeline/ocr/recheck.py) by the same runtime's fp32 model; as it is when that is off or it runs fp32."""
    from pipeline.bundle.serving_choice import load_engine
    from pipeline.ocr.recheck import rechecked

    kind = (getattr(rec, "serving", None) or {}).get("engine", rec.kind)
    return rechecked(rec, flow, lambda: load_engine(sub, load_infer_config(sub), kind, threads, "fp32",
                                                    label="recognition (lines in doubt)"))


def reference_engine(sub: Path, threads: int):
    """A part's fp32 reference engine (pipeline/bundle/reference.py): Paddle Inference on its program, or ONNX Runtime
    at basic graph optimizations on an imported .onnx."""
    from pipeline.bundle import reference

    return reference.engine(sub, load_infer_config(sub), threads)


def references(subs: dict[str, Path]) -> dict[str, tuple[str, str]]:
    """role -> (engine, "fp32") of each part's reference."""
    from pipeline.bundle import reference

    return {r: reference.pair(load_infer_config(b)) for r, b in subs.items()}


def reference_label(subs: dict[str, Path], all_paddle: str = "server fp32") -> str:
    """The fp32 chain's name: `all_paddle` when every part's reference is Paddle Inference (the names used before ONNX
    imports were bundled), else the engine of each part, e.g. "reference fp32 (detection onnxruntime, recognition
    onnxruntime, classifier paddle-inference)"."""
    refs = references(subs)
    if all(k == layout.DEFAULT_REFERENCE for k, _ in refs.values()):
        return all_paddle
    return "reference fp32 (" + ", ".join(f"{r} {k}" for r, (k, _) in refs.items()) + ")"


def paddle_engine(prefix: Path, precision: str, threads: int):
    from pipeline.engines.paddle_infer import InferenceEngine

    return InferenceEngine(prefix, precision, threads=threads)


def lite_engine(nb: Path, input_shape: list, timeout: float):
    from pipeline.engines.lite import LiteEngine

    return LiteEngine(nb, input_shape, timeout=timeout)


def lite_shape(sub: Path) -> list:
    """The input shape a part's .nb is run with: its program's, dynamic dims free (PP-OCR's det and rec)."""
    from pipeline.engines.paddle_infer import program_input_shape

    return program_input_shape(sub / layout.FP32_PREFIX)


LITE_BATCH = 4096      # one Lite subprocess per model per call, not one per 16 pages


def model_prefix(sub: Path, precision: str) -> Path | None:
    """Paddle Inference model of one precision inside a model bundle (None when it holds none)."""
    p = sub / layout.server_prefix(precision)
    return p if p.with_suffix(".pdmodel").is_file() else None


def write_samples(folder: Path, pages: list[np.ndarray], lines: list[list[dict]],
                  served: list[list[dict]] | None = None) -> list[str]:
    """Sample pages with the fp32 chain's lines (and, when system.engine=auto serves another set, what that set read)."""
    from pipeline.core.artifacts import atomic_write_text
    from pipeline.bundle.format import write_sample_pngs

    names = write_sample_pngs(folder, pages, layout.SYSTEM_SAMPLE_PNG)
    items = [{"file": n, "lines": ln, **({"served_lines": served[i]} if served else {})}
             for i, (n, ln) in enumerate(zip(names, lines))]
    atomic_write_text(folder / layout.SYSTEM_SAMPLES_EXPECTED, json.dumps({"pages": items}, indent=1))
    return names


def _sample_pages(folder: Path) -> tuple[list[np.ndarray], list[list[dict]], list[list[dict]]]:
    """(pages, the fp32 chain's lines, the served set's lines: the fp32 ones in bundles that serve fp32)."""
    expected = json.loads((folder / layout.SYSTEM_SAMPLES_EXPECTED).read_text())["pages"]
    if not expected:
        raise MissingArtifact(f"{folder}/{layout.SYSTEM_SAMPLES_EXPECTED} lists no sample pages")
    pages = []
    for item in expected:
        pages.append(decode_file(folder / item["file"]))
    return pages, [item["lines"] for item in expected], [item.get("served_lines", item["lines"]) for item in expected]


def verify_system(folder: Path, timeout: float = 120, threads: int = 0) -> dict:
    """Hashes of everything, each model bundle's own sample checks, then the system on its sample pages."""
    from pipeline.core.env import cpu_count
    from pipeline.bundle.verify_model import verify_model_folder

    folder = Path(folder)
    manifest = verify_hashes(folder)
    cfg = load_infer_config(folder)
    checks = [asdict(Check("sha256 of every file", 0.0, 0.0))]
    for role in roles_of(cfg):
        sub = verify_model_folder(sub_bundle(folder, cfg, role), timeout=timeout, threads=threads)
        checks += [{**c, "name": f"{role}: {c['name']}"} for c in sub["checks"]]
    spec, _, _ = spec_of(folder)
    pages, expected, served_lines = _sample_pages(folder)
    threads = threads or cpu_count()
    set_opencv_threads(threads)
    limit = float(cfg.get("verify", {}).get("max_disagreement", VERIFY_MAX_DISAGREEMENT))
    subs = subs_of(folder, cfg)
    runs = {reference_label(subs): engine_set(lambda r, b: reference_engine(b, threads), subs)}
    x86_nb = layout.mobile_nb("x86", "fp32")
    if all((b / x86_nb).is_file() for b in subs.values()):
        runs["lite x86 fp32"] = engine_set(lambda r, b: lite_engine(b / x86_nb, lite_shape(b), timeout), subs)
    if cfg.get("engine") == "auto":      # what /ocr serves, against what that set read when the bundle was built
        served = cfg.get("served") or {}
        det, rec, cls = engine_set(lambda r, b: served_engine(b, threads, "auto", served.get(r), r, spec.flow), subs)
        runs["as served"] = (det, recheck_served(rec, subs["recognition"], spec.flow, threads), cls)
    sets = {name: _precisions(engines) for name, engines in runs.items()}
    for name, (det, rec, cls) in runs.items():
        got = read_pages(pages, det, rec, spec, batch=LITE_BATCH if name.startswith("lite") else 16, cls=cls)
        miss = 1.0 - agreement(got, served_lines if name == "as served" else expected)
        checks.append(asdict(Check(f"system {name} lines differing on sample pages", miss, limit, "<=",
                                   miss <= limit)))
    return {"bundle": manifest.get("name"), "files": len(manifest["files"]), "checks": checks,
            "sets": sets, "ok": all(c["passed"] for c in checks)}


def _precisions(engines: tuple) -> dict:
    """{role: {engine, requested, effective}} of one checked set, from the engines that ran it (never a label)."""
    out = {}
    for role, eng in zip(("detection", "recognition", "classifier"), engines):
        if eng is not None:
            serving = getattr(eng, "serving", None) or {}
            out[role] = {"engine": eng.kind, "requested": serving.get("precision", "fp32"),
                         "effective": eng.effective_precision}
    return out


def parts_served(sc, subs: dict) -> dict:
    """role -> what the part serves and why (its recommendation as this CPU runs it, or system.pin.<role>)."""
    if sc.pin and sc.engine != "auto":
        raise ConfigError(f"system.pin {dict(sc.pin)} needs system.engine: auto (it is {sc.engine!r})",
                          hint="set system.engine=auto, or drop system.pin")
    unknown = sorted(set(sc.pin) - set(subs))
    if unknown:
        raise ConfigError(f"system.pin names {unknown[0]!r}, which this system has no part for",
                          hint=f"one of {', '.join(subs)}")
    return {r: part_serving(b, sc.pin.get(r), r) for r, b in subs.items()}

