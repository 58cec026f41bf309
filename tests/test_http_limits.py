"""HTTP limits with real sockets (pipeline/serving/limits.py): slow and oversized clients cannot hold `serve`.

Timeouts are set short for the test (0.5-2 s), never wall-clock minutes. The tiny model of tests/test_serve.py
is served in a uvicorn thread (BackgroundServer); the SIGTERM test runs `python -m pipeline serve` on the
smoke bundle as a real process.
"""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from test_serve import tiny_model  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
LIMITS = dict(max_header_bytes=4096, header_timeout_s=1.0, body_timeout_s=1.5, keepalive_s=1.0, grace_s=3.0)


def _png(h=16, w=16) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w), 128, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def server(tiny_model):  # noqa: F811
    from pipeline.serving.limits import HttpLimits
    from pipeline.serving.http_common import BackgroundServer
    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, max_concurrency=8, log_requests=False)
    with BackgroundServer(app, limits=HttpLimits(**LIMITS)) as srv:
        host, port = srv.url.rsplit("/", 1)[1].split(":")
        srv.addr = (host, int(port))
        yield srv


def _head(path="/predict", length=1000, extra=b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: image/png\r\ncontent-length: {length}\r\n".encode()
            + extra + b"\r\n")


def _answer(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (or timeout)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def test_fifty_slow_uploads_hold_no_slot_and_time_out(server):
    import httpx

    slow = [socket.create_connection(server.addr) for _ in range(50)]
    stop = threading.Event()

    def trickle():                           # one body byte per 0.2 s on every slow connection
        while not stop.wait(0.2):
            for s in slow:
                try:
                    s.send(b"0")
                except OSError:
                    pass
    for s in slow:
        s.sendall(_head() + b"\x89PNG")
    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        time.sleep(0.3)
        with httpx.Client(base_url=server.url) as client:
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                r = client.post("/predict", content=_png(), headers={"content-type": "image/png"})
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
        assert max(times) < 1.0, times
        answers = [_answer(s, LIMITS["body_timeout_s"] + 3) for s in slow]
    finally:
        stop.set()
        for s in slow:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408") and b"serve.body_timeout_s" in a for a in answers), answers[0][:300]


def test_stalled_headers_get_408_and_an_idle_connection_is_closed(server):
    partial = socket.create_connection(server.addr)
    partial.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n")       # the head never ends
    idle = socket.create_connection(server.addr)                      # says nothing at all
    t0 = time.perf_counter()
    answer = _answer(partial, 5)
    assert answer.startswith(b"HTTP/1.1 408") and b"serve.header_timeout_s" in answer, answer
    assert _answer(idle, 5) == b""                                     # closed without a word
    assert time.perf_counter() - t0 < LIMITS["header_timeout_s"] + 2
    partial.close(), idle.close()


def test_oversized_header_gets_431_without_reading_it_all(server):
    s = socket.create_connection(server.addr)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    try:
        while sent < (8 << 20):              # would be 8 MiB; the server refuses after max_header_bytes
            s.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    answer = _answer(s, 5)
    assert answer.startswith(b"HTTP/1.1 431") and b"serve.max_header_bytes" in answer, answer[:200]
    assert sent < (8 << 20)
    s.close()


def test_keepalive_connection_is_closed_when_idle(server):
    s = socket.create_connection(server.addr)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.perf_counter()
    answer = _answer(s, 5)                       # the answer, then the close after keepalive_s
    assert answer.startswith(b"HTTP/1.1 200")
    assert LIMITS["keepalive_s"] - 0.2 < time.perf_counter() - t0 < LIMITS["keepalive_s"] + 2
    s.close()


def test_slow_inference_still_holds_its_slot(tiny_model):  # noqa: F811
    """Bodies complete, inference in progress: those count, and more get 429."""
    import httpx

    from pipeline.serving.http_common import BackgroundServer

    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, max_concurrency=1, log_requests=False)
    run = app.state.engine.run
    app.state.runner.inline = False
    app.state.engine.run = lambda x: time.sleep(1.0) or run(x)
    with BackgroundServer(app) as srv:
        slow = threading.Thread(target=lambda: httpx.post(srv.url + "/predict", content=_png(),
                                                          headers={"content-type": "image/png"}, timeout=10))
        slow.start()
        time.sleep(0.3)
        r = httpx.post(srv.url + "/predict", content=_png(), headers={"content-type": "image/png"})
        slow.join()
    assert r.status_code == 429 and "serve.max_concurrency" in r.json()["error"] and r.headers["retry-after"] == "1"


def _serve_process(bundle: Path, tmp_path: Path) -> tuple[subprocess.Popen, tuple[str, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    over = [x for k, v in {**LIMITS, "body_timeout_s": 2.0, "grace_s": 4.0}.items() for x in ("-o", f"serve.{k}={v}")]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(bundle), "--port", str(port), *over],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if _answer(c, 2).startswith(b"HTTP/1.1 200"):
                    return proc, ("127.0.0.1", port)
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"serve did not start: {proc.communicate()[0][-2000:]}")


@pytest.mark.slow
def test_sigterm_answers_requests_in_flight_then_exits_within_grace(smoke_bundle, tmp_path):
    bundle = smoke_bundle[0]
    with np.load(bundle / "samples" / "expected.npz") as z:
        body = (bundle / str(z["files"][0])).read_bytes()
    proc, addr = _serve_process(bundle, tmp_path)
    inflight = [socket.create_connection(addr) for _ in range(6)]
    stalled = socket.create_connection(addr)
    try:
        for s in inflight:                   # headers and half the body: in flight when SIGTERM comes
            s.sendall(_head(length=len(body), extra=b"Connection: keep-alive\r\n") + body[: len(body) // 2])
        stalled.sendall(_head(length=len(body)) + body[:10])      # never finishes its body
        time.sleep(0.3)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        for s in inflight:
            s.sendall(body[len(body) // 2:])
        answers = [_answer(s, 10) for s in inflight]
        proc.wait(timeout=15)
        took = time.perf_counter() - t0
        stalled_answer = _answer(stalled, 1)
    finally:
        for s in (*inflight, stalled):
            s.close()
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert all(a.startswith(b"HTTP/1.1 200") and b'"predictions"' in a for a in answers), (answers, log[-2000:])
    assert stalled_answer.startswith(b"HTTP/1.1 408") or stalled_answer == b"", stalled_answer
    assert proc.returncode == 0 and took < 4.0 + 1.5, (took, log[-2000:])
    assert "Traceback" not in log, log[-3000:]
