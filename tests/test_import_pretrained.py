"""Importing exported models (model.source=inference), pretrained weights (model.pretrained), the weights-moved
check, PaddleOCR recognition conventions (use_space_char, probabilities, ppocr preprocessing, dynamic width)."""
import numpy as np
import paddle
import pytest
from PIL import Image

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, NonFiniteError
from pipeline.models import imported
from pipeline.data.preprocess import PPOCR_PAD, fit_image, to_tensor
from pipeline.ocr.text_metrics import is_probabilities
from pipeline.tasks.recognition import RecognitionTask, charset_of

from clirun import ROOT, pipeline_cli


class _Tiny(paddle.nn.Layer):
    def __init__(self, classes=5):
        super().__init__()
        self.conv = paddle.nn.Conv2D(1, 4, 3, padding=1)
        self.fc = paddle.nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(self.conv(x).mean(axis=[2, 3]))


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A small exported classifier: [N, 1, 16, 16] → [N, 5] logits."""
    from paddle.static import InputSpec

    paddle.seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "model"
    folder.mkdir()
    layer = _Tiny()
    layer.eval()
    paddle.jit.save(layer, str(folder / "inference"), input_spec=[InputSpec([None, 1, 16, 16], "float32", "x")])
    return folder


# ------------------------------------------------------------------ import: paths and signatures
def test_resolve_prefix_accepts_folder_prefix_and_file(tiny_export):
    for given in (tiny_export, tiny_export / "inference", tiny_export / "inference.pdmodel"):
        assert imported.resolve_prefix(given) == tiny_export / "inference"


def test_missing_model_is_one_config_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        imported.resolve_prefix(tmp_path)
    assert "model.path" in e.value.message and "inference.pdmodel" in e.value.message


def test_source_inference_without_path_is_refused():
    with pytest.raises(ConfigError, match="model.path is empty"):
        load_config(overrides=["model.source=inference"])


@pytest.mark.parametrize("spec, words", [({"channels": 3, "height": 16, "width": 16}, "channels 1 (data.channels=3)"),
                                         ({"channels": 1, "height": 32, "width": 16}, "height 16 (data.height=32)")])
def test_input_signature_mismatch_names_the_key(tiny_export, spec, words):
    with pytest.raises(ConfigError) as e:
        imported.check_input(imported.resolve_prefix(tiny_export), spec, "classification")
    assert words in e.value.message and "\n" not in e.value.message


def test_import_of_a_classifier_as_recognizer_is_refused(tiny_export, tmp_path):
    res = pipeline_cli("run", "train", "-o", "task=recognition", "-o", "model.source=inference",
                       "-o", f"model.path={tiny_export}", "-o", "data.height=16", "-o", "data.width=16",
                       "-o", "data.num_train=8", "-o", "data.num_val=8", "-o", "data.max_len=2", "-o", "train.nproc=1",
                       "-o", f"run.root={tmp_path}", "-o", "run.quiet=true", timeout=300)
    assert res.returncode != 0
    assert "outputs shape [1, 5]; the recognition task needs [N, T, classes]" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_import_chain_without_labels_keeps_parity_and_says_no_labels(tiny_export, tmp_path):
    """data.source=images: no labels; train reports the metric gate SKIPPED, export's parity gate holds."""
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (20, 24), dtype=np.uint8)).save(imgs / f"{i}.png")
    common = ["-o", "model.source=inference", "-o", f"model.path={tiny_export}", "-o", "data.source=images",
              "-o", f"data.path={imgs}", "-o", "data.height=16", "-o", "data.width=16", "-o", "train.nproc=1",
              "-o", f"run.root={tmp_path}/runs", "-o", "run.quiet=true"]
    res = pipeline_cli("run", "train", "export", "-o", "task=classification", *common, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    import json
    train = json.loads((tmp_path / "runs/default/train/manifest.json").read_text())
    export = json.loads((tmp_path / "runs/default/export/manifest.json").read_text())
    assert train["gates"][0]["status"] == "OK"                       # loaded, signature fits, outputs finite
    assert train["gates"][1]["status"] == "SKIPPED" and "no labels" in train["gates"][1]["reason"]
    assert train["info"]["imported"]["sha256"]["inference.pdmodel"]
    assert export["gates"][0]["status"] == "OK" and export["gates"][0]["checks"][1]["observed"] == 0.0


def test_model_files_enter_the_fingerprint(tiny_export, tmp_path):
    import shutil
    copy = tmp_path / "m"
    shutil.copytree(tiny_export, copy)
    cfg = load_config(overrides=["model.source=inference", f"model.path={copy}"])
    before = cfg.hash_of("model")
    (copy / "inference.pdiparams").write_bytes((copy / "inference.pdiparams").read_bytes() + b"\0")
    assert load_config(overrides=["model.source=inference", f"model.path={copy}"]).hash_of("model") != before


# ------------------------------------------------------------------ pretrained weights
def test_pretrained_key_mismatch_is_reported_and_refused(tmp_path):
    src = _Tiny(classes=5)
    path = tmp_path / "w.pdparams"
    paddle.save(src.state_dict(), str(path))
    with pytest.raises(ConfigError) as e:
        imported.load_params(_Tiny(classes=7), path, allow_partial=False)
    assert "w.pdparams: partial load refused: 2 shape mismatch (e.g. fc.bias)" in e.value.message
    assert "model.allow_partial=true" in e.value.hint
    report = imported.load_params(_Tiny(classes=7), path, allow_partial=True)
    assert len(report["shape_mismatch"]) == 2 and report["loaded"] == 2 and not report["missing"]


def test_pretrained_full_load_copies_values(tmp_path):
    src, dst = _Tiny(), _Tiny()
    path = tmp_path / "w.pdparams"
    paddle.save(src.state_dict(), str(path))
    report = imported.load_params(dst, path, allow_partial=False)
    assert report["loaded"] == 4
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(src.parameters(), dst.parameters()))


