"""Which forward tensors a training program keeps for its backward pass, fp32 program vs bf16 (O1) program.

Why bf16 O1 on a CPU saves little activation memory (docs/amp_cpu.md): only the ops that run bf16 (nn.Linear's
`mul`) read bf16 copies of their inputs in the backward pass; everything else the backward reads (residual adds,
attention softmax and transposes, layer_norm statistics) stays fp32. This reads the static program itself: a
forward op's output counts when a backward op reads its buffer (Paddle's no-need-buffer inputs, e.g. the shapes
elementwise_add_grad reads, excluded), in MB at the given batch, by dtype and by the op that produced it.

    .venv/bin/python scripts/amp_activations.py --config configs/vit_tiny.yaml --batch 64
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)


def saved_for_backward(program) -> dict:
    """{dtype: {producer op type: MB}} of the forward outputs read by backward ops."""
    from paddle.base import core

    block = program.global_block()
    role_attr = core.op_proto_and_checker_maker.kOpRoleAttrName()
    backward, forward = int(core.op_proto_and_checker_maker.OpRole.Backward), 0
    produced, out = {}, defaultdict(lambda: defaultdict(float))
    for op in block.ops:
        role = int(op.attr(role_attr))
        if role == forward:
            produced.update({n: op.type for n in op.output_arg_names if not block.var(n).persistable})
        elif role & backward:
            slots = core.infer_no_need_buffer_slots(op.type, {k: op.input(k) for k in op.input_names},
                                                    {k: op.output(k) for k in op.output_names}, {})
            no_buffer = {n for slot in slots for n in op.input(slot)}
            for name in set(op.input_arg_names) - no_buffer:
                if name in produced:
                    var = block.var(name)
                    size = 2 if var.dtype == core.VarDesc.VarType.BF16 else 4
                    dtype = str(var.dtype).rsplit(".", 1)[-1].lower()
                    out[dtype][produced.pop(name)] += int(np.prod([abs(d) for d in var.shape])) * size / 2**20
    return {dt: dict(sorted(by.items(), key=lambda kv: -kv[1])) for dt, by in out.items()}


def build(config: Path, batch: int, overrides: list[str], bf16: bool):
    from pipeline.core.config import load_config
    from pipeline.data.preprocess import to_tensor
    from pipeline.models import imported
    from pipeline.tasks import get_task
    from pipeline.training.static_bf16 import StaticBf16Trainer

    import paddle

    cfg = load_config([config], ["data.num_train=8", "data.num_val=8", *overrides])
    task = get_task(cfg.task, cfg.section("detection")["detection"])
    ds = task.load_data(cfg.section("data")["data"], cfg.seed)
    x = to_tensor(ds.train.images[:1], task.preprocess_spec(cfg.section("data")["data"], ds.info))
    y = np.asarray(ds.train.labels[:1])
    model_cfg = cfg.section("model")["model"]
    return StaticBf16Trainer(lambda: imported.build(task, model_cfg, ds.info, load_pretrained=False)[0], task,
                             lambda layer: (paddle.optimizer.Adam(1e-3, parameters=layer.parameters()), None),
                             batch, list(x.shape[1:]), list(y.shape[1:]), str(y.dtype), bf16=bf16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "vit_tiny.yaml")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("-o", dest="overrides", action="append", default=[], help="config override key=value")
    args = p.parse_args()
    from pipeline.core import env
    from pipeline.core.errors import PipelineError

    env.import_paddle_quietly()
    totals = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        try:
            saved = saved_for_backward(build(args.config, args.batch, args.overrides, bf16).main)
        except PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        totals[name] = sum(sum(by.values()) for by in saved.values())
        print(f"{name} program, batch {args.batch}: {totals[name]:.1f} MB kept for the backward pass")
        for dtype, by in saved.items():
            if sum(by.values()) < 0.05:         # int labels, shapes
                continue
            parts = ", ".join(f"{op} {mb:.1f}" for op, mb in by.items() if mb >= 0.05)
            print(f"  {dtype:9s} {sum(by.values()):7.1f} MB  ({parts})")
    print(f"bf16 / fp32: {totals['bf16'] / totals['fp32']:.2f}x of the activations kept for backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
