"""Paddle Lite engine: program repair, conversion, running, crash isolation, FP16 detection.

Tiny models are built once per module (dygraph -> jit.save, plus one PaddleSlim PTQ model).
Every Lite call runs in a child process, so a Lite abort must surface as EngineCrash here.
"""
import zlib

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # allow bare `pytest` without an installed package
    sys.path.insert(0, str(ROOT))

import paddle

from pipeline.core.capabilities import host_arch
from pipeline.engines import lite, program_repair
from pipeline.core.errors import DataError, EngineCrash, MissingArtifact

SHAPE = [-1, 1, 32, 32]


class _CNN(paddle.nn.Layer):
    """conv/bn/act/pool/flatten/linear; 256-unit hidden layer so weights dominate the .nb."""

    def __init__(self, relu6: bool, nn_flatten: bool):
        super().__init__()
        self.conv = paddle.nn.Conv2D(1, 8, 3, padding=1)
        self.bn = paddle.nn.BatchNorm2D(8)
        self.act = paddle.nn.ReLU6() if relu6 else paddle.nn.ReLU()
        self.pool = paddle.nn.MaxPool2D(2)
        self.flat = paddle.nn.Flatten() if nn_flatten else None
        self.fc1 = paddle.nn.Linear(8 * 16 * 16, 256)
        self.fc2 = paddle.nn.Linear(256, 10)

    def forward(self, x):
        x = self.pool(self.act(self.bn(self.conv(x))))
        x = self.flat(x) if self.flat is not None else paddle.flatten(x, 1)
        return self.fc2(self.act(self.fc1(x)))


def _infer(model_file, params_file, x):
    import paddle.inference as pi

    cfg = pi.Config(str(model_file), str(params_file))
    cfg.disable_glog_info()
    pred = pi.create_predictor(cfg)
    pred.get_input_handle(pred.get_input_names()[0]).copy_from_cpu(x)
    pred.run()
    return pred.get_output_handle(pred.get_output_names()[0]).copy_to_cpu()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lite_models")
    paddle.disable_static()
    paddle.seed(0)
    x = np.random.RandomState(1).rand(2, 1, 32, 32).astype("float32")
    spec = [paddle.static.InputSpec([None, 1, 32, 32], "float32", "x")]
    out = {"dir": d, "x": x}
    for name, relu6, nn_flatten in (("plain", False, True), ("relu6", True, False)):
        layer = _CNN(relu6, nn_flatten)
        layer.eval()
        paddle.jit.save(layer, str(d / name), input_spec=spec)
        out[name] = (d / f"{name}.pdmodel", d / f"{name}.pdiparams")
        out[name + "_ref"] = layer(paddle.to_tensor(x)).numpy()
    return out


@pytest.fixture(scope="module")
def ptq_model(models):
    from paddleslim.quant import quant_post_static

    class _DS(paddle.io.Dataset):
        def __getitem__(self, i):
            return {"x": np.random.RandomState(i).rand(1, 32, 32).astype("float32")}

        def __len__(self):
            return 16

    d = models["dir"]
    paddle.enable_static()
    try:
        quant_post_static(executor=paddle.static.Executor(paddle.CPUPlace()), model_dir=str(d),
                          quantize_model_path=str(d / "ptq"), model_filename="plain.pdmodel",
                          params_filename="plain.pdiparams", batch_nums=2, algo="abs_max",
                          data_loader=paddle.io.DataLoader(_DS(), batch_size=8),
                          onnx_format=False, save_model_filename="model.pdmodel",
                          save_params_filename="model.pdiparams")
    finally:
        paddle.disable_static()
    return d / "ptq" / "model.pdmodel", d / "ptq" / "model.pdiparams"


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("lite_nb")
    m, p = models["relu6"]
    return {
        "x86": lite.convert(m, p, out / "relu6_x86", target="x86"),
        "arm": lite.convert(m, p, out / "relu6_arm", target="arm"),
        "arm_w8": lite.convert(m, p, out / "relu6_arm_w8", target="arm", precision="int8_weight"),
        "out": out,
    }


def test_list_ops(models):
    ops = program_repair.list_ops(models["relu6"][0])
    assert ops == sorted(set(ops)) and "feed" not in ops and "fetch" not in ops
    assert {"conv2d", "relu6", "flatten_contiguous_range", "matmul_v2"} <= set(ops)


