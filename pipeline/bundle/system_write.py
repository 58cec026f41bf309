"""Writes the OCR system bundle (layout: pipeline/bundle/system.py): the parts' bundles unchanged, sample pages with
the fp32 chain's lines, infer_config (what /ocr serves and why), the model card and the manifest; then the bundle's
self-verification as a gate."""
from __future__ import annotations

import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from pipeline.bundle import layout
from pipeline.bundle.format import FORMAT_VERSION
from pipeline.bundle.system_choice import SERVED
from pipeline.core import env
from pipeline.core.artifacts import atomic_write_text, describe_files, write_json
from pipeline.core.gates import FAIL, OK, Check, Gate


def _infer_config(sc, subs: dict, keys: dict, ref: dict, served: dict | None = None) -> dict:
    from pipeline.tasks.ppocr_system import flow_of
    from pipeline.core.capabilities import describe

    cls = "classifier" in subs
    return {"format_version": FORMAT_VERSION, "task": "ocr_system", "detection": "detection",
            "recognition": "recognition", **({"classifier": "classifier"} if cls else {}),
            "pipeline": "page -> DB boxes -> perspective crops -> " + ("0/180 classifier -> " if cls else "")
                        + "CTC recognition",
            "flow": flow_of(sc.model_dump()), "engine": sc.engine,
            # what /ocr serves per part (auto: each part's recommendation; else that runtime on the fp32 models)
            # and why; measured_on: the CPU each part's rows were gated and timed on (serve re-checks its own)
            "served": served if sc.engine == "auto" else
                      {r: {"engine": sc.engine, "precision": "fp32", "by": "system.engine",
                           "why": f"system.engine={sc.engine}: every part's fp32 model on that runtime"} for r in subs},
            "built_on": {"cpu": env.hardware()["cpu"], **describe()},
            # each part's fp32 reference (the fp32 chain, samples' `lines`): Paddle Inference or, for an ONNX import,
            # ONNX Runtime at basic graph optimizations (pipeline/bundle/reference.py)
            "reference": _references(subs),
            "fields": keys, "verify": {"max_disagreement": 0.05},
            "metrics_on_build": {k: ref[k] for k in ("line_accuracy", "field_accuracy")}}


def _references(subs: dict) -> dict:
    from pipeline.bundle.format import load_infer_config

    out = {}
    for r, b in subs.items():
        kind, model = layout.reference_of(load_infer_config(b))
        out[r] = {"engine": kind, "precision": "fp32", "model": f"{r}/{model}"}
    return out


def _served_lines(served: dict) -> list[str]:
    """The model card's account of what /ocr runs per part, and why."""
    out = ["", "## Served", "", "| part | engine | precision | chosen by | why |", "|---|---|---|---|---|"]
    for role, p in served.items():
        why = p.get("why", "") + (f" ({p['cpu']})" if p.get("cpu") else "")
        out.append(f"| {role} | {p['engine']} | {p['precision']} | {p.get('by', '')} | {why} |")
    on = {r: p["measured_on"]["cpu"] for r, p in served.items() if (p.get("measured_on") or {}).get("cpu")}
    if on:
        out += ["", "Measured on: " + ", ".join(f"{r}: {c}" for r, c in on.items()) + ". `serve` on a CPU that runs "
                "other bf16/int8 kernels re-ranks among the rows that passed (docs/serving_choice.md)."]
    return out


def _model_card(name: str, gates: list[Gate], parts: dict, served: dict | None = None) -> str:
    lines = [f"# {name}", "", "OCR system: page → DB text boxes → perspective crops → CTC recognition → lines with "
             "boxes and scores. Sub-bundles: `detection/`, `recognition/` (each with its own model card).", "",
             "## System gates", "", "| checked | precision | line accuracy | field accuracy | verdict |",
             "|---|---|---|---|---|"]
    for g in gates:
        la, fa = g.extra.get("line_accuracy"), g.extra.get("field_accuracy")
        lines.append(f"| {g.subject} | {g.precision_effective} | {'' if la is None else f'{la:.4f}'} | "
                     f"{'' if fa is None else f'{fa:.4f}'} | {g.status}{(': ' + g.reason) if g.reason else ''} |")
    lines += _served_lines(served or {})
    lines += ["", "Parts: " + ", ".join(f"{r}: run `{p.run.name}`" for r, p in parts.items()), "",
              "Serve: `python -m pipeline serve <bundle>` → POST /ocr with a page image; "
              "verify: `python -m pipeline verify <bundle>`.", ""]
    return "\n".join(lines)


def write_bundle(ctx, b: Path, name: str, version: str, chain, gates: list, parts: dict) -> None:
    """The parts' bundles unchanged, sample pages with the fp32 chain's lines, infer_config, card, manifest."""
    from pipeline.bundle.system import write_samples

    sc = ctx.cfg.system
    for role, sub in chain.subs.items():
        shutil.copytree(sub, b / role)
    k = min(sc.samples, len(chain.pages["images"]))
    served = chain.row_lines.get(SERVED) if sc.engine == "auto" else None
    write_samples(b, list(chain.pages["images"][:k]), chain.lines[:k], served[:k] if served else None)
    icfg = _infer_config(sc, chain.subs, chain.keys, chain.ref, chain.served)
    atomic_write_text(b / layout.INFER_CONFIG, yaml.safe_dump(icfg, sort_keys=False, allow_unicode=True))
    atomic_write_text(b / layout.MODEL_CARD, _model_card(name, gates, parts, icfg["served"]))
    part_gates = [g for r in chain.subs for g in ctx.input_manifests[r].get("gates", [])]
    write_json(b / layout.MANIFEST, {
        "format_version": FORMAT_VERSION, "name": name, "version": version, "task": "ocr_system",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": describe_files(b, exclude=()),        # the sub-bundles' manifest.json files are hashed too
        "versions": env.versions(), "git_commit": env.git_commit(), "hardware": env.hardware(),
        "config": ctx.cfg.to_dict(), "gates": [g.to_dict() for g in gates], "part_bundle_gates": part_gates,
        "served": icfg["served"], "reference": icfg["reference"],
        "parts": {r: ctx.input_manifests[r]["info"]["name"] for r in chain.subs}})


def _joined(sets: dict, which: str) -> str:
    """The precisions the checked sets ran, fp32 first (e.g. "fp32+bf16" when the served set runs a bf16 part)."""
    seen = {p[which] for parts in sets.values() for p in parts.values()} or {"fp32"}
    return "+".join(sorted(seen, key=lambda x: (x != "fp32", x)))


def verify_gate(b: Path, timeout: float, threads: int) -> Gate:
    from pipeline.bundle.system import verify_system

    t0 = time.perf_counter()
    report = verify_system(b, timeout=timeout, threads=threads)
    bad = [Check(**c) for c in report["checks"] if not c["passed"]]
    # one summary check for the table; every individual check stays in extra
    sets = report.get("sets", {})
    vg = Gate("system", "bundle self-verification", _joined(sets, "requested"), _joined(sets, "effective"),
              "failed checks", value=float(len(bad)),
              checks=[Check("failed_checks", float(len(bad)), 0.0, "<=", not bad)],
              extra={"checks": report["checks"], "sets": sets})
    vg.status = OK if report["ok"] else FAIL
    vg.reason = "; ".join(f"{c.name}: {c.describe()}" for c in bad)
    vg.seconds = round(time.perf_counter() - t0, 2)
    return vg

