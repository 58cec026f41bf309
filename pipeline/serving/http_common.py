"""The HTTP layer every service shares (`/predict`, `/ocr`, KServe v2): limits, body reading, image uploads,
error answers, request logs, the FastAPI base app and a background server for gates and tests.

Route modules (pipeline/serving/app.py, pipeline/serving/kserve.py, pipeline/serving/ocr_routes.py) import from here; nothing here
imports them, so a request flows down through one layer and nothing reaches back up.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import numpy as np
from fastapi import Request   # module level: FastAPI resolves the (string) annotations from globals

from pipeline.data import imagedecode
from pipeline.core.errors import ConfigError, DataError, PipelineError
from pipeline.serving.limits import (ConcurrencyLimit, HttpLimits, declared_too_big, parse_length, streamed_too_big,
                                    uvicorn_config)

log = logging.getLogger("pipeline.serving.app")     # the serving log (one name for every route module)


MAX_BODY_BYTES = 4 * 1024 * 1024      # defaults of the serve.* config keys


MAX_PIXELS = 4096 * 4096


MAX_CONCURRENCY = 8


MAX_BATCH = 64


REQUEST_TIMEOUT_S = 60.0             # a dense real page took 21-29 s of CPU on /ocr (issue 30); 60 s leaves room


MAX_BOXES_PER_PAGE = 500             # /ocr: boxes read per page (issue 30: ~900 boxes of a dense page took 21-29 s)


# inputs this small are decoded/parsed on the event loop: the thread-pool hop (~0.1 ms measured here) costs more
# than they do, and the loop is blocked for well under a millisecond. Anything bigger goes to the prep pool.
INLINE_PIXELS = 256 * 256
INLINE_BYTES = 64 * 1024


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
    Request and returns a Response; _BadRequest is answered here as the app's handler would. Other methods
    fall through to the router, HEAD as GET without the body (Starlette gives HEAD only to plain routes).
    Any other exception, from a hot route or the router, is answered by `fault` (one line, 400 or 500)."""

    def __init__(self, app, routes: dict):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            endpoint = self.routes.get(scope["path"]) if scope["method"] == "POST" else None
            if endpoint is None:
                if scope["method"] == "HEAD":
                    return await self.app({**scope, "method": "GET"}, receive, _without_body(tracked))
                return await self.app(scope, receive, tracked)
            try:
                response = await endpoint(Request(scope, receive))
            except _BadRequest as exc:
                response = _error_response(exc)
        except Exception as exc:
            if started:                           # too late for a status: uvicorn ends the connection
                raise
            response = _error_response(fault(exc, scope))
        await response(scope, receive, send)


def _without_body(send):
    """HEAD: the GET answer's status and headers (content-length included), no body bytes."""
    async def headers_only(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)
    return headers_only


def fault(exc: Exception, scope) -> _BadRequest:
    """How an exception nobody answered is answered, in one line and never with a traceback: a DataError is
    the input's fault (an engine refused it: 400); anything else is the server's (an engine crashed, a
    runtime raised: 500). The log gets one line, plus the traceback for what is not a PipelineError."""
    if isinstance(exc, DataError):
        return _BadRequest(400, _one_line(exc.one_line()))
    what = exc.one_line() if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
    what = _one_line(what)
    log.error("%s %s failed: %s", scope.get("method"), scope.get("path"), what,
              exc_info=None if isinstance(exc, PipelineError) else exc)
    return _BadRequest(500, f"internal error: {what} (the server log has the details)")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def decodes_inline(data: bytes) -> bool:
    """A PNG whose header (IHDR, read without decoding) announces at most INLINE_PIXELS: cheaper to decode on
    the event loop than to hand over. Every other image goes to the prep pool."""
    if len(data) < 24 or not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR":
        return False
    return int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big") <= INLINE_PIXELS


async def off_loop(pool: ThreadPoolExecutor, fn, *args):
    """fn(*args) on the prep pool (decoding, pre- and post-processing): the event loop keeps answering."""
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _error_response(exc: _BadRequest):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": exc.message}, status_code=exc.status)


def base_app(name: str, pool: ThreadPoolExecutor, *, max_concurrency: int, log_requests: bool,
             log_summary_s: float = 60.0, max_body: int = MAX_BODY_BYTES,
             request_timeout_s: float | None = REQUEST_TIMEOUT_S, on_shutdown=()):
    """The FastAPI app every service here starts from: the predictor pool and the prep pool (app.state.prep:
    decoding and pre/post-processing off the event loop) closed at shutdown, then each on_shutdown callable (e.g. the
    OCR lanes' threads and engines), the concurrency limit and the
    per-request time budget, request timing/logging (per request, or a summary line per log_summary_s seconds
    of traffic), HEAD on GET routes, and errors answered as {"error": ...}. Routes are added by the caller."""
    from fastapi import FastAPI

    from pipeline.core import env

    traffic = _Traffic(log_summary_s)
    # decoding runs inside a request's concurrency slot, so more workers than slots would idle
    prep = ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, env.cpu_count())), thread_name_prefix="prep")

    @asynccontextmanager
    async def lifespan(_app):
        yield
        traffic.flush()
        prep.shutdown(wait=True)
        pool.shutdown(wait=True)
        for close in on_shutdown:
            close()

    # FastAPI's native OpenTelemetry looks up the global providers on every request (~10 % of a /predict
    # here, measured with cProfile); nothing configures OpenTelemetry in these services, so it is off.
    app = FastAPI(title=f"pipeline serve: {name}", docs_url=None, redoc_url=None, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    hot: dict = {}                                  # path -> endpoint, filled by the caller (innermost)
    app.add_middleware(_HotRoutes, routes=hot)
    app.add_middleware(ConcurrencyLimit, limit=max_concurrency, max_body=max_body,    # bodies read first
                       timeout_s=request_timeout_s)
    app.add_middleware(_LatencyLog, log_requests=log_requests, traffic=traffic)   # outermost: 429s logged and timed too
    app.state.traffic, app.state.hot_routes, app.state.prep = traffic, hot, prep

    @app.exception_handler(_BadRequest)
    async def _bad(_request, exc: _BadRequest):
        return _error_response(exc)

    return app


async def read_body(request, max_body: int) -> bytes:
    """The request body, refused with 413 at the first byte past max_body (declared or streamed)."""
    declared = parse_length(request.headers.get("content-length"))
    if declared is not None and declared > max_body:
        raise _BadRequest(413, declared_too_big(declared, max_body))
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
