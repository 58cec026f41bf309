"""bundle: assemble a self-describing deployable folder + .tar.gz from the run's artifacts.

Nothing here re-derives anything: files are copied from upstream stages, and every gate and
precision is taken from their manifests. The bundle is built in the stage's temp folder, checked
(hashes, then the FP32 model and the x86 .nb on the bundled samples), and only then published
under bundle.root — never over an existing version.
"""
from __future__ import annotations

import io
import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

import numpy as np
import yaml

from pipeline.bundle import layout as bundle_layout, reference, signing
from pipeline.core import env
from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text, describe_files, write_json
from pipeline.bundle.format import FORMAT_VERSION, check_name, publish, write_archive, write_sample_pngs
from pipeline.core.config import ROOT
from pipeline.core.errors import ConfigError, IntegrityError
from pipeline.core.gates import OK, Check, Gate
from pipeline.core.runner import Stage, StageContext, StageResult


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def infer_config(info: dict, export_info: dict, serving: dict | None = None, sample_check: dict | None = None,
                 ref: dict | None = None) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "task": info["task"],
        "input": {"name": "x", "dtype": "float32", "shape": [None] + info["input_shape"][1:], "layout": "NCHW"},
        "preprocess": info["preprocess"],
        "postprocess": info["postprocess"],
        "primary_metric": info["primary_metric"],
        "models": export_info,
        # the fp32 engine + model the samples' expected outputs come from (pipeline/bundle/reference.py)
        "reference": ref or reference.record(info),
        "serving": serving or None,     # recommended engine + measured settings (pipeline/bundle/serving_choice.py)
        "sample_check": sample_check,   # `verify`'s tolerance on the bundled samples (bundle.sample_atol/rtol/prob_atol)
    }


def write_samples(folder: Path, images: np.ndarray, outputs: np.ndarray, labels: np.ndarray) -> list[str]:
    names = write_sample_pngs(folder, images, bundle_layout.SAMPLE_PNG)
    buf = io.BytesIO()
    np.savez(buf, outputs=outputs, labels=labels, files=np.array(names))
    atomic_write_bytes(folder / bundle_layout.SAMPLES_EXPECTED, buf.getvalue())
    return names


def model_card(name: str, info: dict, gates: list[dict], versions: dict, files: dict, serving: dict | None = None,
               ref: dict | None = None) -> str:
    ref = ref or reference.record(info)
    how = f", {ref['graph_optimization']} graph optimizations" if ref.get("graph_optimization") else ""
    lines = [f"# {name}", "", f"Task: **{info['task']}**, input {info['input_shape'][1:]} (NCHW, float32), "
             f"primary metric **{info['primary_metric']}**.", "",
             f"Reference: **{ref['engine']} fp32** on `{ref['model']}`{how}: the samples' expected outputs come from "
             "it and `verify` runs it first" + (f" ({ref['why']})." if ref.get("why") else "."), "",
             "## Gates", "", "OK: executed here and within tolerance. UNVERIFIED: converted, not executed; the row says "
             "what vouches for it. SKIPPED: not produced, with the reason.", "",
             "| stage | checked | precision (effective) | metric | value | verdict |", "|---|---|---|---|---|---|"]
    for g in gates:
        v = "" if g.get("value") is None else f"{g['value']:.4f}"
        lines.append(f"| {g['stage']} | {g['subject']} | {g['precision_effective']} | {g['metric']} | {v} | "
                     f"{g['status']}{(': ' + g['reason']) if g['status'] in ('SKIPPED', 'UNVERIFIED') else ''} |")
    if serving and serving.get("engine"):
        lines += ["", "## Served", "", f"`serve` runs **{serving['engine']} {serving.get('precision', 'fp32')}** "
                  f"(`{serving.get('model', '')}`): {serving.get('why', 'recommended by the server stage')}."]
    lines += ["", "## Files", ""] + [f"- `{k}` ({v['bytes']:,} bytes)" for k, v in files.items()]
    lines += ["", "## Versions", ""] + [f"- {k}: {v}" for k, v in versions.items()]
    lines += ["", "Verify before use: `python -m pipeline verify <this folder or .tar.gz> [--key PUBLIC.pem]` "
              "(with the publisher's public key when the bundle carries `model.sig`).",
              "Files whose row is UNVERIFIED were converted, not executed here (e.g. ARM `.nb` on an x86 host); "
              "their accuracy is vouched for by the executed row their line names.", ""]
    return "\n".join(lines)


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    export_dir, server_dir, lite_dir = ctx.input("export"), ctx.input("server"), ctx.input("lite")
    info = json.loads((export_dir / "info.json").read_text())
    version, name, root, sign_key = _destination(cfg)
    published = root / name
    t0 = time.perf_counter()
    b = ctx.out_dir / name
    ref = reference.record(info)        # Paddle Inference on the program, or ONNX Runtime on an imported .onnx
    models = _copy_models(b, export_dir, server_dir, lite_dir, ref["engine"])
    serving = json.loads((server_dir / "serving.json").read_text()) if (server_dir / "serving.json").is_file() else None

    with np.load(export_dir / "reference.npz") as z:       # the reference engine's outputs (export stage)
        k = min(cfg.bundle.samples, len(z["labels"]))
        write_samples(b, z["images"][:k], z["outputs"][:k], z["labels"][:k])
    atomic_write_text(b / bundle_layout.INFER_CONFIG, yaml.safe_dump(infer_config(
        info, models, serving, {"atol": cfg.bundle.sample_atol, "rtol": cfg.bundle.sample_rtol,
                                "prob_atol": cfg.bundle.sample_prob_atol}, ref), sort_keys=False))
    files, public_key = _write_manifest(ctx, b, name, version, info, sign_key, serving, ref)

    gate = _self_verify(cfg, b, public_key)
    if cfg.bundle.archive:
        write_archive(b, ctx.out_dir / f"{name}.tar.gz")
    gate.seconds = round(time.perf_counter() - t0, 2)
    if gate.status == OK:
        publish(ctx.out_dir, name, root, cfg.bundle.archive)
    return StageResult(gates=[gate], precision={"requested": "float32", "effective": "float32"},
                       metrics={"files": len(files), "bytes": sum(f["bytes"] for f in files.values()),
                                "signed": sign_key is not None},
                       info={"bundle": str(published), "archive": str(published) + ".tar.gz" if cfg.bundle.archive
                             else None, "name": name})


