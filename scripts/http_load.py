"""Bounded local HTTP load for `make bench-deploy`: `serve` against a bare FastAPI endpoint.

Both servers run in their own process on 127.0.0.1 (uvicorn, same settings); the client (aiohttp,
keep-alive) sends the same PNG bodies to both, alternating rounds so that load from neighbours on a
shared machine hits both alike. Every run is bounded by a request count and a time limit.
`python scripts/http_load.py bare --port N` runs the bare endpoint (the bench starts it).
"""

import asyncio
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


def load(url: str, bodies: list[bytes], *, n: int, concurrency: int, seconds: float) -> dict:
    return asyncio.run(_load(url, bodies, n, concurrency, seconds))


def compare(servers: dict[str, str], bodies: list[bytes], *, n: int, concurrency: int, seconds: float,
            rounds: int = 3) -> dict[str, dict]:
    """Alternating rounds per server; returns totals: rps, client p50/p90, server-side p50 (x-latency-ms)."""
    acc: dict[str, dict] = {k: {"requests": 0, "seconds": 0.0, "errors": 0, "client_ms": [], "server_ms": []}
                            for k in servers}
    for _ in range(rounds):
        for name, url in servers.items():
            r = load(url, bodies, n=max(1, n // rounds), concurrency=concurrency, seconds=seconds / rounds)
            a = acc[name]
            a["requests"] += r["requests"]
            a["seconds"] += r["seconds"]
            a["errors"] += r["errors"]
            a["client_ms"] += r["client_ms"]
            a["server_ms"] += r["server_ms"]
    out = {}
    for name, a in acc.items():
        c = np.asarray(a["client_ms"]) if a["client_ms"] else np.zeros(1)
        out[name] = {"requests": a["requests"], "errors": a["errors"],
                     "rps": a["requests"] / a["seconds"] if a["seconds"] else 0.0,
                     "client_p50_ms": float(np.percentile(c, 50)), "client_p90_ms": float(np.percentile(c, 90)),
                     "server_p50_ms": float(np.median(a["server_ms"])) if a["server_ms"] else None}
    return out


def _bare(port: int) -> None:
    """The floor: FastAPI + uvicorn doing nothing but reading the body and answering a small JSON."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    app = FastAPI(docs_url=None, redoc_url=None)

    @app.post("/predict")
    async def predict(request: Request):
        await request.body()
        return Response(b'{"ok":true}', media_type="application/json")

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
