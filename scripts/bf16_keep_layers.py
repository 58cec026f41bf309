"""Which OpenVINO layers must stay f32 for a bf16 row to keep what it reads (server.bf16.openvino_keep_fp32)?

Chosen on the TUNING split (the run's train/calib.npz: training-set samples, disjoint from the validation slice the
server gate judges): each segment (a compute layer and its fused tail, pipeline/engines/ov.py layer_segments) is run
alone in bf16 and ranked by the error it adds (recognizer: |dp| of fp32's top class; detector: |dp| over the DB
map); then the top k segments are kept f32 for k = 0, 1, 2, 4, ... and each trial reports what changed vs f32 and
its speed vs f32 (timed interleaved, one thread; recognizer batch 8, detector batch 1: pages are read one by one):
  recognizer: tuning lines whose decoded text changed;
  detector:   DB boxes (the run's postprocess) of the tuning pages that f32 finds and the row does not reproduce to
              the pixel, plus the row's boxes f32 does not have; and the share of map pixels whose binarisation flips.
Each trial is also judged by the row's own gate (server.gates.bf16, judge_try: correct lines lost, metric drop,
agreement against Paddle Inference fp32) on the tuning samples and their labels, at half its budget
(`MARGIN`: the gate is judged afterwards on other samples, so a list chosen at the limit here is a coin flip there).
The rule (docs/low_precision.md): among the trials at least server.recommend.min_speedup x faster than f32 (a slower
keep list is never served), the smallest k whose trial holds at that margin: the fewest layers in f32, so the most
speed the gate allows. When none holds (or the tuning samples have no labels): the fewest changes, then the smallest
k (the rule before, which bought 3 changed lines for 1.29x where 5 at 1.84x were within the gate). Needs a CPU with
bf16 (avx512_bf16/AMX). The base IR is fused before it is marked (ov.save_f32_ir), so the
marks hold on every convolution; a MatMul+Add the CPU plugin turns into FullyConnected stays bf16 whatever is marked.

  .venv/bin/python scripts/bf16_keep_layers.py --run runs/ppocr_v4_rec [--samples 512] [--rank-samples 128]
  .venv/bin/python scripts/bf16_keep_layers.py --run runs/ppocr_v4_det --judge box  (16 calib.npz pages; ranked on 4)

--judge text (a detector's default since issue 48): the box judge above cannot see a crop edge that rewrites a
character (`3F1` vs `3FI` on a real sign), so the detector is judged by the lines the system reads through its boxes
instead: tuning pages rendered with text tight against its box edges (pipeline/data/edge_pages.py, its own seed:
never a validation set, never the real images), read by the f32 detector and by each trial's, both through the
system's flow with the SAME fp32 v4 direction classifier and recogniser (scripts/det_text_judge.py, OpenVINO f32); a
trial's changed lines are lines whose text changes at a box matched at IoU >= 0.5, plus missing and extra lines
(pipeline/ocr/line_judge.py). It holds when at most MARGIN of (1 - system.edge_lines_kept) of the reference lines
change (the share a part must keep on the system stage's own edge pages, pipeline/evaluation/edge_judge.py; was
(1 - server.recommend.min_agreement) before, 0.5 %, which no detector trial held either); segments are ranked by
DB-map error on the first --rank-samples of those pages; the rule is the same.
--judge text for a recogniser (since issue 48): the crops the system's f32 detector and classifier give on those
pages, each read through the flow's width batches by the f32 and the trial IR; crops that read another text count,
against the same budget; the first --rank-samples crops that fit 48x320 (default 64) rank and time.
  .venv/bin/python scripts/bf16_keep_layers.py --run runs/ppocr_v5_rec --judge text \
      --system configs/ppocr_v5_system.yaml --samples 16 --ks 0,8,16,20,24,28,32 --rounds 9
  .venv/bin/python scripts/bf16_keep_layers.py --run runs/ppocr_v4_det --samples 16 --rank-samples 3 --rounds 15
      (what chose configs/ppocr_v4_det.yaml's list: docs/low_precision.md#pp-ocrv4-detector-rows; another detector's
      recogniser and flow: --system, e.g. configs/ppocr_v5_system.yaml)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
import numpy as np


def changed_lines(out: np.ndarray, ref: np.ndarray) -> int:
    from pipeline.ocr.text_metrics import ctc_greedy_decode
    return sum(tuple(a) != tuple(b) for a, b in zip(ctc_greedy_decode(out), ctc_greedy_decode(ref)))


def changed_boxes(out: np.ndarray, ref: np.ndarray, post: dict) -> dict:
    """Boxes of fp32's maps the row does not reproduce to the pixel + the row's boxes fp32 lacks, and the share of
    pixels whose binarisation (prob > thresh) flips."""
    from pipeline.ocr.db_post import DBParams, boxes_from_map

    params = DBParams.from_dict(post)
    changed = boxes = 0
    for o, r in zip(out, ref):
        a = {q.astype(int).tobytes() for q in boxes_from_map(r, params)[0]}
        b = {q.astype(int).tobytes() for q in boxes_from_map(o, params)[0]}
        changed += len(a ^ b)
        boxes += len(a)
    flips = float(((out > params.thresh) != (ref > params.thresh)).mean())
    return {"changed": changed, "of": boxes, "flipped_pixels": flips}


def speed(xml_f32, xml_bf16, x, rounds: int = 5, batch: int = 8) -> float:
    """f32 time / bf16 time at `batch`, one thread, the two compiled models called alternately."""
    from pipeline.engines.ov import shared_core

    cs = [shared_core().compile_model(str(p), "CPU", {"INFERENCE_PRECISION_HINT": h, "INFERENCE_NUM_THREADS": 1,
                                                      "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1})
          for p, h in ((xml_f32, "f32"), (xml_bf16, "bf16"))]
    xb = np.ascontiguousarray(x[:batch])
    times = [[], []]
    for c in cs:
        c(xb)
    for _ in range(rounds):
        for i, c in enumerate(cs):
            t = time.perf_counter()
            c(xb)
            times[i].append(time.perf_counter() - t)
    return float(np.median(times[0]) / np.median(times[1]))


MARGIN = 0.5      # share of the gate's budget a trial may use on the tuning samples


def within_margin(tol, margin: float = MARGIN):
    """The gate's tolerance with `margin` of its budget: drop and lost lines scaled, agreement's shortfall too."""
    upd = {k: getattr(tol, k) * margin for k in ("metric_delta", "max_correct_lost") if getattr(tol, k) is not None}
    if tol.min_agreement is not None:
        upd["min_agreement"] = 1 - (1 - tol.min_agreement) * margin
    return tol.model_copy(update=upd)


def advise(trials: list[dict], min_speedup: float) -> dict:
    """The rule: among trials >= min_speedup x f32, the smallest k that holds at the margin; none: the fewest changes,
    then the smallest k (none fast enough: k=0)."""
    fast = [t for t in trials if t["speed_vs_f32"] >= min_speedup] or [t for t in trials if t["k"] == 0][:1]
    held = [t for t in fast if t.get("holds")]
    if held:
        return min(held, key=lambda t: t["k"])
    return min(fast, key=lambda t: (t["changed"], t["k"]))


def _trial(ovx, base, tmp, ranked, k, x, ref, post, batch, judge, text_judge=None, rounds: int = 5) -> dict:
    names = [n for s in ranked[:k] for n in s["names"]]
    ovx.keep_f32_ir(base, names, Path(tmp) / "keep.xml")
    t = {"k": k, "layers": [s["layer"] for s in ranked[:k]],
         "speed_vs_f32": round(speed(base, Path(tmp) / "keep.xml", x, rounds=rounds, batch=batch), 3)}
    if text_judge is not None:
        t.update(text_judge(Path(tmp) / "keep.xml"))
        return t
    out = ovx.run_ir(Path(tmp) / "keep.xml", x, "bf16", batch=batch)
    t.update(changed_boxes(out, ref, post) if post is not None else {"changed": changed_lines(out, ref), "of": len(x)})
    if judge is not None:
        r = judge(out)
        t.update(holds=r["passed"], lost=r["lost"], lost_of=r["of"], drop=r["drop"], agreement=r["agreement"],
                 why=r["reason"])
    return t


def _judge(run: Path, x: np.ndarray, batch: int):
    """out -> the bf16 gate's verdict at MARGIN on the tuning samples (None without labels)."""
    import tuning_split
    from pipeline.core.config import load_config
    from pipeline.core.gates import judge_try
    from pipeline.tasks.reference import load_reference

    _, ref_out, labels = tuning_split.load(run, len(x), batch, 1)
    if labels is None:
        return None
    task = load_reference(run / "export").task
    tol = within_margin(load_config([run / "config.resolved.yaml"]).server.gates["bf16"])
    return lambda out: judge_try(task, tol, out, ref_out, labels, "bf16", key="server.gates.bf16")