def test_jit_loaded_program_fine_tunes_only_with_both_traps_handled(tiny_export):
    prefix = imported.resolve_prefix(tiny_export)
    x, y = paddle.randn([4, 1, 16, 16]), paddle.to_tensor([0, 1, 2, 3])
    for model, moves in ((paddle.jit.load(str(prefix)), False), (imported.trainable(prefix), True)):
        model.train()
        before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
        loss = paddle.nn.functional.cross_entropy(model(x), y)
        if not loss.stop_gradient:
            loss.backward()
            opt.step()
        changed, total = imported.changed_tensors(before, {k: v.numpy() for k, v in model.state_dict().items()})
        assert (changed == total) if moves else changed == 0


def test_unchanged_weights_fail_naming_the_cause(tiny_export):
    from pipeline.training.checks import check_weights_moved

    model = paddle.jit.load(str(imported.resolve_prefix(tiny_export)))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError) as e:
        check_weights_moved(model, state, state, lr=0.001)
    assert "no weight changed" in e.value.message and "stop_gradient=True" in e.value.message
    frozen = _Tiny()
    for p in frozen.parameters():
        p.stop_gradient = True
    state = {k: v.numpy() for k, v in frozen.state_dict().items()}
    with pytest.raises(NonFiniteError, match="frozen"):
        check_weights_moved(frozen, state, state, lr=0.001)


def test_vanishing_lr_moves_nothing_and_says_lr(tiny_export):
    """A learning rate that only nudges exact zeros (Adam's first step is ~lr per element: 0 -> 1e-30, every other
    value rounds back to itself) changed bits but moved no tensor: the check fails and names train.lr, as a run with
    train.lr=1e-30 on PP-OCRv4 rec did (8 of 234 tensors had changed bits and passed the check before)."""
    from pipeline.training.checks import check_weights_moved

    model = imported.trainable(imported.resolve_prefix(tiny_export))
    with paddle.no_grad():
        model.parameters()[0].set_value(paddle.zeros_like(model.parameters()[0]))     # exact zeros, as in v4 rec
    model.train()
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    opt = paddle.optimizer.Adam(1e-30, parameters=model.parameters())
    paddle.nn.functional.cross_entropy(model(paddle.randn([4, 1, 16, 16])), paddle.to_tensor([0, 1, 2, 3])).backward()
    opt.step()
    after = {k: v.numpy() for k, v in model.state_dict().items()}
    assert imported.rounding_only(before, after) >= 1 and imported.changed_tensors(before, after)[0] == 0
    with pytest.raises(NonFiniteError) as e:
        check_weights_moved(model, before, after, lr=1e-30)
    assert "train.lr=1e-30 is too small" in e.value.message and "\n" not in e.value.message
    assert imported.changed_tensors(before, {k: v + 1e-3 for k, v in before.items()}) == (len(before), len(before))


