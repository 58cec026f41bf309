"""Concurrent requests run as one engine call when that pays: the measurement that decides, and the coalescer.

Coalescing: a request that finds the engine idle runs at once, alone, with no added wait. Requests that arrive
while the engine is busy queue; when it frees up, the queued ones (same input shape, up to `max_batch`
samples) run as one call, and each gets its own slice of the result. A queued request therefore waits at most
for the call in progress (plus `max_wait_ms`, spent only when others are queued). A batch that raises is run
again one request at a time, so a bad request never fails the others.

The decision (`decide`): batching is on when the served engine's per-sample time at batch `max_batch` is at
least `min_saving_ms` and `min_saving_ratio` below its time at the batch a request runs alone (1 for /predict; for
/ocr a page's own full batch of rec_batch_num crops). On a model whose batch-1 call is a fraction of a millisecond
the saving is smaller than what batching costs a lone request (its thread hop; README "Serving").
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Hashable

import numpy as np

MODES = ("auto", "on", "off")
# the serve.batching keys' defaults (docs/serving_hardening.md (serve settings) says how min_saving_ms was measured)
DEFAULTS = {"mode": "auto", "max_batch": 8, "max_wait_ms": 0.0, "min_saving_ms": 0.5, "min_saving_ratio": 0.1}


def _median_ms(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    """Median CPU time of the process per call: what a saturated server spends per request, and steadier than
    wall time on a shared machine (on a loaded host wall time at batch 8 of PP-OCRv4 rec read 18 % *slower* per
    sample than batch 1 while serve's CPU per request at concurrency 8 was 14 % lower with batching on)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return float(np.median(times) * 1e3)


def measure(run: Callable[[np.ndarray], Any], sample_shape: list[int], k: int, budget_s: float = 3.0,
            base: int = 1) -> dict:
    """Per-sample engine CPU time at batch `base` (what a request runs alone) and batch k on zeros, interleaved
    (the neighbours' load hits both), within about budget_s (a big model gets fewer repeats, at least 3 rounds)."""
    x1 = np.zeros([base, *sample_shape], np.float32)
    xk = np.zeros([k, *sample_shape], np.float32)
    first = _median_ms(lambda: run(x1), 1, 1) + _median_ms(lambda: run(xk), 1, 1)      # warm both
    rounds = int(max(3, min(5, budget_s * 1e3 / max(first * 3, 1e-3))))
    per = int(max(1, min(20, budget_s * 1e3 / max(first * rounds, 1e-3))))
    one, many = [], []
    for r in range(rounds):                 # alternate which batch is timed first in a round
        for x, times in ((x1, one), (xk, many))[::1 if r % 2 == 0 else -1]:
            times.append(_median_ms(lambda x=x: run(x), per, 0))
    b1, bk = float(np.median(one)) / base, float(np.median(many)) / k
    return {"base_batch": base, "batch": k, "base_ms_per_sample": round(b1, 4), "batchk_ms_per_sample": round(bk, 4),
            "saving_ms_per_sample": round(b1 - bk, 4), "saving_ratio": round((b1 - bk) / b1, 4) if b1 > 0 else 0.0,
            "repeats": rounds * per}


def decide(run: Callable[[np.ndarray], Any] | None, sample_shape: list[int] | None, settings: dict,
           base: int = 1) -> dict:
    """The choice for one served engine: settings {mode, max_batch, max_wait_ms, min_saving_ms, min_saving_ratio}.
    mode on/off is taken as is (recorded, not measured); auto measures batch `base` (what a request runs alone:
    1 for /predict, rec_batch_num crops for an /ocr page) against max_batch, and is on when the per-sample saving
    reaches both minimums. Inputs with a free non-batch dim (pages at their own size) never share a shape, so
    auto leaves them unbatched."""
    s = {**DEFAULTS, **settings}
    mode, k = s["mode"], int(s["max_batch"])
    mode = {True: "on", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode    # YAML's on/off
    choice = {"mode": mode, "max_batch": k, "max_wait_ms": float(s["max_wait_ms"]),
              "min_saving_ms": float(s["min_saving_ms"]), "min_saving_ratio": float(s["min_saving_ratio"])}
    if mode in ("on", "off"):
        return {**choice, "enabled": mode == "on" and k > 1, "reason": f"serve.batching.mode={mode}"}
    if run is None or not sample_shape or any(int(d) <= 0 for d in sample_shape) or k <= base:
        why = "inputs have no fixed shape" if k > base else f"max_batch {k} <= the batch a request runs alone ({base})"
        return {**choice, "enabled": False, "reason": f"{why}: nothing to gain"}
    m = measure(run, [int(d) for d in sample_shape], k, base=base)
    on = m["saving_ms_per_sample"] >= choice["min_saving_ms"] and m["saving_ratio"] >= choice["min_saving_ratio"]
    why = (f"batch {k} saves {m['saving_ms_per_sample']:.3f} ms per sample ({m['saving_ratio']:.0%}) over batch {base} "
           f"({m['base_ms_per_sample']:.3f} -> {m['batchk_ms_per_sample']:.3f} ms); on needs >= {choice['min_saving_ms']:g} "
           f"ms and >= {choice['min_saving_ratio']:.0%}")
    return {**choice, "enabled": on, "measured": m, "reason": why}


def served_shape(input_shape: list, preprocess: dict | None) -> list[int]:
    """The sample shape requests mostly have: the model's, free height/width filled from the preprocessing
    (a PaddleOCR recogniser takes any width, but lines are padded to `width`, so most requests share it)."""
    shape = [int(d) if isinstance(d, int) and d > 0 else -1 for d in input_shape]
    pre = preprocess or {}
    for i, key in ((-2, "height"), (-1, "width")):
        if len(shape) >= 2 and shape[i] <= 0 and isinstance(pre.get(key), int):
            shape[i] = pre[key]
    return shape


def state(choice: dict, coalescer: "Coalescer | None") -> dict:
    """What GET /health shows: the choice and, when on, how many requests the engine calls served."""
    return {**choice, "stats": dict(coalescer.stats) if coalescer else None}


def describe(choice: dict) -> str:
    """One log line."""
    state = "on" if choice.get("enabled") else "off"
    extra = f" (max batch {choice['max_batch']}, max wait {choice['max_wait_ms']:g} ms)" if choice.get("enabled") else ""
    return f"batching {state}{extra}: {choice.get('reason', '')}"


class Coalescer:
    """Runs concurrent submissions together (see the module docstring).

    call: async, a list of items -> a list with one result per item. size(item): samples an item holds
    (bounded by max_batch together); key(item): only items with equal keys share a call."""

    def __init__(self, call: Callable[[list], Awaitable[list]], *, max_batch: int, max_wait_ms: float = 0.0,
                 size: Callable[[Any], int] = lambda item: 1, key: Callable[[Any], Hashable] = lambda item: None):
        self.call, self.max_batch, self.max_wait_s = call, int(max_batch), float(max_wait_ms) / 1e3
        self.size, self.key = size, key
        self.busy, self._task = False, None
        self.queue: list[tuple[Any, asyncio.Future]] = []
        self.stats = {"calls": 0, "items": 0, "largest": 0}

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.busy:
            fut = loop.create_future()
            self.queue.append((item, fut))
            return await fut
        self.busy = True                     # idle: this request runs now, alone, with no added wait
        try:
            return (await self._call([item]))[0]
        finally:
            self._hand_over(loop)

    def _hand_over(self, loop) -> None:
        if self.queue:
            self._task = loop.create_task(self._drain())   # the queue is served by a task; this request returns now
        else:
            self.busy = False

    async def _drain(self) -> None:
        try:
            while self.queue:
                if self.max_wait_s and self._queued_samples() < self.max_batch:
                    await asyncio.sleep(self.max_wait_s)          # only under contention: let the batch fill
                batch = self._take()
                await self._settle(batch)
        finally:
            self.busy = False

    def _queued_samples(self) -> int:
        return sum(self.size(item) for item, _ in self.queue)

    def _take(self) -> list[tuple[Any, asyncio.Future]]:
        """The head of the queue and the queued items with its key, up to max_batch samples (at least one)."""
        head = self.key(self.queue[0][0])
        batch, rest, n = [], [], 0
        for item, fut in self.queue:
            s = self.size(item)
            if self.key(item) == head and (not batch or n + s <= self.max_batch):
                batch.append((item, fut))
                n += s
            else:
                rest.append((item, fut))
        self.queue = rest
        return batch

    async def _settle(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        batch = [(i, f) for i, f in batch if not f.done()]      # a cancelled request (client gone) is dropped
        if not batch:
            return
        try:
            results = await self._call([i for i, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                _set(batch[0][1], exc=exc)
                return
            for pair in batch:                                   # one bad request must not fail the others
                await self._settle([pair])
            return
        for (_, fut), res in zip(batch, results):
            _set(fut, res)

    async def _call(self, items: list) -> list:
        self.stats["calls"] += 1
        self.stats["items"] += len(items)
        self.stats["largest"] = max(self.stats["largest"], len(items))
        return await self.call(items)


def _set(fut: asyncio.Future, res: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


def split_rows(out: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Per-request slices of a batched output, in submission order."""
    return np.split(out, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [out]
