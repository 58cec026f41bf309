"""How `make conformance` judges its rows, on fabricated run folders (no training): near-chance rows MARKED whatever
their verdict, the marked-share exit rule, gates that cannot resolve their limit, the zoo read from its config."""
import json
import re

import pytest
import yaml

from pipeline.nightly import conformance, conformance_rules as rules

GATES = {"fp32": {"metric_delta": 0.0, "max_correct_lost": 0.0}, "fp16": {"metric_delta": 0.03, "max_correct_lost": 0.05},
         "bf16": {"metric_delta": 0.03, "max_correct_lost": 0.05}, "int8": {"metric_delta": 0.04, "max_correct_lost": 0.05}}


def _gate(subject: str, prec: str, status: str, ref: float, metric: str, of: int | None = None) -> dict:
    key = f"server.gates.{prec}"
    checks = [{"name": "max_abs_diff", "observed": 0.1, "limit": 0.5, "op": "<=", "passed": True, "key": "", "detail": ""},
              {"name": f"{metric}_drop", "observed": 0.0, "limit": GATES[prec]["metric_delta"], "op": "<=",
               "passed": status == "OK", "key": f"{key}.metric_delta", "detail": ""}]
    if of is not None:
        checks.append({"name": "correct_lost", "observed": 0.0, "limit": GATES[prec]["max_correct_lost"], "op": "<=",
                       "passed": True, "key": f"{key}.max_correct_lost",
                       "detail": f"0 of {of} correctly read samples turn wrong"})
    return {"subject": subject, "precision_requested": prec, "status": status, "metric": metric, "reference": ref,
            "checks": checks, "reason": "" if status == "OK" else f"{metric}_drop 0.09 > limit 0.04", "seconds": 1.0}


def _fake_run(root, metric_value: float, int8_status: str = "OK", task: str = "classification", samples: int = 512):
    """A conformance run folder as the chain leaves it: train info and manifest, server manifest, resolved config."""
    run = root / "arch"
    for stage in ("train", "server"):
        (run / stage).mkdir(parents=True)
    labels = [str(i) for i in range(36)] if task == "classification" else []
    (run / "train" / "info.json").write_text(json.dumps({"task": task, "labels_info": {"labels": labels}}))
    (run / "train" / "manifest.json").write_text(json.dumps({"gates": [], "info": {"val_slice": samples}}))
    metric = "accuracy" if task == "classification" else "seq_accuracy"
    of = round(metric_value * samples) if task == "recognition" else None
    gates = [_gate("paddle-inference fp32", "fp32", "OK", metric_value, metric, of),
             _gate("paddle-inference fp16", "fp16", "OK", metric_value, metric, of),
             _gate("paddle-inference int8", "int8", int8_status, metric_value, metric, of)]
    (run / "server" / "manifest.json").write_text(json.dumps({"gates": gates}))
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"task": task, "server": {"gates": GATES}}))
    return run


@pytest.mark.parametrize("accuracy, int8_status, verdict, would_be", [
    (0.10, "OK", "MARKED", "OK"), (0.10, "FAIL", "MARKED", "FAIL"), (0.10, "EXCLUDED", "MARKED", "EXCLUDED"),
    (0.30, "OK", "OK", ""), (0.30, "FAIL", "FAIL", "")])
def test_a_low_precision_row_near_chance_is_marked_whatever_its_verdict(tmp_path, accuracy, int8_status, verdict,
                                                                        would_be):
    """36 classes: chance 0.028 + 5 x int8's 0.04 = 0.228. Below it every executed fp16/bf16/int8 row is MARKED, pass or
    fail, with the reason and the verdict it would have had; above it the gate's verdict stands; fp32 rows always
    count (exact parity on any weights)."""
    rows = {r.row: r for r in conformance._stage_rows("arch", _fake_run(tmp_path, accuracy, int8_status), "")}
    assert rows["server: paddle-inference fp32"].verdict == "OK"
    int8 = rows["server: paddle-inference int8"]
    assert (int8.verdict, int8.would_be) == (verdict, would_be)
    if verdict == "MARKED":
        assert "0.228" in int8.note and "chance 0.028" in int8.note and f"would be {int8_status}" in int8.note
    counts = rules.verdict_counts(list(rows.values()))
    assert counts["marked (near chance)"] == (2 if accuracy < 0.228 else 0)
    assert counts["marked that would fail"] == (accuracy < 0.228 and int8_status != "OK")
    assert counts["failed"] == (verdict == "FAIL") + 1          # + export: no manifest in this fake run


