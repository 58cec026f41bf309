"""Bounded local HTTP load for `make bench-deploy`: `serve` against a bare FastAPI endpoint.

Both servers run in their own process on 127.0.0.1 (uvicorn, same settings; see _bare for how their
/predict routes differ); the clients send the same PNG bodies to both, alternating rounds so that load from
neighbours on a shared machine hits both alike. Every run is bounded by a request count and a time limit.

Clients: concurrency 1 (latency) uses the standard library's http.client on one keep-alive connection;
concurrency N uses aiohttp. On this 2-core machine under load, aiohttp's own request path cost ~0.8 ms
of CPU per request and put the bare endpoint's p50 at 3-4 ms, against 0.3-0.8 ms for http.client or a
raw socket (measured 2026-11-30): a latency client should not be what the latency measures.
`python scripts/http_load.py bare --port N` runs the bare endpoint (the bench starts it).
"""

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server child process on 127.0.0.1:port; always stopped (by its own pid) on exit."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, timeout: float = 120):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait(ready_path, timeout)

    def _wait(self, path: str, timeout: float) -> None:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"error: server {self.proc.args} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise SystemExit(f"error: server {self.proc.args} not ready after {timeout:g}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def serve_cmd(bundle: Path, port: int, engine: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pipeline", "serve", str(bundle), "--port", str(port)]
    return cmd + (["--engine", engine] if engine else [])


def bare_cmd(port: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "bare", "--port", str(port)]


async def _load(url: str, bodies: list[bytes], n: int, concurrency: int, seconds: float) -> dict:
    import aiohttp

    lat: list[float] = []
    server_ms: list[float] = []
    errors = 0
    it = iter(range(n))
    deadline = time.perf_counter() + seconds
    headers = {"content-type": "image/png"}

    async def worker(session):
        nonlocal errors
        for i in it:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            async with session.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                lat.append((time.perf_counter() - t0) * 1e3)
                if "x-latency-ms" in r.headers:
                    server_ms.append(float(r.headers["x-latency-ms"]))

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(min(20, n)):                     # warm-up, not counted
            async with session.post(url, data=bodies[0], headers=headers) as r:
                await r.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests": len(lat), "seconds": wall, "rps": len(lat) / wall if wall else 0.0, "errors": errors,
            "client_ms": lat, "server_ms": server_ms}


def _sequential(url: str, bodies: list[bytes], n: int, seconds: float) -> dict:
    """One request at a time on one keep-alive connection (http.client sends headers and a bytes body in
    one write). Also collects the server's own numbers: X-Latency-ms and the JSON body's inference_ms."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    headers = {"content-type": "image/png"}
    lat: list[float] = []
    server_ms: list[float] = []
    inference_ms: list[float] = []
    errors = 0

    def post(body: bytes) -> tuple[int, bytes, str | None]:
        conn.request("POST", u.path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("x-latency-ms")

    try:
        for _ in range(min(20, n)):                     # warm-up, not counted
            post(bodies[0])
        t_start = time.perf_counter()
        for i in range(n):
            if time.perf_counter() - t_start > seconds:
                break
            t0 = time.perf_counter()
            status, data, srv = post(bodies[i % len(bodies)])
            lat.append((time.perf_counter() - t0) * 1e3)
            errors += status != 200
            if srv is not None:
                server_ms.append(float(srv))
            if status == 200 and b"inference_ms" in data:
                inference_ms.append(float(json.loads(data)["inference_ms"]))
        wall = time.perf_counter() - t_start
    finally:
        conn.close()
    return {"requests": len(lat), "seconds": wall, "rps": len(lat) / wall if wall else 0.0, "errors": errors,
            "client_ms": lat, "server_ms": server_ms, "inference_ms": inference_ms}


def load(url: str, bodies: list[bytes], *, n: int, concurrency: int, seconds: float) -> dict:
    if concurrency == 1:
        return _sequential(url, bodies, n, seconds)
    return {**asyncio.run(_load(url, bodies, n, concurrency, seconds)), "inference_ms": []}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare(servers: dict[str, str], bodies: list[bytes], *, n: int, concurrency: int, seconds: float,
            rounds: int = 3, pids: dict[str, int] | None = None) -> dict[str, dict]:
    """Alternating rounds per server; returns totals: rps, client p50/p90, server-side p50 (x-latency-ms) and,
    at concurrency 1, the engine time inside the request (the response's inference_ms); with pids, the
    server process's CPU time per request (spinning threads and per-request overhead show up there)."""
    acc: dict[str, dict] = {k: {"requests": 0, "seconds": 0.0, "errors": 0, "client_ms": [], "server_ms": [],
                                "inference_ms": [], "cpu_s": 0.0} for k in servers}
    pids = pids or {}
    for _ in range(rounds):
        for name, url in servers.items():
            c0 = cpu_seconds(pids[name]) if name in pids else None
            r = load(url, bodies, n=max(1, n // rounds), concurrency=concurrency, seconds=seconds / rounds)
            c1 = cpu_seconds(pids[name]) if c0 is not None else None
            a = acc[name]
            a["cpu_s"] = None if c1 is None or a["cpu_s"] is None else a["cpu_s"] + c1 - c0
            a["requests"] += r["requests"]
            a["seconds"] += r["seconds"]
            a["errors"] += r["errors"]
            a["client_ms"] += r["client_ms"]
            a["server_ms"] += r["server_ms"]
            a["inference_ms"] += r["inference_ms"]
    out = {}
    for name, a in acc.items():
        c = np.asarray(a["client_ms"]) if a["client_ms"] else np.zeros(1)
        out[name] = {"requests": a["requests"], "errors": a["errors"],
                     "rps": a["requests"] / a["seconds"] if a["seconds"] else 0.0,
                     "client_p50_ms": float(np.percentile(c, 50)), "client_p90_ms": float(np.percentile(c, 90)),
                     "server_p50_ms": float(np.median(a["server_ms"])) if a["server_ms"] else None,
                     "inference_p50_ms": float(np.median(a["inference_ms"])) if a["inference_ms"] else None,
                     "server_cpu_ms": a["cpu_s"] * 1e3 / a["requests"] if a["cpu_s"] is not None and a["requests"]
                     else None}
    return out


def _bare(port: int) -> None:
    """The floor: FastAPI + uvicorn doing nothing but reading the body and answering a small JSON, through
    a plain Starlette route in a FastAPI app (the "bare FastAPI endpoint" of the goal). serve answers its
    /predict ahead of FastAPI's router and exception middleware (serve._HotRoutes, ~0.035 ms less per
    request); the rest of the difference is the work a request needs (decode, preprocess, model, JSON) plus
    serve's limits and request log."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import Response

    app = FastAPI(docs_url=None, redoc_url=None)

    async def predict(request):
        await request.body()
        return Response(b'{"ok":true}', media_type="application/json")

    app.add_route("/predict", predict, methods=["POST"])

    @app.get("/health")
    async def health():
        return {"ok": True}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["bare"])
    ap.add_argument("--port", type=int, required=True)
    _bare(ap.parse_args().port)