def test_repair_adds_xshape_idempotent_inference_unchanged(models, tmp_path):
    m, p = models["relu6"]
    fixed = tmp_path / "fixed.pdmodel"
    repairs = program_repair.repair_for_lite(m, fixed)
    assert any(r.startswith("flatten_contiguous_range@block0/op") and "XShape" in r for r in repairs)
    assert sum("relu6@" in r and "threshold" in r for r in repairs) == 2
    before = fixed.read_bytes()
    assert program_repair.repair_for_lite(fixed, fixed) == []  # in place, idempotent
    assert fixed.read_bytes() == before
    prog = program_repair._load(fixed)
    flat = next(op for op in prog.blocks[0].ops if op.type == "flatten_contiguous_range")
    xshape = next(v.arguments[0] for v in flat.outputs if v.parameter == "XShape")
    var = next(v for v in prog.blocks[0].vars if v.name == xshape)
    assert list(var.type.lod_tensor.tensor.dims) == [0, -1, 8, 16, 16] and not var.persistable
    x = models["x"]
    np.testing.assert_allclose(_infer(fixed, p, x), _infer(m, p, x), rtol=0, atol=1e-6)
    assert sorted(list(tmp_path.iterdir())) == [fixed]  # no temp files left behind


def test_x86_nb_matches_dygraph_and_inference(models, converted):
    res = converted["x86"]
    assert res.precision_effective == "fp32" and res.path.name == "relu6_x86.nb"
    assert any("XShape" in n for n in res.notes) and any("threshold" in n for n in res.notes)
    assert lite.fp32_nb_runs_correctly_here("x86") == (host_arch() == "x86")
    if host_arch() != "x86":
        pytest.skip(f"an x86 .nb cannot be executed on this {host_arch()} host")
    x = models["x"]
    y = lite.run(res.path, x, expected_shape=SHAPE)
    assert y.shape == (2, 10) and y.dtype == np.float32
    assert np.abs(y - models["relu6_ref"]).max() < 1e-4
    assert np.abs(y - _infer(*models["relu6"], x)).max() < 1e-4


def test_arm_and_weight_only_int8(converted):
    arm, w8 = converted["arm"], converted["arm_w8"]
    assert arm.path.is_file() and arm.size_bytes == arm.path.stat().st_size > 0
    assert lite.fp32_nb_runs_correctly_here("arm") == (host_arch() == "arm")
    assert any("not verifiable" in n for n in arm.notes) == (host_arch() != "arm")
    assert w8.precision_effective == "int8_weight"
    assert w8.size_bytes <= 0.35 * arm.size_bytes, (w8.size_bytes, arm.size_bytes)
    assert not any(p.name.startswith(".lite-") for p in converted["out"].iterdir())


def test_ptq_int8(models, ptq_model, converted, tmp_path):
    res = lite.convert(*ptq_model, tmp_path / "ptq_arm", target="arm", precision="int8")
    assert res.precision_effective == "int8"
    assert any(k[3] == 2 for k in lite.nb_kernels(res.path))  # INT8 kernels really emitted
    assert res.size_bytes <= 0.35 * converted["arm"].size_bytes
    with pytest.raises(DataError, match="fake-quant"):
        lite.convert(*models["plain"], tmp_path / "not_ptq", target="arm", precision="int8")
    assert not (tmp_path / "not_ptq.nb").exists()