def test_a_stage_stopped_by_a_marked_failure_did_not_run_it_did_not_fail(tmp_path):
    """mobilenet_v2 at 0.066: its int8 gate failed (MARKED, would be FAIL) and stopped the chain; the Lite stage after
    it has no manifest. It never ran: NOT RUN, not a FAILED row of a model near chance."""
    run = _fake_run(tmp_path, 0.066, "FAIL")
    (run / "export").mkdir()
    (run / "export" / "manifest.json").write_text(json.dumps({"gates": []}))
    rows = {r.row: r for r in conformance._stage_rows("arch", run, "error: server: paddle-inference int8 failed")}
    assert rows["server: paddle-inference int8"].would_be == "FAIL"
    assert rows["lite"].verdict == "NOT RUN" and rows["lite"].note == "an input stage failed"
    assert rules.verdict_counts(list(rows.values()))["failed"] == 0


def test_standing_prints_fp32_beside_chance_and_margin(tmp_path):
    st = rules.standing(_fake_run(tmp_path, 0.5))
    assert (st.chance, st.budget) == (pytest.approx(1 / 36), 0.04) and not st.near_chance
    assert st.line() == "fp32 accuracy 0.500, chance 0.028, floor 0.228 (+5 x 0.04), margin +0.272"


def test_a_recogniser_has_no_chance_and_its_lost_lines_need_enough_correct_samples(tmp_path):
    """CTC lines are never right by chance (floor 0.2). 39 correctly read lines of 512: one moves the lost-lines
    share by 0.026, and resolving 0.05 needs 80 (one line <= 0.0125): the row says so; its verdict stands."""
    run = _fake_run(tmp_path, 39 / 512, task="recognition")
    assert rules.standing(run).floor == pytest.approx(0.2)
    rows = {r.row: r for r in conformance._stage_rows("arch", run, "")}
    fp16 = rows["server: paddle-inference fp16"]
    assert fp16.verdict == "MARKED" and fp16.unresolved
    assert "correct_lost could not resolve its limit 0.05: one of 39 correctly read samples" in fp16.note
    assert ">= 80" in fp16.note and "seq_accuracy_drop" not in fp16.note     # 512 samples resolve 0.03 (needs 134)
    assert not rows["server: paddle-inference fp32"].unresolved              # limit 0 is exact


def test_few_samples_cannot_resolve_a_metric_delta(tmp_path):
    gate = _gate("onnxruntime int8", "int8", "OK", 0.9, "accuracy")
    cfg = {"server": {"gates": GATES}}
    assert rules.resolution(gate, 100, cfg) == ""                          # 4 / 0.04 = 100 samples
    why = rules.resolution(gate, 64, cfg)
    assert why.startswith("accuracy_drop could not resolve its limit 0.04: one of 64 samples moves it by 0.0156")
    # the HTTP row judges only its requests: 16 of them, whatever the validation slice holds
    http = {**gate, "extra": {"requests": 16}}
    assert "one of 16 samples" in rules.resolution(http, 512, cfg)
    http["checks"][1]["detail"] = "metric_delta 0.04 < one sample of 16 (0.0625): one sample allowed"
    assert "one of 16 samples" in rules.resolution({**http, "extra": {}}, 512, cfg)


@pytest.mark.parametrize("lost, of, draw", [(19, 336, True), (16, 336, True), (23, 336, True), (0, 336, False),
                                             (2, 470, False), (40, 336, False), (55, 1358, True), (30, 1358, False)])
