"""`python -m pipeline serve BUNDLE`: an HTTP inference service (FastAPI + uvicorn) and its gate.

GET  /health   status, model name, task, input shape, versions
POST /predict  an image (multipart file, or a raw image/png|image/jpeg body) or JSON
               {"inputs": [...]} holding a preprocessed float tensor [N,C,H,W] or [C,H,W];
               `?outputs=1` also returns the raw model outputs (the server stage's gate uses them).
Bad input is answered 400/413/415 with a message, never 500. Images go through the same
pipeline.preprocess path as training, so served predictions cannot drift from the gated ones.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from fastapi import Request   # module level: FastAPI resolves the (string) annotations from globals

from . import imagedecode, tempdirs
from .errors import ConfigError, DataError, PipelineError
from .httplimits import (ConcurrencyLimit, HttpLimits, declared_too_big, stop_quietly_on_sigterm, streamed_too_big,
                         uvicorn_config)

log = logging.getLogger("pipeline.serve")

MAX_BODY_BYTES = 4 * 1024 * 1024      # defaults of the serve.* config keys
MAX_PIXELS = 4096 * 4096
MAX_CONCURRENCY = 8
MAX_BATCH = 64
IMAGE_TYPES = tuple(imagedecode.CONTENT_TYPES)   # the allow-list: PNG, JPEG, BMP, GIF, TIFF, WebP


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _Traffic:
    """Per-request status and latency, logged as one summary line per `every_s` seconds of traffic (and at
    shutdown): `serve` stays observable without a log write per request. A per-request line (stderr
    write + flush) cost ~0.1 ms of a ~0.7 ms /predict here (measured in-process); serve.access_log
    turns those lines back on."""

    MAX_SAMPLES = 100_000            # flush early rather than hold more latencies in memory

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.since, self.ms, self.codes = now, [], {}

    def add(self, status: int, ms: float) -> None:
        self.ms.append(ms)
        self.codes[status] = self.codes.get(status, 0) + 1
        now = time.perf_counter()
        if now - self.since >= self.every_s or len(self.ms) >= self.MAX_SAMPLES:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.ms:
            p50, p99 = np.percentile(self.ms, [50, 99])
            codes = ", ".join(f"{c}×{n}" for c, n in sorted(self.codes.items()))
            log.info("%d requests in %.1f s (%s); latency p50 %.2f ms, p99 %.2f ms", len(self.ms), now - self.since,
                     codes, p50, p99)
        self._reset(now)


class _LatencyLog:
    """X-Latency-ms header on every response, and the request log: one line per request (log_requests) or
    the _Traffic summary. Plain ASGI (BaseHTTPMiddleware adds a task per request)."""

    def __init__(self, app, log_requests: bool = False, traffic: _Traffic | None = None):
        self.app, self.log_requests, self.traffic = app, log_requests, traffic or _Traffic()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [500]       # 500: an exception escaped before a response started

        async def timed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                ms = (time.perf_counter() - t0) * 1e3
                message = {**message, "headers": [*message.get("headers", []), (b"x-latency-ms", f"{ms:.3f}".encode())]}
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            if self.log_requests:
                log.info("%s %s -> %d in %.2f ms", scope["method"], scope["path"], status[0], ms)
            else:
                self.traffic.add(status[0], ms)


class _HotRoutes:
    """POST routes answered right behind the concurrency limit and the request log, ahead of FastAPI's
    exception middleware, router and endpoint wrapper, which cost ~0.035 ms of a ~0.37 ms in-process
    /predict (uvloop, default model, measured 2026-11-30 in interleaved rounds). An endpoint takes a
    Request and returns a Response; _BadRequest is answered here as the app's handler would; anything
    else still reaches Starlette's ServerErrorMiddleware (500). Other methods fall through to the router."""

    def __init__(self, app, routes: dict):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        try:
            response = await endpoint(Request(scope, receive))
        except _BadRequest as exc:
            response = _error_response(exc)
        await response(scope, receive, send)


