"""Real architectures on defaults: zoo builders, mixed-precision emulation that follows Paddle's op
lists, general Lite repair, BN recalibration, a user model by import path, and the fast conformance subset."""
import json
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from pipeline.engines import amp_emulation, lite, program_repair
from pipeline.engines.paddle_infer import InferenceEngine, make_fp16_emulated
from tests.clirun import pipeline_cli as _cli

ROOT = Path(__file__).resolve().parent.parent


def _export(layer, shape, prefix):
    from paddle.static import InputSpec
    layer.eval()
    spec = [InputSpec([None, *shape], "float32", "x")]
    paddle.jit.save(paddle.jit.to_static(layer, input_spec=spec, full_graph=True), str(prefix), input_spec=spec)
    return str(prefix)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    sys.path.insert(0, str(ROOT))
    from tests.user_models import HybridNet
    paddle.seed(0)
    prefix = _export(HybridNet(10), [1, 16, 16], tmp_path_factory.mktemp("hybrid") / "inference")
    x = np.random.default_rng(0).standard_normal([8, 1, 16, 16]).astype("float32")
    return prefix, x


def test_zoo_builds_every_registered_model():
    from pipeline.models.registry import BUILTIN, build_model
    from pipeline.core.errors import ConfigError
    for task, models in BUILTIN.items():
        for name in models:
            m = build_model(task, name, {}, {"num_classes": 5, "in_channels": 3, "height": 32, "width": 64,
                                             "image_size": 32})
            assert isinstance(m, paddle.nn.Layer), name
    with pytest.raises(ConfigError, match="not a classification model: neither a built-in one"):
        build_model("classification", "crnn", {}, {"num_classes": 5})


def test_fp16_emulation_follows_paddle_op_lists(hybrid, tmp_path):
    prefix, x = hybrid
    info = make_fp16_emulated(prefix, tmp_path / "emu" / "model")
    # as Paddle Inference's mixed-precision pass: layer_norm/softmax run in fp16 too (only the pass's default
    # black list stays fp32), and layer_norm's Mean/Variance (outputs inference never fills: casting them crashed
    # Paddle Inference) are never given casts
    assert {"conv2d", "matmul_v2", "layer_norm", "softmax"} <= set(info["low_precision_ops"])
    assert set(info["fp32_ops_black_list"]) <= amp_emulation.INFERENCE_BLACK
    # conv (+ bias) + batch_norm are one fused op on a GPU predictor: only the normalised output is rounded
    assert info["batch_norms_folded"] >= 3
    fp32, emu = InferenceEngine(prefix), InferenceEngine(tmp_path / "emu" / "model", "fp16")
    a, b = fp32.run(x), emu.run(x)
    assert emu.effective_precision == "fp16-emulated" and 0 < np.abs(a - b).max() < 0.05 * np.abs(a).max()
    bf = make_fp16_emulated(prefix, tmp_path / "bf16" / "model", "bf16")
    eng = InferenceEngine(tmp_path / "bf16" / "model")
    assert bf["label"] == eng.effective_precision == "bf16-emulated"
    # bf16 keeps 8 mantissa bits to fp16's 11: its rounding error is the larger one
    assert np.abs(eng.run(x) - a).max() > np.abs(b - a).max()


def test_lite_repair_is_general_and_opt_accepts_it(hybrid, tmp_path):
    prefix, x = hybrid
    fixed = tmp_path / "fixed.pdmodel"
    repairs = program_repair.repair_for_lite(prefix + ".pdmodel", fixed)
    text = "\n".join(repairs)
    # restored from Paddle's own op definitions, not a per-op table
    assert "swish@" in text and "beta=1.0" in text and "flatten_contiguous_range@" in text and "XShape" in text
    assert program_repair.repair_for_lite(fixed, fixed) == []
    with pytest.raises(lite.EngineCrash, match="beta"):          # what users hit without the repair
        lite.convert(prefix + ".pdmodel", prefix + ".pdiparams", tmp_path / "raw", target="arm", repair=False)
    res = lite.convert(prefix + ".pdmodel", prefix + ".pdiparams", tmp_path / "x86", target="x86")
    y = lite.run(res.path, x, expected_shape=[-1, 1, 16, 16])
    assert np.abs(y - InferenceEngine(prefix).run(x)).max() < 1e-4


