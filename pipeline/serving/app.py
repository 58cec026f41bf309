"""`python -m pipeline serve BUNDLE`: opens and verifies a bundle, loads what it serves, and assembles the app.

The only serving module that reads a bundle: the route modules (predict.py: /predict and KServe v2;
ocr_routes.py: /ocr) are handed loaded engines, so a request never leaves serving, engines and the part it runs.
"""
from __future__ import annotations

import gc
import logging
import socket
from pathlib import Path

import numpy as np

from pipeline.bundle import layout
from pipeline.bundle.format import load_infer_config, open_bundle, verify_hashes
from pipeline.bundle.serving_choice import load_engine
from pipeline.bundle.verify import check_signature
from pipeline.core import tempdirs
from pipeline.serving.batching import describe
from pipeline.serving.http_common import MAX_BODY_BYTES, bind
from pipeline.serving.limits import HttpLimits, stop_quietly_on_sigterm, uvicorn_config
from pipeline.serving.predict import create_app_from_model

log = logging.getLogger("pipeline.serving.app")


def create_app(bundle: str | Path, *, threads: int = 0, max_body: int = MAX_BODY_BYTES, key: str | Path | None = None,
               archive_limits: tuple[int, int] | None = None, engine: str | None = None,
               precision: str | None = None, **limits):
    """App for a bundle folder or .tar.gz; the signature (with a key) and every hash are checked before
    Paddle parses any file. limits: max_pixels, max_concurrency (see create_app_from_model).
    engine: override the bundle's recommended engine (paddle-inference | onnxruntime | openvino); precision: its
    precision (default: the recommended one for the recommended engine, fp32 for another).
    limits also takes request_timeout_s (every app) and max_boxes (/ocr: boxes read per page)."""
    scratch = tempdirs.directory("serve-bundle")
    folder = open_bundle(Path(bundle), Path(scratch.name), *(archive_limits or ()))
    signature = check_signature(folder, key)
    manifest = verify_hashes(folder)
    cfg = load_infer_config(folder)
    if cfg.get("task") == "ocr_system":          # two models and POST /ocr: pipeline/serving/ocr_routes.py
        app = _ocr_app(folder, cfg, threads=threads, max_body=max_body, name=manifest.get("name"),
                       versions=manifest.get("versions"), **limits)
    else:
        limits.pop("max_boxes", None)            # /ocr only
        limits.pop("ocr_lanes", None)
        app = create_app_from_model(str(folder / layout.reference_of(cfg)[1]), cfg, threads=threads,
                                    max_body=max_body, name=manifest.get("name") or folder.name,
                                    versions=manifest.get("versions"),
                                    engine=load_engine(folder, cfg, engine, threads, precision), **limits)
        app.state.batching_recorded = (cfg.get("serving") or {}).get("batching")    # what the server stage measured
    app.state.scratch = scratch          # an extracted archive lives as long as the app
    app.state.signature = signature
    return app


def _ocr_app(folder: Path, cfg: dict, *, threads: int = 0, ocr_lanes: int = 1, **kw):
    """/ocr for an (already hash-verified) system bundle: its parts loaded as the bundle says they are served.
    ocr_lanes > 1 (serve.ocr_lanes): that many engine sets, each at `threads` (default: every core, so a page read
    while the other lanes idle gets them all), read pages side by side (pipeline/ocr/lanes.py); 1: one set at
    `threads` (default: every core), one page at a time."""
    from pipeline.bundle.system import served_system
    from pipeline.core import env
    from pipeline.serving.ocr_routes import create_ocr_app

    name = kw.pop("name", None) or folder.name
    if ocr_lanes > 1:
        from pipeline.ocr.lanes import PageLanes

        lanes = PageLanes(lambda: served_system(folder, threads or env.cpu_count()), ocr_lanes)
        return create_ocr_app(lanes.sets[0], cfg, name=name, lanes=lanes, **kw)
    det, rec, cls, spec = served_system(folder, threads or env.cpu_count())
    return create_ocr_app((det, rec, cls, spec), cfg, name=name, **kw)


def http_ocr_gate(folder: Path, pages: list[np.ndarray], *, threads: int = 0, timeout: float = 60.0) -> dict:
    """A system bundle's /ocr over HTTP on the given pages (see ocr_routes.ocr_over_http)."""
    from pipeline.serving.ocr_routes import ocr_over_http

    # the gate compares whole pages with the in-process read: no box cap, no time budget (httpx's timeout bounds it)
    app = _ocr_app(Path(folder), load_infer_config(folder), threads=threads, log_requests=False, max_boxes=0,
                   request_timeout_s=None)
    return {**ocr_over_http(app, pages, timeout=timeout), "parts": app.state.parts}


# ------------------------------------------------------------------------------------ running


def serve(bundle: str | Path, host: str = "127.0.0.1", port: int = 8000, threads: int = 0,
          sock: socket.socket | None = None, limits: HttpLimits | None = None, **app_kw) -> None:
    """Serve until interrupted or SIGTERM (in-flight requests get limits.grace_s to finish); sock: an
    already bound listening socket (else host:port is bound here)."""
    import uvicorn

    sock = sock or bind(host, port)    # a busy port fails here, before the model loads or "serving" prints
    host, port = sock.getsockname()[:2]
    try:
        app = create_app(bundle, threads=threads, **app_kw)
        # the loaded runtimes are millions of long-lived objects: frozen, the collector stops walking them (full
        # collections were ~8 % of a tiny model's batch-1 CPU time in a serving loop, measured with perf)
        gc.collect()
        gc.freeze()
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("binding %s exposes the service beyond this machine; it has no authentication", host)
        log.info("bundle %s", app.state.signature)
        log.info("serving %s with %s %s on http://%s:%d (%s)", bundle, app.state.engine.kind,
                 app.state.engine.effective_precision, host, port,
                 app.state.endpoints)
        log.info("%s", describe(app.state.batching))
        recorded = getattr(app.state, "batching_recorded", None)
        if recorded:
            log.info("  the bundle's record (server stage, build machine): %s", describe(recorded))
        log.info("request log: %s", "one line per request" if app_kw.get("log_requests") else
                 f"a summary line per {app.state.traffic.every_s:g} s of traffic (serve.access_log=true: one per request)")
        stop_quietly_on_sigterm()
        uvicorn.Server(uvicorn_config(app, limits)).run(sockets=[sock])
        log.info("stopped")
    finally:
        sock.close()