def _destination(cfg) -> tuple[str, str, Path, Path | None]:
    """(version, name, bundle.root, signing key), refused before anything is copied: a missing key or an
    existing bundle of that name would otherwise be found only after the work."""
    version = cfg.bundle.version or datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = check_name(f"{cfg.run.name}-{version}")         # a folder under bundle.root: a name, never a path
    root = Path(cfg.bundle.root) if Path(cfg.bundle.root).is_absolute() else ROOT / cfg.bundle.root
    published = root / name
    sign_key = Path(cfg.bundle.sign_key) if cfg.bundle.sign_key else None
    if sign_key is not None and not sign_key.is_file():
        raise ConfigError(f"bundle.sign_key {sign_key} not found",
                          hint="pass an EC private key (PEM), or bundle.sign_key=null for an unsigned bundle")
    if published.exists():
        raise ConfigError(f"bundle {published} already exists; bundles are never overwritten",
                          hint="set bundle.version to a new value (or leave it null for a timestamp)")
    return version, name, root, sign_key


def _mobile_path(nb_name: str) -> str:
    """The bundle path of a lite stage .nb (named <target>_<precision>.nb there)."""
    target, precision = Path(nb_name).stem.split("_", 1)
    return bundle_layout.mobile_nb(target, precision)


def _copy_reference(b: Path, export_dir: Path, server_dir: Path, ref_engine: str) -> dict:
    """The export's fp32 model into the bundle as its reference: the Paddle program, or (model.source=onnx) the
    imported .onnx, which the server stage ran as it is (the same bytes, or the bundle would pair other rows' files
    with another reference) -> infer_config's `models` so far."""
    from pipeline.core.artifacts import sha256_file

    fp32 = bundle_layout.REFERENCE_MODELS[ref_engine]
    if ref_engine == "paddle-inference":
        _copy(export_dir / "inference.pdmodel", b / f"{fp32}.pdmodel")
        _copy(export_dir / "inference.pdiparams", b / f"{fp32}.pdiparams")
        return {"fp32": fp32}
    served = server_dir / "onnx" / "model.onnx"
    if served.is_file() and sha256_file(served) != sha256_file(export_dir / "model.onnx"):
        raise IntegrityError(f"bundle: {served} is not the export's model.onnx (sha256 differs)",
                             hint="run the server stage again (FORCE=1 make deploy)")
    _copy(export_dir / "model.onnx", b / fp32)
    return {"fp32": fp32, "onnx": fp32}


