"""Build any engine by runtime name, tune it per batch profile, and rank engines side by side.

Tuning and ranking measure in interleaved rounds (A, B, C, A, B, C, ...) so that a neighbour's load
on a shared machine hits every candidate alike; the ranking is then fair even when absolute
numbers drift.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.engines.base import Engine, ShapeRouted
from pipeline.core.errors import ConfigError

KINDS = ("paddle-inference", "onnxruntime", "openvino")      # the built-in runtimes
INTERLEAVED = "interleaved"     # rank()'s rows: timed alternately in one loop, one session id per call


@dataclass(frozen=True)
class EngineSpec:
    """What registering an engine declares (docs/extending.md): its runtime name, how to build one, and the Python
    module its runtime needs (None: always available). build(model, precision, *, threads, batch, spin, **opts)
    returns a base.Engine subclass instance (it implements `_run` and sets input_shape, effective_precision with
    its evidence)."""
    kind: str
    build: Callable[..., Engine]
    requires: str | None = None


def _paddle_inference(model, precision, *, threads, batch, spin, **paddle_opts) -> Engine:
    from pipeline.engines.paddle_infer import InferenceEngine
    return InferenceEngine(model, precision, threads=threads, **paddle_opts)


def _onnxruntime(model, precision, *, threads, batch, spin, **_) -> Engine:
    from pipeline.engines.ort import OrtEngine
    return OrtEngine(model, threads=threads, label=precision, spin=spin)


def _openvino(model, precision, *, threads, batch, spin, static_shapes: int = 0, **_) -> Engine:
    from pipeline.engines.ov import OpenVinoEngine
    return OpenVinoEngine(model, threads=threads, label=precision, static_batch=batch, static_shapes=static_shapes)


_ENGINES: dict[str, EngineSpec] = {s.kind: s for s in (EngineSpec("paddle-inference", _paddle_inference, "paddle"),
                                                       EngineSpec("onnxruntime", _onnxruntime, "onnxruntime"),
                                                       EngineSpec("openvino", _openvino, "openvino"))}


def register_engine(kind: str, build: Callable[..., Engine], requires: str | None = None) -> EngineSpec:
    """Add a runtime: `make(kind, ...)`, tune and rank then build it like any other (a built-in name cannot be taken)."""
    if kind in KINDS:
        raise ValueError(f"engine {kind!r} is built in; register another name")
    spec = _ENGINES[kind] = EngineSpec(kind, build, requires)
    return spec


def kinds() -> tuple[str, ...]:
    """Every engine `make` builds: the built-ins, then registered ones."""
    return tuple(_ENGINES)


def _spec(kind: str) -> EngineSpec:
    if kind not in _ENGINES:
        raise ConfigError(f"unknown engine {kind!r}", hint=f"one of {', '.join(_ENGINES)}")
    return _ENGINES[kind]


def available(kind: str) -> tuple[bool, str]:
    """Is the runtime importable here? (Paddle Inference always is: it is the pipeline's base.)"""
    mod = _spec(kind).requires
    if mod is None:
        return True, "ok"
    try:
        __import__(mod)
    except ImportError as e:
        return False, f"{mod} is not installed ({e}); pip install -r requirements.txt"
    from pipeline.core import capabilities

    if kind == "openvino" and capabilities.onednn_below_avx2():
        # its CPU plugin honours the oneDNN cap, and below AVX2 it cannot compile every node ("MVN node ... bad
        # combination" on a layer-normed model): a test environment that caps the ISA, not a deployment target
        return False, (f"OpenVINO's CPU plugin below AVX2 ({capabilities.ISA_ENV}="
                       f"{os.environ.get(capabilities.ISA_ENV) or 'no AVX2 on this CPU'})")
    return True, "ok"


def make(kind: str, model: str | os.PathLike, precision: str = "fp32", *, threads: int = 1,
         batch: int | None = None, spin: bool = True, **paddle_opts) -> Engine:
    """model: a Paddle prefix for paddle-inference; an .onnx (or OpenVINO .xml) file otherwise.
    batch: a batch size the instance will always see (OpenVINO compiles it statically).
    spin=False: ONNX Runtime's pool threads sleep between calls (for servers). Paddle's OpenMP threads are
    not switched here: they follow OMP_WAIT_POLICY, chosen per process by pipeline/core/env.py."""
    engine = _spec(kind).build(model, precision, threads=threads, batch=batch, spin=spin, **paddle_opts)
    if not isinstance(engine, Engine) or not isinstance(getattr(engine, "input_shape", None), (list, tuple)):
        raise TypeError(f"engine {kind!r} built a {type(engine).__name__}: an engine is a pipeline.engines.base.Engine "
                        "with input_shape set (docs/extending.md)")
    return engine


# engine options a batch profile records besides threads: those the tuner chooses (ir_optim), and the fp16 row's
# mixed-precision black list (a GPU predictor must get the one its model was converted with)
TUNABLE = {"paddle-inference": ("ir_optim", "keep_fp32_ops")}


def profile_options(kind: str, profile: dict) -> dict:
    """The engine options a recorded batch profile carries ({"threads": 1, "ir_optim": False, ...})."""
    return {k: profile[k] for k in TUNABLE.get(kind, ()) if k in profile}


def make_routed(kind: str, model: str | os.PathLike, precision: str, settings: dict, *, spin: bool = False,
                **paddle_opts) -> ShapeRouted:
    """Rebuild a tuned engine from its recorded settings ({"batch1": {"threads", ...}, "batchN": {...}}),
    as tune() measured it (spin=False: ONNX Runtime's pool threads sleep between calls, as in `serve`)."""
    one, many = ({**paddle_opts, **profile_options(kind, settings[p])} for p in ("batch1", "batchN"))
    return ShapeRouted(make(kind, model, precision, threads=int(settings["batch1"]["threads"]), batch=1, spin=spin,
                            **one),
                       make(kind, model, precision, threads=int(settings["batchN"]["threads"]), spin=spin, **many))


def batch_of(x: np.ndarray, n: int) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate([x] * (n // len(x) + 1))[:n])


def rotated(keys: list, round_index: int) -> list:
    """The order of one interleaved round: each round starts with the next engine, so no engine is always timed
    first (right after the others' caches and the CPU's clock were disturbed) or always last."""
    if not keys:
        return keys
    i = round_index % len(keys)
    return keys[i:] + keys[:i]


def interleaved_latency(engines: dict[str, Engine], x1: np.ndarray, *, warmup: int, repeats: int,
                        rounds: int = 5) -> dict[str, dict]:
    """Batch-1 latency summaries, measured in interleaved rounds (the first-timed engine rotates per round)."""
    from pipeline.engines.perf import latency_ms, summarize_ms

    per = max(1, repeats // rounds)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for e in engines.values():
        for _ in range(warmup):
            e.run(x1)
    for r in range(rounds):
        for k in rotated(list(engines), r):
            times[k].extend(latency_ms(engines[k].run, x1, warmup=0, repeats=per, raw=True))
    return {k: {**summarize_ms(v), "repeats": len(v)} for k, v in times.items()}


def interleaved_throughput(engines: dict[str, Engine], xb: np.ndarray, *, warmup: int, repeats: int,
                           rounds: int = 5) -> dict[str, float]:
    """Samples/s at batch len(xb): len(xb) / median call time over interleaved rounds."""
    from pipeline.engines.perf import latency_ms

    per = max(1, repeats // rounds)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for e in engines.values():
        for _ in range(max(1, warmup)):
            e.run(xb)
    for r in range(rounds):
        for k in rotated(list(engines), r):
            times[k].extend(latency_ms(engines[k].run, xb, warmup=0, repeats=per, raw=True))
    return {k: float(len(xb) / (np.median(v) / 1e3)) for k, v in times.items()}


def thread_choices(choices: list[int], cores: int) -> list[int]:
    """Config values (0 = all cores) -> distinct thread counts within 1..cores, in order."""
    out = [cores if c == 0 else min(int(c), cores) for c in choices]
    return list(dict.fromkeys(c for c in out if c >= 1)) or [cores]


def tune(kind: str, model: str | os.PathLike, precision: str, x: np.ndarray, *, batch_size: int,
         threads: list[int], warmup: int, repeats: int, rounds: int = 5, variants: list[dict] | None = None,
         spin: bool = False, **paddle_opts) -> tuple[ShapeRouted, dict]:
    """Pick threads (and engine options: variants, e.g. [{"ir_optim": True}, {"ir_optim": False}]) per batch
    profile by measurement: the lowest batch-1 p50 and the highest batch-N samples/s. One instance per
    profile and candidate, so no instance alternates shapes. Within 5 % counts as a tie, won by fewer
    threads (less contention with the server's other work), then by the earlier variant.
    spin=False: candidates are built as `serve` runs them (ONNX Runtime's pool threads sleep between calls;
    with spinning threads 2 threads won the OCR model's batch-1 in a tight loop but took 0.77 instead of
    0.38 ms inside serve's requests, measured 2026-11-30), so the choice holds where it is used."""
    x1, xb = np.ascontiguousarray(x[:1]), batch_of(x, batch_size)
    cands = [{"threads": t, **v} for t in threads for v in (variants or [{}])]
    names = [" ".join(f"{k}={v}" for k, v in c.items()) for c in cands]

    def build(c: dict, batch: int | None) -> Engine:
        return make(kind, model, precision, batch=batch, spin=spin, **{**paddle_opts, **c})

    if len(cands) == 1:         # nothing to choose between: timing it would cost (v4 det: ~10 s per engine) and decide nothing
        why = "the only candidate (server.tuning lists one thread count and variant): not measured"
        record = {"batch1": {**cands[0], "chosen": why}, "batchN": {**cands[0], "batch": batch_size, "chosen": why},
                  "instances": "one per batch profile"}
        return ShapeRouted(build(cands[0], 1), build(cands[0], None)), record
    ones = {n: build(c, 1) for n, c in zip(names, cands)}
    manys = {n: build(c, None) for n, c in zip(names, cands)}
    lat = interleaved_latency(ones, x1, warmup=warmup, repeats=repeats, rounds=rounds)
    sps = interleaved_throughput(manys, xb, warmup=max(1, warmup // 2), repeats=max(rounds, repeats // 5),
                                 rounds=rounds)
    best_lat, best_sps = min(v["p50"] for v in lat.values()), max(sps.values())
    i1 = min(range(len(cands)), key=lambda i: (lat[names[i]]["p50"] > 1.05 * best_lat, cands[i]["threads"], i))
    iN = min(range(len(cands)), key=lambda i: (sps[names[i]] < best_sps / 1.05, cands[i]["threads"], i))
    for i, n in enumerate(names):
        if i != i1:
            ones[n].close()
        if i != iN:
            manys[n].close()
    record = {"batch1": {**cands[i1], "p50_ms_by_candidate": {n: round(lat[n]["p50"], 4) for n in names}},
              "batchN": {**cands[iN], "batch": batch_size,
                         "samples_per_s_by_candidate": {n: round(sps[n], 1) for n in names}},
              "instances": "one per batch profile"}
    return ShapeRouted(ones[names[i1]], manys[names[iN]]), record


def rank(engines: dict[str, Engine], x: np.ndarray, *, batch_size: int, warmup: int, repeats: int,
         rounds: int = 5, by: str | None = None) -> list[dict]:
    """Side by side, interleaved: batch-1 p50 and batch-N samples/s with ratios to the best of each.
    by="latency" / "throughput": only that profile (the other is None): what a recommendation ranks on (the
    v4 det's six candidates spent ~40 s on batch-8 throughput a latency recommendation never read)."""
    import uuid

    x1, xb = np.ascontiguousarray(x[:1]), batch_of(x, batch_size)
    # every row carries the same marker: a ranker can tell rows timed side by side in this loop from figures
    # taken at other moments (pipeline/bundle/recommend.interleaved_session refuses to mix them)
    timing = {"how": INTERLEAVED, "session": uuid.uuid4().hex[:12], "rounds": rounds, "candidates": len(engines)}
    lat = interleaved_latency(engines, x1, warmup=warmup, repeats=repeats, rounds=rounds) \
        if by != "throughput" else {k: None for k in engines}
    sps = interleaved_throughput(engines, xb, warmup=max(1, warmup // 2), repeats=max(rounds, repeats // 5),
                                 rounds=rounds) if by != "latency" else {k: None for k in engines}
    best_lat = min((v["p50"] for v in lat.values() if v), default=None)
    best_sps = max((v for v in sps.values() if v), default=None)
    rows = [{"engine": k, "latency_ms": lat[k], "throughput_sps": sps[k], "throughput_batch": batch_size,
             "p50_vs_fastest": round(lat[k]["p50"] / best_lat, 3) if lat[k] else None,
             "sps_vs_best": round(sps[k] / best_sps, 3) if sps[k] else None, "timing": timing}
            for k in engines]
    if by == "throughput":
        return sorted(rows, key=lambda r: -r["throughput_sps"])
    return sorted(rows, key=lambda r: r["latency_ms"]["p50"])