def test_lost_lines_whose_interval_holds_the_limit_are_a_draw(lost, of, draw):
    """svtr_lcnet's int8 rows: 19 and 23 of 336 lost fail 0.05, but their 95 % intervals (0.036-0.087, 0.046-0.101)
    hold it; on 1358 fresh correctly read lines the same models lose 4.1 % and 4.9 %, still a draw (0.031-0.052).
    Such a row says it could not resolve its limit; 0 of 336, 40 of 336 (0.088-0.158) or 30 of 1358 are clear."""
    gate = _gate("onnxruntime int8", "int8", "OK" if lost / of <= 0.05 else "FAIL", 0.66, "seq_accuracy", of)
    gate["checks"][-1].update(observed=lost / of, detail=f"{lost} of {of} correctly read samples turn wrong")
    why = rules.resolution(gate, 512, {"server": {"gates": GATES}})
    assert ("95 % interval" in why and "holds the limit" in why) == draw, why
    if draw:
        lo, hi = rules.wilson(lost, of)
        assert lo < 0.05 < hi and f"{lo:.3f}-{hi:.3f}" in why


@pytest.mark.parametrize("agreement, draw", [(0.828125, True), (0.832031, True), (0.912, False), (0.80, False)])
def test_an_agreement_whose_interval_holds_the_limit_is_a_draw(agreement, draw):
    """vit's int8 rows on 512 samples: strict argmax agreement 0.828 and 0.832 fail 0.85 (interval 0.793-0.858 holds
    it); on 2048 fresh samples the same models agree 0.862 and 0.855. 0.912 and 0.80 are clear of 0.85."""
    gate = _gate("openvino int8", "int8", "OK" if agreement >= 0.85 else "FAIL", 0.55, "accuracy")
    gate["checks"].append({"name": "argmax_agreement", "observed": agreement, "limit": 0.85, "op": ">=",
                           "passed": agreement >= 0.85, "key": "server.gates.int8.min_agreement", "detail": ""})
    cfg = {"server": {"gates": {**GATES, "int8": {**GATES["int8"], "min_agreement": 0.85}}}}
    why = rules.resolution(gate, 512, cfg)
    assert ("argmax_agreement" in why and "holds the limit" in why) == draw, why


def _counts(ok=0, marked=0, failed=0, not_run=0, skipped=0):
    rows = [rules.Row("a", f"r{i}", v) for i, v in enumerate(["OK"] * ok + ["MARKED"] * marked + ["FAIL"] * failed
                                                          + ["NOT RUN"] * not_run + ["SKIPPED"] * skipped)]
    return rules.verdict_counts([rules.Row("a", "chain (wall time)", "OK"), *rows])


def test_too_many_marked_rows_fail_the_run_and_skipped_ones_do_not_count():
    assert rules.verdict(_counts(ok=95, marked=5, skipped=50), 0.05) == (0, "")
    code, why = rules.verdict(_counts(ok=94, marked=6, skipped=50), 0.05)
    assert code == 1 and "6 of 100 executed rows MARKED near chance (6.0% > conformance.max_marked_share 5.0%)" in why
    assert rules.verdict(_counts(ok=10, failed=1), 0.05)[0] == 1
    assert rules.verdict(_counts(ok=10, not_run=1), 0.05)[0] == 1
    assert rules.verdict(_counts(), 0.05) == (0, "")


