"""The detector's text judge (issue 48): a bf16 detector judged by the lines the system reads through its boxes.

Used by scripts/bf16_keep_layers.py --judge text (the keep list chosen on tuning pages: pipeline/data/edge_pages.py,
never the real images), and on its own to RE-CHECK chosen lists on the real images afterwards:

  .venv/bin/python scripts/det_text_judge.py --run runs/ppocr_v4_det --list new=configs/ppocr_v4_det.yaml \
      --list old=/tmp/old_det.yaml [--list none=-] [--edge-seed 480002]

Each list is a YAML file holding server.bf16.openvino_keep_fp32 (`-`: none, every layer bf16); each list's detector
(OpenVINO bf16, those segments f32) and the f32 detector read every real page through the system's flow with the
SAME fp32 v4 direction classifier and recogniser (OpenVINO f32, one thread, the system config's flow): lines changed
vs f32 (line_judge.line_changes) and GT.tsv's known texts (scripts/ocr_peers.py KNOWN, `3F` + 1/I/l/]/】 counted).
The crop images (ocr_peers.CROPS) are read without detection: they count for known texts, never for lines.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
import numpy as np

DEFAULT_SYSTEM = "configs/ppocr_v4_system.yaml"


class IrDetector:
    """An OpenVINO IR compiled at one precision hint, one thread: an engine the system's flow calls (the `det` one;
    a recogniser's too, its input_shape saying whether its width is dynamic)."""
    kind = "openvino"

    def __init__(self, xml, hint: str):
        from pipeline.engines.ov import shared_core

        self.effective_precision = hint
        self._c = shared_core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                                "INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
                                                                "PERFORMANCE_HINT": "LATENCY"})
        self.input_shape = [d.get_length() if d.is_static else -1 for d in self._c.input(0).get_partial_shape()]

    def run(self, x: np.ndarray) -> np.ndarray:
        return self._c(np.ascontiguousarray(x))[0]


def system_parts(system_config: str | Path = DEFAULT_SYSTEM) -> tuple:
    """(spec, rec, cls): the system config's flow and detection settings, its recogniser and the v4 classifier, each
    OpenVINO f32 at one thread (the fixed readers every trial shares)."""
    from known_texts import onnx_of
    from pipeline.core.config import load_config
    from pipeline.engines import registry
    from pipeline.ocr.ppocr_models import fetch
    from pipeline.tasks import ppocr_system

    sys_cfg = load_config([ROOT / system_config])
    s = sys_cfg.system
    det_cfg, rec_cfg = load_config([ROOT / s.detection]), load_config([ROOT / s.recognition])
    keys = Path(rec_cfg.data.charset) if rec_cfg.data.charset else fetch()["keys"]
    spec = ppocr_system.spec_from_configs(det_cfg, sys_cfg, keys)
    rec_onnx = onnx_of(rec_cfg.section("model")["model"], ROOT / ".cache" / "known_texts" / rec_cfg.run.name, "rec")
    cls_onnx = ppocr_system.model_file(fetch(), "cls", "onnxruntime", ROOT / ".cache" / "ppocr" / "onnx")
    rec, cls = (registry.make("openvino", f, "fp32", threads=1) for f in (rec_onnx, cls_onnx))
    return spec, rec, cls


def system_detector(system_config: str | Path, tmp: str) -> IrDetector:
    """The system's detector (its run's ONNX) as an OpenVINO f32 IR at one thread: what reads the tuning pages into
    crops when a recogniser is judged."""
    from pipeline.core.config import load_config
    from pipeline.engines import ov as ovx

    det_cfg = load_config([ROOT / load_config([ROOT / system_config]).system.detection])
    run = ROOT / det_cfg.run.root / det_cfg.run.name
    return IrDetector(ovx.save_f32_ir(_onnx(run, tmp), Path(tmp) / "system_det.xml"), "f32")


def page_crop_sets(pages: list[np.ndarray], det, spec, cls) -> list[list[np.ndarray]]:
    """Per page, the crops the recogniser reads: the system's boxes, turned as its classifier says (page_crops:
    classify_crops turns them in place)."""
    from pipeline.ocr.system import page_crops

    return [page_crops(p, det, spec, cls).crops for p in pages]


def tuning_pages(n: int, seed: int | None = None) -> list[np.ndarray]:
    from pipeline.data.edge_pages import DEFAULT_SEED, installed_fonts, render_edge_pages

    return render_edge_pages(n, DEFAULT_SEED if seed is None else seed, fonts=installed_fonts())


def det_inputs(pages: list[np.ndarray], spec) -> np.ndarray:
    """The detector's inputs of equal-sized pages, as the flow prepares them (ranking and timing)."""
    from pipeline.ocr import ppocr

    return np.concatenate([ppocr.det_input(ppocr.prepare_page(ppocr.to_bgr(p), spec.flow)[0], spec.det_pre)
                           for p in pages])


def references(pages: list[np.ndarray], det, rec, spec, cls) -> list:
    from pipeline.ocr.line_judge import read_system_page

    return [read_system_page(p, det, rec, spec, cls) for p in pages]


def keep_list(path: str) -> list[str]:
    import yaml

    if path == "-":
        return []
    try:
        return list(yaml.safe_load(Path(path).read_text())["server"]["bf16"]["openvino_keep_fp32"])
    except (OSError, KeyError, TypeError) as e:
        raise SystemExit(f"det_text_judge: {path} has no server.bf16.openvino_keep_fp32 ({e}); "
                         "give a det config") from None


def _known(name: str, texts: list[str]) -> bool:
    from ocr_peers import KNOWN, known

    return bool(KNOWN.get(name)) and known(name, texts)


