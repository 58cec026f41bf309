"""Batching of concurrent requests (pipeline/serving/batching.py): requests that wait for a busy engine share its call,
each gets exactly its own answer, a bad one fails alone, a lone request is not held back, and the choice is
measured and recorded. Served on the tiny model of test_serve (seconds)."""
import asyncio
import time

import numpy as np

from test_serve import H, W, _png, tiny_model  # noqa: F401  (the fixture)

from pipeline.engines.base import Engine
from pipeline.core.errors import DataError


class _Busy(Engine):
    """The real Paddle Inference engine, held busy a little longer per call so that concurrent requests are
    sure to queue behind it (the timing is the only change; outputs are the engine's own). An input holding
    POISON is refused as a runtime would refuse it."""

    POISON = 1e30

    def __init__(self, prefix: str, hold_s: float = 0.02):
        from pipeline.engines.paddle_infer import InferenceEngine

        super().__init__()
        self.inner, self.hold_s, self.batches = InferenceEngine(prefix, "fp32", threads=1), hold_s, []
        self.kind, self.input_shape = self.inner.kind, self.inner.input_shape

    def _run(self, x):
        self.batches.append(len(x))
        time.sleep(self.hold_s)
        if (x >= self.POISON).any():
            raise DataError("engine refused an input value")
        return self.inner.run(x)


def _app(tiny_model, mode: str, engine):
    from pipeline.serving.predict import create_app_from_model

    return create_app_from_model(*tiny_model, engine=engine, max_concurrency=16, batching={"mode": mode, "max_batch": 8,
                                                                       "max_wait_ms": 0, "min_saving_ms": 0.5})


async def _post_all(app, requests: list[dict]) -> list:
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await asyncio.gather(*(c.post("/predict", params={"outputs": "1"}, **r) for r in requests))


def test_concurrent_requests_share_calls_and_each_gets_its_own_answer(tiny_model):
    imgs = np.random.default_rng(3).integers(0, 256, size=(12, H, W), dtype=np.uint8)
    reqs = [{"content": _png(i), "headers": {"content-type": "image/png"}} for i in imgs]
    engine = _Busy(tiny_model[0])
    alone = asyncio.run(_post_all_one_by_one(_app(tiny_model, "off", engine), reqs))
    engine.batches.clear()
    app = _app(tiny_model, "on", engine)
    together = asyncio.run(_post_all(app, reqs))
    assert max(engine.batches) > 1 and len(engine.batches) < len(reqs)      # they really were coalesced
    assert app.state.runner.coalescer.stats["largest"] > 1
    for a, b in zip(alone, together):
        assert a.status_code == b.status_code == 200
        pa, pb = a.json()["predictions"], b.json()["predictions"]
        assert [p["label"] for p in pa] == [p["label"] for p in pb]
        # a sample's row of a batch-k oneDNN call is the same math as the batch-1 call, up to summation order (the
        # scores too: oneDNN's SSE4.1 kernels differ in the 7th digit between batch sizes)
        np.testing.assert_allclose(b.json()["outputs"], a.json()["outputs"], rtol=0, atol=1e-5)


async def _post_all_one_by_one(app, requests: list[dict]) -> list:
    out = []
    for r in requests:
        out += await _post_all(app, [r])
    return out


def test_a_failing_request_does_not_fail_the_others(tiny_model):
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((1, 1, H, W)).astype(np.float32) for _ in range(6)]
    xs[3][0, 0, 0, 0] = _Busy.POISON
    engine = _Busy(tiny_model[0])
    app = _app(tiny_model, "on", engine)
    res = asyncio.run(_post_all(app, [{"json": {"inputs": x.tolist()}} for x in xs]))
    assert [r.status_code for r in res] == [200, 200, 200, 400, 200, 200]
    assert "refused" in res[3].json()["error"]
    assert max(engine.batches) > 1                  # the bad one was in a shared call, then retried alone
    for x, r in zip(xs, res):
        if r.status_code == 200:
            np.testing.assert_allclose(r.json()["outputs"], engine.inner.run(x), rtol=0, atol=1e-5)


def test_a_lone_request_runs_at_once_and_alone():
    from pipeline.serving.batching import Coalescer

    seen = []

    async def call(items):
        seen.append(list(items))
        return [i * 10 for i in items]

    async def main():
        co = Coalescer(call, max_batch=4)
        assert await co.submit(1) == 10               # idle: no task, no wait, a batch of one
        return co

    co = asyncio.run(main())
    assert seen == [[1]] and not co.busy and co._task is None


def test_coalescer_groups_by_key_and_bounds_the_batch():
    from pipeline.serving.batching import Coalescer

    seen = []

    async def call(items):
        seen.append(list(items))
        await asyncio.sleep(0.01)
        return list(items)

    async def main():
        co = Coalescer(call, max_batch=3, key=lambda s: s[0])
        return await asyncio.gather(*(co.submit(s) for s in ["a0", "a1", "b0", "a2", "a3", "a4", "b1"]))

    assert asyncio.run(main()) == ["a0", "a1", "b0", "a2", "a3", "a4", "b1"]
    assert seen[0] == ["a0"]                          # the first ran alone at once
    assert all(len(b) <= 3 and len({s[0] for s in b}) == 1 for b in seen)


def test_the_choice_is_measured_and_recorded(tiny_model):
    from pipeline.serving.batching import decide, describe
    from pipeline.engines.paddle_infer import InferenceEngine

    eng = InferenceEngine(tiny_model[0], "fp32", threads=1)
    shape = [1, H, W]
    off = decide(eng.run, shape, {"mode": "auto", "max_batch": 8, "min_saving_ms": 1e3})
    m = off["measured"]
    assert not off["enabled"] and m["batch"] == 8 and m["base_batch"] == 1
    assert m["base_ms_per_sample"] > 0 and m["batchk_ms_per_sample"] > 0
    on = decide(eng.run, shape, {"mode": "auto", "max_batch": 8, "min_saving_ms": 0.0, "min_saving_ratio": -1.0})
    assert on["enabled"] and on["measured"]["saving_ratio"] < 1
    assert ">= 1000 ms" in describe(off) and describe(off).startswith("batching off")
    same = decide(eng.run, shape, {"mode": "auto", "max_batch": 6}, base=6)      # /ocr: a page's own batch
    assert not same["enabled"] and "nothing to gain" in same["reason"]
    free = decide(eng.run, [1, -1, W], {"mode": "auto", "max_batch": 8})
    assert not free["enabled"] and "no fixed shape" in free["reason"]
    forced = decide(None, None, {"mode": "on", "max_batch": 8})
    assert forced["enabled"] and "measured" not in forced and forced["reason"] == "serve.batching.mode=on"


def test_health_reports_the_choice(tiny_model):
    from fastapi.testclient import TestClient

    with TestClient(_app(tiny_model, "off", None)) as c:
        b = c.get("/health").json()["batching"]
    assert b["enabled"] is False and b["mode"] == "off" and b["stats"] is None
