"""Text detection and the OCR system: DB targets, DB post-processing, detection metric, crops, system."""

