"""Run history in SQLite (stdlib, one file, no server): one row per run, one per gate.

The nightly job appends every run; the regression check falls back to the last passing run when
no baseline was accepted, the report plots the trend, `python -m pipeline history` prints it.
"""
from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from pipeline.core.errors import PipelineError

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT UNIQUE NOT NULL, run_dir TEXT NOT NULL, time TEXT NOT NULL,
    git_commit TEXT, config_hash TEXT, status TEXT NOT NULL,
    baseline TEXT, regressions INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS gates (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    stage TEXT NOT NULL, subject TEXT NOT NULL, precision TEXT, metric TEXT,
    value REAL, status TEXT NOT NULL, latency_p50 REAL, size_bytes INTEGER);
CREATE INDEX IF NOT EXISTS gates_run ON gates(run_id);
"""


class History:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=30)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys = ON")
            conn.executescript(SCHEMA)
            return conn
        except (sqlite3.Error, OSError) as exc:
            raise PipelineError(f"cannot open run history {self.path}: {exc}",
                                hint="set regression.history to a writable .sqlite path") from None

    def record(self, run: dict, gates: list[dict]) -> None:
        """run: name, run_dir, time, git_commit, config_hash, status, baseline, regressions.
        gates: stage, subject, precision, metric, value, status, latency_p50, size_bytes.
        Re-recording a run name replaces it (a re-compared run is one run, not two)."""
        with closing(self._connect()) as conn, conn:
            conn.execute("DELETE FROM runs WHERE name = ?", (run["name"],))
            cur = conn.execute(
                "INSERT INTO runs (name, run_dir, time, git_commit, config_hash, status, baseline, regressions)"
                " VALUES (:name, :run_dir, :time, :git_commit, :config_hash, :status, :baseline, :regressions)",
                {k: run.get(k) for k in ("name", "run_dir", "time", "git_commit", "config_hash", "status",
                                         "baseline")} | {"regressions": int(run.get("regressions") or 0)})
            conn.executemany(
                "INSERT INTO gates (run_id, stage, subject, precision, metric, value, status, latency_p50, size_bytes)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(cur.lastrowid, g["stage"], g["subject"], g.get("precision"), g.get("metric"), g.get("value"),
                  g["status"], g.get("latency_p50"), g.get("size_bytes")) for g in gates])

    def runs(self, limit: int = 20) -> list[dict]:
        """Newest first."""
        if not self.path.is_file():
            return []
        with closing(self._connect()) as conn:
            rows = conn.execute("SELECT * FROM runs ORDER BY time DESC, id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(r) for r in rows]

    def gates(self, run_name: str) -> list[dict]:
        with closing(self._connect()) as conn:
            rows = conn.execute("SELECT g.* FROM gates g JOIN runs r ON r.id = g.run_id WHERE r.name = ?"
                                " ORDER BY g.rowid", (run_name,)).fetchall()
        return [dict(r) for r in rows]

    def last_passed(self, exclude: str | None = None, where=None) -> dict | None:
        """The newest run that passed every gate and comparison, other than `exclude`, whose folder still exists
        (and for which `where(run)` holds, e.g. the same nightly series)."""
        for r in self.runs(limit=200):
            if (r["name"] != exclude and r["status"] == "passed" and Path(r["run_dir"]).is_dir()
                    and (where is None or where(r))):
                return r
        return None

    def trend(self, limit: int = 20) -> list[dict]:
        """Oldest → newest: each run with its gates keyed "stage: subject"."""
        out = []
        for r in reversed(self.runs(limit)):
            r["gates"] = {f"{g['stage']}: {g['subject']}": g for g in self.gates(r["name"])}
            out.append(r)
        return out


def print_trend(history: History, limit: int = 20, console=None) -> None:
    """A rich table, one row per run: status, commit, every gate's value, the first latency, the bundle size."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=180)
    rows = history.trend(limit)
    if not rows:
        console.print(f"no runs recorded yet in {history.path} (run `make nightly`)")
        return
    latest = rows[-1]["gates"]
    keys = [k for k, g in latest.items() if g["value"] is not None][:6]
    lat_key = next((k for k, g in latest.items() if g["latency_p50"] is not None), None)
    size_key = next((k for k in latest if k.startswith("bundle:")), None)
    table = Table(title=f"run history ({history.path})", header_style="bold")
    table.add_column("run", no_wrap=True)
    for col in ["time (UTC)", "commit", "status", *(k.replace(": ", "\n") for k in keys)]:
        table.add_column(col, overflow="fold")
    if lat_key:
        table.add_column(f"p50 ms\n{lat_key.split(': ', 1)[1]}", overflow="fold")
    if size_key:
        table.add_column("bundle MB")
    style = {"passed": "green", "regressed": "bold red", "failed": "bold red"}
    for r in rows:
        g = r["gates"]
        cells = [r["name"], r["time"][:16].replace("T", " "), (r["git_commit"] or "")[:10],
                 f"[{style.get(r['status'], '')}]{r['status']}[/]" + (f" ({r['regressions']})" if r["regressions"] else "")]
        cells += [_fmt(g.get(k, {}).get("value"), "{:.4f}") for k in keys]
        if lat_key:
            cells.append(_fmt(g.get(lat_key, {}).get("latency_p50"), "{:.3f}"))
        if size_key:
            cells.append(_fmt((g.get(size_key, {}).get("size_bytes") or 0) / 1e6 or None, "{:.2f}"))
        table.add_row(*cells)
    console.print(table)


def _fmt(v, fmt: str) -> str:
    return "" if v is None else fmt.format(v)
