"""HTTP limits with real sockets (pipeline/serving/limits.py): slow and oversized clients cannot hold `serve`.

Timeouts are set short for the test (0.5-2 s), never wall-clock minutes. The tiny model of tests/test_serve.py
is served in a uvicorn thread (BackgroundServer); the SIGTERM test runs `python -m pipeline serve` on the
smoke bundle as a real process.
"""
from __future__ import annotations

import functools
import io
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
def server(tiny_model):
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


def test_slow_inference_still_holds_its_slot(tiny_model):
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
    # the docs promise a 408 for a body that never completes, SIGTERM or not (issue 31: an empty answer passed)
    assert stalled_answer.startswith(b"HTTP/1.1 408") and b"serve.body_timeout_s" in stalled_answer, stalled_answer
    assert proc.returncode == 0 and took < 4.0 + 1.5, (took, log[-2000:])
    assert "Traceback" not in log, log[-3000:]


# ------------------------------------------------------------------------------------ issue 30: the event loop stays free

@functools.cache
def _big_page(side: int = 4096) -> bytes:
    """A 16-megapixel gray page of dark strokes on white, as PNG (~140 KB: far under serve.max_body_bytes)."""
    rng = np.random.default_rng(0)
    img = np.full((side, side), 255, np.uint8)
    for y, x, w in zip(rng.integers(0, side - 40, 3000), rng.integers(0, side - 400, 3000), rng.integers(40, 400, 3000)):
        img[y:y + 24, x:x + w] = rng.integers(0, 120)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _health_under_uploads(url: str, body: bytes, n: int) -> tuple[list[int], list[float]]:
    """n uploads of `body` to /predict released at once; /health timed every 20 ms until all are answered.
    One shared client (an httpx.Client per thread spends ~20 ms of GIL each building its SSL context)."""
    import httpx

    statuses, health_ms = [], []
    go = threading.Barrier(n + 1)
    with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n + 1)) as posts, \
            httpx.Client(base_url=url, timeout=30) as probe:
        def post():
            go.wait()
            statuses.append(posts.post("/predict", content=body, headers={"content-type": "image/png"}).status_code)
        threads = [threading.Thread(target=post) for _ in range(n)]
        for t in threads:
            t.start()
        probe.get("/health")                     # connection open before the uploads start
        go.wait()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            health_ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.02)
        for t in threads:
            t.join()
    return statuses, health_ms


def test_health_answers_while_30_big_pages_are_decoded(tiny_model):
    """Issue 30: 30 concurrent 16-megapixel pages stalled /health for 6.1 s while they were decoded on the
    event loop. Decoding runs on the prep pool now: /health keeps answering. The bound is generous (1 s, not
    the 100 ms target) because this host may be shared; docs/serving_hardening.md has the measured figures."""
    from pipeline.serving.http_common import BackgroundServer
    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, max_concurrency=30, log_requests=False)
    with BackgroundServer(app) as srv:
        statuses, health_ms = _health_under_uploads(srv.url, _big_page(), 30)
    assert statuses == [200] * 30
    assert len(health_ms) >= 3 and max(health_ms) < 1000, health_ms


def test_past_the_slots_big_pages_get_429_at_once(tiny_model):
    """Decoding holds a concurrency slot: with 2 slots, most of 30 simultaneous big pages are refused 429 (with
    the limit named) instead of all queueing on the event loop, as all 100 did in issue 30."""
    import httpx

    from pipeline.serving.http_common import BackgroundServer
    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, max_concurrency=2, log_requests=False)
    body = _big_page()
    with BackgroundServer(app) as srv:
        statuses, health_ms = _health_under_uploads(srv.url, body, 30)
        r = None
        while r is None or r.status_code == 429:             # the slots free up once the pages are read
            r = httpx.post(srv.url + "/predict", content=body, headers={"content-type": "image/png"}, timeout=30)
    assert statuses.count(429) >= 10 and set(statuses) == {200, 429}, statuses
    assert r.status_code == 200 and max(health_ms) < 1000


def test_request_past_its_time_budget_gets_503_naming_the_limit(tiny_model):
    """serve.request_timeout_s: a request still in inference past its budget gets 503 naming the key, at the
    deadline; the engine call finishes in its thread, and the next request is answered."""
    import httpx

    from pipeline.serving.http_common import BackgroundServer
    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, log_requests=False, batching={"mode": "off"}, request_timeout_s=0.4,
                                max_concurrency=1)
    run, calls = app.state.engine.run, []
    app.state.runner.inline = False
    app.state.engine.run = lambda x: (calls.append(1), len(calls) == 1 and time.sleep(1.5), run(x))[2]
    with BackgroundServer(app) as srv:
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/predict", content=_png(), headers={"content-type": "image/png"}, timeout=10)
        took = time.perf_counter() - t0
        time.sleep(1.3)                   # the abandoned call ends in its worker thread
        again = httpx.post(srv.url + "/predict", content=_png(), headers={"content-type": "image/png"}, timeout=10)
    assert r.status_code == 503 and "within 0.4 s (serve.request_timeout_s)" in r.json()["error"], r.text
    assert "\n" not in r.text and took < 1.4, took
    assert again.status_code == 200, again.text


def test_upload_slower_than_the_time_budget_gets_408_naming_it(tiny_model):
    from pipeline.serving.http_common import BackgroundServer
    from pipeline.serving.limits import HttpLimits
    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, log_requests=False, request_timeout_s=0.6)
    with BackgroundServer(app, limits=HttpLimits(**{**LIMITS, "body_timeout_s": 10.0})) as srv:
        host, port = srv.url.rsplit("/", 1)[1].split(":")
        s = socket.create_connection((host, int(port)))
        s.sendall(_head() + b"\x89PNG")           # 4 of 1000 bytes, then nothing
        t0 = time.perf_counter()
        answer = _answer(s, 5)
        took = time.perf_counter() - t0
        s.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"within 0.6 s (serve.request_timeout_s)" in answer, answer
    assert took < 2.0, took


def test_head_on_get_routes_answers_like_get_without_a_body(server):
    import httpx

    with httpx.Client(base_url=server.url) as client:
        name = client.get("/health").json()["model"]
        for path in ("/health", "/v2", "/v2/health/live", "/v2/health/ready", f"/v2/models/{name}",
                     f"/v2/models/{name}/ready"):
            get, head = client.get(path), client.head(path)
            assert head.status_code == get.status_code == 200, path
            assert head.content == b"" and head.headers["content-length"] == get.headers["content-length"], path
        assert client.head("/predict").status_code == 405          # POST only: as GET /predict
        assert client.head("/nope").status_code == 404
