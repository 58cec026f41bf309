import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
import stages


import json
import subprocess

import pytest

SMOKE_OVERRIDES = ("-c", "configs/smoke.yaml", "-o", "run.name=smoke", "-o", "train.min_metric=0.05")


def smoke_args(base: Path) -> list[str]:
    """The smoke chain's CLI arguments: same config → same fingerprints → every stage cached."""
    return [*SMOKE_OVERRIDES, "-o", f"run.root={base}/runs", "-o", f"bundle.root={base}/bundles"]


@pytest.fixture(scope="session")
def smoke_chain(tmp_path_factory) -> Path:
    """The whole smoke chain, run once per session (train.min_metric lowered: these tests check packaging,
    not how well 3 epochs train); returns the run folder. Its bundle: smoke_bundle."""
    base = tmp_path_factory.getbasetemp() / "smoke-chain"
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "all", *smoke_args(base)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (base / "console.txt").write_text(res.stdout + res.stderr)    # what a log reader sees (tests/test_console.py)
    return base / "runs" / "smoke"


@pytest.fixture(scope="session")
def smoke_bundle(smoke_chain) -> tuple[Path, Path]:
    """(bundle folder, .tar.gz) of the smoke chain."""
    info = json.loads((smoke_chain / "bundle" / "manifest.json").read_text())["info"]
    return Path(info["bundle"]), Path(info["archive"])


def served_limit(folder: Path, expected, fp32_limit: float = 1e-4) -> float:
    """Max |served - expected| a bundle's recommended row may show: fp32's limit, or, when a low-precision row is
    served (int8 on a VNNI CPU, bf16 on a bf16 CPU), that row's gate tolerance atol + rtol x max|expected|."""
    import numpy as np
    import yaml

    serving = yaml.safe_load((Path(folder) / "infer_config.yaml").read_text()).get("serving") or {}
    tol = serving.get("tolerance")
    if (serving.get("precision") or "fp32") == "fp32" or not tol:
        return fp32_limit
    return tol["atol"] + tol["rtol"] * float(np.abs(expected).max())
