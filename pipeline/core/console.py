"""What a person reads on the console (one place, used by every entry point).

- Our own lines (the `pipeline` logger, progress bars, the summary table) go to `stream()`: the console.
- While a stage runs, `native_output_to(log)` points file descriptors 1 and 2 at the run's log file, so what
  Paddle, oneDNN, OpenVINO, NNCF, Paddle Lite and child processes print natively (C++ iostreams, glog, Python
  libraries writing to sys.stdout/sys.stderr) lands there; Python logging cannot reach those writers.
- On a terminal: progress bars and colours. Anywhere else (a file, a pipe, CI, cron): plain lines, no carriage
  returns, no ANSI codes (`is_terminal()`).
- `--quiet` (env PIPELINE_QUIET=1, inherited by child processes): warnings, errors and the summary only.
"""
from __future__ import annotations

import codecs
import contextlib
import ctypes
import io
import logging
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

QUIET_ENV = "PIPELINE_QUIET"
_capture: dict = {}          # while native output is captured: {"console": TextIO, "log": path}
_keep = {"here": False}      # a process whose fds are already its own log (a training rank's workerlog.N)


# what an ASCII-only console (LANG=C, PYTHONUTF8=0) shows for the symbols our lines use
ASCII_FALLBACK = {"\u00d7": "x", "\u2192": "->", "\u2190": "<-", "\u2265": ">=", "\u2264": "<=", "\u2260": "!=",
                  "\u2248": "~", "\u00b1": "+-", "\u2026": "...", "\u2014": "--", "\u2013": "-", "\u00b5": "u",
                  "\u2713": "ok", "\u2717": "x", "\u2022": "*", "\u00b7": ".", "\u2018": "'", "\u2019": "'",
                  "\u201c": '"', "\u201d": '"', "\u2212": "-", "\u221e": "inf", "\u0394": "delta"}
ASCII_ERRORS = "pipeline-ascii"


def _ascii_fallback(exc: UnicodeError):
    """A codec error handler: the ASCII spelling of a known symbol, else a \\uXXXX escape (never an exception)."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    text = exc.object[exc.start:exc.end]
    return "".join(ASCII_FALLBACK.get(ch) or ch.encode("ascii", "backslashreplace").decode() for ch in text), exc.end


codecs.register_error(ASCII_ERRORS, _ascii_fallback)


def locale_proof(*streams) -> None:
    """Printing never raises UnicodeEncodeError, whatever the locale: symbols fall back to ASCII."""
    for s in streams or (sys.stdout, sys.stderr):
        encoding = getattr(s, "encoding", None)
        if not isinstance(encoding, str):           # a StringIO (tests, redirect_stdout): no encoding, no error
            continue
        with contextlib.suppress(AttributeError, ValueError, LookupError, io.UnsupportedOperation):
            if codecs.lookup(encoding).name != "utf-8":
                s.reconfigure(errors=ASCII_ERRORS)


def keep_native_output_here() -> None:
    """Leave fds 1 and 2 where they are for this process: native_output_to becomes a no-op."""
    _keep["here"] = True


def quiet() -> bool:
    return os.environ.get(QUIET_ENV) == "1"


def set_quiet(on: bool) -> None:
    if on:
        os.environ[QUIET_ENV] = "1"     # child processes (system parts, training ranks) inherit it
    logging.getLogger("pipeline").setLevel(logging.WARNING if quiet() else logging.INFO)


def stream():
    """The console: the saved original stderr while a stage's native output is captured, else sys.stderr."""
    return _capture.get("console") or sys.stderr


def binary_stream():
    s = stream()
    return getattr(s, "buffer", None) or sys.__stderr__.buffer


def is_terminal() -> bool:
    s = stream()
    try:
        return s.isatty()
    except (AttributeError, ValueError):
        return False


def rich_console(file=None, **kwargs):
    """A rich Console (on `file`, default the console): styled on a terminal, plain text (no ANSI codes) elsewhere."""
    from rich.console import Console
    file = file or stream()
    try:
        tty = file.isatty()
    except (AttributeError, ValueError):
        tty = False
    return Console(file=file, force_terminal=tty, color_system="auto" if tty else None,
                   force_interactive=tty, **kwargs)


class _ConsoleHandler(logging.StreamHandler):
    """Writes to whatever the console is right now (it moves while a stage's native output is captured)."""

    @property
    def stream(self):
        return stream()

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging() -> None:
    locale_proof()
    # our own handler: paddle reconfigures the root logger on import
    log = logging.getLogger("pipeline")
    if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        for h in list(log.handlers):
            log.removeHandler(h)
        handler = _ConsoleHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet() else logging.INFO)
    log.propagate = False


def _flush_all() -> None:
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    with contextlib.suppress(Exception):       # C stdio buffers (std::cout syncs with them): before fds move
        ctypes.CDLL(None).fflush(None)


def _real_fd(s, fd: int) -> bool:
    try:
        return s.fileno() == fd
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False


@contextlib.contextmanager
def native_output_to(log_path: Path, title: str = "") -> Iterator[Path]:
    """Fds 1 and 2 -> `log_path` (appended) for the duration; our own output keeps going to the console.
    Nested uses (a stage inside a stage's process) keep the outer capture."""
    if _capture or _keep["here"]:
        yield Path(_capture.get("log") or log_path)
        return
    log_path = Path(log_path)
    with contextlib.suppress(OSError):
        log_path.parent.mkdir(parents=True, exist_ok=True)
    _flush_all()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    # sys.stderr replaced by a Python object (pytest's capsys): it is not on fd 2, so keep writing to it
    if _real_fd(sys.stderr, 2):
        console = io.TextIOWrapper(os.fdopen(os.dup(saved[2]), "wb", buffering=0), encoding=sys.stderr.encoding,
                                   errors=ASCII_ERRORS, line_buffering=True, write_through=True)
    else:
        console = sys.stderr
    try:
        log = open(log_path, "ab", buffering=0)
    except OSError:             # a read-only or full disk: the stage itself reports it, in one line
        for dup in saved.values():
            os.close(dup)
        yield log_path
        return
    with log:
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        log.write(f"==== {title} {stamp} (native output of Paddle, oneDNN, OpenVINO, NNCF, Lite)\n".encode())
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        _capture.update(console=console, log=str(log_path))
        try:
            yield log_path
        finally:
            _flush_all()
            for fd, dup in saved.items():
                os.dup2(dup, fd)
                os.close(dup)
            _capture.clear()
            if console is not sys.stderr:
                with contextlib.suppress(Exception):
                    console.close()
