"""Orders stages, checks their inputs, skips up-to-date ones, runs the rest atomically, records results.

The runner owns the bookkeeping (DVC-style fingerprints, manifests, temp-dir-then-rename);
a stage only reads ctx.inputs / ctx.cfg and writes into ctx.out_dir.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from pipeline.core import catalogue, code_closure, console, env, resources, runlock
from pipeline.core.capabilities import kernel_key
from pipeline.core.artifacts import (MANIFEST, describe_files, load_manifest, reads_limited, replace_dir, staged_dir,
                                     verify_outputs, write_json)
from pipeline.core.config import Config, save_resolved
from pipeline.core.errors import ConfigError, GateFailed, IntegrityError, MissingArtifact, PipelineError
from pipeline.core.gates import FAIL, OK, Gate
from pipeline.core.process_layout import is_auto
from pipeline.core.status import code_record
from pipeline.core.supervise import mark_stage

log = logging.getLogger("pipeline")
NATIVE_LOG = "native.log"      # runs/<name>/log/native.log


@dataclass
class StageResult:
    gates: list[Gate] = field(default_factory=list)
    precision: dict = field(default_factory=dict)     # {"requested": ..., "effective": ...}
    metrics: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


@dataclass
class StageContext:
    cfg: Config
    name: str
    out_dir: Path                 # temp folder; renamed into place when the stage succeeds
    work_dir: Path                # persistent scratch (checkpoints for resume), survives failures
    inputs: dict[str, Path]       # upstream stage name → its (verified) output folder
    input_manifests: dict[str, dict]
    fingerprint: str = ""
    force: bool = False

    @property
    def quiet(self) -> bool:
        return self.cfg.run.quiet

    def input(self, producer: str, rel: str = "") -> Path:
        """An upstream stage's output by its declared name (pipeline/core/catalogue.py), never a guessed path."""
        if rel:
            catalogue.check_output(producer, rel)
        return self.inputs[producer] / rel if rel else self.inputs[producer]


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]           # upstream stages whose outputs this one reads
    config_keys: tuple[str, ...]      # config sections that change the result (fingerprint)
    make_target: str                  # what users type to produce this stage's output
    run: Callable[[StageContext], StageResult]
    description: str = ""
    # the stage's code is its module's import closure (pipeline/core/code_closure.py); code_deps only adds
    # repo-relative non-Python files or folders its result depends on
    code_deps: tuple[str, ...] = ()
    # config keys that the resolved process layout (pipeline/core/process_layout.py) stands for: non-empty means the
    # layout enters the fingerprint in their place (train.nproc=auto and =2 are the same run on 2 cores)
    layout_keys: tuple[str, ...] = ()
    # outputs of *other runs* this stage reads (name → stage folder), e.g. the OCR system's two bundles;
    # checked, hashed and fingerprinted like inputs, and they must have passed their gates
    external_inputs: Callable[[Config], dict[str, Path]] | None = None
    # files (relative to the stage folder) other stages may read: `outputs` always exist after a pass,
    # `optional_outputs` only when the row that makes them ran (ctx.input refuses any other name)
    outputs: tuple[str, ...] = ()
    optional_outputs: tuple[str, ...] = ()
    applies_to: Callable[[str], bool] = lambda task: task != "ocr_system"    # which tasks run this stage
    # runs the stage as several processes (training: pipeline/distributed.launch_stage); the runner calls it
    # when the layout needs a launch, so the run core never imports the launcher
    launcher: Callable | None = None
    # its gates and timings hold for the CPU kernels they ran on (engines' bf16/int8/vector families): a cached
    # result from a host with other kernels is not reused (capabilities.kernel_key enters the fingerprint);
    # a callable decides per config (train: only when bf16 AMP runs the CPU's bf16 kernels)
    machine_bound: bool | Callable[[Config], bool] = False

    def bound_to_machine(self, cfg: Config) -> bool:
        return bool(self.machine_bound(cfg) if callable(self.machine_bound) else self.machine_bound)


@dataclass
class Outcome:
    stage: str
    status: str                       # OK | FAIL | CACHED | ERROR | NOT RUN
    manifest: dict | None = None
    error: PipelineError | None = None
    seconds: float = 0.0


