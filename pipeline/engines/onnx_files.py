"""Tensors of an ONNX file that ONNX Runtime or OpenVINO would read from other files (external data), checked
before either opens the model.

ONNX lets any tensor keep its bytes in a file named by `location`, resolved against the model's folder: not only
initializers but a `Constant` node's value, a tensor attribute inside an `If`/`Loop` subgraph or a function, and
sparse tensors. A location such as `Makefile`, `../../etc/hostname` or a symlink makes the engine read that file
as weights (issue 47: its bytes came back as reference outputs and in KServe answers). Here every such tensor is
found and its location, with symlinks followed, must lie inside the model's own folder; an import (a model given
as one file) may hold none at all.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pipeline.core.errors import IntegrityError


def _graph_tensors(graph, where: str):
    for t in graph.initializer:
        yield f"{where}initializer {t.name}", t
    for s in graph.sparse_initializer:
        yield f"{where}sparse initializer {s.values.name}", s.values
        yield f"{where}sparse initializer {s.values.name} (indices)", s.indices
    for node in graph.node:
        yield from _node_tensors(node, where)


def _node_tensors(node, where: str):
    at = f"{where}{node.op_type} node {node.name or '(unnamed)'}"
    for a in node.attribute:
        if a.HasField("t"):
            yield f"{at} attribute {a.name}", a.t
        for t in a.tensors:
            yield f"{at} attribute {a.name}", t
        if a.HasField("sparse_tensor"):
            yield f"{at} attribute {a.name}", a.sparse_tensor.values
            yield f"{at} attribute {a.name}", a.sparse_tensor.indices
        for s in a.sparse_tensors:
            yield f"{at} attribute {a.name}", s.values
            yield f"{at} attribute {a.name}", s.indices
        if a.HasField("g"):
            yield from _graph_tensors(a.g, f"{at} subgraph {a.name}: ")
        for g in a.graphs:
            yield from _graph_tensors(g, f"{at} subgraph {a.name}: ")


def external_tensors(model) -> list[tuple[str, str]]:
    """(where, location) of every tensor of `model` (an onnx.ModelProto) that keeps its bytes in another file."""
    import onnx

    found = []
    tensors = [*_graph_tensors(model.graph, "")]
    for fn in model.functions:
        for node in fn.node:
            tensors.extend(_node_tensors(node, f"function {fn.name}: "))
    for where, t in tensors:
        if t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in t.external_data}
            found.append((where, entries.get("location", "")))
    return found


def _outside(folder: Path, location: str) -> bool:
    """Where an engine would read `location` from (joined to the model's folder as ONNX Runtime does, symlinks
    followed) is not strictly inside that folder."""
    base = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(folder, location)) if location else base
    return not location or os.path.isabs(location) or os.path.commonpath([base, target]) != base or target == base


@lru_cache(maxsize=64)
def _check(path: str, allow_external: bool, _stamp: tuple) -> None:
    import onnx

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:       # a foreign or truncated file: the engine's own load names it; nothing to read
        raise IntegrityError(f"{path} is not a readable ONNX model ({type(exc).__name__})",
                             hint="export the model again") from None
    folder = Path(path).parent
    for where, location in external_tensors(model):
        if not allow_external:
            raise IntegrityError(f"{path}: {where[:120]} keeps its data in an external file ({location[:80]!r})",
                                 hint="save the model as one .onnx file (onnx.save without external data)")
        if _outside(folder, location):
            raise IntegrityError(f"{path}: {where[:120]} reads external data from {location[:80]!r}, outside the "
                                 f"model's folder {folder} (symlinks followed): refused before any engine opened it",
                                 hint="a model's external data lives beside it; re-export or re-download the model")


def confine(path: str | os.PathLike, allow_external: bool = True) -> None:
    """IntegrityError (one line) unless every external-data tensor of the ONNX file at `path` lies inside its
    folder (allow_external=False: unless there is none). Cached per file version (size, mtime)."""
    p = os.path.abspath(path)            # its folder as the engine sees it (a symlinked file: the link's folder)
    st = os.stat(p)
    _check(p, allow_external, (st.st_size, st.st_mtime_ns, st.st_ino))