def test_bn_recalibrate_averages_batch_statistics():
    from pipeline.training import bn
    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Conv2D(1, 4, 3), paddle.nn.BatchNorm2D(4))
    layer = bn.bn_layers(net)[0]
    layer._mean.set_value(paddle.full([4], 50.0))                   # unsettled running statistics
    x = np.random.default_rng(0).standard_normal([64, 1, 8, 8]).astype("float32") + 3.0
    info = bn.recalibrate(net, x, batch_size=16)
    assert info == {"layers": 1, "batches": 4, "samples": 64}
    with paddle.no_grad():
        conv_out = net[0](paddle.to_tensor(x)).numpy()
    np.testing.assert_allclose(layer._mean.numpy(), conv_out.mean(axis=(0, 2, 3)), rtol=1e-4, atol=1e-4)
    assert layer._momentum == 0.9 and not net.training


@pytest.mark.slow
def test_user_model_by_import_path_train_export_deploy_on_default_gates(tmp_path):
    """`make train export deploy` (the same CLI calls) with a user model on every default parity gate. The
    low-precision rows are serving candidates here (server.roles): whether an int8 or bf16 kernel holds depends on the
    CPU (OpenVINO int8 moved this model's logits by 0.94 of their scale on an AMX Xeon, ONNX Runtime's by 0.21), so a
    failed one is EXCLUDED, gated and reported, never served; fp32 on every engine must pass."""
    args = ["-c", "configs/smoke.yaml", "-o", f"run.root={tmp_path}", "-o", "run.name=user",
            "-o", f"bundle.root={tmp_path}/bundles", "-o", "model.name=tests.user_models:HybridNet",
            "-o", "lite.arm=[fp32,int8]", "-o", "server.roles={int8: candidate, bf16: candidate}"]
    for stages in (["train"], ["export"], ["server", "lite", "bundle"]):
        res = _cli("run", *stages, *args)
        assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "user"
    for stage in ("train", "export", "server", "lite", "bundle"):
        man = json.loads((run / stage / "manifest.json").read_text())
        assert man["status"] == "OK", stage
        for g in man["gates"]:
            allowed = ("OK", "SKIPPED", "UNVERIFIED") + (("EXCLUDED",) if g["precision_requested"] in ("int8", "bf16") else ())
            assert g["status"] in allowed, (stage, g["subject"], g["status"], g.get("reason"))
    lite_man = json.loads((run / "lite" / "manifest.json").read_text())
    assert any("swish@" in r and "beta" in r for r in lite_man["info"]["restored_for_lite"])
    server = json.loads((run / "server" / "manifest.json").read_text())
    assert "layer_norm" in server["info"]["fp16_emulation"]["low_precision_ops"]
    fp16 = next(g for g in server["gates"] if g["subject"] == "paddle-inference fp16")
    assert {"max_abs_diff", "argmax_agreement", "accuracy_drop"} <= {c["name"] for c in fp16["checks"]}


@pytest.mark.slow
def test_conformance_fast_subset_end_to_end(tmp_path):
    """make test's slice of `make conformance`: an attention/LayerNorm/swish recogniser, whole chain + verify,
    tiny data; parity gates at their defaults."""
    # one epoch on 256 lines leaves svtr_lcnet near chance: every low-precision row MARKED, allowed here; its strict
    # agreement is then noise (0.30-0.81), so those rows are candidates: a failure is EXCLUDED (then MARKED) and the
    # chain goes on to Lite, the bundle and verify, which this slice exists to run
    res = _cli("conformance", "--fast", "--root", str(tmp_path), "--max-marked-share", "1",
               "-o", "server.roles={fp16: candidate, bf16: candidate, int8: candidate, bf16-emulated: candidate}",
               "-o", "data.num_train=256", "-o", "data.num_val=64",
               "-o", "train.epochs=1", "-o", "server.http.max_requests=8", "-o", "lite.arm=[fp32,int8]",
               "-o", "server.engines=[paddle-inference]")     # ONNX Runtime/OpenVINO rows: make conformance
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "conformance: architecture" in res.stdout
    rows = json.loads((tmp_path / "conformance.json").read_text())["rows"]
    assert {r["arch"] for r in rows} == {"svtr_lcnet"}
    for r in rows:      # one epoch on 256 lines leaves svtr_lcnet near chance: its low-precision rows are MARKED
        assert r["verdict"] in ("OK", "SKIPPED", "UNVERIFIED", "MARKED"), r
        if r["verdict"] != "OK":
            assert r["note"], r
    rows_of = {r["row"] for r in rows}
    assert {"server: paddle-inference fp16", "lite: lite x86 fp32", "verify bundle"} <= rows_of
    md = (tmp_path / "conformance.md").read_text()      # one line of fp32 against chance, then every row
    assert md.count("| svtr_lcnet |") == 1 + sum(r["arch"] == "svtr_lcnet" for r in rows)
    assert "| svtr_lcnet | fp32 seq_accuracy" in md and "chance 0.000, floor 0.200" in md
