"""Gates that mean something on probabilities, and an fp16 emulation that rounds what Paddle Inference's
mixed-precision pass rounds (tiny synthetic arrays and a tiny static program: seconds)."""
from pathlib import Path

import numpy as np
import paddle
import pytest

from pipeline.core.config import Tolerance
from pipeline.engines import amp_emulation
from pipeline.core.gates import Gate, evaluate_tol, output_kind, parity_limits
from pipeline.tasks.classification import ClassificationTask
from pipeline.tasks.detection import DetectionTask

FP32 = Tolerance(atol=1e-4, rtol=1e-5, metric_delta=0.0, min_agreement=0.99, prob_atol=1e-3)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _gate(task, cand, ref, tol=FP32):
    return evaluate_tol(Gate("server", "row", "fp32", "fp32", task.primary_metric), cand, ref, tol, None, task,
                        key="server.gates.fp32")


def test_each_output_kind_has_its_own_bound():
    assert parity_limits("logits", 1e-4, 1e-5, 1e-3) == (1e-4, 1e-5, "atol/rtol")
    assert parity_limits("probabilities", 1e-4, 1e-5, 1e-3) == (1e-3, 0.0, "prob_atol")
    assert output_kind(DetectionTask()) == "probabilities" and output_kind(ClassificationTask()) == "logits"
    assert output_kind(ClassificationTask({"outputs": "probabilities"})) == "probabilities"


def test_tiny_probabilities_do_not_blow_up_and_real_moves_still_fail():
    task = ClassificationTask({"outputs": "probabilities"})
    ref = np.array([[0.999999, 1e-6, 1e-12], [0.2, 0.7, 0.1]], np.float32)
    tiny = ref.copy()
    tiny[0, 1:] = [1e-10, 1e-6]          # log-probabilities would differ by 9.2 and 13.8: a non-event
    gate = _gate(task, tiny, ref)
    assert gate.status == "OK" and gate.extra["compared_as"] == "probabilities"
    moved = ref.copy()
    moved[1] = [0.2, 0.69, 0.11]         # 0.01 of probability moved: what the bound is for
    gate = _gate(task, moved, ref)
    assert gate.status == "FAIL" and "server.gates.fp32.prob_atol" in gate.reason
    # ... and the same class wins everywhere: the message says the answers did not move
    assert "decoded output (argmax_agreement) is identical on every sample" in gate.reason


def test_logits_keep_their_tight_scale_relative_bound():
    task = ClassificationTask()
    ref = np.array([[10.0, -3.0, 1.0]], np.float32)
    assert _gate(task, ref + 1e-4, ref).status == "OK"                      # 1e-4 + 1e-5 x 10
    gate = _gate(task, ref + 5e-4, ref)
    assert gate.status == "FAIL" and "server.gates.fp32.atol/rtol" in gate.reason
    assert gate.extra["compared_as"] == "logits"


def _square(y0, x0, size=24, h=64):
    m = np.zeros((1, 1, h, h), np.float32)
    m[0, 0, y0:y0 + size, x0:x0 + size] = 0.95
    return m


def test_detection_map_with_the_same_boxes_gets_the_explaining_message():
    task = DetectionTask({"thresh": 0.3, "box_thresh": 0.5, "unclip_ratio": 1.5, "max_candidates": 100})
    ref = _square(16, 16)
    cand = ref.copy()
    cand[0, 0, 30, 30] = 0.5                                                 # one pixel moved by 0.45, inside the box
    gate = _gate(task, cand, ref)
    checks = {c.name: c for c in gate.checks}
    assert checks["box_agreement"].observed == 1.0 and not checks["max_abs_diff"].passed
    assert "decoded output (box_agreement) is identical on every sample" in gate.reason
    gone = _gate(task, _square(40, 36, size=20), ref, Tolerance(metric_delta=0.0, min_agreement=0.99, prob_atol=0.99,
                                                                  atol=1e-4))
    assert gone.status == "FAIL" and "box_agreement" in gone.reason          # another box: agreement bites


