"""A low-precision recogniser's lines in doubt read again at fp32 (pipeline/ocr/recheck.py, issue 48): which lines
are in doubt, that only they are re-read and at their batch's own width, what the label and evidence say, and where
the system turns it on. Stub engines: no model runs here."""
import numpy as np
import pytest

from pipeline.engines.base import Engine
from pipeline.ocr.recheck import SCORE_BAND, RecheckedRecognizer, doubtful_lines, rechecked

A, B = 1, 2     # two characters; 0 is the CTC blank


def _probs(rows: list[list[dict]], classes: int = 4) -> np.ndarray:
    """[N, T, C] probabilities: each step {class: p}, the rest spread evenly."""
    out = np.zeros((len(rows), len(rows[0]), classes), np.float32)
    for n, steps in enumerate(rows):
        for t, step in enumerate(steps):
            rest = (1.0 - sum(step.values())) / (classes - len(step))
            out[n, t] = rest
            for c, p in step.items():
                out[n, t, c] = p
    return out


def test_a_close_call_that_changes_the_text_is_in_doubt_and_one_that_does_not_is_not():
    sure = [{A: 0.97}, {0: 0.97}, {B: 0.97}]
    # a close blank/B call beside another B: either way the text is "AB" (repeats collapse)
    harmless = [{A: 0.97}, {B: 0.5, 0: 0.45}, {B: 0.97}]
    # a close A/B call: "AB" or "BB"->"B"... the text changes
    rewrites = [{A: 0.5, B: 0.45}, {0: 0.97}, {B: 0.97}]
    out = _probs([sure, harmless, rewrites])
    before = out.copy()
    assert doubtful_lines(out, 0.2).tolist() == [2]
    assert np.array_equal(out, before)          # the output is left as it was
    assert doubtful_lines(out, 0.04).tolist() == []     # the rewriting call is 0.05 apart
    assert doubtful_lines(out, 0.0).tolist() == []      # 0 = off


def test_logits_are_judged_by_their_softmax():
    probs = _probs([[{A: 0.97}, {0: 0.97}], [{A: 0.5, B: 0.45}, {0: 0.97}]])
    logits = np.log(probs) + 3.0        # a softmax of these is probs again
    assert doubtful_lines(logits, 0.2).tolist() == [1]
    assert doubtful_lines(logits, 0.04).tolist() == []


def test_a_line_scored_near_drop_score_is_in_doubt():
    near = [{A: 0.5 + SCORE_BAND / 2}, {0: 0.97}]      # its score: the mean of its kept characters' p
    far = [{A: 0.97}, {0: 0.97}]
    out = _probs([near, far])
    assert doubtful_lines(out, 0.01, drop_score=0.5).tolist() == [0]
    assert doubtful_lines(out, 0.01).tolist() == []


class _Stub(Engine):
    kind = "openvino"

    def __init__(self, label: str, out_of) -> None:
        super().__init__()
        self.input_shape, self.effective_precision, self.out_of = [-1, 3, 4, -1], label, out_of
        self.calls, self.closed = [], False

    def _run(self, x):
        self.calls.append(x.copy())
        return self.out_of(x)

    def close(self):
        self.closed = True


def test_only_the_lines_in_doubt_are_read_again_at_fp32_with_their_batch_width():
    sure, doubt = [{A: 0.97}, {0: 0.97}], [{A: 0.5, B: 0.45}, {0: 0.97}]
    exact_line = _probs([[{B: 0.97}, {0: 0.97}]])[0]
    fast = _Stub("bf16", lambda x: _probs([doubt if v[0, 0, 0] > 0 else sure for v in x]))
    exact = _Stub("fp32", lambda x: np.stack([exact_line] * len(x)))
    eng = RecheckedRecognizer(fast, exact, 0.2, None)
    x = np.zeros((3, 3, 4, 9), np.float32)
    x[1] = 1.0          # the one line the fast engine reads as a close call
    out = eng.run(x)
    assert len(exact.calls) == 1 and exact.calls[0].shape == (1, 3, 4, 9)      # the batch's padded width
    assert np.array_equal(exact.calls[0][0], x[1])
    assert np.array_equal(out[1], exact_line) and out[0].argmax(-1).tolist() == [A, 0]
    assert eng.effective_precision.startswith("bf16 (") and "fp32" in eng.effective_precision
    assert eng.evidence["recheck"] | {} == {**eng.evidence["recheck"], "lines": 3, "reread": 1, "margin": 0.2}
    eng.run(np.zeros((2, 3, 4, 9), np.float32))       # nothing in doubt: fp32 is not called
    assert len(exact.calls) == 1 and eng.evidence["recheck"]["lines"] == 5
    eng.close()
    assert fast.closed and exact.closed
    shared = RecheckedRecognizer(_Stub("bf16", fast.out_of), _Stub("fp32", exact.out_of), 0.2, None, own_exact=False)
    shared.close()
    assert not shared.exact.closed      # the system stage's engine cache closes a shared fp32 engine itself


@pytest.mark.parametrize("margin, label, wrapped", [(0.2, "bf16", True), (0.0, "bf16", False),
                                                    (0.2, "fp32", False), (0.2, "int8", False),
                                                    (0.2, "fp32 (bf16 not applied: no bf16)", False)])
def test_the_flow_rechecks_only_a_recogniser_below_fp32(margin, label, wrapped):
    made = []
    fast = _Stub(label, lambda x: x)
    got = rechecked(fast, {"rec_recheck_margin": margin, "drop_score": 0.5},
                    lambda: made.append(1) or _Stub("fp32", lambda x: x))
    assert isinstance(got, RecheckedRecognizer) == wrapped and len(made) == int(wrapped)
    if wrapped:
        assert got.drop_score == 0.5 and rechecked(got, {"rec_recheck_margin": margin}, None) is got


def test_the_config_key_is_checked_and_reaches_the_flow():
    from pipeline.core.config import load_config
    from pipeline.core.errors import ConfigError
    from pipeline.tasks.ppocr_system import flow_of

    cfg = load_config(["configs/ppocr_v4_system.yaml"])
    assert flow_of(cfg.section("system")["system"])["rec_recheck_margin"] == cfg.system.rec_recheck_margin
    with pytest.raises(ConfigError, match="rec_recheck_margin"):
        load_config(["configs/ppocr_v4_system.yaml"], ["system.rec_recheck_margin=1.5"])


def test_a_read_only_output_is_judged_and_re_read_on_a_copy():
    """doubtful_lines marks each step's best class in place to find the second: a runtime that hands back a
    read-only array (a shared output buffer) is copied first, never written to."""
    doubt = [{A: 0.5, B: 0.45}, {0: 0.97}]
    exact_line = _probs([[{B: 0.97}, {0: 0.97}]])[0]

    def frozen(x):
        out = _probs([doubt] * len(x))
        out.flags.writeable = False
        return out

    fast = _Stub("bf16", frozen)
    eng = RecheckedRecognizer(fast, _Stub("fp32", lambda x: np.stack([exact_line] * len(x))), 0.2, None)
    out = eng.run(np.zeros((2, 3, 4, 9), np.float32))
    assert np.array_equal(out, np.stack([exact_line] * 2)) and eng.reread == 2
