"""Nightly regression: compare logic, junit.xml, report.html, history, accept — on synthetic run
folders (fast), plus one slow end-to-end check: a run trained for 1 epoch fails against the smoke run."""
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import GateFailed, RegressionFound
from pipeline.core.gates import Check, Gate, skipped
from pipeline.engines import registry
from pipeline.nightly.history import History, print_trend
from pipeline.nightly.ab_latency import measure
from pipeline.nightly.regression import accept, check_run, compare, regressions, resolve_baseline, run_facts

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["train", "export", "server", "lite", "bundle"]
LIMITS = dict(metric_drop=0.01, size_growth=0.10)


def _gate(stage, subject, value, status="OK", precision="fp32", **extra):
    g = Gate(stage, subject, precision.split(" ")[0], precision, "accuracy", value=value, reference=value,
             status=status, checks=[Check("accuracy_drop", 0.0, 0.01, "<=", status != "FAIL")], extra=extra,
             seconds=0.5)
    g.reason = {"OK": "", "FAIL": "accuracy_drop 0.2 > limit 0.01"}.get(status, "converted, not executed")
    return g.to_dict()


def make_run(root: Path, name: str, acc=0.95, p50=1.0, p90=1.2, nb=100_000, server_status="OK",
             skip_bundle=False, gflops=40.0, int8="int8", arm_status="UNVERIFIED") -> Path:
    """A run folder shaped like the runner's output: <stage>/manifest.json with gates and outputs."""
    run = root / name
    lat = {"p50": p50, "p90": p90, "p99": p90 * 1.2, "mean": p50}
    stages = {
        "train": ([_gate("train", "dygraph validation", acc)], {"model.pdparams": 50_000}),
        "export": ([_gate("export", "jit.save program vs dygraph", acc)],
                   {"inference.pdmodel": 20_000, "inference.pdiparams": 80_000}),
        "server": ([_gate("server", "paddle-inference fp32", acc, server_status, latency_ms=lat),
                    skipped("server", "paddle-inference bf16", "bf16", "accuracy", "no bf16 CPU").to_dict(),
                    _gate("server", "paddle-inference int8", acc - 0.01, precision=int8,
                          latency_ms={**lat, "p50": p50 / 2})],
                   {"models/int8/model.pdiparams": 30_000}),
        "lite": ([_gate("lite", "lite arm fp32", None, arm_status, bytes=nb), _gate("lite", "lite x86 fp32", acc, bytes=nb)],
                 {"arm_fp32.nb": nb, "x86_fp32.nb": nb}),
        "bundle": ([_gate("bundle", "bundle self-verification", None)],
                   {f"{name}-1/server/fp32/inference.pdiparams": 80_000, f"{name}-1/mobile/x86_fp32.nb": nb,
                    f"{name}-1.tar.gz": 90_000 + nb}),
    }
    for stage, (gates, outputs) in stages.items():
        if stage == "bundle" and skip_bundle:
            continue
        status = "FAIL" if any(g["status"] == "FAIL" for g in gates) else "OK"
        folder = run / (stage if status == "OK" else f"{stage}.failed")
        folder.mkdir(parents=True)
        outs = {k: {"sha256": "0" * 64, "bytes": b} for k, b in outputs.items()}
        info = {"matmul_peak_gflops": gflops} if stage == "server" else {}
        (folder / "manifest.json").write_text(json.dumps({"stage": stage, "status": status, "gates": gates,
                                                          "outputs": outs, "info": info}))
    (run / "train" / "metrics.jsonl").write_text("".join(
        json.dumps({"epoch": e, "loss": 3.0 / e, "accuracy": acc * e / 3}) + "\n" for e in (1, 2, 3)))
    (run / "config.resolved.yaml").write_text("task: classification\nseed: 42\nrun: {name: %s}\n" % name)
    return run


@pytest.fixture
def cfg(tmp_path):
    return load_config(overrides=[f"run.root={tmp_path}", f"regression.history={tmp_path}/history.sqlite"])


def test_identical_run_passes(tmp_path):
    a = run_facts(make_run(tmp_path, "a"), STAGES)
    comps = compare(a, a, **LIMITS)
    kinds = {c.kind for c in comps}
    assert kinds == {"status", "metric", "size", "precision"} and not regressions(comps)


def test_precision_change_is_a_regression_but_its_explanation_is_not(tmp_path):
    base = run_facts(make_run(tmp_path, "a"), STAGES)
    fell_back = run_facts(make_run(tmp_path, "b", int8="fp32 (int8 not applied: mkldnn=false)"), STAGES)
    regs = [c for c in regressions(compare(base, fell_back, **LIMITS)) if c.kind == "precision"]
    assert len(regs) == 1 and "paddle-inference int8: effective precision int8 → fp32 (int8 not applied" in regs[0].message
    a = run_facts(make_run(tmp_path, "c", int8="fp32 (int8 not applied: mkldnn=false)"), STAGES)
    b = run_facts(make_run(tmp_path, "d", int8="fp32 (int8 not applied: ir_optim=false)"), STAGES)
    assert not [c for c in regressions(compare(a, b, **LIMITS)) if c.kind == "precision"]


