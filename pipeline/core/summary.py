"""The end-of-run table: one row per gate of every stage in the run folder (rich).

Long reasons (SKIPPED, converted-not-executed, failures) go to numbered notes under the table
so the table stays readable in an 80-120 column terminal or CI log.
"""
from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.core.artifacts import load_manifest
from pipeline.core.console import rich_console
from pipeline.core.gates import Gate

STYLE = {"OK": "green", "FAIL": "bold red", "SKIPPED": "yellow", "UNVERIFIED": "cyan", "EXCLUDED": "magenta",
         "ERROR": "bold red",
         "NOT RUN": "dim"}
SHORT = {"max_abs_diff": "atol", "finite": "finite"}


def _num(v, fmt="{:.4f}"):
    return "" if v is None else fmt.format(v)


def _limit(g: Gate) -> str:
    parts = []
    for c in g.checks:
        if c.limit is None or "finite" in c.name or c.name.startswith("sha256"):
            continue
        name = SHORT.get(c.name, "atol" if "max_abs_diff" in c.name else
                         "drop" if c.name.endswith("_drop") else "agree" if c.name.endswith("_agreement") else c.name)
        name = "|Δp|" if name == "atol" and c.key.endswith("prob_atol") else name     # compared as probabilities
        parts.append(f"{name} {'≤' if c.op == '<=' else '≥'} {c.limit:.3g}")
    return ", ".join(dict.fromkeys(parts))


def gate_rows(run_dir: Path, stage_order: list[str], outcomes: dict[str, str]) -> tuple[list[list[str]], list[str]]:
    rows, notes = [], []
    for name in stage_order:
        man = load_manifest(run_dir / name)
        state = outcomes.get(name)
        if state == "FAIL":
            man = load_manifest(run_dir / f"{name}.failed") or man
        if man is None or state in ("ERROR", "NOT RUN"):
            if state:
                rows.append([name, "", "", "", "", "", "", state, "", ""])
            continue
        tag = " (cached)" if state == "CACHED" else ""
        for d in man.get("gates", []):
            g = Gate.from_dict(d)
            subject = g.subject.replace("paddle-inference ", "inference ").removeprefix("lite ")
            verdict = g.status
            # "fp32 (bf16 not applied: ...)": the table shows the precision, the note says why
            precision, _, why = g.precision_effective.partition(" (")
            reason = "; ".join(filter(None, [g.reason, f"ran {precision} ({why}" if why else ""]))
            if reason:
                notes.append(f"{g.stage} {subject}: {reason}")
                verdict += f" [{len(notes)}]"
            lat = g.extra.get("latency_ms")
            p50 = f"{lat['p50']:.2f} ms" if isinstance(lat, dict) and lat.get("p50") is not None else ""
            if g.status != "SKIPPED" and not precision.startswith(g.precision_requested.split("/")[0]):
                precision = f"{g.precision_requested} → {precision}"      # e.g. float16/O1 → float32 on CPU
            rows.append([name, subject, precision, g.metric, _num(g.value),
                         _num(g.delta, "{:+.4f}"), _limit(g), verdict + tag, p50, f"{g.seconds:.1f}s"])
    return rows, notes


def print_summary(run_dir: Path, stage_order: list[str], outcomes: dict[str, str], console: Console | None = None):
    console = console or rich_console(file=sys.stdout, width=170)   # no colour codes when not a terminal
    table = Table(title=f"run {run_dir}", header_style="bold")
    for col in ("stage", "checked", "precision", "metric", "value", "Δ vs ref", "limit", "verdict",
                "p50 (b=1)", "time"):
        table.add_column(col, overflow="fold", no_wrap=col in ("stage", "checked", "precision", "metric", "value", "Δ vs ref", "time"))
    rows, notes = gate_rows(run_dir, stage_order, outcomes)
    for r in rows:
        key = r[7].split(" ")[0]
        r[7] = f"[{STYLE[key]}]{r[7]}[/]" if key in STYLE else r[7]
        table.add_row(*r)
    console.print(table)
    for i, note in enumerate(notes, 1):
        console.print(f"  [{i}] {note}", highlight=False, soft_wrap=True)
    layout = layout_line(run_dir)
    if layout:
        console.print(f"  {layout}", highlight=False, soft_wrap=True)


def layout_line(run_dir: Path) -> str | None:
    """How training ran (processes × threads, nodes) and why, from the train manifest."""
    man = load_manifest(run_dir / "train")
    lay = (man or {}).get("info", {}).get("layout")
    if not lay:
        return None
    threads = lay.get("threads")
    text = (f"train layout: {lay['nproc']} process{'es' * (lay['nproc'] != 1)} × "
            f"{threads if threads is not None else 'default'} thread{'s' * (threads != 1)}"
            + (f" × {lay['nnodes']} nodes" if lay.get("nnodes", 1) > 1 else "")
            + f", global batch {man['info'].get('global_batch')} ({lay.get('reason', '')})")
    wait = (man.get("cpu_tuning") or {})
    if wait.get("why", {}).get("OMP_WAIT_POLICY"):
        text += f"; OpenMP wait {wait.get('OMP_WAIT_POLICY') or 'default'}: {wait['why']['OMP_WAIT_POLICY']}"
    return text


def summary_record(run_dir: Path, stage_order: list[str], outcomes: list, exit_code: int) -> dict:
    """The summary for scripts (`--summary-json PATH`): each stage's outcome and every gate as its manifest
    records it (value, limit, verdict, effective precision, reason); the table shows the same rows."""
    by_stage = {o.stage: o for o in outcomes}
    stages, gates = [], []
    for name in stage_order:
        o = by_stage.get(name)
        man = load_manifest(run_dir / (f"{name}.failed" if o is not None and o.status == "FAIL" else name))
        if o is None and man is None:
            continue
        stages.append({"stage": name, "status": o.status if o is not None else "NOT REQUESTED",
                       "seconds": round(o.seconds, 2) if o is not None else None,
                       "error": o.error.one_line() if o is not None and o.error is not None else None})
        gates += (man or {}).get("gates", []) if o is None or o.status not in ("ERROR", "NOT RUN") else []
    return {"run_dir": str(run_dir), "ok": exit_code == 0, "exit_code": exit_code, "stages": stages,
            "gates": gates, "layout": layout_line(run_dir)}
