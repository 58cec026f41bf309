"""Serving the recommended engine, and the KServe v2 protocol spoken to the official tritonclient.

Uses the shared smoke chain (same root and overrides as tests/test_serve.py and tests/test_bundle.py:
whichever module runs first trains, the others hit the stage cache).
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

th = pytest.importorskip("tritonclient.http")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_bundle(tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "smoke-chain"
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "all", "-c", "configs/smoke.yaml",
                          "-o", f"run.root={base}/runs", "-o", f"bundle.root={base}/bundles", "-o", "run.name=smoke",
                          "-o", "train.min_metric=0.05"], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads((base / "runs" / "smoke" / "bundle" / "manifest.json").read_text())["info"]
    return Path(info["bundle"]), base / "runs" / "smoke"


def _samples(folder: Path):
    from pipeline.data.preprocess import decode_image_bytes, to_tensor

    cfg = yaml.safe_load((folder / "infer_config.yaml").read_text())
    with np.load(folder / "samples" / "expected.npz") as z:
        files, expected = list(z["files"]), z["outputs"]
    imgs = np.stack([decode_image_bytes((folder / f).read_bytes(), cfg["preprocess"]) for f in files])
    return to_tensor(imgs, cfg["preprocess"]), expected, cfg


def test_every_engine_row_is_gated_and_honestly_labelled(smoke_bundle):
    from pipeline.engines import registry

    _, run = smoke_bundle
    gates = {g["subject"]: g for g in json.loads((run / "server" / "manifest.json").read_text())["gates"]}
    ov_ok, ov_why = registry.available("openvino")     # e.g. not below AVX2 (ONEDNN_MAX_CPU_ISA=SSE41)
    if not ov_ok:       # its fp32 row says why; no int8 row is built without the engine
        assert gates["openvino fp32"]["status"] == "SKIPPED" and ov_why in gates["openvino fp32"]["reason"]
        assert "openvino int8" not in gates
    for subject in ["onnxruntime fp32", "openvino fp32", "onnxruntime int8"] + (["openvino int8"] if ov_ok else []):
        g = gates[subject]
        assert g["status"] in ("OK", "FAIL", "SKIPPED"), g
        if g["status"] != "SKIPPED":
            assert g["checks"] and g["checks"][0]["name"] == "finite", g      # gated like every row
    for p in ("cuda", "tensorrt"):
        g = gates[f"onnxruntime {p} fp32"]
        assert g["status"] == "OK" or (g["status"] == "SKIPPED" and g["reason"].startswith("not run here")), g
    ort8, ov8 = gates["onnxruntime int8"], gates.get("openvino int8", {})
    if ort8["precision_effective"] == "int8":            # the label needs int8 kernels in ORT's optimized graph
        assert ort8["extra"]["evidence"]["int8_kernels"], ort8
    if ov8.get("precision_effective") == "int8":         # ... and i8/u8 runtime precision in OpenVINO
        assert set(ov8["extra"]["evidence"]["runtime_precision_ops"]) & {"i8", "u8"}, ov8


def test_bundle_carries_onnx_and_the_measured_recommendation(smoke_bundle):
    folder, run = smoke_bundle
    serving = yaml.safe_load((folder / "infer_config.yaml").read_text())["serving"]
    gates = {g["subject"]: g for g in json.loads((run / "server" / "manifest.json").read_text())["gates"]}
    assert (folder / "server" / "onnx" / "model.onnx").is_file()
    assert gates[serving["row"]]["status"] == "OK"          # only a passing row is served
    ranked = {r["engine"]: r for r in serving["ranking"]}   # keyed by row subject ("onnxruntime int8")
    assert serving["row"] in ranked and {c["row"]: c["verdict"] for c in serving["candidates"]}[serving["row"]] == "chosen"
    for row in ranked:
        assert gates[row]["status"] == "OK"
        if row.endswith(" fp32"):
            t = serving["tuning"][row.split(" ")[0]]
            assert t["batch1"]["threads"] >= 1 and t["batchN"]["threads"] >= 1
    http = gates["http /predict as served"]    # the recommended row as served, gated at its precision
    assert http["extra"]["engine"] == serving["engine"] and http["status"] == "OK"
    assert http["precision_requested"] == serving["precision"]


def test_serve_uses_the_recommended_engine_unless_overridden(smoke_bundle):
    from pipeline.core.errors import ConfigError
    from pipeline.serving.app import create_app

    folder, _ = smoke_bundle
    serving = yaml.safe_load((folder / "infer_config.yaml").read_text())["serving"]
    assert create_app(folder).state.engine.kind == serving["engine"]
    ort_engine = create_app(folder, engine="onnxruntime").state.engine
    assert not ort_engine.settings["batch1"]["spinning"] and not ort_engine.settings["batchN"]["spinning"]
    assert create_app(folder, engine="paddle-inference").state.engine.kind == "paddle-inference"
    with pytest.raises(ConfigError, match="unknown engine"):
        create_app(folder, engine="tensorflow")


@pytest.mark.parametrize("engine", [None, "paddle-inference"])
def test_tritonclient_outputs_equal_bundle_samples(smoke_bundle, engine):
    from tritonclient.utils import InferenceServerException

    from pipeline.serving.http_common import BackgroundServer

    from pipeline.serving.app import create_app

    from tests.conftest import served_limit

    folder, _ = smoke_bundle
    x, expected, _ = _samples(folder)
    recommended = (yaml.safe_load((folder / "infer_config.yaml").read_text())["serving"] or {}).get("engine")
    # the recommended engine serves at its recommended precision (a low-precision row on a bf16 / VNNI CPU)
    limit = served_limit(folder, expected) if engine in (None, recommended) else 1e-4
    with BackgroundServer(create_app(folder, engine=engine)) as srv:
        c = th.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(folder.name)
            meta = c.get_model_metadata(folder.name)
            assert meta["inputs"][0]["datatype"] == "FP32" and meta["inputs"][0]["shape"][1:] == list(x.shape[1:])
            for binary in (True, False):                   # binary tensor extension (client default) and JSON
                inp = th.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=binary)
                res = c.infer(folder.name, [inp], outputs=[th.InferRequestedOutput("output", binary_data=binary)])
                assert np.abs(res.as_numpy("output") - expected).max() < limit
                one = th.InferInput("x", [1, *x.shape[1:]], "FP32")
                one.set_data_from_numpy(x[:1], binary_data=binary)
                assert np.abs(c.infer(folder.name, [one]).as_numpy("output") - expected[:1]).max() < limit

            def status_of(call) -> str:
                with pytest.raises(InferenceServerException) as e:
                    call()
                assert e.value.message()                   # {"error": "..."} carried a message
                return e.value.status()

            assert status_of(lambda: c.infer("no-such-model", [inp])) == "404"
            assert status_of(lambda: c.get_model_metadata(folder.name, model_version="7")) == "404"
            bad = th.InferInput("x", [1, 1, 3, 3], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 1, 3, 3), np.float32))
            assert status_of(lambda: c.infer(folder.name, [bad])) == "400"
            typed = th.InferInput("x", list(x[:1].shape), "FP64")
            typed.set_data_from_numpy(x[:1].astype(np.float64))
            assert status_of(lambda: c.infer(folder.name, [typed])) == "400"
            nan = th.InferInput("x", list(x[:1].shape), "FP32")
            nan.set_data_from_numpy(np.full(x[:1].shape, np.nan, np.float32))
            assert status_of(lambda: c.infer(folder.name, [nan])) == "400"
        finally:
            c.close()
