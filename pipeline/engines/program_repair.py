"""Patch a saved Paddle 2.6 ProgramDesc (.pdmodel) so Paddle Lite 2.13 `opt` accepts it.

`paddle.jit.save(clip_extra=True)` strips what Paddle 2.6 calls "extra": attributes such as swish
`beta` and relu6 `threshold` (Lite's op_desc GetAttr aborts: "No attributes called beta found") and
intermediate outputs such as XShape of flatten/squeeze2/transpose2 (Lite's flatten dereferences the
missing var -> SIGSEGV). The repair is general, driven by Paddle's own op registry, not per op:
  * attributes: every attribute in the op's definition (core.get_op_attrs_default_value) or its
    extra list (core.get_op_extra_attrs) that the saved op lacks is restored with Paddle's default,
    which is what the Paddle kernel computed with. Backend hints (oneDNN/cuDNN switches, fuse flags,
    oneDNN quant scales) and bookkeeping (op_role, call stacks) are not restored: they do not change
    what the op computes, and Lite reads some of them (e.g. Scale_*) as requests.
  * outputs: every non-dispensable output slot of the op proto (core.get_all_op_protos) that is
    missing gets a fresh variable (XShape: [0] + the input's dims, Paddle's convention).
The repaired program still runs identically in Paddle Inference (restored values are the defaults;
the outputs are unused intermediates). Each change is reported, and the lite stage records them.
"""

import os
from pathlib import Path
from typing import Any

from pipeline.engines.program import FEED_FETCH as _FEED_FETCH
from pipeline.engines.program import parse as _load
from pipeline.engines.program import pb as _pb


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


# Not restored: runtime/backend hints and bookkeeping (see the module docstring).
_HINT_PREFIXES = ("use_", "mkldnn_", "fuse_", "Scale_", "op_")
_HINT_NAMES = {"is_test", "workspace_size_MB", "exhaustive_search", "force_fp32_output", "with_quant_attr"}
_REGISTRY: dict[str, tuple[dict, list]] = {}


def _registry(op_type: str) -> tuple[dict, list]:
    """(attribute defaults, required output slot names) from Paddle's own op definitions; cached."""
    if op_type not in _REGISTRY:
        from paddle.base import core

        attrs: dict = {}
        for getter in (lambda: core.get_op_attrs_default_value(op_type.encode()),
                       lambda: core.get_op_extra_attrs(op_type)):
            try:
                attrs.update(dict(getter()))
            except Exception:  # op unknown to this Paddle build (e.g. a Lite-only op): nothing to restore
                pass
        attrs = {k: v for k, v in attrs.items() if k not in _HINT_NAMES and not k.startswith(_HINT_PREFIXES)}
        if not _REGISTRY:   # first call: index the op protos once
            pb = _pb()
            for raw in core.get_all_op_protos():
                proto = pb.OpProto.FromString(raw)
                _REGISTRY.setdefault("\0outs", ({}, []))[0][proto.type] = [
                    o.name for o in proto.outputs if not o.dispensable]
        outs = _REGISTRY["\0outs"][0].get(op_type, [])
        _REGISTRY[op_type] = (attrs, outs)
    return _REGISTRY[op_type]


def _attr_value(pb: Any, name: str, value: Any) -> Any | None:
    """An OpDesc.Attr holding a Python default, typed like Paddle does; None when not representable."""
    a = pb.OpDesc.Attr(name=name)
    if isinstance(value, bool):
        a.type, a.b = pb.AttrType.BOOLEAN, value
    elif isinstance(value, int):
        if -2 ** 31 <= value < 2 ** 31:
            a.type, a.i = pb.AttrType.INT, value
        else:
            a.type, a.l = pb.AttrType.LONG, value
    elif isinstance(value, float):
        a.type, a.f = pb.AttrType.FLOAT, value
    elif isinstance(value, str):
        a.type, a.s = pb.AttrType.STRING, value
    elif isinstance(value, (list, tuple)) and value:
        # bool before int: bool is a subclass of int
        for kind, attr_type, field in ((bool, "BOOLEANS", "bools"), (int, "INTS", "ints"),
                                       (float, "FLOATS", "floats"), (str, "STRINGS", "strings")):
            if all(isinstance(v, kind) for v in value):
                a.type = getattr(pb.AttrType, attr_type)
                getattr(a, field).extend(value)
                return a
        return None
    else:   # empty lists / block attrs: the type cannot be inferred, and Lite reads none of those
        return None
    return a