def _served_run(root: Path, name: str, subject: str, precision: str, status: str = "OK") -> Path:
    run = make_run(root, name)
    man = json.loads((run / "server" / "manifest.json").read_text())
    served = {"served": True} if "as served" in subject else {}        # what the stages mark on a served row
    man["gates"].append(_gate("server", subject, 0.95, status, precision=precision, **served))
    (run / "server" / "manifest.json").write_text(json.dumps(man))
    return run


def test_a_changed_served_row_is_reported_but_a_failing_one_is_flagged(tmp_path):
    """The served HTTP row is a timed choice: bf16 one night, fp32 the next is reported, never 'passed, now
    missing'; a served row that fails its gate is a regression. Runs from before the name line up with new ones."""
    old = run_facts(_served_run(tmp_path, "a", "http /predict bf16", "bf16"), STAGES)      # the former subject
    now = run_facts(_served_run(tmp_path, "b", "http /predict as served", "fp32"), STAGES)
    comps = compare(old, now, **LIMITS)
    served = [c for c in comps if "as served" in c.name]
    assert not regressions(comps) and {c.kind for c in served} == {"status", "metric", "precision"}
    assert any("served precision bf16 → fp32" in c.message for c in served)
    broken = run_facts(_served_run(tmp_path, "c", "http /predict as served", "fp32", status="FAIL"), STAGES)
    assert [c.kind for c in regressions(compare(now, broken, **LIMITS))] == ["status"]
    # the OCR system's served set is marked the same way, whatever its subject says
    sys_a = run_facts(_served_run(tmp_path, "d", "as served (system.engine=auto)", "int8/fp32"), STAGES)
    sys_b = run_facts(_served_run(tmp_path, "e", "as served (system.engine=auto)", "fp32/fp32"), STAGES)
    assert not regressions(compare(sys_a, sys_b, **LIMITS))
    plain_a = run_facts(_served_run(tmp_path, "f", "paddle-inference bf16", "bf16"), STAGES)
    plain_b = run_facts(_served_run(tmp_path, "g", "paddle-inference bf16", "fp32 (bf16 not applied: x)"), STAGES)
    assert [c.kind for c in regressions(compare(plain_a, plain_b, **LIMITS))] == ["precision"]   # unmarked: strict


def test_unverified_rows_never_count_as_ok(tmp_path):
    unverified = run_facts(make_run(tmp_path, "a"), STAGES)
    claimed_ok = run_facts(make_run(tmp_path, "b", arm_status="OK"), STAGES)
    assert not regressions(compare(unverified, claimed_ok, **LIMITS))        # became executed: fine
    regs = regressions(compare(claimed_ok, unverified, **LIMITS))           # OK -> not executed: flagged
    assert [c.message for c in regs] == ["lite: lite arm fp32: passed in baseline, now UNVERIFIED (converted, not executed)"]
    gone = run_facts(make_run(tmp_path, "c", arm_status="FAIL"), STAGES)
    assert any("was UNVERIFIED in baseline, now FAIL" in c.message for c in regressions(compare(unverified, gone, **LIMITS)))


def test_degraded_run_is_flagged_and_named(tmp_path):
    base = run_facts(make_run(tmp_path, "good"), STAGES)
    bad = run_facts(make_run(tmp_path, "bad", acc=0.85, nb=150_000), STAGES)
    regs = regressions(compare(base, bad, **LIMITS))
    text = "\n".join(c.message for c in regs)
    assert "server: paddle-inference fp32: accuracy 0.9500 → 0.8500" in text
    assert "lite: arm_fp32.nb: 100,000 → 150,000 bytes (+50.0%" in text
    assert {c.kind for c in regs} == {"metric", "size"}


def _spin(ms: float):
    """A stand-in engine whose call costs `ms` of CPU (busy wait: load slows it like real compute)."""
    def run(x):
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass
    return run


@pytest.mark.parametrize("a_ms, b_ms, flagged", [
    (0.3, 0.3, False),        # unchanged
    (0.3, 0.33, False),       # +10 %: under the limit
    (0.3, 0.45, True),        # 1.5x: caught
])
def test_ab_latency_flags_only_a_real_slowdown(a_ms, b_ms, flagged):
    res = measure(_spin(a_ms), _spin(b_ms), np.zeros(1), rounds=9, runs=5, warmup=2, key="server: x")
    assert res.regressed(0.25) == flagged, res.message(0.25)
    assert res.ratio == pytest.approx(b_ms / a_ms, rel=0.2)
    assert "A/B ratio" in res.message(0.25) and "IQR" in res.message(0.25)


