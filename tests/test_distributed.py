"""Scale-out: the global batch split across processes, the process layout in the fingerprint, the
OpenMP wait policy chosen by a probe, two "nodes" on 127.0.0.1, and a rank that dies.
Tiny configs; the process tests share one 2-process run. No timing asserts."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.training import checkpoint
from pipeline.core import env
from pipeline.core.artifacts import load_manifest, verify_outputs
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TINY = ["-c", "configs/smoke.yaml", "-o", "data.num_train=480", "-o", "data.num_val=64", "-o", "train.epochs=2",
        "-o", "train.batch_size=32", "-o", "model.args={channels: [4, 8, 8], hidden: 16}",
        "-o", "train.min_metric=0.0", "-o", "run.quiet=true"]


def cli(*args, root: Path, name: str = "r", over: tuple = (), wait: bool = True, timeout: int = 240, env_extra=None):
    cmd = [sys.executable, "-m", "pipeline", *args, *TINY, "-o", f"run.root={root}", "-o", f"run.name={name}",
           *[x for o in over for x in ("-o", o)]]
    e = {**os.environ, **(env_extra or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=e)


def params(run_dir: Path) -> dict:
    import paddle

    return {k: np.asarray(v) for k, v in paddle.load(str(run_dir / "train" / "model.pdparams"),
                                                     return_numpy=True).items()}


def one_error_line(res) -> str:
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    return errors[0]


def tiny_cfg(*extra: str):
    return load_config(["configs/smoke.yaml"], [o for i, o in enumerate(TINY) if TINY[i - 1] == "-o"] + list(extra))


# ---------------------------------------------------------------- no processes

def test_global_batch_must_split_evenly():
    from pipeline.core.process_layout import plan, split_batch

    assert split_batch(128, 2) == 64 and split_batch(96, 3) == 32
    with pytest.raises(ConfigError, match=r"train.batch_size 100 .* 3 processes") as exc:
        split_batch(100, 3)
    assert "99" in exc.value.hint and "102" in exc.value.hint
    with pytest.raises(ConfigError, match="train.batch_size 32"):
        plan(tiny_cfg(), nproc=3)
    with pytest.raises(ConfigError, match="MASTER"):
        plan(tiny_cfg(), nproc=1, nnodes=2, master=None, node_rank=0)
    with pytest.raises(ConfigError, match="NODE_RANK"):
        plan(tiny_cfg(), nproc=1, nnodes=2, master="127.0.0.1:1234", node_rank=2)


def test_auto_layout_rule():
    from pipeline.core.process_layout import _auto

    assert _auto(128, 2, 0, 1)[0] == 2                     # 2 cores: 2 processes x 1 thread
    assert _auto(128, 1, 0, 1)[0] == 1
    assert _auto(128, 64, 0, 1)[0] == 8                    # never shares smaller than 16 samples
    assert _auto(30, 2, 0, 1)[0] == 1                      # 15-sample shares: threads instead
    assert _auto(128, 8, 4, 1)[0] == 4                     # one per GPU
    assert "processes beat threads" in _auto(128, 2, 0, 1)[1]
    assert _auto(128, 2, 0, 2)[0] == 2                     # 2 nodes x 2 processes: 32-sample shares


def test_layout_is_in_the_fingerprint_but_not_train_nproc_itself():
    from pipeline.core.runner import fingerprint, registry

    stage = registry()["train"]
    one, two = {"nproc": 1, "nnodes": 1, "threads": 2}, {"nproc": 2, "nnodes": 1, "threads": 1}
    assert fingerprint(tiny_cfg(), stage, {}, one) != fingerprint(tiny_cfg(), stage, {}, two)
    # auto and an explicit 2 that resolve to the same layout are the same run
    assert fingerprint(tiny_cfg("train.nproc=auto"), stage, {}, two) == fingerprint(tiny_cfg("train.nproc=2"), stage, {}, two)
    assert fingerprint(tiny_cfg(), registry()["export"], {}, None) == fingerprint(tiny_cfg("train.nproc=2"),
                                                                                  registry()["export"], {}, None)


def test_wait_policy_probe_decides_active_on_quiet_and_passive_on_busy(monkeypatch):
    monkeypatch.setattr(env, "cpu_count", lambda: 4)
    assert env.choose_wait_policy(4, "auto", busy=0.2)[0] == "ACTIVE"
    assert env.choose_wait_policy(4, "auto", busy=2.0)[0] == "PASSIVE"
    assert env.choose_wait_policy(2, "auto", busy=1.0)[0] == "ACTIVE"         # 3 idle cores for 2 threads
    assert env.choose_wait_policy(2, "auto", busy=1.0, demand=4)[0] == "PASSIVE"   # 2 ranks x 2 threads
    assert env.choose_wait_policy(1, "auto", busy=3.9)[0] is None              # no team, nothing waits
    assert env.choose_wait_policy(4, "passive", busy=0.0)[0] == "PASSIVE"      # the documented switch
    assert env.choose_wait_policy(4, "auto", busy=None)[0] is None
    busy = env.busy_cores(0.05)
    assert busy is None or 0.0 <= busy <= env.cpu_count() + 0.01


def test_wait_policy_choice_is_recorded_and_the_user_wins(tmp_path):
    code = "import pipeline, json; from pipeline.core import env; print(json.dumps(env.tuning_record()))"
    base = {k: v for k, v in os.environ.items() if k not in (*env.TUNING_VARS, env.TUNED_MARK, env.LAUNCHER_MARK)}
    quiet = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                      env={**base, "OMP_NUM_THREADS": "2", "PIPELINE_OMP_WAIT": "active"},
                                      check=True).stdout)
    assert quiet["OMP_WAIT_POLICY"] == "ACTIVE" and quiet["set_by"]["OMP_WAIT_POLICY"] == "pipeline"
    assert "PIPELINE_OMP_WAIT=active" in quiet["why"]["OMP_WAIT_POLICY"]
    user = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                     env={**base, "OMP_WAIT_POLICY": "PASSIVE"}, check=True).stdout)
    assert user["OMP_WAIT_POLICY"] == "PASSIVE" and user["set_by"]["OMP_WAIT_POLICY"] == "user"


def test_a_process_that_trains_nothing_waits_passively(tmp_path):
    # deploy stages and imports: PASSIVE without a probe (spinning OpenMP threads take the cores of the other
    # runtimes and of Lite children); the documented switch and the user's own OMP_WAIT_POLICY still win
    from pipeline.cli import _trains

    code = ("import pipeline, json; from pipeline.core import env; env.settle_wait_policy(trains=False); "
            "print(json.dumps(env.tuning_record()))")
    base = {k: v for k, v in os.environ.items() if k not in (*env.TUNING_VARS, env.TUNED_MARK, env.LAUNCHER_MARK)}

    def record(**extra):
        return json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                         env={**base, "OMP_NUM_THREADS": "2", **extra}, check=True).stdout)
    deploy = record()
    assert deploy["OMP_WAIT_POLICY"] == "PASSIVE" and "no training" in deploy["why"]["OMP_WAIT_POLICY"]
    assert record(PIPELINE_OMP_WAIT="active")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert record(OMP_WAIT_POLICY="ACTIVE")["set_by"]["OMP_WAIT_POLICY"] == "user"
    assert _trains(tiny_cfg(), ["train", "export"]) and not _trains(tiny_cfg(), ["export", "server"])
    imported = SimpleNamespace(model=SimpleNamespace(source="inference"))
    assert not _trains(imported, ["train", "export"])       # an import's train stage only loads and checks
    ranks = SimpleNamespace(needs_launch=True)               # `run all` with nproc 2: the ranks train, not this process
    assert not _trains(tiny_cfg(), ["train", "export"], ranks)
    assert _trains(tiny_cfg(), ["train", "export"], SimpleNamespace(needs_launch=False))


def test_lr_scaling_is_explicit():
    from pipeline.training.loop import effective_lr

    assert effective_lr(tiny_cfg().train)[0] == pytest.approx(0.003)
    lr, how = effective_lr(tiny_cfg("train.lr_scaling=linear", "train.lr_base_batch=16").train)
    assert lr == pytest.approx(0.006) and "linear" in how
    assert effective_lr(tiny_cfg("train.lr_scaling=sqrt", "train.lr_base_batch=8").train)[0] == pytest.approx(0.006)


def test_bad_layout_is_one_line_before_any_process(tmp_path):
    line = one_error_line(cli("run", "train", root=tmp_path, over=["train.nproc=3"]))
    assert "train.batch_size 32" in line and "3 processes" in line
    assert not (tmp_path / "r" / "log").exists()
    line = one_error_line(cli("run", "train", "--nnodes", "2", root=tmp_path, over=["train.nproc=1"]))
    assert "MASTER" in line


# ---------------------------------------------------------------- processes

@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    """NPROC=2 on one node: the reference for the two-node run."""
    root = tmp_path_factory.mktemp("np2")
    res = cli("run", "train", root=root, over=["train.nproc=2"])
    assert res.returncode == 0, res.stderr[-4000:]
    return root / "r", res


@pytest.mark.slow
def test_two_processes_make_one_set_of_artifacts(two_procs):
    run, res = two_procs
    man = load_manifest(run / "train")
    verify_outputs(run / "train", man)
    assert man["status"] == "OK" and man["info"]["nproc"] == 2
    assert man["info"]["global_batch"] == 32 and man["info"]["per_process_batch"] == 16      # global, split
    assert man["info"]["layout"]["nproc"] == 2 and man["layout_key"] == {"nproc": 2, "nnodes": 1, "threads": 1}
    assert man["info"]["lr"]["effective_peak"] == pytest.approx(0.003)
    assert man["cpu_tuning"]["OMP_NUM_THREADS"] == "1" and man["cpu_tuning"]["set_by"]["OMP_NUM_THREADS"] != "user"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["config.resolved.yaml", "log", "train"]
    assert not [p for p in run.iterdir() if p.name.startswith((".tmp", ".old"))]
    assert {p.name for p in (run / "log").glob("workerlog.*")} == {"workerlog.0", "workerlog.1"}
    assert {json.loads(p.read_text())["status"] for p in (run / "log").glob("status.*.json")} == {"OK"}
    assert [json.loads(l)["nproc"] for l in (run / "train" / "metrics.jsonl").read_text().splitlines()] == [2, 2]
    assert "2 processes × 1 thread" in res.stderr and "train layout: 2 processes × 1 thread" in res.stdout


@pytest.mark.slow
def test_same_layout_is_up_to_date_another_is_not_and_export_takes_either(two_procs):
    run, _ = two_procs
    res = cli("run", "train", root=run.parent, over=["train.nproc=2"])        # same layout: skipped, no launch
    assert res.returncode == 0 and "up to date" in res.stderr and "launching" not in res.stderr, res.stderr[-2000:]
    from pipeline.core.process_layout import plan
    from pipeline.core.runner import Runner, fingerprint, registry

    cfg = tiny_cfg(f"run.root={run.parent}", "run.name=r", "train.nproc=1")   # another layout asked for...
    assert fingerprint(cfg, registry()["train"], {}, plan(cfg).key()) != load_manifest(run / "train")["fingerprint"]
    runner = Runner(cfg)
    assert runner._expected_fingerprint(registry()["train"]) == load_manifest(run / "train")["fingerprint"]
    dirs, _ = runner._inputs(registry()["export"])                              # ...export still takes it
    assert dirs["train"] == run / "train"


@pytest.mark.slow
def test_any_layout_auto_picked_satisfies_auto(two_procs, tmp_path, monkeypatch):
    """An output auto made stays up to date for auto when auto would now pick another layout (other cores
    available, threads set differently): same config, code and inputs, results equal within noise."""
    import shutil

    from pipeline.core import process_layout as layout_mod
    from pipeline.core.artifacts import write_json
    from pipeline.core.runner import Runner

    run = tmp_path / "r"
    shutil.copytree(two_procs[0], run)
    man = load_manifest(run / "train")
    man["info"]["layout"]["reason"] = "train.nproc=auto: (recorded by a quiet machine)"
    write_json(run / "train" / "manifest.json", man)
    other = layout_mod.Layout(nproc=1, threads=2, reason="train.nproc=auto: one CPU core")
    monkeypatch.setattr(layout_mod, "plan", lambda cfg, **kw: other)
    (outcome,) = Runner(tiny_cfg(f"run.root={tmp_path}", "run.name=r", "train.nproc=auto")).run(["train"])
    assert outcome.status == "CACHED"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_match_two_processes_on_one(two_procs, tmp_path):
    run2, _ = two_procs
    master = f"127.0.0.1:{_free_port()}"
    nodes = [cli("run", "train", "--nnodes", "2", "--master", master, "--node-rank", str(i), root=tmp_path,
                 over=["train.nproc=1", "run.threads=1"], wait=False, env_extra={"POD_IP": "127.0.0.1"})
             for i in (0, 1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-4000:]
    assert "rank 0 on node 0 writes the outputs" in outs[1][1] and "1 process × 1 thread × 2 nodes" in outs[0][1]
    run = tmp_path / "r"
    man, ref = load_manifest(run / "train"), load_manifest(run2 / "train")
    assert man["layout_key"] == {"nproc": 1, "nnodes": 2, "threads": 1} and man["info"]["global_batch"] == 32
    assert {p.name for p in (run / "log").iterdir()} >= {"node0", "node1"}
    a, b = params(run), params(run2)
    assert a.keys() == b.keys()
    for k in a:        # same ranks, same shards, same all-reduce: equal up to float reduction order
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert abs(man["metrics"]["accuracy"] - ref["metrics"]["accuracy"]) <= 1 / 64 + 1e-9


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_run_and_keeps_the_checkpoint(tmp_path):
    run = tmp_path / "r"
    ckpt = run / ".work" / "train" / "checkpoint"
    proc = cli("run", "train", root=tmp_path, over=["train.nproc=2", "train.epochs=40"], wait=False)
    deadline = time.time() + 240
    meta = None
    while proc.poll() is None and time.time() < deadline:     # readiness: epoch 1's checkpoint is committed
        meta = checkpoint.read_meta(ckpt)
        if meta is not None:
            break
        time.sleep(0.05)
    assert meta is not None, "no checkpoint appeared"
    victim = json.loads((run / "log" / "status.1.json").read_text())
    assert victim["status"] == "RUNNING"
    os.kill(victim["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    errors = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "rank 1 died" in errors[0] and str(run / "log" / "workerlog.1") in errors[0], errors[0]
    assert "checkpoint" in errors[0]
    after = checkpoint.read_meta(ckpt)
    assert after is not None and after["epoch"] >= meta["epoch"] and after["epoch"] < 39
    states, _ = checkpoint.load(ckpt, after["key"])                 # complete and loadable (hashes checked)
    assert "model" in states and load_manifest(run / "train") is None


@pytest.mark.parametrize("logs, blamed", [
    # rank 1 SIGKILLed; the launcher's SIGTERM reached rank 0 before it noticed the lost peer (CI, 2026-12-02)
    (["step 7\n[SignalInfo: *** SIGTERM (@0x1c87) received by PID 7312 (TID 0x7f8) from PID 7303 ***]", "step 7"], 1),
    (["gloo::IoException: Connection reset by peer", "step 7"], 1),          # rank 0 lost its peer: a victim
    (["step 7", "step 7"], 0),                                               # no record either way: the lowest
    # both stopped by a SIGTERM (e.g. someone stopped the launcher): the one that only lost a peer is not blamed
    (["*** SIGTERM\ngloo::IoException", "*** SIGTERM"], 1),
])
def test_diagnose_blames_the_rank_that_died_not_the_ones_stopped_or_cut_off(tmp_path, logs, blamed):
    from pipeline.training.distributed import diagnose

    for i, text in enumerate(logs):
        (tmp_path / f"workerlog.{i}").write_text(text + "\n")
    layout = SimpleNamespace(node_rank=0, nproc=2, nnodes=1)
    msg, hint = diagnose(tmp_path, layout, {0: {"status": "RUNNING"}, 1: {"status": "RUNNING"}}, 241)
    assert f"rank {blamed} " in msg and f"workerlog.{blamed}" in msg, msg
    assert "checkpoint" in hint