def test_a_gate_that_cannot_fail_for_probabilities_is_refused():
    from pipeline.core.errors import ConfigError

    with pytest.raises(ValueError, match="cannot fail"):
        Tolerance(metric_delta=1.0)
    with pytest.raises(ValueError, match="prob_atol"):
        Tolerance(atol=0.1, prob_atol=1.0, metric_delta=0.0)                 # a probability moves by <= 1 anyway
    logits_only = Tolerance(atol=0.1, metric_delta=1.0)                      # fine for logits ...
    ref = _softmax(np.zeros((2, 3), np.float32))
    assert _gate(ClassificationTask(), ref, ref, logits_only).status == "OK"
    with pytest.raises(ConfigError, match="server.gates.fp32: cannot fail .* probabilities .*prob_atol"):
        _gate(ClassificationTask({"outputs": "probabilities"}), ref, ref, logits_only)     # ... refused for probabilities


def _save_static(prefix, shape, build):
    """Save the static program `build(x)` of one float32 input `x` of `shape` as an inference model."""
    paddle.enable_static()
    try:
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", shape, "float32")
            y = build(x)
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(startup)
        paddle.static.save_inference_model(str(prefix), [x], [y], exe, program=main)
    finally:
        paddle.disable_static()


def _tiny_program(prefix):
    """conv+bn, softmax, layer_norm, sigmoid (fp16 on a GPU predictor) and exp, reduce_sum, conv2d_transpose
    (the pass's default black list: kept fp32)."""
    def build(x):
        h = paddle.static.nn.batch_norm(paddle.static.nn.conv2d(x, 4, 3, padding=1))
        h = paddle.nn.functional.softmax(h, axis=1)
        h = paddle.static.nn.conv2d_transpose(h, 4, filter_size=2, stride=2)
        h = paddle.static.nn.layer_norm(h, begin_norm_axis=1)
        h = paddle.exp(h) + paddle.sum(h, axis=1, keepdim=True)
        return paddle.nn.functional.sigmoid(h)
    _save_static(prefix, [None, 2, 8, 8], build)


def test_emulation_rounds_what_the_inference_pass_runs_in_fp16(tmp_path):
    from pipeline.engines.paddle_infer import InferenceEngine, make_fp16_emulated

    _tiny_program(tmp_path / "m")
    info = make_fp16_emulated(tmp_path / "m", tmp_path / "emu" / "model")
    # Paddle 2.6 auto_mixed_precision_pass: only its default black list stays fp32, not paddle.static.amp's
    # training list (which would keep softmax/layer_norm fp32)
    assert set(info["fp32_ops_kept"]) == {"exp", "reduce_sum", "conv2d_transpose"} <= amp_emulation.INFERENCE_BLACK
    assert {"conv2d", "softmax", "layer_norm", "sigmoid"} <= set(info["low_precision_ops"])
    assert info["batch_norms_folded"] == 1
    x = np.random.default_rng(0).standard_normal([2, 2, 8, 8]).astype(np.float32)
    a = InferenceEngine(tmp_path / "m", threads=1).run(x)
    b = InferenceEngine(tmp_path / "emu" / "model", "fp16", threads=1).run(x)
    assert np.array_equal(b, b.astype(np.float16).astype(np.float32))          # the sigmoid output is fp16
    assert 0 < np.abs(a - b).max() < 0.01


def test_verify_compares_a_probability_bundle_with_its_own_key():
    from pipeline.bundle.verify_model import _checks

    expected = np.array([[0.9, 0.1], [1e-9, 1.0 - 1e-9]], np.float32)
    out = np.array([[0.9004, 0.0996], [1e-5, 1.0 - 1e-5]], np.float32)      # log p of the 1e-9 class moved 9.2
    cfg = {"task": "text_direction", "postprocess": {"labels": ["0", "180"], "outputs": "probabilities"},
           "sample_check": {"atol": 1e-4, "rtol": 1e-5, "prob_atol": 1e-3}}
    checks = _checks("e", out, expected, cfg)
    assert all(c["passed"] for c in checks) and checks[-1]["key"] == "bundle.sample_prob_atol"
    logits = _checks("e", out, expected, {**cfg, "postprocess": {"labels": ["0", "180"]}})     # same numbers as logits
    assert not all(c["passed"] for c in logits) and logits[-1]["key"] == "bundle.sample_atol/sample_rtol"


