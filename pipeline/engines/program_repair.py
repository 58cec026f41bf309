"""Patch a saved Paddle 2.6 ProgramDesc (.pdmodel) so Paddle Lite 2.13 `opt` accepts it.

Only the protobuf is touched (parsing needs paddle's generated framework_pb2, not the runtime).
Repairs, both verified to crash `opt` when absent (see /work/shared/STACK.md):
  * flatten_contiguous_range without an XShape output: jit.save(clip_extra=True) strips it and
    Lite's flatten op dereferences the missing var -> SIGSEGV.
  * relu6 without a `threshold` attribute: Paddle 2.6 dropped the attr, Lite's op_desc
    GetAttr("threshold") -> LOG(FATAL) abort.
The repaired program still runs identically in Paddle Inference (XShape is an unused
intermediate output; 6.0 is relu6's only threshold).
"""
import zlib  # noqa: F401  (must precede paddle: libpaddle exports its own zlib symbols)

import os
from pathlib import Path
from typing import Any

from pipeline.errors import DataError

_FEED_FETCH = {"feed", "fetch"}
RELU6_THRESHOLD = 6.0


def _pb() -> Any:
    # Paddle 2.6 moved the protos from paddle.fluid to paddle.base; keep the old path as a fallback.
    try:
        from paddle.base.proto import framework_pb2
    except ImportError:  # pragma: no cover - older paddle
        from paddle.fluid.proto import framework_pb2  # type: ignore[no-redef]
    return framework_pb2


def _load(pdmodel: str | os.PathLike) -> Any:
    path = Path(pdmodel)
    if not path.is_file():
        raise DataError(f"model file not found: {path}")
    prog = _pb().ProgramDesc()
    try:
        prog.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf DecodeError and friends
        raise DataError(f"{path} is not a Paddle ProgramDesc (.pdmodel): {exc}") from exc
    if not prog.blocks:
        raise DataError(f"{path} holds an empty program (no blocks)")
    return prog


def list_ops(pdmodel: str | os.PathLike) -> list[str]:
    """Sorted unique op types of every block, feed/fetch excluded."""
    prog = _load(pdmodel)
    return sorted({op.type for b in prog.blocks for op in b.ops} - _FEED_FETCH)


def _find_var(prog: Any, block_idx: int, name: str) -> Any | None:
    # Vars may live in an ancestor block (sub-blocks of control-flow ops).
    idx = block_idx
    while idx >= 0:
        block = prog.blocks[idx]
        for var in block.vars:
            if var.name == name:
                return var
        idx = block.parent_idx if block.parent_idx != idx else -1
    return None


def _unique_name(prog: Any, base: str) -> str:
    taken = {v.name for b in prog.blocks for v in b.vars}
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def _sorted_vars(op: Any, field: str) -> None:
    # Paddle serialises op inputs/outputs sorted by slot name; keep that canonical order.
    items = sorted((v.parameter, list(v.arguments)) for v in getattr(op, field))
    container = getattr(op, field)
    del container[:]
    for param, args in items:
        container.add(parameter=param, arguments=args)


def _add_xshape(pb: Any, prog: Any, bi: int, op: Any) -> bool:
    outs = {v.parameter: list(v.arguments) for v in op.outputs}
    if outs.get("XShape"):
        return False
    ins = {v.parameter: list(v.arguments) for v in op.inputs}
    x_name = (ins.get("X") or [""])[0]
    x_var = _find_var(prog, bi, x_name) if x_name else None
    dims: list[int] = [0]
    dtype = pb.VarType.FP32
    if x_var is not None and x_var.type.type == pb.VarType.LOD_TENSOR:
        dims += list(x_var.type.lod_tensor.tensor.dims)
        dtype = x_var.type.lod_tensor.tensor.data_type
    out_name = (outs.get("Out") or [x_name or "flatten"])[0]
    name = _unique_name(prog, f"{out_name}.xshape")
    var = prog.blocks[bi].vars.add()
    var.name = name
    var.persistable = False
    var.type.type = pb.VarType.LOD_TENSOR
    var.type.lod_tensor.tensor.data_type = dtype
    var.type.lod_tensor.tensor.dims.extend(dims)
    # Drop an empty XShape slot if one exists, then add the filled one.
    kept = [(v.parameter, list(v.arguments)) for v in op.outputs if v.parameter != "XShape"]
    del op.outputs[:]
    for param, args in kept + [("XShape", [name])]:
        op.outputs.add(parameter=param, arguments=args)
    _sorted_vars(op, "outputs")
    return True


def _add_relu6_threshold(pb: Any, op: Any) -> bool:
    if any(a.name == "threshold" for a in op.attrs):
        return False
    attrs = [a for a in op.attrs]
    new = pb.OpDesc.Attr(name="threshold", type=pb.AttrType.FLOAT, f=RELU6_THRESHOLD)
    copies = [type(a)() for a in attrs]
    for c, a in zip(copies, attrs):
        c.CopyFrom(a)
    del op.attrs[:]
    for a in sorted(copies + [new], key=lambda a: a.name):
        op.attrs.add().CopyFrom(a)
    return True


def _write_atomic(path: Path, data: bytes) -> None:
    from pipeline.artifacts import atomic_write_bytes
    atomic_write_bytes(path, data)


def repair_for_lite(pdmodel_in: str | os.PathLike, pdmodel_out: str | os.PathLike) -> list[str]:
    """Apply the Lite repairs; returns one human-readable line per change ([] when none needed).

    Always writes pdmodel_out (atomically), so a caller can rely on it existing; pdmodel_in may
    equal pdmodel_out. Idempotent: repairing a repaired program returns [].
    """
    pb = _pb()
    prog = _load(pdmodel_in)
    repairs: list[str] = []
    for bi, block in enumerate(prog.blocks):
        for oi, op in enumerate(block.ops):
            where = f"{op.type}@block{bi}/op{oi}"
            if op.type == "flatten_contiguous_range" and _add_xshape(pb, prog, bi, op):
                repairs.append(f"{where}: added XShape output")
            elif op.type == "relu6" and _add_relu6_threshold(pb, op):
                repairs.append(f"{where}: added threshold=6.0 attribute")
    src, dst = Path(pdmodel_in), Path(pdmodel_out)
    if repairs or src.resolve() != dst.resolve():
        data = prog.SerializeToString() if repairs else src.read_bytes()
        _write_atomic(dst, data)
    return repairs
