"""`make conformance`: the whole chain over a zoo of real architectures, one matrix of verdicts.

Each architecture runs `python -m pipeline run all` (short training → export → every server row →
Lite arm/x86 → bundle) and then `verify` on its bundle, in its own subprocess and run folder: a crash
of one architecture is a FAIL row with the log as evidence, and the others still run. Each architecture
trains by its own recipe (configs/conformance.yaml `conformance.zoo`, chosen on a tuning split) past chance,
so that its low-precision rows judge decisions; every parity gate keeps its default from configs/defaults.yaml.
Stages are cached by fingerprint as in any run (trained weights included): a rerun re-runs what changed.
Writes <root>/conformance.json and <root>/conformance.md; exit code 1 when a row FAILs or did not run, or when
more than conformance.max_marked_share of executed rows is MARKED near chance (conformance_rules.py).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.markup import escape
from rich.console import Console
from rich.table import Table
import yaml

from pipeline.core.artifacts import atomic_write_text, load_manifest, write_json
from pipeline.nightly import conformance_rules as rules
from pipeline.nightly.conformance_rules import MARKED, Row
from pipeline.nightly.conformance_rules import counts_line as counts_line, verdict_counts as verdict_counts  # re-exported

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "conformance.yaml"
BASE_NAME = "config.base.yaml"      # conformance.yaml without its own section: what each architecture runs with


@dataclass(frozen=True)
class Settings:
    base: dict                      # the stages' config: conformance.yaml without its `conformance` section
    zoo: dict[str, list[str]]       # architecture -> its recipe as -o overrides
    fast: tuple[str, ...]           # what `make test` runs end to end
    max_marked_share: float
    jobs: int = 1                   # architectures run side by side


def load_settings(path: Path = CONFIG) -> Settings:
    """configs/conformance.yaml, its `conformance` section validated as any config is (load_config: unknown keys,
    types, the stage sections too); read when the command runs, never at import."""
    from pipeline.core import safe_yaml
    from pipeline.core.config import load_config
    from pipeline.core.errors import ConfigError

    own = load_config([path]).conformance
    if not own.zoo:
        raise ConfigError(f"{path}: conformance.zoo names no architecture",
                          hint="map each architecture to its recipe, e.g. 'lcnet: {model.name: lcnet, data.channels: 3}'")
    if unknown := [a for a in own.fast if a not in own.zoo]:
        raise ConfigError(f"{path}: conformance.fast names {', '.join(unknown)}, not in conformance.zoo",
                          hint=f"choose from {', '.join(own.zoo)}")
    base = dict(safe_yaml.read(path) or {})
    base.pop("conformance", None)
    fmt = lambda v: v if isinstance(v, str) else json.dumps(v)
    zoo = {arch: [f"{k}={fmt(v)}" for k, v in recipe.items()] for arch, recipe in own.zoo.items()}
    return Settings(base, zoo, tuple(own.fast), own.max_marked_share, own.jobs)


@functools.cache
def settings() -> Settings:
    return load_settings()


def __getattr__(name: str):
    """ZOO, FAST, MAX_MARKED_SHARE: the default config's, read on first use."""
    fields = {"ZOO": "zoo", "FAST": "fast", "MAX_MARKED_SHARE": "max_marked_share"}
    if name in fields:
        return getattr(settings(), fields[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _headline(gate: dict) -> tuple[str, str]:
    """(observed, limit) of the check that decided the row: the first failing one, else the
    elementwise difference, else agreement, else the metric."""
    checks = [c for c in gate.get("checks", []) if c["name"] != "max_rel_diff"]
    bad = [c for c in checks if not c["passed"]]
    order = bad or sorted(checks, key=lambda c: (c["limit"] is None, c["name"] != "max_abs_diff",
                                                 "agreement" not in c["name"]))
    if not order:
        return "", ""
    c = order[0]
    fmt = (lambda v: "" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
    name = c["name"].replace("max_abs_diff", "|diff|")
    sign = "≤" if c["op"] == "<=" else "≥"
    return f"{name} {fmt(c['observed'])}", f"{sign} {fmt(c['limit'])}" if c["limit"] is not None else ""


def _chain(run_dir: Path) -> list[str]:
    """The stages this architecture's run went through (its task's chain in the catalogue)."""
    from pipeline.core.catalogue import for_task

    return for_task(rules.resolved_config(run_dir).get("task") or "classification")


def _stage_rows(arch: str, run_dir: Path, log_tail: str) -> list[Row]:
    rows: list[Row] = []
    near, cfg = rules.standing(run_dir), rules.resolved_config(run_dir)
    samples = int((load_manifest(run_dir / "train") or {}).get("info", {}).get("val_slice") or 0)
    for stage in _chain(run_dir):
        man = load_manifest(run_dir / stage) or load_manifest(run_dir / f"{stage}.failed")
        if man is None:
            # no manifest: the stage raised before its gates (FAIL, log as evidence) or was not run
            # because an input stage failed
            # (a MARKED row whose gate failed stopped the chain too: the stage after it did not fail, it never ran)
            upstream_failed = any(r.verdict in ("FAIL", "NOT RUN") or r.would_be == "FAIL" for r in rows)
            rows.append(Row(arch, stage, "NOT RUN" if upstream_failed else "FAIL",
                            note="an input stage failed" if upstream_failed else f"{log_tail} (log: {arch}/run.log)"))
            continue
        for g in man["gates"]:
            observed, limit = _headline(g)
            note = g.get("reason", "") if g["status"] != "OK" else ""
            coarse = rules.resolution(g, samples, cfg) if g["status"] in rules.EXECUTED and samples else ""
            verdict, note, was = rules.mark(g["status"], note, g.get("precision_requested", ""), near)
            note = "; ".join(filter(None, [note, coarse]))
            rows.append(Row(arch, f"{stage}: {g['subject']}", verdict, observed, limit, g.get("seconds"), note,
                            was, bool(coarse)))
    return rows


def _tail(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("W", "I1", "I0"))]
    return " | ".join(lines[-n:])


def run_group(cmd: list[str], env: dict, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of cmd in its own process group; on timeout the whole group is killed. `python -m pipeline
    run` is a supervisor over the stage process: killing only the supervisor left the stage running on, holding the
    run folder's lock and the cores (a timed-out mobilenet_v2 server stage finished 10 minutes after its row said
    timeout)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return out, f"{err}\ntimeout after {timeout:g}s"


def run_arch(arch: str, recipe: list[str], root: Path, extra: list[str], timeout: float, force: bool = False) -> list[Row]:
    """One architecture, isolated: its own subprocess, run folder and logs. Stages whose fingerprint (config, inputs,
    code, CPU kernels) is unchanged are reused, trained weights included; force re-runs every one."""
    overrides = [*recipe, f"run.root={root}", f"run.name={arch}", f"bundle.root={root / 'bundles'}",
                 "bundle.version=conformance", "run.quiet=true", *extra]
    cmd = [sys.executable, "-m", "pipeline", "run", "all", *(["--force"] if force else []), "-c", str(root / BASE_NAME)]
    for o in overrides:
        cmd += ["-o", o]
    log_dir = root / arch
    if force:
        for old in (log_dir, root / "bundles" / f"{arch}-conformance"):
            shutil.rmtree(old, ignore_errors=True)
        (root / "bundles" / f"{arch}-conformance.tar.gz").unlink(missing_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    out, err = run_group(cmd, env, timeout)
    atomic_write_text(log_dir / "run.log", f"$ {' '.join(cmd)}\n{out}\n--- stderr ---\n{err}")
    rows = _stage_rows(arch, log_dir, _tail(err))
    chain_ok = all(r.verdict in (*rules.PASSING, rules.MARKED) for r in rows)
    rows.insert(0, Row(arch, "chain (wall time)", "OK" if chain_ok else "FAIL", seconds=round(time.perf_counter() - t0, 1)))
    rows.append(_verify_row(arch, root / "bundles" / f"{arch}-conformance", env, log_dir))
    return rows


def _verify_row(arch: str, bundle: Path, env: dict, log_dir: Path) -> Row:
    if not bundle.is_dir():
        return Row(arch, "verify bundle", "NOT RUN", note="no bundle was written")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "verify", str(bundle)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    atomic_write_text(log_dir / "verify.log", proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    checks = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("ok")]
    return Row(arch, "verify bundle", "OK" if proc.returncode == 0 else "FAIL", f"{len(checks)} checks", "",
               round(time.perf_counter() - t0, 1), "" if proc.returncode == 0 else _tail(proc.stderr))


def render(rows: list[Row], console: Console | None = None) -> None:
    console = console or Console(width=160)
    table = Table(title="conformance: architecture × row (parity gates at their defaults)", show_lines=False)
    for col, just in (("architecture", "left"), ("row", "left"), ("verdict", "left"), ("observed", "right"),
                      ("limit", "right"), ("time s", "right")):
        table.add_column(col, justify=just)
    style = {"OK": "green", "FAIL": "bold red", "SKIPPED": "yellow", "UNVERIFIED": "cyan", "NOT RUN": "dim",
             MARKED: "magenta", "EXCLUDED": "magenta"}
    notes: list[str] = []
    last = None
    for r in rows:
        mark = ""
        if r.note and r.verdict != "OK":
            notes.append(f"[{len(notes) + 1}] {r.arch} {r.row}: {r.note}")
            mark = f" [{len(notes)}]"
        st = style.get(r.verdict)            # an unknown verdict prints plain: "[]X[/]" is a markup error
        verdict = f"[{st}]{escape(r.verdict)}[/]{mark}" if st else f"{escape(r.verdict)}{mark}"
        table.add_row(r.arch if r.arch != last else "", r.row, verdict,
                      r.observed, r.limit, "" if r.seconds is None else f"{r.seconds:.1f}",
                      end_section=False)
        last = r.arch
    console.print(table)
    for n in notes:
        console.print(n, highlight=False, soft_wrap=True, markup=False)


def markdown(rows: list[Row], standings: dict[str, str]) -> str:
    out = ["| architecture | fp32 against chance |", "|---|---|", *(f"| {a} | {s} |" for a, s in standings.items()), "",
           "| architecture | row | verdict | observed | limit | time s | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sec = "" if r.seconds is None else f"{r.seconds:.1f}"
        note = r.note.replace("|", "/")[:300]
        out.append(f"| {r.arch} | {r.row} | {r.verdict} | {r.observed} | {r.limit} | {sec} | {note} |")
    return "\n".join(out) + "\n"


def _standings(models: list[str], root: Path) -> dict[str, str]:
    """Each architecture's fp32 metric beside chance, the floor its low-precision rows need and its margin."""
    lines = {}
    for arch in models:
        st = rules.standing(root / arch)
        lines[arch] = (st.line() + (" NEAR CHANCE: its low-precision rows are MARKED" if st.near_chance else "")) \
            if st else "no fp32 Paddle Inference row with a metric"
    return lines


def run_side_by_side(models: list[str], zoo: dict[str, list[str]], root: Path, extra: list[str], timeout: float,
                     force: bool, jobs: int) -> list[list[Row]]:
    """Each architecture's rows, in the order of models, with up to `jobs` chains running at once (started in that
    order: the zoo lists the longest first, so the short ones fill in at the end). A chain's verdicts do not depend
    on what runs beside it: threads per process follow the layout, never the load (docs/training.md); its times do.
    One chain leaves a core idle outside training (export, server rows, Lite, bundle, verify run one process), which
    a second chain fills: docs/conformance.md."""
    def one(arch: str) -> list[Row]:
        say(f"[conformance] {arch} ...")
        t = time.perf_counter()
        rows = run_arch(arch, zoo[arch], root, extra, timeout, force)
        say(f"[conformance] {arch} done in {time.perf_counter() - t:.0f} s")
        return rows

    def say(line: str) -> None:         # one write per line: print() writes the newline apart, and threads interleave
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(models)))) as pool:
        return list(pool.map(one, models))


def run(models: list[str], root: Path, extra: list[str] | None = None, timeout: float = 1800, force: bool = False,
        max_marked_share: float | None = None, jobs: int | None = None) -> tuple[list[Row], int]:
    from pipeline.core.errors import ConfigError

    st = settings()
    unknown = [m for m in models if m not in st.zoo]
    if unknown:
        raise ConfigError(f"unknown conformance architecture(s): {', '.join(unknown)}", hint=f"choose from {', '.join(st.zoo)}")
    share = st.max_marked_share if max_marked_share is None else max_marked_share
    if not 0 <= share <= 1:
        raise ConfigError(f"max marked share {share:g} is not a share of rows", hint="pass a value from 0 to 1, e.g. 0.05")
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / BASE_NAME, yaml.safe_dump(st.base, sort_keys=False))
    jobs = st.jobs if jobs is None else jobs
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: at least one architecture must run at a time", hint="pass --jobs 1 or more")
    t0 = time.perf_counter()
    rows = [r for arch_rows in run_side_by_side(models, st.zoo, root, list(extra or []), timeout, force, jobs)
            for r in arch_rows]
    standings = _standings(models, root)
    counts = rules.verdict_counts(rows)
    code, why = rules.verdict(counts, share)
    write_json(root / "conformance.json", {"models": models, "extra_overrides": list(extra or []), "jobs": jobs,
                                           "max_marked_share": share, "standings": standings, "counts": counts,
                                           "seconds": round(time.perf_counter() - t0, 1),
                                           "rows": [asdict(r) for r in rows]})
    atomic_write_text(root / "conformance.md", markdown(rows, standings))
    render(rows)
    for arch, line in standings.items():
        print(f"{arch}: {line}", file=sys.stderr)
    print(f"conformance: {len(models)} architectures ({jobs} at a time), {len(rows)} rows in {time.perf_counter() - t0:.0f} s: "
          f"{rules.counts_line(counts)}; results in {root / 'conformance.md'}", file=sys.stderr)
    if why:
        print(f"conformance failed: {why}", file=sys.stderr)
    return rows, code


