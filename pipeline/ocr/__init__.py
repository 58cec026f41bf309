"""Text detection and the OCR system: DB targets, DB post-processing, detection metric, crops, system."""

# Files whose code changes a trained model or its metric: stages list them in code_deps, so editing
# the system flow or the /ocr service does not re-train every model.
TRAIN_DEPS = ("pipeline/ocr/db_targets.py", "pipeline/ocr/db_loss.py", "pipeline/ocr/db_post.py",
              "pipeline/ocr/det_metric.py", "pipeline/data/crop.py")
METRIC_DEPS = ("pipeline/ocr/db_post.py", "pipeline/ocr/det_metric.py")
