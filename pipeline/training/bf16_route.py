"""The static-bf16 route of the train loop: build the program, check it against fp32, record the evidence.

prepare() returns the StaticBf16Trainer the loop steps through, or None when the run falls back to float32
(the plan then says why, in one line). The evidence lands in the train manifest (precision.evidence): the op
census of the executed program (bf16 and fp32 ops by type), why each fp32 type stays fp32, the pre-check
(bf16 forward vs fp32 on one batch, and how many of the bf16-marked ops returned bf16 tensors at run time),
and the CPU's bf16 kernel family.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from pipeline.core import capabilities
from pipeline.core.errors import ConfigError, NonFiniteError
from pipeline.data.preprocess import to_tensor

log = logging.getLogger("pipeline")



def _first_line(exc: BaseException) -> str:
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text[:160]}"


def prepare(ctx, task, model, ds, spec, plan, nproc: int, batch: int, make_optimizer):
    from pipeline.models import imported
    from pipeline.training.static_bf16 import StaticBf16Trainer

    cfg = ctx.cfg
    if nproc > 1:
        raise ConfigError(f"train.amp.dtype=bfloat16 on a CPU trains in one process (Paddle 2.6.2's static-graph "
                          f"bf16 AMP has no data-parallel path here), but {nproc} processes were started",
                          hint="set train.nproc=1 (NPROC=1), or train.amp.enable=false for data-parallel fp32")
    if isinstance(model, imported.Trainable) or any(isinstance(m, imported.Trainable) for m in model.sublayers()):
        plan.fall_back("AMP bfloat16 on CPU: the model is a paddle.jit.load-ed program, which the static bf16 route "
                       "cannot rebuild from its class")
        return None
    x = to_tensor(ds.train.images[:batch], spec)
    y = np.asarray(ds.train.labels[:batch])
    model_cfg = cfg.section("model")["model"]
    try:
        trainer = StaticBf16Trainer(lambda: imported.build(task, model_cfg, ds.info, load_pretrained=False)[0],
                                    task, make_optimizer, batch, list(x.shape[1:]), list(y.shape[1:]),
                                    str(y.dtype), user_fp32=cfg.train.amp.custom_black_list,
                                    user_bf16=cfg.train.amp.custom_white_list)
        trainer.load_weights(model)
        trainer.warm_up(x, y)
    except Exception as exc:
        plan.fall_back(f"AMP bfloat16 on CPU: the model and loss do not build as a static program "
                       f"({_first_line(exc)})")
        return None
    check = _precheck(cfg, model, trainer, x, y, plan)
    if check is None:
        return None
    plan.evidence = _evidence(trainer, check)
    c = trainer.census
    log.info("[train] bf16 program: %d ops bf16, %d fp32 (%s stay fp32), pre-check max|diff| %.3g",
             c["bf16_ops"], c["fp32_ops"], ", ".join(sorted(trainer.fp32)) or "none", check["max_abs_diff"])
    return trainer


def _precheck(cfg, model, trainer, x: np.ndarray, y: np.ndarray, plan) -> dict | None:
    """bf16 forward of the program vs the fp32 dygraph forward on one batch (both in eval mode)."""
    import paddle

    pc = cfg.train.amp.precheck
    if trainer.census["bf16_ops"] == 0:
        plan.fall_back(f"AMP bfloat16 on CPU: no op of this model trains in bf16 here "
                       f"({', '.join(sorted(trainer.fp32)) or 'none'} stay fp32; docs/amp_cpu.md)")
        return None
    # below the share, the static route costs more than bf16 saves: make amp-bench measured the small CNN (5 % of
    # its multiply-adds in bf16) at 0.27x fp32, the zoo ViT (78 %) at 1.05x, ViT-Tiny (92 %) at 1.53x
    share, floor = trainer.census["bf16_mac_share"], cfg.train.amp.bf16_min_mac_share
    if share < floor:
        plan.fall_back(f"AMP bfloat16 on CPU: only {share:.0%} of this model's multiply-adds could run bf16 (conv2d "
                       f"stays fp32), below train.amp.bf16_min_mac_share {floor:.0%}: the static route would cost "
                       "more than it saves")
        return None
    low, ran = trainer.forward_bf16(x, y)
    result = {"enabled": pc.enable, "atol": pc.bf16_atol, **ran}
    if ran["forward_outputs_bf16_at_run_time"] == 0:
        plan.fall_back("AMP bfloat16 on CPU: no op of the program returned a bf16 tensor")
        return None
    if not pc.enable:
        return {**result, "max_abs_diff": None}
    model.eval()
    with paddle.no_grad():
        ref = model(paddle.to_tensor(x)).astype("float32").numpy()
    model.train()
    diff = float(np.abs(ref - low).max()) if np.isfinite(low).all() else math.inf
    result["max_abs_diff"] = diff
    if diff <= pc.bf16_atol:
        return result
    msg = f"AMP pre-check: max |fp32 - bfloat16| = {diff:.3g} > train.amp.precheck.bf16_atol {pc.bf16_atol}"
    if pc.on_fail == "fail":
        raise NonFiniteError(f"train: {msg}", hint="black-list ops (train.amp.custom_black_list) or train fp32")
    plan.fall_back(msg)
    return None


def _evidence(trainer, check: dict) -> dict:
    import paddle

    flags = capabilities.cpu_flags()
    return {"paddle": paddle.__version__, "api": "paddle.static.amp.bf16.decorate_bf16 (O1, fp32 master weights)",
            "cpu_bf16_family": capabilities.kernel_family("bf16", flags),
            "cpu": capabilities.describe(), "program": trainer.census,
            "fp32_types": trainer.fp32, "rewritten": trainer.rewritten, "precheck": check,
            "nonfinite_steps": "skipped by the optimizer (SkipUpdate)" if trainer.skips_nonfinite else
            "applied (momentum has no SkipUpdate): the NaN guard and the epoch's weight check stop the run"}
