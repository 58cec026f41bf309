"""RapidOCR 3.10 behind a pipe, for scripts/bench_ocr.py and scripts/bench_ocr_all.py: runs in its own venv
(`make rapidocr3-venv`; its opencv-python-headless and numpy would overwrite the pipeline's), imports nothing of the
pipeline.

Models: --det/--cls/--rec/--keys (bench_ocr: RapidOCR 1.4.4's PP-OCRv4 ONNX files), or none: RapidOCR 3.10's own, as
shipped (PP-OCRv6 small det/rec, mobile v2 cls, from its wheel). One instance per --modes entry, 1 thread each:
  "onnxruntime":  RapidOCR's default engine and config, as a user gets it;
  "openvino-f32": OpenVINO with INFERENCE_PRECISION_HINT f32 forced (RapidOCR exposes no precision setting: its
                  OpenVINO CPU config is extended for this instance only);
  "openvino":     OpenVINO with RapidOCR's own config (the CPU plugin's default: bf16 where the CPU has it).
Protocol (pickle frames on stdin/stdout): ("page" | "crop", mode, BGR uint8 array) -> (lines, seconds), lines =
[(4x2 box, text)] for a page, [text] for a crop; seconds = the OCR call alone, timed here (no pipe in it).
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

MODES = ("onnxruntime", "openvino-f32", "openvino")


def params(mode: str, files: dict | None) -> dict:
    """RapidOCR's params for one instance: 1 thread on its engine; files (det/cls/rec/keys) or its own models."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    engine = "onnxruntime" if mode == "onnxruntime" else "openvino"
    threads = {"onnxruntime": {"EngineConfig.onnxruntime.intra_op_num_threads": 1,
                               "EngineConfig.onnxruntime.inter_op_num_threads": 1},
               "openvino": {"EngineConfig.openvino.inference_num_threads": 1}}[engine]
    out = {"Global.log_level": "error", **threads}
    if engine != "onnxruntime":         # onnxruntime is RapidOCR's default engine_type: left as shipped
        from rapidocr import EngineType
        out.update({f"{p}.engine_type": EngineType.OPENVINO for p in ("Det", "Cls", "Rec")})
    if files:
        out.update({"Det.model_path": files["det"], "Cls.model_path": files["cls"], "Rec.model_path": files["rec"],
                    "Rec.rec_keys_path": files["keys"]})
    return out


def _instances(modes: list[str], files: dict | None) -> dict:
    from rapidocr import RapidOCR
    from rapidocr.inference_engine.openvino import device_config
    import numpy as np

    plain = device_config.CPUConfig.get_config
    out = {}
    for mode in modes:
        if mode == "openvino-f32":
            device_config.CPUConfig.get_config = lambda self: {**plain(self), "INFERENCE_PRECISION_HINT": "f32"}
        else:
            device_config.CPUConfig.get_config = plain
        ocr = RapidOCR(params=params(mode, files))
        # models load on first use: load them now, under this instance's config
        ocr(np.full((64, 256, 3), 255, np.uint8), use_det=True, use_cls=True, use_rec=True)
        ocr(np.full((48, 192, 3), 255, np.uint8), use_det=False, use_cls=True, use_rec=True)
        out[mode] = ocr
    device_config.CPUConfig.get_config = plain
    return out


def precision(ocr) -> dict:
    """What each model really runs, per part: for OpenVINO its runtime model's compute-op precisions (the evidence
    that "openvino" is bf16 and "openvino-f32" is f32 on this CPU); ONNX Runtime's CPU provider runs the model's own
    element type, named from its first input."""
    from collections import Counter

    out = {}
    for part in ("text_det", "text_cls", "text_rec"):
        sess = getattr(ocr, part).session.session
        seen = Counter()
        if hasattr(sess, "get_compiled_model"):
            for op in sess.get_compiled_model().get_runtime_model().get_ordered_ops():
                rt = op.get_rt_info()
                kind = rt["layerType"].astype(str) if "layerType" in rt else op.get_type_name()
                if kind in ("Convolution", "GroupConvolution", "MatMul", "FullyConnected"):
                    seen[rt["runtimePrecision"].astype(str).lower() if "runtimePrecision" in rt else "unknown"] += 1
        else:
            t = sess.get_inputs()[0].type
            seen[{"tensor(float)": "f32", "tensor(float16)": "f16"}.get(t, t)] += 1
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
    ap.add_argument("--modes", default="openvino-f32,openvino", help=f"comma-separated, of {', '.join(MODES)}")
    for k in ("det", "cls", "rec", "keys"):
        ap.add_argument(f"--{k}", default=None)
    a = ap.parse_args()
    given = {k: getattr(a, k) for k in ("det", "cls", "rec", "keys")}
    if any(given.values()) and not all(given.values()):
        ap.error("--det, --cls, --rec and --keys go together (or none: RapidOCR 3.10's own models)")
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown {m!r}, one of {', '.join(MODES)}")
    out = os.fdopen(os.dup(1), "wb")        # the protocol's own copy of stdout: library chatter goes to stderr
    os.dup2(2, 1)
    inst = _instances(modes, given if all(given.values()) else None)
    from importlib.metadata import version

    inp = sys.stdin.buffer
    pickle.dump(("ready", {**{p: version(p) for p in ("rapidocr", "openvino", "onnxruntime")},
                           "models": {k: v for k, v in given.items() if v} or "RapidOCR 3.10's own (as shipped)",
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
