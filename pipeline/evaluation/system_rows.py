"""The OCR system's rows: the fp32 reference chain (each part on its bundle's reference) with its accuracy floors,
and every other set of engines read through the same flow (page -> boxes -> crops -> recognition) and gated on its
drop vs that chain; a row that crashes is that row's FAIL (run_row), the other rows still run."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.gates import FAIL, OK, Check, Gate, metric_check, run_row

METRIC = "line_accuracy"


def _score(lines, pages, keys) -> dict:
    from pipeline.data.invoice_pages import FIELDS, unpack_quads
    from pipeline.ocr.system_metrics import system_scores

    texts = [[t for t in row if t] for row in pages["texts"]]
    fields = [dict(zip(FIELDS, row)) for row in pages["fields"]]
    return system_scores(lines, unpack_quads(pages["quads"]), texts, fields, keys)


def system_row(subject, precision, effective, lines, pages, keys, ref=None, ref_lines=None, drop=0.0,
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
class Chain:
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
    edge: dict | None = None        # the fp32 chain's reading of the edge pages (pipeline/evaluation/edge_judge.py)
    exact_tags: dict = field(default_factory=dict)    # (role, engine) → tag of the fp32 engine a re-read set shares

    @property
    def flow(self) -> dict:
        """The system's flow settings (empty for a chain without a spec)."""
        return getattr(self.spec, "flow", None) or {}

    def ref_of(self, role: str) -> tuple[str, str]:
        from pipeline.bundle.system_choice import FP32_REF

        return self.refs.get(role, FP32_REF)

    def context_of(self, role: str) -> tuple[str, str]:
        """(engine, "fp32") of a part a timing loop does not compare, only reads through (its crops feed the part
        that is compared): OpenVINO fp32 on the part's ONNX model where OpenVINO runs and the model is bundled, else
        the part's reference. One dynamic-shape OpenVINO model held ~1.1 GB over the loop's 24 page shapes where the
        Paddle Inference references held ~3.8 GB (v4 det + rec, 2026-12-07, before InferenceEngine gave back each
        shape's buffers; ~2.0 GB after): the stage's peak RSS."""
        from pipeline.bundle import layout
        from pipeline.engines import registry

        sub = self.subs[role]
        if registry.available("openvino")[0] and layout.model_exists(sub / layout.serving_model("openvino", "fp32",
                                                                                                  sub)):
            return "openvino", "fp32"
        return self.ref_of(role)


def pair_row(chain: Chain, subject: str, prec: str, make, drop: float, batch: int = 16) -> Gate:
    """One set of engines (det, rec[, cls]; make(role, sub-bundle) builds each) through the flow, gated on its
    drop vs the fp32 chain; an engine that fails to load or run is that row's FAIL (run_row: any exception, its
    traceback kept), and the other rows still run."""
    from pipeline.ocr.system import read_pages
    from pipeline.bundle.system import engine_set

    def read() -> Gate:
        det, rec, cls = engine_set(make, chain.subs)
        lines = read_pages(list(chain.pages["images"]), det, rec, chain.spec, batch=batch, cls=cls)
        chain.row_lines[subject] = lines
        return system_row(subject, prec, effective_label(det, rec, cls), lines, chain.pages, chain.keys, chain.ref,
                          chain.lines, drop)

    t0 = time.perf_counter()
    g = run_row("system", subject, prec, METRIC, read, chain.evidence)
    g.seconds = round(time.perf_counter() - t0, 2)
    return g


