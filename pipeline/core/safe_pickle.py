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
MAX_VALUES_SLACK = 100_000     # values met walking the result (shared containers each time): <= bytes + this
BIG_PARAM_KEY = "UnpackBigParamInfor@@"     # paddle.save splits arrays > 4 GB (protocol 2/3) and records how
NAME_TABLE_KEY = "StructuredToParameterName@@"


BUDGET_FACTOR = 3              # allocations while unpickling: at most 3x the file's size + BUDGET_SLACK bytes
BUDGET_SLACK = 16 << 20        # (arrays are built from their own bytes: a genuine file needs ~1x)
_TEXT_CODECS = frozenset({"latin1", "latin-1", "latin_1", "iso8859-1", "utf-8", "utf8", "ascii"})


class Refused(Exception):
    """A global outside ALLOWED (module.name) or a value of a type a saved state never holds."""


class _Ndarray:
    """What `numpy.ndarray` names in a file: a marker _reconstruct accepts, never called (ndarray(shape) would
    allocate any size the file asks for, and its strides make views far bigger than their bytes)."""

    def __call__(self, *args, **kwargs):
        raise Refused("numpy.ndarray called with arguments (an array must come from its own bytes)")


_NDARRAY = _Ndarray()


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, every allocation charged to a budget tied to the file's size: each opcode
    and each allowed global (wrapped, so the real class is never reachable: no NEWOBJ, no ndarray(shape))."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, budget: int):
        super().__init__(file, encoding="latin1")
        self.budget = budget

    def charge(self, nbytes: int, what: str) -> None:
        self.budget -= max(int(nbytes), 0)
        if self.budget < 0:
            raise Refused(f"more memory than its size allows ({what}: an allocation bomb)")

    def find_class(self, module, name):
        # protocol 2 names Python 2 modules (__builtin__.tuple): map them as pickle does, then check
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) not in ALLOWED:
            raise Refused(f"{module}.{name}")
        if module.startswith("numpy._core"):          # a numpy 2 file read by numpy 1
            module = module.replace("numpy._core", "numpy.core", 1)
        return self._wrapped(module, name)

    def _wrapped(self, module, name):
        import collections

        import numpy as np
        from numpy.core import multiarray

        def container(kind):
            def build(*args):
                if len(args) > 1:
                    raise Refused(f"{kind.__name__} with {len(args)} arguments")
                out = kind(*args)
                self.charge(64 + 8 * len(out), kind.__name__)
                return out
            return build

        def encode(text="", encoding="utf-8", errors="strict"):
            if not isinstance(text, str) or encoding not in _TEXT_CODECS:
                raise Refused(f"_codecs.encode to {str(encoding)[:20]!r}")
            self.charge(len(text), "_codecs.encode")
            return text.encode(encoding, errors)

        def reconstruct(cls, shape, typecode):
            if cls is not _NDARRAY or tuple(shape) != (0,):
                raise Refused("numpy _reconstruct of anything but an empty ndarray (filled from its own bytes)")
            return multiarray._reconstruct(np.ndarray, (0,), typecode)

        def dtype(obj, align=False, copy=False):
            if not isinstance(obj, str) or len(obj) > 8:
                raise Refused(f"numpy.dtype({str(obj)[:20]!r})")
            return np.dtype(obj, align=bool(align), copy=bool(copy))

        def scalar(dt, data=None):
            if not isinstance(dt, np.dtype) or dt.hasobject or not isinstance(data, bytes) \
                    or len(data) != dt.itemsize:
                raise Refused("a numpy scalar not made of its own bytes")
            return multiarray.scalar(dt, data)

        table = {"tuple": container(tuple), "list": container(list), "dict": container(dict),
                 "set": container(set), "frozenset": container(frozenset), "slice": slice,
                 "OrderedDict": container(collections.OrderedDict), "encode": encode, "ndarray": _NDARRAY,
                 "_reconstruct": reconstruct, "dtype": dtype, "scalar": scalar}
        return table[name]

    def load_build(self):
        import numpy as np

        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, np.ndarray):
            _check_array_state(state)
            self.charge(len(state[4]), "array bytes")
        elif not isinstance(inst, np.dtype):
            raise Refused(f"BUILD on a {type(inst).__name__}")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build

    def load_newobj(self):
        raise Refused("NEWOBJ (a saved state never constructs classes)")
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj

    def load_reduce(self):
        self.charge(64, "call")
        super().load_reduce()
    dispatch[pickle.REDUCE[0]] = load_reduce


def _check_array_state(state) -> None:
    """ndarray.__setstate__((version, shape, dtype, fortran, rawdata)): the bytes are the array, all of it."""
    import numpy as np

    if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], np.dtype)
            and isinstance(state[4], bytes) and isinstance(state[1], tuple)
            and all(type(d) is int and 0 <= d < 1 << 40 for d in state[1]) and len(state[1]) <= 32):
        raise Refused("an array state other than (version, shape, dtype, fortran, its bytes)")
    dt, count = state[2], 1
    for d in state[1]:
        count *= d
    if dt.hasobject or count * dt.itemsize != len(state[4]):
        raise Refused(f"an array of shape {state[1]} {dt} whose bytes ({len(state[4])}) do not match it")


def _check(obj, depth: int = 0, sizes: dict | None = None) -> int:
    """Only the types a saved state holds; raises Refused naming the first other one. Returns the number of
    values with every shared container counted each time it is reached, each container visited once (so the
    check is linear in the pickle's size, and a DAG of shared lists shows its real, exponential size)."""
    import numpy as np

    sizes = {} if sizes is None else sizes
    if depth > MAX_DEPTH:
        raise Refused(f"nesting deeper than {MAX_DEPTH}")
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.generic)):
        if isinstance(obj, np.generic) and obj.dtype.hasobject:
            raise Refused("a numpy object scalar")
        return 1
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise Refused(f"a numpy array of dtype {obj.dtype} (Python objects, not numbers)")
        return 1
    if id(obj) in sizes:
        return sizes[id(obj)]
    sizes[id(obj)] = 1 << 62                       # reached again while inside it: a cycle, unbounded
    if type(obj) in (dict,) or type(obj).__name__ == "OrderedDict":
        items = [x for kv in obj.items() for x in kv]
    elif type(obj) in (list, tuple, set, frozenset):
        items = obj
    else:
        raise Refused(f"a {type(obj).__module__}.{type(obj).__qualname__} value")
    sizes[id(obj)] = min(1 + sum(_check(v, depth + 1, sizes) for v in items), 1 << 62)
    return sizes[id(obj)]


def loads(data: bytes):
    """Unpickle bytes with the allow-list and the allocation budget; Refused or pickle/EOF/value errors on
    anything else."""
    obj = _Unpickler(io.BytesIO(data), BUDGET_FACTOR * len(data) + BUDGET_SLACK).load()
    values, limit = _check(obj), len(data) + MAX_VALUES_SLACK
    if values > limit:
        raise Refused(f"containers shared so often that a walk meets {values:.3g} values (over {limit}, "
                      "one per byte of the file)")
    return obj


def _pack_big(obj: dict) -> dict:
    """Join arrays paddle.save split into slices (its UnpackBigParamInfor@@ table), as paddle.load does."""
    import numpy as np

    table = obj.pop(BIG_PARAM_KEY, None)
    if not isinstance(table, dict):
        return obj
    for key, info in table.items():
        parts = [obj.pop(s) for s in info["slices"]]          # each slice once: the result is the file's bytes
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
