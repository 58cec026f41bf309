"""The system choice's text judge on edge pages (issue 48): a low-precision part about to be served first reads
`system.edge_pages` tuning pages with text tight against its boxes (pipeline/data/edge_pages.py, SYSTEM_SEED: never
the pages a detector keep list was chosen on, never the real images) and must keep `system.edge_lines_kept` of the
lines the fp32 chain reads there.

Why: the synthetic invoice pages the system gates read are blind to what bf16 does to real text. The v5
recogniser's OpenVINO bf16 row kept 139 of their 140 lines and was served; on 16 edge pages it rewrote 178 of 1504
crops (11.8 %), and on the real images 2 of 29 lines. A row that fails here is EXCLUDED (never served; the part's
next row is chosen), not a failure of the run.
"""
from __future__ import annotations

import time

from pipeline.core.gates import EXCLUDED, FAIL, OK, Check, Gate, apply_role, run_row

METRIC = "edge_lines_kept"


def _pages(n: int) -> list:
    from pipeline.data.edge_pages import SYSTEM_SEED, installed_fonts, render_edge_pages

    return render_edge_pages(n, SYSTEM_SEED, fonts=installed_fonts())


def _read(chain, combo: dict, threads: int, pages: list) -> tuple[list, str]:
    from pipeline.bundle.system import engine_set
    from pipeline.evaluation.system_rows import chain_engine, effective_label
    from pipeline.ocr.system import read_pages

    det, rec, cls = engine_set(lambda r, b: chain_engine(chain, r, *combo[r], threads), chain.subs)
    return read_pages(pages, det, rec, chain.spec, cls=cls), effective_label(det, rec, cls)


def reference(chain, threads: int, n: int) -> dict:
    """The fp32 chain's reading of n edge pages, read once per stage (kept on the chain); its engines are closed
    after it, so the set judged next is loaded alone."""
    from pipeline.evaluation.system_rows import close_engines

    if chain.edge is None:
        from pipeline.data.edge_pages import SYSTEM_SEED, installed_fonts

        t0 = time.perf_counter()
        pages = _pages(n)
        lines, _ = _read(chain, {r: chain.ref_of(r) for r in chain.subs}, threads, pages)
        close_engines(chain)        # one engine set at a time (both sets at once: the v4 system stage at 4.35 GB)
        chain.edge = {"pages": pages, "lines": lines, "seed": SYSTEM_SEED, "fonts": installed_fonts(),
                      "seconds": round(time.perf_counter() - t0, 1)}
    return chain.edge


def changed_lines(ref: list[list[dict]], got: list[list[dict]]) -> dict:
    """Totals of line_judge.line_changes over pages: text changed at a matched box, missing, extra, of."""
    from pipeline.ocr.line_judge import line_changes

    total = {"text": 0, "missing": 0, "extra": 0, "changed": 0, "of": 0}
    for r, g in zip(ref, got):
        for k, v in line_changes(r, g).items():
            total[k] += v
    return total


def _judged(chain, combo: dict, threads: int, pages: int) -> tuple[dict, dict, float, str]:
    """(the fp32 chain's reading, changed_lines of combo's reading against it, share kept, what combo ran)."""
    ref = reference(chain, threads, pages)
    got, effective = _read(chain, combo, threads, ref["pages"])
    n = changed_lines(ref["lines"], got)
    return ref, n, (1.0 - n["changed"] / n["of"] if n["of"] else 1.0), effective


def served_set_reading(ctx, chain, combo: dict, threads: int) -> dict:
    """The served set's own reading of the edge pages, for the record (the `as served` row's extra, never a check):
    a pinned part is never judged, so this is where what it does to tight boxes shows."""
    ref, n, kept, effective = _judged(chain, combo, threads, int(ctx.cfg.system.edge_pages))
    return {"lines_kept": round(kept, 4), **n, "pages": len(ref["pages"]), "seed": ref["seed"], "ran": effective,
            "how": "the served set against the fp32 chain on the edge pages; recorded, not gated (pinned parts are "
                   "not judged)"}


def edge_row(ctx, chain, role: str, pair: tuple[str, str], threads: int) -> Gate:
    """`edge pages <role>: <engine> <precision>`: that row with the other parts on the fp32 chain's rows, its lines
    on the edge pages against the fp32 chain's; EXCLUDED (a candidate) when it keeps too few."""
    sc = ctx.cfg.system
    combo = {r: tuple(pair) if r == role else chain.ref_of(r) for r in chain.subs}
    subject = f"edge pages {role}: {pair[0]} {pair[1]}"

    def read() -> Gate:
        ref, n, kept, effective = _judged(chain, combo, threads, int(sc.edge_pages))
        ok = kept >= sc.edge_lines_kept - 1e-12
        g = Gate("system", subject, pair[1], effective, METRIC, value=round(kept, 4), reference=1.0,
                 checks=[Check("lines_same_as_fp32_chain_on_edge_pages", round(kept, 4), sc.edge_lines_kept, ">=",
                               ok, "system.edge_lines_kept",
                               f"{n['changed']} of {n['of']} lines changed (text {n['text']}, missing "
                               f"{n['missing']}, extra {n['extra']}) on {len(ref['pages'])} edge pages, seed "
                               f"{ref['seed']}")])
        g.status = OK if ok else FAIL
        g.reason = "" if ok else g.checks[0].describe()
        g.extra = {"edge": n, "edge_pages": len(ref["pages"]), "seed": ref["seed"], "fonts": ref["fonts"],
                   "reference_seconds": ref["seconds"]}
        return g

    t0 = time.perf_counter()
    g = apply_role(run_row("system", subject, pair[1], METRIC, read, chain.evidence), "candidate")
    g.seconds = round(time.perf_counter() - t0, 2)
    return g


def admitted(g: Gate) -> bool:
    """A row the edge judge lets serve (a crashed read is EXCLUDED too: its traceback is kept)."""
    return g.status not in (EXCLUDED, FAIL)