def test_ab_latency_needs_separated_spreads():
    """A median ratio over the limit whose rounds straddle 1 (noise: B faster in many rounds) is not a regression."""
    from pipeline.nightly.ab_latency import ABResult

    noisy = ABResult("k", ratio=1.3, ratio_p10=0.8, ratio_p90=1.9, a_ms=(0.2, 0.3, 0.5), b_ms=(0.25, 0.39, 0.6),
                     rounds=21, runs=20)
    clear = ABResult("k", ratio=1.5, ratio_p10=1.3, ratio_p90=1.7, a_ms=(0.28, 0.3, 0.32), b_ms=(0.42, 0.45, 0.5),
                     rounds=21, runs=20)
    assert not noisy.regressed(0.25) and clear.regressed(0.25)


def test_a_flagged_row_is_timed_again_and_judged_on_the_second_ab():
    """A burst of load on the new side's calls during the first A/B only (a 2x slower B for its first 45 calls):
    the confirming re-measurement clears it; a slowdown that lasts is flagged twice and says so."""
    from pipeline.nightly.ab_latency import measure_confirmed

    calls = {"n": 0}

    def burst(x):
        calls["n"] += 1
        _spin(0.6 if calls["n"] <= 45 else 0.3)(x)

    kw = dict(growth=0.25, rounds=9, runs=5, warmup=0, key="server: x")
    cleared = measure_confirmed(_spin(0.3), burst, np.zeros(1), **kw)
    assert cleared.first_ratio is not None and cleared.first_ratio > 1.25, cleared.message(0.25)
    assert not cleared.regressed(0.25) and "not confirmed by this second one" in cleared.message(0.25)
    lasting = measure_confirmed(_spin(0.3), _spin(0.6), np.zeros(1), **kw)
    assert lasting.regressed(0.25) and "confirmed by this second one" in lasting.message(0.25)
    steady = measure_confirmed(_spin(0.3), _spin(0.3), np.zeros(1), **kw)
    assert steady.first_ratio is None and "first A/B" not in steady.message(0.25)


def test_gate_that_stops_passing_or_disappears(tmp_path):
    base = run_facts(make_run(tmp_path, "a"), STAGES)
    now = run_facts(make_run(tmp_path, "b", server_status="FAIL", skip_bundle=True), STAGES)
    msgs = [c.message for c in regressions(compare(base, now, **LIMITS)) if c.kind == "status"]
    assert any("paddle-inference fp32: passed in baseline, now FAIL" in m for m in msgs)
    assert any("bundle self-verification: passed in baseline, now missing" in m for m in msgs)
    assert not any("bf16" in m for m in msgs)                  # skipped before and after: not a regression


def test_check_run_junit_report_history_and_baselines(tmp_path, cfg):
    runs = tmp_path
    first = check_run(cfg, make_run(runs, "n1"), STAGES, now="2024-01-01T00:00:00+00:00")
    assert first["baseline"] is None and first["status"] == "passed"
    second = check_run(cfg, make_run(runs, "n2", p50=1.05), STAGES, now="2024-01-02T00:00:00+00:00")
    assert second["baseline"]["name"] == "n1" and second["status"] == "passed"   # previous run in history
    third = check_run(cfg, make_run(runs, "n3", acc=0.85, nb=150_000), STAGES, now="2024-01-03T00:00:00+00:00")
    assert third["status"] == "regressed" and third["baseline"]["name"] == "n2"

    tree = ET.parse(third["junit"])
    cases = tree.getroot().iter("testcase")
    n_gates, n_comps = len(third["facts"]["gates"]), len(third["comparisons"])
    assert len(list(cases)) == n_gates + n_comps
    failures = [f.get("message") for f in tree.getroot().iter("failure")]
    assert len(failures) == len(third["regressions"]) and any("accuracy 0.9500 → 0.8500" in m for m in failures)
    skips = [e.get("message") for e in tree.getroot().iter("skipped")]
    assert len(skips) == 2 and any(m.startswith("UNVERIFIED: converted, not executed") for m in skips)  # bf16, arm

    html = third["report"].read_text()
    srcs = [s.split("'")[0] for s in html.split("<img src='")[1:]]
    assert len(srcs) == 4 and all(s.startswith("data:image/png;base64,") and len(s) > 2000 for s in srcs)
    assert not list(third["report"].parent.glob("*.png"))            # standalone: nothing beside it
    assert "UNVERIFIED" in html
    assert "Regressions" in html and "0.8500" in html

    hist = History(tmp_path / "history.sqlite")
    trend = hist.trend()
    assert [r["name"] for r in trend] == ["n1", "n2", "n3"]
    assert [r["status"] for r in trend] == ["passed", "passed", "regressed"]
    assert trend[2]["gates"]["server: paddle-inference fp32"]["value"] == pytest.approx(0.85)
    assert trend[1]["gates"]["server: paddle-inference fp32"]["latency_p50"] == pytest.approx(1.05)
    assert hist.last_passed(exclude="n3")["name"] == "n2"
    check_run(cfg, runs / "n3", STAGES, now="2024-01-03T00:00:00+00:00")   # re-compared: replaced, not doubled
    assert len(hist.runs()) == 3

    from rich.console import Console
    console = Console(record=True, width=200)
    print_trend(hist, console=console)
    out = console.export_text()
    assert all(n in out for n in ("n1", "n2", "n3", "regressed", "0.8500"))


