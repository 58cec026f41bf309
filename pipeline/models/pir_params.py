"""The tensor stream of a combined `.pdiparams` file (Paddle 2.x `save_combine` and Paddle 3 PIR alike): read it
without a Paddle runtime, and bind its tensors to the parameters a program declares.

A Paddle 3 PIR export writes its parameters in the order of their sorted PIR names (`batch_norm2d_0.b_0`,
`batch_norm2d_0.w_0`, ..., `conv2d_10.w_0`, ...): the file holds no names, so the binding below checks every
tensor's shape and dtype against the parameter it is bound to, and the caller checks the translated program's
outputs against a reference (same-shape tensors, e.g. a BatchNorm mean and variance, are only told apart there).
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from pipeline.core.errors import DataError

# framework.proto VarType.Type -> numpy dtype (the types a parameter file holds)
DTYPES = {0: np.bool_, 2: np.int32, 3: np.int64, 4: np.float16, 5: np.float32, 6: np.float64, 20: np.uint8,
          21: np.int8}


def _tensor_desc():
    from paddle.base.proto import framework_pb2
    return framework_pb2.VarType.TensorDesc()


def _records(data: bytes):
    """(start, end, array) of each tensor record in a combined parameter stream."""
    pos = 0
    while pos < len(data):
        start = pos
        (lod_levels,) = struct.unpack_from("<Q", data, pos + 4)       # after the uint32 version
        pos += 12
        for _ in range(lod_levels):                 # LoD offsets: parameters carry none, skip them if present
            (size,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + size
        _tensor_version, desc_size = struct.unpack_from("<Ii", data, pos)
        pos += 8
        desc = _tensor_desc()
        desc.ParseFromString(data[pos:pos + desc_size])
        pos += desc_size
        dtype = np.dtype(DTYPES[desc.data_type])
        shape = [int(d) for d in desc.dims]
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if pos + n > len(data):
            raise ValueError("truncated")
        yield start, pos + n, np.frombuffer(data, dtype, count=n // dtype.itemsize, offset=pos).reshape(shape).copy()
        pos += n


def read_stream(path: str | Path, spans: bool = False) -> list:
    """Every tensor of a combined parameter file, in file order (spans=True: (start, end, array) each)."""
    data, out = Path(path).read_bytes(), []
    try:
        for rec in _records(data):
            out.append(rec if spans else rec[2])
    except (struct.error, KeyError, ValueError) as exc:
        raise DataError(f"{path}: not a combined Paddle parameter file (tensor {len(out)} unreadable: "
                        f"{type(exc).__name__} {exc})", hint="pass the inference.pdiparams written with the model") \
            from None
    return out


def bind(path: str | Path, declared: dict[str, tuple[list[int], str]], order: list[str]) -> dict[str, np.ndarray]:
    """{name: array} from the file at `path`, its tensors taken in `order` (names of `declared`); each must have
    the declared shape and dtype, and the file must hold exactly one tensor per parameter."""
    tensors = read_stream(path)
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
