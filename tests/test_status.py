"""`python -m pipeline status`: the runner's own reuse rule, and the why by config key and code file name."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from pipeline.core import code_closure
from pipeline.core.config import ROOT, load_config
from pipeline.core.status import UP_TO_DATE, WAITS, STALE, states
from tests.conftest import smoke_args


def _cfg(smoke_chain: Path, *extra: str):
    args = smoke_args(smoke_chain.parent.parent)
    files = [ROOT / b for a, b in zip(args, args[1:]) if a == "-c"]
    overrides = [b for a, b in zip(args, args[1:]) if a == "-o"] + list(extra)
    return load_config(files, overrides)


def test_a_finished_chain_is_up_to_date(smoke_chain):
    res = subprocess.run([sys.executable, "-m", "pipeline", "status", "--exit-code",
                          *smoke_args(smoke_chain.parent.parent)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for stage in ("train", "export", "server", "lite", "bundle"):
        assert stage in res.stdout
    assert "re-runs" not in res.stdout


def test_a_config_key_names_itself_and_downstream_waits(smoke_chain):
    got = {s.stage: s for s in states(_cfg(smoke_chain, "server.perf.repeats=7"), ["all"])}
    assert got["train"].state == UP_TO_DATE and got["export"].state == UP_TO_DATE
    assert got["server"].state == STALE and "server.perf.repeats" in got["server"].why
    assert got["lite"].state == WAITS and "server" in got["lite"].why


def test_an_edited_engine_file_is_named(smoke_chain, monkeypatch):
    """Issue 46: an edit to pipeline/engines/ov.py re-runs server (named by file), then lite and bundle; training
    and export keep their outputs."""
    ov = (ROOT / "pipeline" / "engines" / "ov.py").resolve()
    real = code_closure.file_digest
    monkeypatch.setattr(code_closure, "file_digest",          # an edit: another digest for that one file
                        lambda p: hashlib.sha256(real(p) + b"# one more line").digest() if Path(p).resolve() == ov
                        else real(p))
    got = {s.stage: s for s in states(_cfg(smoke_chain), ["all"])}
    assert got["server"].state == STALE and "code: pipeline/engines/ov.py" in got["server"].why, got["server"]
    assert got["lite"].state == WAITS and got["bundle"].state == WAITS
    assert got["train"].state == UP_TO_DATE and got["export"].state == UP_TO_DATE