def main(args) -> int:
    from pipeline.core.config import split_overrides

    st = settings()
    models = [m for part in (args.models or []) for m in part.split(",") if m] or list(st.fast if args.fast else st.zoo)
    return run(models, Path(args.root), [*args.override, *split_overrides(args.overrides)], args.timeout, args.force,
               args.max_marked_share, args.jobs)[1]


def register(sub) -> None:
    p = sub.add_parser("conformance", help="whole chain over the architecture zoo; prints the verdict matrix")
    p.add_argument("--models", action="append", help="comma-separated subset of conformance.zoo in configs/conformance.yaml")
    p.add_argument("--fast", action="store_true", help="only conformance.fast (what make test runs)")
    p.add_argument("--root", default=str(ROOT / "runs" / "conformance"), help="run folders and results go here")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every architecture (repeatable)")
    p.add_argument("-O", "--overrides", default="", metavar="'K=V K2=V2'",
                   help="several overrides in one string (what `make conformance O=...` passes)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per architecture")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="architectures run side by side (default: conformance.jobs in configs/conformance.yaml)")
    p.add_argument("--force", action="store_true", help="re-run every stage (default: reuse those whose fingerprint "
                   "is unchanged, trained weights included)")
    p.add_argument("--max-marked-share", type=float, default=None, metavar="SHARE",
                   help="fail above this share of executed rows MARKED near chance (default: "
                        "conformance.max_marked_share in configs/conformance.yaml)")
    p.set_defaults(func=main)
