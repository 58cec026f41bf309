"""One writer per run folder.

`Runner.run` holds the run folder (fcntl.flock of the folder itself, exclusive, non-blocking; `<run>/.lock`
names the holder) for as long as it runs: a second
run into the same folder refuses at once with one line naming the holder (pid, host, command, since when)
instead of both printing OK and the last one silently replacing the other's outputs. Refusing, not
waiting: a nightly or a user that collides with another run has picked the wrong run.name, and waiting
would hide that (and could wait for hours).

flock belongs to the open file: a `kill -9` or a crash releases it with the process, so no stale lock
can block the next run (the holder text left in the file is just overwritten). The ranks of one
distributed training (pipeline/training/distributed.py) are children of the process holding the lock: it passes
the folder in PIPELINE_RUN_LOCKED and a Runner inside a rank does not lock it again. In a multi-node
training only node 0 (the node whose rank 0 writes the outputs) locks.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from pipeline.core.errors import RunLocked, StorageError

LOCK_NAME = ".lock"
ENV = "PIPELINE_RUN_LOCKED"


def _first_copy_error(exc: shutil.Error) -> OSError:
    """shutil.copytree gathers every failed file in one shutil.Error: the first one, as an OSError."""
    src, dst, reason = exc.args[0][0]
    code = re.search(r"\[Errno (\d+)\]", str(reason))
    return OSError(int(code.group(1)) if code else None, str(reason).split("] ")[-1].split(":")[0], dst)


def storage_error(where: str, exc: OSError, path=None, folder=None, hint: str | None = None) -> StorageError:
    """An OSError as one line: what failed, the path, why, and what to do. `folder`: where the failed write
    went when the error names no file (a write() on a full disk carries no file name)."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        exc = _first_copy_error(exc)
    path = path or exc.filename or (f"into {folder}" if folder else "(the file system gave no path)")
    why = {errno.EROFS: "the file system is read-only", errno.ENOSPC: "no space left on the device",
           errno.EDQUOT: "the disk quota is exceeded", errno.EACCES: "permission denied",
           errno.EPERM: "operation not permitted"}.get(exc.errno, exc.strerror or str(exc))
    hint = "free some space and re-run (finished stages are kept)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) \
        else hint or "point run.root / bundle.root at a writable folder, or fix its permissions"
    return StorageError(f"{where}: cannot write {path}: {why}", hint=hint)


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return (f"pid {info['pid']} on {info['host']} ({info['command']}), since {info['since']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _lock_fd(run_dir: Path, path: Path) -> int:
    """An fd of the run folder itself, flocked: deleting the .lock file cannot free it (a lock on the file
    alone could be stolen by `rm .lock`: the next run locks a new file). Where folders cannot be flocked
    (some network file systems), the .lock file's own flock."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError:
            os.close(fd)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)     # the umask decides, as for any file
    except BlockingIOError:
        raise
    except OSError as exc:
        raise storage_error("run", exc, exc.filename or path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd


def acquire(run_dir: Path):
    """The open, locked run folder (close it to release); None when the ranks' parent holds it.
    Raises RunLocked naming the holder, or StorageError when the folder cannot be written."""
    run_dir = Path(run_dir)
    if os.environ.get(ENV) == str(run_dir.resolve()):
        return None
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise storage_error("run", exc, exc.filename or run_dir) from None
    try:
        fd = _lock_fd(run_dir, path)
    except BlockingIOError:
        raise RunLocked(f"run folder {run_dir} is in use by {_holder(path)}",
                        hint="wait for it to finish, or give this run another run.name") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:                                               # who holds it, for the next one's message
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(info) + "\n")
    except OSError as exc:
        os.close(fd)
        raise storage_error("run", exc, path) from None
    os.environ[ENV] = str(run_dir.resolve())          # inherited by the ranks this process launches
    return fd


def release(fd, previous: str | None) -> None:
    if fd is not None:
        os.close(fd)                                   # closing the file releases the flock
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous


def _writes_outputs(layout) -> bool:
    """Only node 0 of a multi-node training writes the outputs (the nodes may share one folder)."""
    return layout is None or getattr(layout, "nnodes", 1) <= 1 or not getattr(layout, "node_rank", 0)


def exclusive(method):
    """Decorator for Runner.run: hold the run folder's lock around it; file-system errors of the run
    itself (config.resolved.yaml) become one StorageError line."""
    @functools.wraps(method)
    def wrapper(self, names, *args, **kw):
        self.resolve(names)          # a refused stage list is answered before any folder (or lock) exists
        previous = os.environ.get(ENV)
        fd = acquire(self.run_dir) if _writes_outputs(self.layout) else None
        try:
            return method(self, names, *args, **kw)
        except OSError as exc:
            raise storage_error("run", exc, folder=self.run_dir) from None
        finally:
            release(fd, previous)
    return wrapper
