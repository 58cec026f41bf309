"""Nightly regression: compare a finished run folder with a baseline run folder.

Per gate (matched by stage + subject): passed before and not now; primary metric dropped more
than regression.metric_drop; effective precision changed. Per model file and for the bundle: size grew
more than regression.size_growth. These are read from the stage manifests, so any two run folders can be
compared. Latency is not compared from recorded numbers (two nights on a shared machine differ by 50 %
on noise alone): both runs' artifacts are re-measured A/B in this process (pipeline/nightly/ab_latency.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from pipeline.core.artifacts import load_manifest
from pipeline.core.config import ROOT
from pipeline.core.errors import MissingArtifact
from pipeline.core.gates import Check, metric_check

MODEL_SUFFIXES = (".pdmodel", ".pdiparams", ".nb")
BASELINE_FILE = "BASELINE"       # <run.root>/BASELINE names the accepted run (written by `accept`)
_STAMP = re.compile(r"-\d{8}T\d{6}Z$")   # nightly run folders: <series>-<UTC time>


def series(run_name: str) -> str:
    """The nightly series a run belongs to: its name without the timestamp (nightly-2026...Z -> nightly)."""
    return _STAMP.sub("", run_name)


def baseline_marker(root: Path, run_name: str) -> Path:
    """One accepted baseline per series (the config's run.name without a timestamp): runs/BASELINE for the
    default nightly, runs/BASELINE.<series> for others (a recognition nightly must not replace the
    classification nightly's baseline)."""
    name = series(run_name)
    return Path(root) / (BASELINE_FILE if name in ("nightly", "") else f"{BASELINE_FILE}.{name}")


@dataclass
class Comparison:
    name: str                    # "metric · server: paddle-inference fp32 (accuracy)"
    kind: str                    # status | metric | latency | size
    baseline: float | str | None
    current: float | str | None
    limit: str
    passed: bool
    message: str
    measured: bool = True        # False: nothing was compared (said with the reason; never counted as a pass)


def _resolve(path: str | Path, base: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else base / p


def history_path(cfg) -> Path:
    return _resolve(cfg.regression.history, ROOT)


def run_root(cfg) -> Path:
    return cfg.run_dir.parent


# ------------------------------------------------------------------------------------ facts

_SERVED_ROW = re.compile(r"^http /predict (fp32|fp16|bf16|int8)$")     # the served HTTP row's name before 2026-12-02


def run_facts(run_dir: Path, stage_order: list[str]) -> dict:
    """What a run folder says about itself: stage statuses, gates, model and bundle sizes."""
    run_dir = Path(run_dir)
    stages, gates, sizes = {}, {}, {}
    for stage in stage_order:
        man = load_manifest(run_dir / stage) or load_manifest(run_dir / f"{stage}.failed")
        stages[stage] = man["status"] if man else "NOT RUN"
        if not man:
            continue
        for g in man.get("gates", []):
            lat = g.get("extra", {}).get("latency_ms")
            subject = _SERVED_ROW.sub("http /predict as served", g["subject"])    # runs from before the name
            gates[f"{stage}: {subject}"] = {
                "stage": stage, "subject": subject,
                "served": bool(g.get("extra", {}).get("served")) or subject != g["subject"], "precision": g.get("precision_effective"),
                "metric": g.get("metric"), "value": g.get("value"), "status": g["status"],
                "reason": _why(g), "seconds": g.get("seconds", 0.0),
                "latency": lat if isinstance(lat, dict) and lat.get("p50") is not None else None,
                "bytes": g.get("extra", {}).get("bytes")}
        outputs = man.get("outputs", {}) if man["status"] == "OK" else {}
        if stage == "bundle":
            # the bundle folder is named <run>-<version>: strip it so two runs' bundles line up
            inner = {k: v for k, v in outputs.items() if "/" in k}
            if inner:
                sizes["bundle: all files"] = sum(v["bytes"] for v in inner.values())
                for g in gates.values():              # the history's size column for the bundle row
                    if g["stage"] == "bundle":
                        g["bytes"] = sizes["bundle: all files"]
            for k, v in outputs.items():
                if k.endswith(".tar.gz"):
                    sizes["bundle: .tar.gz"] = v["bytes"]
        else:
            for k, v in outputs.items():
                if k.endswith(MODEL_SUFFIXES):
                    sizes[f"{stage}: {k}"] = v["bytes"]
    server = load_manifest(run_dir / "server") or load_manifest(run_dir / "server.failed") or {}
    return {"name": run_dir.name, "run_dir": str(run_dir), "stages": stages, "gates": gates, "sizes": sizes,
            "config_hash": config_hash(run_dir),
            # the server stage's matmul probe, measured minutes from its latencies: how fast the machine was
            "machine_gflops": server.get("info", {}).get("matmul_peak_gflops")}


def _why(g: dict) -> str:
    """A failed gate's failing checks (its reason field may hold notes); else its reason."""
    if g["status"] == "FAIL":
        bad = [Check(**c).describe() for c in g.get("checks", []) if not c.get("passed", True)]
        if bad:
            return "; ".join(bad)
    return g.get("reason") or ""


def config_hash(run_dir: Path) -> str | None:
    """Hash of the resolved config without `run` and `regression` (which differ between nights by design)."""
    p = Path(run_dir) / "config.resolved.yaml"
    if not p.is_file():
        return None
    tree = {k: v for k, v in (yaml.safe_load(p.read_text()) or {}).items() if k not in ("run", "regression")}
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ compare

def compare(base: dict, cur: dict, *, metric_drop: float, size_growth: float) -> list[Comparison]:
    """Status, metric, precision and size comparisons from two runs' facts (latency: see latency_ab)."""
    out: list[Comparison] = []
    for key, b in base["gates"].items():
        c = cur["gates"].get(key)
        now = c["status"] if c else "missing"
        if b["status"] in ("OK", "UNVERIFIED"):
            # an UNVERIFIED row (produced, not executed) may become OK, never worse; OK must stay OK
            allowed = ("OK",) if b["status"] == "OK" else ("OK", "UNVERIFIED")
            ok = now in allowed
            why = "" if ok else f" ({c['reason']})" if c and c.get("reason") else ""
            was = "passed" if b["status"] == "OK" else "was UNVERIFIED"
            out.append(Comparison(f"status · {key}", "status", b["status"], now, f"stays {' or '.join(allowed)}",
                                  ok, f"{key}: {was} in baseline, now {now}{why}"))
        if c is None:
            continue
        if b.get("precision") and c.get("precision") and b["status"] != "SKIPPED":
            out.append(_precision(key, b["precision"], c["precision"], served=bool(b.get("served") or c.get("served"))))
        if _num(b["value"]) and c["value"] is not None:
            drop = b["value"] - c["value"]
            ok = metric_check(b["metric"], c["value"], b["value"], metric_drop).passed   # the gates' own rule
            out.append(Comparison(f"metric · {key} ({b['metric']})", "metric", b["value"], c["value"],
                                  f"drop ≤ {metric_drop:g}", ok,
                                  f"{key}: {b['metric']} {b['value']:.4f} → {c['value']:.4f} "
                                  f"(drop {drop:+.4f}, limit {metric_drop:g})"))
    for key, b_bytes in base["sizes"].items():
        c_bytes = cur["sizes"].get(key)
        if c_bytes is None or not b_bytes:
            continue                      # a vanished file shows up as a failed/missing gate above
        growth = c_bytes / b_bytes - 1
        out.append(Comparison(f"size · {key}", "size", b_bytes, c_bytes, f"growth ≤ {size_growth:.0%}",
                              growth <= size_growth + 1e-12,
                              f"{key}: {b_bytes:,} → {c_bytes:,} bytes ({growth:+.1%}, limit +{size_growth:.0%})"))
    return out


def _precision(key: str, base: str, cur: str, served: bool = False) -> Comparison:
    """Any change of the precision that really ran is a regression (fp16 -> fp32 is slower, int8 -> fp32
    may mean oneDNN stopped quantizing, fp32 -> bf16 changes the numbers); only the explanation may change.
    served: the served row is the recommendation's timed choice, so a change of its precision is reported, not
    failed (the row itself must still pass its gate at whatever precision it now serves: the status check)."""
    from pipeline.engines.evidence import head

    same = head(base) == head(cur)
    if served:
        note = "" if same else " (the recommendation chose another row; its gate passed at that precision)"
        return Comparison(f"precision · {key}", "precision", base, cur, "reported", True,
                          f"{key}: served precision {base} → {cur}{note}")
    return Comparison(f"precision · {key}", "precision", base, cur, "same effective precision", same,
                      f"{key}: effective precision {base} → {cur}")


def latency_ab(base_dir: Path, cur_dir: Path, *, growth: float, rounds: int, runs: int, threads: int = 0,
               wrap_current=None, wrap_rows=None) -> list[Comparison]:
    """Latency comparisons measured now, A/B, on both runs' own artifacts (see pipeline/nightly/ab_latency.py)."""
    from pipeline.nightly.ab_latency import ab_compare, sample_input

    x = sample_input(cur_dir)
    if x is None:
        return []
    out = []
    for key, res, note in ab_compare(base_dir, cur_dir, x, growth=growth, rounds=rounds, runs=runs,
                                     threads=threads, wrap_current=wrap_current, wrap_rows=wrap_rows):
        name = f"latency · {key} (A/B)"
        if res is None:
            out.append(Comparison(name, "latency", None, None, "A/B", True, f"{key}: {note}", measured=False))
        else:
            out.append(Comparison(name, "latency", round(res.a_ms[1], 4), round(res.b_ms[1], 4),
                                  f"ratio ≤ {1 + growth:.2f} (or p10 ≤ 1)", not res.regressed(growth),
                                  res.message(growth)))
    return out


def _num(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


_PRIORITY = {"metric": 0, "status": 1, "precision": 2, "size": 3, "latency": 4}


def regressions(comparisons: list[Comparison]) -> list[Comparison]:
    """Failed comparisons, most telling first: a metric drop explains the gates that stopped passing."""
    bad = [c for c in comparisons if not c.passed]
    return sorted(bad, key=lambda c: (_PRIORITY.get(c.kind, 9), c.current == "missing"))


def regression_block(baseline: str, regs: list[Comparison]) -> str:
    lines = [f"{len(regs)} regression(s) against baseline {baseline}:"]
    lines += [f"  - [{c.kind}] {c.message}" for c in regs]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ baseline

def resolve_baseline(cfg, current: str, history, explicit: str | None = None) -> tuple[Path | None, str]:
    """explicit / regression.baseline → the accepted run (<run.root>/BASELINE) → the last passing run
    in history → none (first run). Returns (run folder, how it was chosen)."""
    root = run_root(cfg)
    given = explicit or cfg.regression.baseline
    if given:
        for cand in (_resolve(given, ROOT), _resolve(given, root)):
            if (cand / "config.resolved.yaml").is_file():
                return cand, "given"
        raise MissingArtifact(f"baseline run folder not found: {given}",
                              hint="pass a run folder (e.g. runs/nightly-...) or a run name under run.root")
    marker = baseline_marker(root, cfg.run.name)
    if marker.is_file():
        target = _resolve(marker.read_text().strip(), root)
        if not target.is_dir():
            raise MissingArtifact(f"accepted baseline {target} (from {marker}) no longer exists",
                                  hint="accept another run: make accept RUN=runs/<name>")
        return target, "accepted"
    # a timestamped nightly compares within its own series (nightly-*, nightly_rec-*); other names with any run
    same = (lambda r: series(r["name"]) == series(current)) if series(current) != current else None
    prev = history.last_passed(exclude=current, where=same)
    if prev:
        return Path(prev["run_dir"]), "previous passing run in history"
    return None, "none (first run)"


def accept(cfg, run_dir: Path, stage_order: list[str]) -> Path:
    """Promote a run to baseline; only a run whose every stage passed may become the reference."""
    from pipeline.core.errors import GateFailed

    run_dir = Path(run_dir).resolve()
    facts = run_facts(run_dir, stage_order)
    bad = {s: st for s, st in facts["stages"].items() if st != "OK"}
    if bad:
        raise GateFailed(f"refusing to accept {run_dir} as baseline: stage(s) not OK: "
                         + ", ".join(f"{s}={st}" for s, st in bad.items()),
                         hint="accept a run whose whole chain passed (see `python -m pipeline history`)")
    root = run_root(cfg)
    rel = run_dir.relative_to(root.resolve()) if run_dir.is_relative_to(root.resolve()) else run_dir
    from pipeline.core.artifacts import atomic_write_text
    marker = baseline_marker(root, cfg.run.name)       # the series of the config it is accepted for
    atomic_write_text(marker, f"{rel}\n")
    return marker


def comparisons_as_dicts(comps: list[Comparison]) -> list[dict]:
    return [asdict(c) for c in comps]


# ------------------------------------------------------------------------------------ the check

def check_run(cfg, run_dir: Path, stage_order: list[str], *, baseline: str | None = None,
              stage_errors: dict[str, str] | None = None, now: str | None = None, planted: dict | None = None) -> dict:
    """Compare run_dir with its baseline, append it to the history, write junit.xml and report.html.

    Never raises for a regression (the caller decides): returns facts, comparisons, regressions and paths.
    planted: tests/experiments only, {"wrap_current": fn -> fn, "wrap_rows": {server row subjects}}."""
    from datetime import datetime, timezone

    from pipeline.core import env
    from pipeline.nightly.history import History
    from pipeline.nightly.report import write_junit, write_report

    facts = run_facts(run_dir, stage_order)
    hist = History(history_path(cfg))
    base_dir, how = resolve_baseline(cfg, facts["name"], hist, explicit=baseline)
    base = run_facts(base_dir, stage_order) if base_dir else None
    r = cfg.regression
    comps = compare(base, facts, metric_drop=r.metric_drop, size_growth=r.size_growth) if base else []
    if base:
        comps += latency_ab(base_dir, Path(run_dir), growth=r.latency_growth, rounds=r.ab_rounds, runs=r.ab_runs,
                            threads=r.ab_threads, **(planted or {}))
    regs = regressions(comps)
    failed = any(st != "OK" for st in facts["stages"].values()) or bool(stage_errors)
    status = "failed" if failed else "regressed" if regs else "passed"
    hist.record({"name": facts["name"], "run_dir": str(Path(run_dir).resolve()),
                 "time": now or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "git_commit": env.git_commit(), "config_hash": facts["config_hash"], "status": status,
                 "baseline": base["name"] if base else None, "regressions": len(regs)},
                [{**g, "latency_p50": g["latency"]["p50"] if g["latency"] else None, "size_bytes": g["bytes"]}
                 for g in facts["gates"].values()])
    label = f"{base['name']} ({how})" if base else how
    junit = write_junit(Path(run_dir) / "junit.xml", facts, comps, stage_errors or {})
    report = write_report(Path(run_dir), facts, comps, base, label, hist.trend(limit=30), status, regs)
    return {"facts": facts, "baseline": base, "baseline_label": label, "comparisons": comps,
            "regressions": regs, "status": status, "junit": junit, "report": report}
