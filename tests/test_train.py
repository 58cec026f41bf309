"""The train stage in depth: determinism, kill -9 and resume, NaN guard, honest precision, the scaler's
skipped steps, atomic checkpoints, bad input (multi-process runs: test_distributed.py). Tiny configs throughout."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from child_kill import kill_at_marker
from pipeline.core import capabilities as caps
from pipeline.training import checkpoint
from pipeline.core.artifacts import load_manifest, verify_outputs
from pipeline.core.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ["-c", "configs/smoke.yaml", "-o", "data.num_train=480", "-o", "data.num_val=64", "-o", "train.epochs=3",
        "-o", "train.batch_size=32", "-o", "model.args={channels: [4, 8, 8], hidden: 16}",
        "-o", "train.min_metric=0.0", "-o", "run.quiet=true"]


def cli(*args, root: Path, over: tuple = (), wait: bool = True, timeout: int = 300):
    """`python -m pipeline <args>` on the tiny config; `over` overrides come last (last one wins)."""
    cmd = [sys.executable, "-m", "pipeline", *args, *TINY, "-o", f"run.root={root}", "-o", "run.name=r",
           *[x for o in over for x in ("-o", o)]]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def params(run_dir: Path) -> dict:
    import paddle

    return {k: np.asarray(v) for k, v in paddle.load(str(run_dir / "train" / "model.pdparams"),
                                                     return_numpy=True).items()}


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One uninterrupted run (separate process): the reference for determinism and resume."""
    root = tmp_path_factory.mktemp("train-a")
    res = cli("run", "train", root=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "r"


# ---------------------------------------------------------------- determinism, precision, telemetry

def test_same_seed_is_bit_identical_across_processes(baseline, tmp_path):
    res = cli("run", "train", root=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_identical(params(baseline), params(tmp_path / "r"))
    assert (baseline / "train" / "model.pdparams").read_bytes() == (tmp_path / "r" / "train" / "model.pdparams").read_bytes()


def _expected_train_precision() -> str:
    """fp16 AMP runs only on a GPU with fp16 (compute capability >= 7); CPUs have no fp16 kernels."""
    gpu = caps.gpu()
    return "float16/O1" if gpu["gpu"] and gpu["fp16"] else "float32"


def test_requested_and_effective_precision_are_recorded(baseline):
    man = load_manifest(baseline / "train")
    effective = _expected_train_precision()
    assert man["precision"]["requested"] == "float16/O1"          # defaults: amp.enable, float16, O1
    assert man["precision"]["effective"] == effective
    gate = man["gates"][0]
    assert (gate["precision_requested"], gate["precision_effective"]) == ("float16/O1", effective)
    if effective == "float32":
        assert ("CPU" if not caps.gpu()["gpu"] else "float32") in man["precision"]["reason"]
        assert gate["reason"]                                    # the summary prints it as a note


def test_metrics_jsonl_has_every_field_per_epoch(baseline):
    lines = (baseline / "train" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines, 1):
        rec = json.loads(line)
        assert rec["epoch"] == i and rec["precision"] == _expected_train_precision()
        assert (rec["loss_scale"] is None) == (rec["precision"] == "float32")
        for k in ("loss", "accuracy", "lr", "skipped_steps", "scaler_skipped_steps", "nonfinite_loss_steps",
                  "samples_per_s", "peak_memory_mb", "seconds"):
            assert isinstance(rec[k], (int, float)), k
        assert rec["samples_per_s"] > 0 and rec["peak_memory_mb"] > 0


# ---------------------------------------------------------------- kill -9 and resume

# The child trains as `python -m pipeline` would, except that its loss function holds still (and says so
# on stderr) at the first step after the epoch-1 checkpoint is on disk: the kill lands mid-epoch 2 every
# time, however busy the machine, instead of racing a timed poll against a fast epoch.
HOLD_AFTER_CHECKPOINT = """
import sys, time
from pipeline.core import console
from pipeline.training import checkpoint
from pipeline.tasks.classification import ClassificationTask
ckpt, real = sys.argv.pop(1), ClassificationTask.loss
def loss(self, logits, labels):
    meta = checkpoint.read_meta(ckpt)
    if meta is not None and meta["epoch"] == 0:
        print("HOLDING: epoch 1 checkpoint is on disk", file=console.stream(), flush=True)   # not the native log
        time.sleep(600)
    return real(self, logits, labels)
ClassificationTask.loss = loss
from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted(baseline, tmp_path):
    ckpt = tmp_path / "r" / ".work" / "train" / "checkpoint"
    cmd = [sys.executable, "-c", HOLD_AFTER_CHECKPOINT, str(ckpt), "run", "train", *TINY,
           "-o", f"run.root={tmp_path}", "-o", "run.name=r"]
    held, returncode = kill_at_marker(cmd, cwd=ROOT)
    assert held, "the child ended without reaching epoch 2"
    assert returncode == -signal.SIGKILL
    assert checkpoint.read_meta(ckpt)["epoch"] < 2 and load_manifest(tmp_path / "r" / "train") is None

    res = cli("run", "train", root=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming after epoch" in res.stderr
    man = load_manifest(tmp_path / "r" / "train")
    assert man["info"]["resumed_after_epoch"] in (1, 2)
    assert_identical(params(baseline), params(tmp_path / "r"))
    # the file itself, not only the weights: downstream fingerprints hash it
    assert (baseline / "train" / "model.pdparams").read_bytes() == (tmp_path / "r" / "train" / "model.pdparams").read_bytes()


def test_checkpoint_is_atomic_as_a_whole(tmp_path, monkeypatch):
    """A kill between two part files must leave the previous checkpoint whole, never a mix."""
    import paddle

    folder = tmp_path / "ckpt"
    good = {"model": {"w": paddle.to_tensor([1.0, 2.0])}, "optimizer": {"m": paddle.to_tensor([0.5])}}
    checkpoint.save(folder, "k", {**good, "best": checkpoint.SameAs("model")}, {"epoch": 0, "history": []})

    real = checkpoint.atomic_write_bytes
    calls = []

    def dies_on_second_part(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between files")
        real(path, data)

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", dies_on_second_part)
    newer = {"model": {"w": paddle.to_tensor([9.0, 9.0])}, "optimizer": {"m": paddle.to_tensor([9.0])}}
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(folder, "k", newer, {"epoch": 1, "history": []})
    monkeypatch.setattr(checkpoint, "atomic_write_bytes", real)

    states, meta = checkpoint.load(folder, "k")
    assert meta["epoch"] == 0
    assert states["model"]["w"].numpy().tolist() == [1.0, 2.0] and states["optimizer"]["m"].numpy().tolist() == [0.5]
    assert states["best"] is states["model"]
    assert checkpoint.load(folder, "another-config") is None
    # a damaged part is refused (start over) rather than resumed from
    part = checkpoint.current(folder) / "model.pdparams"
    part.write_bytes(part.read_bytes()[:-3])
    assert checkpoint.load(folder, "k") is None
    # the next save cleans up leftovers and becomes current
    checkpoint.save(folder, "k", good, {"epoch": 2, "history": []})
    assert [p.name for p in folder.iterdir() if p.name != checkpoint.POINTER] == [checkpoint.current(folder).name]


# ---------------------------------------------------------------- in-process: NaN guard and scaler

def _tiny_cfg(root: Path, *extra: str):
    over = [o for i, o in enumerate(TINY) if TINY[i - 1] == "-o"] + [f"run.root={root}", "run.name=r", *extra]
    return load_config(["configs/smoke.yaml"], over)


def test_nan_guard_stops_with_hint_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    from pipeline.core.errors import NonFiniteError
    from pipeline.core.runner import Runner
    from pipeline.tasks.classification import ClassificationTask

    calls = {"n": 0}
    real_loss = ClassificationTask.loss

    def poisoned(self, logits, labels):        # epochs 1-2 fine (15 steps each), NaN from epoch 3 on
        calls["n"] += 1
        loss = real_loss(self, logits, labels)
        return loss * float("nan") if calls["n"] > 30 else loss

    monkeypatch.setattr(ClassificationTask, "loss", poisoned)
    cfg = _tiny_cfg(tmp_path, "train.max_nonfinite_steps=3")
    (outcome,) = Runner(cfg).run(["train"])
    assert outcome.status == "ERROR" and isinstance(outcome.error, NonFiniteError)
    line = outcome.error.one_line()
    assert "3 consecutive steps" in line and "custom_black_list" in line and "bfloat16" in line and "\n" not in line
    assert "last good checkpoint (epoch 2) is kept" in line
    assert load_manifest(cfg.run_dir / "train") is None                  # no half-made output
    ckpt = cfg.run_dir / ".work" / "train" / "checkpoint"
    meta = checkpoint.read_meta(ckpt)
    states, meta = checkpoint.load(ckpt, meta["key"])                    # intact: hashes verified
    assert meta["epoch"] == 1 and len(meta["history"]) == 2
    assert all(np.isfinite(np.asarray(v)).all() for v in states["model"].values())


def test_scaler_skipped_steps_are_counted_for_real(tmp_path, monkeypatch):
    """Paddle's GradScaler refuses CPU; build a real one as if on GPU (ops run on CPU), overflow the
    scaled gradients at 3 steps while the loss stays finite, and check the record and the scale."""
    import paddle.amp.grad_scaler as gs

    from pipeline.training import amp
    from pipeline.core.runner import Runner
    from pipeline.tasks.classification import ClassificationTask

    real_make = amp.make_scaler

    def make_scaler_as_on_gpu(amp_cfg, plan):
        real_tracer = gs._dygraph_tracer
        gpu = types.SimpleNamespace(is_gpu_place=lambda: True, is_xpu_place=lambda: False,
                                    is_custom_place=lambda: False)
        gs._dygraph_tracer = lambda: types.SimpleNamespace(_expected_place=gpu)
        try:
            return real_make(amp_cfg, plan)
        finally:
            gs._dygraph_tracer = real_tracer

    monkeypatch.setattr(amp, "make_scaler", make_scaler_as_on_gpu)
    monkeypatch.setattr(amp, "plan", lambda c, d, caps: amp.AmpPlan("float16/O1", "float16/O1", True, "O1", "float16"))
    calls = {"n": 0}
    real_loss = ClassificationTask.loss

    def overflowing(self, logits, labels):
        calls["n"] += 1
        loss = real_loss(self, logits, labels)
        # finite loss, but d(loss)/d(logits) x 2^15 overflows fp32: the scaler must skip the update
        return loss + 2e34 * logits.sum() if calls["n"] in (3, 4, 20) else loss

    monkeypatch.setattr(ClassificationTask, "loss", overflowing)
    cfg = _tiny_cfg(tmp_path, "train.epochs=2")
    (outcome,) = Runner(cfg).run(["train"])
    assert outcome.status == "OK", outcome.error
    recs = [json.loads(l) for l in (cfg.run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["scaler_skipped_steps"] for r in recs] == [2, 1] and [r["nonfinite_loss_steps"] for r in recs] == [0, 0]
    assert recs[0]["loss_scale"] == 32768.0 * 0.5           # decr_every_n_nan_or_inf=2 bad steps → x0.5
    assert outcome.manifest["metrics"]["scaler_skipped_steps"] == 3
    ckpt = checkpoint.read_meta(cfg.run_dir / ".work" / "train" / "checkpoint")
    assert "scaler" in ckpt["files"]


# ---------------------------------------------------------------- bad input: one line, no traceback, nothing lost

def _one_line_error(res, *needles):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-2000:]
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("override, needle", [
    ("train.lr=0", "train.lr"),
    ("train.lr=-0.1", "train.lr"),
    ("train.epochs=0", "train.epochs"),
    ("train.amp.level=O3", "train.amp.level"),
])
def test_bad_config_is_one_line(tmp_path, override, needle):
    _one_line_error(cli("run", "train", root=tmp_path, over=[override]), needle)


def test_launch_checks_the_config_before_starting_processes(tmp_path):
    res = cli("launch", "--nproc", "2", root=tmp_path, over=["train.amp.level=O3"])
    _one_line_error(res, "train.amp.level")
    assert not (tmp_path / "r" / "log").exists()


def test_batch_larger_than_data_keeps_earlier_output(baseline):
    before = load_manifest(baseline / "train")
    res = cli("run", "train", root=baseline.parent, over=["train.batch_size=1000"])
    _one_line_error(res, "train.batch_size", "480")
    assert load_manifest(baseline / "train") == before
    verify_outputs(baseline / "train", before)


def test_empty_or_missing_data_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (empty, tmp_path / "missing"):
        res = cli("run", "train", root=tmp_path, over=["data.source=folder", f"data.path={path}"])
        _one_line_error(res, str(path))


def test_label_out_of_range_names_the_model_size():
    import paddle

    from pipeline.core.errors import DataError
    from pipeline.training.checks import check_labels, output_classes

    model = paddle.nn.Sequential(paddle.nn.Flatten(), paddle.nn.Linear(4, 3))
    classes = output_classes(model, np.zeros((2, 1, 2, 2), np.float32))
    check_labels(classes, np.array([0, 2]), "training set")
    with pytest.raises(DataError, match="label 3 is out of range for a model with 3 outputs"):
        check_labels(classes, np.array([0, 3]), "training set")


def test_visualdl_missing_is_a_clear_config_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("visualdl") is not None:
        pytest.skip("visualdl is installed here")
    _one_line_error(cli("run", "train", root=tmp_path, over=["train.visualdl=true"]), "train.visualdl", "visualdl")


def test_visualdl_logging_when_enabled(tmp_path, monkeypatch):
    """VisualDL is optional (not in requirements): a stand-in module records what the trainer logs."""
    from pipeline.core.runner import Runner

    fake = tmp_path / "fakevdl" / "visualdl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import json, pathlib\n"
        "class LogWriter:\n"
        "    def __init__(self, logdir):\n"
        "        self.path = pathlib.Path(logdir) / 'scalars.jsonl'\n"
        "        self.path.parent.mkdir(parents=True, exist_ok=True)\n"
        "    def add_scalar(self, tag, value, step):\n"
        "        with open(self.path, 'a') as f:\n"
        "            f.write(json.dumps([tag, value, step]) + '\\n')\n"
        "    def close(self):\n"
        "        pass\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    monkeypatch.delitem(sys.modules, "visualdl", raising=False)
    cfg = _tiny_cfg(tmp_path, "train.visualdl=true", "train.epochs=2")
    (outcome,) = Runner(cfg).run(["train"])
    assert outcome.status == "OK", outcome.error
    rows = [json.loads(l) for l in (cfg.run_dir / ".work" / "train" / "visualdl" / "scalars.jsonl").read_text().splitlines()]
    assert {(t, s) for t, _, s in rows} >= {("train/loss", 1), ("train/accuracy", 2), ("train/samples_per_s", 2)}


def test_best_epoch_is_kept_not_the_last(tmp_path, monkeypatch):
    import paddle

    from pipeline.core.runner import Runner
    from pipeline.tasks.classification import ClassificationTask

    scores = iter([0.9, 0.5, 0.5])        # epoch 1 is the best; later calls (final evaluation) reuse the last

    def metrics(self, outputs, labels):
        return {"accuracy": next(scores, 0.5)}

    monkeypatch.setattr(ClassificationTask, "metrics", metrics)
    cfg = _tiny_cfg(tmp_path)
    (outcome,) = Runner(cfg).run(["train"])
    assert outcome.status == "OK", outcome.error
    assert outcome.manifest["metrics"]["best_epoch"] == 1
    states, meta = checkpoint.load(cfg.run_dir / ".work" / "train" / "checkpoint",
                                   checkpoint.read_meta(cfg.run_dir / ".work" / "train" / "checkpoint")["key"])
    assert meta["files"]["best"]["file"] == "best.pdparams"          # stored apart from the last epoch's model
    out = paddle.load(str(cfg.run_dir / "train" / "model.pdparams"), return_numpy=True)
    as_np = lambda sd: {k: np.asarray(v) for k, v in sd.items()}
    assert_identical(out, as_np(states["best"]))
    assert not all(np.array_equal(out[k], np.asarray(states["model"][k])) for k in out)