def _restore_attrs(pb: Any, op: Any) -> list[str]:
    have = {a.name for a in op.attrs}
    added = []
    for name, value in sorted(_registry(op.type)[0].items()):
        if name in have:
            continue
        attr = _attr_value(pb, name, value)
        if attr is not None:
            added.append(attr)
    if not added:
        return []
    merged = [type(a)() for a in op.attrs]
    for c, a in zip(merged, op.attrs):
        c.CopyFrom(a)
    del op.attrs[:]
    for a in sorted(merged + added, key=lambda a: a.name):   # Paddle keeps attrs sorted by name
        op.attrs.add().CopyFrom(a)
    return [f"{a.name}={_registry(op.type)[0][a.name]!r}" for a in added]


def _add_output(pb: Any, prog: Any, bi: int, op: Any, slot: str) -> None:
    """A fresh variable for a missing output slot: XShape is [0] + X's dims, others take X's shape."""
    ins = {v.parameter: list(v.arguments) for v in op.inputs}
    x_name = next((args[0] for key in ("X", "Input") for args in [ins.get(key) or []] if args), "")
    x_var = _find_var(prog, bi, x_name) if x_name else None
    dims: list[int] = [0] if slot == "XShape" else []
    dtype = pb.VarType.FP32
    if x_var is not None and x_var.type.type == pb.VarType.LOD_TENSOR:
        dims += list(x_var.type.lod_tensor.tensor.dims)
        dtype = x_var.type.lod_tensor.tensor.data_type
    outs = {v.parameter: list(v.arguments) for v in op.outputs}
    out_name = (outs.get("Out") or outs.get("Y") or [x_name or op.type])[0]
    name = _unique_name(prog, f"{out_name}.{slot.lower()}")
    var = prog.blocks[bi].vars.add()
    var.name, var.persistable = name, False
    var.type.type = pb.VarType.LOD_TENSOR
    var.type.lod_tensor.tensor.data_type = dtype
    var.type.lod_tensor.tensor.dims.extend(dims)
    kept = [(v.parameter, list(v.arguments)) for v in op.outputs if v.parameter != slot]
    del op.outputs[:]
    for param, args in kept + [(slot, [name])]:
        op.outputs.add(parameter=param, arguments=args)
    _sorted_vars(op, "outputs")


def _restore_outputs(pb: Any, prog: Any, bi: int, op: Any) -> list[str]:
    filled = {v.parameter for v in op.outputs if v.arguments}
    missing = [slot for slot in _registry(op.type)[1] if slot not in filled]
    for slot in missing:
        _add_output(pb, prog, bi, op, slot)
    return missing


def _write_atomic(path: Path, data: bytes) -> None:
    from pipeline.core.artifacts import atomic_write_bytes
    atomic_write_bytes(path, data)


def repair_for_lite(pdmodel_in: str | os.PathLike, pdmodel_out: str | os.PathLike) -> list[str]:
    """Restore what jit.save dropped; returns one human-readable line per repaired op ([] when none).

    Always writes pdmodel_out (atomically), so a caller can rely on it existing; pdmodel_in may
    equal pdmodel_out. Idempotent: repairing a repaired program returns [].
    """
    pb = _pb()
    prog = _load(pdmodel_in)
    repairs: list[str] = []
    for bi, block in enumerate(prog.blocks):
        for oi, op in enumerate(block.ops):
            if op.type in _FEED_FETCH:
                continue
            what = [f"added {slot} output" for slot in _restore_outputs(pb, prog, bi, op)]
            attrs = _restore_attrs(pb, op)
            if attrs:
                what.append(f"added attribute(s) {', '.join(attrs)}")
            if what:
                repairs.append(f"{op.type}@block{bi}/op{oi}: {'; '.join(what)}")
    src, dst = Path(pdmodel_in), Path(pdmodel_out)
    if repairs or src.resolve() != dst.resolve():
        data = prog.SerializeToString() if repairs else src.read_bytes()
        _write_atomic(dst, data)
    return repairs
