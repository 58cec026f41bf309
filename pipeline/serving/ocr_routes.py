"""HTTP for the OCR system bundle: POST /ocr (a page image) → lines with boxes and scores; GET /health.

Same service conventions as pipeline/serving/app.py (size-capped body, 400/413/415 with a message, one
predictor thread, latency header): its helpers are reused, only the route differs. The flow is
pipeline/ocr/system.read_pages, the very function the system stage gated.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from fastapi import Request

from pipeline.core.errors import DataError, PipelineError
from pipeline.serving.http_common import (MAX_BODY_BYTES, MAX_CONCURRENCY, MAX_PIXELS, BackgroundServer, _BadRequest, base_app,
                     decode_refusal, image_upload, read_body)


async def _page_from_request(request, max_body: int, max_pixels: int) -> np.ndarray:
    """The whole page, full resolution, BGR (crops are cut from it), through pipeline/imagedecode.decode_page."""
    from pipeline.data.imagedecode import decode_page

    body = await read_body(request, max_body)
    if not body:
        raise _BadRequest(400, "empty request body: send a page image (image/png or image/jpeg)")
    body = await image_upload(request, body, what="page")
    try:
        return decode_page(body, mode="BGR", max_pixels=max_pixels)   # colour: the PP-OCR models read BGR
    except DataError as exc:
        raise decode_refusal(exc) from None


class _PageRunner:
    """Reads one page on the worker thread. With batching on (PaddleOCR's flow, measured to pay on the
    recogniser), detection runs per page and the crops of pages that wait for the recogniser together are
    recognised together (ocr/system.recognize_pages: every crop sees the input it would alone); a page
    that finds the recogniser idle runs at once."""

    def __init__(self, det, rec, cls, spec, pool: ThreadPoolExecutor, settings: dict, max_pages: int):
        from pipeline.serving.batching import Coalescer, decide

        self.det, self.rec, self.cls, self.spec, self.pool = det, rec, cls, spec, pool
        if spec.paddleocr:
            shape = [int(rec.input_shape[1]), int(spec.rec_pre["height"]), int(spec.rec_pre["width"])]
            # a page alone already runs full batches of rec_batch_num crops: merging pays only beyond that
            self.batching = {**decide(rec.run, shape, settings, base=int(spec.flow["rec_batch_num"])),
                             "unit": "crops per recogniser call"}
        else:        # the built-in flow reads a page's crops in one call already
            self.batching = {**decide(None, None, {**settings, "mode": "off"}),
                             "reason": "built-in (stretch) flow: each page's crops are recognised in one call"}
        self.coalescer = Coalescer(self._recognize, max_batch=max_pages) if self.batching["enabled"] else None

    async def __call__(self, page: np.ndarray) -> list[dict]:
        from pipeline.ocr.system import page_crops, page_lines, read_pages

        loop = asyncio.get_running_loop()
        if self.coalescer is None:
            return await loop.run_in_executor(self.pool, lambda: read_pages([page], self.det, self.rec, self.spec,
                                                                            cls=self.cls)[0])
        pc = await loop.run_in_executor(self.pool, page_crops, page, self.det, self.spec, self.cls)
        texts, scores = (await self.coalescer.submit(pc.crops)) if pc.crops else ([], [])
        return page_lines(pc, texts, scores, self.spec)

    async def _recognize(self, crop_sets: list) -> list:
        from pipeline.ocr.system import recognize_pages

        step = self.batching["max_batch"] if len(crop_sets) > 1 else 0     # one page: PaddleOCR's batches as is
        return await asyncio.get_running_loop().run_in_executor(self.pool, recognize_pages, crop_sets, self.rec,
                                                                self.spec, step)


def create_ocr_app(system: tuple, cfg: dict, *, max_body: int = MAX_BODY_BYTES, name: str = "ocr",
                   versions: dict | None = None, log_requests: bool = True, max_pixels: int = MAX_PIXELS,
                   max_concurrency: int = MAX_CONCURRENCY, batching: dict | None = None):
    """/ocr for a loaded system: (det, rec, cls or None, spec) engines, and the system bundle's infer config;
    limits and batching as in predict.create_app_from_model. serving/app.py loads the system from its bundle."""
    from pipeline.core import env
    from pipeline.serving.batching import DEFAULTS
    from pipeline.serving.batching import state as batching_state

    det, rec, cls, spec = system
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ocr")     # predictors are not thread-safe
    runner = _PageRunner(det, rec, cls, spec, pool, DEFAULTS if batching is None else batching,
                         max_concurrency)

    app = base_app(name, pool, max_concurrency=max_concurrency, log_requests=log_requests, max_body=max_body)

    # per part: the engine and precision that run, and why (recommended / pinned / re-ranked for this CPU)
    served = {role: getattr(e, "serving", None) or {"engine": e.kind, "precision": e.effective_precision}
              for role, e in (("detection", det), ("recognition", rec), ("classifier", cls)) if e is not None}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "task": "ocr_system", "fields": cfg.get("fields"), "engine": det.kind,
                "served": served, "batching": batching_state(runner.batching, runner.coalescer),
                "versions": versions or env.versions()}

    @app.post("/ocr")
    async def ocr(request: Request):
        page = await _page_from_request(request, max_body, max_pixels)
        t0 = time.perf_counter()
        lines = await runner(page)
        return {"model": name, "width": int(page.shape[1]), "height": int(page.shape[0]), "lines": lines,
                "inference_ms": round((time.perf_counter() - t0) * 1e3, 3),
                "served": {r: f"{p['engine']} {p['precision']}" for r, p in served.items()}}

    app.state.engine, app.state.endpoints = det, "POST /ocr, GET /health"     # `serve` logs both
    app.state.batching = runner.batching
    return app


def ocr_over_http(app, pages: list[np.ndarray], *, timeout: float = 60.0) -> dict:
    """Serve an /ocr app on a free 127.0.0.1 port, POST each page as PNG to /ocr, time it."""
    import httpx
    from pipeline.engines.perf import summarize_ms
    from pipeline.data.preprocess import png_bytes

    lines, times = [], []
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=timeout) as client:
        try:
            for page in pages:
                body = png_bytes(page)
                t0 = time.perf_counter()
                r = client.post("/ocr", content=body, headers={"content-type": "image/png"})
                times.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    raise PipelineError(f"HTTP /ocr answered {r.status_code}: {r.text[:200]}")
                lines.append(r.json()["lines"])
        except httpx.HTTPError as exc:
            raise PipelineError(f"HTTP request to {srv.url}/ocr failed: {exc!r}") from None
    return {"lines": lines, "latency_ms": {**summarize_ms(times), "repeats": len(times)}}
