"""system: one OCR bundle from a gated detection run and a gated recognition run.

Inputs are the two parts' published bundles (artifacts of other runs, see pipeline/core/composite.py);
nothing here imports another stage. On synthetic invoice pages from a seed neither model saw,
the flow page → boxes → crops → recognition runs per engine row, and each row is gated:
  the fp32 reference chain (each part's bundle reference: Paddle Inference fp32, or ONNX Runtime fp32 at basic
  graph optimizations for a part imported from .onnx; pipeline/bundle/reference.py): line and field accuracy floors;
  int8 / bf16 / fp16 pairs from the bundles, the ONNX Runtime and OpenVINO fp32 pairs, the Lite x86 .nb
  pair, HTTP /ocr: drop vs the fp32 chain.
Then the bundle is assembled, verifies itself (hashes, both model bundles, the system on its
sample pages) and is published next to the parts' bundles.
"""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from pipeline.core import env
from pipeline.core.artifacts import atomic_write_text, describe_files, write_json
from pipeline.bundle import layout
from pipeline.bundle.format import FORMAT_VERSION, write_archive
from pipeline.core.composite import part_configs
from pipeline.core.config import ROOT
from pipeline.core.errors import ConfigError
from pipeline.core.gates import FAIL, OK, Check, Gate, apply_role, metric_check, run_row, skipped
from pipeline.core.runner import Stage, StageContext, StageResult

log = logging.getLogger("pipeline")
METRIC = "line_accuracy"


def _bundle_folder(ctx: StageContext, role: str) -> Path:
    name = ctx.input_manifests[role]["info"]["name"]
    return ctx.inputs[role] / name


def _page_charset(parts: dict, rec_cfg: dict) -> str:
    """What the unseen pages are written in: the recogniser's charset; for a dictionary far larger than the
    built-in invoice charset and no font of the part's own (PP-OCR's 6623 characters), the built-in invoice
    characters it holds (Pillow's default font draws no CJK)."""
    from pipeline.data.textlines import DEFAULT_CHARSET

    charset = rec_cfg["postprocess"]["charset"]
    if parts["detection"].data.fonts or len(charset) <= 4 * len(DEFAULT_CHARSET):
        return charset
    return "".join(c for c in DEFAULT_CHARSET if c in charset)


def _eval_pages(ctx, det_cfg: dict, charset: str, parts: dict) -> dict:
    from pipeline.data.invoice_pages import load_or_render

    d = parts["detection"].data
    pre = det_cfg["preprocess"]
    # a seed neither part trained or validated on (they use seed and seed + 1)
    return load_or_render(ctx.cfg.system.pages, ctx.cfg.seed + 7919, pre["height"], pre["width"],
                          max_boxes=64, fonts=list(d.fonts), charset=charset,
                          max_len=parts["recognition"].data.max_len, cache_dir=d.cache_dir)


def _score(lines, pages, keys) -> dict:
    from pipeline.data.invoice_pages import FIELDS, unpack_quads
    from pipeline.ocr.system_metrics import system_scores

    texts = [[t for t in row if t] for row in pages["texts"]]
    fields = [dict(zip(FIELDS, row)) for row in pages["fields"]]
    return system_scores(lines, unpack_quads(pages["quads"]), texts, fields, keys)


def _row(subject, precision, effective, lines, pages, keys, ref=None, ref_lines=None, drop=0.0,
         floors=(0.0, 0.0)) -> Gate:
    from pipeline.ocr.system_metrics import agreement

    s = _score(lines, pages, keys)
    g = Gate("system", subject, precision, effective, METRIC, value=s[METRIC])
    g.extra = {**s}
    if ref is None:      # the fp32 chain: absolute floors
        g.checks = [Check(METRIC, s[METRIC], floors[0], ">=", s[METRIC] >= floors[0]),
                    Check("field_accuracy", s["field_accuracy"], floors[1], ">=", s["field_accuracy"] >= floors[1])]
    else:
        g.reference = ref[METRIC]
        # as every gate: a non-zero budget below one line (one field) of these pages is one line (one field);
        # 8 pages hold ~24 fields, so a 0.01-0.03 field budget meant "no field may change"
        g.checks = [metric_check(METRIC, s[METRIC], ref[METRIC], drop, samples=int(s["lines"]) or None),
                    metric_check("field_accuracy", s["field_accuracy"], ref["field_accuracy"], drop,
                                 samples=int(s["fields"]) or None)]
        g.extra["agreement_with_fp32"] = round(agreement(lines, ref_lines), 4)
    g.status = OK if all(c.passed for c in g.checks) else FAIL
    g.reason = "; ".join(c.describe() for c in g.checks if not c.passed)
    return g


