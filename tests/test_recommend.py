"""The serving recommendation on synthetic gate rows (no engines): budget, evidence, not faster, failed, emulated."""
import pytest

from pipeline.bundle import recommend as rec
from pipeline.core.config import load_config
from pipeline.core.gates import FAIL, OK, SKIPPED, Check, Gate


def _rc(**over):
    return load_config([], [f"server.recommend.{k}={v}" for k, v in over.items()]).server.recommend


def _gate(subject, prec, eff=None, value=0.98, ref=0.98, status=OK, agree=1.0, evidence=True, reason=""):
    g = Gate("server", subject, prec, eff or prec, "accuracy", value=value, reference=ref, status=status,
             reason=reason)
    g.checks = [Check("finite", 0.0, 0.0), Check("argmax_agreement", 1.0, 0.99, ">=")]
    g.extra = {"agreement": {"name": "argmax_agreement", "strict": agree}}
    if evidence and prec != "fp32":
        g.extra["evidence"] = {"optimized_program": "12 ops in int8"}
    return g


def _rank(p50: dict, session: str = "s1") -> list[dict]:
    """registry.rank-shaped rows: batch-1 p50 (ms) per row subject; throughput 1000/p50; one interleaved session."""
    timing = {"how": "interleaved", "session": session, "rounds": 2, "candidates": len(p50)}
    return [{"engine": k, "latency_ms": {"p50": v}, "throughput_sps": 1000.0 / v, "timing": timing}
            for k, v in p50.items()]


def _verdicts(cands):
    return {c.row: c.verdict for c in cands}


ROWS = [_gate("paddle-inference fp32", "fp32"), _gate("onnxruntime fp32", "fp32"), _gate("openvino fp32", "fp32"),
        _gate("paddle-inference fp16", "fp16", eff="fp16-emulated"),
        _gate("paddle-inference bf16", "bf16", status=SKIPPED, reason="CPU lacks avx512_bf16/amx_bf16"),
        _gate("paddle-inference int8", "int8", value=0.945, ref=0.984),            # 3.9 points: over budget
        _gate("onnxruntime int8", "int8", agree=0.995),
        _gate("openvino int8", "int8", eff="int8-simulated"),
        _gate("openvino bf16", "bf16", eff="fp32 (bf16 not applied: OpenVINO's runtime model runs {'f32': 2})"),
        _gate("onnxruntime cuda fp32", "fp32", status=SKIPPED, reason="not run here"),
        _gate("http /predict fp32", "fp32")]


def test_screen_gives_every_servable_row_a_verdict():
    cands = rec.screen(ROWS, _rc(), samples=256)
    v = _verdicts(cands)
    assert "http /predict fp32" not in v and "onnxruntime cuda fp32" not in v      # not servable rows
    assert v["paddle-inference fp16"] == "emulated"                                  # never served
    assert v["openvino int8"] == "emulated"                                          # int8-simulated
    assert v["paddle-inference bf16"] == "skipped"
    assert v["openvino bf16"] == "no evidence"                                       # asked bf16, ran f32
    assert v["paddle-inference int8"] == "over budget"
    over = {c.row: c for c in cands}["paddle-inference int8"]
    assert "accuracy drop 0.039 > 0.01" in over.detail and "server.recommend.max_metric_drop" in over.detail
    assert over.agreement == 1.0        # recorded though the drop was over first: the OCR system admits by it
    assert {v[r] for r in ("paddle-inference fp32", "onnxruntime fp32", "openvino fp32", "onnxruntime int8")} == \
        {rec.CANDIDATE}


def test_budget_agreement_precisions_and_failed_rows():
    rows = [_gate("onnxruntime int8", "int8", agree=0.97), _gate("openvino int8", "int8", status=FAIL,
                                                                     reason="accuracy_drop 0.06 > limit 0.04"),
            _gate("paddle-inference int8", "int8", evidence=False)]
    v = {c.row: c for c in rec.screen(rows, _rc(), samples=256)}
    assert v["onnxruntime int8"].verdict == "over budget" and "server.recommend.min_agreement" in v["onnxruntime int8"].detail
    assert v["openvino int8"].verdict == "failed gate" and "0.06" in v["openvino int8"].detail
    assert v["paddle-inference int8"].verdict == "no evidence"
    only_fp32 = rec.screen([_gate("onnxruntime int8", "int8")], _rc(precisions="[fp32]"))
    assert only_fp32[0].verdict == "not allowed"
    # a drop below one sample of the slice counts as one sample, as in the gates
    assert rec.screen([_gate("onnxruntime int8", "int8", value=0.984375, ref=1.0)], _rc(), samples=64)[0].verdict \
        == rec.CANDIDATE