def _copy_models(b: Path, export_dir: Path, server_dir: Path, lite_dir: Path, ref_engine: str) -> dict:
    """Copy every model file into the bundle layout -> infer_config's `models` (name -> bundle path)."""
    models = _copy_reference(b, export_dir, server_dir, ref_engine)
    for prec_dir in sorted((server_dir / "models").glob("*")) if (server_dir / "models").is_dir() else []:
        prefix = bundle_layout.server_prefix(prec_dir.name)
        for f in prec_dir.glob("*.pd*"):
            _copy(f, b / PurePosixPath(prefix).parent / f.name)
        models[prec_dir.name] = prefix
    if "onnx" not in models and (server_dir / "onnx" / "model.onnx").is_file():   # paddle2onnx export, gated there
        _copy(server_dir / "onnx" / "model.onnx", b / bundle_layout.ONNX_MODEL)
        models["onnx"] = bundle_layout.ONNX_MODEL
    for src, dst in bundle_layout.SERVER_STAGE_MODELS.items():   # ORT / OpenVINO int8, OpenVINO bf16 IR: servable
        if (server_dir / src).is_file():
            _copy(server_dir / src, b / dst)
            if dst.endswith((".onnx", ".xml")):     # onnx_int8, openvino_int8, openvino_bf16
                models[PurePosixPath(src).parent.name + "_" + PurePosixPath(src).stem.split("_")[-1]] = dst
    for nb in sorted(lite_dir.glob("*.nb")):
        _copy(nb, b / _mobile_path(nb.name))
        models[f"lite_{nb.stem}"] = _mobile_path(nb.name)
    return models


def _write_manifest(ctx, b: Path, name: str, version: str, info: dict, sign_key: Path | None, serving: dict | None,
                    ref: dict):
    """MODEL_CARD.md, then manifest.json (hashes of everything else), then the signature -> (files, public key)."""
    cfg = ctx.cfg
    gates = [g for stage in STAGE.inputs for g in ctx.input_manifests[stage]["gates"]]      # every upstream gate
    precisions = {s: ctx.input_manifests[s].get("precision", {}) for s in STAGE.inputs}
    versions = env.versions()
    files = describe_files(b)
    atomic_write_text(b / bundle_layout.MODEL_CARD, model_card(name, info, gates, versions, files, serving, ref))
    files = describe_files(b)
    manifest = {
        "format_version": FORMAT_VERSION, "name": name, "version": version,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "task": info["task"], "files": files, "versions": versions, "git_commit": env.git_commit(),
        "hardware": env.hardware(), "config": cfg.to_dict(), "precisions": precisions, "gates": gates,
        "reference": ref,           # the fp32 engine + model the samples were written by and verify runs first
        # produced but never executed here: verify cannot check these either, so say what vouches for them
        "unverified": {_mobile_path(g["extra"]["file"]): g["reason"] for g in gates
                       if g["status"] == "UNVERIFIED" and (g.get("extra") or {}).get("file")},
        "stage_fingerprints": {s: m["fingerprint"] for s, m in ctx.input_manifests.items()},
        # what `serve` runs and why (the full record, every candidate included, is infer_config.yaml's `serving`)
        "serving": {k: serving[k] for k in ("engine", "precision", "row", "model", "why", "fp32") if k in serving}
        if serving else None,
    }
    if sign_key is not None:
        manifest["signature"] = {"format": signing.FORMAT, "file": signing.SIGNATURE}
    write_json(b / bundle_layout.MANIFEST, manifest)
    public_key = None
    if sign_key is not None:                              # signs every file, manifest.json included
        signing.sign(b, sign_key)
        public_key = ctx.work_dir / "sign_key.pub.pem"    # the stage checks its own signature like a user would
        atomic_write_bytes(public_key, signing.public_key_pem(sign_key))
    return files, public_key


def _self_verify(cfg, b: Path, public_key: Path | None) -> Gate:
    from pipeline.bundle.verify import verify_bundle            # signature, hashes, then real runs on the samples
    report = verify_bundle(b, timeout=cfg.lite.timeout, key=public_key)
    gate = Gate("bundle", "bundle self-verification", "float32", "float32", "sample outputs", value=None,
                checks=[Check(**c) for c in report["checks"]])
    gate.status = OK if all(c.passed for c in gate.checks) else "FAIL"
    gate.reason = "; ".join(c.describe() for c in gate.checks if not c.passed)
    return gate


STAGE = Stage(name="bundle", inputs=("train", "export", "server", "lite"), config_keys=("bundle", "run"),
              machine_bound=True,     # its rows ran (gated, timed) on this CPU's kernels
              outputs=(),      # published to bundle.root; the run folder keeps the manifest and the archive
              optional_outputs=("*.tar.gz", "*/*"),    # <run>-<time>.tar.gz and the bundle folder <run>-<time>/
              make_target="deploy", run=run,
              description="self-describing bundle, verified and published")
