"""`python -m pipeline status`: which stages the next run would re-run, and why (DVC's `dvc status` question).

The answer is the runner's own rule (Runner.up_to_date: fingerprint of config section, input hashes, code closure,
kernels, process layout; outputs re-hashed), so a stage listed "up to date" is one the next run skips. The why is
read from what the output recorded: its config section, its inputs' hashes and, since manifests keep them, each code
file's digest, so an edit shows by file name (e.g. "code: pipeline/engines/ov.py").
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.core import code_closure
from pipeline.core.artifacts import load_manifest
from pipeline.core.gates import OK

UP_TO_DATE, STALE, NOT_RUN, FAILED, WAITS = "up to date", "re-runs", "not run", "failed", "after its inputs"


@dataclass
class StageState:
    run: str
    stage: str
    state: str
    why: str = ""


def code_record(files: list[Path]) -> dict[str, str]:
    """{repository-relative path: digest} of a stage's code files, kept in its manifest (what status compares)."""
    root = code_closure.ROOT
    return {(f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name): code_closure.file_digest(f).hex()[:16]
            for f in files}


def _changed(old: dict, new: dict, limit: int = 4) -> list[str]:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return keys[:limit] + ([f"+{len(keys) - limit} more"] if len(keys) > limit else [])


def _config_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose value differs between two config sections (leaves, for the why)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def _why(runner, stage, man: dict, inputs: dict) -> str:
    from pipeline.core.runner import _other_kernels, code_files

    why = []
    keys = _config_keys(man.get("config") or {}, runner.cfg.section(*stage.config_keys))
    if keys:
        why.append("config: " + ", ".join(keys[:4]) + (f" +{len(keys) - 4} more" if len(keys) > 4 else ""))
    if "code" in man:
        files = _changed(man["code"], code_record(code_files(stage)))
        if files:
            why.append("code: " + ", ".join(files))
    moved = [d for d, m in inputs.items()
             if man.get("inputs", {}).get(d) != {f: x["sha256"] for f, x in m.get("outputs", {}).items()}]
    if moved:
        why.append("inputs: " + ", ".join(f"{d}'s outputs changed" for d in moved))
    kernels = _other_kernels(stage, man)
    if kernels:
        why.append(f"other CPU kernels ({kernels})")
    if not why:
        why.append("code or process layout (this output predates per-file code records)" if "code" not in man
                   else "process layout")
    return "; ".join(why)


def stage_state(runner, stage, run: str, stale: set[str]) -> StageState:
    """One stage as the next run of `runner` would treat it; stale: stages of this run that will re-run first."""
    from pipeline.core.runner import fingerprint

    folder = runner.run_dir / stage.name
    man = load_manifest(folder)
    if man is None:
        failed = (runner.run_dir / f"{stage.name}.failed").is_dir()
        return StageState(run, stage.name, FAILED if failed else NOT_RUN,
                          "its last run failed its gates (kept beside as .failed)" if failed else "no output yet")
    if man.get("status") != OK:
        return StageState(run, stage.name, FAILED, "its output did not pass its gates")
    waits = [d for d in stage.inputs if d in stale]
    if waits:
        return StageState(run, stage.name, WAITS, ", ".join(waits) + " run first; this stage re-runs when their "
                          "new outputs differ (byte-identical outputs keep it)")
    inputs = {d: load_manifest(runner.run_dir / d) or {} for d in stage.inputs}
    external = stage.external_inputs(runner.cfg) if stage.external_inputs else {}
    inputs.update({d: load_manifest(Path(f)) or {} for d, f in external.items()})
    layout = runner._layout() if stage.layout_keys else None
    fp = fingerprint(runner.cfg, stage, inputs, layout.key() if layout else None)
    if runner.up_to_date(stage, inputs, layout, fp) is not None:
        return StageState(run, stage.name, UP_TO_DATE, f"fingerprint {fp}")
    return StageState(run, stage.name, STALE, _why(runner, stage, man, inputs))


def run_states(cfg, names: list[str], run: str, waits_for: str = "") -> list[StageState]:
    """The stages `names` of one run folder in run order; waits_for: an earlier run that re-runs first and feeds
    these stages (an OCR system's part, whose bundle the system stage reads)."""
    from pipeline.core.runner import Runner

    runner = Runner(cfg)
    out, stale = [], set()
    for stage in runner.resolve(names):
        st = stage_state(runner, stage, run, stale)
        if waits_for and st.state == UP_TO_DATE:
            st = StageState(run, stage.name, WAITS, f"{waits_for} run first; re-runs when a part bundle changes")
        if st.state != UP_TO_DATE:
            stale.add(stage.name)
        out.append(st)
    return out


def states(cfg, names: list[str]) -> list[StageState]:
    """Every stage `run names` would go through, parts first for an OCR system config (pipeline/core/composite.py)."""
    from pipeline.core import catalogue
    from pipeline.core.composite import part_stages

    if cfg.task != "ocr_system":
        return run_states(cfg, catalogue.expand(names, cfg.task), cfg.run.name)
    out = []
    for _, part, part_names in part_stages(cfg, names):
        out += run_states(part, part_names, part.run.name) if part_names else []
    system = catalogue.expand(["all"], cfg.task)
    if set(names) & {"all", "deploy", "bundle", *system}:
        moved = sorted({s.run for s in out if s.state != UP_TO_DATE})
        out += run_states(cfg, system, cfg.run.name, waits_for=", ".join(moved))
    return out
