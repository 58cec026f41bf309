"""Recognition task: CTC decoding, metrics, label encoding, rendering, CRNN + CTC loss."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.textlines import DEFAULT_CHARSET, load_or_render, render_lines
from pipeline.core.errors import ConfigError, DataError
from pipeline.ocr.text_metrics import (char_accuracy, ctc_greedy_decode, decode_indices, edit_distance,
                                   encode_labels, seq_accuracy)


def _onehot(path: list[int], classes: int = 5) -> np.ndarray:
    return np.eye(classes, dtype=np.float32)[path][None]          # [1, T, C]


# ---------------------------------------------------------------- CTC decoding
@pytest.mark.parametrize("path, expected", [
    ([1, 1, 0, 1, 2, 2, 0], [1, 1, 2]),      # blank separates a real repeat
    ([1, 1, 1, 2], [1, 2]),                  # repeats collapse
    ([0, 0, 0], []),                         # all blank
    ([3], [3]),
    ([0, 2, 0, 2, 0, 0, 4], [2, 2, 4]),
])
def test_ctc_greedy_decode(path, expected):
    assert ctc_greedy_decode(_onehot(path)) == [expected]


def test_ctc_greedy_decode_batch_and_blank_index():
    logits = np.concatenate([_onehot([1, 1, 2]), _onehot([4, 4, 4])])
    assert ctc_greedy_decode(logits) == [[1, 2], [4]]
    assert ctc_greedy_decode(_onehot([1, 4, 2]), blank=4) == [[1, 2]]
    with pytest.raises(DataError):
        ctc_greedy_decode(np.zeros((2, 3)))


# ---------------------------------------------------------------- metrics
@pytest.mark.parametrize("a, b, d", [
    ("", "", 0), ("abc", "", 3), ("", "ab", 2), ("kitten", "sitting", 3),
    ("INV-2024", "INV-2024", 0), ("12/03", "12.03", 1), ("flaw", "lawn", 2), ("ab", "ba", 2),
    ("aXbXa", "aYbYa", 2), ("abcab", "ab", 3), ("aaa", "aa", 1), ("xabcx", "xacx", 1),
])
def test_edit_distance(a, b, d):
    assert edit_distance(a, b) == d
    assert edit_distance(b, a) == d
    assert edit_distance(list(a), list(b)) == d          # works on index sequences too


def test_edit_distance_matches_full_dp():
    import random

    def full_dp(a: str, b: str) -> int:      # textbook O(len(a)·len(b)) table, no shortcuts
        d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
        for i in range(1, len(a) + 1):
            for j in range(1, len(b) + 1):
                d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
        return d[-1][-1]

    r = random.Random(1)
    for _ in range(300):   # a 3-letter alphabet makes shared prefixes/suffixes and repeats common
        a = "".join(r.choices("AB.", k=r.randint(0, 8)))
        b = "".join(r.choices("AB.", k=r.randint(0, 8)))
        assert edit_distance(a, b) == full_dp(a, b), (a, b)


def test_seq_and_char_accuracy():
    gts = ["ABC", "12.50", "X"]
    assert seq_accuracy(gts, gts) == 1.0
    assert char_accuracy(gts, gts) == 1.0
    preds = ["ABC", "12,50", ""]
    assert seq_accuracy(preds, gts) == pytest.approx(1 / 3)
    assert char_accuracy(preds, gts) == pytest.approx(1 - 2 / 9)   # 0 + 1 + 1 edits over 9 chars
    assert char_accuracy(["WAYTOOLONGPREDICTION"], ["A"]) == 0.0   # clipped at 0
    assert char_accuracy(["A"], [""]) == 0.0                       # empty gt counts as length 1
    assert seq_accuracy([], []) == 0.0
    with pytest.raises(DataError):
        seq_accuracy(["A"], ["A", "B"])


def test_edit_distance_is_fast_enough():
    import random
    import time
    r = random.Random(0)
    pairs = [("".join(r.choices(DEFAULT_CHARSET, k=20)), "".join(r.choices(DEFAULT_CHARSET, k=20)))
             for _ in range(1000)]
    t = time.perf_counter()
    char_accuracy([a for a, _ in pairs], [b for _, b in pairs])
    # ~0.3 s on an idle core; the loose bound only catches an accidentally exponential
    # algorithm, not a busy CI machine
    assert time.perf_counter() - t < 15.0


def test_encode_decode_round_trip():
    strings = ["INV-2024-00871", "12/03/2024", "1,234.56", "A"]
    enc = encode_labels(strings, DEFAULT_CHARSET, max_len=16)
    assert enc.dtype == np.int64 and enc.shape == (4, 16)
    assert enc[3, 0] == DEFAULT_CHARSET.index("A") + 1 and (enc[3, 1:] == -1).all()
    assert enc.min() >= -1 and 0 not in enc                     # 0 is reserved for the blank
    assert decode_indices(enc, DEFAULT_CHARSET) == strings
    with pytest.raises(DataError, match="not in the charset"):
        encode_labels(["abc"], DEFAULT_CHARSET, 8)
    with pytest.raises(DataError, match="max_len"):
        encode_labels(["0123456789"], DEFAULT_CHARSET, 4)


# ---------------------------------------------------------------- rendering
def test_render_shapes_charset_and_determinism():
    a_img, a_lab = render_lines(40, seed=3, height=32, width=128, max_len=10)
    b_img, b_lab = render_lines(40, seed=3, height=32, width=128, max_len=10)
    c_img, c_lab = render_lines(40, seed=4, height=32, width=128, max_len=10)
    assert a_img.dtype == np.uint8 and a_img.shape == (40, 32, 128)
    assert a_img.tobytes() == b_img.tobytes() and a_lab == b_lab
    assert a_img.tobytes() != c_img.tobytes() and a_lab != c_lab
    assert all(1 <= len(s) <= 10 and set(s) <= set(DEFAULT_CHARSET) for s in a_lab)
    assert a_img.mean() > 127                                    # dark text on a light background


def test_render_bad_font_names_file(tmp_path):
    bad = tmp_path / "broken.ttf"
    bad.write_bytes(b"not a font")
    with pytest.raises(DataError, match="broken.ttf"):
        render_lines(2, seed=0, fonts=[str(bad)])


def test_load_or_render_cache(tmp_path):
    img, lab = load_or_render(12, seed=1, width=128, max_len=8, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))
    img2, lab2 = load_or_render(12, seed=1, width=128, max_len=8, cache_dir=tmp_path)
    assert np.array_equal(img, img2) and lab == lab2
    load_or_render(12, seed=2, width=128, max_len=8, cache_dir=tmp_path)      # new key → new file
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_drawable_chars_keeps_what_the_font_draws():
    from pipeline.data.textlines import drawable_chars

    # the built-in font (Aileron) has Latin glyphs, no CJK, no emoji; a combining mark draws no ink of its own
    assert drawable_chars("A汉1 🔩b\u0301,") == "A1 b,"
    assert drawable_chars(DEFAULT_CHARSET) == DEFAULT_CHARSET


def test_drawable_only_filters_the_rendered_lines_of_its_split(tmp_path):
    from pipeline.tasks.recognition import RecognitionTask, labels_to_strings

    chars = "汉字国中" * 6 + "AB12"                       # a charset the built-in font mostly cannot draw
    (tmp_path / "dict.txt").write_text("\n".join(dict.fromkeys(chars)) + "\n", encoding="utf-8")
    cfg = {**_tiny_cfg(tmp_path), "charset": str(tmp_path / "dict.txt"), "num_train": 64, "num_val": 64}
    task = RecognitionTask()
    plain = task.load_data(cfg, seed=0)
    drawn = task.load_data({**cfg, "train_drawable_only": True}, seed=0)
    charset = drawn.info["charset"]
    train = labels_to_strings(drawn.train.labels, charset)
    assert all(set(s) <= set("AB12") for s in train) and len(set("".join(train))) == 4
    assert any(set(s) - set("AB12") for s in labels_to_strings(plain.train.labels, charset))
    assert np.array_equal(drawn.val.labels, plain.val.labels)          # the same validation lines
    assert np.array_equal(drawn.val.images, plain.val.images)
    both = task.load_data({**cfg, "train_drawable_only": True, "val_drawable_only": True}, seed=0)
    val = labels_to_strings(both.val.labels, charset)
    assert all(set(s) <= set("AB12") for s in val) and np.array_equal(both.train.labels, drawn.train.labels)
    with pytest.raises(ConfigError, match="train_drawable_only"):
        task.load_data({**cfg, "train_drawable_only": True, "source": "pages"}, seed=0)
    with pytest.raises(ConfigError, match="val_drawable_only"):
        task.load_data({**cfg, "val_drawable_only": True, "source": "pages"}, seed=0)
    (tmp_path / "cjk.txt").write_text("汉\n字\n", encoding="utf-8")
    with pytest.raises(DataError, match="no character of the charset"):
        task.load_data({**cfg, "charset": str(tmp_path / "cjk.txt"), "train_drawable_only": True}, seed=0)


# ---------------------------------------------------------------- task + model
def _tiny_cfg(tmp_path) -> dict:
    return dict(source="synthetic", path=None, val_path=None, charset=None, num_train=16, num_val=8,
                height=32, width=64, max_len=6, fonts=[], on_bad_sample="error",
                cache_dir=str(tmp_path), val_fraction=0.1)


def test_task_data_specs_and_geometry_check(tmp_path):
    from pipeline.tasks.recognition import RecognitionTask
    task = RecognitionTask()
    ds = task.load_data(_tiny_cfg(tmp_path), seed=0)
    assert ds.train.images.shape == (16, 32, 64) and ds.train.labels.shape == (16, 6)
    assert ds.val.images.shape == (8, 32, 64)
    assert ds.train.images.tobytes() != ds.val.images.tobytes()[:ds.train.images.nbytes]
    assert ds.info["charset"] == DEFAULT_CHARSET
    assert task.preprocess_spec(_tiny_cfg(tmp_path), ds.info)["resize"] == "pad_right"
    assert task.postprocess_spec(ds.info) == {"type": "ctc_greedy", "blank": 0, "charset": DEFAULT_CHARSET,
                                              "outputs": "logits", "use_space_char": False}
    with pytest.raises(ConfigError, match="16 CTC time steps"):     # CRNN: width/4 = 16 steps < 23
        task.check_output_shape([1, 16, len(DEFAULT_CHARSET) + 1], {**ds.info, "max_len": 12})
    # time steps come from the model: the SVTR recogniser keeps width/8 (like PP-OCRv3)
    svtr = task.build_model({"name": "svtr_lcnet", "args": {}}, ds.info)
    import paddle
    out = svtr(paddle.zeros([1, 1, 32, 64]))
    assert list(out.shape) == [1, 8, len(DEFAULT_CHARSET) + 1]
    task.check_output_shape(list(out.shape), {**ds.info, "max_len": 4})
    with pytest.raises(ConfigError, match="1 step per 8 pixels"):
        task.check_output_shape(list(out.shape), ds.info)          # 8 steps < 2*6-1
    with pytest.raises(ConfigError):
        task.build_model({"name": "resnet"}, ds.info)


def test_crnn_shape_and_ctc_loss_decreases(tmp_path):
    import paddle

    from pipeline.data.preprocess import to_tensor
    from pipeline.tasks.recognition import RecognitionTask
    paddle.seed(0)
    task = RecognitionTask()
    cfg = _tiny_cfg(tmp_path)
    ds = task.load_data(cfg, seed=0)
    model = task.build_model({"name": "crnn", "args": {"hidden": 32, "channels": [8, 16, 32]}}, ds.info)
    x = paddle.to_tensor(to_tensor(ds.train.images, task.preprocess_spec(cfg, ds.info)))
    y = paddle.to_tensor(ds.train.labels)
    out = model(x)
    assert out.shape == [16, 64 // 4, len(DEFAULT_CHARSET) + 1]
    opt = paddle.optimizer.Adam(3e-3, parameters=model.parameters())
    losses = []
    for _ in range(8):
        loss = task.loss(model(x), y)
        assert np.isfinite(float(loss))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    model.eval()
    m = task.metrics(model(x).numpy(), ds.train.labels)
    assert set(m) == {"seq_accuracy", "char_accuracy"} and 0.0 <= m["char_accuracy"] <= 1.0
    assert len(task.decode(model(x).numpy(), ds.info)) == 16
