"""A user's own paddle.nn.Layer, given by import path, goes through export, Paddle Inference and Lite x86."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_paddle_vision_model_by_import_path(tmp_path):
    args = ["-c", "configs/smoke.yaml", "-o", f"run.root={tmp_path}", "-o", "run.name=user_model",
            "-o", "model.name=paddle.vision.models:mobilenet_v3_small", "-o", "model.args={scale: 0.5}",
            "-o", "data.channels=3", "-o", "data.num_train=256", "-o", "data.num_val=64",
            "-o", "train.epochs=1", "-o", "train.min_metric=0.0", "-o", "server.precisions=[fp32]",
            "-o", "server.http.enable=false", "-o", "lite.arm=[fp32]",
            "-o", "export.gate.atol=1e-3", "-o", "lite.gate.atol=1e-3"]
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "train", "export", "server", "lite", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "user_model"
    lite = json.loads((run / "lite" / "manifest.json").read_text())
    x86 = next(g for g in lite["gates"] if g["subject"] == "lite x86 fp32")
    assert x86["status"] == "OK" and x86["reason"].startswith("executed")
    server = json.loads((run / "server" / "manifest.json").read_text())
    assert server["gates"][0]["status"] == "OK"
    info = json.loads((run / "export" / "info.json").read_text())
    assert info["input_shape"][1] == 3 and info["model"]["name"].endswith("mobilenet_v3_small")
