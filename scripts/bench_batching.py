"""Batching of concurrent requests, on vs off (`make bench-batching BUNDLE=...`): `serve` started twice on one
bundle (`serve.batching.mode=on` and `=off`), the same request bodies sent to both at each concurrency level in
alternating rounds (neighbours' load hits both alike), bounded by a request count and a time limit.

A model bundle is sent its own sample images on POST /predict; an OCR system bundle the real images of
tests/data/real_images (as PNG) on POST /ocr. First prints what `mode=auto` decides on this machine (a third
`serve`, started and stopped before the A/B, answers GET /health), then req/s (pages/s for /ocr), client
p50/p90 and, from /health, how many requests each engine call served.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import http_load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read().decode())


def _bodies(bundle: Path) -> tuple[str, list[bytes]]:
    """(route, request bodies) for a bundle."""
    import numpy as np

    import pipeline  # noqa: F401  (zlib before paddle)
    from pipeline import bundle_layout
    from pipeline.bundle import load_infer_config

    if load_infer_config(bundle).get("task") == "ocr_system":
        from pipeline.ocr.pages import decode_page
        from pipeline.preprocess import png_bytes

        files = sorted(p for p in (ROOT / "tests/data/real_images").iterdir() if p.suffix.lower() in (".png", ".jpg"))
        return "/ocr", [png_bytes(decode_page(p.read_bytes(), mode="BGR")[..., ::-1]) for p in files]
    with np.load(bundle / bundle_layout.SAMPLES_EXPECTED) as z:
        return "/predict", [(bundle / f).read_bytes() for f in z["files"]]


def _cmd(bundle: Path, port: int, mode: str, max_batch: int) -> list[str]:
    return http_load.serve_cmd(bundle, port) + ["-o", f"serve.batching.mode={mode}",
                                                "-o", f"serve.batching.max_batch={max_batch}"]


def _auto_choice(bundle: Path, max_batch: int) -> dict:
    port = http_load.free_port()
    with http_load.Server(_cmd(bundle, port, "auto", max_batch), port, "/health", timeout=600) as srv:
        return _get(srv.url + "/health")["batching"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=2000, help="requests per server and level (bounded by --seconds)")
    ap.add_argument("--seconds", type=float, default=20, help="time bound per server and level")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--max-batch", type=int, default=8)
    a = ap.parse_args()
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