def fp32_chain(ctx, subs: dict, spec, pages, keys, threads) -> tuple[Gate, Chain]:
    """Each part on its bundle's fp32 reference; named "paddle-inference fp32" when all are Paddle Inference (as
    before ONNX imports were bundled), else by each part's engine."""
    from pipeline.ocr.system import read_pages
    from pipeline.bundle.system import engine_set, reference_engine, reference_label, references

    sc = ctx.cfg.system
    images = list(pages["images"])
    t0 = time.perf_counter()
    det, rec, cls = engine_set(lambda r, b: reference_engine(b, threads), subs)
    t_read = time.perf_counter()
    ref_lines = read_pages(images, det, rec, spec, cls=cls)
    reading = time.perf_counter() - t_read
    fp32 = system_row(reference_label(subs, all_paddle="paddle-inference fp32"), "fp32", effective_label(det, rec, cls),
                      ref_lines, pages, keys, floors=(sc.min_line_accuracy, sc.min_field_accuracy))
    fp32.seconds = round(time.perf_counter() - t0, 2)       # what the row cost: loading included
    # reading only: the engines' loading (t_read - t0) is not a page's cost
    fp32.extra.update(pages_per_s=round(len(images) / max(reading, 1e-9), 2), load_s=round(t_read - t0, 2),
                      pages_per_s_how="the pages read once by freshly loaded engines; loading excluded")
    refs = references(subs)
    fp32.extra["reference"] = {r: k for r, (k, _) in refs.items()}
    return fp32, Chain(pages, keys, spec, fp32.extra, ref_lines, subs, evidence=ctx.out_dir / "evidence", refs=refs)


def precision_label(values) -> str:
    """One label for a set of parts' precisions (role order: detection, recognition[, classifier]): the precision
    when all agree, else each part's, e.g. "int8/fp32/fp32"."""
    values = list(values)
    return values[0] if len(set(values)) == 1 else "/".join(values)


def effective_label(det, rec, cls=None) -> str:
    """What the engines really ran (each engine's own evidence), e.g. "int8" or "int8/fp32"."""
    return precision_label(e.effective_precision for e in (det, rec, cls) if e is not None)


def chain_engine(chain: Chain, role: str, kind: str, prec: str, threads: int, tag: str = ""):
    """One part's engine as /ocr loads it (load_engine: the bundle's tuned settings), loaded once per (role, engine,
    precision[, tag: a separate instance, so a Paddle engine's shape cache is not shared between timed sets])."""
    from pipeline.bundle.format import load_infer_config
    from pipeline.bundle.serving_choice import load_engine
    from pipeline.ocr.system import det_static_shapes

    key = (role, kind, prec, tag)
    if key not in chain.engines:
        sub = chain.subs[role]
        eng = load_engine(sub, load_infer_config(sub), kind, threads, prec, label=role,
                          static_shapes=det_static_shapes(chain.flow) if role == "detection" else 0)
        if role == "recognition":       # the flow's fp32 re-read of lines in doubt (shared with the fp32 row)
            from pipeline.ocr.recheck import rechecked

            exact_tag = chain.exact_tags.get((role, kind), tag)
            eng = rechecked(eng, chain.flow, lambda: chain_engine(chain, role, kind, "fp32", threads, exact_tag),
                            own_exact=False)
        chain.engines[key] = eng
    return chain.engines[key]


def close_engines(chain: Chain, tag: str = "", role: str | None = None, kind: str | None = None) -> None:
    """Close and forget the chain's engines whose tag starts with `tag` ("" : every one; with role and kind: only
    that part's engines of that runtime, never the fp32 chain's), and give their freed heap back to the kernel (the
    stage's peak RSS: each loop's engines would otherwise stay in glibc's arenas; chain_engine loads an engine again
    when it is asked for)."""
    from pipeline.core import resources

    def chosen(k) -> bool:
        if role is None:
            return True
        return k[0] == role and k[1] == kind and (k[1], k[2]) != chain.ref_of(role)

    for key in [k for k in chain.engines if str(k[3]).startswith(tag) and chosen(k)]:
        getattr(chain.engines.pop(key), "close", lambda: None)()
    resources.release_memory()


def lines_kept(g: Gate) -> Gate:
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


def combo_row(ctx, chain: Chain, subject: str, combo: dict, threads: int) -> Gate:
    """One set (role → (engine, precision)) through the flow, gated on its drop vs the fp32 chain with the tolerance
    of its lowest precision (system.gates.<int8|fp16|bf16>, else engines) and on the lines it keeps."""
    precs = [combo[r][1] for r in chain.subs]
    key = next((p for p in ("int8", "fp16", "bf16") if p in precs), "engines")
    g = pair_row(chain, subject, precision_label(precs), lambda r, b: chain_engine(chain, r, *combo[r], threads),
                  ctx.cfg.system.gates[key])
    g.extra["tolerance_key"] = f"system.gates.{key}"
    return lines_kept(g)

