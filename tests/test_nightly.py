"""The nightly happy path, end to end at smoke sizes: nightly → accept → nightly exits 0 on the default
(classification) task and on the recognition task, the second night compares with the first, every served
engine is A/B-measured with its served settings, and a planted slowdown of the served engine is caught."""
import json
import time
from pathlib import Path

import pytest

from clirun import pipeline_cli
from pipeline.core.catalogue import for_task
from pipeline.core.config import load_config
from pipeline.nightly.regression import check_run

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
AB = ["-o", "regression.ab_rounds=3", "-o", "regression.ab_runs=5"]     # A/B timing kept short for the suite


def _common(tmp: Path, config: str) -> list[str]:
    return ["-c", config, "-o", f"run.root={tmp}/runs", "-o", f"bundle.root={tmp}/bundles",
            "-o", f"regression.history={tmp}/history.sqlite", *AB]


def _nightly(common: list[str], *extra: str) -> tuple[Path, str]:
    res = pipeline_cli("nightly", *common, *extra, check=True)
    run_dir = Path(res.stdout.split("wrote ")[-1].split("/junit.xml")[0])
    return run_dir, res.stdout


def _measured_everything(stdout: str) -> None:
    assert " 0 regressed, 0 not measured" in stdout, stdout[-2000:]


def test_default_task_nightly_accept_nightly(smoke_chain, tmp_path):
    """The session's smoke run is accepted as the first baseline, so one nightly covers nightly -> accept ->
    nightly on the default task (the recognition test below runs two nightlies back to back)."""
    common = _common(tmp_path, "configs/smoke.yaml") + ["-o", "run.name=smoke", "-o", "train.min_metric=0.05"]
    accepted = pipeline_cli("accept", smoke_chain, *common, check=True)     # the session's smoke run as first baseline
    assert "baseline is now" in accepted.stdout
    night, out = _nightly(common)
    assert night.name.startswith("smoke-") and "baseline: smoke (accepted)" in out
    _measured_everything(out)
    promoted = pipeline_cli("accept", *common, check=True)                  # default: the newest run of the series
    assert f"baseline is now {night}" in promoted.stdout
    junit = (night / "junit.xml").read_text()
    served = json.loads((night / "server" / "serving.json").read_text())
    assert f"latency · server: {served['engine']} {served['precision']} (A/B)" in junit    # the served row was timed A/B
    assert sorted(p.name for p in night.iterdir() if (p / "manifest.json").is_file()) == sorted(for_task("classification"))


def test_recognition_nightly_accept_nightly_and_a_planted_slowdown(tmp_path):
    # one tuning candidate per engine (built, not timed): tuning is not what this test is about
    common = _common(tmp_path, "configs/smoke_rec.yaml") + ["-o", "server.tuning.threads=[1]",
                                                            "-o", "server.tuning.paddle_ir_optim=[true]"]
    first, out = _nightly(common)
    assert "baseline: none (first run)" in out
    pipeline_cli("accept", *common, check=True)
    second, out = _nightly(common)
    assert f"baseline: {first.name} (accepted)" in out
    _measured_everything(out)

    served = json.loads((second / "server" / "serving.json").read_text())["engine"]
    cfg = load_config([ROOT / "configs" / "smoke_rec.yaml"],
                      [f"run.root={tmp_path}/runs", f"run.name={second.name}", f"regression.history={tmp_path}/h2.sqlite",
                       "regression.ab_rounds=5", "regression.ab_runs=8"])
    res = check_run(cfg, second, for_task("recognition"), baseline=str(first),
                    planted={"wrap_current": _three_times_slower, "wrap_rows": {f"{served} fp32"}})
    slow = [c for c in res["regressions"] if c.kind == "latency"]
    assert [c.name for c in slow] == [f"latency · server: {served} fp32 (A/B)"], [c.message for c in res["regressions"]]
    assert res["status"] == "regressed"


def _three_times_slower(run):
    def slower(x):
        t0 = time.perf_counter()
        out = run(x)
        end = time.perf_counter() + 2 * (time.perf_counter() - t0)
        while time.perf_counter() < end:
            pass
        return out
    return slower
