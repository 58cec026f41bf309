"""HTTP limits below the routes: slow or oversized clients cannot hold the service.

- LimitedProtocol (uvicorn's httptools protocol plus limits): request headers bigger than
  serve.max_header_bytes get 431, headers not complete within serve.header_timeout_s get 408 (an idle new
  connection is just closed), and a body not complete within serve.body_timeout_s of its headers gets 408
  (the app answers it: ConcurrencyLimit below). Idle keep-alive connections close after serve.keepalive_s.
- ConcurrencyLimit: at most serve.max_concurrency POST requests in progress, counted only once their
  whole body is here, so trickling uploads never hold a slot (each is bounded by the body timeout); a
  request's decoding, inference and answer all run inside its slot. Each POST also has a time budget
  (serve.request_timeout_s, from its headers): past it, 408 while the body is still arriving, else 503.
- uvicorn_config: SIGTERM stops accepting, lets in-flight requests finish for up to serve.grace_s, then
  cancels what is left and exits.
Everything is plain ASGI / asyncio callbacks: a call_later and a cancel per request, no task per request.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from http import HTTPStatus

TIMED_OUT = "pipeline.body_timeout_s"      # scope key the protocol sets when the body deadline passed


@dataclass(frozen=True)
class HttpLimits:
    """Defaults of the serve.* keys of the same names (configs/defaults.yaml)."""
    max_header_bytes: int = 16 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_s: float = 5.0
    grace_s: float = 10.0

    @classmethod
    def from_config(cls, serve_cfg) -> "HttpLimits":
        return cls(**{k: getattr(serve_cfg, k) for k in cls.__dataclass_fields__})


def error_bytes(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def raw_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (written by the protocol itself)."""
    body = error_bytes(message)
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def protocol_class(limits: HttpLimits) -> type:
    """uvicorn's httptools protocol with the header size limit and the header/body timers."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    # uvicorn is imported only when serving, so the class is assembled here; its behaviour is _LimitsMixin's
    class LimitedProtocol(_LimitsMixin, HttpToolsProtocol):
        _serve_limits = limits

    return LimitedProtocol


class _LimitsMixin:
    """The limits of protocol_class, placed before HttpToolsProtocol in the MRO (super() is uvicorn's)."""
    _serve_limits: HttpLimits

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._in_head, self._head_bytes, self._timer = True, 0, None
        self._arm(self._serve_limits.header_timeout_s, self._head_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():   # counted before the head is complete
            self._head_bytes += len(data)
            if self._head_bytes > self._serve_limits.max_header_bytes:
                self._refuse(431, f"request headers exceed {self._serve_limits.max_header_bytes} bytes "
                                  "(serve.max_header_bytes)")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        self._arm(self._serve_limits.header_timeout_s, self._head_timeout)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self._serve_limits.body_timeout_s, self._body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if self.cycle is None or self.cycle.response_complete:   # never inside another response
            self.transport.write(raw_response(status, message))
        self.transport.close()

    def _head_timeout(self) -> None:
        self._timer = None
        if self._head_bytes == 0:          # nothing sent: an idle connection, closed without a word
            self.transport.close()
        else:
            self._refuse(408, f"request headers not complete within {self._serve_limits.header_timeout_s:g} s "
                              "(serve.header_timeout_s)")

    def _body_timeout(self) -> None:
        """Wake the app with the deadline marked in its scope: ConcurrencyLimit answers 408 and the
        response closes the connection. If nobody is reading the body, close it a second later."""
        self._timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        cycle.scope[TIMED_OUT] = self._serve_limits.body_timeout_s
        cycle.message_event.set()
        self._timer = self.loop.call_later(1.0, self.transport.close)


def uvicorn_config(app, limits: HttpLimits | None = None, **kw):
    """uvicorn.Config with the limits: LimitedProtocol, keep-alive timeout, graceful-shutdown period."""
    import uvicorn

    limits = limits or HttpLimits()
    return uvicorn.Config(app, http=protocol_class(limits), timeout_keep_alive=limits.keepalive_s,
                          timeout_graceful_shutdown=limits.grace_s, **{"log_level": "warning",
                                                                       "access_log": False, **kw})


def stop_quietly_on_sigterm() -> None:
    """uvicorn shuts down gracefully on SIGTERM, then re-raises the signal at the handler it found: make
    that handler a no-op, so `serve` returns (cleanup, exit 0) instead of dying by the signal afterwards."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: None)


# ------------------------------------------------------------------------------------ ASGI

async def send_error(send, status: int, message: str, headers: tuple = ()) -> None:
    body = error_bytes(message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def declared_too_big(declared: int, max_body: int) -> str:
    return f"request body is {declared} bytes; the limit is {max_body} (serve.max_body_bytes)"


def streamed_too_big(max_body: int) -> str:
    return f"request body exceeds the {max_body}-byte limit (serve.max_body_bytes)"


_LENGTH = re.compile(rb"[0-9]{1,18}")     # ASCII digits only: str.isdigit() also takes "²" and "١", int() not all


def parse_length(value: str | bytes | None) -> int | None:
    """A length header's value as an int, or None when it is not 1-18 ASCII digits (never an exception)."""
    if value is None:
        return None
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value
    return int(raw) if _LENGTH.fullmatch(raw.strip()) else None


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return parse_length(value)
    return None


class ConcurrencyLimit:
    """At most `limit` POST requests in progress (each holds its body and decoded input in memory); more get
    429 with Retry-After. A request counts only once its body is complete: the body is read here first,
    capped at max_body (413), and all bodies being received share a budget of limit * max_body bytes (503
    past it). Every POST has `timeout_s` from its headers to its answer (_Deadline): 408 while its body is
    still arriving, 503 after. Plain ASGI around the whole app; one event loop, so the counters need no lock."""

    def __init__(self, app, limit: int, max_body: int, timeout_s: float | None = None):
        self.app, self.limit, self.max_body, self.timeout_s = app, limit, max_body, timeout_s
        self.inflight, self.buffered, self.budget = 0, 0, limit * max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if not self.timeout_s:
            return await self._admit(scope, receive, send, None)
        deadline = _Deadline(self.timeout_s)
        try:
            return await self._admit(scope, receive, deadline.watch(send), deadline)
        except asyncio.CancelledError:
            if not deadline.fired:              # the server is stopping, or the client went away: not ours
                raise
            deadline.uncancel()
            return await deadline.answer(send)
        finally:
            deadline.handle.cancel()

    async def _admit(self, scope, receive, send, deadline: "_Deadline | None"):
        body = await self._read_body(scope, receive, send)
        if body is None:                        # answered already, or the client went away
            return None
        if deadline is not None:
            deadline.reading = False
        if self.inflight >= self.limit:
            return await send_error(send, 429, f"{self.inflight} requests already in progress, the limit is "
                                               f"{self.limit} (serve.max_concurrency); retry shortly",
                                    ((b"retry-after", b"1"),))
        self.inflight += 1
        try:
            return await self.app(scope, _replay(body, receive), send)
        finally:
            self.inflight -= 1

    async def _read_body(self, scope, receive, send) -> bytes | None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body:
            return await send_error(send, 413, declared_too_big(declared, self.max_body), _CLOSE)
        chunks, held = [], 0
        try:
            while True:
                message = await receive()
                if TIMED_OUT in scope:
                    return await send_error(send, 408, f"request body not complete within {scope[TIMED_OUT]:g} s "
                                                       "(serve.body_timeout_s)", _CLOSE)
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                if held + len(chunk) > self.max_body:
                    return await send_error(send, 413, streamed_too_big(self.max_body), _CLOSE)
                if self.buffered + len(chunk) > self.budget:
                    return await send_error(send, 503, "the server is receiving too many uploads at once; "
                                                       "retry shortly", ((b"retry-after", b"1"), *_CLOSE))
                self.buffered, held = self.buffered + len(chunk), held + len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            self.buffered -= held


_CLOSE = ((b"connection", b"close"),)     # the rest of a refused body is not read: end the connection


class _Deadline:
    """A request's time budget: one call_later per request (no task), which cancels the request's own task
    when the budget passes before its answer has started. The request then gets 408 (body still arriving)
    or 503 (decoding, inference or the answer took too long), naming serve.request_timeout_s. An engine call
    already running in a worker thread cannot be interrupted: it finishes there, and the next call on that
    engine waits for it, so the slot freed here does not let more work through than the engine can take."""

    def __init__(self, seconds: float):
        self.seconds, self.fired, self.started, self.reading = seconds, False, False, True
        self.task = asyncio.current_task()
        self.handle = asyncio.get_running_loop().call_later(seconds, self._fire)

    def _fire(self) -> None:
        if not self.started:                # an answer already on its way is left to finish
            self.fired = True
            self.task.cancel()

    def watch(self, send):
        async def watched(message):
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)
        return watched

    def uncancel(self) -> None:
        if hasattr(self.task, "uncancel"):  # Python >= 3.11 counts cancellations; this one is handled
            self.task.uncancel()

    async def answer(self, send) -> None:
        if self.reading:
            return await send_error(send, 408, f"request not complete within {self.seconds:g} s "
                                               "(serve.request_timeout_s): the body was still arriving", _CLOSE)
        return await send_error(send, 503, f"request not answered within {self.seconds:g} s "
                                           "(serve.request_timeout_s); retry later, or send a smaller input",
                                ((b"retry-after", b"1"), *_CLOSE))


def _replay(body: bytes, receive):
    """The receive callable the app sees: the body read above, then the real receive (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
