"""ONNX export + ONNX Runtime / OpenVINO engines behind the one engine interface (tiny CNN, ~20 s).

Precision labels are checked against their evidence, whatever this CPU can do: "int8" only when int8
kernels really run (ORT: QLinear*/…Integer nodes in the optimized graph; OpenVINO: i8/u8 runtime precision).
"""
import zlib

import numpy as np
import paddle
import pytest

from pipeline.engines import registry
from pipeline.engines.base import Engine, ShapeRouted
from pipeline.engines.onnx_export import export_onnx
from pipeline.engines.paddle_infer import InferenceEngine
from pipeline.core.errors import DataError, EngineCrash, MissingArtifact, PipelineError

ort = pytest.importorskip("onnxruntime")
ov_mod = pytest.importorskip("openvino")


class Tiny(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = paddle.nn.Conv2D(1, 8, 3, padding=1), paddle.nn.BatchNorm2D(8)
        self.c2 = paddle.nn.Conv2D(8, 16, 3, padding=1)
        self.pool, self.fc = paddle.nn.MaxPool2D(2), paddle.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(paddle.nn.functional.relu(self.b1(self.c1(x))))
        x = self.pool(paddle.nn.functional.relu(self.c2(x)))
        return self.fc(paddle.flatten(x, 1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    paddle.seed(0)
    net = Tiny()
    net.eval()
    d = tmp_path_factory.mktemp("onnx")
    prefix = str(d / "inference")
    paddle.jit.save(net, prefix, input_spec=[paddle.static.InputSpec([None, 1, 16, 16], "float32", "x")])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 1, 16, 16)).astype(np.float32)
    onnx_file = export_onnx(prefix, d / "onnx" / "model.onnx")
    return {"prefix": prefix, "dir": d, "x": x, "onnx": onnx_file,
            "ref": InferenceEngine(prefix, "fp32", threads=1).run(x)}


@pytest.mark.parametrize("kind", ["onnxruntime", "openvino"])
def test_fp32_engines_match_paddle_inference(tiny, kind):
    eng = registry.make(kind, tiny["onnx"], "fp32", threads=1)
    assert isinstance(eng, Engine) and eng.kind == kind and eng.effective_precision == "fp32"
    out = eng.run_batched(tiny["x"], 16)
    assert out.shape == tiny["ref"].shape and np.abs(out - tiny["ref"]).max() < 1e-4
    d = eng.describe()
    assert d["engine"] == kind and d["settings"]["threads"] == 1
    if kind == "openvino":       # fp32 pinned even where the CPU plugin would pick bf16
        assert set(eng.evidence["runtime_precision_ops"]) == {"f32"}


@pytest.mark.parametrize("kind", ["onnxruntime", "openvino"])
def test_int8_label_needs_evidence(tiny, kind):
    from pipeline.engines import ort as ort_engine
    from pipeline.engines import ov

    calib = tiny["x"][:32]
    if kind == "onnxruntime":
        model = tiny["dir"] / "q" / "model_int8.onnx"
        info = ort_engine.quantize_int8(tiny["onnx"], model, calib, batch_size=16, batch_nums=2)
        eng = registry.make(kind, model, "int8", threads=1)
        really_int8 = bool(eng.evidence["int8_kernels"])
    else:
        ok, why = ov.nncf_status()
        if not ok:
            pytest.skip(why)
        model = tiny["dir"] / "q" / "model_int8.xml"
        info = ov.quantize_int8(tiny["onnx"], model, calib, batch_size=16, batch_nums=2)
        eng = registry.make(kind, model, "int8", threads=1)
        really_int8 = bool(set(eng.evidence["runtime_precision_ops"]) & {"i8", "u8"})
    assert info["calibration_samples"] == 32
    assert eng.effective_precision == ("int8" if really_int8 else "int8-simulated")
    out = eng.run(tiny["x"][:8])
    assert np.isfinite(out).all() and out.shape == (8, 10)
    with pytest.raises(PipelineError):             # a quantized graph is never labelled fp32
        registry.make(kind, model, "fp32")


def test_tune_routes_each_batch_shape_to_its_own_instance(tiny):
    eng, record = registry.tune("onnxruntime", tiny["onnx"], "fp32", tiny["x"], batch_size=16, threads=[1, 2],
                                warmup=1, repeats=10, rounds=2)
    assert isinstance(eng, ShapeRouted)
    assert record["batch1"]["threads"] in (1, 2) and record["batchN"]["threads"] in (1, 2)
    assert set(record["batch1"]["p50_ms_by_candidate"]) == {"threads=1", "threads=2"}
    one, rec1 = registry.tune("onnxruntime", tiny["onnx"], "fp32", tiny["x"], batch_size=16, threads=[2],
                              warmup=1, repeats=10, rounds=2)      # one candidate: built, not timed
    assert rec1["batch1"]["threads"] == 2 and "not measured" in rec1["batchN"]["chosen"]
    assert np.abs(one.run_batched(tiny["x"], 16) - tiny["ref"]).max() < 1e-4
    assert not any(eng.settings[p]["spinning"] for p in ("batch1", "batchN"))    # measured as `serve` runs them
    seen = []
    for inst, tag in ((eng.single, "single"), (eng.batched, "batched")):
        run = inst._run
        inst._run = lambda x, run=run, tag=tag: (seen.append((tag, len(x))), run(x))[1]
    eng.run(tiny["x"][:1])
    eng.run(tiny["x"][:16])
    assert seen == [("single", 1), ("batched", 16)]
    assert np.abs(eng.run_batched(tiny["x"], 16) - tiny["ref"]).max() < 1e-4
    rows = registry.rank({"a": eng, "b": registry.make("openvino", tiny["onnx"])}, tiny["x"], batch_size=16,
                         warmup=1, repeats=10, rounds=2)
    assert min(r["p50_vs_fastest"] for r in rows) == 1.0 and all(r["throughput_sps"] > 0 for r in rows)
    rows = registry.rank({"a": eng, "b": registry.make("openvino", tiny["onnx"])}, tiny["x"], batch_size=16,
                         warmup=1, repeats=10, rounds=2, by="latency")     # what a latency recommendation reads
    assert min(r["p50_vs_fastest"] for r in rows) == 1.0 and all(r["throughput_sps"] is None for r in rows)


def test_served_onnxruntime_pool_threads_do_not_spin(tiny):
    """`serve` builds its engines with spin=False: ORT's pool threads sleep between calls instead of
    busy-waiting on the cores the event loop needs. The session itself says so, and outputs are unchanged."""
    def allow_spinning(eng):
        return eng._sess.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")

    served = registry.make_routed("onnxruntime", tiny["onnx"], "fp32",
                                  {"batch1": {"threads": 2}, "batchN": {"threads": 2}}, spin=False)
    assert allow_spinning(served.single) == allow_spinning(served.batched) == "0"
    assert served.settings["batch1"]["spinning"] is False
    loop = registry.make("onnxruntime", tiny["onnx"], threads=2)          # benchmarks keep ORT's default
    assert allow_spinning(loop) == "1" and loop.settings["spinning"] is True
    assert np.abs(served.run(tiny["x"][:1]) - tiny["ref"][:1]).max() < 1e-4


@pytest.mark.parametrize("kind", ["onnxruntime", "openvino"])
def test_bad_input_is_a_data_error(tiny, kind):
    eng = registry.make(kind, tiny["onnx"])
    for bad in (tiny["x"][:2].astype(np.float64), tiny["x"][:2, :, :8], tiny["x"][0], tiny["x"][:0]):
        with pytest.raises(DataError):
            eng.run(bad)


def test_broken_inputs_fail_with_one_line(tiny, tmp_path):
    with pytest.raises(MissingArtifact):
        export_onnx(tmp_path / "nope", tmp_path / "m.onnx")
    (tmp_path / "bad.pdmodel").write_bytes(b"not a program")
    (tmp_path / "bad.pdiparams").write_bytes(b"")
    with pytest.raises(EngineCrash, match="paddle2onnx failed"):
        export_onnx(tmp_path / "bad", tmp_path / "out" / "m.onnx")
    assert not (tmp_path / "out" / "m.onnx").exists()       # atomic: nothing half-written
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00garbage")
    for kind in ("onnxruntime", "openvino"):
        with pytest.raises(PipelineError) as e:
            registry.make(kind, junk)
        assert "\n" not in e.value.one_line()


def test_gpu_providers_report_not_run_here_without_a_gpu():
    from pipeline.core import env
    from pipeline.engines.ort import provider_status

    for p in ("cuda", "tensorrt"):
        ok, why = provider_status(p)
        if not env.capabilities()["gpu"]:
            assert not ok and why.startswith("not run here")
    assert provider_status("cpu")[0]


def test_int8_rows_quantize_only_the_layers_paddleslim_does(tiny):
    """server.quant.op_types/skip reach the ONNX Runtime and OpenVINO int8 rows: the layers PaddleSlim leaves fp32
    (here the first conv, skipped, and the fc, not in op_types) keep fp32 weights there too (PP-OCRv4 rec)."""
    import onnx

    from pipeline.engines import ort as ort_engine
    from pipeline.engines import ov, quant

    first, second, fc = quant.quantizable_layers(tiny["prefix"])
    assert quant.weights_to_quantize(tiny["prefix"], quant.DEFAULT_OP_TYPES) is None     # defaults: as before
    weights = quant.weights_to_quantize(tiny["prefix"], ["conv2d"], [first])
    assert weights == [second]
    calib = tiny["x"][:16]
    model = tiny["dir"] / "scoped" / "model_int8.onnx"
    info = ort_engine.quantize_int8(tiny["onnx"], model, calib, batch_size=16, batch_nums=1, weights=weights)
    assert info["excluded_compute_nodes"] == 2
    graph = onnx.load(str(model)).graph
    made_by = {o: n.op_type for n in graph.node for o in n.output}
    weight_of = {n.name: n.input[1] for n in onnx.load(str(tiny["onnx"])).graph.node if n.op_type in ort_engine.COMPUTE_OPS}
    int8_weight = {weight_of[n.name]: made_by.get(n.input[1]) == "DequantizeLinear"
                   for n in graph.node if n.op_type in ort_engine.COMPUTE_OPS}    # (ORT renames a weight it folds BN into)
    assert int8_weight == {first: False, second: True, fc: False}
    ok, why = ov.nncf_status()
    if not ok:
        pytest.skip(why)
    xml = tiny["dir"] / "scoped" / "model_int8.xml"
    info = ov.quantize_int8(tiny["onnx"], xml, calib, batch_size=16, batch_nums=1, weights=weights, preset="mixed",
                            activation_range="minmax")     # configs/ppocr_v4_rec.yaml's NNCF settings
    assert info["ignored_compute_ops"] == 2 and (info["preset"], info["activation_range"]) == ("mixed", "minmax")
    qmodel = ov_mod.Core().read_model(str(xml))
    fp32_weights = sorted(ov._weight_name(op) for op in qmodel.get_ordered_ops()
                          if op.get_type_name() in ov._COMPUTE_OPS and ov._weight_name(op) is not None)
    assert fp32_weights == sorted([first, fc])       # the quantized conv reads int8 weights (decompressed)


@pytest.mark.parametrize("kind", ["paddle-inference", "onnxruntime", "openvino"])
def test_trimmed_engines_still_answer_the_same(tiny, kind, monkeypatch):
    """Engine.trim (issue 48: the server stage trims the engines it keeps for serving after each row) gives back
    pools and buffers, never the engine: it answers the same after a trim, a large ORT run shrinking its arena too."""
    from pipeline.engines import ort as ort_engine

    model = tiny["prefix"] if kind == "paddle-inference" else tiny["onnx"]
    eng = registry.make(kind, model, "fp32", threads=1)
    before, one = eng.run_batched(tiny["x"], 16), eng.run(tiny["x"][:1])
    eng.trim()
    monkeypatch.setattr(ort_engine, "SHRINK_INPUT_BYTES", 1)        # every run counts as large
    after = eng.run_batched(tiny["x"], 16)
    eng.trim()
    # batch 1 against batch 1: oneDNN's batch-1 and batch-16 kernels may round differently (under SSE41 they do)
    assert np.array_equal(before, after) and np.array_equal(eng.run(tiny["x"][:1]), one)


def test_settle_memory_trims_every_kept_engine():
    from pipeline.evaluation.rows import settle_memory

    trimmed = []

    class Kept(Engine):
        def __init__(self, name):
            super().__init__()
            self.name, self.input_shape = name, [-1, 1, 16, 16]

        def _run(self, x):
            return x

        def trim(self):
            trimmed.append(self.name)

    routed = ShapeRouted(Kept("one"), Kept("many"))
    settle_memory({"paddle-inference": routed, "openvino": Kept("ov")})
    assert trimmed == ["one", "many", "ov"]


def test_the_memory_budget_stops_the_stage_at_the_row_that_passed_it():
    """server.memory_budget_mb is the stage's peak RSS: kept (each row's peak recorded), or one line naming the row,
    the measured peak, the key and what to change."""
    from pipeline.core import resources
    from pipeline.core.errors import GateFailed
    from pipeline.evaluation.rows import LOADING, MemoryBudget, settle_memory

    if resources.hwm_mb() is None:
        pytest.skip("no VmHWM here (not Linux): the budget measures nothing and refuses nothing")
    resources.reset_peak()
    kept = MemoryBudget(1 << 20)
    kept.check(LOADING)
    blob = bytearray(96 << 20)
    blob[::4096] = b"x" * len(blob[::4096])             # 96 MB touched inside the "row"
    del blob
    settle_memory({}, kept, "paddle-inference fp32")
    rows = kept.record()["peak_rss_mb_by_row"]
    assert list(rows) == [LOADING, "paddle-inference fp32"] and rows["paddle-inference fp32"] >= 96
    with pytest.raises(GateFailed) as exc:
        settle_memory({}, MemoryBudget(8), "openvino int8")
    line = exc.value.one_line()
    assert "row 'openvino int8'" in line and "server.memory_budget_mb=8 MB" in line and "\n" not in line
    assert "server.batch_memory_mb" in line
    with pytest.raises(GateFailed, match="raise server.memory_budget_mb: the model"):
        MemoryBudget(8).check(LOADING)


def test_the_system_stage_budget_names_its_stage_and_phase():
    """The system stage checks server.memory_budget_mb after each phase: its line names the system stage, the phase,
    the measured peak and its own fix (not the server stage's row advice)."""
    from pipeline.core import resources
    from pipeline.core.errors import GateFailed
    from pipeline.evaluation.rows import MemoryBudget
    from stages.system import BUDGET_FIX, PHASES, ROWS_PHASE

    if resources.hwm_mb() is None:
        pytest.skip("no VmHWM here (not Linux): the budget measures nothing and refuses nothing")
    with pytest.raises(GateFailed) as exc:
        MemoryBudget(8, stage="system", phases=PHASES, fix=BUDGET_FIX).check(ROWS_PHASE)
    line = exc.value.one_line()
    assert line.startswith("system: peak RSS") and f"MB in {ROWS_PHASE} is over" in line
    assert "server.memory_budget_mb=8 MB" in line and "in the system config" in line and "\n" not in line
    kept = MemoryBudget(1 << 20, stage="system", phases=PHASES, fix=BUDGET_FIX)
    kept.check(ROWS_PHASE)
    assert list(kept.record()["peak_rss_mb_by_row"]) == [ROWS_PHASE]


def test_static_shapes_compile_each_shape_and_keep_the_last_ones(tiny):
    """OpenVINO's static_shapes (the flow's det_static_shapes): each input shape runs on a model compiled for it, the
    `size` most recent kept; the answers are the dynamic model's (fp32: other kernels, same values to rounding)."""
    dyn = registry.make("openvino", tiny["onnx"], "fp32")
    eng = registry.make("openvino", tiny["onnx"], "fp32", static_shapes=2)
    assert eng.settings["static_shapes"] == 2 and "static_shapes" not in dyn.settings
    for n in (1, 3, 1, 5, 3):
        np.testing.assert_allclose(eng.run(tiny["x"][:n]), dyn.run(tiny["x"][:n]), rtol=1e-5, atol=1e-5)
    # 1 and 3 compiled, 1 reused, 5 compiled (3, the least recently used, dropped), 3 compiled again
    assert eng.evidence["static_shapes_compiled"] == 4
    eng.trim()          # every shape's buffers given back: the next call compiles its shape again
    eng.run(tiny["x"][:1])
    assert eng.evidence["static_shapes_compiled"] == 5


def test_a_static_shape_that_runs_another_precision_fails_loudly(tiny, monkeypatch):
    """Each shape's compiled model must run the precision the engine reports (a CPU plugin could pick other kernels
    for a shape): a shape whose runtime model shows another precision stops with one line naming it."""
    from collections import Counter

    from pipeline.engines import ov

    eng = registry.make("openvino", tiny["onnx"], "fp32", static_shapes=4)
    monkeypatch.setattr(ov, "_runtime_precisions", lambda compiled: Counter({"bf16": 3}))
    with pytest.raises(PipelineError) as e:
        eng.run(tiny["x"][:2])
    assert "[2, 1, 16, 16]" in str(e.value) and "\n" not in str(e.value)


def test_only_openvino_is_given_static_shapes(tiny, monkeypatch):
    """load_engine passes static_shapes to OpenVINO alone (the runtime here that compiles per shape)."""
    from pipeline.bundle import serving_choice

    seen = []
    monkeypatch.setattr(registry, "make_routed", lambda kind, model, prec, settings, **opts: seen.append(opts) or
                        type("E", (), {"effective_precision": "fp32"})())
    monkeypatch.setattr(serving_choice.bundle_layout, "model_exists", lambda m: True)
    settings = {"batch1": {"threads": 1}, "batchN": {"threads": 1}}
    monkeypatch.setattr(serving_choice, "serving_choice", lambda cfg, kind, prec: (kind, prec or "fp32", settings))
    monkeypatch.setattr(serving_choice.bundle_layout, "serving_model", lambda kind, prec, folder: "m")
    for kind in ("openvino", "onnxruntime"):
        serving_choice.load_engine(tiny["dir"], {}, kind, 1, "fp32", static_shapes=8)
    assert [o.get("static_shapes") for o in seen] == [8, None]


def test_paddle_gives_back_a_shapes_buffers_when_the_shape_changes(tiny):
    """Paddle's allocator keeps every input shape's buffers until shrunk (varied pages grew the v4 references to
    3.8 GB): the engine shrinks its pool whenever the input shape changes, never on a repeat, and answers the same."""
    eng = InferenceEngine(tiny["prefix"], "fp32", threads=1)

    class Counting:
        def __init__(self, p):
            self.p, self.shrinks = p, 0

        def try_shrink_memory(self):
            self.shrinks += 1
            return self.p.try_shrink_memory()

        def __getattr__(self, name):
            return getattr(self.p, name)

    eng._predictor = Counting(eng._predictor)
    got = [eng.run(tiny["x"][:n]) for n in (1, 1, 3, 3, 1)]
    assert eng._predictor.shrinks == 2                  # 1 -> 3 and 3 -> 1
    np.testing.assert_array_equal(got[0], got[4])
    np.testing.assert_allclose(got[2], tiny["ref"][:3], rtol=1e-5, atol=1e-5)