def _head_program(prefix):
    """A CTC-like head: linear (matmul_v2 + bias add) then softmax, the output fetched."""
    _save_static(prefix, [None, 4, 16],
                 lambda x: paddle.nn.functional.softmax(paddle.static.nn.fc(x, 32, num_flatten_dims=2), axis=-1))


def _is_fp16(a):
    return np.array_equal(a, a.astype(np.float16).astype(np.float32))


def test_keep_fp32_ops_leaves_the_named_op_types_unrounded_in_the_emulation(tmp_path):
    from pipeline.engines.paddle_infer import InferenceEngine, make_fp16_emulated

    _head_program(tmp_path / "m")
    x = np.random.default_rng(1).standard_normal([3, 4, 16]).astype(np.float32)
    default = make_fp16_emulated(tmp_path / "m", tmp_path / "d" / "model")
    assert "softmax" in default["low_precision_ops"] and default["fp32_ops_user_black_list"] == []
    assert _is_fp16(InferenceEngine(tmp_path / "d" / "model", "fp16", threads=1).run(x))   # softmax output rounded
    # save_inference_model appends scale(1.0) before the fetch: it would round the softmax output again
    keep = ["softmax", "scale", "no_such_op"]
    info = make_fp16_emulated(tmp_path / "m", tmp_path / "k" / "model", keep_fp32_ops=keep)
    assert info["fp32_ops_kept"].get("softmax") == 1 and "softmax" not in info["low_precision_ops"]
    assert info["fp32_ops_user_black_list"] == sorted(keep) and info["fp32_ops_user_absent"] == ["no_such_op"]
    assert {"mul", "elementwise_add"} <= set(info["low_precision_ops"])          # the rest still runs fp16
    out = InferenceEngine(tmp_path / "k" / "model", "fp16", threads=1).run(x)
    assert not _is_fp16(out)                                   # computed in fp32 from the rounded logits
    assert np.allclose(out.sum(-1), 1.0, atol=1e-6)


class _RecordingConfig:
    """Stands in for paddle.inference.Config (no GPU here): records every call."""

    def __init__(self, *args):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a))


def test_keep_fp32_ops_reaches_the_gpu_conversion_and_predictor(tmp_path, monkeypatch):
    from pipeline.engines import paddle_infer as pi
    from pipeline.core.errors import PipelineError

    _head_program(tmp_path / "m")
    seen, cfgs = {}, []
    monkeypatch.setattr(pi, "_require_gpu", lambda what: None)          # guarded: this host has no GPU
    monkeypatch.setattr(pi.pinf, "convert_to_mixed_precision", lambda *a, **k: seen.update(args=a, **k))
    pi.convert_fp16_gpu(tmp_path / "m", tmp_path / "fp16" / "model", keep_fp32_ops=["softmax", "layer_norm"])
    assert seen["black_list"] == {"softmax", "layer_norm"} and seen["keep_io_types"] is True
    assert seen["args"][4] == pi.pinf.PrecisionType.Half and seen["args"][5] == pi.pinf.PlaceType.GPU

    def recording(*a):
        cfgs.append(_RecordingConfig())
        return cfgs[-1]

    def no_predictor(cfg):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(pi.pinf, "Config", recording)
    monkeypatch.setattr(pi.pinf, "create_predictor", no_predictor)
    with pytest.raises(PipelineError, match="no GPU here"):
        pi.InferenceEngine(tmp_path / "m", "fp16", device="gpu", keep_fp32_ops=["softmax", "layer_norm"])
    calls = dict(cfgs[0].calls)
    assert calls["exp_disable_mixed_precision_ops"] == ({"softmax", "layer_norm"},)
    assert calls["enable_use_gpu"][2] == pi.pinf.PrecisionType.Half