# ------------------------------------------------------------------ PaddleOCR recognition conventions
def test_use_space_char_appends_the_space_and_the_error_names_it(tmp_path):
    d = tmp_path / "dict.txt"
    d.write_text("a\nb\nc\n", encoding="utf-8")
    assert charset_of({"charset": str(d), "use_space_char": True}) == "abc "
    assert charset_of({"charset": str(d), "use_space_char": False}) == "abc"
    info = {"charset": "abc", "width": 32, "max_len": 2}
    with pytest.raises(ConfigError) as e:
        RecognitionTask().check_output_shape([1, 8, 5], info)       # blank + abc + space
    assert "use_space_char" in e.value.hint and "appends a space" in e.value.hint


def test_probabilities_are_detected_and_ctc_gets_them_once():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 8, 5)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert is_probabilities(probs) and not is_probabilities(logits)
    labels = paddle.to_tensor(np.array([[1, 2, -1], [3, -1, -1]]))
    from_logits = RecognitionTask().loss(paddle.to_tensor(logits), labels)
    from_probs = RecognitionTask({"outputs": "probabilities"}).loss(paddle.to_tensor(probs), labels)
    assert abs(float(from_logits) - float(from_probs)) < 1e-4           # no second softmax
    from pipeline.core.gates import output_kind
    assert output_kind(RecognitionTask({"outputs": "probabilities"})) == "probabilities"
    assert output_kind(RecognitionTask()) == "logits"


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and back: what a bf16 softmax kernel hands out."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def test_a_bf16_softmax_is_still_probabilities_and_keeps_its_line_scores():
    """Rows of a bf16 softmax sum to 1 +- a few 1e-3 (oneDNN bf16 on AVX-512: 0.003); taken for logits, they were
    softmaxed again and every line's score fell under drop_score: the system read nothing (real-ocr, Zen 4)."""
    from pipeline.ocr.system import _line_scores

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 40, 6625)).astype(np.float32)
    logits[np.arange(6)[:, None], np.arange(40)[None, :], rng.integers(1, 6625, size=(6, 40))] += 14.0
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    rounded = _bf16(probs)
    assert np.abs(rounded.astype(np.float64).sum(-1) - 1).max() > 1e-3      # the case that broke
    assert is_probabilities(rounded) and not is_probabilities(_bf16(logits))
    np.testing.assert_allclose(_line_scores(rounded), _line_scores(probs), atol=0.01)
    assert min(_line_scores(rounded)) > 0.5


def test_elementwise_failure_with_identical_text_says_so():
    from pipeline.core.config import Tolerance
    from pipeline.core.gates import Gate, evaluate_tol

    rng = np.random.default_rng(1)
    ref = rng.normal(size=(4, 6, 5)).astype(np.float32)
    ref[..., 1] += 10                                                   # a clear winner everywhere
    cand = ref + 0.01
    gate = evaluate_tol(Gate("server", "x", "fp32", "fp32", "seq_accuracy"), cand, ref,
                        Tolerance(atol=1e-4, rtol=0.0, metric_delta=0.0, min_agreement=0.99), None,
                        RecognitionTask(), key="server.gates.fp32")
    assert gate.status == "FAIL" and "decoded output (text_agreement) is identical on every sample" in gate.reason


def test_ppocr_preprocessing_bgr_keep_ratio_and_dynamic_width():
    img = Image.new("RGB", (200, 20), (10, 20, 30))             # aspect 10: 480 wide at height 48
    fixed = {"height": 48, "width": 320, "resize": "ppocr_rec", "color": "bgr", "mean": 0.5, "std": 0.5}
    a = fit_image(img, fixed)
    assert a.shape == (48, 320, 3)                                # squeezed to the fixed width
    b = fit_image(img, {**fixed, "dynamic_width": True})
    assert b.shape == (48, 480, 3)                                # its own width
    short = fit_image(Image.new("RGB", (20, 20), (10, 20, 30)), fixed)
    assert (short[:, 48:] == PPOCR_PAD).all() and (short[:, :48, 0] == 10).all()
    x = to_tensor(short[None], fixed)
    assert x.shape == (1, 3, 48, 320)
    assert np.isclose(x[0, 0, 0, 0], (30 / 255 - 0.5) / 0.5) and np.isclose(x[0, 2, 0, 0], (10 / 255 - 0.5) / 0.5)


