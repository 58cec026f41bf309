"""model.source=onnx (pipeline/models/onnx_import.py): an ONNX file imported as it is, its reference ONNX Runtime
fp32 (basic graph optimizations), the ORT/OpenVINO rows gated against it, Paddle and Lite rows SKIPPED."""
import json

import numpy as np
import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, IntegrityError
from pipeline.models import onnx_import

from clirun import pipeline_cli

CLASSES = 10


def _tiny_onnx(path, channels=1, size=16, classes=CLASSES, seed=0):
    """Conv(3x3, 4 filters, pad 1) -> ReLU -> global average pool -> Gemm: [N, C, 16, 16] -> [N, classes]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (4, channels, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(4, np.float32), "b"),
             numpy_helper.from_array(rng.normal(0, 0.5, (classes, 4)).astype(np.float32), "fc_w"),
             numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           ["N", channels, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8          # what ONNX Runtime 1.23 loads (onnx writes its newest by default)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onnx") / "model"
    folder.mkdir()
    return _tiny_onnx(folder / "tiny.onnx")


def test_resolve_takes_the_file_or_its_folder(tiny):
    assert onnx_import.resolve(tiny) == tiny
    assert onnx_import.resolve(tiny.parent) == tiny


def test_resolve_refuses_ambiguous_folders_and_other_files(tmp_path, tiny):
    with pytest.raises(ConfigError, match="holds 0 .onnx files"):
        onnx_import.resolve(tmp_path)
    (tmp_path / "model.pdmodel").write_bytes(b"x")
    with pytest.raises(ConfigError, match="is not an .onnx file"):
        onnx_import.resolve(tmp_path / "model.pdmodel")
    with pytest.raises(ConfigError, match="over model.max_file_bytes"):
        onnx_import.resolve(tiny, max_bytes=10)


def test_a_foreign_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf at all" * 10)
    with pytest.raises(ConfigError) as e:
        onnx_import.signature(bad)
    assert "is not a valid ONNX model" in e.value.message and "\n" not in e.value.message


def test_signature_and_input_check(tiny):
    sig = onnx_import.signature(tiny)
    assert sig["input"] == "x" and sig["input_shape"] == [-1, 1, 16, 16] and sig["opset"] == 13
    assert onnx_import.check_input(tiny, {"channels": 1, "height": 16, "width": 16}, "classification")
    with pytest.raises(ConfigError) as e:
        onnx_import.check_input(tiny, {"channels": 3, "height": 16, "width": 16}, "classification")
    assert "has channels 1; data.channels is 3" in e.value.message and e.value.hint == "set data.channels: 1"


def test_reference_is_ort_basic_and_matches_numpy(tiny):
    import onnx
    from onnx import numpy_helper

    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tiny)).graph.initializer}
    x = np.random.default_rng(1).normal(size=(5, 1, 16, 16)).astype(np.float32)
    out = onnx_import.reference_outputs(tiny, x, batch=2)
    # the same graph in numpy: 3x3 conv with zero padding, ReLU, mean, dense
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(pad, (3, 3), axis=(2, 3))       # [N, 1, 16, 16, 3, 3]
    conv = np.einsum("nchwij,kcij->nkhw", win, w["w"]) + w["b"][None, :, None, None]
    want = np.maximum(conv, 0).mean(axis=(2, 3)) @ w["fc_w"].T + w["fc_b"]
    assert out.shape == (5, CLASSES)
    assert np.abs(out - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    sess = onnx_import.reference_session(tiny)
    assert sess.get_providers() == ["CPUExecutionProvider"]


def test_macs_and_activation_bytes_count_the_graph(tiny):
    assert onnx_import.macs(tiny, [-1, 1, 16, 16]) == 16 * 16 * 4 * 9 + CLASSES * 4
    # x: 1x16x16; c, r: 4x16x16 each; p, f: 4; y: 10 (fp32, one sample)
    assert onnx_import.activation_bytes(tiny, [-1, 1, 16, 16]) == 4 * (256 + 2 * 1024 + 4 + 4 + CLASSES)


def test_ort_int8_of_an_opset_11_model_is_quantized_at_opset_13(tiny, tmp_path, monkeypatch):
    """quantize_static writes per-channel QDQ at the model's own opset: at 11 (PP-OCRv6 small as shipped) the
    result does not load (INVALID_GRAPH on the bias's DequantizeLinear), so the float model goes to opset 13 first."""
    import onnx

    from pipeline.core.errors import PipelineError
    from pipeline.engines import ort

    m = onnx.load(str(tiny))
    m.opset_import[0].version = 11
    old = tmp_path / "opset11.onnx"
    onnx.save(m, str(old))
    calib = np.random.default_rng(2).normal(size=(16, 1, 16, 16)).astype(np.float32)
    info = ort.quantize_int8(old, tmp_path / "q.onnx", calib, batch_size=8, batch_nums=2)
    assert info["opset_converted"] == {"from": 11, "to": 13}
    eng = ort.OrtEngine(tmp_path / "q.onnx", label="int8")
    assert eng.effective_precision == "int8" and eng.evidence["int8_kernels"]
    ref = onnx_import.reference_outputs(old, calib)
    assert np.abs(eng.run(calib) - ref).max() <= 0.1 * np.abs(ref).max()       # int8 rounding, not another model
    assert "opset_converted" not in ort.quantize_int8(tiny, tmp_path / "q13.onnx", calib, batch_size=8, batch_nums=1)
    monkeypatch.setattr(ort, "qdq_opset", lambda f, t: (f, None))             # what the row did before
    ort.quantize_int8(old, tmp_path / "q_as_is.onnx", calib, batch_size=8, batch_nums=1)
    with pytest.raises(PipelineError, match="INVALID_GRAPH"):
        ort.OrtEngine(tmp_path / "q_as_is.onnx", label="int8")


def test_source_onnx_needs_a_path():
    with pytest.raises(ConfigError, match="model.path is empty"):
        load_config(overrides=["model.source=onnx"])


@pytest.fixture(scope="module")
def chain(tiny, tmp_path_factory):
    """train (import) -> export -> server -> lite -> bundle on a classifier given as ONNX, once for this module
    (~5-10 s: one fp32 precision, no HTTP row, one thread count) -> (run root, published bundle folder)."""
    root = tmp_path_factory.mktemp("onnx_chain")
    common = ["-o", "task=classification", "-o", "model.source=onnx", "-o", f"model.path={tiny}",
              "-o", "data.height=16", "-o", "data.width=16", "-o", "data.num_train=64", "-o", "data.num_val=32",
              "-o", "train.nproc=1", "-o", "train.min_metric=0", "-o", "server.precisions=[fp32]",
              "-o", "server.http.enable=false", "-o", "server.tuning.threads=[1]", "-o", "server.tuning.rounds=1",
              "-o", "server.perf.repeats=3", "-o", "server.perf.warmup=1", "-o", f"run.root={root}/runs",
              "-o", f"bundle.root={root}/bundles", "-o", "run.quiet=true"]
    res = pipeline_cli("run", "train", "export", "server", "lite", "bundle", *common, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    bundles = [p for p in (root / "bundles").iterdir() if p.is_dir()]
    assert len(bundles) == 1
    return root / "runs" / "default", bundles[0]


@pytest.mark.slow
def test_onnx_chain_runs_ort_and_openvino_rows_and_skips_paddle(tiny, chain):
    """The ORT/OpenVINO fp32 rows pass their gates against ONNX Runtime's reference; every Paddle Inference and Lite
    row is SKIPPED with the reason."""
    run, _ = chain
    man = {s: json.loads((run / s / "manifest.json").read_text()) for s in ("train", "export", "server", "lite")}
    assert man["train"]["info"]["imported"]["reference"]["graph_optimization"] == "basic"
    assert man["export"]["gates"][0]["status"] == "OK"
    rows = {g["subject"]: g for g in man["server"]["gates"]}
    assert rows["paddle-inference fp32"]["status"] == "SKIPPED" and "x2paddle" in rows["paddle-inference fp32"]["reason"]
    assert rows["onnxruntime fp32"]["status"] == "OK"
    assert rows["openvino fp32"]["status"] in ("OK", "SKIPPED")      # SKIPPED only where OpenVINO is not installed
    assert (run / "server/onnx/model.onnx").read_bytes() == tiny.read_bytes()
    lite = {g["subject"]: g for g in man["lite"]["gates"]}
    assert lite.pop("nothing to convert: the export is an ONNX model")["status"] == "OK"    # what the skips rest on
    assert lite and all(g["status"] == "SKIPPED" and "Paddle Lite opt" in g["reason"] for g in lite.values())


# ------------------------------------------------------------------ the ONNX-only bundle: reference = ONNX Runtime basic

def test_a_bundle_reference_is_paddle_by_default_and_only_a_known_engine():
    from pipeline.bundle import layout

    assert layout.reference_of({}) == ("paddle-inference", layout.FP32_PREFIX)       # bundles made before the record
    assert layout.reference_of({"reference": {"engine": "onnxruntime"}}) == ("onnxruntime", layout.ONNX_MODEL)
    for bad in ({"engine": "openvino"}, {"engine": "../x"}, "onnxruntime"):
        with pytest.raises(IntegrityError, match="reference engine"):
            layout.reference_of({"reference": bad})


@pytest.mark.slow
def test_onnx_bundle_names_onnx_runtime_as_its_reference(tiny, chain):
    from pipeline.bundle import layout
    from pipeline.bundle.format import load_infer_config

    run, b = chain
    cfg, man = load_infer_config(b), json.loads((b / layout.MANIFEST).read_text())
    assert cfg["reference"]["engine"] == "onnxruntime" and cfg["reference"]["graph_optimization"] == "basic"
    assert man["reference"] == cfg["reference"] and layout.reference_of(cfg) == ("onnxruntime", layout.ONNX_MODEL)
    assert (b / layout.ONNX_MODEL).read_bytes() == tiny.read_bytes()
    assert not (b / (layout.FP32_PREFIX + ".pdmodel")).exists()
    assert "Reference: **onnxruntime fp32**" in (b / layout.MODEL_CARD).read_text()
    # the samples are the export's reference outputs, which ONNX Runtime (basic) wrote
    with np.load(b / layout.SAMPLES_EXPECTED) as z, np.load(run / "export/reference.npz") as r:
        assert np.array_equal(z["outputs"], r["outputs"][:len(z["outputs"])])


@pytest.mark.slow
def test_onnx_bundle_verifies_folder_and_archive(chain):
    from pipeline.bundle.verify import verify_or_raise

    _, b = chain
    for path in (b, b.with_name(b.name + ".tar.gz")):
        report = verify_or_raise(path)
        names = [c["name"] for c in report["checks"]]
        assert report["ok"] and "reference onnxruntime fp32 (basic) max_abs_diff on samples" in names, names
        assert not any(n.startswith("server fp32") for n in names)
    res = pipeline_cli("verify", b)
    assert res.returncode == 0 and "verified:" in res.stdout, res.stderr[-2000:]


@pytest.mark.slow
def test_onnx_bundle_serves_predict(chain):
    from fastapi.testclient import TestClient

    from pipeline.bundle import layout
    from pipeline.serving.app import create_app

    _, b = chain
    with np.load(b / layout.SAMPLES_EXPECTED) as z:
        files, expected = [str(f) for f in z["files"]], z["outputs"]
    with TestClient(create_app(b)) as c:
        health = c.get("/health").json()
        assert health["status"] == "ok" and c.app.state.engine.kind in ("onnxruntime", "openvino")
        for f, want in zip(files[:3], expected):
            r = c.post("/predict?outputs=1", files={"file": ("x.png", (b / f).read_bytes(), "image/png")})
            assert r.status_code == 200, r.text
            got = np.asarray(r.json()["outputs"], np.float32).reshape(want.shape)
            # fp32 engines on the reference's file: within the bundle's fp32 sample tolerance (its scale)
            assert np.abs(got - want).max() <= 1e-4 + 1e-5 * np.abs(want).max()
            assert r.json()["predictions"][0]["index"] == int(want.argmax())


@pytest.mark.slow
def test_onnx_bundle_tampering_is_caught(chain, tmp_path):
    import shutil

    from pipeline.bundle import layout
    from pipeline.bundle.format import verify_hashes
    from pipeline.bundle.verify import verify_bundle, verify_or_raise
    from pipeline.core.artifacts import sha256_file

    _, b = chain
    flipped = shutil.copytree(b, tmp_path / "flipped")
    with open(flipped / layout.ONNX_MODEL, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(IntegrityError, match=f"modified: {layout.ONNX_MODEL}"):
        verify_hashes(flipped)
    # another model of the same shapes, with the manifest rehashed: only running the reference catches it
    swapped = shutil.copytree(b, tmp_path / "swapped")
    _tiny_onnx(swapped / layout.ONNX_MODEL, seed=1)
    man = json.loads((swapped / layout.MANIFEST).read_text())
    man["files"][layout.ONNX_MODEL] = {"sha256": sha256_file(swapped / layout.ONNX_MODEL),
                                       "bytes": (swapped / layout.ONNX_MODEL).stat().st_size}
    (swapped / layout.MANIFEST).write_text(json.dumps(man))
    report = verify_bundle(swapped)
    bad = [c["name"] for c in report["checks"] if not c["passed"]]
    assert not report["ok"] and "reference onnxruntime fp32 (basic) max_abs_diff on samples" in bad, bad
    with pytest.raises(IntegrityError, match="no longer reproduce"):
        verify_or_raise(swapped)


# ------------------------------------------------------------------ model.source=pir: the yml fills unset keys
_DET_YML = """PreProcess:
  transform_ops:
  - DecodeImage: {channel_first: false, img_mode: BGR}
  - DetResizeForTest: {resize_long: 960}
  - NormalizeImage: {mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225], scale: 1./255., order: hwc}
PostProcess: {name: DBPostProcess, thresh: 0.3, box_thresh: 0.6, unclip_ratio: 1.5, max_candidates: 1000}
"""


def test_config_records_the_keys_the_user_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("task: detection\ndetection:\n  thresh: 0.2\n")
    cfg = load_config([f], ["data.height=64"])
    assert {"task", "detection.thresh", "data.height"} <= cfg.user_keys
    assert "detection.box_thresh" not in cfg.user_keys and "data.width" not in cfg.user_keys


def test_yml_fills_only_the_keys_the_user_did_not_set(tmp_path):
    from pipeline.models import pir_yml

    (tmp_path / "inference.yml").write_text(_DET_YML)
    sections = {"data": {"height": 32, "width": 32}, "detection": {"thresh": 0.2, "box_thresh": 0.7}}
    filled = pir_yml.fill(tmp_path, sections, frozenset({"detection.thresh", "data.width"}))
    det = sections["detection"]
    assert det["thresh"] == 0.2 and "detection.thresh" not in filled           # the user's value stays
    assert det["box_thresh"] == 0.6 and det["limit_type"] == "resize_long" and det["limit_side_len"] == 960
    assert det["mean"] == [0.485, 0.456, 0.406] and filled["detection.unclip_ratio"] == 1.5
    assert sections["data"] == {"height": 960, "width": 32}                     # pages the rule keeps; width set
    untouched = {"data": {}, "detection": {"thresh": 0.2}}
    assert pir_yml.fill(tmp_path, untouched, None) == {} and untouched["detection"] == {"thresh": 0.2}
