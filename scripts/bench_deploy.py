"""`make bench-deploy`: every engine side by side, for the default model and the OCR model, then `serve`
under a bounded local load against a bare FastAPI endpoint.

Reads runs/<name>/{train,export,server} and the newest bundles/<name>-* for the HTTP part (run
`make train export deploy` first; the OCR model: `make train export deploy CONFIG=configs/ocr_rec.yaml`,
a short training is enough for speed; without its bundle its HTTP part is skipped). Every
engine is measured in one process in interleaved rounds (A, B, C, A, B, C ...), so neighbours' load on
a shared machine hits all alike: read the ratios, not the absolute numbers. Also prints the matmul peak,
achieved GFLOP/s and the done-when ratios of the fast-serving work (issue 12), with the decomposition of a
/predict request (engine, server-side time, the bare HTTP floor) so a reader sees which ratio is reachable.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import pipeline
from pipeline.bundle import layout as bundle_layout
from pipeline.core import env
from pipeline.core.config import load_config, split_overrides
from pipeline.engines.base import Engine
from pipeline.core.errors import PipelineError

EAGER = "eager dygraph"
AS_BEFORE = "paddle-inference as configured before (oneDNN+IR, all cores, one predictor)"


class EagerEngine(Engine):
    """The trained dygraph model behind the engine interface (the speed floor every engine must beat)."""

    kind = "eager dygraph"

    def __init__(self, run: Path, info: dict) -> None:
        import paddle

        from pipeline.tasks import get_task

        super().__init__()
        task = get_task(info["task"], info.get("postprocess"))
        self.model = task.build_model(info["model"], info["labels_info"])
        self.model.set_state_dict(paddle.load(str(run / "train" / "model.pdparams")))
        self.model.eval()
        self.input_shape = [-1, *info["input_shape"][1:]]
        self._paddle = paddle

    def _run(self, x: np.ndarray) -> np.ndarray:
        with self._paddle.no_grad():
            return self.model(self._paddle.to_tensor(x)).numpy()


def _engines(run: Path, info: dict, threads: int) -> tuple[dict[str, Engine], dict]:
    from pipeline.engines import registry
    from pipeline.engines.paddle_infer import InferenceEngine

    exp, srv = run / "export", run / "server"
    serving = json.loads((srv / "serving.json").read_text()) if (srv / "serving.json").is_file() else {}
    tuning = serving.get("tuning", {})
    onnx = srv / "onnx" / "model.onnx"
    engines: dict[str, Engine] = {EAGER: EagerEngine(run, info),
                                  AS_BEFORE: InferenceEngine(exp / "inference", "fp32", threads=threads)}
    for kind in registry.KINDS:
        model = exp / "inference" if kind == "paddle-inference" else onnx
        if kind != "paddle-inference" and not onnx.is_file():
            print(f"  {kind}: no {onnx} (re-run `make deploy`), left out")
            continue
        settings = tuning.get(kind) or {"batch1": {"threads": 1}, "batchN": {"threads": threads}}
        engines[f"{kind} fp32 tuned"] = registry.make_routed(kind, model, "fp32", settings)  # as tuned and served
    int8 = {"paddle-inference": srv / "models" / "int8" / "model", "onnxruntime": srv / "onnx" / "model_int8.onnx",
            "openvino": srv / "openvino" / "model_int8.xml"}
    for kind, path in int8.items():
        exists = Path(str(path) + ".pdmodel") if kind == "paddle-inference" else path
        if exists.is_file():
            e = registry.make(kind, path, "int8", threads=1)
            engines[f"{kind} {e.effective_precision} (1 thread)"] = e
    return engines, serving


def bench_model(cfg, a, console) -> dict | None:
    from rich.table import Table

    from pipeline.engines import perf, registry

    run = cfg.run_dir
    exp = run / "export"
    if not (exp / "inference.pdmodel").is_file() or not (run / "train" / "model.pdparams").is_file():
        console.print(f"[yellow]{run.name}: no trained + exported model in {run}; run `make train export deploy "
                      f"CONFIG=...` first — skipped[/]")
        return None
    info = json.loads((exp / "info.json").read_text())
    with np.load(exp / "reference.npz") as z:
        x = z["inputs"]
    threads = cfg.server.threads or env.cpu_count()
    batch = a.batch or cfg.server.perf.batch_size
    engines, serving = _engines(run, info, threads)
    gc.collect()
    gc.freeze()          # as `serve` does once its model is loaded: the collector stops walking the runtimes' objects
    rows = registry.rank(engines, x, batch_size=batch, warmup=10, repeats=a.repeats, rounds=a.rounds)
    by = {r["engine"]: r for r in rows}
    macs = perf.program_macs(str(exp / "inference"))
    fp32 = [r for r in rows if "int8" not in r["engine"]]
    fastest = min(fp32, key=lambda r: r["latency_ms"]["p50"])
    best = max(fp32, key=lambda r: r["throughput_sps"])
    t = Table(title=f"{run.name}: {info['input_shape'][1:]} · {macs / 1e6:.2f} MMAC/sample · {threads} cores · "
                    f"interleaved, {a.rounds} rounds")
    for col in ("engine", "precision", "p50 ms", "p90 ms", "× fastest p50", f"samples/s @b{batch}", "× best",
                "GFLOP/s"):
        t.add_column(col, justify="left" if col in ("engine", "precision") else "right")
    for r in rows:
        e = engines[r["engine"]]
        t.add_row(r["engine"], e.effective_precision, f"{r['latency_ms']['p50']:.3f}", f"{r['latency_ms']['p90']:.3f}",
                  f"{r['latency_ms']['p50'] / fastest['latency_ms']['p50']:.2f}×", f"{r['throughput_sps']:,.0f}",
                  f"{r['throughput_sps'] / best['throughput_sps']:.2f}×", f"{2 * macs * r['throughput_sps'] / 1e9:.1f}")
    console.print(t)
    rec = serving.get("engine")
    p50 = {k: v["latency_ms"]["p50"] for k, v in by.items()}
    pi, ortk = p50.get("paddle-inference fp32 tuned"), p50.get("onnxruntime fp32 tuned")
    checks = []
    if rec and f"{rec} fp32 tuned" in p50:
        checks.append((f"recommended engine ({rec}) batch-1 p50 vs fastest fp32 ({fastest['engine']})",
                       p50[f"{rec} fp32 tuned"] / fastest["latency_ms"]["p50"], 1.1))
    if pi:
        checks.append(("paddle-inference tuned batch-1 p50 vs eager dygraph", pi / p50[EAGER], 1.0))
        checks.append(("paddle-inference tuned batch-1 p50 vs as configured before", pi / p50[AS_BEFORE], None))
        if ortk:
            checks.append(("paddle-inference tuned batch-1 p50 vs onnxruntime", pi / ortk, 3.0))
    for what, ratio, limit in checks:
        verdict = "" if limit is None else ("[green]met[/]" if ratio <= limit else "[red]NOT met[/]")
        console.print(f"  {what}: {ratio:.2f}×" + (f" (goal ≤ {limit}×) {verdict}" if limit else ""))
    _print_int8_speed(run, console)
    return {"run": run, "rows": rows, "recommended": rec, "p50": p50, "engines": engines}


def _print_int8_speed(run: Path, console) -> None:
    """Each int8 row's speed against its own fp32 engine, as the server stage measured it (interleaved, same
    threads; gate.extra["speed_vs_fp32"], what the recommendation reads): below 1x int8 buys nothing."""
    manifest = run / "server" / "manifest.json"
    gates = json.loads(manifest.read_text()).get("gates", []) if manifest.is_file() else []
    for g in gates:
        sp = (g.get("extra") or {}).get("speed_vs_fp32")
        if sp:
            slow = [f"batch {n}" for k, n in (("batch1", 1), ("batchN", sp["batch"])) if sp[k] <= 1.0]
            console.print(f"  {g['subject']} vs its fp32 (fp32 time / int8 time, server stage): batch 1 "
                          f"{sp['batch1']:.2f}×, batch {sp['batch']} {sp['batchN']:.2f}×"
                          + (f" [yellow]int8 not faster at {' and '.join(slow)}[/]" if slow else ""))


def bench_http(cfg, a, console, res: dict) -> None:
    """serve (the bundle's recommended engine) vs a bare FastAPI endpoint, bounded, loopback only. The
    issue's HTTP goals are on the default model; the OCR model's lines are for reference."""
    import http_load
    from rich.table import Table

    root = Path(cfg.bundle.root) if Path(cfg.bundle.root).is_absolute() else Path(pipeline.__file__).parent.parent / cfg.bundle.root
    bundles = sorted((p for p in root.glob(f"{cfg.run.name}-*") if (p / bundle_layout.MANIFEST).is_file()),
                     key=lambda p: p.stat().st_mtime)
    if not bundles:
        console.print(f"[yellow]no bundle {root}/{cfg.run.name}-*: run `make deploy` first — HTTP bench skipped[/]")
        return
    bundle = bundles[-1]
    with np.load(bundle / bundle_layout.SAMPLES_EXPECTED) as z:
        files = list(z["files"])
    bodies = [(bundle / f).read_bytes() for f in files]
    ps, pb = http_load.free_port(), http_load.free_port()
    with http_load.Server(http_load.serve_cmd(bundle, ps), ps, "/v2/health/ready") as srv, \
            http_load.Server(http_load.bare_cmd(pb), pb, "/health") as bare:
        served = json.loads(_get(f"{srv.url}/v2/models/{bundle.name}"))["platform"]
        urls = {"serve /predict": srv.url + "/predict", "bare FastAPI": bare.url + "/predict"}
        pids = {"serve /predict": srv.proc.pid, "bare FastAPI": bare.proc.pid}
        seq = http_load.compare(urls, bodies, n=a.seq_requests, concurrency=1, seconds=a.load_seconds,
                                rounds=a.rounds, pids=pids)
        conc = http_load.compare(urls, bodies, n=a.load_requests, concurrency=a.concurrency,
                                 seconds=a.load_seconds, rounds=a.rounds, pids=pids)
    t = Table(title=f"HTTP on 127.0.0.1: {bundle.name} served by {served}; bounded: ≤ {a.load_requests} requests, "
                    f"≤ {a.load_seconds:g} s per server and concurrency; client: http.client at concurrency 1, "
                    "aiohttp above")
    for col in ("server", "concurrency", "requests", "errors", "req/s", "client p50 ms", "client p90 ms",
                "server-side p50 ms", "server CPU ms/request"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for conc_n, table in ((1, seq), (a.concurrency, conc)):
        for name, r in table.items():
            srv_p50 = "" if r["server_p50_ms"] is None else f"{r['server_p50_ms']:.3f}"
            cpu = "" if r["server_cpu_ms"] is None else f"{r['server_cpu_ms']:.3f}"
            t.add_row(name, str(conc_n), str(r["requests"]), str(r["errors"]), f"{r['rps']:,.0f}",
                      f"{r['client_p50_ms']:.3f}", f"{r['client_p90_ms']:.3f}", srv_p50, cpu)
    console.print(t)
    _http_verdicts(console, a, served, res["p50"].get(f"{served} fp32 tuned"), seq, conc)


def _http_verdicts(console, a, served: str, eng: float | None, seq: dict, conc: dict) -> None:
    """The done-when ratios, and where a request's time goes, so a reader sees what is reachable."""
    s1, b1 = seq["serve /predict"], seq["bare FastAPI"]
    if eng:
        rows = [(f"{served} batch-1, in-process loop (engine table above)", eng, ""),
                ("engine inside serve's request (inference_ms in the response)", s1["inference_p50_ms"],
                 "validation + a cache-cold call"),
                ("serve server-side: ASGI in → response start (X-Latency-ms)", s1["server_p50_ms"],
                 "read body, PNG decode, preprocess, engine, decode, JSON, limits, log"),
                ("bare endpoint over HTTP: the floor (uvicorn + loopback + client)", b1["client_p50_ms"],
                 "reads the body, returns a constant"),
                ("serve /predict over HTTP", s1["client_p50_ms"], "")]
        console.print("  where a /predict request's time goes (p50 ms, concurrency 1, this run):")
        for what, ms, why in rows:
            console.print(f"    {what:<66} {'' if ms is None else f'{ms:8.3f}'}  {why}")
        ratio, floor = s1["client_p50_ms"] / eng, b1["client_p50_ms"] / eng
        console.print(f"  HTTP /predict p50 (client, concurrency 1) vs {served} batch-1 p50: {ratio:.1f}× (goal ≤ 3×) "
                      + ("[green]met[/]" if ratio <= 3 else "[red]NOT met[/]"))
        console.print(f"    the bare endpoint alone is {floor:.1f}× the engine"
                      + (f": ≤ 3× is out of reach over loopback HTTP for a {eng:.3f} ms engine on this machine"
                         if floor > 3 else "")
                      + f"; serve adds {s1['client_p50_ms'] - b1['client_p50_ms']:.3f} ms over the floor; "
                      f"with server-side = engine only, the best reachable is ≈ {(b1['client_p50_ms'] + eng) / eng:.1f}×")
    sN, bN = conc["serve /predict"], conc["bare FastAPI"]
    rr = sN["rps"] / max(bN["rps"], 1e-9)
    console.print(f"  serve vs bare FastAPI req/s at concurrency {a.concurrency}: {rr:.2f}× (goal ≥ 0.5×) "
                  + ("[green]met[/]" if rr >= 0.5 else "[red]NOT met[/]")
                  + "; serve does the job per request (decode, preprocess, model, JSON), the bare endpoint "
                    "returns a constant")
    if sN["server_cpu_ms"] and bN["server_cpu_ms"]:
        console.print(f"    server CPU per request: serve {sN['server_cpu_ms']:.3f} ms, bare {bN['server_cpu_ms']:.3f} ms "
                      f"({bN['server_cpu_ms'] / sN['server_cpu_ms']:.2f}×: the req/s ratio where the server's one event "
                      "loop is the bottleneck; here the load client shares the cores, which narrows the gap)")


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-c", "--config", action="append", default=["configs/chars.yaml"])
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("-O", "--overrides", default="", help="several overrides in one shell-quoted string (make O=...)")
    ap.add_argument("--ocr-config", default="configs/ocr_rec.yaml", help="second model ('' to skip)")
    ap.add_argument("--batch", type=int, default=64, help="throughput batch (0 = server.perf.batch_size)")
    ap.add_argument("--repeats", type=int, default=300, help="timed batch-1 calls per engine")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--seq-requests", type=int, default=300, help="sequential HTTP requests per server")
    ap.add_argument("--load-requests", type=int, default=3000, help="requests per server at --concurrency")
    ap.add_argument("--load-seconds", type=float, default=20, help="time bound per server and load level")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--no-http", action="store_true")
    a = ap.parse_args()
    a.override = split_overrides(a.overrides) + a.override      # as the CLI reads O: quotes, {k: v} values
    env.import_paddle_quietly()
    from rich.console import Console

    console = Console(width=160)
    cfg = load_config(a.config[-1:], a.override)
    console.print(f"bench-deploy on {env.cpu_count()} cores, CPU tuning {env.APPLIED_TUNING or 'none'}; "
                  "the machine may be shared: compare ratios measured in this run")
    for c in [cfg] + ([load_config([a.ocr_config], a.override)] if a.ocr_config else []):
        res = bench_model(c, a, console)
        if res and not a.no_http:
            bench_http(c, a, console, res)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        sys.exit(exc.exit_code)