def test_the_zoo_comes_from_its_config_and_its_section_never_reaches_the_stages(tmp_path):
    st = conformance.load_settings()
    assert "conformance" not in st.base and st.base["train"]["min_metric"] == 0.0
    assert set(st.fast) <= set(st.zoo) and 0 < st.max_marked_share < 1 and st.zoo == conformance.ZOO
    assert all(any(o.startswith("model.name=") for o in ovr) for ovr in st.zoo.values())
    from pipeline.core.errors import ConfigError
    bad = tmp_path / "c.yaml"
    for text, message in (("conformance: {zoo: {lcnet: [model.name=lcnet]}}\n", "conformance.zoo.lcnet"),
                          ("conformance: {zoo: {lcnet: {model.name: lcnet}}, fast: [vit]}\n",
                           "conformance.fast names vit, not in conformance.zoo"),
                          ("conformance: {zoo: {lcnet: {model.name: lcnet}}, max_marked_share: 2}\n",
                           "conformance.max_marked_share"),
                          ("conformance: {zoo: {}}\n", "conformance.zoo names no architecture"),
                          ("conformance: {zoo: {lcnet: {model.name: lcnet}}}\ntrain: {epoch: 3}\n",
                           "unknown config key 'train.epoch'")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            conformance.load_settings(bad)


def test_importing_the_driver_reads_no_config(monkeypatch):
    """The CLI imports every command at start: a broken configs/conformance.yaml must fail `make conformance`
    with its one line, not every other command at import."""
    import importlib

    from pipeline.core import config, safe_yaml

    calls = []
    for module, name in ((config, "load_config"), (safe_yaml, "read"), (yaml, "safe_load")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: calls.append(_n))
    importlib.reload(conformance)
    assert calls == []
    monkeypatch.undo()
    importlib.reload(conformance)


def test_only_int8_is_a_zoo_candidate_and_each_one_is_explained():
    """A candidate row that fails is EXCLUDED and the run goes on: in the zoo only int8 may be one (fp32 is exact
    parity, fp16/bf16 hold everywhere), and every architecture that makes it one says why in docs/conformance.md."""
    st = conformance.load_settings()
    roles = {arch: {o.split("=")[0].removeprefix("server.roles."): o.split("=", 1)[1]
                    for o in ovr if o.startswith("server.roles")} for arch, ovr in st.zoo.items()}
    assert all(set(r) <= {"int8"} for r in roles.values()), roles
    assert "roles" not in (st.base.get("server") or {})          # never zoo-wide: per architecture, per reason
    section = (conformance.ROOT / "docs" / "conformance.md").read_text().split("## int8 roles", 1)[1].split("\n## ")[0]
    candidates = {arch for arch, r in roles.items() if r.get("int8") == "candidate"}
    table_rows = {arch for arch in st.zoo if f"\n| {arch} |" in section}
    assert candidates and candidates == table_rows, (candidates, table_rows)


def test_a_timed_out_architecture_leaves_no_process_behind(tmp_path):
    """`pipeline run` supervises its stage in a child process: a timeout must kill the grandchild too (it held the run
    folder's lock and the cores after its row said timeout)."""
    import os
    import sys
    import time

    pid_file = tmp_path / "grandchild.pid"
    child = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); p.wait()")
    out, err = conformance.run_group([sys.executable, "-c", child], dict(os.environ), timeout=3)
    assert "timeout after 3s" in err
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {grandchild} outlived the timeout")


def test_architectures_side_by_side_keep_the_zoo_order(monkeypatch):
    """conformance.jobs chains at a time, started in the zoo's order (longest first), rows reported in that order
    whatever order they finish in; jobs 1 runs one at a time."""
    import threading
    import time

    running, peak, lock = [0], [0], threading.Lock()

    def fake_run_arch(arch, recipe, root, extra, timeout, force):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep({"long": 0.3, "mid": 0.2, "short": 0.05}[arch])
        with lock:
            running[0] -= 1
        return [rules.Row(arch, "chain (wall time)", "OK")]

    monkeypatch.setattr(conformance, "run_arch", fake_run_arch)
    zoo = {"long": [], "mid": [], "short": []}
    rows = conformance.run_side_by_side(list(zoo), zoo, None, [], 10, False, jobs=2)
    assert [r[0].arch for r in rows] == ["long", "mid", "short"] and peak[0] == 2
    peak[0] = 0
    conformance.run_side_by_side(list(zoo), zoo, None, [], 10, False, jobs=1)
    assert peak[0] == 1
    assert conformance.load_settings().jobs >= 1
