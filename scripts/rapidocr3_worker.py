"""RapidOCR 3.10 behind a pipe, for scripts/bench_ocr.py: runs in its own venv (`make rapidocr3-venv`; its
opencv-python-headless and numpy would overwrite the pipeline's), imports nothing of the pipeline.

Two instances on the same PP-OCRv4 ONNX models (RapidOCR 1.4.4's), OpenVINO, 1 thread:
  "f32":     INFERENCE_PRECISION_HINT f32 forced (RapidOCR exposes no precision setting: its OpenVINO CPU config
             is extended for this instance only);
  "shipped": RapidOCR's own OpenVINO config, as a user gets it (the CPU plugin's default: bf16 where the CPU has it).
Protocol (pickle frames on stdin/stdout): ("page" | "crop", mode, BGR uint8 array) -> (lines, seconds), lines =
[(4x2 box, text)] for a page, [text] for a crop; seconds = the OCR call alone, timed here (no pipe in it).
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time


def _instances(det: str, cls: str, rec: str, keys: str) -> dict:
    from rapidocr import EngineType, RapidOCR
    from rapidocr.inference_engine.openvino import device_config

    params = {"Global.log_level": "error", "EngineConfig.openvino.inference_num_threads": 1,
              "Det.model_path": det, "Cls.model_path": cls, "Rec.model_path": rec, "Rec.rec_keys_path": keys,
              **{f"{p}.engine_type": EngineType.OPENVINO for p in ("Det", "Cls", "Rec")}}
    plain = device_config.CPUConfig.get_config
    out = {}
    for mode in ("f32", "shipped"):
        if mode == "f32":
            device_config.CPUConfig.get_config = lambda self: {**plain(self), "INFERENCE_PRECISION_HINT": "f32"}
        else:
            device_config.CPUConfig.get_config = plain
        ocr = RapidOCR(params=params)
        # models load on first use: load them now, under this instance's config
        import numpy as np
        ocr(np.full((64, 256, 3), 255, np.uint8), use_det=True, use_cls=True, use_rec=True)
        ocr(np.full((48, 192, 3), 255, np.uint8), use_det=False, use_cls=True, use_rec=True)
        out[mode] = ocr
    device_config.CPUConfig.get_config = plain
    return out


def precision(ocr) -> dict:
    """What each OpenVINO model really runs (its runtime model's compute-op precisions), per part: the evidence
    that "shipped" is bf16 and "f32" is f32 on this CPU."""
    from collections import Counter

    out = {}
    for part in ("text_det", "text_cls", "text_rec"):
        compiled = getattr(ocr, part).session.session.get_compiled_model()
        seen = Counter()
        for op in compiled.get_runtime_model().get_ordered_ops():
            rt = op.get_rt_info()
            kind = rt["layerType"].astype(str) if "layerType" in rt else op.get_type_name()
            if kind in ("Convolution", "GroupConvolution", "MatMul", "FullyConnected"):
                seen[rt["runtimePrecision"].astype(str).lower() if "runtimePrecision" in rt else "unknown"] += 1
        out[part.split("_")[1]] = dict(seen)
    return out


def _call(ocr, what: str, img):
    t0 = time.perf_counter()
    if what == "page":
        res = ocr(img, use_det=True, use_cls=True, use_rec=True)      # the flags stick from call to call
        dt = time.perf_counter() - t0
        boxes = [] if res.boxes is None else [b.tolist() for b in res.boxes]
        return list(zip(boxes, list(res.txts or ()))), dt
    res = ocr(img, use_det=False, use_cls=True, use_rec=True)
    return list(res.txts or ()), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k in ("det", "cls", "rec", "keys"):
        ap.add_argument(f"--{k}", required=True)
    a = ap.parse_args()
    out = os.fdopen(os.dup(1), "wb")        # the protocol's own copy of stdout: library chatter goes to stderr
    os.dup2(2, 1)
    inst = _instances(a.det, a.cls, a.rec, a.keys)
    import rapidocr
    import openvino

    inp = sys.stdin.buffer
    pickle.dump(("ready", {"rapidocr": getattr(rapidocr, "__version__", "3.10.0"), "openvino": openvino.__version__,
                           "precision": {m: precision(o) for m, o in inst.items()}}), out)
    out.flush()
    while True:
        try:
            what, mode, img = pickle.load(inp)
        except EOFError:
            return 0
        try:
            pickle.dump(("ok", _call(inst[mode], what, img)), out)
        except Exception as exc:        # noqa: BLE001  (reported to the parent, which exits with it)
            pickle.dump(("error", f"{type(exc).__name__}: {exc}"), out)
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
