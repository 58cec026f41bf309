"""The OCR system straight from PaddleOCR's pretrained models (pipeline/ocr/ppocr_models.py), without bundles:
what `make bench-ocr` reads pages with when no system bundle is given, and what the real-model tests use.

Same flow (pipeline/ocr/system.read_pages), same engines (pipeline.engines.registry) and batching as `/ocr`;
the settings come from the detection config's `detection` section and the system config's `system` section.
Input sizes are PaddleOCR's: rec_image_shape [3, 48, 320] (dynamic width), cls_image_shape [3, 48, 192].
"""
from __future__ import annotations

from pathlib import Path

from pipeline.ocr.system import FLOW_DEFAULTS, SystemSpec

REC_SHAPE = (48, 320)       # PaddleOCR's rec_image_shape (height, base width)
CLS_SHAPE = (48, 192)       # PaddleOCR's cls_image_shape


def flow_of(system_section: dict) -> dict:
    """The flow settings of a `system` config section (the keys FLOW_DEFAULTS names)."""
    return {k: system_section[k] for k in FLOW_DEFAULTS if k in system_section}


def read_charset(keys_file: Path) -> str:
    """PaddleOCR's dictionary file plus its appended space (use_space_char): 6623 + 1 characters, blank is 0."""
    return "".join(line.rstrip("\r\n") for line in Path(keys_file).read_text(encoding="utf-8").splitlines(True)) + " "


def spec_from_configs(det_cfg, sys_cfg, keys_file: Path, use_cls: bool = True) -> SystemSpec:
    from pipeline.tasks.detection import DetectionTask

    task = DetectionTask(det_cfg.section("detection")["detection"])
    det = {"preprocess": task.preprocess_spec(det_cfg.section("data")["data"], {}),
           "postprocess": task.postprocess_spec({})}
    rec = {"preprocess": {"height": REC_SHAPE[0], "width": REC_SHAPE[1]},
           "postprocess": {"charset": read_charset(keys_file)}}
    cls = {"preprocess": {"height": CLS_SHAPE[0], "width": CLS_SHAPE[1]}} if use_cls else None
    return SystemSpec.from_infer_configs(det, rec, cls, flow_of(sys_cfg.section("system")["system"]))


def model_file(models: dict, role: str, kind: str, cache: Path) -> Path:
    """The fetched Paddle model's prefix, or its ONNX conversion (cached) for ONNX Runtime / OpenVINO."""
    prefix = Path(models[role]) / "inference"
    if kind == "paddle-inference":
        return prefix
    from pipeline.engines.onnx_export import export_onnx

    out = Path(cache) / f"{role}.onnx"
    return out if out.is_file() else export_onnx(prefix, out)


def engines(models: dict, kind: str, threads: int, cache: Path, use_cls: bool = True) -> tuple:
    """(det, rec, cls or None) engines of one runtime; ONNX Runtime's pool threads sleep between calls as in serve."""
    from pipeline.engines import registry
    from pipeline.core.errors import ConfigError

    if kind == "auto":      # a recommendation lives in each part's bundle; fetched models have none
        raise ConfigError("system.engine=auto serves each part's recommendation, which only a system bundle records",
                          hint="pass --bundle <system bundle> or --engine paddle-inference|onnxruntime|openvino")

    roles = ("det", "rec", "cls") if use_cls else ("det", "rec")
    made = [registry.make(kind, model_file(models, r, kind, cache), "fp32", threads=threads, spin=False)
            for r in roles]
    return (made[0], made[1], made[2] if use_cls else None)
