"""Temp folders that do not outlive a kill -9.

atexit and `TemporaryDirectory` clean up only on a normal exit. Folders made here carry the owner's pid
in their name (`<kind>-<pid>-xxxx` in the system temp dir); every new one first removes the folders of
the same kind whose process is gone, so a killed run's leftovers disappear at the next run.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # someone else's live process
        return True
    return True


def reap_stale(kind: str, root: str | Path | None = None) -> list[Path]:
    """Remove `<kind>-<pid>-*` folders of this user whose process no longer exists; returns them."""
    root = Path(root or tempfile.gettempdir())
    gone = []
    for p in root.glob(f"{kind}-*-*"):
        pid = p.name[len(kind) + 1:].split("-", 1)[0]
        try:
            if not pid.isdigit() or not p.is_dir() or p.is_symlink() or p.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def prefix(kind: str) -> str:
    """A mkdtemp/TemporaryDirectory prefix owned by this process (stale ones of the same kind reaped first)."""
    reap_stale(kind)
    return f"{kind}-{os.getpid()}-"


def make(kind: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix(kind)))


def directory(kind: str) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=prefix(kind))
