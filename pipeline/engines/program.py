"""Reading a saved Paddle 2.x inference program (.pdmodel ProgramDesc): the one parser every engine module uses.

Files of a model are named by their prefix (`<prefix>.pdmodel` + `<prefix>.pdiparams`). A missing file is a
MissingArtifact; bytes that are not a ProgramDesc (a PIR .json, a truncated file) are a DataError. Nothing here
imports the engines, so every engine module (Paddle Inference, perf, fp16 emulation, quantization, Lite repair)
can import it without a cycle.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeline.core.errors import DataError, MissingArtifact, PipelineError

FEED_FETCH = frozenset({"feed", "fetch"})


def pb() -> Any:
    """Paddle's framework protobuf module (imported lazily: reading a program needs no paddle runtime)."""
    from paddle.base.proto import framework_pb2
    return framework_pb2


def files(model_prefix: str | os.PathLike) -> tuple[str, str]:
    """(<prefix>.pdmodel, <prefix>.pdiparams), both present, or MissingArtifact naming the missing one."""
    prefix = str(model_prefix)
    model, params = prefix + ".pdmodel", prefix + ".pdiparams"
    for f in (model, params):
        if not os.path.isfile(f):
            raise MissingArtifact(f"inference model file not found: {f}",
                                  hint="pass the path prefix without .pdmodel/.pdiparams")
    return model, params


def parse(pdmodel: str | os.PathLike) -> Any:
    """A .pdmodel file -> ProgramDesc with at least one block."""
    path = Path(pdmodel)
    if not path.is_file():
        raise MissingArtifact(f"model file not found: {path}", hint="pass an existing .pdmodel file")
    desc = pb().ProgramDesc()
    try:
        desc.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf DecodeError and friends
        raise DataError(f"cannot parse {path}: not a Paddle 2.x ProgramDesc ({exc})",
                        hint="is it a Paddle 2.x .pdmodel (not a Paddle 3 PIR .json, not truncated)?") from None
    if not desc.blocks:
        raise DataError(f"{path} holds an empty program (no blocks)", hint="re-export with paddle.jit.save")
    return desc


def program_desc(model_prefix: str | os.PathLike) -> Any:
    """The ProgramDesc of a model prefix (both files must exist)."""
    return parse(files(model_prefix)[0])


def feed_name(block: Any, model_prefix: str | os.PathLike) -> str:
    feeds = [a for op in block.ops if op.type == "feed" for o in op.outputs for a in o.arguments]
    if not feeds:
        raise PipelineError(f"{model_prefix}.pdmodel has no feed op", hint="re-export with paddle.jit.save")
    return feeds[0]


def program_ops(model_prefix: str | os.PathLike) -> list[str]:
    """Op types of the main block, in program order (feed/fetch included)."""
    return [op.type for op in program_desc(model_prefix).blocks[0].ops]


def program_input_shape(model_prefix: str | os.PathLike) -> list[int]:
    """Declared shape of the (single) feed variable; -1 marks dynamic dims."""
    block = program_desc(model_prefix).blocks[0]
    feed = feed_name(block, model_prefix)
    for v in block.vars:
        if v.name == feed:
            return [int(d) for d in v.type.lod_tensor.tensor.dims]
    raise PipelineError(f"feed variable {feed!r} not declared in {model_prefix}.pdmodel")
