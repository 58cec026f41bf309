"""Batching of concurrent requests, on vs off (`make bench-batching [BUNDLE=bundles/<name> | BUNDLE=ocr-models]`): `serve` started twice on one
bundle (`serve.batching.mode=on` and `=off`), the same request bodies sent to both at each concurrency level in
alternating rounds (neighbours' load hits both alike), bounded by a request count and a time limit.

A model bundle is sent its own sample images on POST /predict; an OCR system bundle the real images of
tests/data/real_images (as PNG) on POST /ocr. First prints what `mode=auto` decides on this machine (a third
`serve`, started and stopped before the A/B, answers GET /health), then req/s (pages/s for /ocr), client
p50/p90 and, from /health, how many requests each engine call served.

`--ocr-models` (no bundle): the page flow `/ocr` runs (ocr/service._PageRunner: detection per page, crops of
waiting pages recognised together) on the fetched PP-OCRv4 models with configs/ppocr_v4_system.yaml's settings and
engine, in-process (no HTTP: ~1 ms of a page's several hundred), the real images at concurrency 1 and 8.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import http_load

ROOT = Path(__file__).resolve().parent.parent


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read().decode())


def _bodies(bundle: Path) -> tuple[str, list[bytes]]:
    """(route, request bodies) for a bundle."""
    import numpy as np

    import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
    from pipeline.bundle import layout as bundle_layout
    from pipeline.bundle.format import load_infer_config

    if load_infer_config(bundle).get("task") == "ocr_system":
        from pipeline.data.preprocess import png_bytes

        return "/ocr", [png_bytes(page) for page in _real_pages("RGB")]
    with np.load(bundle / bundle_layout.SAMPLES_EXPECTED) as z:
        return "/predict", [(bundle / f).read_bytes() for f in z["files"]]


def _cmd(bundle: Path, port: int, mode: str, max_batch: int) -> list[str]:
    return http_load.serve_cmd(bundle, port) + ["-o", f"serve.batching.mode={mode}",
                                                "-o", f"serve.batching.max_batch={max_batch}"]


def _auto_choice(bundle: Path, max_batch: int) -> dict:
    port = http_load.free_port()
    with http_load.Server(_cmd(bundle, port, "auto", max_batch), port, "/health", timeout=600) as srv:
        return _get(srv.url + "/health")["batching"]


def _ocr_runners(threads: int, max_batch: int) -> tuple[dict, list]:
    """_PageRunner with batching on and off on the fetched v4 models (one engine set each: no instance is
    shared between the two), and the real pages (BGR)."""
    from concurrent.futures import ThreadPoolExecutor

    import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
    from pipeline.core.config import load_config
    from pipeline.tasks import ppocr_system
    from pipeline.serving.ocr_routes import _PageRunner
    from pipeline.ocr.ppocr_models import fetch

    sys_cfg = load_config([ROOT / "configs/ppocr_v4_system.yaml"])
    models = fetch()
    spec = ppocr_system.spec_from_configs(load_config([ROOT / sys_cfg.system.detection]), sys_cfg, models["keys"])
    runners = {}
    for mode in ("on", "off"):
        det, rec, cls = ppocr_system.engines(models, sys_cfg.system.engine, threads, ROOT / ".cache/ppocr/onnx")
        settings = {**sys_cfg.serve.batching.model_dump(), "mode": mode, "max_batch": max_batch}
        runners[f"batching {mode}"] = _PageRunner(det, rec, cls, spec, ThreadPoolExecutor(1), settings, max_pages=8)
    return runners, _real_pages("BGR")


def _real_pages(mode: str) -> list:
    """The real images /ocr accepts (short.png, 65x11, is refused as too thin to read: 400)."""
    from pipeline.core.errors import DataError
    from pipeline.data.imagedecode import decode_page

    out = []
    for p in sorted(p for p in (ROOT / "tests/data/real_images").iterdir() if p.suffix.lower() in (".png", ".jpg")):
        try:
            out.append(decode_page(p.read_bytes(), mode=mode))
        except DataError:
            continue
    return out


async def _pages_at(runner, pages: list, concurrency: int, repeat: int) -> float:
    import asyncio
    import time

    todo = iter([p for _ in range(repeat) for p in pages])

    async def worker():
        for page in todo:
            await runner(page)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


def ocr_flow(a) -> int:
    import asyncio

    from pipeline.core import env

    runners, pages = _ocr_runners(a.threads or env.cpu_count(), a.max_batch)
    auto = _auto_ocr(runners["batching on"], a.max_batch)
    print(f"page flow on the fetched PP-OCRv4 models ({runners['batching on'].det.kind}), {len(pages)} real pages; "
          f"mode=auto decides here: {'on' if auto['enabled'] else 'off'} ({auto['reason']})")
    for r in runners.values():
        asyncio.run(_pages_at(r, pages[:2], 1, 1))                   # warm-up
    for conc in (int(c) for c in a.concurrency.split(",")):
        secs = {k: 0.0 for k in runners}
        for i in range(a.rounds):
            for k in (list(runners) if i % 2 == 0 else list(runners)[::-1]):
                secs[k] += asyncio.run(_pages_at(runners[k], pages, conc, 1))
        n = a.rounds * len(pages)
        on, off = n / secs["batching on"], n / secs["batching off"]
        stats = runners["batching on"].coalescer.stats
        print(f"  concurrency {conc:2d}: batching on {on:.3f} pages/s, off {off:.3f} pages/s, on/off {on / off:.3f}x "
              f"({a.rounds} alternating rounds of {len(pages)} pages; recogniser calls so far served "
              f"{stats['items'] / max(stats['calls'], 1):.2f} pages each, largest {stats['largest']})")
    return 0


def _auto_ocr(runner, max_batch: int) -> dict:
    """What mode=auto decides for this recogniser (the measurement /ocr makes at start-up)."""
    from pipeline.serving.batching import DEFAULTS, decide

    spec, rec = runner.spec, runner.rec
    shape = [int(rec.input_shape[1]), int(spec.rec_pre["height"]), int(spec.rec_pre["width"])]
    return decide(rec.run, shape, {**DEFAULTS, "max_batch": max_batch}, base=int(spec.flow["rec_batch_num"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("bundle", type=Path, nargs="?")
    ap.add_argument("--ocr-models", action="store_true", help="the /ocr page flow on the fetched v4 models")
    ap.add_argument("--threads", type=int, default=0, help="--ocr-models: threads per engine (0 = all cores, as /ocr)")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=2000, help="requests per server and level (bounded by --seconds)")
    ap.add_argument("--seconds", type=float, default=20, help="time bound per server and level")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--max-batch", type=int, default=8)
    a = ap.parse_args()
    if a.ocr_models:
        return ocr_flow(a)
    route, bodies = _bodies(a.bundle)
    choice = _auto_choice(a.bundle, a.max_batch)
    print(f"{a.bundle.name}: {route}; mode=auto decides here: {'on' if choice['enabled'] else 'off'} ({choice['reason']})")
    ports = {m: http_load.free_port() for m in ("on", "off")}
    with http_load.Server(_cmd(a.bundle, ports["on"], "on", a.max_batch), ports["on"], "/health", timeout=600) as on, \
            http_load.Server(_cmd(a.bundle, ports["off"], "off", a.max_batch), ports["off"], "/health", timeout=600) as off:
        urls = {"batching on": on.url + route, "batching off": off.url + route}
        pids = {"batching on": on.proc.pid, "batching off": off.proc.pid}
        for conc in (int(c) for c in a.concurrency.split(",")):
            before = _get(on.url + "/health")["batching"]["stats"]
            res = http_load.compare(urls, bodies, n=a.requests, concurrency=conc, seconds=a.seconds, rounds=a.rounds,
                                    pids=pids)
            after = _get(on.url + "/health")["batching"]["stats"]
            calls, items = after["calls"] - before["calls"], after["items"] - before["items"]
            r_on, r_off = res["batching on"], res["batching off"]
            for name, r in res.items():
                cpu = "" if r["server_cpu_ms"] is None else f", server CPU {r['server_cpu_ms']:.2f} ms/request"
                print(f"  concurrency {conc:2d} {name:13s} {r['rps']:9.2f} req/s  p50 {r['client_p50_ms']:8.2f} ms  "
                      f"p90 {r['client_p90_ms']:8.2f} ms  {r['requests']} requests, {r['errors']} errors{cpu}")
            print(f"  concurrency {conc:2d} on/off req/s {r_on['rps'] / max(r_off['rps'], 1e-9):.3f}x; with batching "
                  f"on, {items / max(calls, 1):.2f} requests per engine call (largest so far {after['largest']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
