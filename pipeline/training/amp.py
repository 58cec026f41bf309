"""AMP planning: what the user asked for, what this device can really do, and the scaler to match.

On CPU, paddle.amp.auto_cast and GradScaler only warn and do nothing, so we decide up front
and record requested vs effective precision honestly (never claim fp16 where fp32 ran). bf16 on a CPU with
bf16 kernels (avx512_bf16, AMX) trains through a static program instead (route "static-bf16":
pipeline/training/static_bf16.py); the dygraph AMP API stays off there (enabled=False).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("pipeline")


@dataclass
class AmpPlan:
    requested: str              # e.g. "float16/O1" or "float32"
    effective: str              # what really runs: "float16/O1", "bfloat16/O2" or "float32"
    enabled: bool
    level: str
    dtype: str
    reason: str = ""
    route: str = "dygraph"      # "static-bf16": bf16 through paddle.static.amp.bf16 on a CPU
    evidence: dict | None = None    # static-bf16: op census of the executed program, pre-check, CPU family

    def as_record(self) -> dict:
        out = {"requested": self.requested, "effective": self.effective, "reason": self.reason}
        if self.route != "dygraph" or self.evidence:
            out.update(route=self.route, evidence=self.evidence)
        return out

    def fall_back(self, why: str) -> None:
        """Train in float32 after all (a failed pre-check, a model the static route cannot build)."""
        log.warning("[train] %s: training in float32", why)
        self.enabled, self.effective, self.route, self.reason = False, "float32", "dygraph", f"{why}: training in float32"

    @property
    def differs(self) -> bool:
        return self.requested != self.effective


def plan(amp_cfg, device: str, caps: dict) -> AmpPlan:
    requested = f"{amp_cfg.dtype}/{amp_cfg.level}" if amp_cfg.enable else "float32"
    if not amp_cfg.enable:
        return AmpPlan(requested, "float32", False, amp_cfg.level, amp_cfg.dtype, "AMP disabled in config")
    if device != "gpu":
        return _plan_cpu(amp_cfg, requested)
    elif amp_cfg.dtype == "float16" and not caps.get("fp16"):
        why = (f"AMP float16 needs CUDA compute capability >= 7.0 (this GPU: {caps.get('compute_capability')}): "
               "training in float32; try amp.dtype=bfloat16 on Ampere+")
    elif amp_cfg.dtype == "bfloat16" and not caps.get("bf16"):
        why = "AMP bfloat16 is not supported on this GPU: training in float32"
    else:
        return AmpPlan(requested, requested, True, amp_cfg.level, amp_cfg.dtype)
    log.warning("[train] %s", why)
    return AmpPlan(requested, "float32", False, amp_cfg.level, amp_cfg.dtype, why)


def _plan_cpu(amp_cfg, requested: str) -> AmpPlan:
    """CPU: bf16 through the static route where oneDNN has bf16 kernels; fp16 and a CPU without bf16 train fp32."""
    from pipeline.core import capabilities

    if amp_cfg.dtype == "float16":
        why = (f"AMP {requested} requested but the device is CPU (Paddle has no fp16 conv/matmul CPU kernels): "
               "training in float32; on a CPU with avx512_bf16 or AMX use train.amp.dtype=bfloat16")
        log.warning("[train] %s", why)
        return AmpPlan(requested, "float32", False, amp_cfg.level, amp_cfg.dtype, why)
    ok, status = capabilities.bf16_cpu_status()
    if not ok:
        why = f"AMP {requested} requested but {status}: training in float32"
        log.warning("[train] %s", why)
        return AmpPlan(requested, "float32", False, amp_cfg.level, amp_cfg.dtype, why)
    why = f"{status}: bf16 through Paddle's static-graph AMP (dygraph auto_cast does nothing on a CPU)"
    if amp_cfg.level == "O2":
        why += ("; O2 (pure bf16) cannot run: no bf16 kernel for adam, momentum, layer_norm_grad, batch_norm, so O1 "
                "with fp32 master weights")
    log.info("[train] AMP %s on CPU: %s", requested, why)
    return AmpPlan(requested, "bfloat16/O1", False, "O1", "bfloat16", why, route="static-bf16")


def make_scaler(amp_cfg, amp_plan: AmpPlan):
    """GradScaler with every knob from config; None when AMP does not run (or bf16: no scaling needed)."""
    import paddle

    if not amp_plan.enabled or amp_plan.dtype == "bfloat16":
        return None
    return paddle.amp.GradScaler(
        enable=True,
        init_loss_scaling=amp_cfg.init_loss_scaling,
        incr_ratio=amp_cfg.incr_ratio,
        decr_ratio=amp_cfg.decr_ratio,
        incr_every_n_steps=amp_cfg.incr_every_n_steps,
        decr_every_n_nan_or_inf=amp_cfg.decr_every_n_nan_or_inf,
        use_dynamic_loss_scaling=amp_cfg.use_dynamic_loss_scaling,
    )


def decorate(model, optimizer, amp_cfg, amp_plan: AmpPlan):
    """O2: low-precision parameters with fp32 master weights. Call before any DataParallel wrapping."""
    import paddle

    if not (amp_plan.enabled and amp_plan.level == "O2"):
        return model, optimizer
    return paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=amp_plan.dtype,
                               master_weight=True, master_grad=amp_cfg.master_grad)


def step_skipped(scaler) -> bool:
    """Whether the last scaler.minimize()/step() skipped the update (inf/nan in the scaled gradients).

    Paddle 2.6 keeps the answer in `_cache_founf_inf` (sic; a Python bool once the optimizer has
    consumed it, else a bool tensor) and the raw check in `_found_inf`. Reading it costs no extra
    device sync: the optimizer already branched on it.
    """
    if scaler is None or not getattr(scaler, "_enable", False):
        return False
    found = getattr(scaler, "_cache_founf_inf", None)
    if found is None:
        found = getattr(scaler, "_found_inf", False)
    return bool(found)


def loss_scale(scaler) -> float | None:
    if scaler is None or not getattr(scaler, "_enable", False):
        return None
    return float(scaler._scale)


def autocast(amp_cfg, amp_plan: AmpPlan):
    """auto_cast for the plan; a no-op context when AMP does not run (no per-step list rebuilding)."""
    import contextlib

    import paddle

    if not amp_plan.enabled:
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(
        enable=amp_plan.enabled,
        custom_white_list=set(amp_cfg.custom_white_list) or None,
        custom_black_list=set(amp_cfg.custom_black_list) or None,
        level=amp_plan.level,
        dtype=amp_plan.dtype,
    )


def fp32_state_dict(model) -> dict:
    """A float32 snapshot of the weights: export always gets float32 parameters (O2 keeps fp16 copies in
    the model), and a copy, not the live tensors, so a kept "best" does not move on with training."""
    import paddle

    out = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        out[k] = v.astype("float32") if v.dtype in (paddle.float16, paddle.bfloat16) else v.clone()
    return out


def load_state(model, state: dict) -> None:
    """set_state_dict that casts each value to the dtype the layer holds (fp32 checkpoints into an O2 model)."""
    import numpy as np
    import paddle

    current = model.state_dict()
    fixed = {}
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            v = paddle.to_tensor(v)
        if k in current and hasattr(v, "astype") and v.dtype != current[k].dtype:
            v = v.astype(current[k].dtype)
        fixed[k] = v
    model.set_state_dict(fixed)
