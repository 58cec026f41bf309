import numpy as np

from pipeline.gates import FAIL, OK, Gate, evaluate, metric_check, parity_checks


def _gate():
    return Gate("server", "paddle-inference fp32", "fp32", "fp32", "accuracy", reference=0.9)


def test_nan_fails_before_tolerances():
    ref = np.zeros((4, 3), np.float32)
    cand = ref.copy()
    cand[1, 2] = np.nan
    checks = parity_checks(cand, ref, atol=1e9)
    assert [c.name for c in checks] == ["finite"] and not checks[0].passed
    g = evaluate(_gate(), cand, ref, atol=1e9, value=0.9, max_drop=1.0)
    assert g.status == FAIL and "non-finite" in g.failure_line()


def test_parity_records_observed_on_pass():
    ref = np.ones((2, 2), np.float32)
    g = evaluate(_gate(), ref + 1e-6, ref, atol=1e-4, value=0.9, max_drop=0.0)
    assert g.status == OK
    mad = next(c for c in g.checks if c.name == "max_abs_diff")
    assert 0 < mad.observed < 1e-5 and mad.limit == 1e-4


def test_atol_failure_names_metric_observed_and_limit():
    ref = np.ones((2, 2), np.float32)
    g = evaluate(_gate(), ref + 1e-3, ref, atol=1e-12, value=0.9, max_drop=0.0)
    line = g.failure_line()
    assert g.status == FAIL and line.startswith("server:") and "max_abs_diff" in line and "1e-12" in line


def test_metric_drop_limit():
    assert metric_check("accuracy", 0.89, 0.9, 0.02).passed
    assert not metric_check("accuracy", 0.85, 0.9, 0.02).passed
    assert metric_check("accuracy", 0.9, 0.9, 0.0).passed
    assert not metric_check("accuracy", float("nan"), 0.9, 1.0).passed


def test_shape_mismatch_fails():
    g = evaluate(_gate(), np.zeros((2, 3)), np.zeros((2, 4)), atol=1.0, value=None, max_drop=0)
    assert g.status == FAIL


def test_roundtrip_dict():
    g = evaluate(_gate(), np.ones(3), np.ones(3), atol=1e-4, value=0.9, max_drop=0)
    g2 = Gate.from_dict(g.to_dict())
    assert g2.status == g.status and g2.checks[1].observed == g.checks[1].observed and g2.delta == 0.0
