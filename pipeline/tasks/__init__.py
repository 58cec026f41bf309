"""Tasks by name: what the stages ask for data, models, losses, metrics and decoding."""
from __future__ import annotations


def get_task(name: str, post: dict | None = None):
    """`post`: the task's post-processing parameters (config section or infer_config's postprocess)."""
    if name == "classification":
        from pipeline.tasks.classification import ClassificationTask
        return ClassificationTask(post)
    if name == "recognition":
        from pipeline.tasks.recognition import RecognitionTask
        return RecognitionTask(post)
    if name == "detection":
        from pipeline.tasks.detection import DetectionTask
        return DetectionTask(post)
    if name == "text_direction":
        from pipeline.tasks.text_direction import TextDirectionTask
        return TextDirectionTask(post)
    from pipeline.core.errors import ConfigError
    raise ConfigError(f"unknown task '{name}'", hint="task: classification | recognition | detection | text_direction")
