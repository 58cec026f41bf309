"""bf16 AMP on a CPU (pipeline/training/static_bf16.py, bf16_route.py): the plan on every CPU, the fp32 list from
Paddle's registered kernels, and, where oneDNN has bf16 kernels, a program that really runs them, skips non-finite
steps, resumes bit-identically after kill -9 and exports from fp32 master weights. Tiny models throughout."""
from __future__ import annotations

import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from child_kill import kill_at_marker
from pipeline.core import capabilities
from pipeline.core.artifacts import load_manifest
from pipeline.training import checkpoint

ROOT = Path(__file__).resolve().parent.parent
BF16 = ["train.amp.enable=true", "train.amp.dtype=bfloat16"]
TINY = ["-c", "configs/smoke.yaml", "-o", "data.num_train=480", "-o", "data.num_val=64", "-o", "train.epochs=3",
        "-o", "train.batch_size=32", "-o", "model.args={channels: [4, 8, 8], hidden: 16}", "-o", "train.nproc=1",
        "-o", "train.min_metric=0.0", "-o", "run.quiet=true", *[x for o in BF16 for x in ("-o", o)],
        "-o", "train.amp.bf16_min_mac_share=0"]     # the tiny CNN's Linear layers in bf16, its convs and BN fp32


def _bf16_runs() -> tuple[bool, str]:
    ok, why = capabilities.bf16_cpu_status()
    if ok and capabilities.simulated(capabilities.BF16_FLAGS):
        return False, "a simulated bf16 profile: oneDNN has no bf16 kernels on the real CPU"
    return ok, why


needs_bf16 = pytest.mark.skipif(not _bf16_runs()[0], reason=f"no bf16 training here: {_bf16_runs()[1]}")


def _amp(**kw):
    base = dict(enable=True, level="O1", dtype="bfloat16")
    return types.SimpleNamespace(**{**base, **kw})


# ---------------------------------------------------------------- the plan, on any CPU

def test_fp16_on_cpu_is_refused_with_its_reason():
    from pipeline.training import amp

    plan = amp.plan(_amp(dtype="float16"), "cpu", {})
    assert plan.effective == "float32" and not plan.enabled and plan.route == "dygraph"
    assert "no fp16 conv/matmul CPU kernels" in plan.reason and "bfloat16" in plan.reason


def test_bf16_capped_below_bf16_trains_fp32_in_one_line(monkeypatch):
    from pipeline.training import amp

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    plan = amp.plan(_amp(), "cpu", {})
    assert plan.effective == "float32" and plan.route == "dygraph"
    assert "\n" not in plan.reason and "training in float32" in plan.reason
    if capabilities.has_bf16():
        assert "ONEDNN_MAX_CPU_ISA=AVX2" in plan.reason


def test_bf16_on_a_cpu_without_bf16_trains_fp32(monkeypatch):
    from pipeline.training import amp

    monkeypatch.setenv(capabilities.PROFILE_ENV, "avx2")
    plan = amp.plan(_amp(), "cpu", {})
    assert plan.effective == "float32" and "lacks avx512_bf16/amx_bf16" in plan.reason


@needs_bf16
def test_bf16_on_a_bf16_cpu_takes_the_static_route_o2_included():
    from pipeline.training import amp

    plan = amp.plan(_amp(level="O2"), "cpu", {})
    assert plan.route == "static-bf16" and plan.effective == "bfloat16/O1" and not plan.enabled
    assert "O2 (pure bf16) cannot run" in plan.reason


def test_nproc_auto_trains_cpu_bf16_in_one_process(monkeypatch):
    from pipeline.core import process_layout
    from pipeline.core.config import load_config

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(capabilities.PROFILE_ENV, "bf16")
    monkeypatch.setattr(process_layout.env, "cpu_count", lambda: 2)
    cfg = load_config([ROOT / "configs" / "chars.yaml"], ["train.device=cpu", "train.batch_size=128", *BF16])
    layout = process_layout.plan(cfg)
    assert layout.nproc == 1 and "bf16" in layout.reason
    fp32 = process_layout.plan(load_config([ROOT / "configs" / "chars.yaml"],
                                           ["train.device=cpu", "train.batch_size=128", "train.amp.enable=false"]))
    assert fp32.nproc == 2


def test_fp32_list_comes_from_the_registered_kernels():
    from pipeline.training.static_bf16 import BROKEN, bf16_kernel_types, fp32_types

    have = bf16_kernel_types()
    assert {"mul", "mul_grad", "matmul_v2"} <= have and "adam" not in have and "layer_norm_grad" not in have
    why = fp32_types(["mul", "layer_norm", "softmax_with_cross_entropy", "conv2d", "elementwise_add", "cast"],
                     user_fp32={"elementwise_add"})
    assert "mul" not in why and "cast" not in why
    assert why["layer_norm"] == "no bf16 kernel for layer_norm_grad"
    assert why["softmax_with_cross_entropy"] == "no bf16 kernel registered"
    assert why["conv2d"] == BROKEN["conv2d"] and why["elementwise_add"] == "train.amp.custom_black_list"
    assert "elementwise_add" not in fp32_types(["elementwise_add"], user_bf16={"elementwise_add"})