def test_low_precision_served_only_when_faster_by_the_margin():
    cands = rec.screen(ROWS, _rc(), samples=256)
    chosen, base = rec.choose(cands, _rank({"paddle-inference fp32": 0.30, "onnxruntime fp32": 0.20,
                                            "openvino fp32": 0.25, "onnxruntime int8": 0.10}), _rc())
    assert (chosen.row, base.row) == ("onnxruntime int8", "onnxruntime fp32") and chosen.speedup_vs_fp32 == 2.0
    why = rec.why(chosen, base, cands, _rc(), "accuracy")
    assert why.startswith("fastest within budget: 2.00x fp32 onnxruntime") and "agreement 0.995 >= 0.99" in why
    assert rec.fp32_baseline(base)["latency_ms_p50"] == 0.2
    assert _verdicts(cands)["openvino fp32"] == "slower"

    cands = rec.screen(ROWS, _rc(), samples=256)          # int8 1.05x: inside the 1.10x margin
    chosen, base = rec.choose(cands, _rank({"paddle-inference fp32": 0.30, "onnxruntime fp32": 0.21,
                                            "openvino fp32": 0.25, "onnxruntime int8": 0.20}), _rc())
    assert chosen.row == "onnxruntime fp32"
    slow = {c.row: c for c in cands}["onnxruntime int8"]
    assert slow.verdict == "not faster"
    assert "int8 not faster than fp32 onnxruntime: 1.05x (0.2 vs 0.21 ms batch-1 p50)" in slow.detail
    why = rec.why(chosen, base, cands, _rc(), "accuracy")
    assert "no low-precision row qualified" in why and "onnxruntime int8 not faster (1.05x)" in why
    assert "paddle-inference int8 over budget" in why and "paddle-inference fp16 emulated" in why


def test_by_throughput_and_nothing_to_compare():
    cands = rec.screen([_gate("onnxruntime fp32", "fp32"), _gate("onnxruntime int8", "int8")], _rc(by="throughput"))
    rows = _rank({"onnxruntime fp32": 0.2, "onnxruntime int8": 0.1})
    rows[1]["throughput_sps"] = 4000.0          # throughput decides, not p50: 4000 vs 5000 samples/s
    chosen, _ = rec.choose(cands, rows, _rc(by="throughput"))
    assert chosen.row == "onnxruntime fp32"
    assert cands[1].verdict == "not faster" and "4000 vs 5000 samples/s" in cands[1].detail
    cands = rec.screen([_gate("onnxruntime int8", "int8")], _rc())
    assert rec.choose(cands, _rank({"onnxruntime int8": 0.1}), _rc()) is None
    assert cands[0].verdict == "not compared"


@pytest.mark.parametrize("bad", ["server.recommend.precisions=[int8]", "server.recommend.min_speedup=0.9",
                                 "server.recommend.min_agreement=1.5"])
def test_recommend_config_is_validated(bad):
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError):
        load_config([], [bad])