@dataclass
class _Chain:
    """The fp32 reference chain every other row is gated against (each part on its bundle's reference), and what it
    read."""
    pages: dict
    keys: dict
    spec: object
    ref: dict
    lines: list
    subs: dict          # role → model bundle folder (detection, recognition[, classifier])
    row_lines: dict = field(default_factory=dict)     # subject → lines that row read
    evidence: Path | None = None    # where a crashed row's traceback goes (run_row)
    served: dict | None = None      # role → what /ocr serves and why (system.engine auto: chosen on these pages)
    engines: dict = field(default_factory=dict)       # (role, engine, precision, tag) → loaded engine, shared
    refs: dict = field(default_factory=dict)          # role → (engine, "fp32") of the part's reference row

    def ref_of(self, role: str) -> tuple[str, str]:
        from pipeline.bundle.system_choice import FP32_REF

        return self.refs.get(role, FP32_REF)


def _pair_row(chain: _Chain, subject: str, prec: str, make, drop: float, batch: int = 16) -> Gate:
    """One set of engines (det, rec[, cls]; make(role, sub-bundle) builds each) through the flow, gated on its
    drop vs the fp32 chain; an engine that fails to load or run is that row's FAIL (run_row: any exception, its
    traceback kept), and the other rows still run."""
    from pipeline.ocr.system import read_pages
    from pipeline.bundle.system import engine_set

    def read() -> Gate:
        det, rec, cls = engine_set(make, chain.subs)
        lines = read_pages(list(chain.pages["images"]), det, rec, chain.spec, batch=batch, cls=cls)
        chain.row_lines[subject] = lines
        return _row(subject, prec, _effective(det, rec), lines, chain.pages, chain.keys, chain.ref, chain.lines, drop)

    t0 = time.perf_counter()
    g = run_row("system", subject, prec, METRIC, read, chain.evidence)
    g.seconds = round(time.perf_counter() - t0, 2)
    return g


def _fp32_chain(ctx, subs: dict, spec, pages, keys, threads) -> tuple[Gate, _Chain]:
    """Each part on its bundle's fp32 reference; named "paddle-inference fp32" when all are Paddle Inference (as
    before ONNX imports were bundled), else by each part's engine."""
    from pipeline.ocr.system import read_pages
    from pipeline.bundle.system import engine_set, reference_engine, reference_label, references

    sc = ctx.cfg.system
    images = list(pages["images"])
    t0 = time.perf_counter()
    det, rec, cls = engine_set(lambda r, b: reference_engine(b, threads), subs)
    ref_lines = read_pages(images, det, rec, spec, cls=cls)
    fp32 = _row(reference_label(subs, all_paddle="paddle-inference fp32"), "fp32", "fp32", ref_lines, pages, keys,
                floors=(sc.min_line_accuracy, sc.min_field_accuracy))
    fp32.seconds = round(time.perf_counter() - t0, 2)
    fp32.extra["pages_per_s"] = round(len(images) / max(fp32.seconds, 1e-9), 2)
    refs = references(subs)
    fp32.extra["reference"] = {r: k for r, (k, _) in refs.items()}
    return fp32, _Chain(pages, keys, spec, fp32.extra, ref_lines, subs, evidence=ctx.out_dir / "evidence", refs=refs)


