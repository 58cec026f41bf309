"""Serving what was recommended, low precision included: old bundles, overrides, verify at the row's own tolerance,
the smoke chain's record, and the OpenVINO bf16 row's decision and evidence."""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from pipeline.core import capabilities as caps
from pipeline.bundle import recommend as rec
from pipeline.core.config import load_config
from pipeline.core.errors import MissingArtifact
from pipeline.engines import evidence


def _cfg(folder: Path) -> dict:
    return yaml.safe_load((folder / "infer_config.yaml").read_text())


def _openvino() -> tuple[bool, str]:
    from pipeline.engines import registry

    return registry.available("openvino")     # not below AVX2, e.g. under ONEDNN_MAX_CPU_ISA=SSE41 (engines/registry.py)


def _samples(folder: Path, cfg: dict) -> np.ndarray:
    from pipeline.bundle.verify_model import load_samples as samples

    return samples(folder, cfg)


# ------------------------------------------------------------------ the smoke chain's record (session fixture)

@pytest.mark.slow
def test_record_explains_the_choice_either_way(smoke_chain):
    serving = json.loads((smoke_chain / "server" / "serving.json").read_text())
    gates = {g["subject"]: g for g in json.loads((smoke_chain / "server" / "manifest.json").read_text())["gates"]}
    cands = {c["row"]: c for c in serving["candidates"]}
    assert cands[serving["row"]]["verdict"] == "chosen" and serving["why"]
    int8_rows = {"paddle-inference int8", "onnxruntime int8", *(["openvino int8"] if _openvino()[0] else [])}
    assert int8_rows <= set(cands)     # int8 was allowed (OpenVINO's rows only where the engine runs here)
    for c in cands.values():
        assert c["verdict"] in ("chosen", "slower", "not faster", "over budget", "no evidence", "emulated",
                                "skipped", "failed gate", "not allowed", "failed to load"), c
        assert c["verdict"] == "chosen" or c["detail"], c         # every verdict says why
    fp32 = serving["fp32"]
    assert fp32["row"].endswith(" fp32") and fp32["latency_ms_p50"] > 0 and fp32["metric"] is not None
    if serving["precision"] == "fp32":
        assert "no low-precision row qualified" in serving["why"]
    else:       # a low-precision row: evidence, within budget, faster than fp32 by the margin
        g, c = gates[serving["row"]], cands[serving["row"]]
        assert evidence.head(g["precision_effective"]) == serving["precision"] and g["extra"]["evidence"]
        assert c["speedup_vs_fp32"] >= serving["budget"]["min_speedup"]
        assert serving["why"].startswith("fastest within budget")
    assert cands["paddle-inference fp16"]["verdict"] == ("emulated" if not caps.gpu()["gpu"] else cands[
        "paddle-inference fp16"]["verdict"])
    if not caps.bf16_cpu_status()[0]:
        bf16_rows = ["paddle-inference bf16"] + (["openvino bf16"] if _openvino()[0] else [])
        assert {cands[r]["verdict"] for r in bf16_rows} == {"skipped"}


@pytest.mark.slow
def test_the_smoke_rows_under_a_generous_budget(smoke_chain):
    """Same rows, budget opened: every int8 row with evidence is within it (the screen reads real gates); one that
    its own row measured slower than min_speedup x its engine's fp32 is "not faster" before any ranking."""
    from pipeline.core.gates import Gate

    gates = [Gate.from_dict(g) for g in json.loads((smoke_chain / "server" / "manifest.json").read_text())["gates"]]
    rc = load_config([], ["server.recommend.max_metric_drop=1", "server.recommend.min_agreement=0"]).server.recommend
    for c in rec.screen(gates, rc):
        g = next(g for g in gates if g.subject == c.row)
        if c.precision == "int8" and g.status == "OK" and evidence.head(g.precision_effective) == "int8":
            assert c.verdict in (rec.CANDIDATE, "not faster") and c.agreement is not None, c
            assert (c.verdict == "not faster") == (g.extra["speed_vs_fp32"]["batch1"] < rc.min_speedup), c


