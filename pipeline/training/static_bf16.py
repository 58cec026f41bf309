"""bf16 mixed-precision training on a CPU, through Paddle 2.6.2's static-graph AMP (`paddle.static.amp.bf16`).

Dygraph `auto_cast` does nothing on a CPU (it warns), so a bf16 run builds the model's class a second time in
static mode (the same nn.Layer code: its forward() is traced into a Program), copies the dygraph weights in,
rewrites the program with `decorate_bf16` (fp32 master weights: parameters stay fp32, a cast feeds each bf16 op)
and trains that program with an Executor. The loop (pipeline/training/loop.py) keeps everything else: batches,
seeds, checkpoints (the weights go back into the dygraph model at every epoch end), validation, telemetry.

Which ops run bf16 is derived from the kernels Paddle registers: an op type runs bf16 only when it and its grad
op have a bf16 kernel (core._get_all_register_op_kernels), minus the types measured to fail (BROKEN below).
Two program passes before the rewrite, both exact in fp32:
  - nn.Linear's `matmul_v2` (2-D parameter, no transpose) becomes `mul` (bf16 `matmul_v2_grad` fails, `mul_grad` runs);
  - a `cast` to the dtype its input already has (the loss's `astype("float32")`) becomes `assign`: after the rewrite
    such a cast would see bf16 input but keep its fp32 in_dtype, and its grad then fails with a dtype mismatch.
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from functools import lru_cache

import numpy as np

log = logging.getLogger("pipeline")

ROUTE = "static-bf16"
# registered with a bf16 kernel, but training with it fails in Paddle 2.6.2 (measured; docs/amp_cpu.md)
BROKEN = {
    "conv2d": "oneDNN conv forward refuses a bf16 filter; an fp32 filter with bf16 input is a dtype mismatch",
    "depthwise_conv2d": "same oneDNN conv path as conv2d",
    "conv2d_transpose": "same oneDNN conv path as conv2d",
    "matmul_v2": "bf16 matmul_v2_grad fails (dtype mismatch, or SIGSEGV); Linear layers are rewritten to mul",
}
_IGNORED = {"feed", "fetch", "cast"}


@lru_cache(maxsize=1)
def _kernels() -> dict:
    from paddle.base import core

    return core._get_all_register_op_kernels("all")


def bf16_kernel_types() -> frozenset:
    """Op types with a bf16 kernel registered on the CPU (phi and fluid kernels alike)."""
    return frozenset(op for op, keys in _kernels().items() if any("bfloat16" in k for k in keys))


def fp32_types(op_types, user_fp32=(), user_bf16=()) -> dict:
    """{op type: why it stays fp32} for the forward op types of a program. bf16 needs a bf16 kernel for the op
    and its grad; among those, only Paddle's compute-bound white list (mul, matmul, conv2d...) runs bf16 by
    default: the element-wise and data-movement ops Paddle would let follow their input (its gray list) ran
    slower in bf16 than in fp32 here (oneDNN reorders around each; docs/amp_cpu.md), so they stay fp32 unless
    train.amp.custom_white_list names them."""
    from paddle.amp.amp_lists import BF16_WHITE_LIST

    have = bf16_kernel_types()
    out = {}
    for t in sorted(set(op_types) - _IGNORED):
        if t in user_fp32:
            out[t] = "train.amp.custom_black_list"
        elif t in BROKEN:
            out[t] = BROKEN[t]
        elif t not in have:
            out[t] = "no bf16 kernel registered"
        elif f"{t}_grad" in _kernels() and f"{t}_grad" not in have:
            out[t] = f"no bf16 kernel for {t}_grad"
        elif t not in BF16_WHITE_LIST and t not in user_bf16:
            out[t] = "memory-bound: its bf16 variant was slower than fp32 (train.amp.custom_white_list runs it bf16)"
    return out


@contextlib.contextmanager
def static_mode():
    """Static mode for building the program; dygraph (the loop's mode) restored after, whatever happens."""
    import paddle

    was_dygraph = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        yield
    finally:
        if was_dygraph:
            paddle.disable_static()


def _linear_to_mul(block) -> int:
    """matmul_v2(X, W) with a 2-D parameter W and no transpose -> mul(X, W) over X's last axis (same math)."""
    n = 0
    for i, op in enumerate(list(block.ops)):
        if op.type != "matmul_v2" or op.attr("trans_x") or op.attr("trans_y"):
            continue
        x, w = block.var(op.input("X")[0]), block.var(op.input("Y")[0])
        if len(w.shape) != 2 or not w.persistable or len(x.shape) < 2:
            continue
        out = block.var(op.output("Out")[0])
        block._remove_op(i, sync=False)
        block._insert_op(i, type="mul", inputs={"X": [x], "Y": [w]}, outputs={"Out": [out]},
                         attrs={"x_num_col_dims": len(x.shape) - 1, "y_num_col_dims": 1})
        n += 1
    return n


def _identity_casts_to_assign(block) -> int:
    n = 0
    for i, op in enumerate(list(block.ops)):
        if op.type == "cast" and op.attr("in_dtype") == op.attr("out_dtype"):
            x, out = block.var(op.input("X")[0]), block.var(op.output("Out")[0])
            block._remove_op(i, sync=False)
            block._insert_op(i, type="assign", inputs={"X": [x]}, outputs={"Out": [out]})
            n += 1
    return n


def _onednn_casts(program) -> int:
    """fp32<->bf16 casts through oneDNN's reorder instead of Paddle's plain loop: the casts around every bf16 op
    took 32 % of a ViT step with the plain kernel, half that with oneDNN's; and the plain fp32->bf16 cast truncates
    (1.0049 -> 1.0) where oneDNN rounds to nearest even (-> 1.0078). Measured on ViT-Tiny, not taken
    (docs/amp_cpu.md): plain truncating fp32->bf16 casts were 1.14x faster with 0.78x the peak RSS (batch 256);
    plain bf16->fp32 casts only (exact, same numerics) 0.8x the speed."""
    from paddle.base import core

    bf16, n = core.VarDesc.VarType.BF16, 0
    for op in program.global_block().ops:
        if op.type == "cast" and op.has_attr("use_mkldnn") and bf16 in (op.attr("in_dtype"), op.attr("out_dtype")):
            op._set_attr("use_mkldnn", True)
            n += 1
    return n


def _macs(block, op) -> int:
    """Multiply-adds of one matmul/conv op from the program's static shapes (batch fixed; any -1 counts as 1)."""
    shape = lambda name: [abs(int(d)) or 1 for d in block.var(name).shape]
    if op.type == "mul":
        x, w = shape(op.input("X")[0]), shape(op.input("Y")[0])
        return int(np.prod(x[:op.attr("x_num_col_dims")])) * int(np.prod(w))
    if op.type == "matmul_v2":
        x = shape(op.input("X")[0])
        return int(np.prod(shape(op.output("Out")[0]))) * x[-2 if op.attr("trans_x") else -1]
    if op.type in ("conv2d", "depthwise_conv2d", "conv2d_transpose"):
        f = shape(op.input("Filter")[0])
        return int(np.prod(shape(op.output("Output")[0]))) * int(np.prod(f[1:]))
    return 0


def bf16_mac_share(program) -> float:
    """Share of the forward multiply-adds (matmul, mul, conv) that run in bf16: what bf16 can speed up at all."""
    block = program.global_block()
    total = bf16 = 0
    for op in block.ops:
        n = _macs(block, op)
        total += n
        bf16 += n if is_bf16_op(op) else 0
    return bf16 / total if total else 0.0


def is_bf16_op(op) -> bool:
    return op.has_attr("mkldnn_data_type") and op.attr("mkldnn_data_type") == "bfloat16" \
        and op.has_attr("use_mkldnn") and bool(op.attr("use_mkldnn"))


def op_census(program) -> dict:
    """What the program will run: bf16 and fp32 ops by type (casts counted apart)."""
    bf16, fp32, casts = Counter(), Counter(), 0
    for op in program.global_block().ops:
        if op.type == "cast":
            casts += 1
        elif op.type not in ("feed", "fetch"):
            (bf16 if is_bf16_op(op) else fp32)[op.type] += 1
    return {"bf16_ops": sum(bf16.values()), "fp32_ops": sum(fp32.values()), "casts": casts,
            "bf16_by_type": dict(sorted(bf16.items())), "fp32_by_type": dict(sorted(fp32.items()))}


class StaticBf16Trainer:
    """The bf16 training program of one model, its Executor and its own scope.

    build_layer() makes a fresh instance of the model's class (called in static mode); make_optimizer(layer) ->
    (optimizer, lr scheduler). Batches have a fixed size (the loop drops the last partial batch)."""

    def __init__(self, build_layer, task, make_optimizer, batch: int, x_shape, y_shape, y_dtype: str,
                 user_fp32=(), user_bf16=(), bf16: bool = True):
        import paddle
        from paddle.static.amp import bf16 as amp_bf16

        self.batch = batch
        self.main, startup = paddle.static.Program(), paddle.static.Program()
        with static_mode(), paddle.utils.unique_name.guard(), paddle.static.program_guard(self.main, startup):
            layer = build_layer()
            x = paddle.static.data("x", [batch, *x_shape], "float32")
            y = paddle.static.data("y", [batch, *y_shape], y_dtype)
            for var in (x, y):      # shapes stay fixed for the census; warm_up() feeds a smaller batch (why: there)
                var.desc.set_need_check_feed(False)
            out = layer(x)
            loss = task.loss(out, y)
            # 1.0 in training; tests inject a non-finite loss through it (the loop's loss_hook): one multiply
            loss = loss * paddle.static.data("loss_factor", [1], "float32")
            block = self.main.global_block()
            self.rewritten = {"linear_to_mul": _linear_to_mul(block), "identity_cast_to_assign":
                              _identity_casts_to_assign(block)}
            self.main._sync_with_cpp()
            self.fp32 = fp32_types([op.type for op in block.ops], set(user_fp32), set(user_bf16))
            bf16_extra = set(user_bf16) - set(self.fp32)
            lists = amp_bf16.AutoMixedPrecisionListsBF16(custom_fp32_list=set(self.fp32),
                                                         custom_bf16_list=bf16_extra or None)
            self.test = self.main.clone(for_test=True)
            if bf16:
                amp_bf16.rewrite_program_bf16(self.test, lists)
            opt, self.sched = make_optimizer(layer)
            # bf16=False: the same program in fp32 (make amp-bench's "static fp32" row: the route's own cost)
            dec = amp_bf16.decorate_bf16(opt, amp_lists=lists, use_bf16_guard=False, use_pure_bf16=False) if bf16 \
                else opt
            params_grads = dec.backward(loss, startup)
            if hasattr(opt, "_set_auxiliary_var"):   # adam(w): SkipUpdate leaves weights and moments untouched
                opt._set_auxiliary_var("found_inf", paddle.logical_not(paddle.isfinite(loss)))
            if bf16:
                dec.apply_optimize(loss, startup, params_grads)
            else:
                with paddle.static.program_guard(self.main, startup):
                    opt.apply_gradients(params_grads)
            self.skips_nonfinite = opt.type in ("adam", "adamw")
            self.onednn_casts = _onednn_casts(self.main) + _onednn_casts(self.test) if bf16 else 0
        self.names = {k: v.name for k, v in layer.state_dict().items()}
        self.loss_name, self.out_name = loss.name, out.name
        self.scope = paddle.static.Scope()
        self.exe = paddle.static.Executor(paddle.CPUPlace())
        self._run(startup)
        self.census = {**op_census(self.main), "bf16_mac_share": round(bf16_mac_share(self.test), 4)}

    def _run(self, program, feed=None, fetch=()):
        import paddle

        # ops one after another on this thread: on ViT-Tiny (batch 64) 1.1x (bf16) and 1.3x (fp32) faster than the
        # executor's worker threads and 0.7x their peak RSS (fewer malloc arenas holding freed activations)
        serial = paddle.get_flags(["FLAGS_new_executor_serial_run"])
        paddle.set_flags({"FLAGS_new_executor_serial_run": True})
        try:
            with static_mode(), paddle.static.scope_guard(self.scope):
                return self.exe.run(program, feed=feed or {}, fetch_list=list(fetch), scope=self.scope,
                                    return_numpy=True)
        finally:
            paddle.set_flags(serial)

    def _tensor(self, name: str):
        return self.scope.find_var(name).get_tensor()

    # ----------------------------------------------------------------- weights and optimizer state
    def load_weights(self, model) -> None:
        """Dygraph model -> program (by structured key: the program's parameter names are its own)."""
        import paddle

        state = model.state_dict()
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise RuntimeError(f"static bf16 program: the dygraph model lacks {missing[0]} ({len(missing)} keys)")
        for key, name in self.names.items():
            self._tensor(name).set(state[key].numpy(), paddle.CPUPlace())

    def store_weights(self, model) -> None:
        """Program -> dygraph model: the fp32 master weights and BatchNorm statistics the loop validates and saves."""
        state = model.state_dict()
        for key, name in self.names.items():
            state[key].set_value(np.array(self._tensor(name)))

    def _optimizer_vars(self) -> list[str]:
        weights = set(self.names.values())
        return sorted(v.name for v in self.main.list_vars()
                      if v.persistable and v.name not in weights and v.name not in ("feed", "fetch")
                      and self.scope.find_var(v.name) is not None and self._tensor(v.name)._is_initialized())

    def state_dict(self) -> dict:
        """Optimizer accumulators (moments, beta powers, learning-rate variable) as numpy arrays."""
        return {name: np.array(self._tensor(name)) for name in self._optimizer_vars()}

    def set_state_dict(self, state: dict) -> None:
        import paddle

        for name in self._optimizer_vars():
            if name in state:
                self._tensor(name).set(np.asarray(state[name]), paddle.CPUPlace())

    # ----------------------------------------------------------------- running
    def warm_up(self, x: np.ndarray, y: np.ndarray, n: int = 2) -> None:
        """Run both programs once on n samples and put every persistable (weights, BatchNorm statistics, optimizer
        state) and the RNG back as they were. The first run of a program is the executor's build run, and in
        Paddle 2.6.2 a bf16 program's build run keeps far more tensors alive than its later runs (ViT-Tiny: 493 MB
        vs 233 at batch 64, 1890 vs 859 at 256; fp32 programs alike in both; most likely the tensors around the 150
        layout transfers the executor inserts for oneDNN ops): at the real batch it set the process's peak RSS.
        Bit-identical training either way (tests/test_amp_cpu.py; docs/amp_cpu.md, round 3)."""
        import paddle

        saved = {name: np.array(self._tensor(name)) for name in [*self.names.values(), *self._optimizer_vars()]}
        rng = paddle.get_rng_state()
        try:
            self.step(x[:n], y[:n])
            self.forward_bf16(x[:n], y[:n])
        except Exception as exc:    # e.g. a model that bakes the batch into a reshape: no warm-up, a fresh executor
            log.debug("static program warm-up on %d samples failed (%s): the first step builds it", n, exc)
            self.exe = paddle.static.Executor(paddle.CPUPlace())
        finally:
            paddle.set_rng_state(rng)
            for name, value in saved.items():
                self._tensor(name).set(value, paddle.CPUPlace())

    def step(self, x: np.ndarray, y: np.ndarray, loss_factor: float = 1.0) -> float:
        feed = {"x": x, "y": y, "loss_factor": np.array([loss_factor], dtype="float32")}
        loss, = self._run(self.main, feed, [self.loss_name])
        return float(np.asarray(loss).reshape(-1)[0])

    def forward_bf16(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict]:
        """The rewritten forward (test mode) on one batch -> (outputs as fp32, run-time dtype evidence): the
        outputs of the ops marked bf16 are fetched and their dtype counted (bf16 arrives as uint16)."""
        block = self.test.global_block()
        marked = [op.output_arg_names[0] for op in block.ops if is_bf16_op(op) and op.output_arg_names]
        feed = {"x": x, "y": y, "loss_factor": np.ones([1], "float32")}
        got = self._run(self.test, feed, [self.out_name, *marked])
        out, rest = np.asarray(got[0]), got[1:]
        if out.dtype == np.uint16:          # a model whose last op ran bf16
            out = (out.astype(np.uint32) << 16).view(np.float32)
        ran = sum(1 for a in rest if np.asarray(a).dtype == np.uint16)
        return out.astype(np.float32), {"forward_ops_marked_bf16": len(marked), "forward_outputs_bf16_at_run_time": ran}
