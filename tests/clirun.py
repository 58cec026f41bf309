"""`python -m pipeline ...` as a user runs it, for the end-to-end tests: one subprocess, the repo as cwd."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pipeline_cli(*args, check: bool = False, env_extra: dict | None = None, timeout: float = 1200):
    """Run the CLI; check=True turns a non-zero exit into an AssertionError carrying both output tails."""
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-m", "pipeline", *map(str, args)], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res
