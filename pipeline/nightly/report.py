"""What the nightly job leaves in the run folder for people and for CI.

junit.xml    one <testcase> per gate and per baseline comparison (Jenkins/GitLab render it natively)
report.html  one standalone page: gates, comparisons and PNG plots embedded as base64 data URIs
             (training curves, metric per stage/precision, latency per engine, trend over past runs)
"""
from __future__ import annotations

import html
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text


# ------------------------------------------------------------------------------------ junit

def write_junit(path: Path, facts: dict, comparisons: list, stage_errors: dict[str, str]) -> Path:
    root = ET.Element("testsuites", name=f"pipeline nightly {facts['name']}")
    suite = ET.SubElement(root, "testsuite", name="gates")
    for key, g in facts["gates"].items():
        case = ET.SubElement(suite, "testcase", classname=f"gates.{g['stage']}", name=f"{g['subject']} ({g['precision']})",
                             time=f"{g.get('seconds') or 0:.3f}")
        if g["status"] == "FAIL":
            ET.SubElement(case, "failure", message=f"{key}: {g['reason']}"[:500], type="GateFailed").text = g["reason"]
        elif g["status"] == "SKIPPED":
            ET.SubElement(case, "skipped", message=g["reason"][:500])
        elif g["status"] == "UNVERIFIED":      # produced, not executed: neither a pass nor a failure
            ET.SubElement(case, "skipped", message=f"UNVERIFIED: {g['reason']}"[:500])
    gated = {g["stage"] for g in facts["gates"].values()}
    for stage, err in stage_errors.items():          # a stage that crashed or never ran has no gates: still visible
        if stage in gated:
            continue
        case = ET.SubElement(suite, "testcase", classname=f"gates.{stage}", name=f"{stage} stage", time="0")
        ET.SubElement(case, "error", message=err[:500], type="StageError").text = err
    comp = ET.SubElement(root, "testsuite", name="regression")
    for c in comparisons:
        case = ET.SubElement(comp, "testcase", classname=f"regression.{c.kind}", name=c.name, time="0")
        if not c.passed:
            ET.SubElement(case, "failure", message=c.message[:500], type="RegressionFound").text = c.message
        elif not c.measured:            # nothing was compared: neither a pass nor a regression
            ET.SubElement(case, "skipped", message=f"NOT MEASURED: {c.message}"[:500])
        else:
            ET.SubElement(case, "system-out").text = c.message
    for s in (suite, comp):
        cases = s.findall("testcase")
        s.set("tests", str(len(cases)))
        s.set("failures", str(sum(1 for c in cases if c.find("failure") is not None)))
        s.set("errors", str(sum(1 for c in cases if c.find("error") is not None)))
        s.set("skipped", str(sum(1 for c in cases if c.find("skipped") is not None)))
    ET.indent(root)
    atomic_write_bytes(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))
    return path


def _verdict(c) -> str:
    return "REGRESSION" if not c.passed else "OK" if c.measured else f"NOT MEASURED ({c.message.split(': ', 1)[-1]})"


# ------------------------------------------------------------------------------------ plots

def _plt():
    import matplotlib
    matplotlib.use("Agg")                  # headless: CI machines have no display
    import matplotlib.pyplot as plt
    return plt


def _save(fig, folder: Path, name: str) -> str:
    """The figure as a data URI: the report is one file that can be mailed or archived alone."""
    import base64
    import io
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def plot_training(run_dir: Path) -> str | None:
    src = next((p for p in (run_dir / "train" / "metrics.jsonl", run_dir / "train.failed" / "metrics.jsonl")
                if p.is_file()), None)
    rows = [json.loads(l) for l in src.read_text().splitlines() if l.strip()] if src else []
    if not rows:
        return None
    metric = next((k for k in rows[0] if k in ("accuracy", "seq_accuracy")), None)
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if metric else 1, figsize=(9, 3.2), squeeze=False)
    epochs = [r["epoch"] for r in rows]
    axes[0][0].plot(epochs, [r["loss"] for r in rows], marker="o")
    axes[0][0].set(title="training loss", xlabel="epoch")
    if metric:
        axes[0][1].plot(epochs, [r[metric] for r in rows], marker="o", color="tab:green")
        axes[0][1].set(title=f"validation {metric}", xlabel="epoch")
    return _save(fig, run_dir, "plot_training.png")


def plot_metrics(run_dir: Path, facts: dict, base: dict | None) -> str | None:
    rows = [(k, g) for k, g in facts["gates"].items() if _finite(g["value"])]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ys = range(len(rows))
    colors = ["tab:green" if g["status"] == "OK" else "tab:red" for _, g in rows]
    ax.barh([y + 0.2 for y in ys], [g["value"] for _, g in rows], height=0.4, color=colors, label="this run")
    if base:
        ax.barh([y - 0.2 for y in ys], [(base["gates"].get(k) or {}).get("value") or 0 for k, _ in rows],
                height=0.4, color="tab:gray", label=f"baseline {base['name']}")
    ax.set_yticks(list(ys), [f"{k} [{g['precision']}]" for k, g in rows])
    ax.invert_yaxis()
    ax.set(title="primary metric per stage and precision", xlim=(0, 1.05))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _save(fig, run_dir, "plot_metrics.png")