def test_batch_sizes_follow_the_model_size(tiny_export, v4_rec):
    from pipeline.engines.perf import activation_bytes, batch_for

    tiny = imported.resolve_prefix(tiny_export)
    assert batch_for(tiny, [1, 1, 16, 16], 4096, 64) == 64
    per = activation_bytes(tiny, [1, 1, 16, 16])
    assert batch_for(tiny, [1, 1, 16, 16], 1, 64) == min(64, 2 ** 20 // per)
    big = batch_for(v4_rec["rec"] / "inference", [1, 3, 48, 320], 4096, 64)     # PP-OCRv4 rec: 523 MB bound
    assert 1 <= big <= 8


def test_verify_sample_tolerance_comes_from_the_bundle():
    from pipeline.bundle.verify_model import _checks

    expected = np.zeros((2, 3), np.float32)
    out = expected + 5e-4
    cfg = {"task": "classification", "postprocess": {"labels": ["a", "b", "c"]}}
    loose = _checks("e", out, expected, {**cfg, "sample_check": {"atol": 1e-3, "rtol": 0.0}})
    strict = _checks("e", out, expected, {**cfg, "sample_check": {"atol": 1e-4, "rtol": 0.0}})
    assert all(c["passed"] for c in loose) and not all(c["passed"] for c in strict)
    assert any(c["key"] == "bundle.sample_atol" for c in strict)


# ------------------------------------------------------------------ the real PP-OCRv4 recognizer
@pytest.fixture(scope="module")
def v4_rec():
    from pipeline.ocr import ppocr_models

    return ppocr_models.fetch()


def _v4_infer_cfg(v4_rec) -> dict:
    charset = charset_of({"charset": str(v4_rec["keys"]), "use_space_char": True})
    return {"task": "recognition", "input": {"shape": [None, 3, 48, -1]},
            "preprocess": {"height": 48, "width": 320, "channels": 3, "mean": 0.5, "std": 0.5,
                           "resize": "ppocr_rec", "color": "bgr", "dynamic_width": True},
            "postprocess": {"type": "ctc_greedy", "blank": 0, "charset": charset, "outputs": "probabilities"}}


def test_v4_rec_served_at_each_lines_own_width(v4_rec):
    """/predict reads a long line at its natural width (48 x ~1000 px); squeezed into 320 px it is lost."""
    import difflib

    import httpx

    from pipeline.serving.http_common import BackgroundServer

    from pipeline.serving.predict import create_app_from_model

    cfg = _v4_infer_cfg(v4_rec)
    body = (ROOT / "tests/data/real_images/en_rec.jpg").read_bytes()
    want = "To facilitate the shot type analysis in videos, we collect MovieShots, a large-scale"
    texts = {}
    for dynamic in (True, False):
        c = {**cfg, "preprocess": {**cfg["preprocess"], "dynamic_width": dynamic}}
        app = create_app_from_model(str(v4_rec["rec"] / "inference"), c, threads=2)
        with BackgroundServer(app) as srv:
            r = httpx.post(f"{srv.url}/predict", content=body, headers={"content-type": "image/jpeg"}, timeout=120)
        assert r.status_code == 200, r.text
        texts[dynamic] = r.json()["predictions"][0]
    own = difflib.SequenceMatcher(None, texts[True], want).ratio()
    squeezed = difflib.SequenceMatcher(None, texts[False], want).ratio()
    assert own > 0.9 and squeezed < 0.5, texts


@pytest.mark.slow
def test_v4_rec_import_and_export_parity(v4_rec, tmp_path):
    """configs/ppocr_v4_rec.yaml through train (import) and export on a few lines: the real lines are read
    right, outputs are recognised as probabilities, the copied program reproduces the reference exactly."""
    import json

    from pipeline.tasks import get_task

    res = pipeline_cli("run", "train", "export", "-c", "configs/ppocr_v4_rec.yaml", "-o", f"run.root={tmp_path}",
                       "-o", "data.num_val=6", "-o", "data.num_train=8", "-o", "run.quiet=true", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "ppocr_v4_rec"
    train = json.loads((run / "train/manifest.json").read_text())
    record = train["info"]["imported"]
    assert record["outputs"] == "probabilities" and record["input"] == [-1, 3, 48, -1]
    assert record["output_per_sample"] == [40, 6625]
    export = json.loads((run / "export/manifest.json").read_text())
    assert export["gates"][0]["status"] == "OK" and export["info"]["input_spec"] == [None, 3, 48, None]
    info = json.loads((run / "export/info.json").read_text())
    with np.load(run / "export/reference.npz") as z:
        texts = get_task("recognition", info["postprocess"]).decode(z["outputs"][:2], info["postprocess"])
    assert texts == ["韩国小馆", "在中国作家协会第三届儿童文学"]
