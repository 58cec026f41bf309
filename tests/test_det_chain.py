"""Integration: the tiny detection chain through the CLI (train → export → server → lite → bundle),
gated on probability maps and hmean, then `verify` on the archive and `serve` /predict returning boxes."""
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from pipeline.data.preprocess import png_bytes
from tests.clirun import pipeline_cli as cli

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def det_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cli("run", "all", "-c", "configs/smoke_ocr_det.yaml", "-o", f"run.root={root}",
        "-o", f"bundle.root={root}/bundles", check=True)
    return root


def _manifest(root, stage):
    return json.loads((root / "smoke_ocr_det" / stage / "manifest.json").read_text())


def test_every_row_gated_on_maps_and_hmean(det_run):
    for stage in ("train", "export", "server", "lite", "bundle"):
        man = _manifest(det_run, stage)
        assert man["status"] == "OK", stage
        assert all(g["status"] in ("OK", "SKIPPED") for g in man["gates"]), stage
    server = {g["subject"]: g for g in _manifest(det_run, "server")["gates"]}
    fp32 = server["paddle-inference fp32"]
    assert fp32["metric"] == "hmean" and {c["name"] for c in fp32["checks"]} >= {"finite", "max_abs_diff", "hmean_drop"}
    http = [g for s, g in server.items() if s.startswith("http /predict ")]      # at the served row's precision
    assert len(http) == 1 and http[0]["status"] == "OK"
    lite = {g["subject"]: g for g in _manifest(det_run, "lite")["gates"]}
    assert lite["lite x86 fp32"]["status"] == "OK" and lite["lite x86 fp32"]["value"] is not None


def test_bundle_carries_post_processing_and_verifies(det_run):
    name = _manifest(det_run, "bundle")["info"]["name"]
    bundle = det_run / "bundles" / name
    infer = yaml.safe_load((bundle / "infer_config.yaml").read_text())
    assert infer["task"] == "detection" and infer["primary_metric"] == "hmean"
    post = infer["postprocess"]
    assert post["type"] == "db" and post["thresh"] == 0.5 and post["box_thresh"] == 0.5
    assert {"unclip_ratio", "max_candidates", "min_size", "iou"} <= set(post)
    res = cli("verify", str(bundle) + ".tar.gz", check=True)
    assert "lite x86 fp32" in res.stdout


def test_serve_predict_returns_boxes(det_run):
    from fastapi.testclient import TestClient

    from pipeline.serving.app import create_app

    bundle = det_run / "bundles" / _manifest(det_run, "bundle")["info"]["name"]
    body = (bundle / "samples" / "000.png").read_bytes()
    with TestClient(create_app(bundle), raise_server_exceptions=False) as client:
        r = client.post("/predict", content=body, headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        [pred] = r.json()["predictions"]
        assert len(pred["boxes"]) == len(pred["scores"])
        assert all(np.asarray(b).shape == (4, 2) for b in pred["boxes"])
        assert all(0.0 <= s <= 1.0 for s in pred["scores"])
        # the same page at twice the size: boxes come back in its own pixels (twice the model frame's)
        big = np.asarray(Image.open(io.BytesIO(body)).convert("L").resize((320, 320), Image.NEAREST))
        r2 = client.post("/predict", content=png_bytes(big), headers={"content-type": "image/png"})
        [pred2] = r2.json()["predictions"]
        boxes2 = np.asarray(pred2["boxes"]).reshape(-1, 4, 2)
        assert boxes2.size == 0 or (boxes2.max() <= 319 and boxes2.max() > 160)    # not the 160x160 model frame
