"""A system config (task: ocr_system) drives two ordinary runs and then the `system` stage.

`make train export deploy CONFIG=configs/ocr_system.yaml` runs the requested stages of the
detection part, then of the recognition part (each an ordinary, separately gated run in its own
run folder), and, once bundles are asked for, the `system` stage that joins the two published
bundles. The parts share the system config's run.root/run.quiet/run.threads/bundle.root (and train.nproc
when set, e.g. by NPROC=N), so a test that moves the system run moves its parts too.
"""
from __future__ import annotations

import logging
from pathlib import Path

from pipeline.core import catalogue
from pipeline.core.config import ROOT, Config, load_config
from pipeline.core.errors import ConfigError

log = logging.getLogger("pipeline")

PARTS = {"detection": "detection", "recognition": "recognition", "classifier": "text_direction"}  # role → task
OPTIONAL = ("classifier",)          # the 0/180 direction classifier runs only when system.classifier names it


def _config_path(p: str) -> Path:
    path = Path(p)
    if path.is_absolute() or path.is_file():
        return path
    return ROOT / path            # configs/... relative to the repository, whatever the cwd


def part_configs(cfg: Config) -> dict[str, Config]:
    """role → the part's resolved Config."""
    if cfg.task != "ocr_system":
        raise ConfigError(f"the system stage needs task: ocr_system, got task: {cfg.task}",
                          hint="use CONFIG=configs/ocr_system.yaml")
    sc = cfg.system
    shared = [f"run.root={cfg.run.root}", f"run.quiet={str(cfg.run.quiet).lower()}",
              f"run.threads={cfg.run.threads}", f"bundle.root={cfg.bundle.root}"]
    if str(cfg.train.nproc) != "auto":      # `make train NPROC=N CONFIG=configs/ocr_system.yaml` lays out both parts
        shared.append(f"train.nproc={cfg.train.nproc}")
    out = {}
    for role, task in PARTS.items():
        path = getattr(sc, role)
        if not path and role in OPTIONAL:
            continue
        if not path:
            raise ConfigError(f"system.{role} is empty: the OCR system needs a {role} config",
                              hint=f"e.g. system.{role}=configs/ocr_{role[:3]}.yaml")
        part = load_config([_config_path(path)], shared + list(getattr(sc, f"{role}_overrides")))
        if part.task != task:
            raise ConfigError(f"system.{role} ({path}) has task: {part.task}, expected {task}")
        if part.run.name == cfg.run.name:
            raise ConfigError(f"system.{role} ({path}) uses run.name {part.run.name!r}, the system's own run name",
                              hint="give the part its own run.name")
        out[role] = part
    return out


def part_stages(cfg: Config, requested: list[str]) -> list[tuple[str, Config, list[str]]]:
    """(role, part config, the stages `requested` means for its task, e.g. `all`), in run order."""
    system = catalogue.expand(["all"], cfg.task)          # the stages of the system task itself
    names = [n for n in requested if n not in system]
    return [(role, part, catalogue.expand(names, part.task) if names else [])
            for role, part in part_configs(cfg).items()]


def run_system(cfg: Config, requested: list[str], force: bool, run_stages, run_part=None) -> int:
    """Run the parts' stages (what `requested` means for each part's task, e.g. `all`), then `system`
    when bundles were requested. run_part(role, stage names) -> exit code runs a part elsewhere (the CLI: in its
    own process, so what one model's stages leave in the heap, allocator caches and oneDNN's primitive cache is
    gone before the next model starts: the v4 rec server stage read 4.19 GB after the detector, 2.81 GB alone);
    without it the parts run in this process."""
    system = catalogue.expand(["all"], cfg.task)
    for role, part, part_names in part_stages(cfg, requested):
        if part_names:
            log.info("[system] %s part: %s into %s", role, " ".join(part_names), part.run_dir)
            code = run_part(role, part_names) if run_part else run_stages(part, part_names, force)[1]
            if code:
                return code
    if set(requested) & {"all", "deploy", "bundle", *system}:
        return run_stages(cfg, system, force)[1]
    return 0
