"""One writer per run folder (pipeline/core/runlock.py), file-system errors as one line, ordinary file modes.

Real processes hold and lose the lock (kill -9). ENOSPC at a checkpoint is simulated by making os-level
writes fail (monkeypatch), the other read-only / full cases in the corpus use real tmpfs mounts.
"""
from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline.core import runlock
from pipeline.core.errors import RunLocked, StorageError

ROOT = Path(__file__).resolve().parent.parent


def _holder(run_dir: Path, then: str = "time.sleep(60)") -> subprocess.Popen:
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from pipeline.core import runlock; "
            f"runlock.acquire({str(run_dir)!r}); print('locked', flush=True); {then}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
    proc = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunLocked) as info:
            runlock.acquire(tmp_path / "run")
        assert f"pid {proc.pid}" in info.value.message and "since" in info.value.message
    finally:
        proc.kill(), proc.wait()


def test_kill_9_leaves_no_stuck_lock(tmp_path):
    proc = _holder(tmp_path / "run", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.wait() == -signal.SIGKILL
    fd = runlock.acquire(tmp_path / "run")                 # the flock died with its process
    runlock.release(fd, None)


def test_ranks_of_the_holding_run_are_not_blocked(tmp_path, monkeypatch):
    monkeypatch.delenv(runlock.ENV, raising=False)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pipeline.core import runlock; "
            f"print(runlock.acquire({str(tmp_path / 'run')!r}))")
    child = lambda **env: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         timeout=60, env={**os.environ, **env})
    fd = runlock.acquire(tmp_path / "run")
    try:
        out = child()                                # a rank: inherits PIPELINE_RUN_LOCKED from its parent
        assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
        out = child(**{runlock.ENV: "/elsewhere"})   # an unrelated process: refused
        assert out.returncode != 0 and "RunLocked" in out.stderr and f"pid {os.getpid()}" in out.stderr
    finally:
        runlock.release(fd, None)
    assert runlock.ENV not in os.environ
    assert child(**{runlock.ENV: "/elsewhere"}).returncode == 0          # released: free again


def test_storage_errors_are_one_line_naming_where_and_what():
    err = runlock.storage_error("bundle", OSError(errno.ENOSPC, "No space left on device", "/b/x.tar.gz"))
    assert err.one_line().startswith("bundle: cannot write /b/x.tar.gz: no space left") and "free some space" in err.hint
    assert "read-only" in runlock.storage_error("run", OSError(errno.EROFS, "Read-only", "/r")).message


def test_enospc_at_a_checkpoint_fails_the_stage_in_one_line_and_keeps_no_output(tmp_path, monkeypatch):
    """A full disk while training writes its checkpoint (simulated: the checkpoint's file writes fail)."""
    from pipeline.training import checkpoint
    from pipeline.core.config import load_config
    from pipeline.core.runner import Runner

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "runs/smoke/.work/train/ckpt"))
    for name in ("save", "save_checkpoint", "write_checkpoint"):
        if hasattr(checkpoint, name):
            monkeypatch.setattr(checkpoint, name, full)
    import paddle
    monkeypatch.setattr(paddle, "save", full)
    cfg = load_config(["configs/smoke.yaml"], [f"run.root={tmp_path / 'runs'}", "run.name=smoke", "train.epochs=1",
                                               "data.num_train=64", "data.num_val=32", "train.min_metric=0"])
    (outcome,) = Runner(cfg).run(["train"])
    assert outcome.status == "ERROR" and isinstance(outcome.error, StorageError), outcome
    assert outcome.error.message.startswith("train: cannot write") and "no space left" in outcome.error.message
    assert not (tmp_path / "runs/smoke/train").exists()
    assert not list((tmp_path / "runs/smoke").glob(".tmp-train-*"))


def test_files_and_folders_get_the_modes_the_umask_gives(tmp_path):
    from pipeline.core.artifacts import atomic_write_text, staged_dir
    from pipeline.bundle.format import write_archive

    old = os.umask(0o022)
    try:
        with staged_dir(tmp_path / "stage") as tmp:
            atomic_write_text(tmp / "manifest.json", "{}")
        write_archive(tmp_path / "stage", tmp_path / "b.tar.gz")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(tmp_path / "stage") == 0o755 and mode(tmp_path / "stage" / "manifest.json") == 0o644
    assert mode(tmp_path / "b.tar.gz") == 0o644
    with tarfile.open(tmp_path / "b.tar.gz") as tf:
        assert {m.name: m.mode for m in tf.getmembers()} == {"stage": 0o755, "stage/manifest.json": 0o644}