def _lines_kept(system_config: str) -> float:
    """The share of the fp32 chain's lines a low-precision part must keep on edge pages (system.edge_lines_kept):
    the text judges' budget is MARGIN of the rest."""
    from pipeline.core.config import load_config

    return float(load_config([Path(system_config)]).system.edge_lines_kept)


def _text_judge(args):
    """--judge text (detectors): the tuning pages (pipeline/data/edge_pages.py), their detector inputs, and
    xml -> that IR's bf16 detector judged by the lines the system reads (scripts/det_text_judge.py): it holds when at
    most MARGIN of (1 - system.edge_lines_kept) of the reference lines change."""
    import det_text_judge as tj
    from pipeline.ocr.line_judge import judge_detector

    spec, rec, cls = tj.system_parts(args.system)
    share = (1 - _lines_kept(args.system)) * MARGIN
    t0 = time.perf_counter()
    pages = tj.tuning_pages(args.samples or 32, args.seed)
    x = tj.det_inputs(pages, spec)
    print(f"{len(pages)} tuning pages rendered in {time.perf_counter() - t0:.0f} s")
    state = {}

    def judge(xml: Path) -> dict:
        r = judge_detector(pages, tj.IrDetector(xml, "bf16"), state["refs"], rec, spec, cls)
        budget = share * r["of"]
        return r | {"holds": r["changed"] <= budget, "budget": round(budget, 1)}

    def start(base: Path) -> None:        # the f32 detector's reading: the reference every trial is judged against
        state["refs"] = tj.references(pages, tj.IrDetector(base, "f32"), rec, spec, cls)

    judge.start = start
    return x, judge


