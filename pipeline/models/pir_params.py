"""The tensor stream of a combined `.pdiparams` file (Paddle 2.x `save_combine` and Paddle 3 PIR alike): read it
without a Paddle runtime, and bind its tensors to the parameters a program declares.

A Paddle 3 PIR export writes its parameters in the order of their sorted PIR names (`batch_norm2d_0.b_0`,
`batch_norm2d_0.w_0`, ..., `conv2d_10.w_0`, ...): the file holds no names, so the binding below checks every
tensor's shape and dtype against the parameter it is bound to, and the caller checks the translated program's
outputs against a reference (same-shape tensors, e.g. a BatchNorm mean and variance, are only told apart there).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.core.errors import DataError


def read_stream(path: str | Path, spans: bool = False, max_bytes: int | None = None,
                expect: int | None = None) -> list:
    """Every tensor of a combined parameter file, in file order (spans=True: (start, end, array) each), through
    the one checked reader (pipeline/engines/params_file.py): sizes against the file, count against `expect`."""
    from pipeline.engines import params_file

    recs = params_file.tensors(path, max_bytes, expect)
    return recs if spans else [r[2] for r in recs]


def bind(path: str | Path, declared: dict[str, tuple[list[int], str]], order: list[str],
         max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """{name: array} from the file at `path`, its tensors taken in `order` (names of `declared`); each must have
    the declared shape and dtype, and the file must hold exactly one tensor per parameter."""
    tensors = read_stream(path, max_bytes=max_bytes, expect=len(order))
    if len(tensors) != len(order):
        raise DataError(f"{path}: {len(tensors)} tensors for the program's {len(order)} parameters",
                        hint="the .pdiparams does not belong to this inference.json")
    out = {}
    for name, arr in zip(order, tensors):
        shape, dtype = declared[name]
        if list(arr.shape) != list(shape) or arr.dtype != np.dtype(dtype):
            raise DataError(f"{path}: parameter {name} is declared {dtype}{list(shape)} but the file holds "
                            f"{arr.dtype}{list(arr.shape)} at its place",
                            hint="the .pdiparams does not belong to this inference.json (or its order is not the "
                                 "sorted-name order Paddle 3 writes)")
        out[name] = arr
    return out