def recheck(run: Path, lists: dict[str, list[str]], system_config: str) -> dict:
    """Real images: per list, lines changed vs the f32 detector and known texts read (see the module doc)."""
    import tempfile

    from ocr_peers import CROPS, IMAGES, KNOWN, pages as real_pages
    from pipeline.engines import ov as ovx
    from pipeline.ocr.line_judge import changed_texts, line_changes, read_system_page
    from pipeline.ocr.system import read_crops

    spec, rec, cls = system_parts(system_config)
    images = real_pages(IMAGES)
    crops_known = sum(_known(n, read_crops([im], rec, spec, cls)) for n, im in images.items() if n in CROPS)
    names = [n for n in images if n not in CROPS]
    paged = [images[n] for n in names]
    with tempfile.TemporaryDirectory() as tmp:
        base = ovx.save_f32_ir(_onnx(run, tmp), Path(tmp) / "base.xml")
        refs = references(paged, IrDetector(base, "f32"), rec, spec, cls)
        out = {"f32": _row(names, refs, refs, crops_known)}
        for label, layers in lists.items():
            ovx.keep_f32_ir(base, ovx.segment_names(base, layers), Path(tmp) / f"{label}.xml")
            det = IrDetector(Path(tmp) / f"{label}.xml", "bf16")
            got = [read_system_page(p, det, rec, spec, cls, r) for p, r in zip(paged, refs)]
            out[label] = _row(names, got, refs, crops_known) | {
                "changed": sum(line_changes(r.lines, g.lines)["changed"] for r, g in zip(refs, got)),
                "examples": [e for n, r, g in zip(names, refs, got) for e in changed_texts(n, r.lines, g.lines)],
                "k": len(layers)}
    out["of_known"] = len(KNOWN)
    return out


def confirm(run: Path, lists: dict[str, list[str]], system_config: str, seed: int, n: int) -> dict:
    """Edge pages of another seed (a second tuning split: never the real images): per list, lines changed vs the f32
    detector, read as the judge that chose the list reads them. Tells a list that won its trials by luck (the
    fewest of several knife-edge counts) from one that keeps as many lines elsewhere."""
    import tempfile

    from pipeline.engines import ov as ovx
    from pipeline.ocr.line_judge import judge_detector

    spec, rec, cls = system_parts(system_config)
    pages = tuning_pages(n, seed)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = ovx.save_f32_ir(_onnx(run, tmp), Path(tmp) / "base.xml")
        refs = references(pages, IrDetector(base, "f32"), rec, spec, cls)
        for label, layers in lists.items():
            ovx.keep_f32_ir(base, ovx.segment_names(base, layers), Path(tmp) / f"{label}.xml")
            r = judge_detector(pages, IrDetector(Path(tmp) / f"{label}.xml", "bf16"), refs, rec, spec, cls)
            out[label] = {k: r[k] for k in ("changed", "of", "text", "missing", "extra", "boxes_changed")} | {
                "k": len(layers)}
    return out


def _row(names: list[str], readings: list, refs: list, crops_known: int) -> dict:
    texts = {n: [ln["text"] for ln in r.lines] for n, r in zip(names, readings)}
    return {"lines": sum(len(r.lines) for r in readings), "ref_lines": sum(len(r.lines) for r in refs),
            "known": crops_known + sum(_known(n, t) for n, t in texts.items()),
            "sign": " | ".join(texts.get("return_word_debug.jpg", []))}


def _onnx(run: Path, tmp: str) -> Path:
    from pipeline.engines.onnx_export import export_onnx

    onnx = run / "server" / "onnx" / "model.onnx"
    return onnx if onnx.is_file() else export_onnx(run / "export" / "inference", Path(tmp) / "model.onnx")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the detector's run folder (export/inference or server/onnx)")
    ap.add_argument("--list", action="append", default=[], metavar="LABEL=YAML",
                    help="a keep list: a det config holding server.bf16.openvino_keep_fp32 (`-`: every layer bf16)")
    ap.add_argument("--system", default=DEFAULT_SYSTEM, help="system config: flow, recogniser (default %(default)s)")
    ap.add_argument("--edge-seed", type=int, default=None, help="re-check on edge pages of this seed (a second "
                    "tuning split, e.g. 480002, the system stage's) instead of the real images")
    ap.add_argument("--edge-pages", type=int, default=16, help="with --edge-seed: how many pages (default 16)")
    args = ap.parse_args()
    lists = {}
    for item in args.list:
        label, sep, path = item.partition("=")
        if not sep or not label:
            raise SystemExit(f"det_text_judge: --list {item!r}: expected LABEL=YAML "
                             "(e.g. new=configs/ppocr_v4_det.yaml)")
        lists[label] = keep_list(path)
    if args.edge_seed is not None:
        res = confirm(Path(args.run), lists, args.system, args.edge_seed, args.edge_pages)
        print(f"edge pages of seed {args.edge_seed} ({args.edge_pages}), lines read through the same fp32 cls + rec")
        for label, r in res.items():
            print(f"  {label}, k={r['k']}: {r['changed']} of {r['of']} lines changed vs f32 (text {r['text']}, "
                  f"missing {r['missing']}, extra {r['extra']}; {r['boxes_changed']} boxes not reproduced to the bit)")
        return 0
    res = recheck(Path(args.run), lists, args.system)
    print(f"real images, lines read through the same fp32 cls + rec; known texts of {res['of_known']}")
    for label, r in res.items():
        if label == "of_known":
            continue
        extra = "" if label == "f32" else f", k={r['k']}: {r['changed']} of {r['ref_lines']} lines changed vs f32"
        print(f"  {label}{extra}; {r['lines']} lines; known texts {r['known']}/{res['of_known']}; sign: {r['sign']}")
        for e in r.get("examples", []):
            print(f"      {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
