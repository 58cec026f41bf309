"""Run folders, atomic writes, hashes and per-stage manifests.

A stage writes into a temp folder next to its final place; only a finished stage is renamed in,
so a crash or Ctrl-C never leaves a half-written output (DVC / Lightning style).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from pipeline.core.errors import IntegrityError, MissingArtifact

MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(folder: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, dict]:
    """{relative path: {"sha256", "bytes"}} for every file under folder (sorted, stable)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in exclude:
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def umask() -> int:
    """The process umask, read without changing it (os.umask sets it: a race with other threads' files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def ordinary_mode(target: int | Path, folder: bool = False) -> None:
    """Give a file (fd or path) or folder made by tempfile.mkstemp/mkdtemp (always 0600/0700) the mode
    the umask gives ordinary ones, so a bundle is readable by whoever its owner lets read files."""
    mode = (0o777 if folder else 0o666) & ~umask()
    if isinstance(target, int):
        os.fchmod(target, mode)
    else:
        os.chmod(target, mode)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        ordinary_mode(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if hasattr(o, "item"):          # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


@contextmanager
def staged_dir(final: Path):
    """Yield a fresh temp folder beside `final`; on success swap it in atomically.

    The previous content of `final` survives any failure inside the block.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        ordinary_mode(tmp, folder=True)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


def replace_dir(src: Path, final: Path) -> None:
    """Move src to final; an existing final is moved aside first and deleted only afterwards."""
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{int(time.time() * 1e6)}"
        os.replace(final, old)
    os.replace(src, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_manifest(stage_dir: Path) -> dict | None:
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except (OSError, json.JSONDecodeError):
        return None


def verify_outputs(stage_dir: Path, manifest: dict) -> None:
    """Raise IntegrityError if any recorded output changed or vanished since the stage wrote it."""
    for rel, meta in manifest.get("outputs", {}).items():
        p = Path(stage_dir) / rel
        if not p.is_file():
            raise IntegrityError(f"{p} is missing (recorded in {stage_dir / MANIFEST})",
                                 hint="re-run the stage that makes it (FORCE=1)")
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            raise IntegrityError(f"{p} changed since it was written (sha256 mismatch)",
                                 hint="re-run the stage that makes it (FORCE=1)")


def require_file(path: Path, what: str, make_hint: str) -> Path:
    if not Path(path).is_file():
        raise MissingArtifact(f"missing {what}: {path}", hint=make_hint)
    return Path(path)


# folder (absolute, with a trailing separator) -> (who reads, whose folder, may this relative path be read?)
_READ_LIMITS: dict[str, tuple[str, str, Callable[[str], bool]]] = {}
_HOOKED = False


def _refuse_undeclared_read(event: str, args: tuple) -> None:
    """sys.addaudithook callback: an `open` under a limited folder of a path it does not allow raises (the stage's
    own code gets the error from its open call). Native runtimes reading model files are not seen: the declared
    outputs they load are checked where the stage names them (StageContext.input)."""
    if event != "open" or not _READ_LIMITS or isinstance(args[0], int):
        return
    try:
        path = os.path.abspath(os.fsdecode(args[0]))
    except (TypeError, ValueError):
        return
    for folder, (reader, producer, allowed) in list(_READ_LIMITS.items()):
        if path.startswith(folder):
            rel = path[len(folder):].replace(os.sep, "/")
            if not allowed(rel):
                raise MissingArtifact(f"the {reader} stage opened '{rel}' in the {producer} stage's output, which "
                                      f"the {producer} stage does not declare",
                                      hint=f"declare it in the {producer} STAGE's outputs / optional_outputs, or read "
                                           "a declared output (pipeline/core/catalogue.py)")


@contextmanager
def reads_limited(reader: str, folders: dict[str, tuple[Path, Callable[[str], bool]]]):
    """While the block runs (a stage), files under each producer's folder open only if allowed(rel) says so:
    {producer: (folder, allowed)}. One audit hook for the process (hooks cannot be removed), active only here."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_refuse_undeclared_read)
        _HOOKED = True
    added = {os.path.join(os.path.abspath(folder), ""): (reader, producer, allowed)
             for producer, (folder, allowed) in folders.items()}
    _READ_LIMITS.update(added)
    try:
        yield
    finally:
        for key in added:
            _READ_LIMITS.pop(key, None)
