"""`make bench-lowprec`'s target (issue 29, checked since issue 46): a bf16 row that ran bf16 is >= 1.4x (2x on AMX)
its own engine's fp32 at batch N; when no bf16 row ran, nothing was checked and that is a failed target."""
import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("bench_lowprec")
    finally:
        sys.path.remove(str(SCRIPTS))


def test_bf16_rows_that_ran_bf16_are_checked(bench):
    rows = [{"row": "openvino bf16", "ran": "bf16", "batchN": 1.5},
            {"row": "paddle-inference bf16", "ran": "fp32 (bf16 not applied: no avx512_bf16)", "batchN": 1.0},
            {"row": "onnxruntime int8", "ran": "int8", "batchN": 0.9},
            {"row": "paddle-inference bf16", "ran": "-", "note": "not run: no bf16 kernels"}]
    met = bench.targets(rows, amx=False, batch=8)
    assert [(v, lim, ok) for _, v, lim, ok in met] == [(1.5, 1.4, True)] and "openvino bf16" in met[0][0]
    assert [ok for *_, ok in bench.targets(rows, amx=True, batch=8)] == [False]        # 2x on AMX


def test_nothing_checked_is_a_failed_target(bench):
    rows = [{"row": "onnxruntime int8", "ran": "int8", "batchN": 2.0},
            {"row": "openvino bf16", "ran": "-", "note": "not run: no bf16 kernels"}]
    met = bench.targets(rows, amx=False, batch=8)
    assert len(met) == 1 and met[0][3] is False and "cannot be checked" in met[0][0]
