"""Subcommands beyond `run`: each registers a parser and sets `func(args) -> exit code`.

Errors are raised as PipelineError; cli.main turns them into one-line messages and exit codes.
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path


def register(sub, config_args, output_args) -> None:
    _register_bundle_tools(sub, config_args)
    _register_scale_tools(sub, config_args)
    _register_nightly_tools(sub, config_args, output_args)


def _register_bundle_tools(sub, config_args) -> None:
    """verify, sign, serve: one bundle on this machine."""
    v = sub.add_parser("verify", help="check a bundle (folder or .tar.gz): signature, hashes, then sample outputs")
    v.add_argument("bundle", type=Path)
    v.add_argument("--key", type=Path, help="public key (PEM) the bundle must be signed with (default: verify.trust_key)")
    v.add_argument("--timeout", type=float, default=120)
    config_args(v)
    v.set_defaults(func=_verify)

    g = sub.add_parser("sign", help="sign a bundle (folder or .tar.gz) with an EC private key (OpenSSF model signing)")
    g.add_argument("bundle", type=Path)
    g.add_argument("--key", type=Path, required=True, help="EC private key in PEM (password: $PIPELINE_SIGN_KEY_PASSWORD)")
    g.set_defaults(func=_sign)

    s = sub.add_parser("serve", help="HTTP inference service for a bundle (POST /predict, GET /health)")
    s.add_argument("bundle", type=Path)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    s.add_argument("--port", type=int, default=8000, help="1-65535 (default 8000)")
    s.add_argument("--threads", type=int, default=0,
                   help="CPU threads per engine instance; 0 = the counts measured per batch profile")
    s.add_argument("--engine", choices=("paddle-inference", "onnxruntime", "openvino"),
                   help="override the bundle's recommended engine")
    s.add_argument("--precision", choices=("fp32", "bf16", "int8", "fp16"),
                   help="override the recommended precision (default: the recommended one for the recommended "
                        "engine, fp32 for another --engine)")
    s.add_argument("--key", type=Path, help="public key (PEM) the bundle must be signed with (default: verify.trust_key)")
    config_args(s)
    s.set_defaults(func=_serve)


def _register_scale_tools(sub, config_args) -> None:
    """batch (Ray Data) and kserve: a bundle beyond one process."""
    b = sub.add_parser("batch", help="read a folder, glob or manifest of images with a bundle on Ray Data (resumable)")
    b.add_argument("bundle", type=Path)
    b.add_argument("input", help="a folder (recursive), a quoted glob, or a .jsonl/.parquet manifest with a path column")
    b.add_argument("output", type=Path, help="output folder of part files; a re-run skips the inputs already in it")
    b.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    b.add_argument("--workers", type=int, default=0, help="Ray actors (default: the cluster's CPUs / --threads)")
    b.add_argument("--threads", type=int, default=1, help="engine threads (and Ray CPUs) per actor (default 1)")
    b.add_argument("--batch-size", type=int, default=8, help="inputs per actor call (default 8)")
    b.add_argument("--address", default=None, help="an existing Ray cluster (default: a local one on this machine)")
    b.add_argument("--key", type=Path, help="public key (PEM) the bundle must be signed with (default: verify.trust_key)")
    config_args(b)
    b.set_defaults(func=_batch)

    k = sub.add_parser("kserve", help="write a KServe ServingRuntime, InferenceService and container recipe for a bundle")
    k.add_argument("bundle", type=Path)
    k.add_argument("--out", type=Path, default=None, help="output folder (default: kserve/<bundle name>)")
    k.add_argument("--image", default=None, help="the server image (default: pipeline-serve:<project version>)")
    k.add_argument("--storage-uri", default=None, help="where the cluster reads the bundle (default: pvc://bundles/<name>)")
    k.add_argument("--namespace", default=None)
    config_args(k)
    k.set_defaults(func=_kserve)


def _register_nightly_tools(sub, config_args, output_args) -> None:
    """nightly, compare, accept, history, gates: runs against their baseline and limits."""
    n = sub.add_parser("nightly", help="run every stage into a fresh run folder, then compare with the baseline")
    n.add_argument("--baseline", help="run folder to compare with (default: regression.baseline, then accepted)")
    output_args(n)
    config_args(n)
    n.set_defaults(func=_nightly)

    c = sub.add_parser("compare", help="compare an existing run folder with the baseline (junit, report, history)")
    c.add_argument("run_dir", type=Path)
    c.add_argument("--baseline", help="run folder to compare with (default: regression.baseline, then accepted)")
    config_args(c)
    c.set_defaults(func=_compare)

    a = sub.add_parser("accept", help="promote a run folder (default: the newest nightly) to regression baseline")
    a.add_argument("run_dir", type=Path, nargs="?")
    config_args(a)
    a.set_defaults(func=_accept)

    h = sub.add_parser("history", help="print the trend over recorded runs")
    h.add_argument("--limit", type=int, default=20)
    config_args(h)
    h.set_defaults(func=_history)

    st = sub.add_parser("status", help="which stages the next `run` would re-run, and why (config keys, code "
                                       "files, inputs, CPU kernels)")
    st.add_argument("stages", nargs="*", default=["all"])
    st.add_argument("--exit-code", action="store_true", help="exit 1 when any stage would run (for scripts)")
    config_args(st)
    st.set_defaults(func=_status)
    t = sub.add_parser("gates", help="print every gate's limits from the config (the table docs/ hold, markdown)")
    config_args(t)
    t.set_defaults(func=_gates)


def _trust(args, cfg):
    """--key, else verify.trust_key, else None (the signature is then reported as not checked)."""
    return args.key or cfg.verify.trust_key


def _verify(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.core.env import import_paddle_quietly
    from pipeline.bundle.verify import verify_or_raise

    cfg = _load(args)
    import_paddle_quietly()         # paddle's import-time banner would bury the one-line error
    report = verify_or_raise(args.bundle, timeout=args.timeout, key=_trust(args, cfg),
                             max_bytes=cfg.verify.max_archive_bytes, max_members=cfg.verify.max_members)
    for c in report["checks"]:
        print(f"  ok  {c['name']}" + (f" = {c['observed']:.3g} (limit {c['limit']:g})" if c["limit"] else ""))
    for rel, why in report.get("unverified", {}).items():
        print(f"  not executed  {rel}: {why}")
    n_unverified = len(report.get("unverified", {}))
    print(f"verified: {args.bundle} ({report['files']} files"
          + (f", {n_unverified} converted but not executed" if n_unverified else "") + f"); {report['signature']}")
    return 0


def _sign(args) -> int:
    """Sign a bundle folder or archive; a file system that refuses the write (read-only, full) is one line."""
    from pipeline.core.runlock import storage_error

    try:
        return _sign_files(args)
    except OSError as exc:
        raise storage_error("sign", exc, folder=args.bundle.parent,
                            hint="copy the bundle to writable storage and sign the copy") from None


def _sign_files(args) -> int:
    import tempfile

    from pipeline.bundle.format import open_bundle, verify_hashes, write_archive
    from pipeline.bundle.signing import sign

    path = args.bundle
    if path.is_dir():
        verify_hashes(path)               # sign only what is intact: a signature vouches for these bytes
        sig = sign(path, args.key)
        archive = path.parent / f"{path.name}.tar.gz"
        if archive.is_file():             # keep the published pair consistent
            write_archive(path, archive)
        print(f"signed: {sig}" + (f" (and rewrote {archive})" if archive.is_file() else ""))
        return 0
    with tempfile.TemporaryDirectory(prefix="bundle-sign-", dir=path.parent if path.parent.is_dir() else None) as tmp:
        folder = open_bundle(path, Path(tmp))
        verify_hashes(folder)
        sign(folder, args.key)
        write_archive(folder, path)       # atomic: the unsigned archive stays until the signed one is complete
    print(f"signed: {path} (model.sig inside)")
    return 0


def _serve(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.core.env import import_paddle_quietly
    from pipeline.serving.limits import HttpLimits
    from pipeline.serving.http_common import bind
    from pipeline.serving.app import serve

    cfg = _load(args)
    sock = bind(args.host, args.port)        # a bad or busy port: one line now, not after loading the model
    import_paddle_quietly()
    sv = cfg.serve
    serve(args.bundle, sock=sock, threads=args.threads, key=_trust(args, cfg), limits=HttpLimits.from_config(sv),
          max_body=sv.max_body_bytes, max_pixels=sv.max_pixels, max_concurrency=sv.max_concurrency,
          log_requests=sv.access_log, batching=sv.batching.model_dump(), request_timeout_s=sv.request_timeout_s,
          max_boxes=sv.max_boxes_per_page, ocr_lanes=sv.ocr_lanes,
          archive_limits=(cfg.verify.max_archive_bytes, cfg.verify.max_members), engine=args.engine,
          precision=args.precision)
    return 0


def _batch(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.scale.batch import BatchOptions, run_batch

    cfg = _load(args)          # the driver never loads a model: paddle is imported in the Ray workers only
    for flag, value, least in (("--workers", args.workers, 0), ("--threads", args.threads, 1),
                               ("--batch-size", args.batch_size, 1)):
        if value < least:
            from pipeline.core.errors import ConfigError
            raise ConfigError(f"{flag} {value}: must be at least {least}")
    opts = BatchOptions(workers=args.workers, threads=args.threads, batch_size=args.batch_size, address=args.address,
                        key=_trust(args, cfg), fmt=args.format, max_pixels=cfg.serve.max_pixels,
                        archive_limits=(cfg.verify.max_archive_bytes, cfg.verify.max_members))
    s = run_batch(args.bundle, args.input, args.output, opts)
    print(f"batch: {s['inputs']} inputs, {s['written']} rows written ({s['errors']} error rows), {s['skipped']} already "
          f"in {args.output}; {s['workers']} workers x {s['threads']} threads, {s['seconds']:.1f} s")
    if s["errors"]:
        print(f"  error rows: the `error` column of {args.output} says why each input could not be read")
    return 0


def _kserve(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.core.env import import_paddle_quietly
    from pipeline.scale.kserve_deploy import write_manifests

    cfg = _load(args)
    import_paddle_quietly()
    files = write_manifests(args.bundle, args.out, image=args.image, storage_uri=args.storage_uri,
                            namespace=args.namespace, max_pixels=cfg.serve.max_pixels,
                            archive_limits=(cfg.verify.max_archive_bytes, cfg.verify.max_members))
    for f in files:
        print(f"wrote {f}")
    return 0


def _stage_order(cfg) -> list[str]:
    """The chain of this config's task (the catalogue decides; the OCR system stage is not in a model's chain)."""
    from pipeline.core.catalogue import for_task
    return for_task(cfg.task)


def _finish(cfg, run_dir: Path, baseline: str | None, stage_errors: dict[str, str]) -> int:
    """Compare + junit + report + history; the regression list goes to stderr as one block."""
    from pipeline.core.errors import RegressionFound
    from pipeline.nightly.regression import check_run, regression_block

    from pipeline.core.console import native_output_to

    with native_output_to(run_dir / "log" / "native.log", "nightly comparison"):   # the A/B rebuilds engines
        res = check_run(cfg, run_dir, _stage_order(cfg), baseline=baseline, stage_errors=stage_errors)
    comps = res["comparisons"]
    unmeasured = [c for c in comps if not c.measured]
    ok = sum(c.passed and c.measured for c in comps)
    print(f"baseline: {res['baseline_label']} · {ok} comparisons OK, {len(res['regressions'])} regressed, "
          f"{len(unmeasured)} not measured")
    for c in unmeasured:
        print(f"  not measured: {c.message}")
    print(f"wrote {res['junit']} and {res['report']}")
    if res["regressions"]:
        print(regression_block(res["baseline_label"], res["regressions"]), file=sys.stderr)
        first = res["regressions"][0]
        raise RegressionFound(f"{len(res['regressions'])} regression(s) vs {res['baseline']['name']}; first: "
                              f"{first.message}", hint=f"full list above and in {res['report']}")
    return 0


def _nightly(args) -> int:
    from pipeline.core.session import load as _load, run_stages
    from pipeline.core.env import import_paddle_quietly
    from pipeline.core.errors import ConfigError

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = _load(args).run.name           # the series (nightly, nightly_rec, ...): one baseline per series
    args.override = list(args.override) + [f"run.name={name}-{stamp}"]
    cfg = _load(args)
    if cfg.run_dir.exists():
        raise ConfigError(f"nightly needs a fresh run folder, {cfg.run_dir} exists",
                          hint="drop the run.name override (a timestamped name is chosen)")
    if cfg.task == "ocr_system":
        raise ConfigError("nightly runs one model's chain; task: ocr_system joins two runs",
                          hint="run the nightly on each part's config (its detection and recognition configs)")
    import_paddle_quietly()
    outcomes, code = run_stages(cfg, _stage_order(cfg), summary_json=args.summary_json)   # a fresh folder
    errors = {o.stage: o.error.one_line() for o in outcomes if o.error is not None}
    finished = _finish(cfg, cfg.run_dir, args.baseline, errors)   # junit/report/history even for a failed run
    return code or finished


def _compare(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.core.errors import MissingArtifact

    run_dir = args.run_dir.resolve()
    if not (run_dir / "config.resolved.yaml").is_file():
        raise MissingArtifact(f"{args.run_dir} is not a run folder (no config.resolved.yaml)",
                              hint="pass runs/<name>, e.g. the newest nightly-* folder")
    # the run's own resolved config (its thresholds), then any -c/-o given here
    args.config = [str(run_dir / "config.resolved.yaml")] + list(args.config)
    args.override = list(args.override) + [f"run.root={run_dir.parent}", f"run.name={run_dir.name}"]
    return _finish(_load(args), run_dir, args.baseline, {})


def _accept(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.core.errors import MissingArtifact
    from pipeline.nightly.history import History
    from pipeline.nightly.regression import accept, history_path, series

    cfg = _load(args)
    run_dir = args.run_dir
    if run_dir is None:
        nightly = [r for r in History(history_path(cfg)).runs(200)
                   if series(r["name"]) == cfg.run.name != r["name"] and Path(r["run_dir"]).is_dir()]
        if not nightly:
            raise MissingArtifact(f"no '{cfg.run.name}' nightly run recorded to accept",
                                  hint="run `make nightly` (same NIGHTLY_CONFIG) or pass RUN=runs/<name>")
        run_dir = Path(nightly[0]["run_dir"])
    marker = accept(cfg, run_dir, _stage_order(cfg))
    print(f"baseline is now {run_dir} (recorded in {marker})")
    return 0


def _history(args) -> int:
    from pipeline.core.session import load as _load
    from pipeline.nightly.history import History, print_trend
    from pipeline.nightly.regression import history_path

    print_trend(History(history_path(_load(args))), limit=args.limit)
    return 0


def _gates(args) -> int:
    from pipeline.core.gate_table import markdown
    from pipeline.core.session import load as _load

    print(markdown(_load(args)))
    return 0


def _status(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from pipeline.core.session import load
    from pipeline.core.status import UP_TO_DATE, states

    rows = states(load(args), args.stages)
    table = Table(title="what the next run does (python -m pipeline status)")
    for col in ("run", "stage", "state", "why"):
        table.add_column(col, overflow="fold")
    for r in rows:
        style = "green" if r.state == UP_TO_DATE else "yellow"
        table.add_row(r.run, r.stage, f"[{style}]{r.state}[/{style}]", escape(r.why))
    Console(width=160).print(table)
    return 1 if args.exit_code and any(r.state != UP_TO_DATE for r in rows) else 0
