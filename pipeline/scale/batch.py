"""`python -m pipeline batch BUNDLE INPUT OUTPUT`: a bundle over many images on Ray Data, resumable.

The driver lists the inputs, reads from OUTPUT which are done (path + content hash, pipeline/scale/store.py), and
hands the rest to a pool of Ray actors (Dataset.map_batches with a callable class): each actor opens, verifies and
loads the bundle once (pipeline/scale/reader.py: as `serve` loads it) and turns a batch of paths into rows. The driver
commits rows in part files as they arrive. A worker killed mid-run is restarted by Ray and its batch retried (Ray
Data's actor pool: max_restarts=-1, max_task_retries=-1), and the driver only ever receives a batch's rows once, so
the output holds every input exactly once; a stopped driver loses at most the rows not yet committed, which the
next run reads again. Local by default (ray.init with this machine's cores), or --address of an existing cluster,
whose nodes must hold the same project and .venv (docs/scale.md).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import ConfigError
from pipeline.scale.store import OutputStore, arrow_schema, list_inputs

log = logging.getLogger("pipeline.scale")
ROOT = Path(__file__).resolve().parents[2]
# a quiet Ray: no usage report (and, local, no dashboard: start_ray)
# RAY_worker_niceness: Ray starts its workers at nice +15, so on a machine with any other work they yielded to it
# (and `make bench-batch` compared nice-15 workers with a nice-0 single reader); 0: the workers run at the
# niceness the job was started at (`nice make batch ...` still makes the whole job polite)
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1", "RAY_worker_niceness": "0"}


@dataclass
class BatchOptions:
    workers: int = 0                 # actors (0: every CPU of the cluster / threads)
    threads: int = 1                 # engine threads per actor (Ray CPUs each actor holds)
    batch_size: int = 8              # inputs per actor call (and per Ray block)
    address: str | None = None       # an existing Ray cluster; None: a local one on this machine's cores
    key: str | Path | None = None    # public key the bundle must be signed with
    fmt: str = "parquet"
    max_pixels: int = 4096 * 4096
    archive_limits: tuple = ()
    commit_rows: int = 256           # rows per part file (a stopped driver re-reads at most this many)
    commit_seconds: float = 30.0     # ... or rows of at most this age
    object_store_mb: int = 512       # local Ray only: the shared-memory store (paths and rows are small)
    progress: bool | None = None     # Ray's bars (None: on a terminal); off a terminal one line per 10 %
    on_commit: object = None         # callable(rows committed so far, the part's rows): tests, progress


class _ReaderActor:
    """The map_batches callable class: one verified, loaded bundle per Ray worker process."""

    def __init__(self, bundle: str, key, threads: int, max_pixels: int, archive_limits: tuple):
        import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
        from pipeline.scale.reader import BundleReader

        self.reader = BundleReader(bundle, key=key, threads=threads, max_pixels=max_pixels,
                                   archive_limits=archive_limits)

    def __call__(self, batch):
        import pyarrow as pa

        rows = [self.reader.read(p, f) for p, f in zip(batch.column("path").to_pylist(), batch.column("file").to_pylist())]
        return pa.Table.from_pylist(rows, schema=arrow_schema())


def start_ray(opts: BatchOptions) -> None:
    """ray.init: the cluster at opts.address, or a local one on this machine's cores (project on the workers' path)."""
    import ray

    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return
    if opts.address:
        ray.init(address=opts.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        return
    from pipeline.core.env import cpu_count

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=cpu_count(), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             object_store_memory=opts.object_store_mb * 2 ** 20)


def _pool(opts: BatchOptions) -> int:
    """Actors to start: --workers, or as many as the cluster's CPUs hold at --threads each (refused beyond them)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    if opts.threads < 1:
        raise ConfigError(f"--threads {opts.threads}: an actor needs at least one thread")
    workers = opts.workers or max(1, cpus // opts.threads)
    if workers * opts.threads > cpus:
        raise ConfigError(f"--workers {workers} x --threads {opts.threads} = {workers * opts.threads} CPUs, the "
                          f"cluster has {cpus}", hint="lower --workers or --threads (they would wait for CPUs forever)")
    return workers


def _blocks(paths: list[str], size: int) -> list:
    """The pending inputs as Arrow tables of `size` rows: one Ray block (and one retry unit) each."""
    import pyarrow as pa

    files = [os.path.abspath(p) for p in paths]         # a worker's working folder is not the driver's
    schema = pa.schema([("path", pa.string()), ("file", pa.string())])
    return [pa.table({"path": paths[i:i + size], "file": files[i:i + size]}, schema=schema)
            for i in range(0, len(paths), size)]


def content_hash(path: str) -> str:
    """sha256 of a file's bytes; "" when it cannot be read (as the reader's row records it)."""
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def pending_inputs(paths: list[str], done: dict[str, str]) -> list[str]:
    """Inputs without a row in the output, then those whose bytes changed since theirs (hashed here, in threads:
    a re-run with nothing new starts no worker and loads no model)."""
    from concurrent.futures import ThreadPoolExecutor

    again = [p for p in paths if p in done]
    with ThreadPoolExecutor(max_workers=8) as pool:
        changed = [p for p, h in zip(again, pool.map(content_hash, again)) if h != done[p]]
    return [p for p in paths if p not in done] + changed


def run_batch(bundle: str | Path, inputs: str, output: str | Path, opts: BatchOptions) -> dict:
    """Read every input not yet in OUTPUT with the bundle; → the run's summary (also OUTPUT/_batch.json)."""
    from pipeline.scale.reader import open_checked
    from pipeline.core import tempdirs

    store = OutputStore(Path(output), opts.fmt)
    paths = list_inputs(inputs, exclude=Path(output))
    done = store.done()
    with tempdirs.directory("batch-check") as scratch:      # a bad bundle or key fails here, before Ray starts
        _, cfg, manifest, signature = open_checked(Path(bundle), Path(scratch), opts.key, opts.archive_limits)
    log.info("bundle %s (%s): %s", manifest.get("name"), cfg.get("task"), signature)
    t0 = time.perf_counter()
    pending = pending_inputs(paths, done)
    log.info("%d inputs: %d to read, %d with their row in %s already", len(paths), len(pending),
             len(paths) - len(pending), output)
    workers, stats = 0, {"written": 0, "errors": 0, "first_s": None, "last_s": None, "rows": []}
    if pending:
        start_ray(opts)
        workers = _pool(opts)
        log.info("%d workers x %d threads, batches of %d", workers, opts.threads, opts.batch_size)
        stats = _execute(str(Path(bundle).resolve()), _blocks(pending, opts.batch_size), store, opts, workers,
                         len(pending))
    summary = {"bundle": manifest.get("name"), "task": cfg.get("task"), "inputs": len(paths),
               "written": stats["written"], "skipped": len(paths) - len(pending), "errors": stats["errors"],
               "workers": workers, "threads": opts.threads, "batch_size": opts.batch_size,
               "seconds": round(time.perf_counter() - t0, 3), "seconds_to_first_rows": _round(stats["first_s"]),
               "rows_per_s_all_workers_up": all_up_rate(stats["rows"]), "format": opts.fmt, "signature": signature,
               "peak_rss_mb_per_worker": _peaks(stats["rows"])}
    store.write_summary(summary)
    return summary


def _round(x):
    return None if x is None else round(x, 3)


def _peaks(rows: list[dict]) -> dict[str, float]:
    """worker -> the largest resident memory it reported (MB)."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["worker"]] = max(out.get(r["worker"], 0.0), r["rss_mb"] or 0.0)
    return out


def all_up_rate(rows: list[dict]) -> float | None:
    """Inputs per second once every worker has finished its first input (by the rows' read_at): start-up, bundle
    loading and a late worker left out; None with fewer than 2 rows in that window."""
    firsts: dict[str, float] = {}
    for r in rows:
        firsts[r["worker"]] = min(firsts.get(r["worker"], r["read_at"]), r["read_at"])
    if not firsts:
        return None
    start = max(firsts.values())
    after = [r["read_at"] for r in rows if r["read_at"] > start]
    return round(len(after) / (max(after) - start), 3) if len(after) >= 2 and max(after) > start else None


def _execute(bundle: str, blocks: list, store: OutputStore, opts: BatchOptions, workers: int, total: int):
    """Run the actor pool over the blocks, committing rows as they arrive → {"written", "errors", "first_s" (seconds to
    the first rows: workers started, bundle loaded), "last_s" (to the last)}."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)      # its per-dataset INFO lines: Ray's own log files
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = sys.stderr.isatty() if opts.progress is None else opts.progress
    ds = ray.data.from_arrow(blocks).map_batches(
        _ReaderActor, batch_format="pyarrow", batch_size=opts.batch_size,
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=opts.threads,
        fn_constructor_kwargs={"bundle": bundle, "key": None if opts.key is None else str(opts.key),
                               "threads": opts.threads, "max_pixels": opts.max_pixels,
                               "archive_limits": tuple(opts.archive_limits)})
    held, stats, t0, last_commit = [], {"written": 0, "errors": 0, "first_s": None, "last_s": None, "rows": []}, \
        time.perf_counter(), time.perf_counter()
    step = next_line = max(1, total // 10)
    for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        rows = table.to_pylist()
        if rows and stats["first_s"] is None:
            stats["first_s"] = time.perf_counter() - t0
        held += rows
        stats["rows"] += [{"worker": r["worker"], "read_at": r["read_at"], "rss_mb": r["rss_mb"]} for r in rows]
        if held and (len(held) >= opts.commit_rows or time.perf_counter() - last_commit >= opts.commit_seconds):
            _commit(store, held, stats, opts)
            held, last_commit = [], time.perf_counter()
        got = stats["written"] + len(held)
        if not ctx.enable_progress_bars and got >= next_line:
            log.info("batch: %d of %d inputs read (%d%%)", got, total, 100 * got // max(total, 1))
            next_line = (got // step + 1) * step
    if held:
        _commit(store, held, stats, opts)
    stats["last_s"] = time.perf_counter() - t0
    return stats


def _commit(store: OutputStore, rows: list[dict], stats: dict, opts: BatchOptions) -> None:
    store.write(rows)
    stats["written"] += len(rows)
    stats["errors"] += sum(r.get("error") is not None for r in rows)
    if callable(opts.on_commit):
        opts.on_commit(stats["written"], rows)