def registry() -> dict[str, Stage]:
    """Every stage in dependency order (the catalogue, pipeline/core/catalogue.py)."""
    return catalogue.stages()


def code_files(stage: Stage) -> list[Path]:
    """The code a stage's result depends on: its module's import closure over pipeline/ and stages/
    (pipeline/core/code_closure.py: derived, never listed by hand; reporting and CLI code left out) plus
    `code_deps`, non-Python files it reads. Editing any of them re-runs the stage; editing code it cannot reach (the
    CLI, reports, another stage's libraries) does not invalidate a 4-minute training."""
    root = code_closure.ROOT
    mod = sys.modules.get(stage.run.__module__)
    start = Path(mod.__file__) if mod and getattr(mod, "__file__", None) else None
    files = list(code_closure.closure(start)) if start else []
    for dep in stage.code_deps:
        p = root / dep
        files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return sorted(set(files))


def _code_hash(stage: Stage) -> str:
    h = hashlib.sha256()
    root = code_closure.ROOT
    for f in code_files(stage):
        h.update(f.relative_to(root).as_posix().encode() if f.is_relative_to(root) else b"")
        h.update(code_closure.file_digest(f))
    return h.hexdigest()[:16]


def fingerprint(cfg: Config, stage: Stage, input_manifests: dict[str, dict], layout: dict | None = None) -> str:
    """Config section + input hashes + code, and for layout-keyed stages the process layout (Layout.key())."""
    config = cfg.section(*stage.config_keys)
    for dotted in stage.layout_keys:
        *path, last = dotted.split(".")
        node = config
        for part in path:
            node = node.get(part, {})
        node.pop(last, None)
    blob = {
        "stage": stage.name,
        "config": config,
        "inputs": {k: {f: m["sha256"] for f, m in v.get("outputs", {}).items()} for k, v in input_manifests.items()},
        "code": _code_hash(stage),
    }
    if stage.layout_keys:
        blob["layout"] = layout
    if stage.bound_to_machine(cfg):
        blob["kernels"] = kernel_key()
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _other_kernels(stage: Stage, manifest: dict) -> str:
    """What differs between the kernels a machine-bound stage's output was measured on and this host's
    ("bf16 amx_bf16 -> avx512_bf16"); "" when they are the same, or the stage holds on any CPU."""
    theirs, mine = manifest.get("kernels"), kernel_key()
    if not theirs:          # recorded only by a stage that was machine-bound for its config
        return ""
    return ", ".join(f"{k} {theirs.get(k)} -> {v}" for k, v in mine.items() if theirs.get(k) != v)


def _not_ours(*folders: Path) -> Path | None:
    """The first of the folders that exists without a manifest file: something a user put there."""
    return next((f for f in folders if (f.exists() or f.is_symlink()) and not (f / MANIFEST).is_file()), None)


