"""Tasks by name: what the stages ask for data, models, losses, metrics and decoding."""
from __future__ import annotations


def get_task(name: str):
    if name == "classification":
        from .classification import ClassificationTask
        return ClassificationTask()
    if name == "recognition":
        from .recognition import RecognitionTask
        return RecognitionTask()
    from ..errors import ConfigError
    raise ConfigError(f"unknown task '{name}'", hint="task: classification | recognition")