def plot_latency(run_dir: Path, facts: dict) -> str | None:
    rows = [(k, g["latency"]) for k, g in facts["gates"].items() if g["latency"]]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    p50 = [lat["p50"] for _, lat in rows]
    p90 = [max(0.0, (lat.get("p90") or lat["p50"]) - lat["p50"]) for _, lat in rows]
    ax.barh(range(len(rows)), p50, xerr=[[0] * len(rows), p90], color="tab:blue", capsize=3)
    ax.set_yticks(range(len(rows)), [k for k, _ in rows])
    ax.invert_yaxis()
    ax.set(title="latency per engine (bar: p50, whisker: p90)", xlabel="ms per request/batch of 1")
    return _save(fig, run_dir, "plot_latency.png")


def plot_trend(run_dir: Path, trend: list[dict]) -> str | None:
    if len(trend) < 2:
        return None
    keys, lat_keys = [], []                       # every gate seen in the window, in first-seen order
    for r in trend:
        keys += [k for k, g in r["gates"].items() if _finite(g["value"]) and k not in keys]
        lat_keys += [k for k, g in r["gates"].items() if g["latency_p50"] is not None and k not in lat_keys]
    keys, lat_keys = keys[:8], lat_keys[:4]
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = list(range(len(trend)))
    for k in keys:
        a1.plot(x, [_get(r, k, "value") for r in trend], marker="o", label=k)
    for k in lat_keys:
        a2.plot(x, [_get(r, k, "latency_p50") for r in trend], marker="o", label=k)
    for ax, title in ((a1, "primary metric over runs"), (a2, "latency p50 (ms) over runs")):
        ax.set_xticks(x, [_run_label(r["name"]) for r in trend], fontsize=7)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.autofmt_xdate(rotation=40, ha="right")     # slanted labels, bottom margin made to fit them
    return _save(fig, run_dir, "plot_trend.png")


def _run_label(name: str) -> str:
    """nightly-20261130T101500Z -> 11-30 10:15 (the date is what a reader scans for); other names as is."""
    import re
    m = re.search(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})", name)
    return f"{m[2]}-{m[3]} {m[4]}:{m[5]}" if m else name[-18:]


def _get(run: dict, key: str, field: str) -> float:
    v = (run["gates"].get(key) or {}).get(field)
    return v if _finite(v) else math.nan


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# ------------------------------------------------------------------------------------ html

CSS = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}"
       "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}.OK,.passed{color:#080}"
       ".FAIL,.failed,.regressed{color:#b00;font-weight:bold}.SKIPPED{color:#a60}.UNVERIFIED{color:#06c}"
       "img{max-width:100%}")


def _table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{e(classes[i])}"' if classes else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>")
    return "\n".join(out) + "</table>"


def write_report(run_dir: Path, facts: dict, comparisons: list, base: dict | None, baseline_label: str,
                 trend: list[dict], status: str, regs: list) -> Path:
    """Render what it is given (comparisons and the regressions among them): report knows no regression rules."""
    e = html.escape
    plots = [("Training curves", plot_training(run_dir)), ("Metric per stage and precision",
             plot_metrics(run_dir, facts, base)), ("Latency per engine", plot_latency(run_dir, facts)),
             ("Trend over past runs", plot_trend(run_dir, trend))]
    parts = [f"<!doctype html><meta charset='utf-8'><title>{e(facts['name'])}</title><style>{CSS}</style>",
             f"<h1>Run {e(facts['name'])}: <span class='{e(status)}'>{e(status)}</span></h1>",
             f"<p>Baseline: {e(baseline_label)} · stages: "
             + ", ".join(f"{e(s)} <span class='{e(st)}'>{e(st)}</span>" for s, st in facts["stages"].items())
             + "</p>",
             "<p>Latency is compared A/B: the baseline's and this run's artifacts re-measured in one process, "
             "alternating rounds, same input; a row fails only when the ratio exceeds the limit with separated "
             "spreads. UNVERIFIED rows were produced but not executed here.</p>",
             f"<p>Machine probe (matmul GFLOP/s, informational): {_short(facts.get('machine_gflops'))}"
             + (f" · baseline {_short(base.get('machine_gflops'))}" if base else "") + "</p>"]
    if regs:
        parts.append("<h2 class='FAIL'>Regressions</h2><ul>" + "".join(f"<li>[{e(c.kind)}] {e(c.message)}</li>"
                                                                      for c in regs) + "</ul>")
    parts.append("<h2>Gates</h2>" + _table(
        ["stage: checked", "precision", "metric", "value", "p50 ms", "status"],
        [[k, g["precision"], g["metric"], "" if g["value"] is None else f"{g['value']:.4f}",
          f"{g['latency']['p50']:.3f}" if g["latency"] else "", g["status"] + (f": {g['reason']}" if g["reason"]
                                                                               and g["status"] != "OK" else "")]
         for k, g in facts["gates"].items()], [g["status"] for g in facts["gates"].values()]))
    if comparisons:
        parts.append("<h2>Comparison with the baseline</h2>" + _table(
            ["check", "baseline", "this run", "limit", "verdict"],
            [[c.name, _short(c.baseline), _short(c.current), c.limit, _verdict(c)] for c in comparisons],
            ["OK" if c.passed and c.measured else "FAIL" if not c.passed else "SKIPPED" for c in comparisons]))
    for title, src in plots:
        body = f"<img src='{src}' alt='{e(title)}'>" if src else "<p>(no data for this plot yet)</p>"
        parts.append(f"<h2>{e(title)}</h2>{body}")
    path = run_dir / "report.html"
    atomic_write_text(path, "\n".join(parts) + "\n")
    return path


def _short(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"{v:,}" if isinstance(v, int) else str(v)