def test_accept_promotes_a_passing_run_only(tmp_path, cfg):
    good, bad = make_run(tmp_path, "good"), make_run(tmp_path, "bad", server_status="FAIL")
    hist = History(tmp_path / "history.sqlite")
    assert resolve_baseline(cfg, "x", hist) == (None, "none (first run)")
    with pytest.raises(GateFailed, match="server=FAIL"):
        accept(cfg, bad, STAGES)
    marker = accept(cfg, good, STAGES)
    assert marker.read_text().strip() == "good"
    assert resolve_baseline(cfg, "x", hist) == (good.resolve(), "accepted")
    res = check_run(cfg, make_run(tmp_path, "later", acc=0.9), STAGES)
    assert res["baseline"]["name"] == "good" and res["regressions"]


def test_compare_cli_exit_code_and_one_line_error(tmp_path):
    good, bad = make_run(tmp_path, "good"), make_run(tmp_path, "bad", acc=0.80)
    hist = f"regression.history={tmp_path}/h.sqlite"
    res = subprocess.run([sys.executable, "-m", "pipeline", "compare", str(bad), "--baseline", str(good), "-o", hist],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == RegressionFound.exit_code, res.stderr
    block, last = res.stderr.strip().rsplit("\n", 1)
    assert "regression(s) against baseline good" in block and block.count("[metric]") >= 3
    assert last.startswith("error: ") and "accuracy 0.9500 → 0.8000" in last
    assert (bad / "junit.xml").is_file() and (bad / "report.html").is_file()


@pytest.mark.slow
def test_fewer_epochs_fails_against_the_smoke_baseline(tmp_path_factory, tmp_path):
    """End to end: the shared smoke run is the baseline; the same chain trained for 1 epoch at a
    hundredth of the learning rate must be reported as a regression naming the metric. Whether the
    degraded run also fails its own train gate (then later stages do not run) does not matter here."""
    base = tmp_path_factory.getbasetemp() / "smoke-chain"
    common = ["-c", "configs/smoke.yaml", "-o", f"run.root={base}/runs", "-o", f"bundle.root={base}/bundles",
              "-o", "train.min_metric=0.05"]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)

    good = cli("run", "all", *common, "-o", "run.name=smoke")     # the same chain as tests/test_bundle.py: cached
    assert good.returncode == 0, good.stderr[-3000:]
    cli("run", "all", *common, "-o", "run.name=smoke-degraded", "-o", "train.epochs=1", "-o", "train.lr=0.00005",
        "-o", "train.min_metric=0.5")     # fails its own train gate: the later stages do not run (~20 s less)
    hist = ["-o", f"regression.history={tmp_path}/h.sqlite", "-o", "regression.ab_rounds=3", "-o", "regression.ab_runs=5"]
    ok = cli("compare", str(base / "runs" / "smoke"), "--baseline", str(base / "runs" / "smoke"), *hist)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = cli("compare", str(base / "runs" / "smoke-degraded"), "--baseline", str(base / "runs" / "smoke"), *hist)
    assert bad.returncode == RegressionFound.exit_code, bad.stderr[-2000:]
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "regression(s) vs smoke" in last
    assert "train: dygraph validation: accuracy" in bad.stderr
    junit = ET.parse(base / "runs" / "smoke-degraded" / "junit.xml").getroot()
    assert any("accuracy" in f.get("message") for f in junit.iter("failure"))
    same = ET.parse(base / "runs" / "smoke" / "junit.xml").getroot()       # latency re-measured A/B, both runs' files
    ab = [c for c in same.iter("testcase") if c.get("classname") == "regression.latency"]
    assert ab and all("A/B ratio" in c.find("system-out").text for c in ab)     # every engine, ORT/OpenVINO too
    engines = {"paddle-inference fp32", "onnxruntime fp32", *(["openvino fp32"] if registry.available("openvino")[0]
                                                              else [])}   # SKIPPED below AVX2: nothing to time
    assert engines <= {c.get("name").split("server: ")[1].split(" (A/B)")[0] for c in ab}
