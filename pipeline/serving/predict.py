"""`python -m pipeline serve BUNDLE`: an HTTP inference service (FastAPI + uvicorn) and its gate.

GET  /health   status, model name, task, input shape, versions
POST /predict  an image (multipart file, or a raw image/png|image/jpeg body) or JSON
               {"inputs": [...]} holding a preprocessed float tensor [N,C,H,W] or [C,H,W];
               `?outputs=1` also returns the raw model outputs as JSON lists; `?outputs=b64` as
               {"dtype": "float32", "shape": [...], "data": base64 of the little-endian bytes}
               (the server stage's gate: a 736x736 detection map is ~5 MB of JSON numbers to write and parse).
Bad input is answered 400/413/415 with a message, an engine fault 500 with one line. Images go through the same
pipeline.data.preprocess path as training, so served predictions cannot drift from the gated ones. Decoding,
pre- and post-processing run on the prep pool (http_common.off_loop) unless the input is tiny, so /health and
the 429s of the concurrency limit answer at once whatever is being decoded.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from fastapi import Request   # module level: FastAPI resolves the (string) annotations from globals

from pipeline.core.errors import DataError, PipelineError
from pipeline.serving.batching import DEFAULTS as BATCHING, served_shape
from pipeline.serving.batching import state as batching_state
from pipeline.serving.http_common import (INLINE_BYTES, MAX_BATCH, MAX_BODY_BYTES, MAX_CONCURRENCY, MAX_PIXELS,
                                          REQUEST_TIMEOUT_S, BackgroundServer, _BadRequest, base_app, decode_refusal,
                                          decodes_inline, image_upload, off_loop, read_body)

INLINE_OUTPUTS = 4096      # output elements answered on the event loop; bigger (a detection map) on the prep pool


def create_app_from_model(model_prefix: str, infer_cfg: dict, *, threads: int = 0, max_body: int = MAX_BODY_BYTES,
                          name: str | None = None, versions: dict | None = None, log_requests: bool = False,
                          max_pixels: int = MAX_PIXELS, max_concurrency: int = MAX_CONCURRENCY, engine=None,
                          batching: dict | None = None, request_timeout_s: float | None = REQUEST_TIMEOUT_S):
    """App for an exported model + the infer_config structure (used by the server stage before a bundle exists).

    engine: an already loaded pipeline.engines.base.Engine to serve (default: Paddle Inference on model_prefix);
    max_pixels: images above it get 413 from their header, before decoding; max_concurrency: requests in
    progress at once (bodies + decoded images held in memory), more get 429; request_timeout_s: a request's
    budget from its headers to its answer (408/503 past it; None: no budget). log_requests: one log line per
    request (serve.access_log); otherwise a traffic summary line per minute."""
    from fastapi.responses import Response

    from pipeline.core import env
    from pipeline.tasks import get_task

    engine = _checked_engine(model_prefix, infer_cfg, engine, threads)
    task = get_task(infer_cfg["task"], infer_cfg["postprocess"])
    want = [d if isinstance(d, int) and d > 0 else None for d in infer_cfg["input"]["shape"]]
    name = name or Path(model_prefix).parent.name
    # one worker thread owns the predictor: it is not thread-safe, and the event loop stays free
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor")
    runner = _Runner(engine, pool, BATCHING if batching is None else batching,
                     served_shape(infer_cfg["input"]["shape"], infer_cfg["preprocess"])[1:])
    app = base_app(name, pool, max_concurrency=max_concurrency, log_requests=log_requests, max_body=max_body,
                   request_timeout_s=request_timeout_s)
    prep = app.state.prep

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "task": task.name, "input": infer_cfg["input"],
                "batching": batching_state(runner.batching, runner.coalescer),
                "versions": versions or env.versions()}

    answer = functools.partial(_answer, task, name, infer_cfg["postprocess"])

    async def predict(request: Request):
        x, sizes = await _read_input(request, infer_cfg, want, max_body, max_pixels, prep)
        t0 = time.perf_counter()
        try:
            out = await runner(x)
        except DataError as exc:             # shape/dtype the engine refused; other faults: http_common.fault (500)
            raise _BadRequest(400, exc.one_line()) from None
        how = request.query_params.get("outputs", "0").lower() if request.scope["query_string"] else None
        args = (out, sizes, how, t0)
        text = answer(*args) if out.size <= INLINE_OUTPUTS else await off_loop(prep, answer, *args)
        return Response(text, media_type="application/json")

    # POST is answered by _HotRoutes, ahead of the router; the endpoint takes no typed parameters (FastAPI's per-request
    # dependency solving cost ~0.07 ms, measured in-process). Registered with the router too: other methods get 405
    app.state.hot_routes["/predict"] = predict
    app.add_route("/predict", predict, methods=["POST"])

    from pipeline.serving.kserve import add_v2_routes               # KServe v2 / Open Inference Protocol under /v2

    add_v2_routes(app, name=name, runner=runner, input_shape=want, output_name="output",
                  versions=versions or env.versions(), max_body=max_body)
    app.state.engine, app.state.runner, app.state.batching = engine, runner, runner.batching
    app.state.endpoints = "POST /predict, GET /health, KServe v2 under /v2"
    return app


def _answer(task, name: str, post: dict, out: np.ndarray, sizes: list | None, how: str | None, t0: float) -> str:
    """The /predict answer body: decoded predictions (+ raw outputs when asked), as a JSON string."""
    preds = task.decode(out, post, sizes) if sizes else task.decode(out, post)
    body = {"model": name, "task": task.name, "predictions": preds,
            "inference_ms": round((time.perf_counter() - t0) * 1e3, 3)}
    if how:
        _add_outputs(body, out, how)
    # json.dumps straight to a string: FastAPI's jsonable_encoder walk cost ~5x more than the encoding
    return json.dumps(body, separators=(",", ":"))


def _checked_engine(model_prefix: str, infer_cfg: dict, engine, threads: int):
    """The engine to serve, once the infer config has every section a request needs."""
    from pipeline.core import env
    from pipeline.engines.paddle_infer import InferenceEngine

    for key in ("preprocess", "postprocess", "task", "input"):
        if key not in infer_cfg:
            raise DataError(f"infer config has no '{key}' section", hint="see stages/bundle.py infer_config()")
    return engine if engine is not None else InferenceEngine(model_prefix, "fp32", threads=threads or env.cpu_count())


class _Runner:
    """Runs the engine for a request.

    Batch-1 inputs of a ShapeRouted engine whose batch-1 call is well under a millisecond run inline
    on the event loop: the thread-pool hop costs more than such a model (measured ~0.15 ms per
    request) and the event loop is blocked for less than a JSON parse. The batch-1 instance is then
    only ever touched by the loop thread and the batched one only by the worker thread, so neither
    predictor is shared between threads. Everything else goes to the worker thread; with batching on
    (pipeline/serving/batching.py, decided by measurement at start-up) concurrent requests share its calls.
    """

    INLINE_MS = 1.0

    def __init__(self, engine, pool: ThreadPoolExecutor, batching: dict | None = None,
                 sample_shape: list | None = None):
        from pipeline.serving.batching import Coalescer, decide
        from pipeline.engines.base import ShapeRouted

        self.engine, self.pool = engine, pool
        self.batching = decide(engine.run, sample_shape or engine.input_shape[1:], batching or {"mode": "off"})
        self.batch1_ms = _probe_ms(engine) if isinstance(engine, ShapeRouted) else None
        self.inline = (not self.batching["enabled"] and self.batch1_ms is not None
                       and self.batch1_ms < self.INLINE_MS)
        self.coalescer = Coalescer(self._run_many, max_batch=self.batching["max_batch"],
                                   max_wait_ms=self.batching["max_wait_ms"], size=len,
                                   key=lambda x: x.shape[1:]) if self.batching["enabled"] else None

    async def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.coalescer is not None and len(x) < self.coalescer.max_batch:
            return await self.coalescer.submit(x)
        if self.inline and len(x) == 1:
            return self.engine.run(x)
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.engine.run, x)

    async def _run_many(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        from pipeline.serving.batching import split_rows

        x = xs[0] if len(xs) == 1 else np.concatenate(xs)
        out = await asyncio.get_running_loop().run_in_executor(self.pool, self.engine.run, x)
        return split_rows(out, [len(a) for a in xs])


def _probe_ms(engine) -> float | None:
    """Median batch-1 time on zeros (also warms the instance up); None when a non-batch dim is free."""
    shape = [1, *engine.input_shape[1:]]
    if any(d <= 0 for d in shape):
        return None
    x = np.zeros(shape, np.float32)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        engine.run(x)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]) * 1e3)


async def _read_input(request, infer_cfg: dict, want: list, max_body: int, max_pixels: int, prep
                      ) -> tuple[np.ndarray, list | None]:
    """→ (model input, original (h, w) per image where the task maps its output back to it, else None).
    The body is read on the event loop; parsing and decoding run on the prep pool unless tiny."""
    body = await read_body(request, max_body)
    if not body:
        raise _BadRequest(400, "empty request body: send an image or JSON {\"inputs\": [...]}")
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        x = _json_tensor(body, want) if len(body) <= INLINE_BYTES else await off_loop(prep, _json_tensor, body, want)
        return x, None
    body = await image_upload(request, body)
    if decodes_inline(body):
        return _decode_input(body, infer_cfg, max_pixels)
    return await off_loop(prep, _decode_input, body, infer_cfg, max_pixels)


def _decode_input(body: bytes, infer_cfg: dict, max_pixels: int) -> tuple[np.ndarray, list | None]:
    """Image bytes → (model input, [page (h, w)] for a detection task else None); refusals as _BadRequest."""
    from pipeline.data.preprocess import decode_image_bytes, to_tensor

    try:
        if infer_cfg["task"] == "detection":      # boxes come back in the page's own pixels
            from pipeline.ocr.pages import decode_page, detection_input

            page = decode_page(body, max_pixels)
            return detection_input(page, infer_cfg["preprocess"]), [page.shape[:2]]
        img = decode_image_bytes(body, infer_cfg["preprocess"], max_pixels=max_pixels)
    except DataError as exc:
        raise decode_refusal(exc) from None
    return to_tensor(img[None], infer_cfg["preprocess"]), None


def _json_tensor(body: bytes, want: list) -> np.ndarray:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _BadRequest(400, f"body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise _BadRequest(400, "JSON body must be an object with an 'inputs' array")
    try:
        arr = np.asarray(doc["inputs"])
    except ValueError:                           # numpy refuses ragged nesting
        arr = np.asarray([], dtype=object)
    if arr.dtype == object:
        raise _BadRequest(400, "'inputs' must be a rectangular nested array of numbers")
    if arr.dtype.kind not in "iuf" or arr.size == 0:
        raise _BadRequest(400, f"'inputs' must hold numbers, got dtype {arr.dtype} with {arr.size} values")
    if arr.ndim == len(want) - 1:
        arr = arr[None]
    shape_ok = arr.ndim == len(want) and all(w is None or g == w for g, w in zip(arr.shape, want))
    if not shape_ok:
        expect = ["N" if w is None else w for w in want]
        raise _BadRequest(400, f"'inputs' shape {list(arr.shape)} does not match the model input {expect} "
                               f"(or {expect[1:]} for one sample)")
    if len(arr) > MAX_BATCH:
        raise _BadRequest(400, f"batch of {len(arr)} exceeds the limit of {MAX_BATCH}")
    if not np.isfinite(arr).all():
        raise _BadRequest(400, "'inputs' contains NaN or Inf")
    limit = float(np.finfo(np.float32).max)
    if arr.dtype.kind == "f" and np.abs(arr).max() > limit:      # would become Inf as float32
        raise _BadRequest(400, f"'inputs' holds {np.abs(arr).max():.4g}, outside the float32 range (|x| <= {limit:.4g})")
    return arr.astype(np.float32)


def _add_outputs(body: dict, out: np.ndarray, how: str) -> None:
    if how in ("1", "true", "yes"):
        body["outputs"] = out.tolist()
    elif how == "b64":
        body["outputs_b64"] = {"dtype": "float32", "shape": list(out.shape),
                               "data": base64.b64encode(np.ascontiguousarray(out, "<f4").tobytes()).decode()}


def outputs_of(answer: dict) -> np.ndarray:
    """The raw outputs of a /predict answer asked with ?outputs=1 or ?outputs=b64."""
    if "outputs_b64" in answer:
        b = answer["outputs_b64"]
        return np.frombuffer(base64.b64decode(b["data"]), "<f4").reshape(b["shape"])
    return np.asarray(answer["outputs"], dtype=np.float32)


def http_gate(model_prefix: str, infer_cfg: dict, images_uint8: np.ndarray, labels: np.ndarray, task_name: str,
              *, max_requests: int, threads: int = 0, timeout: float = 30.0, engine=None,
              batching: dict | None = None) -> dict:
    """Serve the model on a free 127.0.0.1 port, POST up to max_requests images as PNG (one per request),
    score the returned raw outputs with the task's primary metric, and time every request end to end."""
    import httpx

    from pipeline.engines.perf import summarize_ms
    from pipeline.tasks import get_task

    if images_uint8.ndim not in (3, 4) or images_uint8.dtype != np.uint8 or len(images_uint8) == 0:
        raise DataError(f"http_gate needs uint8 images [N, H, W] or [N, H, W, 3], got {images_uint8.dtype} {list(images_uint8.shape)}")
    n = min(int(max_requests), len(images_uint8))
    task = get_task(task_name, infer_cfg.get("postprocess"))
    from pipeline.data.preprocess import png_bytes

    bodies = [png_bytes(img) for img in images_uint8[:n]]
    app = create_app_from_model(model_prefix, infer_cfg, threads=threads, log_requests=False,  # percentiles instead
                                engine=engine, batching=batching)
    outputs, times = [], []
    headers = {"content-type": "image/png"}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=timeout) as client:
        try:
            client.post("/predict", content=bodies[0], headers=headers)      # warm-up: first oneDNN run is slow
            for body in bodies:
                t0 = time.perf_counter()
                r = client.post("/predict", params={"outputs": "b64"}, content=body, headers=headers)
                times.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    raise PipelineError(f"HTTP /predict answered {r.status_code}: {r.text[:200]}")
                outputs.append(outputs_of(r.json()))
        except httpx.HTTPError as exc:
            raise PipelineError(f"HTTP request to {srv.url}/predict failed: {exc!r}") from None
    out = np.concatenate(outputs, axis=0)
    metric = task.metrics(out, labels[:n])[task.primary_metric] if np.isfinite(out).all() else float("nan")
    latency = {**summarize_ms(times), "repeats": len(times)}
    return {"metric": float(metric), "metric_name": task.primary_metric, "outputs": out, "latency_ms": latency,
            "n": n, "engine": app.state.engine.kind}
