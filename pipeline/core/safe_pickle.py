"""Reading a `.pdparams` (paddle.save) as data: a pickle that may only rebuild what a saved state is.

`paddle.load` is `pickle.load`: a crafted file runs any code it names (os.system, exec, ...), and a payload
that runs and then returns the real weights leaves no trace. What Paddle 2.6 really pickles for a state_dict,
an optimizer's state and a list of tensors (checked with pickletools on paddle.save output): dicts, lists,
tuples, strings, numbers, and numpy arrays rebuilt by `numpy.core.multiarray._reconstruct` + `numpy.ndarray`
+ `numpy.dtype`; a Tensor outside a dict is `builtins.tuple` of (name, array). Older files (protocol 2) also
name `_codecs.encode` for their bytes; numpy 2 writes `numpy._core`. Every other global is refused before it
is looked up, so nothing a file names is ever called. The result is then walked: only those types, numeric
arrays (no object dtype), at most MAX_DEPTH deep.
"""
from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
from pathlib import Path

from pipeline.core.errors import IntegrityError

ALLOWED = frozenset({
    ("collections", "OrderedDict"),
    ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"),
    ("_codecs", "encode"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
})
MAX_DEPTH = 64
BIG_PARAM_KEY = "UnpackBigParamInfor@@"     # paddle.save splits arrays > 4 GB (protocol 2/3) and records how
NAME_TABLE_KEY = "StructuredToParameterName@@"


class Refused(Exception):
    """A global outside ALLOWED (module.name) or a value of a type a saved state never holds."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # protocol 2 names Python 2 modules (__builtin__.tuple): map them as pickle does, then check
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) not in ALLOWED:
            raise Refused(f"{module}.{name}")
        if module.startswith("numpy._core"):          # a numpy 2 file read by numpy 1
            module = module.replace("numpy._core", "numpy.core", 1)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise Refused(f"persistent id {str(pid)[:40]!r}")


def _check(obj, depth: int = 0):
    """Only the types a saved state holds; raises Refused naming the first other one."""
    import numpy as np

    if depth > MAX_DEPTH:
        raise Refused(f"nesting deeper than {MAX_DEPTH}")
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.generic)):
        if isinstance(obj, np.generic) and obj.dtype.hasobject:
            raise Refused("a numpy object scalar")
        return
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise Refused(f"a numpy array of dtype {obj.dtype} (Python objects, not numbers)")
        return
    if type(obj) in (dict,) or type(obj).__name__ == "OrderedDict":
        for k, v in obj.items():
            _check(k, depth + 1)
            _check(v, depth + 1)
        return
    if type(obj) in (list, tuple, set, frozenset):
        for v in obj:
            _check(v, depth + 1)
        return
    raise Refused(f"a {type(obj).__module__}.{type(obj).__qualname__} value")


def loads(data: bytes):
    """Unpickle bytes with the allow-list; Refused or pickle/EOF/value errors on anything else."""
    obj = _Unpickler(io.BytesIO(data), encoding="latin1").load()
    _check(obj)
    return obj


def _pack_big(obj: dict) -> dict:
    """Join arrays paddle.save split into slices (its UnpackBigParamInfor@@ table), as paddle.load does."""
    import numpy as np

    table = obj.pop(BIG_PARAM_KEY, None)
    if not isinstance(table, dict):
        return obj
    for key, info in table.items():
        parts = [obj.pop(s) for s in info["slices"]]
        obj[key] = np.concatenate(parts).reshape(info["OriginShape"])
    return obj


def load_state(path: str | os.PathLike, what: str = "parameter file", max_bytes: int | None = None):
    """A `.pdparams` (or any paddle.save file) -> its object, numpy arrays in place of tensors, without running
    anything the file names. Refusals are one IntegrityError line naming the file and what it asked for."""
    p = Path(path)
    if not p.is_file():             # a FIFO would block the read, a device would never end
        raise IntegrityError(f"{what} {p} is not a regular file", hint="give the path of a .pdparams file")
    size = p.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise IntegrityError(f"{what} {p} is {size} bytes, over the limit of {max_bytes}",
                             hint="raise model.max_file_bytes if the file is genuine")
    with open(p, "rb") as f:
        data = f.read()
    try:
        obj = loads(data)
        if isinstance(obj, dict):
            obj = _pack_big(obj)
            obj.pop(NAME_TABLE_KEY, None)
    except Refused as exc:
        raise IntegrityError(f"{what} {p} refused: it asks to load {exc}, which a saved Paddle state never "
                             "holds (a pickle can run code: it was not run)",
                             hint="re-save the weights with paddle.save(layer.state_dict(), path) from a "
                                  "trusted source") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            MemoryError, OverflowError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{what} {p} is not a Paddle parameter file (damaged or truncated: "
                             f"{type(exc).__name__})",
                             hint="save it with paddle.save(layer.state_dict(), path)") from None
    return obj
