"""Atomic training checkpoints for resume: model, optimizer, scheduler, scaler, best weights, epoch.

Layout: one folder per checkpoint, and a pointer file that names the current one.

    checkpoint/
      LATEST               "ckpt-0003-<id>"   (atomically replaced: the commit point)
      ckpt-0003-<id>/      model.pdparams optimizer.pdparams scheduler.pdparams [scaler.pdparams]
                           [best.pdparams] meta.json (key, epoch, history, sha256 of every part)

A checkpoint is written into a hidden temp folder (every file fsynced), renamed into place, and
only then does LATEST move to it. A kill at any moment leaves LATEST naming a complete checkpoint
(or none): never new weights next to an old optimizer or meta. Folders LATEST does not name are
leftovers of an interrupted save and are deleted by the next save.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from pathlib import Path

from pipeline.core import safe_pickle
from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text, sha256_file

log = logging.getLogger("pipeline")

POINTER = "LATEST"


class SameAs:
    """A part that is identical to another part of the same checkpoint (e.g. best = this epoch's model)."""

    def __init__(self, part: str):
        self.part = part


def to_bytes(obj) -> bytes:
    import paddle

    buf = io.BytesIO()
    paddle.save(obj, buf)
    return buf.getvalue()


def stable_state_bytes(state: dict) -> bytes:
    """paddle.save bytes of a model state dict that depend only on keys and values.

    paddle.save also pickles a table of each tensor's internal name (`eager_tmp_38`), a process-local
    counter: a resumed run would write a different file for identical weights. Each tensor is saved
    under its structured key instead (a detached alias: the caller's tensors keep their names)."""
    named = {}
    for key, value in state.items():
        if hasattr(value, "detach") and hasattr(value, "name"):
            value = value.detach()
            value.name = key
        named[key] = value
    return to_bytes(named)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(folder: Path, key: str, parts: dict, meta: dict) -> Path:
    """Write one complete checkpoint and make it current. parts: name → state dict | bytes | SameAs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(meta.get('epoch', 0)) + 1:04d}-{time.time_ns():x}"
    tmp = folder / f".tmp-{name}"
    tmp.mkdir()
    files, aliases = {}, {}
    try:
        for part, obj in parts.items():
            if isinstance(obj, SameAs):
                aliases[part] = obj.part
                continue
            fname = f"{part}.pdparams"
            atomic_write_bytes(tmp / fname, obj if isinstance(obj, bytes) else to_bytes(obj))
            files[part] = {"file": fname, "sha256": sha256_file(tmp / fname)}
        missing = [a for a, target in aliases.items() if target not in files]
        if missing:
            raise ValueError(f"checkpoint aliases point at parts that are not saved: {missing}")
        atomic_write_text(tmp / "meta.json", json.dumps({**meta, "key": key, "files": files, "aliases": aliases}))
        _fsync_dir(tmp)
        os.replace(tmp, folder / name)
        _fsync_dir(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(folder / POINTER, name + "\n")          # the commit point
    _fsync_dir(folder)
    _prune(folder, keep=name)
    return folder / name


def _prune(folder: Path, keep: str) -> None:
    """Remove every checkpoint folder (and stray file of the old single-folder format) but `keep`."""
    for p in folder.iterdir():
        if p.name in (keep, POINTER):
            continue
        if p.is_dir() and (p.name.startswith("ckpt-") or p.name.startswith(".tmp-ckpt-")):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and (p.suffix == ".pdparams" or p.name == "meta.json"):
            p.unlink(missing_ok=True)


def current(folder: Path) -> Path | None:
    """The folder LATEST names, if it exists."""
    pointer = Path(folder) / POINTER
    try:
        name = pointer.read_text().strip()
    except OSError:
        return None
    path = Path(folder) / name
    return path if name and path.is_dir() else None


def read_meta(folder: Path) -> dict | None:
    path = current(folder)
    if path is None:
        return None
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _tensors(obj, paddle):
    """numpy arrays back to Tensors, as paddle.load returns them (the optimizer's set_state_dict expects them)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return paddle.to_tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _tensors(v, paddle)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_tensors(v, paddle) for v in obj]
    return obj


def load(folder: Path, key: str) -> tuple[dict, dict] | None:
    """(states, meta) of the current checkpoint when it was made by this exact config and is intact.

    A checkpoint of another config is ignored; a damaged one (hash mismatch) is ignored with a warning
    (training then starts over rather than resuming from corrupt state).
    """
    import paddle

    path = current(folder)
    meta = read_meta(folder)
    if path is None or meta is None or meta.get("key") != key:
        return None
    states = {}
    for part, rec in meta.get("files", {}).items():
        f = path / rec["file"]
        if not f.is_file() or sha256_file(f) != rec["sha256"]:
            log.warning("[train] checkpoint %s is damaged (%s); starting over", path, rec["file"])
            return None
        states[part] = _tensors(safe_pickle.load_state(f, "checkpoint file"), paddle)   # data only, as paddle.load
    for part, target in meta.get("aliases", {}).items():
        states[part] = states[target]
    return states, meta