def _rec_text_judge(args, tmp: str, n_rank: int):
    """--judge text (recognisers): the crops the system's f32 detector and classifier give on the tuning pages
    (pipeline/data/edge_pages.py), every one read through the flow's width batches (recognize_crops) by the f32 and
    the trial IR; the first n_rank crops that fit 48x320 rank the segments and time the trials (batch 8). It holds
    when at most MARGIN of (1 - system.edge_lines_kept) of the crops read another text. Why: the synthetic lines a
    recogniser is gated on hide what bf16 does to thin and bracket glyphs at a crop's ends (the v5 recogniser's
    OpenVINO bf16 row rewrote 11.8 % of these crops while keeping 139 of 140 synthetic system lines)."""
    import det_text_judge as tj
    from pipeline.ocr import ppocr
    from pipeline.ocr.system import recognize_crops

    spec, _, cls = tj.system_parts(args.system)
    share = (1 - _lines_kept(args.system)) * MARGIN
    t0 = time.perf_counter()
    sets = tj.page_crop_sets(tj.tuning_pages(args.samples or 16, args.seed), tj.system_detector(args.system, tmp),
                             spec, cls)
    height, width = int(spec.rec_pre["height"]), int(spec.rec_pre["width"])
    fit = [c for s in sets for c in s if c.shape[1] / max(c.shape[0], 1) <= width / height][:n_rank]
    x = np.stack([ppocr.resize_norm(c, height, width) for c in fit])
    of = sum(len(s) for s in sets)
    print(f"{len(sets)} tuning pages, {of} crops in {time.perf_counter() - t0:.0f} s; {len(x)} rank and time")
    state = {}

    def read(xml: Path, hint: str) -> list[list[str]]:
        eng = tj.IrDetector(xml, hint)
        return [recognize_crops(s, eng, spec)[0] if s else [] for s in sets]

    def judge(xml: Path) -> dict:
        got = read(xml, "bf16")
        changed = [f"{a!r} -> {b!r}" for r, g in zip(state["refs"], got) for a, b in zip(r, g) if a != b]
        budget = share * of
        return {"changed": len(changed), "of": of, "text": len(changed), "missing": 0, "extra": 0,
                "boxes_changed": 0, "examples": changed[:5], "holds": len(changed) <= budget,
                "budget": round(budget, 1)}

    def start(base: Path) -> None:
        state["refs"] = read(base, "f32")

    judge.start = start
    return x, judge


