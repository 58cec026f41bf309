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
import math
import os
import re
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


MAX_META_BYTES = 16 << 20      # meta.json holds the epochs' history: a few KB per epoch
_PART_FILE = re.compile(r"[A-Za-z0-9_]+\.pdparams")


def read_meta(folder: Path) -> dict | None:
    """The current checkpoint's meta.json; None if there is none or it is not one we wrote (damaged, tampered:
    a warning line, and training starts over)."""
    path = current(folder)
    if path is None:
        return None
    try:
        f = path / "meta.json"
        if f.stat().st_size > MAX_META_BYTES:
            raise ValueError(f"{f.stat().st_size} bytes, over {MAX_META_BYTES}")
        meta = json.loads(f.read_bytes().decode("utf-8"))
        _check_meta(meta)
        return meta
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
        log.warning("[train] checkpoint %s/meta.json is damaged (%s); starting over", path,
                    str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__)
        return None


def _check_meta(meta) -> None:
    """What save() writes: raises ValueError naming the first key that is not."""
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    files, aliases = meta.get("files"), meta.get("aliases", {})
    if not isinstance(files, dict) or not isinstance(aliases, dict):
        raise ValueError("'files' or 'aliases' is not an object")
    for part, rec in files.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("file"), str) and _PART_FILE.fullmatch(rec["file"])
                and isinstance(rec.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", rec["sha256"])):
            raise ValueError(f"files.{str(part)[:40]} is not a part file name with its sha256")
    for part, target in aliases.items():
        if target not in files:
            raise ValueError(f"aliases.{str(part)[:40]} names no saved part")
    for k in ("epoch", "best_epoch"):
        if k in meta and (type(meta[k]) is not int or not 0 <= meta[k] < 1 << 31):
            raise ValueError(f"'{k}' is not an epoch number")
    if "history" in meta and not isinstance(meta["history"], list):
        raise ValueError("'history' is not a list")
    if "best" in meta and (type(meta["best"]) not in (int, float) or not math.isfinite(meta["best"])):
        raise ValueError("'best' is not a finite number")


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