class Runner:
    def __init__(self, cfg: Config, force: bool = False, layout=None):
        self.cfg = cfg
        self.force = force
        self.stages = registry()
        self.run_dir = cfg.run_dir
        self.layout = layout          # pipeline.core.process_layout.Layout; None: planned from the config when needed

    @property
    def native_log(self) -> Path:
        return self.run_dir / "log" / NATIVE_LOG

    def _layout(self):
        if self.layout is None:
            from pipeline.core.process_layout import plan
            self.layout = plan(self.cfg)
        return self.layout

    def resolve(self, names: list[str]) -> list[Stage]:
        """Stage names or aliases (all, deploy) -> the stages of this config's task, in dependency order."""
        return [self.stages[n] for n in catalogue.expand(names, self.cfg.task)]

    def _inputs(self, stage: Stage) -> tuple[dict[str, Path], dict[str, dict]]:
        dirs, manifests = {}, {}
        for dep in stage.inputs:
            folder = self.run_dir / dep
            man = load_manifest(folder)
            maker = self.stages[dep].make_target
            if man is None:
                failed = load_manifest(self.run_dir / f"{dep}.failed")
                why = "failed its gates (see the summary)" if failed else "has not been produced"
                raise MissingArtifact(f"{stage.name} needs the '{dep}' output at {folder}, which {why}",
                                      hint=f"run `make {maker}` first (same CONFIG)")
            verify_outputs(folder, man)
            if man.get("fingerprint") != self._expected_fingerprint(self.stages[dep]):
                changed = _other_kernels(self.stages[dep], man)
                why = f"other CPU kernels ({changed})" if changed else "another config or code version"
                raise MissingArtifact(f"{stage.name} needs the '{dep}' output at {folder}, but it was made with "
                                      f"{why} (stale)", hint=f"run `make {maker}` first (same CONFIG)")
            dirs[dep], manifests[dep] = folder, man
        for dep, folder in (stage.external_inputs(self.cfg) if stage.external_inputs else {}).items():
            man = load_manifest(folder)
            if man is None or man.get("status") != OK:
                raise MissingArtifact(f"{stage.name} needs the gated '{dep}' output at {folder}, which has not "
                                      "been produced or did not pass its gates",
                                      hint="run `make train export deploy` with the same CONFIG first")
            verify_outputs(folder, man)
            dirs[dep], manifests[dep] = folder, man
        return dirs, manifests

    def _expected_fingerprint(self, stage: Stage) -> str | None:
        """What `stage` would fingerprint to now, given the outputs its own inputs have on disk
        (and the process layout it recorded: any layout is a valid producer for downstream stages)."""
        manifests = {}
        for dep in stage.inputs:
            man = load_manifest(self.run_dir / dep)
            if man is None:
                return None
            manifests[dep] = man
        own = load_manifest(self.run_dir / stage.name) or {}
        return fingerprint(self.cfg, stage, manifests, own.get("layout_key"))

    @runlock.exclusive          # one writer per run folder; its own file-system errors as one line
    def run(self, names: list[str]) -> list[Outcome]:
        chain = self.resolve(names)           # unknown or inapplicable stages: refused before any folder exists
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resolved = self.run_dir / "config.resolved.yaml"
        if not resolved.exists():         # a fresh folder: nothing good to protect yet
            save_resolved(self.cfg, resolved)
        outcomes: list[Outcome] = []
        for stage in chain:
            if any(o.status in (FAIL, "ERROR", "NOT RUN") and o.stage in stage.inputs for o in outcomes):
                outcomes.append(Outcome(stage.name, "NOT RUN",
                                        error=MissingArtifact(f"{stage.name} not run: an input stage failed")))
                continue
            # what Paddle, oneDNN, OpenVINO, NNCF and child processes print natively: the run's log, not the console
            with console.native_output_to(self.native_log, stage.name):
                outcomes.append(self._run_one(stage))
        if all(o.status in (OK, "CACHED") for o in outcomes):
            # the run-level copy describes the artifacts beside it: a failed run must not overwrite it
            # (each stage folder, and each <stage>.failed, holds the config it really ran with)
            save_resolved(self.cfg, resolved)
        return outcomes

    def _run_one(self, stage: Stage) -> Outcome:
        t0 = time.time()
        try:
            dirs, manifests = self._inputs(stage)
            layout = self._layout() if stage.layout_keys else None
        except PipelineError as exc:
            return Outcome(stage.name, "ERROR", error=exc)
        fp = fingerprint(self.cfg, stage, manifests, layout.key() if layout else None)
        final = self.run_dir / stage.name
        # several nodes: their rank 0 on node 0 decides for all (run folders may differ between nodes)
        current = None if layout is not None and layout.needs_launch and layout.nnodes > 1 else \
            self.up_to_date(stage, manifests, layout, fp)
        if current is not None:
            log.info("[%s] up to date (fingerprint %s), skipped; FORCE=1 re-runs it", stage.name, current["fingerprint"])
            return Outcome(stage.name, "CACHED", manifest=current, seconds=time.time() - t0)
        foreign = _not_ours(final, self.run_dir / f"{stage.name}.failed")
        if foreign is not None:          # never replace (or delete) a folder this pipeline did not write
            return Outcome(stage.name, "ERROR", seconds=time.time() - t0, error=IntegrityError(
                f"{foreign} exists but was not made by this pipeline (no {MANIFEST}): the {stage.name} stage would "
                "replace it", hint="move it away, or give this run another run.name"))
        if layout is not None and layout.needs_launch:
            return self._launched(stage, layout, t0)
        for leftover in self.run_dir.glob(f".tmp-{stage.name}-*"):   # from a kill -9 mid-stage
            shutil.rmtree(leftover, ignore_errors=True)
        work = self.run_dir / ".work" / stage.name
        work.mkdir(parents=True, exist_ok=True)
        log.info("[%s] running (%s)", stage.name, stage.description or stage.name)
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        mark_stage(stage.name)
        resources.release_memory()          # earlier stages' freed heap: not this stage's, and not for it to carry
        per_stage_peak = resources.reset_peak()
        try:
            with staged_dir(final) as tmp:
                ctx = StageContext(self.cfg, stage.name, tmp, work, dirs, manifests, fp, self.force)
                with reads_limited(stage.name, self._readable(stage, dirs)):
                    result = stage.run(ctx)
                self._check_declarations(stage, tmp, result)
                save_resolved(self.cfg, tmp / "config.resolved.yaml")     # the config these outputs came from
                manifest = self._manifest(stage, fp, manifests, tmp, result, started, time.time() - t0)
                manifest["resources"] = resources.peak_record(per_stage_peak)
                if layout is not None:
                    manifest["layout_key"], manifest["info"]["layout"] = layout.key(), layout.record()
                write_json(tmp / MANIFEST, manifest)
                if manifest["status"] == FAIL:
                    # keep the evidence beside, never in place of, the last good output
                    replace_dir(tmp, self.run_dir / f"{stage.name}.failed")
                    tmp.mkdir()   # staged_dir swaps an empty folder in only on success; see below
                    raise _GateFail(manifest)
        except _GateFail as gf:
            return self._gate_fail(stage, gf.manifest, t0)
        except PipelineError as exc:
            return Outcome(stage.name, "ERROR", error=exc, seconds=time.time() - t0)
        except OSError as exc:          # read-only, full, no permission: the staged output was removed
            return Outcome(stage.name, "ERROR", error=runlock.storage_error(stage.name, exc, folder=final), seconds=time.time() - t0)
        shutil.rmtree(self.run_dir / f"{stage.name}.failed", ignore_errors=True)
        return Outcome(stage.name, OK, manifest=manifest, seconds=time.time() - t0)

    def _readable(self, stage: Stage, dirs: dict[str, Path]) -> dict:
        """{producer: (its folder, may this file be read?)}: a stage reads another stage's declared outputs and its
        records of the run (manifest, resolved config), nothing else (external inputs, other runs' bundles, are
        checked by their own manifests)."""
        def allowed(producer: str):
            return lambda rel: rel in (MANIFEST, "config.resolved.yaml") or catalogue.declares(self.stages[producer], rel)
        return {dep: (dirs[dep], allowed(dep)) for dep in stage.inputs if dep in dirs}

    @staticmethod
    def _check_declarations(stage: Stage, folder: Path, result: StageResult) -> None:
        """A passing stage wrote every declared output, and every file it wrote is declared (the catalogue is the one
        list of what a stage makes; the next stage may read only that)."""
        if any(g.status == FAIL for g in result.gates):
            return          # a failed stage's folder is evidence, kept as it is
        missing = catalogue.missing_outputs(stage, folder)
        if missing:
            raise IntegrityError(f"the {stage.name} stage passed but did not write its declared output "
                                 f"'{missing[0]}'", hint="a bug in the stage: its STAGE.outputs and its writes disagree")
        extra = catalogue.undeclared_outputs(stage, folder)
        if extra:
            raise IntegrityError(f"the {stage.name} stage wrote '{extra[0]}', which its STAGE declaration does not name"
                                 + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                                 hint="a bug in the stage: add it to STAGE.outputs / optional_outputs")

    def up_to_date(self, stage: Stage, manifests: dict, layout, fp: str) -> dict | None:
        """The current output's manifest if it may be reused (verified on disk), else None."""
        current = load_manifest(self.run_dir / stage.name)
        if not current or self.force or current.get("status") != OK:
            return None
        accepted = {fp}
        if layout is not None and is_auto(layout.record()) and is_auto(current.get("info", {}).get("layout")):
            # auto picks the layout from the machine (cores, GPUs, threads); any layout auto picked satisfies
            # auto (same config, code and inputs; results equal within noise)
            accepted.add(fingerprint(self.cfg, stage, manifests, current.get("layout_key")))
        if current.get("fingerprint") not in accepted:
            changed = _other_kernels(stage, current)
            if changed:
                log.info("[%s] measured on a CPU with other kernels (%s); re-running on this one", stage.name, changed)
            return None
        try:
            verify_outputs(self.run_dir / stage.name, current)
        except IntegrityError as exc:
            log.warning("[%s] cached output is damaged (%s); re-running", stage.name, exc.message)
            return None
        return current

    def _gate_fail(self, stage: Stage, manifest: dict, t0: float) -> Outcome:
        first = next(Gate.from_dict(g) for g in manifest["gates"] if g["status"] == FAIL)
        return Outcome(stage.name, FAIL, manifest=manifest, seconds=time.time() - t0,
                       error=GateFailed(first.failure_line(),
                                        hint=f"details in {self.run_dir / (stage.name + '.failed') / MANIFEST}"))

    def _launched(self, stage: Stage, layout, t0: float) -> Outcome:
        """Run the stage in processes (paddle.distributed.launch); rank 0 runs a Runner that writes the
        output and manifest; this parent turns rank 0's status into the same Outcome as in-process."""
        if stage.launcher is None:
            return Outcome(stage.name, "ERROR", seconds=time.time() - t0,
                           error=ConfigError(f"the {stage.name} stage cannot run as {layout.nproc} processes",
                                             hint="set train.nproc=1"))
        try:
            status = stage.launcher(self.cfg, stage.name, layout, self.force)
        except PipelineError as exc:
            return Outcome(stage.name, "ERROR", error=exc, seconds=time.time() - t0)
        if status is None:            # another node's rank 0 wrote the outputs, on its own disk
            log.info("[%s] this node's ranks finished; rank 0 on node 0 writes the outputs and the manifest", stage.name)
            return Outcome(stage.name, "OK (node 0 writes)", seconds=time.time() - t0)
        state = status["status"]
        if state == FAIL:
            return self._gate_fail(stage, load_manifest(self.run_dir / f"{stage.name}.failed"), t0)
        if state in (OK, "CACHED"):
            return Outcome(stage.name, state, manifest=load_manifest(self.run_dir / stage.name),
                           seconds=time.time() - t0)
        error = PipelineError(status.get("error") or f"{stage.name} failed on rank 0")
        error.exit_code = int(status.get("exit_code") or 1)
        return Outcome(stage.name, state, error=error, seconds=time.time() - t0)

    def _manifest(self, stage: Stage, fp: str, inputs: dict[str, dict], out: Path, result: StageResult,
                  started: str, seconds: float) -> dict:
        if not any(g.status in (OK, FAIL) for g in result.gates):   # SKIPPED/UNVERIFIED rows checked nothing
            result.gates.append(Gate(stage.name, "at least one executed gate", "", "none", "", status=FAIL,
                                     reason=f"the {stage.name} stage has no executed gate: it ran no check on its "
                                            "output, and a stage that checked nothing cannot pass"))
        status = FAIL if any(g.status == FAIL for g in result.gates) else OK
        return {
            "stage": stage.name,
            "status": status,
            "fingerprint": fp,
            "config_hash": self.cfg.hash_of(*stage.config_keys),
            "config": self.cfg.section(*stage.config_keys),
            "inputs": {k: {f: m["sha256"] for f, m in v.get("outputs", {}).items()} for k, v in inputs.items()},
            "outputs": describe_files(out, exclude=(MANIFEST, "config.resolved.yaml")),   # records, not outputs
            "precision": result.precision,
            "metrics": result.metrics,
            "gates": [g.to_dict() for g in result.gates],
            "info": result.info,
            "versions": env.versions(),
            "cpu_tuning": env.tuning_record(),
            **({"kernels": kernel_key()} if stage.bound_to_machine(self.cfg) else {}),
            "code": code_record(code_files(stage)),     # per-file digests: `pipeline status` names an edited file
            "started": started,
            "duration_s": round(seconds, 2),
        }


class _GateFail(Exception):
    def __init__(self, manifest: dict):
        super().__init__(manifest["stage"])
        self.manifest = manifest