def test_opt_crash_is_engine_crash_and_leaves_nothing(models, tmp_path):
    # Unrepaired flatten (no XShape) segfaults x86 opt: must be a clean one-line EngineCrash.
    with pytest.raises(EngineCrash) as ei:
        lite.convert(*models["plain"], tmp_path / "crash", target="x86", repair=False)
    msg = ei.value.message
    assert "stage=lite" in msg and "target=x86" in msg and "SIGSEGV" in msg and "\n" not in msg
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["truncated", "junk"])
def test_corrupt_nb_is_engine_crash(models, converted, tmp_path, kind):
    good = converted["x86"].path.read_bytes()
    bad = tmp_path / f"{kind}.nb"
    bad.write_bytes(good[: len(good) // 3] if kind == "truncated" else b"\x01garbage" * 100)
    with pytest.raises(EngineCrash) as ei:
        lite.run(bad, models["x"], expected_shape=SHAPE)
    assert "stage=lite" in ei.value.message and "SIGABRT" in ei.value.message
    assert "\n" not in ei.value.message


def test_worker_engine_matches_one_shot_run_and_survives_a_crash(models, converted):
    # LiteEngine keeps one `lite_child serve` process per engine; a crash ends it with a one-line EngineCrash
    # naming the signal, and the next run starts a fresh worker.
    if host_arch() != "x86":
        pytest.skip(f"an x86 .nb cannot be executed on this {host_arch()} host")
    nb, x = converted["x86"].path, models["x"]
    eng = lite.LiteEngine(nb, SHAPE, timeout=60)
    try:
        y = eng.run(x)
        np.testing.assert_array_equal(y, lite.run(nb, x, expected_shape=SHAPE))
        np.testing.assert_allclose(eng.run_batched(x, 1), y, rtol=0, atol=1e-5)   # batch 1 vs 2: gemm blocking
        pid = eng.worker.proc.pid
        assert eng.worker.starts == 1                       # three runs, one process
        eng.worker.proc.kill()
        eng.worker.proc.wait()
        eng.worker.proc = _Dead(eng.worker.proc)            # looks alive until it is used, as after an abort
        with pytest.raises(EngineCrash) as ei:
            eng.run(x)
        assert "SIGKILL" in ei.value.message and "stage=lite" in ei.value.message and "\n" not in ei.value.message
        np.testing.assert_array_equal(eng.run(x), y)
        assert eng.worker.starts == 2 and eng.worker.proc.pid != pid
    finally:
        eng.close()
    assert eng.worker.proc is None


class _Dead:
    """A killed worker whose poll() still says 'running' (the abort happens during the next request)."""

    def __init__(self, proc):
        self._proc = proc

    def poll(self):
        return None

    def __getattr__(self, name):
        return getattr(self._proc, name)


def test_worker_engine_corrupt_nb_and_timeout(models, converted, tmp_path):
    bad = tmp_path / "junk.nb"
    bad.write_bytes(b"\x01garbage" * 100)
    eng = lite.LiteEngine(bad, SHAPE, timeout=60)
    with pytest.raises(EngineCrash) as ei:
        eng.run(models["x"])
    assert "SIGABRT" in ei.value.message and "\n" not in ei.value.message and eng.worker.proc is None
    slow = lite.LiteEngine(converted["x86"].path, SHAPE, timeout=0.01)     # the worker cannot even start in time
    with pytest.raises(EngineCrash, match="timeout after 0.01s"):
        slow.run(models["x"])
    assert slow.worker.proc is None


def test_bad_inputs_rejected_without_spawning(models, converted, monkeypatch, tmp_path):
    def no_spawn(*a, **k):
        raise AssertionError("a child process was spawned")

    monkeypatch.setattr(lite.subprocess, "run", no_spawn)
    monkeypatch.setattr(lite.subprocess, "Popen", no_spawn)       # the Lite worker
    nb, x = converted["x86"].path, models["x"]
    with pytest.raises(DataError, match="float64"):
        lite.run(nb, x.astype("float64"), expected_shape=SHAPE)
    with pytest.raises(DataError, match=r"\[2, 3, 32, 32\]"):
        lite.run(nb, np.zeros((2, 3, 32, 32), "float32"), expected_shape=SHAPE)
    with pytest.raises(DataError, match="does not match"):
        lite.run(nb, x[0], expected_shape=SHAPE)  # 3-D input aborts Lite
    with pytest.raises(MissingArtifact):
        lite.run(tmp_path / "nope.nb", x, expected_shape=SHAPE)


def test_supported_ops_listing():
    ops = lite.supported_ops("x86")
    assert ops is not None and {"conv2d", "relu6", "flatten_contiguous_range"} <= ops
    assert lite.unsupported_ops(["conv2d", "no_such_op"], "x86") == ["no_such_op"]
    table = ("Supported OPs on ' kX86': \n"  # layout copied from opt 2.13rc0 output
             "    OP_name  kHost  kUnk  kX86\n"
             "      relu6      Y           Y\n"
             "        abs      Y            \n")
    from pipeline.engines.lite_child import parse_supported_ops_table

    assert parse_supported_ops_table(table) == {"relu6": ["kHost", "kX86"], "abs": ["kHost"]}


def test_fp16_status_and_no_fake_fp16_files(models, tmp_path):
    ok, reason = lite.fp16_status("x86")
    assert ok is False and "identical" in reason
    assert lite.fp16_status("x86") == (ok, reason)  # cached
    with pytest.raises(lite.Unsupported):
        lite.convert(*models["relu6"], tmp_path / "x86_fp16", target="x86", precision="fp16")
    assert list(tmp_path.iterdir()) == []
    # This pip build does emit FP16 ARM kernels (when enable_fp16 precedes set_valid_places).
    ok_arm, reason_arm = lite.fp16_status("arm")
    if ok_arm:
        res = lite.convert(*models["relu6"], tmp_path / "arm_fp16", target="arm", precision="fp16")
        assert res.precision_effective == "fp16"
        assert any(k[3] == 5 for k in lite.nb_kernels(res.path))
    else:
        with pytest.raises(lite.Unsupported):
            lite.convert(*models["relu6"], tmp_path / "arm_fp16", target="arm", precision="fp16")


def test_zlib_still_works_after_imports():
    assert zlib.decompress(zlib.compress(b"lite" * 100)) == b"lite" * 100


def test_lite_runs_big_inputs_one_at_a_time():
    """Lite holds a whole run's activations: 8 PP-OCRv4 det pages (736x736x3 float32) at once peaked its child at
    5.5 GB (issue 48). Big samples go one per run; small ones (a 48x320 rec line) keep 8."""
    from pipeline.engines.lite_child import RUN_CHUNK, chunk_of

    assert chunk_of(3 * 736 * 736 * 4) == 1
    assert chunk_of(3 * 48 * 320 * 4) == RUN_CHUNK == 8
    assert chunk_of(0) == RUN_CHUNK
