"""HTTP for the OCR system bundle: POST /ocr (a page image) → lines with boxes and scores; GET /health.

Same service conventions as pipeline/serving/predict.py (size-capped body, 400/413/415 with a message, an
engine fault 500 in one line, one predictor thread, pages decoded on the prep pool, latency header): its
helpers are reused, only the route differs. The flow is pipeline/ocr/system's, the very one the system stage
gated; at most serve.max_boxes_per_page boxes of a page are read, and the answer says when it capped
("boxes_found", "truncated").
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from fastapi import Request

from pipeline.core.errors import DataError, PipelineError
from pipeline.serving.http_common import (MAX_BODY_BYTES, MAX_BOXES_PER_PAGE, MAX_CONCURRENCY, MAX_PIXELS,
                                          REQUEST_TIMEOUT_S, BackgroundServer, _BadRequest, base_app, decode_refusal,
                                          image_upload, off_loop, read_body)


async def _page_from_request(request, max_body: int, max_pixels: int, prep: ThreadPoolExecutor) -> np.ndarray:
    """The whole page, full resolution, BGR (crops are cut from it): the body read on the event loop, decoded
    on the prep pool (a 16-megapixel page takes a good part of a second)."""
    body = await read_body(request, max_body)
    if not body:
        raise _BadRequest(400, "empty request body: send a page image (image/png or image/jpeg)")
    body = await image_upload(request, body, what="page")
    return await off_loop(prep, _decode_page, body, max_pixels)


def _decode_page(body: bytes, max_pixels: int) -> np.ndarray:
    """pipeline/imagedecode.decode_page in colour (the PP-OCR models read BGR); refusals as _BadRequest."""
    from pipeline.data.imagedecode import decode_page

    try:
        return decode_page(body, mode="BGR", max_pixels=max_pixels)
    except DataError as exc:
        raise decode_refusal(exc) from None


class _PageRunner:
    """Reads one page on the worker thread. With batching on (PaddleOCR's flow, measured to pay on the
    recogniser), detection runs per page and the crops of pages that wait for the recogniser together are
    recognised together (ocr/system.recognize_pages: every crop sees the input it would alone); a page
    that finds the recogniser idle runs at once. max_boxes: boxes read per page (0: all)."""

    def __init__(self, det, rec, cls, spec, pool: ThreadPoolExecutor, settings: dict, max_pages: int,
                 max_boxes: int = 0):
        from pipeline.serving.batching import Coalescer, decide

        self.det, self.rec, self.cls, self.spec, self.pool = det, rec, cls, spec, pool
        self.max_boxes = max_boxes
        if spec.paddleocr:
            shape = [int(rec.input_shape[1]), int(spec.rec_pre["height"]), int(spec.rec_pre["width"])]
            # a page alone already runs full batches of rec_batch_num crops: merging pays only beyond that
            self.batching = {**decide(rec.run, shape, settings, base=int(spec.flow["rec_batch_num"])),
                             "unit": "crops per recogniser call"}
        else:        # the built-in flow reads a page's crops in one call already
            self.batching = {**decide(None, None, {**settings, "mode": "off"}),
                             "reason": "built-in (stretch) flow: each page's crops are recognised in one call"}
        self.coalescer = Coalescer(self._recognize, max_batch=max_pages) if self.batching["enabled"] else None

    async def __call__(self, page: np.ndarray) -> tuple[list[dict], int]:
        """→ (the page's lines, boxes detected on it: more than max_boxes when it was capped)."""
        from pipeline.ocr.system import needs_turn_check, page_crops, page_lines, read_page, retry_needed, settle_turns

        loop = asyncio.get_running_loop()
        if self.coalescer is None:
            return await loop.run_in_executor(self.pool, read_page, page, self.det, self.rec, self.spec, self.cls,
                                              self.max_boxes)
        for scale in (1.0, float(self.spec.flow.get("retry_scale", 0))):      # read_page's retry, coalesced
            pc = await loop.run_in_executor(self.pool, page_crops, page, self.det, self.spec, self.cls,
                                            self.max_boxes, scale)
            texts, scores = (await self.coalescer.submit(pc.crops)) if pc.crops else ([], [])
            if needs_turn_check(pc, self.spec):
                texts, scores = list(texts), list(scores)
                await loop.run_in_executor(self.pool, settle_turns, pc.crops, pc.angles, texts, scores, self.rec,
                                           self.spec)
            lines = page_lines(pc, texts, scores, self.spec)
            if not retry_needed(lines, self.spec):
                break
        return lines, pc.found

    async def _recognize(self, crop_sets: list) -> list:
        from pipeline.ocr.system import recognize_pages

        step = self.batching["max_batch"] if len(crop_sets) > 1 else 0     # one page: PaddleOCR's batches as is
        return await asyncio.get_running_loop().run_in_executor(self.pool, recognize_pages, crop_sets, self.rec,
                                                                self.spec, step)


class _LaneRunner:
    """serve.ocr_lanes > 1: each page read whole on the first free lane (pipeline/ocr/lanes.PageLanes: one engine set
    per lane on its own thread), up to `lanes` pages at once; the recogniser is not shared, so nothing coalesces."""

    def __init__(self, lanes, max_boxes: int = 0):
        from pipeline.serving.batching import decide

        self.lanes, self.max_boxes, self.coalescer = lanes, max_boxes, None
        self.free = asyncio.Semaphore(lanes.lanes)        # a page is submitted only when a lane is free
        self.batching = {**decide(None, None, {"mode": "off"}),
                         "reason": f"{lanes.lanes} lanes (serve.ocr_lanes): each page is read whole on its own "
                                   "engine set, side by side"}

    async def __call__(self, page: np.ndarray) -> tuple[list[dict], int]:
        async with self.free:
            return await asyncio.wrap_future(self.lanes.submit(page, self.max_boxes))


def create_ocr_app(system: tuple, cfg: dict, *, max_body: int = MAX_BODY_BYTES, name: str = "ocr",
                   versions: dict | None = None, log_requests: bool = True, max_pixels: int = MAX_PIXELS,
                   max_concurrency: int = MAX_CONCURRENCY, batching: dict | None = None,
                   request_timeout_s: float | None = REQUEST_TIMEOUT_S, max_boxes: int = MAX_BOXES_PER_PAGE,
                   lanes=None):
    """/ocr for a loaded system: (det, rec, cls or None, spec) engines, and the system bundle's infer config;
    limits and batching as in predict.create_app_from_model; max_boxes: boxes read per page (0: all).
    lanes: a PageLanes whose first engine set is `system` (serve.ocr_lanes > 1; closed when the app shuts down),
    else pages one at a time.
    serving/app.py loads the system from its bundle."""
    from pipeline.core import env
    from pipeline.serving.batching import DEFAULTS
    from pipeline.serving.batching import state as batching_state

    det, rec, cls, spec = system
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ocr")     # predictors are not thread-safe
    runner = _LaneRunner(lanes, max_boxes) if lanes is not None and lanes.lanes > 1 else \
        _PageRunner(det, rec, cls, spec, pool, DEFAULTS if batching is None else batching, max_concurrency, max_boxes)

    app = base_app(name, pool, max_concurrency=max_concurrency, log_requests=log_requests, max_body=max_body,
                   request_timeout_s=request_timeout_s, on_shutdown=[lanes.close] if lanes is not None else [])

    # per part: the engine and precision that run, and why (recommended / pinned / re-ranked for this CPU)
    served = {role: getattr(e, "serving", None) or {"engine": e.kind, "precision": e.effective_precision}
              for role, e in (("detection", det), ("recognition", rec), ("classifier", cls)) if e is not None}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "task": "ocr_system", "fields": cfg.get("fields"), "engine": det.kind,
                "served": served, "batching": batching_state(runner.batching, runner.coalescer),
                "versions": versions or env.versions()}

    from pipeline.serving.kserve import add_health_routes           # GET /v2/health/live|ready (KServe probes)

    add_health_routes(app, versions or env.versions())

    @app.post("/ocr")
    async def ocr(request: Request):
        page = await _page_from_request(request, max_body, max_pixels, app.state.prep)
        t0 = time.perf_counter()
        lines, found = await runner(page)
        answer = {"model": name, "width": int(page.shape[1]), "height": int(page.shape[0]), "lines": lines,
                  "boxes_found": found, "truncated": bool(max_boxes) and found > max_boxes,
                  "inference_ms": round((time.perf_counter() - t0) * 1e3, 3),
                  "served": {r: f"{p['engine']} {p['precision']}" for r, p in served.items()}}
        if answer["truncated"]:
            order = "reading order" if spec.paddleocr else "detection order"
            answer["note"] = (f"{found} text boxes found; the first {max_boxes} in {order} were read "
                              "(serve.max_boxes_per_page)")
        return answer

    app.state.engine, app.state.endpoints = det, "POST /ocr, GET /health, GET /v2/health/live|ready"     # `serve` logs both
    # what each loaded part really runs (its engine's own evidence): the HTTP gate's effective precision
    app.state.parts = {role: {"engine": e.kind, "precision": e.effective_precision}
                       for role, e in (("detection", det), ("recognition", rec), ("classifier", cls)) if e is not None}
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
