"""Tasks by name: what the stages ask for data, models, losses, metrics and decoding.

Every task subclasses `base.Task` (the hooks it must and may provide, with defaults). Built-ins are listed in
BUILTIN; another task is added with `register_task` (docs/extending.md).
"""
from __future__ import annotations

from typing import Callable


def _classification(post):
    from pipeline.tasks.classification import ClassificationTask
    return ClassificationTask(post)


def _recognition(post):
    from pipeline.tasks.recognition import RecognitionTask
    return RecognitionTask(post)


def _detection(post):
    from pipeline.tasks.detection import DetectionTask
    return DetectionTask(post)


def _text_direction(post):
    from pipeline.tasks.text_direction import TextDirectionTask
    return TextDirectionTask(post)


# name -> factory(post) -> Task (imports inside: a run loads only its own task's code)
BUILTIN: dict[str, Callable] = {"classification": _classification, "recognition": _recognition,
                                "detection": _detection, "text_direction": _text_direction}
_REGISTERED: dict[str, Callable] = {}


def register_task(name: str, factory: Callable) -> None:
    """Add a task: factory(post: dict | None) -> a base.Task subclass instance. A built-in name cannot be taken."""
    if name in BUILTIN:
        raise ValueError(f"task {name!r} is built in; register another name")
    _REGISTERED[name] = factory


def task_names() -> list[str]:
    return [*BUILTIN, *_REGISTERED]


def get_task(name: str, post: dict | None = None):
    """`post`: the task's post-processing parameters (config section or infer_config's postprocess)."""
    factory = BUILTIN.get(name) or _REGISTERED.get(name)
    if factory is None:
        from pipeline.core.errors import ConfigError
        raise ConfigError(f"unknown task '{name}'", hint=f"task: {' | '.join(task_names())}")
    task = factory(post)
    from pipeline.tasks.base import Task
    if not isinstance(task, Task):
        raise TypeError(f"task {name!r}: its factory returned a {type(task).__name__}, not a pipeline.tasks.base.Task")
    return task