def _report(t: dict, post, batch: int, judge, text: bool) -> str:
    if text and post is None:
        return (f"k={t['k']}: {t['changed']} of {t['of']} tuning crops read another text, {t['speed_vs_f32']}x f32 "
                f"(batch {batch}); " + ("holds" if t["holds"] else "fails")
                + f" at {MARGIN:g} of (1 - system.edge_lines_kept): <= {t['budget']} crops"
                + (f"; e.g. {', '.join(t['examples'][:3])}" if t["examples"] else ""))
    if text:
        return (f"k={t['k']}: {t['changed']} of {t['of']} tuning lines changed (text {t['text']}, missing "
                f"{t['missing']}, extra {t['extra']}; {t['boxes_changed']} boxes not reproduced to the bit), "
                f"{t['speed_vs_f32']}x f32 (batch {batch}); " + ("holds" if t["holds"] else "fails")
                + f" at {MARGIN:g} of (1 - system.edge_lines_kept): <= {t['budget']} lines"
                + (f"; e.g. {', '.join(t['examples'][:3])}" if t["examples"] else ""))
    return (f"k={t['k']}: {t['changed']} of {t['of']} tuning {'boxes' if post is not None else 'lines'} changed"
            + (f", {t['flipped_pixels']:.2e} of map pixels flipped" if post is not None else "")
            + f", {t['speed_vs_f32']}x f32 (batch {batch})"
            + ("" if judge is None else f"; gate at {MARGIN:g} of its budget: "
               + ("holds" if t["holds"] else f"fails ({t['why']})")
               + ("" if t["lost"] is None else f", correct lost {t['lost']}/{t['lost_of']}")
               + ("" if t["drop"] is None else f", drop {t['drop']:+.4f}")))