# ------------------------------------------------------------------ serve / verify load what was recommended

@pytest.mark.slow
def test_old_style_bundles_still_load(smoke_bundle):
    from pipeline.bundle.serving_choice import load_engine, serving_choice

    folder, _ = smoke_bundle
    cfg = _cfg(folder)
    x, expected = _samples(folder, cfg)
    old = {**cfg, "serving": {k: cfg["serving"][k] for k in ("engine", "by", "tuning")}}    # no precision/row/settings
    kind, prec, settings = serving_choice(old)
    assert (kind, prec) == (cfg["serving"]["engine"], "fp32") and settings["batch1"]["threads"] >= 1
    for infer in (old, {**cfg, "serving": None}):                 # a bundle from before any recommendation
        eng = load_engine(folder, infer)
        assert eng.effective_precision == "fp32" and np.abs(eng.run(x) - expected).max() < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["paddle-inference", "onnxruntime", "openvino"])
def test_int8_rows_are_served_from_their_own_files(smoke_bundle, kind):
    from pipeline.bundle.serving_choice import load_engine

    folder, _ = smoke_bundle
    cfg = _cfg(folder)
    x, expected = _samples(folder, cfg)
    if kind == "openvino" and not _openvino()[0]:       # the server stage built no OpenVINO rows: none is bundled
        with pytest.raises(MissingArtifact, match="the bundle has no int8 model for engine openvino"):
            load_engine(folder, cfg, override=kind, precision="int8")
        return
    eng = load_engine(folder, {**cfg, "serving": {**cfg["serving"], "engine": kind, "precision": "int8",
                                                  "settings": {"batch1": {"threads": 1}, "batchN": {"threads": 1}}}})
    assert eng.kind == kind and evidence.head(eng.effective_precision) in ("int8", "int8-simulated")
    assert np.isfinite(eng.run(x)).all()
    over = load_engine(folder, cfg, override=kind, precision="int8")      # --engine/--precision overrides
    assert evidence.head(over.effective_precision) == evidence.head(eng.effective_precision)


@pytest.mark.slow
def test_bf16_without_a_bf16_cpu_serves_fp32(smoke_bundle, monkeypatch):
    from pipeline.bundle.serving_choice import load_engine

    monkeypatch.setenv(caps.PROFILE_ENV, "avx2")
    folder, _ = smoke_bundle
    cfg = _cfg(folder)
    for kind in ("paddle-inference", "openvino"):
        eng = load_engine(folder, {**cfg, "serving": {**cfg["serving"], "engine": kind, "precision": "bf16"}})
        assert eng.effective_precision == "fp32", kind


@pytest.mark.slow
def test_verify_holds_the_served_row_to_its_own_tolerance(smoke_bundle, tmp_path):
    from pipeline.bundle.verify_model import verify_model_folder

    src, _ = smoke_bundle
    folder = tmp_path / "b"
    shutil.copytree(src, folder)
    cfg = _cfg(folder)
    tol = {"atol": 0.1, "rtol": 1.0, "key": "server.gates.int8"}
    cfg["serving"] = {**cfg["serving"], "engine": "onnxruntime", "precision": "int8", "tolerance": tol}
    (folder / "infer_config.yaml").write_text(yaml.safe_dump(cfg))
    manifest = json.loads((folder / "manifest.json").read_text())
    report = verify_model_folder(folder, manifest=manifest)         # hashes were checked by the caller
    served = [c for c in report["checks"] if c["name"].startswith("served onnxruntime")]
    assert served and all(c["passed"] for c in served), report["checks"]
    assert all(c["key"].startswith("server.gates.int8") for c in served if c["name"].endswith("max_abs_diff on samples"))


# ------------------------------------------------------------------ the OpenVINO bf16 row

