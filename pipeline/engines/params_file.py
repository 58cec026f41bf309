"""Checking a combined `.pdiparams` before Paddle reads it.

The file is a stream of LoDTensors as Paddle 2.x (and Paddle 3's PIR export) writes them
(paddle/fluid/framework/lod_tensor.cc, tensor_util.cc): per tensor
    uint32 version (0) | uint64 lod levels | per level: uint64 bytes + that many bytes
    uint32 version (0) | int32 desc bytes | TensorDesc protobuf {1: data type, 2: dims} | numel x dtype-size bytes
Paddle trusts every declared size: a truncated file or one declaring a 2^40-element tensor ends in a C++
exception or an allocation of that size. Here each header is read and every declared size is checked against
what the file still holds, so such a file is one line naming it, the tensor and the sizes.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

from pipeline.core.errors import IntegrityError

# framework.proto VarType.Type -> bytes per element
DTYPE_BYTES = {0: 1, 1: 2, 2: 4, 3: 8, 4: 2, 5: 4, 6: 8, 19: 8, 20: 1, 21: 1, 22: 2, 23: 8, 24: 16}
MAX_DESC = 1 << 16          # a TensorDesc is a dtype and a few dims: tens of bytes
MAX_LOD_LEVELS = 8
MAX_RANK = 16


class _Bad(Exception):
    pass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise _Bad("a malformed tensor description")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return (value - (1 << 64) if value >= 1 << 63 else value), i


def _desc(buf: bytes) -> tuple[int, list[int]]:
    """TensorDesc bytes -> (data type, dims); field 2 packed or not."""
    dtype, dims, i = None, [], 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        if tag == 0x08:
            dtype, i = _varint(buf, i)
        elif tag == 0x10:
            d, i = _varint(buf, i)
            dims.append(d)
        elif tag == 0x12:
            n, i = _varint(buf, i)
            end = i + n
            if n < 0 or end > len(buf):
                raise _Bad("a malformed tensor description")
            while i < end:
                d, i = _varint(buf, i)
                dims.append(d)
        else:
            raise _Bad(f"an unknown field (tag {tag}) in a tensor description")
    if dtype not in DTYPE_BYTES:
        raise _Bad(f"an unknown data type {dtype}")
    if len(dims) > MAX_RANK or any(d < 0 for d in dims):
        raise _Bad(f"impossible dims {dims[:MAX_RANK]}")
    return dtype, dims


class _Reader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    @property
    def left(self) -> int:
        return self.size - self.f.tell()

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left:
            raise _Bad(f"{what} declares {n} bytes but only {self.left} remain (truncated or damaged)")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.left:
            raise _Bad(f"{what} declares {n} bytes but only {self.left} remain (truncated or damaged)")
        self.f.seek(n, os.SEEK_CUR)


def _tensor(r: _Reader, k: int) -> tuple[int, list[int]]:
    what = f"tensor #{k}"
    version, levels = struct.unpack("<IQ", r.take(12, what))
    if version != 0 or levels > MAX_LOD_LEVELS:
        raise _Bad(f"{what} has header (version {version}, {levels} LoD levels), not a Paddle tensor")
    for _ in range(levels):
        (n,) = struct.unpack("<Q", r.take(8, what))
        r.skip(n, f"{what}'s LoD")
    version, desc_len = struct.unpack("<Ii", r.take(8, what))
    if version != 0 or not 0 < desc_len <= MAX_DESC:
        raise _Bad(f"{what} has a tensor header (version {version}, description {desc_len} bytes) Paddle never writes")
    dtype, dims = _desc(r.take(desc_len, what))
    numel = 1
    for d in dims:
        numel *= d
    r.skip(numel * DTYPE_BYTES[dtype], f"{what} (shape {dims})")
    return dtype, dims


# framework.proto VarType.Type -> numpy dtype name, for the types read into arrays here (bf16 has no numpy type)
NUMPY_DTYPES = {0: "bool", 1: "int16", 2: "int32", 3: "int64", 4: "float16", 5: "float32", 6: "float64",
                20: "uint8", 21: "int8", 23: "complex64", 24: "complex128"}


def _walk(path: str | os.PathLike, max_bytes: int | None, expect: int | None, with_data: bool) -> list:
    """Every tensor record of a combined .pdiparams, checked: [(start, end, dtype, dims)], or IntegrityError."""
    p = Path(path)
    if not p.is_file():
        raise IntegrityError(f"{p} is not a regular file", hint="give the exported model's .pdiparams file")
    size = p.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise IntegrityError(f"{p} is {size} bytes, over the limit of {max_bytes}",
                             hint="raise model.max_file_bytes if the file is genuine")
    records = []
    try:
        with open(p, "rb") as f:
            r = _Reader(f, size)
            while r.left > 0:
                if expect is not None and len(records) >= expect:
                    raise _Bad(f"more than the {expect} tensors the program declares")
                start = f.tell()
                dtype, dims = _tensor(r, len(records))
                if with_data and dtype not in NUMPY_DTYPES:
                    raise _Bad(f"tensor #{len(records)} has data type {dtype}, which a parameter read here never has")
                records.append((start, f.tell(), dtype, dims))
    except _Bad as exc:
        raise IntegrityError(f"{p} is not a valid Paddle parameter file: {exc}",
                             hint="re-export or re-download the model") from None
    if expect is not None and len(records) != expect:
        raise IntegrityError(f"{p} holds {len(records)} tensors but the program declares {expect} parameters",
                             hint="the .pdiparams does not belong to this program: re-export the model")
    return records


def check(path: str | os.PathLike, max_bytes: int | None = None, expect: int | None = None) -> int:
    """Walk every tensor header of a combined .pdiparams; the tensor count, or IntegrityError (one line).
    `expect`: the number of parameters the program declares, when known."""
    return len(_walk(path, max_bytes, expect, with_data=False))


def tensors(path: str | os.PathLike, max_bytes: int | None = None, expect: int | None = None) -> list:
    """The one reader of a combined .pdiparams as arrays (Paddle 2.x and Paddle 3 PIR files alike): every header
    checked first as check() does, then [(start, end, numpy array)] in file order."""
    import numpy as np

    records = _walk(path, max_bytes, expect, with_data=True)
    data, out = Path(path).read_bytes(), []
    for start, end, dtype, dims in records:
        dt = np.dtype(NUMPY_DTYPES[dtype])
        n = 1
        for d in dims:
            n *= d
        out.append((start, end, np.frombuffer(data, dt, count=n, offset=end - n * dt.itemsize).reshape(dims).copy()))
    return out