def main() -> int:
    from pipeline.core.config import load_config
    from pipeline.engines import ov as ovx
    from pipeline.engines.onnx_export import export_onnx

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True)
    p.add_argument("--samples", "--lines", type=int, default=None, help="tuning samples judged (from "
                   "train/calib.npz; default: a recogniser 512 lines, a detector 16 pages)")
    p.add_argument("--rank-samples", type=int, default=None, help="of those, the first N rank the segments "
                   "(default: a recogniser 128 lines, a detector 4 pages)")
    p.add_argument("--out", default=None, help="write the ranking and trials as JSON here")
    p.add_argument("--judge", choices=("box", "text"), default=None, help="detectors: text (the default: lines read "
                   "through the system on rendered tuning pages, pipeline/data/edge_pages.py; 32 pages unless "
                   "--samples) or box (DB boxes and the gate on train/calib.npz, the judge before issue 48); "
                   "recognisers: box (the default: train/calib.npz lines and the gate) or text (the crops of those "
                   "tuning pages, 16 unless --samples)")
    p.add_argument("--seed", type=int, default=None, help="--judge text: the tuning pages' seed (default: the "
                   "generator's own, pipeline/data/edge_pages.DEFAULT_SEED)")
    p.add_argument("--system", default="configs/ppocr_v4_system.yaml", help="--judge text: the system config "
                   "whose flow and recogniser read the lines (default %(default)s)")
    p.add_argument("--rank", choices=("map", "flips", "prefix"), default="map", help="detectors: rank segments by "
                   "mean |dp| over the DB map (map), by the share of pixels whose binarisation at the run's thresh "
                   "flips (flips: the boxes' edges), or take them in the IR's order (prefix: the first k segments "
                   "f32, one run of f32 layers instead of islands that each convert to and from bf16)")
    p.add_argument("--ks", type=lambda v: sorted({int(k) for k in v.split(",")}), default=None, metavar="K,K,..",
                   help="the trials' k (default 0, 1, 2, 4, ... doubling): finer steps where the doubling jumps "
                   "from a fast list that fails to a slow one that holds")
    p.add_argument("--compete", action="append", default=[], metavar="LABEL=YAML", help="a keep list held in a "
                   "config's server.bf16.openvino_keep_fp32 (e.g. served=configs/ppocr_v4_det.yaml), tried, judged "
                   "and timed as the others, competing under the same rule")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per trial (more on a loaded "
                   "host: the speed decides which trials may be advised)")
    args = p.parse_args()
    run = Path(args.run)
    if not (run / "train" / "info.json").is_file():
        raise SystemExit(f"bf16_keep_layers: {run} is not a run folder (no train/info.json): give --run runs/<name> "
                         "after `python -m pipeline run train export -c <config>`")
    info = json.loads((run / "train" / "info.json").read_text())
    post = info["postprocess"] if info["task"] == "detection" else None
    args.judge = args.judge or ("text" if post is not None else "box")
    batch = 1 if post is not None else 8
    min_speedup = load_config([run / "config.resolved.yaml"]).server.recommend.min_speedup
    text_judge = judge = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.judge == "text":
            x, text_judge = _text_judge(args) if post is not None else \
                _rec_text_judge(args, tmp, args.rank_samples or 64)
        else:
            with np.load(run / "train" / "calib.npz") as z:
                x = z["inputs"][:args.samples or (16 if post is not None else 512)]
            judge = _judge(run, x, batch)
        n_rank = min(args.rank_samples or (4 if post is not None else 128), len(x))
        onnx = run / "server" / "onnx" / "model.onnx"
        if not onnx.is_file():
            onnx = export_onnx(run / "export" / "inference", Path(tmp) / "model.onnx")
        base = ovx.save_f32_ir(onnx, Path(tmp) / "base.xml")
        ref = ovx.run_ir(base, x if text_judge is None else x[:n_rank], "f32", batch=batch)
        if text_judge is not None:
            text_judge.start(base)
        t0 = time.perf_counter()
        if args.rank == "prefix":       # topological order: no per-segment trial runs
            ranked = [dict(s, error=float("nan")) for s in ovx.layer_segments(base)]
            print(f"{len(ranked)} segments in the IR's order: the first k are kept f32")
        else:
            error = ovx.top_class_error if post is None else \
                ovx.flip_error(float(post["thresh"])) if args.rank == "flips" else ovx.map_error
            ranked = ovx.bf16_sensitivity(base, x[:n_rank], ref[:n_rank], tmp, batch=batch, error=error)
            print(f"ranked {len(ranked)} segments on {n_rank} tuning samples in {time.perf_counter() - t0:.0f} s")
            for s in ranked[:12]:
                print(f"  {s['error']:.3g}  {s['layer']} ({s['type']}, {len(s['names'])} layers)")
        trials = []
        segments = {s["layer"]: s for s in ovx.layer_segments(base)}
        for item in args.compete:       # an existing list, judged and timed alike, competes under the same rule
            from det_text_judge import keep_list

            label, _, path = item.partition("=")
            mine = [segments.get(n, {"layer": n, "names": [n]}) for n in keep_list(path)]
            t = _trial(ovx, base, tmp, mine, len(mine), x, ref, post, batch, judge, text_judge, args.rounds)
            trials.append(t | {"label": label})
            print(f"[{label}] " + _report(t, post, batch, judge, text_judge is not None), flush=True)
        ks = iter(args.ks) if args.ks else None
        k = next(ks) if ks else 0
        while k <= len(ranked):
            t = _trial(ovx, base, tmp, ranked, k, x, ref, post, batch, judge, text_judge, args.rounds)
            trials.append(t)
            print(_report(t, post, batch, judge, text_judge is not None), flush=True)
            if t["changed"] == 0 or k == len(ranked) or (t.get("holds") and t["speed_vs_f32"] >= min_speedup):
                break       # a larger k cannot be advised: the smallest k that holds fast enough is
            k = min(next(ks, len(ranked) + 1), len(ranked) + 1) if ks else 1 if k == 0 else min(2 * k, len(ranked))
    pick = advise(trials, min_speedup)
    if pick.get("label"):
        print(f"the competing list {pick['label']!r} is advised again")
    rule = (f"the smallest k holding the gate at {MARGIN:g} of its budget" if pick.get("holds")
            else "none holds: the fewest changes, then the smallest k")
    print(f"advised (>= {min_speedup:g}x f32, {rule}): k={pick['k']} "
          f"({pick['changed']} changed, {pick['speed_vs_f32']}x f32): server.bf16.openvino_keep_fp32 = "
          f"{pick['layers']} (each with its segment's tail: ov.segment_names)")
    if args.out:
        Path(args.out).write_text(json.dumps({"ranked": ranked, "trials": trials, "advised": pick}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
