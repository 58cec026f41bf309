"""One OCR system row per engine and precision the parts' bundles hold: the fp32 chain, Paddle Inference
fp16/bf16/int8, ONNX Runtime and OpenVINO fp32, the rows /ocr serves (system.engine auto), the Lite x86 .nb set."""
from __future__ import annotations

from pathlib import Path

from pipeline.bundle import layout
from pipeline.core import env
from pipeline.core.gates import OK, Gate, apply_role, skipped
from pipeline.evaluation.system_rows import METRIC, Chain, fp32_chain, pair_row
from pipeline.evaluation.system_serving import served_rows


def engine_rows(ctx, subs: dict, spec, pages, keys, threads) -> tuple[list[Gate], Chain]:
    from pipeline.engines import paddle_infer as pi
    from pipeline.bundle.system import LITE_BATCH, lite_engine, lite_shape, model_prefix, paddle_engine

    from pipeline.ocr.system import set_opencv_threads

    sc = ctx.cfg.system
    set_opencv_threads(threads)      # OpenCV's pool with the engines' threads: every row's page steps alike
    fp32, chain = fp32_chain(ctx, subs, spec, pages, keys, threads)
    gates = [fp32]
    for prec in ("fp16", "bf16", "int8"):
        subject = f"paddle-inference {prec}"
        if prec == "bf16":
            ok, why = pi.bf16_status()
            lost = [r for r, b in subs.items() if not part_passed(b, subject)]
            have = ok and not lost
            if ok and lost:     # a part whose own bf16 row failed its gate (or never ran) would read garbage here
                why = f"{', '.join(lost)}: no passing {subject} row in the part's bundle (its server gates)"
        else:
            have = all(model_prefix(b, prec) for b in subs.values())
            why = f"the bundles hold no {prec} model set (server/{prec}/ in each)"
            if prec == "fp16" and not env.capabilities().get("gpu"):
                why = "fp16 runs only as an emulation on CPU (server stage row); no fp16 model is bundled"
        if not have:
            gates.append(skipped("system", subject, prec, METRIC, why))
            continue
        pick = (lambda b: b / layout.FP32_PREFIX) if prec == "bf16" else (lambda b, p=prec: model_prefix(b, p))
        g = pair_row(chain, subject, prec, lambda r, b, p=prec, f=pick: paddle_engine(f(b), p, threads), sc.gates[prec])
        gates.append(apply_role(g, system_role(subs, subject)))
    gates += _other_engine_rows(ctx, chain, threads)
    if sc.engine == "auto":
        gates += served_rows(ctx, chain, threads)
    subject = "lite x86 fp32"
    x86_nb = layout.mobile_nb("x86", "fp32")
    if all((b / x86_nb).is_file() for b in subs.values()):
        timeout = ctx.cfg.lite.timeout
        gates.append(pair_row(chain, subject, "fp32",
                              lambda r, b: lite_engine(b / x86_nb, lite_shape(b), timeout),
                              sc.gates["lite"], batch=LITE_BATCH))
    else:
        gates.append(skipped("system", subject, "fp32", METRIC, "the bundles hold no x86 fp32 .nb set"))
    return gates, chain


def _part_rows(sub: Path, subject: str) -> list[dict]:
    """A part's bundle's server rows of that subject (e.g. "paddle-inference bf16")."""
    from pipeline.core.artifacts import load_manifest

    gates = (load_manifest(sub) or {}).get("gates") or []      # a missing or unreadable manifest: None
    return [g for g in gates if g.get("subject") == subject and g.get("stage", "server") == "server"]


def part_passed(sub: Path, subject: str) -> bool:
    """Whether a part's bundle records that server row (e.g. "paddle-inference bf16") as passed."""
    return any(g.get("status") == OK for g in _part_rows(sub, subject))


def system_role(subs: dict, subject: str) -> str:
    """The role of the system row that runs every part on `subject`: a candidate when any part's own row of that
    subject is one (server.roles in its config: the config asked for it only as a serving candidate, issue 29), so
    it is gated and reported, and EXCLUDED instead of failing the run; else required."""
    roles = {(g.get("extra") or {}).get("role", "required") for b in subs.values() for g in _part_rows(b, subject)}
    return "candidate" if "candidate" in roles else "required"


def _other_engine_rows(ctx, chain: Chain, threads: int) -> list[Gate]:
    """The fp32 chain on every other configured runtime (server.engines: ONNX Runtime, OpenVINO) from the
    bundles' server/onnx/model.onnx files, gated on its drop vs the Paddle Inference fp32 chain."""
    from pipeline.engines import registry
    from pipeline.bundle.serving_choice import MODEL_PATHS

    gates = []
    for kind in (k for k in ctx.cfg.server.engines if k != "paddle-inference"):
        subject = f"{kind} fp32"
        ok, why = registry.available(kind)
        if not ok or not all((b / MODEL_PATHS[kind]).is_file() for b in chain.subs.values()):
            gates.append(skipped("system", subject, "fp32", METRIC,
                                 why if not ok else f"the bundles hold no {MODEL_PATHS[kind]} set"))
            continue
        gates.append(pair_row(chain, subject, "fp32",
                              lambda r, b, k=kind: registry.make(k, b / MODEL_PATHS[k], "fp32", threads=threads),
                              ctx.cfg.system.gates["engines"]))
    return gates

