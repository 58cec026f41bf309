"""The stage catalogue: every stage, what it reads and writes, and which tasks it applies to, in one place.

Stages are registered from above: the `stages` package lists its modules and calls `register` when it is
imported (`python -m pipeline`, the rank entry and the tests import it), so this bottom package never reaches the
top one. They are ordered by their declared inputs (Kedro/DVC style: the graph, not a hand-written list, gives
the order). Everything that needs a
list of stages asks here: `run all` / `run deploy`, nightly, compare, accept, conformance, the summary,
the bundle's gate sources and the Makefile (`python -m pipeline stages`).
"""
from __future__ import annotations

import fnmatch
from functools import lru_cache

from pipeline.core.artifacts import MANIFEST
from pipeline.core.errors import ConfigError, MissingArtifact, PipelineError

# what users type (make targets / CLI aliases) -> the make_target of the stages it runs
ALIASES = {"all": None, "deploy": "deploy"}


_REGISTERED: dict = {}       # name -> Stage, as registered (stages/__init__.py)


def register(*declared) -> None:
    """Add stages (pipeline.core.runner.Stage) to the catalogue; a stage registered again under its name (a
    reloaded module) replaces the earlier one."""
    for stage in declared:
        _REGISTERED[stage.name] = stage
    stages.cache_clear()


@lru_cache(maxsize=1)
def stages() -> dict:
    """name -> Stage, in dependency order (inputs before the stages that read them)."""
    if not _REGISTERED:
        raise PipelineError("the stage catalogue is empty: no stage has been registered",
                            hint="import the `stages` package first (python -m pipeline and tests/conftest.py do)")
    return _topological(dict(_REGISTERED))


def _topological(found: dict) -> dict:
    """Order by declared inputs; ties keep a stable order (fewest transitive inputs first, then name)."""
    for s in found.values():
        unknown = [d for d in s.inputs if d not in found]
        if unknown:
            raise MissingArtifact(f"stage '{s.name}' declares input '{unknown[0]}', which no stage produces",
                                  hint=f"stages: {', '.join(sorted(found))}")
    depth: dict[str, int] = {}

    def level(name: str, seen: tuple = ()) -> int:
        if name in seen:
            raise ConfigError(f"stage inputs form a cycle: {' -> '.join((*seen, name))}")
        if name not in depth:
            depth[name] = 1 + max((level(d, (*seen, name)) for d in found[name].inputs), default=-1)
        return depth[name]

    # a stage that reads other runs' published outputs (the OCR system joins two bundles) comes after
    # every stage of a single run
    last = 1 + max((level(n) for n, s in found.items() if s.external_inputs is None), default=0)
    key = {n: (level(n) if s.external_inputs is None else last + level(n), n) for n, s in found.items()}
    return {n: found[n] for n in sorted(found, key=key.get)}


def for_task(task: str) -> list[str]:
    """The chain a run of `task` goes through, in order."""
    return [n for n, s in stages().items() if s.applies_to(task)]


def expand(names: list[str], task: str) -> list[str]:
    """CLI stage arguments (names or aliases) -> stage names for this task, in order, without duplicates.
    An explicitly named stage that does not apply to the task is refused with the stages that do."""
    chain = for_task(task)
    wanted: list[str] = []
    for name in names:
        if name in ALIASES:
            target = ALIASES[name]
            wanted += [n for n in chain if target is None or stages()[n].make_target == target]
            continue
        if name not in stages():
            import difflib
            close = difflib.get_close_matches(name, [*stages(), *ALIASES], n=1)
            raise ConfigError(f"unknown stage '{name}'", hint=f"did you mean '{close[0]}'?" if close else
                              f"stages: {', '.join(stages())}; aliases: {', '.join(ALIASES)}")
        if name not in chain:
            raise ConfigError(f"the {name} stage does not apply to task: {task}",
                              hint=f"stages of a {task} run: {', '.join(chain)}")
        wanted.append(name)
    return [n for n in chain if n in wanted]


# files every stage folder holds that are records, not outputs: no stage reads another's (the runner writes the first
# two; evidence/ keeps a crashed row's traceback)
RECORDS = (MANIFEST, "config.resolved.yaml", "evidence/*")


def declares(stage, rel: str) -> bool:
    """Is `rel` (POSIX, relative to the stage folder) one of the stage's declared outputs: a pattern it matches
    (fnmatch: `*` spans folders), or a file inside a declared folder ("models/int8" declares models/int8/model.pdmodel)?"""
    return any(fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern.rstrip("/") + "/")
               for pattern in (*stage.outputs, *stage.optional_outputs))


def check_output(producer: str, rel: str) -> None:
    """A stage may read another stage's file only under a name that stage declares (catalogue discipline)."""
    stage = stages()[producer]
    if not declares(stage, rel):
        raise MissingArtifact(f"'{rel}' is not a declared output of the {producer} stage",
                              hint=f"declared: {', '.join((*stage.outputs, *stage.optional_outputs))}; a stage "
                                   f"reads only what another declares (STAGE.outputs / optional_outputs)")


def missing_outputs(stage, folder) -> list[str]:
    """Declared (non-optional) outputs a finished stage folder lacks: a stage must write what it promises."""
    return [rel for rel in stage.outputs if not (folder / rel).exists()]


def undeclared_outputs(stage, folder) -> list[str]:
    """Files a finished stage folder holds that its declaration does not name: every file a stage writes is declared,
    so the next stage can read it and the catalogue shows it."""
    files = (p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file())
    return [rel for rel in files if not declares(stage, rel)
            and not any(fnmatch.fnmatchcase(rel, pattern) for pattern in RECORDS)]


def describe() -> list[dict]:
    """For `python -m pipeline stages` (and the README): the graph as data."""
    from typing import get_args

    from pipeline.core.config import Config

    tasks = get_args(Config.model_fields["task"].annotation)
    return [{"name": n, "inputs": list(s.inputs), "outputs": list(s.outputs), "optional": list(s.optional_outputs),
             "make": s.make_target, "tasks": [t for t in tasks if s.applies_to(t)], "description": s.description}
            for n, s in stages().items()]