def _engine_rows(ctx, subs: dict, spec, pages, keys, threads) -> tuple[list[Gate], _Chain]:
    from pipeline.engines import paddle_infer as pi
    from pipeline.bundle.system import LITE_BATCH, lite_engine, lite_shape, model_prefix, paddle_engine

    sc = ctx.cfg.system
    fp32, chain = _fp32_chain(ctx, subs, spec, pages, keys, threads)
    gates = [fp32]
    for prec in ("fp16", "bf16", "int8"):
        subject = f"paddle-inference {prec}"
        if prec == "bf16":
            ok, why = pi.bf16_status()
            lost = [r for r, b in subs.items() if not _part_passed(b, subject)]
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
        g = _pair_row(chain, subject, prec, lambda r, b, p=prec, f=pick: paddle_engine(f(b), p, threads), sc.gates[prec])
        gates.append(apply_role(g, _system_role(subs, subject)))
    gates += _other_engine_rows(ctx, chain, threads)
    if sc.engine == "auto":
        gates += _served_rows(ctx, chain, threads)
    subject = "lite x86 fp32"
    x86_nb = layout.mobile_nb("x86", "fp32")
    if all((b / x86_nb).is_file() for b in subs.values()):
        timeout = ctx.cfg.lite.timeout
        gates.append(_pair_row(chain, subject, "fp32",
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


def _part_passed(sub: Path, subject: str) -> bool:
    """Whether a part's bundle records that server row (e.g. "paddle-inference bf16") as passed."""
    return any(g.get("status") == OK for g in _part_rows(sub, subject))


def _system_role(subs: dict, subject: str) -> str:
    """The role of the system row that runs every part on `subject`: a candidate when any part's own row of that
    subject is one (server.roles in its config: the config asked for it only as a serving candidate, issue 29), so
    it is gated and reported, and EXCLUDED instead of failing the run; else required."""
    roles = {(g.get("extra") or {}).get("role", "required") for b in subs.values() for g in _part_rows(b, subject)}
    return "candidate" if "candidate" in roles else "required"


def _other_engine_rows(ctx, chain: _Chain, threads: int) -> list[Gate]:
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
        gates.append(_pair_row(chain, subject, "fp32",
                               lambda r, b, k=kind: registry.make(k, b / MODEL_PATHS[k], "fp32", threads=threads),
                               ctx.cfg.system.gates["engines"]))
    return gates


SERVED = "as served (system.engine=auto)"


def _engine(chain: _Chain, role: str, kind: str, prec: str, threads: int, tag: str = ""):
    """One part's engine as /ocr loads it (load_engine: the bundle's tuned settings), loaded once per (role, engine,
    precision[, tag: a separate instance, so a Paddle engine's shape cache is not shared between timed sets])."""
    from pipeline.bundle.format import load_infer_config
    from pipeline.bundle.serving_choice import load_engine

    key = (role, kind, prec, tag)
    if key not in chain.engines:
        sub = chain.subs[role]
        chain.engines[key] = load_engine(sub, load_infer_config(sub), kind, threads, prec, label=role)
    return chain.engines[key]


def _lines_kept(g: Gate) -> Gate:
    """The system gates plus what users read: lines identical to the fp32 chain's >= MIN_LINES_KEPT."""
    from pipeline.core.gates import agreement_check
    from pipeline.bundle.system_choice import MIN_LINES_KEPT

    kept = g.extra.get("agreement_with_fp32")
    if kept is None:        # the row crashed: its verdict stands
        return g
    c = agreement_check("lines_same_as_fp32_chain", kept, MIN_LINES_KEPT,
                        detail="lines at matching boxes with identical text (docs/serving_choice.md)")
    g.checks.append(c)
    if not c.passed:
        g.status = FAIL
        g.reason = "; ".join(x.describe() for x in g.checks if not x.passed)
    return g


def _combo_row(ctx, chain: _Chain, subject: str, combo: dict, threads: int) -> Gate:
    """One set (role → (engine, precision)) through the flow, gated on its drop vs the fp32 chain with the tolerance
    of its lowest precision (system.gates.<int8|fp16|bf16>, else engines) and on the lines it keeps."""
    precs = [combo[r][1] for r in chain.subs]
    key = next((p for p in ("int8", "fp16", "bf16") if p in precs), "engines")
    g = _pair_row(chain, subject, "/".join(precs), lambda r, b: _engine(chain, r, *combo[r], threads),
                  ctx.cfg.system.gates[key])
    g.extra["tolerance_key"] = f"system.gates.{key}"
    return _lines_kept(g)


def _judge_part(ctx, chain: _Chain, role: str, pairs: list, threads: int) -> tuple[list[Gate], list[dict]]:
    """Each candidate row of one part, the other parts on the fp32 chain's rows: its system gate (EXCLUDED, not
    FAIL, when it misses: a candidate that does not serve)."""
    gates, rows = [], []
    for kind, prec in pairs:
        if (kind, prec) == chain.ref_of(role):
            rows.append({"engine": kind, "precision": prec, "passed": True, "lines_kept": 1.0,
                         "detail": "the fp32 chain"})
            continue
        combo = {r: (kind, prec) if r == role else chain.ref_of(r) for r in chain.subs}
        g = apply_role(_combo_row(ctx, chain, f"choice {role}: {kind} {prec}", combo, threads), "candidate")
        gates.append(g)
        rows.append({"engine": kind, "precision": prec, "passed": g.status == OK,
                     "lines_kept": g.extra.get("agreement_with_fp32"), "detail": g.reason})
    return gates, rows


def _time_sets(chain: _Chain, combos: dict, threads: int, start: int = 0) -> dict:
    """label → combo timed interleaved on the system's pages stretched to varied shapes (time_sets); the fp32 chain
    ("fp32 chain") on engines of its own."""
    from pipeline.ocr.system import read_pages
    from pipeline.bundle.system_choice import time_sets, varied_pages

    sets = {"fp32 chain": {r: _engine(chain, r, *chain.ref_of(r), threads, tag="ref") for r in chain.subs}}
    sets.update({k: {r: _engine(chain, r, *c[r], threads) for r in chain.subs} for k, c in combos.items()})
    pages = list(chain.pages["images"])

    def read(page, e):
        read_pages([page], e["detection"], e["recognition"], chain.spec, cls=e.get("classifier"))

    return time_sets(sets, varied_pages(pages, start=start), read, warmup=pages[0])


def _choose(ctx, chain: _Chain, served: dict, threads: int) -> tuple[list[Gate], dict]:
    """Parts not pinned: every candidate judged, the passing ones timed, the fastest per part chosen."""
    from pipeline.bundle.format import load_infer_config
    from pipeline.bundle.system_choice import choose_part, not_admitted, part_candidates

    free = [r for r, p in served.items() if not str(p.get("by", "")).startswith("pinned")]
    gates, rows = [], {}
    for r in free:
        sub = chain.subs[r]
        cfg = load_infer_config(sub)
        g, rows[r] = _judge_part(ctx, chain, r, part_candidates(sub, cfg), threads)
        kept_out = not_admitted(cfg)
        for x in kept_out:
            log.info("[system] %s %s %s: %s", r, x["engine"], x["precision"], x["detail"])
        rows[r] += kept_out
        gates += g
    combos = {f"{r}: {x['engine']} {x['precision']}": {q: (x["engine"], x["precision"]) if q == r else chain.ref_of(q)
                                                       for q in chain.subs}
              for r in free for x in rows[r] if x["passed"] and (x["engine"], x["precision"]) != chain.ref_of(r)}
    res = _time_sets(chain, combos, threads)
    for r in free:
        for x in rows[r]:
            t = res.get("fp32 chain" if (x["engine"], x["precision"]) == chain.ref_of(r)
                        else f"{r}: {x['engine']} {x['precision']}")
            if t:
                x.update(part_s=t["parts"][r], chain_s=t["seconds"])
        log.info("[system] %s on the system's pages: %s", r, ", ".join(
            f"{x['engine']} {x['precision']} {x.get('part_s', '-')} s" for x in rows[r]))
    return gates, {r: choose_part(r, rows[r], chain.ref_of(r)) for r in free}


def _served_entry(sub: Path, role: str, chosen: dict, rows: list, rec: dict) -> dict:
    from pipeline.bundle.layout import serving_model
    from pipeline.bundle.system import measured_on
    from pipeline.bundle.system_choice import TIMING_PAGES, ROUNDS, why_chosen

    keep = ("engine", "precision", "verdict", "speedup_vs_fp32", "lines_kept", "part_s", "detail")
    return {"engine": chosen["engine"], "precision": chosen["precision"], "by": "system pages",
            "why": why_chosen(role, chosen, TIMING_PAGES * ROUNDS, f"{rec['engine']} {rec['precision']}"),
            **{k: chosen[k] for k in ("speedup_vs_fp32", "speedup_vs_fastest_fp32", "chain_speedup_vs_fp32",
                                      "lines_kept")},
            "recommended": {k: rec[k] for k in ("engine", "precision", "why") if k in rec},
            "candidates": [{k: x[k] for k in keep if x.get(k) not in (None, "")} for x in rows],
            "model": serving_model(chosen["engine"], chosen["precision"], sub), "measured_on": measured_on(sub)}


def _served_rows(ctx, chain: _Chain, threads: int) -> list[Gate]:
    """What /ocr serves: pinned parts as pinned, the others chosen on the system's pages; the set is gated together
    (falling back part by part to fp32 when it fails together) and timed against the fp32 chain."""
    from pipeline.bundle.system_choice import fallbacks

    served = _parts_served(ctx.cfg.system, chain.subs)
    gates, picks = _choose(ctx, chain, served, threads)
    for r, (chosen, rows) in picks.items():
        served[r] = _served_entry(chain.subs[r], r, chosen, rows, served[r])
    tries = fallbacks({r: c for r, (c, _) in picks.items()})
    for i, combo in enumerate(tries):
        full = {r: combo.get(r) or (p["engine"], p["precision"]) for r, p in served.items()}
        g = _combo_row(ctx, chain, SERVED, full, threads)
        g.extra["served"] = True        # a timed choice: the nightly reports a change of its precision
        if g.status == OK or i == len(tries) - 1:
            break
        log.warning("[system] the chosen set %s failed together (%s): the next one puts a part back on fp32",
                    full, g.reason)
    for r, (kind, prec) in full.items():
        if (served[r]["engine"], served[r]["precision"]) != (kind, prec):
            served[r].update(engine=kind, precision=prec, by="system pages (fallback)",
                             why=f"fp32 fallback: the chosen set failed its gate together ({g.reason})")
    for r, p in served.items():
        log.info("[system] %s serves %s %s (%s): %s", r, p["engine"], p["precision"], p["by"], p["why"])
    t = _time_sets(chain, {"as served": full}, threads, start=64)
    g.extra.update(served=served, timing={**t, "how": "interleaved, pages of varied shape"},
                   chain_speedup_vs_fp32=round(t["fp32 chain"]["seconds"] / t["as served"]["seconds"], 3))
    chain.served = served
    for eng in chain.engines.values():       # the HTTP row and verify load their own
        getattr(eng, "close", lambda: None)()
    chain.engines.clear()
    return gates + [g]


def _parts_served(sc, subs: dict) -> dict:
    """role -> what the part serves and why (its recommendation as this CPU runs it, or system.pin.<role>)."""
    from pipeline.bundle.system import part_serving

    if sc.pin and sc.engine != "auto":
        raise ConfigError(f"system.pin {dict(sc.pin)} needs system.engine: auto (it is {sc.engine!r})",
                          hint="set system.engine=auto, or drop system.pin")
    unknown = sorted(set(sc.pin) - set(subs))
    if unknown:
        raise ConfigError(f"system.pin names {unknown[0]!r}, which this system has no part for",
                          hint=f"one of {', '.join(subs)}")
    return {r: part_serving(b, sc.pin.get(r), r) for r, b in subs.items()}


def _effective(det, rec) -> str:
    """What the two engines really ran (each engine's own evidence), e.g. "int8" or "int8/fp32"."""
    a, b = det.effective_precision, rec.effective_precision
    return a if a == b else f"{a}/{b}"


def _http_row(ctx, folder: Path, chain: _Chain, threads) -> Gate:
    """/ocr over HTTP must read as the same engines did in process (the fp32 chain, or the system.engine row)."""
    from pipeline.serving.app import http_ocr_gate
    from pipeline.ocr.system_metrics import agreement

    pages, auto = chain.pages, ctx.cfg.system.engine == "auto"
    ref_lines = chain.row_lines.get(SERVED if auto else f"{ctx.cfg.system.engine} fp32", chain.lines)
    n = min(ctx.cfg.system.http_pages, len(pages["images"]))
    subject = "http /ocr as served" if auto else "http /ocr fp32"
    engine = "served" if auto else ctx.cfg.system.engine
    limit = ctx.cfg.system.gates["http"]

    def serve() -> Gate:
        res = http_ocr_gate(folder, list(pages["images"][:n]), threads=threads)
        diff = 1.0 - agreement(res["lines"], ref_lines[:n])
        g = Gate("system", subject, "fp32", "fp32", "lines_differing", value=diff,
                 checks=[Check(f"lines_differing_from_{engine}_chain", diff, limit, "<=",
                               diff <= limit + 1e-12, "system.gates.http")])
        g.status = OK if g.checks[0].passed else FAIL
        g.reason = "" if g.status == OK else g.checks[0].describe()
        g.extra = {"latency_ms": res["latency_ms"], "requests": n}
        return g

    t0 = time.perf_counter()
    g = run_row("system", subject, "fp32", METRIC, serve, chain.evidence)
    g.seconds = round(time.perf_counter() - t0, 2)
    return g


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


def _write_bundle(ctx, b: Path, name: str, version: str, chain: _Chain, gates: list, parts: dict) -> None:
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


def _verify_gate(b: Path, timeout: float, threads: int) -> Gate:
    from pipeline.bundle.system import verify_system

    t0 = time.perf_counter()
    report = verify_system(b, timeout=timeout, threads=threads)
    bad = [Check(**c) for c in report["checks"] if not c["passed"]]
    # one summary check for the table; every individual check stays in extra
    vg = Gate("system", "bundle self-verification", "fp32", "fp32", "failed checks", value=float(len(bad)),
              checks=[Check("failed_checks", float(len(bad)), 0.0, "<=", not bad)],
              extra={"checks": report["checks"]})
    vg.status = OK if report["ok"] else FAIL
    vg.reason = "; ".join(f"{c.name}: {c.describe()}" for c in bad)
    vg.seconds = round(time.perf_counter() - t0, 2)
    return vg


def _read_rows(ctx, parts: dict) -> tuple[list[Gate], _Chain]:
    from pipeline.bundle.format import load_infer_config
    from pipeline.data.invoice_pages import keys_for
    from pipeline.ocr.system import SystemSpec
    from pipeline.tasks.ppocr_system import flow_of

    subs = {role: _bundle_folder(ctx, role) for role in parts}
    det_cfg, rec_cfg = load_infer_config(subs["detection"]), load_infer_config(subs["recognition"])
    cls_cfg = load_infer_config(subs["classifier"]) if "classifier" in subs else None
    spec = SystemSpec.from_infer_configs(det_cfg, rec_cfg, cls_cfg, flow_of(ctx.cfg.system.model_dump()))
    charset = _page_charset(parts, rec_cfg)
    pages = _eval_pages(ctx, det_cfg, charset, parts)
    threads = ctx.cfg.server.threads or env.cpu_count()
    log.info("[system] reading %d pages per engine row", len(pages["images"]))
    return _engine_rows(ctx, subs, spec, pages, keys_for(charset), threads)


def run(ctx: StageContext) -> StageResult:
    cfg, sc = ctx.cfg, ctx.cfg.system
    parts = part_configs(cfg)
    gates, chain = _read_rows(ctx, parts)
    version = cfg.bundle.version or datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = f"{cfg.run.name}-{version}"
    root = Path(cfg.bundle.root) if Path(cfg.bundle.root).is_absolute() else ROOT / cfg.bundle.root
    if (root / name).exists():
        raise ConfigError(f"bundle {root / name} already exists; bundles are never overwritten",
                          hint="set bundle.version to a new value (or leave it null for a timestamp)")
    b = ctx.out_dir / name
    _write_bundle(ctx, b, name, version, chain, gates, parts)
    threads = cfg.server.threads or env.cpu_count()
    if sc.http_pages:
        gates.append(_http_row(ctx, b, chain, threads))
    gates.append(run_row("system", "bundle self-verification", "fp32", "failed checks",
                         lambda: _verify_gate(b, cfg.lite.timeout, threads), ctx.out_dir / "evidence"))
    if cfg.bundle.archive:
        write_archive(b, ctx.out_dir / f"{name}.tar.gz")
    if all(g.status != FAIL for g in gates):
        from pipeline.bundle.format import publish
        publish(ctx.out_dir, name, root, cfg.bundle.archive)
    summary = {k2: chain.ref[k2] for k2 in ("line_accuracy", "field_accuracy", "lines", "fields")}
    return StageResult(gates=gates, precision={g.subject: g.precision_effective for g in gates},
                       metrics=summary, info={"bundle": str(root / name), "name": name,
                                              "archive": str(root / name) + ".tar.gz" if cfg.bundle.archive else None})


def _external(cfg) -> dict[str, Path]:
    return {role: part.run_dir / "bundle" for role, part in part_configs(cfg).items()}


STAGE = Stage(name="system", inputs=(), config_keys=("system", "seed", "bundle", "lite", "server"), make_target="deploy",
              machine_bound=True,     # its rows ran (gated, timed) on this CPU's kernels
              applies_to=lambda task: task == "ocr_system",
              run=run, external_inputs=_external,
              optional_outputs=("*.tar.gz", "*/*"),    # the system bundle's archive and folder, as bundle's
              description="OCR system bundle from gated detection, recognition [and direction classifier] runs, "
                          "end-to-end gates")
