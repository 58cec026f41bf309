"""`make bench-batch`: pages/s of `pipeline batch` at 1 worker and at every core's worker, against the single-process
reader, on the real images repeated to --pages pages, with memory per worker.

The three readers run the same BundleReader (pipeline/scale/reader.py: the bundle as `serve` loads it), each engine at
1 thread, so the batch runner's overhead and its scaling are what differ:
  single   the reader in this process, page after page (bundle loaded before the clock starts);
  batch 1  `pipeline batch` with one Ray worker; batch N with one worker per core.
A batch run's rate counts pages finished after every worker finished its first page (their `read_at`): Ray's start,
the workers' imports and bundle loading are reported apart (seconds to the first rows), as they are paid once per run,
not per page. --rounds R repeats the three in alternating order (each goes first as often) and takes each one's best.
Targets (issue 50), exit 1 when missed: batch N >= 1.6x batch 1 with N >= 2 cores; batch 1 >= 0.9x single.
Every page's result must equal the single-process reader's (exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.core.errors import PipelineError

IMAGES = ROOT / "tests" / "data" / "real_images"
TARGETS = {"all_vs_one": 1.6, "one_vs_single": 0.9}


def pages_folder(images: Path, n: int, dest: Path) -> list[str]:
    """The images copied round-robin into dest until it holds n pages (r000_<name>, r001_<name>, ...)."""
    src = sorted(p for p in images.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not src:
        raise PipelineError(f"no .png/.jpg images in {images}")
    out = []
    for i in range(n):
        p = src[i % len(src)]
        out.append(str(shutil.copy(p, dest / f"r{i // len(src):03d}_{p.name}")))
    return sorted(out)


def single(bundle: str, paths: list[str]) -> dict:
    from pipeline.scale.reader import BundleReader, read_all

    reader = BundleReader(bundle, threads=1)
    try:
        t0 = time.perf_counter()
        rows = read_all(reader, paths)
        dt = time.perf_counter() - t0
    finally:
        reader.close()
    from pipeline.core.resources import rss_mb

    return {"pages_per_s": len(rows) / dt, "rows": rows, "rss_mb": {"this process": rss_mb()}, "start_s": 0.0,
            "ms_per_page": _mean_ms(rows)}


def _mean_ms(rows: list[dict]) -> float:
    """Mean decode + inference time of a page inside its reader: when it grows with the workers, they wait for
    cores (other jobs on a shared machine), not for the batch runner."""
    return sum(r["ms"] for r in rows) / max(len(rows), 1)


def batch(bundle: str, folder: Path, workers: int, out: Path, batch_size: int) -> dict:
    from pipeline.scale.batch import BatchOptions, run_batch
    from pipeline.scale.store import OutputStore

    shutil.rmtree(out, ignore_errors=True)
    s = run_batch(bundle, str(folder), out, BatchOptions(workers=workers, threads=1, batch_size=batch_size,
                                                               progress=False))
    rows = OutputStore(out).rows()
    return {"pages_per_s": s["rows_per_s_all_workers_up"], "rows": rows,
            "rss_mb": s["peak_rss_mb_per_worker"], "start_s": s["seconds_to_first_rows"], "wall_s": s["seconds"],
            "ms_per_page": _mean_ms(rows)}


def same_results(ref: list[dict], got: list[dict]) -> list[str]:
    """Pages whose result differs from the single-process reader's (or that are missing / twice)."""
    want = {r["path"]: (r["result"], r["error"]) for r in ref}
    have = {}
    for r in got:
        have.setdefault(r["path"], []).append((r["result"], r["error"]))
    return [p for p in want if have.get(p) != [want[p]]] + [p for p in have if p not in want]


def run(args) -> dict:
    from pipeline.core.env import cpu_count
    from pipeline.scale.batch import start_ray, BatchOptions

    cores = cpu_count()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        folder = Path(tmp) / "pages"
        folder.mkdir()
        paths = pages_folder(Path(args.images), args.pages, folder)
        start_ray(BatchOptions())
        best: dict[str, dict] = {}
        order = ["single", "batch 1", f"batch {cores}"]
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                res = single(args.bundle, paths) if name == "single" else \
                    batch(args.bundle, folder, int(name.split()[1]), Path(tmp) / "out", args.batch_size)
                print(f"  round {r + 1} {name}: {res['pages_per_s']:.2f} pages/s", flush=True)
                if name not in best or (res["pages_per_s"] or 0) > (best[name]["pages_per_s"] or 0):
                    best[name] = res
        differ = {n: same_results(best["single"]["rows"], b["rows"]) for n, b in best.items() if n != "single"}
    one, alln, sp = (best[n]["pages_per_s"] or 0.0 for n in ("batch 1", f"batch {cores}", "single"))
    return {"pages": args.pages, "cores": cores, "bundle": args.bundle, "rounds": args.rounds, "batch_size": args.batch_size,
            "readers": {n: {k: v for k, v in b.items() if k != "rows"} for n, b in best.items()},
            "all_vs_one": alln / one if one else 0.0, "one_vs_single": one / sp if sp else 0.0,
            "differing_pages": differ}


def report(res: dict) -> bool:
    print(f"{res['pages']} pages ({res['bundle']}), {res['cores']} cores, engines at 1 thread, batches of "
          f"{res['batch_size']}, best of {res['rounds']}")
    print(f"{'reader':<10} {'pages/s':>9} {'ms/page':>8} {'start s':>8}  memory per worker (MB)")
    for name, r in res["readers"].items():
        mem = ", ".join(f"{v:.0f}" for v in r["rss_mb"].values())
        print(f"{name:<10} {r['pages_per_s'] or 0:>9.2f} {r['ms_per_page']:>8.2f} {r['start_s'] or 0:>8.1f}  {mem}")
    ok = True
    for key, label in (("all_vs_one", f"batch {res['cores']} / batch 1"), ("one_vs_single", "batch 1 / single")):
        need = TARGETS[key] if key == "one_vs_single" or res["cores"] >= 2 else 0.0
        met = res[key] >= need
        ok &= met
        print(f"{label}: {res[key]:.2f}x (target >= {need:g}) {'ok' if met else 'MISSED'}")
    for name, pages in res["differing_pages"].items():
        print(f"{name}: {len(pages)} pages differ from the single-process reader" + (f" (first: {pages[0]})" if pages
                                                                                      else ""))
        ok &= not pages
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="a bundle folder or .tar.gz")
    ap.add_argument("--images", default=str(IMAGES))
    ap.add_argument("--pages", type=int, default=240)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8, help="inputs per actor call (pipeline batch --batch-size)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    try:
        res = run(args)
    except PipelineError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    ok = report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