# ---------------------------------------------------------------- the program, where bf16 kernels run

def _tiny_trainer(batch: int = 16):
    import paddle
    from paddle import nn

    from pipeline.tasks import get_task
    from pipeline.training.static_bf16 import StaticBf16Trainer

    def build():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 4))

    paddle.seed(3)
    model = build()
    trainer = StaticBf16Trainer(build, get_task("classification"),
                                lambda layer: (paddle.optimizer.Adam(1e-2, parameters=layer.parameters()), None),
                                batch, [1, 8, 8], [], "int64")
    trainer.load_weights(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 1, 8, 8)).astype("float32")
    y = (x[:, 0, 0, :4].sum(1) > 0).astype("int64") + 2 * (x[:, 0, 1, :4].sum(1) > 0)
    return trainer, model, x, y


@needs_bf16
def test_static_program_runs_bf16_kernels_and_learns():
    trainer, model, x, y = _tiny_trainer()
    c = trainer.census
    assert c["bf16_by_type"].get("mul") == 2 and c["bf16_by_type"].get("mul_grad") == 2
    assert trainer.rewritten["linear_to_mul"] == 2 and trainer.onednn_casts > 0 and c["bf16_mac_share"] == 1.0
    out, ran = trainer.forward_bf16(x, y)
    assert ran["forward_ops_marked_bf16"] == 2 and ran["forward_outputs_bf16_at_run_time"] == 2
    import paddle

    model.eval()
    ref = model(paddle.to_tensor(x)).numpy()
    assert 0 < np.abs(out - ref).max() < 0.1           # bf16 rounding: close, not equal
    losses = [trainer.step(x, y) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    trainer.store_weights(model)
    assert all(p.dtype == paddle.float32 for p in model.parameters())     # fp32 master weights


@needs_bf16
def test_nonfinite_step_changes_nothing():
    trainer, model, x, y = _tiny_trainer()
    trainer.step(x, y)
    before = {n: np.array(trainer._tensor(v)) for n, v in trainer.names.items()}
    opt_before = trainer.state_dict()
    assert not np.isfinite(trainer.step(x, y, loss_factor=float("nan")))
    for n, v in trainer.names.items():
        assert np.array_equal(before[n], np.array(trainer._tensor(v))), n
    after = trainer.state_dict()
    for k, v in opt_before.items():
        assert np.array_equal(v, after[k]), k


@needs_bf16
def test_warm_up_on_a_small_batch_changes_nothing():
    a, _, x, y = _tiny_trainer()
    b, _, _, _ = _tiny_trainer()
    b.warm_up(x, y)
    weights = lambda t: {k: np.array(t._tensor(v)) for k, v in t.names.items()}
    for before, after in ((weights(a), weights(b)), (a.state_dict(), b.state_dict())):
        assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    assert [a.step(x, y) for _ in range(3)] == [b.step(x, y) for _ in range(3)]
    wa, wb = weights(a), weights(b)
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


@needs_bf16
def test_a_model_that_bakes_its_batch_skips_the_warm_up_and_trains_as_without(caplog):
    import paddle
    from paddle import nn

    from pipeline.tasks import get_task
    from pipeline.training.static_bf16 import StaticBf16Trainer

    class Baked(nn.Layer):      # reshape to a fixed batch: 2 samples cannot run it
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 4)

        def forward(self, x):
            return self.fc(paddle.reshape(x, [16, 64]))

    def trainer():
        paddle.seed(3)
        t = StaticBf16Trainer(Baked, get_task("classification"),
                              lambda layer: (paddle.optimizer.Adam(1e-2, parameters=layer.parameters()), None),
                              16, [1, 8, 8], [], "int64")
        t.load_weights(Baked())
        return t

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 1, 8, 8)).astype("float32"), rng.integers(0, 4, 16).astype("int64")
    a, b = trainer(), trainer()
    with caplog.at_level("DEBUG", logger="pipeline"):
        b.warm_up(x, y)
    assert "warm-up on 2 samples failed" in caplog.text
    assert [a.step(x, y) for _ in range(3)] == [b.step(x, y) for _ in range(3)]


