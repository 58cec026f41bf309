"""A benchmark worker in its own process, driven one JSON line per request over stdin/stdout.

Both benches run every variant in a separate process (MKL reads its environment once, at load) and
make them take turns, so one process computes at a time. stderr goes to a temp file, not a pipe:
Paddle's warnings could fill a pipe nobody reads and hang the child; the file's tail explains a crash.
"""
from __future__ import annotations

import json
import subprocess
import tempfile


class LineChild:
    def __init__(self, cmd: list[str], name: str, **popen):
        self.name = name
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1, **popen)

    def reply(self) -> dict:
        """The child's next JSON line; a dead child ends the bench with its exit code and last stderr line."""
        line = self.proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            tail = (self._stderr.read().strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: bench worker {self.name} failed (exit {self.proc.wait()}): {tail}")
        return json.loads(line)

    def ask(self, request: str) -> dict:
        self.proc.stdin.write(request + "\n")
        return self.reply()

    def close(self, timeout: float = 120) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=timeout)
        self._stderr.close()
