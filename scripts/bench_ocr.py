"""`make bench-ocr`: the OCR system as served next to RapidOCR on the real images, at 1 thread and at every core,
in one run.

Peers, all on the same PP-OCRv4 det + mobile v2 cls + v4 rec models:
  RapidOCR 1.4.4 (ONNX Runtime, fp32, in process): the fp32 reference whose lines every system is compared with;
  RapidOCR 3.10 (the newest; its own venv, `make rapidocr3-venv`, through scripts/rapidocr3_worker.py) on OpenVINO,
  once with f32 forced and once as shipped (the CPU plugin's default: bf16 on a bf16 CPU; the worker reports what
  each model's runtime ran).
Ours: the flow `/ocr` runs (pipeline/ocr/system.read_pages) on the engines `/ocr` loads: from a system bundle
(--bundle, as `make real-ocr` publishes; system.engine auto: each part's recommendation as this CPU runs it, said
per part with its reason), or from the fetched models on one runtime (--engine). Every page is decoded once
(pipeline/ocr/pages.decode_page) and the same array goes to all.
Timing: every system reads the same one warm-up page (ocr_peers.WARMUP: a real page with text, scored but never timed;
no other warm-up), then --passes (ocr_peers.PASSES) passes over the other pages, page by page, the systems in a rotating order (each
goes first as often): a neighbour's load hits all alike. 1 thread per engine and for OpenCV. Every real page is a new
input shape in the first pass (a one-shot reader's case), a repeat in the others (a server's); pages/s is the mean
pass's, and each pass's ratios are printed.
Every core (--cores, default all; 1: skip): the same pages again, ours as lanes (one page per core, each lane its
own engines at every core, as `/ocr` serves with serve.ocr_lanes: a page read while the other lane idles gets both;
pipeline/ocr/lanes.py; every page must read exactly as at 1 thread), RapidOCR 3.10 with
its own thread settings (every core, one page at a time); interleaved in two halves of the pages (blocks of one page
per lane would time each block at its slowest page).
Reported: per image lines, lines identical to the reference (box matched at IoU >= 0.5) and GT.tsv's known texts
(crops read with recognition alone, as RapidOCR's tests do); per system pages/s and ours / it. Exit 1 when a
target of issue 29 is missed (targets()). Shared with `make bench-ocr-all` (the v4, v5, v6 systems side by side
with RapidOCR 3.10 on its own models, scripts/bench_ocr_all.py): scripts/ocr_peers.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ocr_peers import (CROPS, IMAGES, KNOWN, ROOT, Ours, OursLanes, Rapid, Rapid3, Rapid3Worker,  # noqa: F401  (re-exported: tests import the peers from here)
                       agreement as _agreement, interleaved as _interleaved, interleaved_blocks, known as _known,
                       add_passes, pages as _pages, cpu, finish, no_training, rapid_models, set_threads, texts_of,
                       warmup_name)
from pipeline.core.errors import PipelineError

TARGETS = {"agreement": 0.97, "all_cores_vs_shipped": 1.1}    # issue 48
REF = "rapid"           # RapidOCR 1.4.4 (ONNX Runtime fp32): the fp32 reference of every system's lines


def read_only(args) -> bool:
    """Our system alone on the real images (`make real-ocr`): lines per image and GT.tsv's known texts. With a
    bundle, its fp32 reference chain (each part's bundle reference, pipeline/bundle/reference.py) reads them too,
    page by page in alternating order: what the deployment must not lose is a known text the model itself reads,
    so the exit status fails on a known text the reference reads and the served system misses; a text both miss
    is the model's (reported). Without a bundle (fetched models, no reference): every known text. pages/s: every
    image through the page flow, 1 thread, one pass, interleaved with the reference."""
    from argparse import Namespace
    from rich.console import Console
    from rich.markup import escape         # "[known text read]" is not a style tag

    systems = {"served": Ours(args)}
    if args.bundle:
        systems["fp32 reference"] = Ours(Namespace(**{**vars(args), "engine": "reference", "pin": None}))
    con, read, seconds = Console(width=170), {k: 0 for k in systems}, {k: 0.0 for k in systems}
    lost, pages = [], _pages(Path(args.images))
    set_threads()
    warm = warmup_name(pages)
    warm_lines = {k: s.page(pages[warm])[0] for k, s in systems.items()}     # the one warm-up page: read, not timed
    for i, (name, img) in enumerate(pages.items()):
        texts = {}
        for k in list(systems)[i % len(systems):] + list(systems)[:i % len(systems)]:
            lines, dt = (warm_lines[k], 0.0) if name == warm else systems[k].page(img)
            seconds[k] += dt
            texts[k] = texts_of(systems[k], name, img, lines)
        known = {k: _known(name, t) for k, t in texts.items()}
        for k in systems:
            read[k] += int(known[k] and bool(KNOWN.get(name)))
        mark = "" if not KNOWN.get(name) else "  [known text read]" if known["served"] else \
            f"  [MISSED known text {KNOWN[name]}" + ("" if "fp32 reference" not in known else
                                                     ": LOST by serving, the fp32 reference reads it]"
                                                     if known["fp32 reference"] else ": the model's, the fp32 "
                                                     "reference misses it too]")
        if KNOWN.get(name) and not known["served"] and known.get("fp32 reference", True):
            lost.append(name)
        con.print(escape(f"{name}: {' | '.join(texts['served'])}{mark}"))
    for k, s in systems.items():
        con.print(escape(f"{k} ({s.label})") + f": known texts read {read[k]} of {len(KNOWN)}, "
                  f"{(len(pages) - 1) / seconds[k]:.3f} pages/s ({len(pages) - 1} images timed after the warm-up page "
                  f"{warm}, 1 thread, one pass" + (", interleaved)" if len(systems) > 1 else ")"))
    if len(systems) > 1:
        con.print(f"served / fp32 reference pages/s: {seconds['fp32 reference'] / seconds['served']:.2f}x; known texts "
                  f"lost by serving: {', '.join(lost) or 'none'}")
    return not lost


def _systems(args, warmup) -> dict:
    return {"ours": Ours(args), REF: Rapid(), **_rapid3(args, warmup)}


def _rapid3(args, warmup, threads: int = 1) -> dict:
    """RapidOCR 3.10's two OpenVINO peers (f32 forced, as shipped) in one worker, when its venv is given; threads 0:
    its own thread settings."""
    if not args.rapid3_python:
        return {}
    worker = Rapid3Worker(args.rapid3_python, ("openvino-f32", "openvino"), rapid_models(), warmup=warmup,
                          threads=threads)
    return {"rapid3_f32": Rapid3(worker, "openvino-f32"), "rapid3_shipped": Rapid3(worker, "openvino")}


def _close(systems: dict) -> None:
    """Our engines and the RapidOCR 3.10 worker (shared by its two peers)."""
    if "rapid3_f32" in systems:
        systems["rapid3_f32"].worker.close()
    systems["ours"].close()


def _score(systems: dict, pages: dict, got: dict) -> tuple[list, dict]:
    """Per image and per system: lines, lines identical to the fp32 reference (at a box matched at IoU >= 0.5),
    GT.tsv's known texts (crops read with recognition alone)."""
    rows, per = [], {n: {"same": 0, "known": 0} for n in systems}
    for name, img in pages.items():
        row = {"image": name, "ref_lines": len(got[REF][name]), "known": bool(KNOWN.get(name))}
        for n, system in systems.items():
            texts = texts_of(system, name, img, got[n][name])
            same, known = _agreement(got[n][name], got[REF][name]), _known(name, texts)
            row[n] = {"lines": len(got[n][name]), "same": same, "known": known, "read": " | ".join(texts)[:40]}
            per[n]["same"] += same
            per[n]["known"] += int(known and row["known"])
        rows.append(row)
    return rows, per


def run(args) -> dict:
    pages = _pages(Path(args.images))
    systems = _systems(args, pages[warmup_name(pages)])
    try:
        spread = {}
        got, t, timed = _interleaved(systems, pages, passes=getattr(args, "passes", 1), spread=spread)
        rows, per = _score(systems, pages, got)
        served = systems["ours"].served()
    finally:
        _close(systems)
    total = sum(r["ref_lines"] for r in rows)
    known = sum(r["known"] for r in rows)
    out = {n: {"label": s.label, "pages_per_s": len(timed) / t[n], "same": per[n]["same"],
               "agreement": per[n]["same"] / total if total else 1.0, "known": per[n]["known"], "of_known": known,
               "ours_vs": t[n] / t["ours"]} for n, s in systems.items()}
    res = {"rows": rows, "systems": out, "pages": len(pages), "timed": len(timed), "ref_lines": total,
           "served": served, "cpu": cpu(),
           "rapid3": getattr(systems.get("rapid3_f32"), "worker", None) and systems["rapid3_f32"].worker.info,
           "passes": getattr(args, "passes", 1), "pass_ours_vs": per_pass(spread)}
    if getattr(args, "cores", 1) != 1:
        res["all_cores"] = all_cores(args, pages, got["ours"], got[REF], total)
    return res


def all_cores(args, pages: dict, ours_one: dict, ref: dict, ref_lines: int) -> dict:
    """The same pages at every core: ours as lanes (one page per core, each lane's engines at every core, as `/ocr`
    serves with serve.ocr_lanes: pipeline/ocr/lanes.py),
    RapidOCR 3.10 with its own thread settings (every core, one page at a time, as a user runs it); interleaved in
    two halves of the timed pages. Ours must read every page exactly as at one thread."""
    from pipeline.core.env import cpu_count

    cores = args.cores or cpu_count()
    systems = {"ours": OursLanes(args, cores), **_rapid3(args, pages[warmup_name(pages)], threads=0)}
    try:
        # two halves, the systems' order rotating: blocks of one page per lane would time every block at its slowest
        # page (a lane idles until its neighbour's bigger page is read); a half keeps the lanes fed as a stream does
        block = max(cores, -(-(len(pages) - 1) // 2))
        spread = {}
        got, t, timed = interleaved_blocks(systems, pages, block, getattr(args, "passes", 1), spread)
    finally:
        _close(systems)
    same = {n: sum(_agreement(got[n][i], ref[i]) for i in pages) for n in systems}
    return {"cores": cores, "lane_threads": systems["ours"].threads, "timed": len(timed), "block": block,
            "pass_ours_vs": per_pass(spread),
            "ours_differ_from_1_thread": [i for i in pages if got["ours"][i] != ours_one[i]],
            "systems": {n: {"label": s.label, "pages_per_s": len(timed) / t[n], "ours_vs": t[n] / t["ours"],
                            "same": same[n], "agreement": same[n] / ref_lines if ref_lines else 1.0}
                        for n, s in systems.items()}}


def per_pass(spread: dict) -> dict:
    """{system: [ours / it in each timed pass]} from each pass's seconds."""
    return {n: [v / o for v, o in zip(sec, spread["ours"])] for n, sec in spread.items()} if "ours" in spread else {}


def _pass_line(con, passes: int, ratios: dict) -> None:
    if passes > 1 and ratios:
        con.print(f"{passes} timed passes (pages/s above: the mean pass), ours / it in each: " + "; ".join(
            f"{n} " + " / ".join(f"{v:.2f}x" for v in r) for n, r in ratios.items() if n != "ours"))


def targets(res: dict) -> list[tuple[str, float, float, bool]]:
    """Issue 29's targets as (what, observed, limit, met): ours against each peer, from this one run."""
    s, cpu = res["systems"], res["cpu"]
    speed = 3.0 if cpu["avx512"] else 1.2
    out = [("ours: lines identical to the fp32 reference", s["ours"]["agreement"], TARGETS["agreement"]),
           ("ours: known texts read", s["ours"]["known"], s["ours"]["of_known"]),
           (f"ours / RapidOCR 1.4.4 pages/s ({'AVX-512' if cpu['avx512'] else 'no AVX-512'})", s[REF]["ours_vs"], speed)]
    if "rapid3_f32" in s:
        out.append(("ours / RapidOCR 3.10 OpenVINO f32 pages/s", s["rapid3_f32"]["ours_vs"], 1.0))
    if "rapid3_shipped" in s and cpu["bf16"]:
        out.append(("ours / RapidOCR 3.10 OpenVINO as shipped pages/s (bf16 CPU)", s["rapid3_shipped"]["ours_vs"], 1.0))
    a = res.get("all_cores")
    if a:
        out.append((f"ours at {a['cores']} cores: pages read as at 1 thread", a["timed"] + 1 -
                    len(a["ours_differ_from_1_thread"]), a["timed"] + 1))
        if "rapid3_shipped" in a["systems"] and cpu["bf16"] and a["cores"] >= 2:
            out.append((f"ours / RapidOCR 3.10 OpenVINO as shipped pages/s, {a['cores']} cores (bf16 CPU)",
                        a["systems"]["rapid3_shipped"]["ours_vs"], TARGETS["all_cores_vs_shipped"]))
    return [(what, float(v), float(lim), v >= lim - 1e-12) for what, v, lim in out]


def report(res: dict) -> bool:
    from rich.console import Console
    from rich.table import Table

    con, names = Console(width=190), list(res["systems"])
    t = Table(title="Per image (same = lines identical to RapidOCR 1.4.4's, the fp32 reference, at a box matched "
                    "at IoU >= 0.5)")
    t.add_column("image", no_wrap=True)
    t.add_column("ref lines", min_width=9)
    for n in names:
        t.add_column(f"{n}: lines/same/known", no_wrap=True)
    t.add_column("ours read", no_wrap=True)
    for r in res["rows"]:
        cell = lambda n, r=r: f"{r[n]['lines']}/{r[n]['same']}/" + (("yes" if r[n]["known"] else "NO") if r["known"]
                                                               else "-")
        t.add_row(r["image"], str(r["ref_lines"]), *[cell(n) for n in names], r["ours"]["read"])
    con.print(t)
    t = Table(title=f"{res['timed']} real images timed after one warm-up page (scored), 1 thread, timed interleaved "
                    f"(rotating order, {res.get('passes', 1)} pass(es))")
    for col in ("system", "what runs", "pages/s", "ours / it", "lines = fp32 reference", "known texts"):
        t.add_column(col, no_wrap=col != "what runs")
    for n, v in res["systems"].items():
        t.add_row(n, v["label"], f"{v['pages_per_s']:.3f}", f"{v['ours_vs']:.2f}x",
                  f"{v['same']}/{res['ref_lines']} = {v['agreement']:.3f}", f"{v['known']}/{v['of_known']}")
    con.print(t)
    _pass_line(con, res.get("passes", 1), res.get("pass_ours_vs"))
    a = res.get("all_cores")
    if a:
        t = Table(title=f"The same images at {a['cores']} cores ({a['timed']} timed after the warm-up page, interleaved in "
                        f"blocks of {a['block']} pages): ours {a['cores']} lanes x {a['lane_threads']} threads, RapidOCR 3.10 its own threads")
        for col in ("system", "what runs", "pages/s", "ours / it", "lines = fp32 reference"):
            t.add_column(col, no_wrap=col != "what runs")
        for n, v in a["systems"].items():
            t.add_row(n, v["label"], f"{v['pages_per_s']:.3f}", f"{v['ours_vs']:.2f}x",
                      f"{v['same']}/{res['ref_lines']} = {v['agreement']:.3f}")
        con.print(t)
        _pass_line(con, res.get("passes", 1), a.get("pass_ours_vs"))
    for role, p in res["served"].items():
        con.print(f"served {role}: {p['engine']} {p['precision']} (ran {p.get('effective_precision', '?')}): "
                  f"{p.get('why', '')}" + (f" [{p['cpu']}]" if p.get("cpu") else ""))
    met = targets(res)
    for what, v, lim, ok in met:
        con.print(f"{what}: {v:.3f} (target >= {lim:g}) {'ok' if ok else 'MISSED'}")
    return all(ok for *_, ok in met)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ppocr_v4_system.yaml", help="system config (without --bundle)")
    ap.add_argument("--bundle", default=None, help="a system bundle folder (as `make real-ocr` publishes)")
    ap.add_argument("--images", default=str(IMAGES))
    ap.add_argument("--engine", default=None, choices=("paddle-inference", "onnxruntime", "openvino", "reference"),
                    help="runtime of our parts (default: the config's system.engine; reference: with --bundle, each "
                         "part's fp32 reference)")
    ap.add_argument("--only-ours", action="store_true",
                    help="read the images with our system only (no peer; with --bundle, beside its fp32 reference)")
    ap.add_argument("--pin", action="append", metavar='PART="ENGINE PRECISION"',
                    help="with --bundle: serve that part on this row instead of the bundle's choice (repeatable)")
    ap.add_argument("--rapid3-python", default=None,
                    help="python of the RapidOCR 3.10 venv (`make rapidocr3-venv`): adds its two OpenVINO peers")
    ap.add_argument("--cores", type=int, default=0, help="the all-cores pass's lanes (default 0: every core; 1: the "
                                                         "1-thread pass only)")
    add_passes(ap)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    no_training()
    try:
        if args.only_ours:
            return 0 if read_only(args) else 1
        res = run(args)
        return finish(args.json, {**res, "targets": targets(res)}, report(res))
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