# the first step's peak of live tensors (Paddle's CPU allocator), with and without the warm-up, in a fresh process
FIRST_STEP_PEAK = """
import sys
import numpy as np
import paddle
from paddle import nn
from paddle.base import core
from pipeline.tasks import get_task
from pipeline.training.static_bf16 import StaticBf16Trainer
build = lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 256), *[m for _ in range(6) for m in (nn.GELU(),
                              nn.Linear(256, 256))], nn.Linear(256, 4))
t = StaticBf16Trainer(build, get_task("classification"),
                      lambda layer: (paddle.optimizer.Adam(1e-2, parameters=layer.parameters()), None), 1024, [1, 8, 8],
                      [], "int64")
x, y = np.random.default_rng(0).standard_normal((1024, 1, 8, 8)).astype("float32"), np.zeros(1024, "int64")
if sys.argv[1] == "warm":
    t.warm_up(x, y)
t.step(x, y)
print(core.host_memory_stat_peak_value("Allocated", 0))
"""


@needs_bf16
def test_warm_up_keeps_the_first_step_at_the_steady_peak():
    peak = {}
    for mode in ("cold", "warm"):
        res = subprocess.run([sys.executable, "-c", FIRST_STEP_PEAK, mode], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        peak[mode] = int(res.stdout.split()[-1])
    assert peak["warm"] < 0.7 * peak["cold"], peak     # measured 16.4 vs 33.4 MB


def _cli(*args, root: Path, wait: bool = True):
    cmd = [sys.executable, "-m", "pipeline", *args, *TINY, "-o", f"run.root={root}", "-o", "run.name=r"]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _params(run_dir: Path) -> dict:
    import paddle

    return {k: np.asarray(v) for k, v in paddle.load(str(run_dir / "train" / "model.pdparams"),
                                                     return_numpy=True).items()}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-a")
    res = _cli("run", "train", "export", root=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "r"


@needs_bf16
def test_manifest_records_the_executed_bf16_program(bf16_run):
    man = load_manifest(bf16_run / "train")
    prec = man["precision"]
    assert prec["effective"] == "bfloat16/O1" and prec["route"] == "static-bf16"
    ev = prec["evidence"]
    assert ev["program"]["bf16_ops"] > 0 and ev["program"]["bf16_by_type"]["mul"] >= 1
    assert ev["fp32_types"]["conv2d"] and ev["fp32_types"]["batch_norm"] == "no bf16 kernel registered"
    assert ev["precheck"]["forward_outputs_bf16_at_run_time"] == ev["precheck"]["forward_ops_marked_bf16"] > 0
    assert ev["cpu_bf16_family"] in ("avx512_bf16", "amx_bf16")
    state = _params(bf16_run)
    assert all(v.dtype == np.float32 for v in state.values())
    assert any("_mean" in k and np.abs(v).max() > 0 for k, v in state.items())     # BatchNorm statistics moved
    export = load_manifest(bf16_run / "export")
    assert export is not None and all(g["status"] == "OK" for g in export["gates"])


# The child holds still (and says so) in the first bf16 step after the epoch-1 checkpoint is on disk: the kill
# lands mid-epoch 2 however busy the machine.
HOLD = """
import sys, time
from pipeline.core import console
from pipeline.training import checkpoint
from pipeline.training.static_bf16 import StaticBf16Trainer
ckpt, real = sys.argv.pop(1), StaticBf16Trainer.step
def step(self, *a, **k):
    meta = checkpoint.read_meta(ckpt)
    if meta is not None and meta["epoch"] == 0:
        print("HOLDING: epoch 1 checkpoint is on disk", file=console.stream(), flush=True)
        time.sleep(600)
    return real(self, *a, **k)
StaticBf16Trainer.step = step
from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


@needs_bf16
@pytest.mark.slow
def test_kill_9_during_bf16_then_resume_equals_uninterrupted(bf16_run, tmp_path):
    ckpt = tmp_path / "r" / ".work" / "train" / "checkpoint"
    cmd = [sys.executable, "-c", HOLD, str(ckpt), "run", "train", *TINY, "-o", f"run.root={tmp_path}",
           "-o", "run.name=r"]
    held, returncode = kill_at_marker(cmd, cwd=ROOT)
    assert held and returncode == -signal.SIGKILL
    res = _cli("run", "train", root=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming after epoch" in res.stderr
    a, b = _params(bf16_run), _params(tmp_path / "r")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (bf16_run / "train" / "model.pdparams").read_bytes() == (tmp_path / "r" / "train" / "model.pdparams").read_bytes()


@needs_bf16
def test_nan_guard_stops_a_bf16_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    from pipeline.core.config import load_config
    from pipeline.core.errors import NonFiniteError
    from pipeline.core.runner import Runner
    from pipeline.training.static_bf16 import StaticBf16Trainer

    calls, real = {"n": 0}, StaticBf16Trainer.step

    def poisoned(self, x, y, loss_factor=1.0):      # epochs 1-2 fine (15 steps each), NaN from epoch 3 on
        calls["n"] += 1
        return real(self, x, y, float("nan") if calls["n"] > 30 else loss_factor)

    monkeypatch.setattr(StaticBf16Trainer, "step", poisoned)
    over = [TINY[i + 1] for i in range(2, len(TINY), 2)]
    cfg = load_config([ROOT / "configs" / "smoke.yaml"], [*over, f"run.root={tmp_path}", "run.name=r",
                                                          "train.max_nonfinite_steps=3"])
    (outcome,) = Runner(cfg).run(["train"])
    assert outcome.status == "ERROR" and isinstance(outcome.error, NonFiniteError)
    assert "last good checkpoint (epoch 2) is kept" in outcome.error.one_line()
    ckpt = cfg.run_dir / ".work" / "train" / "checkpoint"
    states, meta = checkpoint.load(ckpt, checkpoint.read_meta(ckpt)["key"])
    assert meta["epoch"] == 1 and all(np.isfinite(np.asarray(v)).all() for v in states["model"].values())


@needs_bf16
def test_data_parallel_bf16_is_refused_in_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "train", *TINY, "-o", "train.nproc=2",
                          "-o", f"run.root={tmp_path}", "-o", "run.name=r"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode != 0
    assert "trains in one process" in res.stdout + res.stderr and "Traceback" not in res.stdout + res.stderr


@needs_bf16
def test_a_conv_model_with_little_bf16_work_trains_fp32_and_says_why(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "train", *TINY, "-o", "train.epochs=1",
                          "-o", "train.amp.bf16_min_mac_share=0.5", "-o", f"run.root={tmp_path}", "-o", "run.name=r"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    prec = load_manifest(tmp_path / "r" / "train")["precision"]
    assert prec["effective"] == "float32" and "multiply-adds could run bf16" in prec["reason"]
    assert "bf16_min_mac_share" in prec["reason"] and "\n" not in prec["reason"]


def test_amp_bench_separates_the_executor_gain_from_the_bf16_gain():
    import importlib

    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        bench = importlib.import_module("amp_bench")
    finally:
        sys.path.remove(scripts)
    row = lambda mode, sps, rss, metric: {"model": "vit", "mode": mode, "samples_per_s": sps, "peak_rss_mb": rss,
                                          "metric": metric}
    rows = [row("fp32", 10.0, 1000, 0.50), row("bf16", 15.0, 1500, 0.49), row("static-fp32", 16.0, 1400, 0.50),
            row("fp32", 5.0, 100, 0.1) | {"model": "cnn"}, row("bf16", 5.0, 100, 0.1) | {"model": "cnn"}]
    lines = bench.split_gains(rows)
    assert len(lines) == 1 and lines[0].startswith("vit: bf16 vs static fp32")   # no static-fp32 row: no split
    assert "0.94x samples/s" in lines[0] and "1.07x peak RSS" in lines[0] and "metric -0.0100" in lines[0]
    assert "static fp32 vs fp32 (the executor's effect) 1.60x" in lines[0]
    assert rows[1]["vs_static_fp32"] == {"samples_per_s": 0.938, "peak_rss": 1.071, "metric_delta": -0.01}


def test_amp_paired_judges_the_tolerance_on_paired_differences():
    import importlib

    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        paired = importlib.import_module("amp_paired").paired
    finally:
        sys.path.remove(scripts)
    # fp32 moves 10 points from seed to seed, bf16 follows each seed within 0.1: resolved inside ±0.5
    close = paired([0.50, 0.60, 0.55, 0.45], [0.501, 0.599, 0.551, 0.450], tol=0.5)
    assert close["diffs"] == [0.1, -0.1, 0.1, 0.0] and close["n"] == 4 and "within" in close["verdict"]
    assert -0.5 <= close["ci95"][0] < close["mean"] < close["ci95"][1] <= 0.5
    far = paired([0.50, 0.60, 0.55], [0.47, 0.57, 0.52], tol=0.5)
    assert far["mean"] == -3.0 and "outside" in far["verdict"]
    noisy = paired([0.50, 0.60, 0.55], [0.53, 0.57, 0.55], tol=0.5)
    assert "not resolved at 3 seeds" in noisy["verdict"] and "not shown to be no worse" in noisy["non_inferiority"]
    better = paired([0.50, 0.60, 0.55], [0.52, 0.61, 0.58], tol=0.5)     # +2, +1, +3: higher, not "within"
    assert "within" not in better["verdict"] and better["higher_in"] == 3
    assert better["lower95_one_sided"] > -0.5 and "bf16 no worse than fp32 - 0.5" in better["non_inferiority"]