def test_the_config_key_drives_both_fp16_paths(monkeypatch):
    """server.fp16.keep_fp32_ops -> the GPU conversion + predictor, or the CPU emulation: one set for both."""
    from types import SimpleNamespace

    from pipeline.core.config import load_config
    from pipeline.engines import paddle_infer as pi
    from pipeline.evaluation import paddle_rows

    cfg = load_config([], ["server.fp16.keep_fp32_ops=[softmax, matmul_v2]"])
    assert cfg.server.fp16.keep_fp32_ops == ["matmul_v2", "softmax"]
    with pytest.raises(Exception, match="op type"):
        load_config([], ["server.fp16.keep_fp32_ops=[Softmax!]"])
    seen = {}

    class Eng:
        evidence, notes = {}, []

        def __init__(self, *a, **k):
            seen["engine"] = k.get("keep_fp32_ops")

    monkeypatch.setattr(pi, "convert_fp16_gpu", lambda p, o, keep_fp32_ops: seen.update(gpu=keep_fp32_ops) or o)
    monkeypatch.setattr(pi, "make_fp16_emulated", lambda p, o, d, keep_fp32_ops: seen.update(cpu=keep_fp32_ops) or
                        {"fp32_ops_user_black_list": sorted(keep_fp32_ops), "fp32_ops_user_absent": []})
    monkeypatch.setattr(pi, "InferenceEngine", Eng)
    monkeypatch.setattr(paddle_rows, "engine_row", lambda *a, **k: "gate")
    monkeypatch.setattr(paddle_rows, "batch_sizes", lambda *a: {})
    ctx = SimpleNamespace(cfg=cfg, out_dir=Path("/nonexistent"), work_dir=Path("/nonexistent"))
    ref = SimpleNamespace(task=None, model_prefix="m", inputs=None)
    assert paddle_rows.fp16_row(ctx, ref, "gpu", {}, {}, ()) == "gate"
    assert seen == {"gpu": ["matmul_v2", "softmax"], "engine": ["matmul_v2", "softmax"]}
    info: dict = {}
    paddle_rows.fp16_row(ctx, ref, "cpu", {}, info, ())
    assert seen["cpu"] == ["matmul_v2", "softmax"] and info["fp16_emulation"]["fp32_ops_user_black_list"] == seen["cpu"]


def test_served_settings_carry_the_list_and_lite_fp16_is_not_vouched_for_by_it():
    """A GPU predictor serving the converted model gets the list it was converted with; Lite's arm fp16 (no black
    list in opt) is not vouched for by an fp16 row that needed one."""
    from types import SimpleNamespace

    from pipeline.engines.registry import profile_options
    from pipeline.bundle.serving_choice import precision_settings
    from stages import lite

    s = precision_settings("paddle-inference", "fp16", None, ["softmax"])
    assert profile_options("paddle-inference", s["batch1"]) == {"ir_optim": True, "keep_fp32_ops": ["softmax"]}
    assert "keep_fp32_ops" not in precision_settings("paddle-inference", "int8", None, ["softmax"])["batch1"]
    row = {"subject": "paddle-inference fp16", "status": "OK", "metric": "m", "value": 0.9,
           "precision_effective": "fp16-emulated", "extra": {"evidence": {"fp32_ops_user_black_list": ["softmax"]}}}
    ctx = SimpleNamespace(input_manifests={"server": {"gates": [row]}})
    assert "softmax" in lite._no_fp16_evidence(ctx)
    row["extra"]["evidence"]["fp32_ops_user_black_list"] = []
    assert lite._no_fp16_evidence(ctx) == ""
    assert lite._voucher(ctx, "fp16").startswith("server 'paddle-inference fp16'")


def test_an_arm_fp16_nb_needs_a_passing_fp16_row_not_the_fp32_one():
    """The fp32 row says nothing about fp16 kernels: without an executed, passing fp16 row the arm fp16 .nb is
    SKIPPED (never converted, never vouched for by fp32)."""
    from types import SimpleNamespace

    from stages import lite

    fp32 = {"subject": "paddle-inference fp32", "status": "OK", "metric": "m", "value": 0.9,
            "precision_effective": "fp32", "extra": {}}
    fp16 = {**fp32, "subject": "paddle-inference fp16", "status": "FAIL", "precision_effective": "fp16-emulated"}
    for rows, why in (([fp32], "no such row ran"), ([fp32, fp16], "it is FAIL")):
        ctx = SimpleNamespace(input_manifests={"server": {"gates": rows}})
        assert why in lite._no_fp16_evidence(ctx)
        assert lite._voucher(ctx, "fp16").startswith("nothing")
    fp16["status"] = "OK"
    assert lite._no_fp16_evidence(ctx) == "" and "fp16-emulated" in lite._voucher(ctx, "fp16")
