"""`pipeline batch` on a small local Ray (2 CPUs): every input exactly once with a worker killed mid-run, rows equal to
the single-process reader's, a re-run writes nothing, a lost part is read again, bad inputs are error rows.

The smoke bundle comes from the shared smoke chain (tests/conftest.py). One Ray session for the module.
"""
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bad_inputs_cases import png_header

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "tests" / "data" / "real_images"


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """A folder of good images (the real pages and synthetic ones, in sub-folders) and of bad ones, by kind."""
    root = tmp_path_factory.mktemp("batch-in")
    rng = np.random.default_rng(0)
    (root / "real").mkdir()
    for p in REAL.iterdir():
        if p.suffix.lower() in (".png", ".jpg"):
            shutil.copy(p, root / "real" / p.name)
    (root / "synthetic" / "deep").mkdir(parents=True)
    for i in range(24):
        (root / "synthetic" / ("deep" if i % 2 else "") / f"{i:03d}.png").write_bytes(
            _png(rng.integers(0, 255, (40 + i, 32 + 2 * i), dtype=np.uint8)))
    sixteen = Image.fromarray((rng.integers(0, 65535, (48, 48))).astype(np.uint16))
    buf = io.BytesIO()
    sixteen.save(buf, format="PNG")
    noisy = _png(rng.integers(0, 255, (64, 64), dtype=np.uint8))
    bad = {"corrupt": noisy[:len(noisy) // 2],                            # truncated inside its image data
           "not_an_image": b"%PDF-1.4 this is not a picture\n",
           "huge": png_header(20000, 20000),                             # 400 megapixels announced in the header
           "sixteen_bit": buf.getvalue()}
    (root / "bad").mkdir()
    for name, data in bad.items():
        (root / "bad" / f"{name}.png").write_bytes(data)
    (root / "notes.txt").write_text("not listed: a folder input takes image files only")
    files = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.suffix != ".txt")
    return {"root": root, "files": files, "bad": {k: str(root / "bad" / f"{k}.png") for k in bad}}


@pytest.fixture(scope="module")
def local_ray():
    from pipeline.scale.batch import BatchOptions, start_ray

    start_ray(BatchOptions(object_store_mb=128))
    yield
    ray.shutdown()


def _opts(**kw):
    from pipeline.scale.batch import BatchOptions

    return BatchOptions(**{"workers": 2, "batch_size": 2, "commit_rows": 4, "progress": False, **kw})


def _rows(output: Path) -> list[dict]:
    from pipeline.scale.store import OutputStore

    return OutputStore(output, "jsonl" if any(output.glob("*.jsonl")) else "parquet").rows()


def _kill_one_worker(state: dict, total: int):
    """on_commit: after the first part, kill -9 the Ray worker that read its first row (mid-run: rows remain)."""
    def on_commit(written, rows):
        if state.get("killed"):
            return
        pid = int(rows[0]["worker"].rsplit(":", 1)[1])
        assert written < total, "the run finished before a worker could be killed"
        os.kill(pid, signal.SIGKILL)
        state.update(killed=pid, written_at_kill=written)
    return on_commit


def test_worker_killed_mid_run_every_input_once_and_equal_to_the_single_process_reader(smoke_bundle, inputs,
                                                                                        local_ray, tmp_path):
    from pipeline.scale.batch import run_batch
    from pipeline.scale.reader import BundleReader, read_all

    bundle, out, state = smoke_bundle[0], tmp_path / "out", {}
    total = len(inputs["files"])
    summary = run_batch(bundle, str(inputs["root"]), out, _opts(on_commit=_kill_one_worker(state, total)))
    assert state.get("killed") and state["written_at_kill"] < total
    rows = _rows(out)
    paths = [r["path"] for r in rows]
    assert sorted(paths) == inputs["files"] and len(set(paths)) == len(paths) == total      # every input exactly once
    assert summary["written"] == total and summary["skipped"] == 0
    workers = {r["worker"] for r in rows}
    assert len(workers) >= 2, workers

    reader = BundleReader(bundle, threads=1)
    try:
        single = {r["path"]: r for r in read_all(reader, inputs["files"])}
    finally:
        reader.close()
    for r in rows:                                 # what `serve` answers, bit for bit, whichever worker read it
        s = single[r["path"]]
        assert (r["sha256"], r["result"], r["prediction"], r["score"], r["error"]) == \
            (s["sha256"], s["result"], s["prediction"], s["score"], s["error"]), r["path"]
        assert r["rss_mb"] and r["ms"] >= 0 and json.loads(r["served"])["model"]

    by_path = {r["path"]: r for r in rows}
    errors = {k: by_path[p]["error"] for k, p in inputs["bad"].items()}
    assert "is not a readable PNG image (image file is truncated)" in errors["corrupt"], errors
    assert "not a readable image: not PNG, JPEG" in errors["not_an_image"], errors
    assert "400,000,000 pixels" in errors["huge"] and "serve.max_pixels" in errors["huge"], errors
    assert errors["sixteen_bit"] is None and by_path[inputs["bad"]["sixteen_bit"]]["prediction"]   # scaled, read
    for k in ("corrupt", "not_an_image", "huge"):
        assert "\n" not in errors[k] and by_path[inputs["bad"][k]]["result"] is None
    assert sum(r["error"] is not None for r in rows) == 3 == summary["errors"]

    # a second run over the same output: nothing to read, nothing written, no worker started
    parts = sorted(out.glob("part-*"))
    again = run_batch(bundle, str(inputs["root"]), out, _opts())
    assert (again["written"], again["skipped"], again["workers"]) == (0, total, 0)
    assert sorted(out.glob("part-*")) == parts
    assert [r["written"] for r in json.loads((out / "_batch.json").read_text())["runs"]] == [total, 0]


