"""The end-of-run table: one row per gate of every stage in the run folder (rich)."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from .artifacts import load_manifest
from .gates import Gate

STYLE = {"OK": "green", "FAIL": "bold red", "SKIPPED": "yellow", "CACHED": "cyan", "ERROR": "bold red",
         "NOT RUN": "dim"}


def _num(v, fmt="{:.4f}"):
    return "" if v is None else fmt.format(v)


def _limit(g: Gate) -> str:
    parts = [f"{c.name.replace('_diff', '').replace('max_abs', 'atol')}{'≤' if c.op == '<=' else '≥'}{c.limit:g}"
             for c in g.checks if c.limit is not None and c.name != "finite"]
    return ", ".join(parts)


def rows_for(run_dir: Path, stage_order: list[str], outcomes: dict[str, str]) -> list[list[str]]:
    rows = []
    for name in stage_order:
        man = load_manifest(run_dir / name)
        failed = load_manifest(run_dir / f"{name}.failed")
        state = outcomes.get(name)
        if state == "FAIL" and failed:
            man = failed
        if man is None:
            if state:
                rows.append([name, "", "", "", "", "", "", state, ""])
            continue
        tag = " (cached)" if state == "CACHED" else ("" if state else " (earlier run)")
        for d in man.get("gates", []):
            g = Gate.from_dict(d)
            latency = g.extra.get("latency_ms", {}).get("p50") if isinstance(g.extra.get("latency_ms"), dict) else None
            rows.append([name, g.subject, g.precision_effective, g.metric,
                         _num(g.value), _num(g.delta, "{:+.4f}"), _limit(g),
                         g.status + ("" if g.status != "SKIPPED" else f": {g.reason}") + tag,
                         (f"{latency:.2f} ms p50 · " if latency else "") + f"{g.seconds:.1f}s"])
    return rows


def print_summary(run_dir: Path, stage_order: list[str], outcomes: dict[str, str], console: Console | None = None):
    console = console or Console(stderr=False, width=160)
    table = Table(title=f"run {run_dir}", header_style="bold", show_lines=False)
    for col in ("stage", "checked", "precision (effective)", "metric", "value", "Δ vs ref", "limit", "verdict", "time"):
        table.add_column(col, overflow="fold")
    for r in rows_for(run_dir, stage_order, outcomes):
        verdict = r[7]
        key = verdict.split(":")[0].split(" ")[0]
        r[7] = f"[{STYLE.get(key, '')}]{verdict}[/]" if key in STYLE else verdict
        table.add_row(*r)
    console.print(table)