def _tiny_onnx(path: Path) -> Path:
    """Conv -> Relu -> MatMul: compute ops whose runtime precision OpenVINO reports."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.RandomState(0)
    init = [numpy_helper.from_array(rng.randn(4, 1, 3, 3).astype(np.float32), "W"),
            numpy_helper.from_array(rng.randn(256, 5).astype(np.float32), "M"),
            numpy_helper.from_array(np.array([-1, 256], np.int64), "S")]
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Reshape", ["r", "S"], ["f"]),
                           helper.make_node("MatMul", ["f", "M"], ["y"])], "tiny",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 5])], init)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_openvino_bf16_row_is_skipped_without_bf16(monkeypatch):
    from pipeline.evaluation.onnx_rows import openvino_bf16_row

    monkeypatch.setenv(caps.PROFILE_ENV, "avx2")
    ctx = SimpleNamespace(cfg=load_config([], []))
    task = SimpleNamespace(primary_metric="accuracy")
    g = openvino_bf16_row(ctx, task, Path("unused.onnx"), ())
    assert g.status == "SKIPPED" and "avx512_bf16/amx_bf16" in g.reason and "f32" in g.reason


def test_openvino_bf16_label_follows_the_runtime_model(tmp_path, monkeypatch):
    """Hint bf16 on a CPU without bf16: OpenVINO silently runs f32, and the label must say so (never 'bf16')."""
    from pipeline.engines.ov import OpenVinoEngine, bf16_status

    pytest.importorskip("openvino")
    onnx_file = _tiny_onnx(tmp_path / "tiny.onnx")
    monkeypatch.setenv(caps.PROFILE_ENV, "bf16")            # simulated: the row runs, the runtime model decides
    ok, why = bf16_status()
    if caps.isa_cap_without_bf16() and not caps.simulated(caps.BF16_FLAGS):
        # a real bf16 CPU run with ONEDNN_MAX_CPU_ISA below bf16: the plugin refuses the hint, the row is SKIPPED
        assert not ok and caps.ISA_ENV in why
        return
    assert ok and (("simulated" in why) == caps.simulated(caps.BF16_FLAGS))
    eng = OpenVinoEngine(onnx_file, label="bf16")
    ops = eng.evidence["runtime_precision_ops"]
    assert eng.evidence["inference_precision_hint_requested"] == "bf16" and ops
    if "bf16" in ops:          # a real bf16 CPU
        assert eng.effective_precision == "bf16"
    else:
        assert eng.effective_precision.startswith("fp32 (bf16 not applied") and "f32" in eng.effective_precision
    fp32 = OpenVinoEngine(onnx_file, label="fp32")          # fp32 rows keep the f32 hint on every CPU
    assert fp32.evidence["inference_precision_hint"] == "f32" and set(fp32.evidence["runtime_precision_ops"]) == {"f32"}
    x = np.random.RandomState(1).randn(2, 1, 8, 8).astype(np.float32)
    if "bf16" not in ops:
        assert np.array_equal(eng.run(x), fp32.run(x))


@pytest.mark.slow
def test_http_row_gates_a_low_precision_row_as_served(smoke_chain, tmp_path):
    """The server stage's HTTP row on an int8 recommendation: subject, precision and tolerance are int8's."""
    from pipeline.engines import registry
    from pipeline.tasks.reference import load_reference
    from pipeline.evaluation.http_rows import predict_http_row

    cfg = load_config([Path("configs/smoke.yaml")], ["server.http.max_requests=8"])
    ref = load_reference(smoke_chain / "export")
    eng = registry.make_routed("onnxruntime", smoke_chain / "server" / "onnx" / "model_int8.onnx", "int8",
                               {"batch1": {"threads": 1}, "batchN": {"threads": 1}})
    g = predict_http_row(SimpleNamespace(cfg=cfg, out_dir=tmp_path), ref, 1, eng, "int8")
    assert g.subject == "http /predict as served" and g.precision_requested == "int8"
    assert g.precision_effective == eng.effective_precision and g.extra["engine"] == "onnxruntime"
    # the verdict is int8's (not asserted OK: on the barely trained smoke model int8 flips near-ties, and since issue
    # 46 agreement is strict; measured 2026-12-06: 4 of the 8 HTTP samples, strict 0.5 < 0.85, FAIL)
    tol = cfg.server.gates["int8"]
    limits = {c.name: c for c in g.checks}
    assert limits["argmax_agreement"].limit == tol.min_agreement and limits["argmax_agreement"].key.startswith(
        "server.gates.int8")
    scale = float(np.abs(ref.outputs[:g.extra["requests"]]).max())
    assert abs(limits["max_abs_diff"].limit - (tol.atol + tol.rtol * scale)) < 1e-9
    assert g.status == ("OK" if all(c.passed for c in g.checks) else "FAIL")


@pytest.mark.slow
def test_bundle_manifest_and_card_say_what_is_served(smoke_bundle):
    folder, _ = smoke_bundle
    served = json.loads((folder / "manifest.json").read_text())["serving"]
    serving = _cfg(folder)["serving"]
    assert {k: served[k] for k in ("engine", "precision", "row", "why")} == \
        {k: serving[k] for k in ("engine", "precision", "row", "why")}
    assert f"runs **{served['engine']} {served['precision']}**" in (folder / "MODEL_CARD.md").read_text()
    from pipeline.bundle.serving_choice import load_engine

    assert (folder / serving["model"]).exists() or (folder / (serving["model"] + ".pdmodel")).exists()
    assert evidence.head(load_engine(folder, _cfg(folder)).effective_precision) in (serving["precision"], "fp32")


def test_openvino_bf16_serves_the_ir_its_row_was_gated_on(tmp_path, monkeypatch):
    """The OpenVINO bf16 row is gated on an IR whose keep-list layers are marked f32; the bundle must serve that IR
    (it served the ONNX model with the bf16 hint: every layer bf16, on the real images `3F1` read `3FI`). A bundle
    made before it lacks the IR: loading that row says so in one line, it never serves the ONNX model instead."""
    from pipeline.bundle import layout
    from pipeline.bundle.serving_choice import load_engine
    from pipeline.core.errors import MissingArtifact

    assert layout.serving_model("openvino", "bf16") == layout.OPENVINO_BF16
    assert layout.serving_model("openvino", "bf16", tmp_path) == layout.OPENVINO_BF16        # an older bundle too
    assert layout.SERVER_STAGE_MODELS["openvino/model_bf16.xml"] == layout.OPENVINO_BF16
    server = tmp_path / "run" / "server"
    assert layout.server_stage_model(server, tmp_path / "export", "openvino", "bf16") == \
        server / "openvino" / "model_bf16.xml"
    assert layout.serving_model("paddle-inference", "bf16", tmp_path) == layout.FP32_PREFIX   # the engine's switch
    (tmp_path / layout.ONNX_MODEL).parent.mkdir(parents=True)
    (tmp_path / layout.ONNX_MODEL).write_bytes(b"onnx")             # the file such a bundle did serve: not any more
    from pipeline.core import capabilities
    monkeypatch.setattr(capabilities, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))   # any host
    monkeypatch.delenv(capabilities.ISA_ENV, raising=False)                                      # and no cap
    with pytest.raises(MissingArtifact) as err:
        load_engine(tmp_path, {"serving": {"engine": "openvino", "precision": "bf16"}}, override="openvino",
                    precision="bf16")
    line = err.value.one_line()
    assert "no bf16 model for engine openvino" in line and layout.OPENVINO_BF16 in line and "\n" not in line
    assert "before that row's own IR was bundled" in line


def test_openvino_bf16_row_writes_the_ir_it_is_gated_on(tmp_path, monkeypatch):
    """With or without a keep list, the row's model is server/openvino/model_bf16.xml (+ .bin) in the stage's
    output, the file the bundle stage copies and serving loads."""
    pytest.importorskip("openvino")
    import pipeline.evaluation.onnx_rows as onnx_rows
    from pipeline.engines import ov

    monkeypatch.setattr(ov, "bf16_status", lambda: (True, "test"))
    made = []
    monkeypatch.setattr("pipeline.engines.registry.make", lambda kind, model, prec, **kw: made.append(
        (kind, Path(model), prec)) or SimpleNamespace(notes=[], evidence={}))
    monkeypatch.setattr(onnx_rows, "engine_row", lambda *a, **kw: SimpleNamespace(status="FAIL"))
    for keep in ([], ["conv"]):
        cfg = load_config([], [f"server.bf16.openvino_keep_fp32=[{', '.join(keep)}]"])
        out = tmp_path / f"out{len(keep)}"
        ctx = SimpleNamespace(cfg=cfg, work_dir=tmp_path / f"work{len(keep)}", out_dir=out)
        onnx_rows.openvino_bf16_row(ctx, SimpleNamespace(primary_metric="accuracy"), _tiny_onnx(tmp_path / "m.onnx"), ())
        assert made[-1] == ("openvino", out / "openvino" / "model_bf16.xml", "bf16")
        assert (out / "openvino" / "model_bf16.xml").is_file() and (out / "openvino" / "model_bf16.bin").is_file()


def test_every_low_precision_rows_speed_baseline_is_a_fresh_fp32_engine_of_its_kind(monkeypatch):
    """Issue 46: the Paddle bf16 row was timed against the tuned fp32 engine (its own threads and ir_optim per
    profile) while int8 and OpenVINO bf16 rows were timed against a fresh engine with their settings; every row now
    compares with a fresh fp32 engine of its kind with the same threads and options, and its `how` says so."""
    import pipeline.evaluation.paddle_rows as pr
    from pipeline.engines import paddle_infer as pi
    from pipeline.evaluation import timing

    made, seen = [], {}

    class Engine:
        def __init__(self, prefix, precision="fp32", **kw):
            self.precision, self.kw, self.notes = precision, kw, []
            made.append(self)

    monkeypatch.setattr(pi, "InferenceEngine", Engine)
    monkeypatch.setattr(pi, "bf16_status", lambda: (True, "avx512_bf16"))
    monkeypatch.setattr(pr, "engine_row", lambda ctx, task, prec, eng, *a: SimpleNamespace(
        status="OK", subject=f"paddle-inference {prec}", precision_requested=prec, extra={}))
    monkeypatch.setattr(pr, "note_speed_vs_fp32", lambda ctx, gate, low, fp32, x: seen.update(low=low, fp32=fp32))
    ctx = SimpleNamespace(cfg=load_config([], []))
    ref = SimpleNamespace(task=SimpleNamespace(primary_metric="accuracy"), model_prefix="m", inputs=None,
                          outputs=None, labels=None, metric=None)
    common = dict(threads=3, mkldnn=True, ir_optim=True)
    tuned = object()
    pr._paddle_row(ctx, ref, "bf16", 0.1, None, "cpu", common, {}, {}, {"paddle-inference": tuned})
    assert seen["fp32"] is not tuned and seen["fp32"].precision == "fp32" and seen["fp32"].kw == common
    assert seen["low"].precision == "bf16" and {k: seen["low"].kw[k] for k in common} == common

    monkeypatch.setattr("pipeline.engines.registry.rank", lambda engines, x, **kw: [
        {"engine": k, "latency_ms": {"p50": 2.0 if k == "fp32" else 1.0}, "throughput_sps": 10.0} for k in engines])
    sp = timing.speed_vs_fp32(None, None, None, batch=4, warmup=1, repeats=1, rounds=3, label="bf16",
                              kind="openvino")
    assert sp["batch1"] == 2.0
    assert sp["how"] == ("interleaved, 3 rounds; baseline: a fresh openvino fp32 engine with the same threads and "
                         "options")