def test_a_lost_part_and_a_changed_file_are_read_again_once(smoke_bundle, inputs, local_ray, tmp_path):
    """JSONL output from a JSONL manifest (with a missing file and a folder: error rows); a part lost as if the run
    had stopped before committing it, and a file whose bytes changed, are read again, nothing else."""
    from pipeline.scale.batch import run_batch

    src = tmp_path / "in"
    shutil.copytree(inputs["root"] / "synthetic", src)
    listed = sorted(str(p) for p in src.rglob("*.png")) + [str(tmp_path / "missing/page.png"), str(tmp_path)]
    manifest = tmp_path / "list.jsonl"
    manifest.write_text("".join(json.dumps({"path": os.path.relpath(p, tmp_path)}) + "\n" for p in listed[:-1])
                        + json.dumps(listed[-1]) + "\n")
    out = tmp_path / "out"
    first = run_batch(smoke_bundle[0], str(manifest), out, _opts(workers=1, batch_size=4, commit_rows=4, fmt="jsonl"))
    rows = {r["path"]: r for r in _rows(out)}
    assert first["written"] == len(listed) == len(rows) and set(rows) == set(listed)
    assert rows[str(tmp_path / "missing/page.png")]["error"].endswith("missing/page.png does not exist")
    assert "cannot be read" in rows[str(tmp_path)]["error"] and first["errors"] == 2
    parts = sorted(out.glob("part-*.jsonl"))
    assert len(parts) >= 3
    lost = {json.loads(line)["path"] for line in parts[1].read_text().splitlines()}
    parts[1].unlink()
    changed = listed[0]
    Path(changed).write_bytes(_png(np.full((50, 50), 200, np.uint8)))
    s = run_batch(smoke_bundle[0], str(manifest), out, _opts(workers=1, batch_size=4, fmt="jsonl"))
    assert s["written"] == len(lost | {changed}) and s["skipped"] == len(listed) - s["written"]
    again = _rows(out)
    assert len([r for r in again if r["path"] == changed]) == (1 if changed in lost else 2)   # old content's row stays
    assert sorted({r["path"] for r in again}) == sorted(listed) and len(again) == len(listed) + (changed not in lost)


def test_user_mistakes_are_one_line_without_ray(smoke_bundle, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pipeline", "batch", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    for args, expect in [((smoke_bundle[0], tmp_path / "nowhere", tmp_path / "o"), "is not a folder, a glob"),
                         ((tmp_path / "no-bundle", REAL, tmp_path / "o"), "bundle not found"),
                         ((smoke_bundle[0], str(tmp_path / "*.png"), tmp_path / "o"), "matches no file"),
                         ((smoke_bundle[0], REAL, tmp_path / "o", "--threads", "0"), "--threads 0: must be at least 1")]:
        res = cli(*args)
        assert res.returncode != 0 and expect in res.stderr, (args, res.stderr[-800:])
        assert "Traceback" not in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "part-x-00001.jsonl").write_text("")
    res = cli(smoke_bundle[0], REAL, tmp_path / "o2")
    assert res.returncode == 2 and "another format than parquet" in res.stderr, res.stderr


def test_ray_workers_run_at_the_jobs_niceness(local_ray):
    """Ray's default puts its workers at nice +15: on a machine with other work the batch runner yielded to all of it
    (and bench-batch timed nice-15 workers against a nice-0 single reader). They run at the driver's niceness."""
    @ray.remote
    def niceness():
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)
