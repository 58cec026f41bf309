"""RapidOCR 3.10 behind a pipe, for scripts/bench_ocr.py and scripts/bench_ocr_all.py: runs in its own venv
(`make rapidocr3-venv`; its opencv-python-headless and numpy would overwrite the pipeline's), imports nothing of the
pipeline.

Models: --det/--cls/--rec/--keys (bench_ocr: RapidOCR 1.4.4's PP-OCRv4 ONNX files; bench_ocr_all's controls: our
bundles' ONNX files), or none: RapidOCR 3.10's own, as shipped (PP-OCRv6 small det/rec, mobile v2 cls, from its wheel).
--limit-type/--limit-side-len/--mean/--std: the detector's resize and normalisation (bench_ocr_all's same-resize
control: ours), else RapidOCR's own (min 736). One instance per --modes entry, --threads each (OpenCV's too):
  "onnxruntime":  RapidOCR's default engine and config, as a user gets it;
  "openvino-f32": OpenVINO with INFERENCE_PRECISION_HINT f32 forced (RapidOCR exposes no precision setting: its
                  OpenVINO CPU config is extended for this instance only);
  "openvino":     OpenVINO with RapidOCR's own config (the CPU plugin's default: bf16 where the CPU has it).
Protocol (pickle frames on stdin/stdout): first the warm-up page (a BGR uint8 array): each instance reads it once as it
loads its models, its only warm-up (as every other system's); "ready" carries the readings. Then ("page" | "crop", mode,
BGR uint8 array) -> (lines, seconds), lines = [(4x2 box, text)] for a page, [text] for a crop; seconds = the OCR call
alone, timed here (no pipe in it).
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

MODES = ("onnxruntime", "openvino-f32", "openvino")


def params(mode: str, files: dict | None, threads: int = 1, det: dict | None = None) -> dict:
    """RapidOCR's params for one instance: `threads` on its engine; files (det/cls/rec/keys) or its own models;
    det: {limit_type, limit_side_len, mean, std} of the detector's pre-processing, or RapidOCR's own."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    engine = "onnxruntime" if mode == "onnxruntime" else "openvino"
    threads = {} if threads < 1 else {      # < 1: RapidOCR's own thread settings (all cores: `make bench-ocr`)
        "onnxruntime": {"EngineConfig.onnxruntime.intra_op_num_threads": threads,
                        "EngineConfig.onnxruntime.inter_op_num_threads": 1},
        "openvino": {"EngineConfig.openvino.inference_num_threads": threads}}[engine]
    out = {"Global.log_level": "error", **threads}
    if engine != "onnxruntime":         # onnxruntime is RapidOCR's default engine_type: left as shipped
        from rapidocr import EngineType
        out.update({f"{p}.engine_type": EngineType.OPENVINO for p in ("Det", "Cls", "Rec")})
    if files:
        out.update({"Det.model_path": files["det"], "Cls.model_path": files["cls"], "Rec.model_path": files["rec"],
                    "Rec.rec_keys_path": files["keys"]})
    out.update({f"Det.{k}": v for k, v in (det or {}).items() if v is not None})
    return out


def _instances(modes: list[str], files: dict | None, warmup, threads: int = 1, det: dict | None = None) -> tuple:
    """({mode: RapidOCR}, {mode: its reading of the warm-up page}): each instance reads the warm-up page once, under its
    own config (models load on first use); a part the page did not reach is loaded, not run."""
    from rapidocr import RapidOCR
    from rapidocr.inference_engine.openvino import device_config

    plain = device_config.CPUConfig.get_config
    out, warm = {}, {}
    for mode in modes:
        if mode == "openvino-f32":
            device_config.CPUConfig.get_config = lambda self: {**plain(self), "INFERENCE_PRECISION_HINT": "f32"}
        else:
            device_config.CPUConfig.get_config = plain
        ocr = RapidOCR(params=params(mode, files, threads, det))
        warm[mode] = _call(ocr, "page", warmup)[0]
        for load in ("_load_det_model", "_load_cls_model", "_load_rec_model"):
            getattr(ocr, load)()
        out[mode] = ocr
    device_config.CPUConfig.get_config = plain
    return out, warm


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
    ap.add_argument("--threads", type=int, default=1, help="each engine's threads, and OpenCV's (0: RapidOCR's and "
                                                           "OpenCV's own settings, every core)")
    ap.add_argument("--limit-type", choices=("min", "max"), default=None)
    ap.add_argument("--limit-side-len", type=int, default=None)
    ap.add_argument("--mean", type=float, nargs=3, default=None)
    ap.add_argument("--std", type=float, nargs=3, default=None)
    a = ap.parse_args()
    given = {k: getattr(a, k) for k in ("det", "cls", "rec", "keys")}
    if any(given.values()) and not all(given.values()):
        ap.error("--det, --cls, --rec and --keys go together (or none: RapidOCR 3.10's own models)")
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown {m!r}, one of {', '.join(MODES)}")
    import cv2

    if a.threads > 0:       # OpenCV's own pool would otherwise use every core inside the timed call
        cv2.setNumThreads(a.threads)
    det = {"limit_type": a.limit_type, "limit_side_len": a.limit_side_len, "mean": a.mean, "std": a.std}
    out = os.fdopen(os.dup(1), "wb")        # the protocol's own copy of stdout: library chatter goes to stderr
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    warmup = pickle.load(inp)
    inst, warm = _instances(modes, given if all(given.values()) else None, warmup, a.threads, det)
    from importlib.metadata import version

    pickle.dump(("ready", {**{p: version(p) for p in ("rapidocr", "openvino", "onnxruntime")},
                           "models": {k: v for k, v in given.items() if v} or "RapidOCR 3.10's own (as shipped)",
                           "det_resize": {k: v for k, v in det.items() if v is not None} or "RapidOCR's own (min 736)",
                           "precision": {m: precision(o) for m, o in inst.items()}, "warmup": warm}), out)
    out.flush()
    while True:
        try:
            what, mode, img = pickle.load(inp)
        except EOFError:
            return 0
        try:
            pickle.dump(("ok", _call(inst[mode], what, img)), out)
        except Exception as exc:
            pickle.dump(("error", f"{type(exc).__name__}: {exc}"), out)
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