def test_a_row_not_faster_than_its_own_fp32_is_not_ranked():
    """speed_vs_fp32 (interleaved in the int8 row, vs the same engine's fp32) under min_speedup: it cannot beat the
    fastest fp32 by that much either, so screen() says "not faster" and the ranking never builds it."""
    slow, fast = _gate("paddle-inference int8", "int8"), _gate("openvino int8", "int8")
    how = "interleaved, 2 rounds, same threads"
    slow.extra["speed_vs_fp32"] = {"batch1": 0.96, "batchN": 1.4, "batch": 8, "how": how}
    fast.extra["speed_vs_fp32"] = {"batch1": 1.2, "batchN": 0.9, "batch": 8, "how": how}
    cands = {c.row: c for c in rec.screen([_gate("openvino fp32", "fp32"), slow, fast], _rc())}
    assert cands["paddle-inference int8"].verdict == "not faster" and cands["openvino int8"].verdict == rec.CANDIDATE
    assert "0.96x (batch-1 p50" in cands["paddle-inference int8"].detail and "not ranked" in cands["paddle-inference int8"].detail
    chosen, base = rec.choose(list(cands.values()), _rank({"openvino fp32": 10.0, "openvino int8": 12.0}), _rc())
    assert chosen.row == "openvino fp32" and "paddle-inference int8 not faster (0.96x its own fp32)" in \
        rec.why(chosen, base, list(cands.values()), _rc(), "accuracy")
    by_sps = {c.row: c.verdict for c in rec.screen([slow, fast], _rc(by="throughput"))}
    assert by_sps == {"paddle-inference int8": rec.CANDIDATE, "openvino int8": "not faster"}


def test_the_ranker_refuses_figures_not_timed_interleaved():
    """Issue 29: rows timed at different moments of a busy machine oversold bf16 (OpenVINO 5.4x in the rows, 1.55x
    interleaved). choose() ranks only rows of ONE interleaved registry.rank session; a row's own speed ratio
    counts only when it was timed interleaved."""
    cands = lambda: rec.screen([_gate("openvino fp32", "fp32"), _gate("openvino int8", "int8")], _rc())
    mixed = _rank({"openvino fp32": 10.0}, "a") + _rank({"openvino int8": 2.0}, "b")
    with pytest.raises(ValueError, match="mixes 2 timing sessions"):
        rec.choose(cands(), mixed, _rc())
    lone = _rank({"openvino fp32": 10.0}) + [{"engine": "openvino int8", "latency_ms": {"p50": 2.0},
                                             "throughput_sps": 500.0}]           # a figure from a row's own timing
    with pytest.raises(ValueError, match=r"\['openvino int8'\] were not timed interleaved"):
        rec.choose(cands(), lone, _rc())
    assert rec.choose(cands(), _rank({"openvino fp32": 10.0, "openvino int8": 2.0}), _rc())[0].row == "openvino int8"
    g = _gate("openvino int8", "int8")
    g.extra["speed_vs_fp32"] = {"batch1": 0.5, "batchN": 0.5, "batch": 8}       # no "how": not interleaved
    assert rec.screen([g], _rc())[0].verdict == rec.CANDIDATE                    # ignored: the ranking decides


def test_registry_rank_marks_its_rows_as_one_interleaved_session():
    import numpy as np

    from pipeline.engines import registry
    from pipeline.engines.base import Engine

    class Scale(Engine):
        kind = "scale"

        def __init__(self, k):
            super().__init__()
            self.k, self.input_shape = k, [-1, 4]

        def _run(self, x):
            return x * self.k

    x = np.ones((4, 4), np.float32)
    rows = registry.rank({"a": Scale(1.0), "b": Scale(2.0)}, x, batch_size=4, warmup=1, repeats=4, rounds=2)
    assert rec.interleaved_session(rows) == rows[0]["timing"]["session"]
    again = registry.rank({"a": Scale(1.0)}, x, batch_size=4, warmup=1, repeats=2, rounds=2)
    with pytest.raises(ValueError):
        rec.interleaved_session(rows + again)        # two calls = two moments


def test_interleaved_rounds_rotate_the_first_timed_engine():
    """No engine is always timed first (issue 46): round r starts with engine r mod n, in latency and throughput."""
    import numpy as np

    from pipeline.engines import registry

    class Logged:
        def __init__(self, name, log):
            self.name, self.log = name, log

        def run(self, x):
            self.log.append(self.name)
            return x

    log: list[str] = []
    engines = {k: Logged(k, log) for k in ("a", "b", "c")}
    x = np.ones((1, 4), np.float32)
    registry.interleaved_latency(engines, x, warmup=0, repeats=3, rounds=3)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    log.clear()
    registry.interleaved_throughput(engines, x, warmup=0, repeats=3, rounds=3)
    assert [log[i] for i in (3, 6, 9)] == ["a", "b", "c"]        # after one warm-up call each, rounds start a, b, c
    assert registry.rotated([], 2) == []
