"""One engine interface for every runtime: Paddle Inference, Paddle Lite, ONNX Runtime, OpenVINO.

An engine is loaded from an artifact (converting first where the runtime needs it), runs a float32
NCHW batch and returns output 0, and says what precision really ran and why (`evidence`). The server
stage, the lite stage, `verify`, `serve` and `bench-deploy` all drive engines through this class, so
they share one measure-and-gate loop.
"""
from __future__ import annotations

import abc
from typing import Sequence

import numpy as np

from pipeline.core.errors import ConfigError, DataError


def validate_input(x: object, want: Sequence[int], who: str = "engine") -> None:
    """float32, rank and fixed dims as declared (-1/None free), batch >= 1: runtimes check less
    (Lite: nothing at all), so this is the one place bad arrays are refused."""
    if not isinstance(x, np.ndarray):
        raise DataError(f"{who} input must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise DataError(f"{who} input dtype {x.dtype} != float32", hint="cast with x.astype(np.float32)")
    want = [-1 if d is None else int(d) for d in want]
    if x.ndim != len(want):
        raise DataError(f"{who} input shape {list(x.shape)} does not match model input {want} "
                        f"(rank {x.ndim} vs {len(want)})")
    bad = [i for i, (g, w) in enumerate(zip(x.shape, want)) if w > 0 and g != w]
    if bad or x.shape[0] == 0:
        raise DataError(f"{who} input shape {list(x.shape)} does not match model input {want}",
                        hint="-1 dims are free; batch must be >= 1")


class Engine(abc.ABC):
    """A loaded model on one runtime: what an engine must implement (a new runtime subclasses it and is registered
    with pipeline.engines.registry.register_engine; docs/extending.md).

    Must: implement `_run` (a validated float32 batch -> output 0 as numpy) and, in __init__ (after
    super().__init__()), set `input_shape` (declared, -1 = free). Set as they apply: `kind` (runtime name used in
    gate subjects, e.g. "onnxruntime"), `effective_precision` (what really runs: never the requested label without
    proof), `evidence` (the proof: kernel precisions, quantized op counts, runtime properties), `notes`
    (human-readable caveats) and `settings` (threads, providers ...). May override `close` (release sessions).
    """

    kind: str = "engine"
    input_shape: list[int]
    effective_precision: str = "fp32"

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.evidence: dict = {}
        self.settings: dict = {}

    @abc.abstractmethod
    def _run(self, x: np.ndarray) -> np.ndarray:
        """Run a validated, contiguous batch; return output 0."""

    def run(self, x: np.ndarray) -> np.ndarray:
        validate_input(x, self.input_shape, self.kind)
        return self._run(np.ascontiguousarray(x))

    def run_batched(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        validate_input(x, self.input_shape, self.kind)
        return np.concatenate([self._run(np.ascontiguousarray(x[i:i + batch_size]))
                               for i in range(0, len(x), batch_size)], axis=0)

    def describe(self) -> dict:
        """What a gate/report records about this engine."""
        return {"engine": self.kind, "precision_effective": self.effective_precision,
                "evidence": dict(self.evidence), "notes": list(self.notes), "settings": dict(self.settings)}

    def perf(self, x: np.ndarray, batch_size: int, warmup: int = 5, repeats: int = 50) -> dict:
        """Batch-1 latency percentiles and batch-N throughput (the two profiles engines are ranked on)."""
        from pipeline.engines import perf

        one = x[:1]
        batch = np.concatenate([x] * (batch_size // len(x) + 1))[:batch_size]
        lat = perf.latency_ms(self.run, one, warmup=warmup, repeats=repeats)
        sps = perf.throughput(self.run, batch, warmup=max(1, warmup // 2), repeats=max(3, repeats // 5))
        return {"latency_ms": lat, "throughput_sps": sps, "throughput_batch": batch_size}

    def close(self) -> None:
        """Release runtime resources (subclasses with sessions override)."""

    def trim(self) -> None:
        """Give back the working memory kept for the shapes run so far (the engine stays usable; the next call
        of a shape prepares it again). The server stage trims the engines it keeps for serving after each row, so
        one row's batch buffers are not carried through the next rows (subclasses with pools override)."""


class ShapeRouted(Engine):
    """Batch-1 requests go to one instance, larger batches to another.

    oneDNN (and OpenVINO's CPU plugin) re-create primitives when one instance alternates shapes:
    measured ~2x slower batch-1 latency with a shared predictor. Each instance also gets the thread
    count tuned for its profile (few threads for latency, all cores for throughput).
    """

    def __init__(self, single: Engine, batched: Engine) -> None:
        super().__init__()
        self.single, self.batched = single, batched
        self.kind = single.kind
        self.input_shape = batched.input_shape      # the single instance may be compiled for batch 1 only
        self.effective_precision = single.effective_precision
        if batched.effective_precision != single.effective_precision:
            raise ConfigError(f"{self.kind}: per-shape instances disagree on precision "
                              f"({single.effective_precision} vs {batched.effective_precision})")
        self.notes = list(dict.fromkeys(single.notes + batched.notes))
        self.evidence = dict(single.evidence)
        self.settings = {"batch1": dict(single.settings), "batchN": dict(batched.settings)}

    def _run(self, x: np.ndarray) -> np.ndarray:
        return (self.single if len(x) == 1 else self.batched)._run(x)

    def close(self) -> None:
        self.single.close()
        self.batched.close()

    def trim(self) -> None:
        self.single.trim()
        self.batched.trim()