def _error_response(exc: _BadRequest):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": exc.message}, status_code=exc.status)


def create_app(bundle: str | Path, *, threads: int = 0, max_body: int = MAX_BODY_BYTES, key: str | Path | None = None,
               archive_limits: tuple[int, int] | None = None, engine: str | None = None, **limits):
    """App for a bundle folder or .tar.gz; the signature (with a key) and every hash are checked before
    Paddle parses any file. limits: max_pixels, max_concurrency (see create_app_from_model).
    engine: override the bundle's recommended engine (paddle-inference | onnxruntime | openvino)."""
    from .bundle import load_infer_config, open_bundle, verify_hashes
    from .serving import load_engine
    from .verify import check_signature

    scratch = tempdirs.directory("serve-bundle")
    folder = open_bundle(Path(bundle), Path(scratch.name), *(archive_limits or ()))
    signature = check_signature(folder, key)
    manifest = verify_hashes(folder)
    cfg = load_infer_config(folder)
    if cfg.get("task") == "ocr_system":          # two models and POST /ocr: pipeline/ocr/service.py
        from .ocr.service import create_ocr_app
        app = create_ocr_app(folder, threads=threads, max_body=max_body, name=manifest.get("name"),
                             versions=manifest.get("versions"), **limits)
        app.state.scratch = scratch
        app.state.signature = signature
        return app
    app = create_app_from_model(str(folder / "server" / "fp32" / "inference"), cfg, threads=threads,
                                max_body=max_body, name=manifest.get("name") or folder.name,
                                versions=manifest.get("versions"), engine=load_engine(folder, cfg, engine, threads),
                                **limits)
    app.state.scratch = scratch          # an extracted archive lives as long as the app
    app.state.signature = signature
    return app


def create_app_from_model(model_prefix: str, infer_cfg: dict, *, threads: int = 0, max_body: int = MAX_BODY_BYTES,
                          name: str | None = None, versions: dict | None = None, log_requests: bool = False,
                          max_pixels: int = MAX_PIXELS, max_concurrency: int = MAX_CONCURRENCY, engine=None):
    """App for an exported model + the infer_config structure (used by the server stage before a bundle exists).

    engine: an already loaded pipeline.engines.base.Engine to serve (default: Paddle Inference on model_prefix).

    max_pixels: images above it get 413 from their header, before decoding; max_concurrency: requests in
    progress at once (bodies + decoded images held in memory), more get 429. log_requests: one log line per
    request (serve.access_log); otherwise a traffic summary line per minute."""
    from fastapi.responses import Response

    from . import env
    from .engines.paddle_infer import InferenceEngine
    from .tasks import get_task

    for key in ("preprocess", "postprocess", "task", "input"):
        if key not in infer_cfg:
            raise DataError(f"infer config has no '{key}' section", hint="see stages/bundle.py infer_config()")
    if engine is None:
        engine = InferenceEngine(model_prefix, "fp32", threads=threads or env.cpu_count())
    task = get_task(infer_cfg["task"], infer_cfg["postprocess"])
    want = [d if isinstance(d, int) and d > 0 else None for d in infer_cfg["input"]["shape"]]
    name = name or Path(model_prefix).parent.name
    # one worker thread owns the predictor: it is not thread-safe, and the event loop stays free
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor")
    runner = _Runner(engine, pool)
    app = base_app(name, pool, max_concurrency=max_concurrency, log_requests=log_requests, max_body=max_body)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "task": task.name, "input": infer_cfg["input"],
                "versions": versions or env.versions()}

    async def predict(request: Request):
        x, sizes = await _read_input(request, infer_cfg, want, max_body, max_pixels)
        t0 = time.perf_counter()
        try:
            out = await runner(x)
        except DataError as exc:             # shape/dtype the engine refused
            raise _BadRequest(400, exc.one_line()) from None
        preds = task.decode(out, infer_cfg["postprocess"], sizes) if sizes else task.decode(out, infer_cfg["postprocess"])
        body = {"model": name, "task": task.name, "predictions": preds,
                "inference_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        if request.scope["query_string"] and request.query_params.get("outputs", "0").lower() in ("1", "true", "yes"):
            body["outputs"] = out.tolist()
        # json.dumps straight to bytes: FastAPI's jsonable_encoder walk cost ~5x more than the encoding
        return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")

    # POST is answered by _HotRoutes, ahead of the router; the endpoint takes no typed parameters (FastAPI's
    # per-request dependency solving cost ~0.07 ms, measured in-process). It is registered with the router
    # too, so other methods get 405 there.
    app.state.hot_routes["/predict"] = predict
    app.add_route("/predict", predict, methods=["POST"])

    from .kserve import add_v2_routes               # KServe v2 / Open Inference Protocol under /v2

    add_v2_routes(app, name=name, runner=runner, input_shape=want, output_name="output",
                  versions=versions or env.versions(), max_body=max_body)
    app.state.engine, app.state.runner = engine, runner
    app.state.endpoints = "POST /predict, GET /health, KServe v2 under /v2"
    return app


def base_app(name: str, pool: ThreadPoolExecutor, *, max_concurrency: int, log_requests: bool,
             log_summary_s: float = 60.0, max_body: int = MAX_BODY_BYTES):
    """The FastAPI app every service here starts from: the predictor pool closed at shutdown, the concurrency
    limit, request timing/logging (per request, or a summary line per log_summary_s seconds of traffic) and
    _BadRequest answered as {"error": ...}. Routes are added by the caller."""
    from fastapi import FastAPI

    traffic = _Traffic(log_summary_s)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        traffic.flush()
        pool.shutdown(wait=True)

    # FastAPI's native OpenTelemetry looks up the global providers on every request (~10 % of a /predict
    # here, measured with cProfile); nothing configures OpenTelemetry in these services, so it is off.
    app = FastAPI(title=f"pipeline serve: {name}", docs_url=None, redoc_url=None, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    hot: dict = {}                                  # path -> endpoint, filled by the caller (innermost)
    app.add_middleware(_HotRoutes, routes=hot)
    app.add_middleware(ConcurrencyLimit, limit=max_concurrency, max_body=max_body)   # bodies read first
    app.add_middleware(_LatencyLog, log_requests=log_requests, traffic=traffic)   # outermost: 429s logged and timed too
    app.state.traffic, app.state.hot_routes = traffic, hot

    @app.exception_handler(_BadRequest)
    async def _bad(_request, exc: _BadRequest):
        return _error_response(exc)

    return app


class _Runner:
    """Runs the engine for a request.

    Batch-1 inputs of a ShapeRouted engine whose batch-1 call is well under a millisecond run inline
    on the event loop: the thread-pool hop costs more than such a model (measured ~0.15 ms per
    request) and the event loop is blocked for less than a JSON parse. The batch-1 instance is then
    only ever touched by the loop thread and the batched one only by the worker thread, so neither
    predictor is shared between threads. Everything else goes to the worker thread.
    """

    INLINE_MS = 1.0

    def __init__(self, engine, pool: ThreadPoolExecutor):
        from .engines.base import ShapeRouted

        self.engine, self.pool = engine, pool
        self.batch1_ms = _probe_ms(engine) if isinstance(engine, ShapeRouted) else None
        self.inline = self.batch1_ms is not None and self.batch1_ms < self.INLINE_MS

    async def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.inline and len(x) == 1:
            return self.engine.run(x)
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.engine.run, x)


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


async def read_body(request, max_body: int) -> bytes:
    """The request body, refused with 413 at the first byte past max_body (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body:
        raise _BadRequest(413, declared_too_big(int(declared), max_body))
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():    # chunked uploads have no content-length: count as we go
            size += len(chunk)
            if size > max_body:
                raise _BadRequest(413, streamed_too_big(max_body))
            chunks.append(chunk)
    except ClientDisconnect:                     # nobody to answer, but no traceback in the log either
        raise _BadRequest(400, f"client disconnected after {size} bytes of the body") from None
    return b"".join(chunks)


async def image_upload(request, body: bytes, what: str = "image") -> bytes:
    """The image bytes of a (size-capped, already read) body: the file part of a multipart form, or a raw
    image/* body. The declared content-type must name the format the bytes are (pipeline/imagedecode)."""
    from starlette.requests import Request

    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        async def replay():                      # the body was already read (size-capped) above
            return {"type": "http.request", "body": body, "more_body": False}
        try:
            form = await Request(request.scope, replay).form(max_files=1, max_fields=4)
        except Exception as exc:                 # malformed multipart of any kind is the client's fault
            raise _BadRequest(400, f"malformed multipart body: {str(exc)[:200]}") from None
        files = [v for v in form.values() if hasattr(v, "read")]
        if not files:
            raise _BadRequest(400, f"multipart body has no file part (send the {what} as field 'file')")
        body = await files[0].read()
        if not body:
            raise _BadRequest(400, "the uploaded file is empty")
        ctype = (files[0].content_type or "").split(";")[0].strip().lower()
    elif ctype not in IMAGE_TYPES:
        raise _BadRequest(415, f"unsupported content-type '{ctype or 'none'}': use {', '.join(IMAGE_TYPES)}, "
                               "multipart/form-data" + (" or application/json" if what == "image" else ""))
    try:
        imagedecode.check_content_type(ctype, body)
    except DataError as exc:
        raise _BadRequest(400, exc.one_line()) from None
    return body


def decode_refusal(exc: DataError) -> _BadRequest:
    """How an image the decoder refused is answered: 413 over the pixel limit, else 400."""
    return _BadRequest(413 if isinstance(exc, imagedecode.ImageTooLarge) else 400, exc.one_line())


async def _read_input(request, infer_cfg: dict, want: list, max_body: int, max_pixels: int = MAX_PIXELS
                      ) -> tuple[np.ndarray, list | None]:
    """→ (model input, original (h, w) per image where the task maps its output back to it, else None)."""
    from .preprocess import decode_image_bytes, to_tensor

    body = await read_body(request, max_body)
    if not body:
        raise _BadRequest(400, "empty request body: send an image or JSON {\"inputs\": [...]}")
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        return _json_tensor(body, want), None
    body = await image_upload(request, body)
    try:
        if infer_cfg["task"] == "detection":      # boxes come back in the page's own pixels
            from .ocr.pages import decode_page, detection_input

            page = decode_page(body, max_pixels)
            return detection_input(page, infer_cfg["preprocess"]), [page.shape[:2]]
        img = decode_image_bytes(body, infer_cfg["preprocess"], max_pixels=max_pixels)
    except DataError as exc:
        raise decode_refusal(exc) from None
    return to_tensor(img[None], infer_cfg["preprocess"]), None


def _json_tensor(body: bytes, want: list) -> np.ndarray:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(400, f"body is not valid JSON: {exc}") from None
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
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise _BadRequest(400, "'inputs' contains NaN or Inf")
    return arr


# ------------------------------------------------------------------------------------ running

def free_port(host: str = "127.0.0.1") -> socket.socket:
    """A bound listening socket on a kernel-chosen port (no race between picking and binding)."""
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then; without it, headers
    # and body leave in separate segments and every response waits ~40 ms for a delayed ACK (measured)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


class BackgroundServer:
    """uvicorn in a daemon thread on a free local port; a context manager that always stops it."""

    def __init__(self, app, host: str = "127.0.0.1", start_timeout: float = 30.0, limits: HttpLimits | None = None):
        import uvicorn

        self.sock = free_port(host)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(app, limits, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.time() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                self.__exit__(None, None, None)
                raise PipelineError(f"HTTP server did not start on {self.url}", hint="see the log above")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a one-line ConfigError: checked before anything says "serving"."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port} is out of range", hint="use a port from 1 to 65535, e.g. --port 8000")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          proto=socket.IPPROTO_TCP)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({exc})",
                          hint="use 127.0.0.1 (local only) or this machine's address") from None
    sock = socket.socket(family, kind, proto)   # IPPROTO_TCP: see free_port
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use", hint=f"stop the other server or pick "
                              f"another port, e.g. --port {port + 1 if port < 65535 else 8000}") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"not allowed to listen on port {port} ({exc.strerror})",
                              hint="ports below 1024 need privileges; use e.g. --port 8000") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                          hint="check --host and --port") from None
    return sock


def serve(bundle: str | Path, host: str = "127.0.0.1", port: int = 8000, threads: int = 0,
          sock: socket.socket | None = None, limits: HttpLimits | None = None, **app_kw) -> None:
    """Serve until interrupted or SIGTERM (in-flight requests get limits.grace_s to finish); sock: an
    already bound listening socket (else host:port is bound here)."""
    import uvicorn

    sock = sock or bind(host, port)    # a busy port fails here, before the model loads or "serving" prints
    host, port = sock.getsockname()[:2]
    try:
        app = create_app(bundle, threads=threads, **app_kw)
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("binding %s exposes the service beyond this machine; it has no authentication", host)
        log.info("bundle %s", app.state.signature)
        log.info("serving %s with %s on http://%s:%d (%s)", bundle, app.state.engine.kind, host, port,
                 app.state.endpoints)
        log.info("request log: %s", "one line per request" if app_kw.get("log_requests") else
                 f"a summary line per {app.state.traffic.every_s:g} s of traffic (serve.access_log=true: one per request)")
        stop_quietly_on_sigterm()
        uvicorn.Server(uvicorn_config(app, limits)).run(sockets=[sock])
        log.info("stopped")
    finally:
        sock.close()


def http_gate(model_prefix: str, infer_cfg: dict, images_uint8: np.ndarray, labels: np.ndarray, task_name: str,
              *, max_requests: int, threads: int = 0, timeout: float = 30.0, engine=None) -> dict:
    """Serve the model on a free 127.0.0.1 port, POST up to max_requests images as PNG (one per request),
    score the returned raw outputs with the task's primary metric, and time every request end to end."""
    import httpx

    from .engines.perf import summarize_ms
    from .tasks import get_task

    if images_uint8.ndim not in (3, 4) or images_uint8.dtype != np.uint8 or len(images_uint8) == 0:
        raise DataError(f"http_gate needs uint8 images [N, H, W] or [N, H, W, 3], got {images_uint8.dtype} {list(images_uint8.shape)}")
    n = min(int(max_requests), len(images_uint8))
    task = get_task(task_name, infer_cfg.get("postprocess"))
    from .preprocess import png_bytes

    bodies = [png_bytes(img) for img in images_uint8[:n]]
    app = create_app_from_model(model_prefix, infer_cfg, threads=threads, log_requests=False,  # percentiles instead
                                engine=engine)
    outputs, times = [], []
    headers = {"content-type": "image/png"}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=timeout) as client:
        try:
            client.post("/predict", content=bodies[0], headers=headers)      # warm-up: first oneDNN run is slow
            for body in bodies:
                t0 = time.perf_counter()
                r = client.post("/predict", params={"outputs": "1"}, content=body, headers=headers)
                times.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    raise PipelineError(f"HTTP /predict answered {r.status_code}: {r.text[:200]}")
                outputs.append(np.asarray(r.json()["outputs"], dtype=np.float32))
        except httpx.HTTPError as exc:
            raise PipelineError(f"HTTP request to {srv.url}/predict failed: {exc!r}") from None
    out = np.concatenate(outputs, axis=0)
    metric = task.metrics(out, labels[:n])[task.primary_metric] if np.isfinite(out).all() else float("nan")
    latency = {**summarize_ms(times), "repeats": len(times)}
    return {"metric": float(metric), "metric_name": task.primary_metric, "outputs": out, "latency_ms": latency,
            "n": n, "engine": app.state.engine.kind}
