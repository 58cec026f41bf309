"""One handler per PIR op: each appends the Paddle 2.6 op(s) that compute the same thing to a static block.

Handlers follow the legacy op definitions Paddle 2.6's `jit.save` writes for the same layers (PP-OCRv4's exported
programs hold the same ops), attributes included: `XShape` outputs on reshape2/transpose2/flatten/squeeze2, `beta`
on swish, `threshold/scale/offset` on hard_swish, which Paddle Lite's `opt` requires. Constants the PIR program
builds with `full` / `full_int_array` (shapes, axes, scales) become attributes, as in the legacy ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

DTYPE = {"0.t_f32": "float32", "0.t_f64": "float64", "0.t_i64": "int64", "0.t_i32": "int32", "0.t_ui8": "uint8",
         "0.t_i8": "int8", "0.t_bool": "bool", "0.t_f16": "float16"}


@dataclass
class Const:
    """A compile-time value (a `full` or `full_int_array` output): folded into the consumer's attributes."""
    value: Any
    dtype: str


class Untranslatable(Exception):
    """A known op in a form this translator does not handle (e.g. a size given as a runtime tensor)."""


class Ctx:
    """The block being written and the PIR value id -> Variable / Const / list map."""

    def __init__(self, block):
        self.block, self.values, self.feeds, self.fetch = block, {}, [], []

    def get(self, vid):
        return None if vid == 0 else self.values[vid]

    def const(self, vid, what: str):
        v = self.get(vid)
        if not isinstance(v, Const):
            raise Untranslatable(f"{what} given as a runtime tensor")
        return v.value

    def var(self, vid):
        return self.var_of(self.get(vid))

    def var_of(self, v, dtype=None):
        """A Variable for value `v`; a scalar constant becomes a fill_constant op of shape [1]."""
        if isinstance(v, Const):
            import numpy as np
            arr = np.asarray(v.value).ravel()
            if arr.size != 1:
                raise Untranslatable("a non-scalar constant used as a tensor")
            out = self.new(dtype or v.dtype)
            self.block.append_op(type="fill_constant", outputs={"Out": [out]},
                                 attrs={"shape": [1], "dtype": out.dtype, "value": float(arr[0]),
                                        "str_value": str(arr[0].item()), "force_cpu": True})
            return out
        return v

    def var_int32(self, v):
        """A ShapeTensor entry: int32, as the legacy reshape2 reads it (shape ops here write int32 already)."""
        out = self.var_of(v, "int32")
        if out.dtype != _int32():
            cast = self.new("int32")
            self.block.append_op(type="cast", inputs={"X": [out]}, outputs={"Out": [cast]},
                                 attrs={"in_dtype": out.dtype, "out_dtype": _int32()})
            out = cast
        return out

    def new(self, dtype="float32"):
        from paddle.base import unique_name
        return self.block.create_var(name=unique_name.generate("pir.tmp"), dtype=dtype)

    def out(self, op, i=0, dtype=None):
        o = op["out"][i]
        v = self.new(dtype or o["dtype"])
        self.values[o["id"]] = v
        return v


def _unary(legacy: str, **fixed) -> Callable:
    def run(ctx, op):
        ctx.block.append_op(type=legacy, inputs={"X": [ctx.var(op["in"][0])]}, outputs={"Out": [ctx.out(op)]},
                            attrs=dict(fixed))
    return run


def _elementwise(legacy: str) -> Callable:
    def run(ctx, op):
        ctx.block.append_op(type=legacy, inputs={"X": [ctx.var(op["in"][0])], "Y": [ctx.var(op["in"][1])]},
                            outputs={"Out": [ctx.out(op)]}, attrs={"axis": -1})   # numpy broadcasting, as PIR
    return run


def _with_xshape(legacy: str, attrs_of: Callable) -> Callable:
    def run(ctx, op):
        x = ctx.var(op["in"][0])
        xshape = ctx.new(x.dtype)
        ctx.block.append_op(type=legacy, inputs={"X": [x]}, outputs={"Out": [ctx.out(op)], "XShape": [xshape]},
                            attrs=attrs_of(ctx, op))
    return run


def conv(legacy: str) -> Callable:
    def run(ctx, op):
        a = op["attrs"]
        attrs = {k: a[k] for k in ("strides", "paddings", "padding_algorithm", "dilations", "groups", "data_format")}
        if legacy == "depthwise_conv2d":
            attrs["use_cudnn"] = False
        if legacy == "conv2d_transpose":
            attrs["output_padding"] = list(a.get("output_padding") or [])
            attrs["output_size"] = [int(v) for v in (ctx.const(op["in"][2], "conv2d_transpose output_size")
                                                     if len(op["in"]) > 2 and op["in"][2] else [])]
        ctx.block.append_op(type=legacy, inputs={"Input": [ctx.var(op["in"][0])], "Filter": [ctx.var(op["in"][1])]},
                            outputs={"Output": [ctx.out(op)]}, attrs=attrs)
    return run


def batch_norm(ctx, op):
    x, mean, var, scale, bias = (ctx.var(v) for v in op["in"])   # PIR order: x, mean, variance, scale, bias
    a = op["attrs"]
    ctx.block.append_op(
        type="batch_norm", inputs={"X": [x], "Scale": [scale], "Bias": [bias], "Mean": [mean], "Variance": [var]},
        outputs={"Y": [ctx.out(op)], "MeanOut": [mean], "VarianceOut": [var], "SavedMean": [ctx.new()],
                 "SavedVariance": [ctx.new()]},
        attrs={"is_test": True, "momentum": a["momentum"], "epsilon": a["epsilon"], "data_layout": a["data_format"],
               "use_global_stats": a.get("use_global_stats", True),
               "trainable_statistics": a.get("trainable_statistics", False)})


def layer_norm(ctx, op):
    ins = {"X": [ctx.var(op["in"][0])]}
    for key, vid in zip(("Scale", "Bias"), op["in"][1:3]):
        if vid:
            ins[key] = [ctx.var(vid)]
    ctx.block.append_op(type="layer_norm", inputs=ins,
                        outputs={"Y": [ctx.out(op)], "Mean": [ctx.new()], "Variance": [ctx.new()]},
                        attrs={"epsilon": op["attrs"]["epsilon"], "begin_norm_axis": op["attrs"]["begin_norm_axis"]})


def pool2d(ctx, op):
    a = op["attrs"]
    attrs = {k: a[k] for k in ("strides", "paddings", "ceil_mode", "exclusive", "data_format", "pooling_type",
                               "global_pooling", "adaptive", "padding_algorithm")}
    attrs["ksize"] = [int(v) for v in ctx.const(op["in"][1], "pool2d kernel_size")]
    attrs["use_cudnn"] = False
    ctx.block.append_op(type="pool2d", inputs={"X": [ctx.var(op["in"][0])]}, outputs={"Out": [ctx.out(op)]},
                        attrs=attrs)


def interp(legacy: str) -> Callable:
    def run(ctx, op):
        if any(op["in"][1:]):
            raise Untranslatable("output size or scale given as a runtime tensor")
        a = op["attrs"]
        attrs = {k: a[k] for k in ("out_d", "out_h", "out_w", "interp_method", "align_corners", "align_mode")}
        attrs.update(data_layout=a["data_format"], scale=[float(s) for s in a["scale"]])
        ctx.block.append_op(type=legacy, inputs={"X": [ctx.var(op["in"][0])]}, outputs={"Out": [ctx.out(op)]},
                            attrs=attrs)
    return run


def reshape(ctx, op):
    x, shape = ctx.var(op["in"][0]), ctx.get(op["in"][1])
    ins, attrs = {"X": [x]}, {}
    if isinstance(shape, Const):
        attrs["shape"] = [int(v) for v in shape.value]
    elif isinstance(shape, list):                # stack(combine(scalars)): the legacy ShapeTensor list
        attrs["shape"] = [int(v.value) if isinstance(v, Const) else -1 for v in shape]
        ins["ShapeTensor"] = [ctx.var_int32(v) for v in shape]
    else:
        raise Untranslatable("shape given as a computed tensor")
    xshape = ctx.new(x.dtype)
    ctx.block.append_op(type="reshape2", inputs=ins, outputs={"Out": [ctx.out(op)], "XShape": [xshape]}, attrs=attrs)


def stack(ctx, op):
    items = ctx.get(op["in"][0])
    if all(isinstance(v, Const) for v in items):
        ctx.values[op["out"][0]["id"]] = Const([v.value for v in items], op["out"][0]["dtype"])
    else:                                        # kept as a list: reshape reads it as ShapeTensor
        ctx.values[op["out"][0]["id"]] = list(items)


def slice_(ctx, op):
    a = op["attrs"]
    starts = ctx.const(op["in"][1], "slice starts")
    ends = ctx.const(op["in"][2], "slice ends")
    x = ctx.var(op["in"][0])
    ctx.block.append_op(type="slice", inputs={"Input": [x]}, outputs={"Out": [ctx.out(op, dtype=x.dtype)]},
                        attrs={"axes": a["axes"], "starts": [int(v) for v in starts], "ends": [int(v) for v in ends],
                               "infer_flags": a.get("infer_flags", [1] * len(a["axes"])),
                               "decrease_axis": a.get("decrease_axis", [])})


def scale(ctx, op):
    a = op["attrs"]
    value = ctx.const(op["in"][1], "scale factor")
    value = float(value[0] if isinstance(value, list) else value)
    ctx.block.append_op(type="scale", inputs={"X": [ctx.var(op["in"][0])]}, outputs={"Out": [ctx.out(op)]},
                        attrs={"scale": value, "bias": a["bias"], "bias_after_scale": a["bias_after_scale"]})


def dropout(ctx, op):
    """Inference-mode dropout: upscale_in_train is the identity, kept as the op the legacy export writes."""
    a = op["attrs"]
    p = ctx.const(op["in"][2], "dropout probability")
    ctx.block.append_op(type="dropout", inputs={"X": [ctx.var(op["in"][0])]},
                        outputs={"Out": [ctx.out(op)], "Mask": [ctx.new("uint8")]},
                        attrs={"dropout_prob": float(p[0] if isinstance(p, list) else p), "is_test": True,
                               "dropout_implementation": a["mode"], "seed": a.get("seed", 0),
                               "fix_seed": a.get("fix_seed", False)})


def concat(ctx, op):
    axis = ctx.const(op["in"][1], "concat axis")
    ctx.block.append_op(type="concat", inputs={"X": [ctx.var_of(v) for v in ctx.get(op["in"][0])]},
                        outputs={"Out": [ctx.out(op)]}, attrs={"axis": int(axis[0] if isinstance(axis, list) else axis)})


def _axes(name):
    return lambda ctx, op: {"axes": [int(v) for v in ctx.const(op["in"][1], f"{name} axes")]}


def full(ctx, op):
    a = op["attrs"]
    ctx.values[op["out"][0]["id"]] = Const(a["value"] if not a.get("shape") else
                                           ([a["value"]] if list(a["shape"]) == [1] else a["value"]), a["dtype"])


def full_int_array(ctx, op):
    ctx.values[op["out"][0]["id"]] = Const([int(v) for v in op["attrs"]["value"]], op["attrs"]["dtype"])


def combine(ctx, op):
    ctx.values[op["out"][0]["id"]] = [ctx.get(v) for v in op["in"]]


def shape(ctx, op):
    ctx.block.append_op(type="shape", inputs={"Input": [ctx.var(op["in"][0])]},
                        outputs={"Out": [ctx.out(op, dtype="int32")]})      # the legacy shape op writes int32


def _int32():
    from paddle.base import core
    return core.VarDesc.VarType.INT32


def matmul(ctx, op):
    ctx.block.append_op(type="matmul_v2", inputs={"X": [ctx.var(op["in"][0])], "Y": [ctx.var(op["in"][1])]},
                        outputs={"Out": [ctx.out(op)]},
                        attrs={"trans_x": op["attrs"]["transpose_x"], "trans_y": op["attrs"]["transpose_y"]})


def data(ctx, op):
    import paddle
    a = op["attrs"]
    var = paddle.static.data(a["name"], [int(d) for d in a["shape"]], a["dtype"])
    ctx.values[op["out"][0]["id"]] = var
    ctx.feeds.append(var)


def fetch(ctx, op):
    ctx.fetch.append(ctx.var(op["in"][0]))


HANDLERS: dict[str, Callable] = {
    "1.conv2d": conv("conv2d"), "1.depthwise_conv2d": conv("depthwise_conv2d"),
    "1.conv2d_transpose": conv("conv2d_transpose"), "1.batch_norm_": batch_norm, "1.batch_norm": batch_norm,
    "1.layer_norm": layer_norm, "1.pool2d": pool2d,
    "1.add": _elementwise("elementwise_add"), "1.subtract": _elementwise("elementwise_sub"),
    "1.multiply": _elementwise("elementwise_mul"), "1.divide": _elementwise("elementwise_div"),
    "1.relu": _unary("relu"), "1.sigmoid": _unary("sigmoid"), "1.swish": _unary("swish", beta=1.0),
    "1.hardswish": _unary("hard_swish", threshold=6.0, scale=6.0, offset=3.0), "1.assign": _unary("assign"),
    "1.hardsigmoid": lambda ctx, op: _unary("hard_sigmoid", slope=op["attrs"]["slope"],
                                            offset=op["attrs"]["offset"])(ctx, op),
    "1.softmax": lambda ctx, op: _unary("softmax", axis=op["attrs"]["axis"])(ctx, op),
    "1.nearest_interp": interp("nearest_interp_v2"), "1.bilinear_interp": interp("bilinear_interp_v2"),
    "1.reshape": reshape, "1.stack": stack, "1.slice": slice_, "1.scale": scale, "1.dropout": dropout,
    "1.concat": concat, "1.matmul": matmul, "1.shape64": shape, "1.shape": shape,
    "1.flatten": _with_xshape("flatten_contiguous_range", lambda ctx, op: {
        "start_axis": op["attrs"]["start_axis"], "stop_axis": op["attrs"]["stop_axis"]}),
    "1.transpose": _with_xshape("transpose2", lambda ctx, op: {"axis": list(op["attrs"]["perm"])}),
    "1.squeeze": _with_xshape("squeeze2", _axes("squeeze")),
    "1.unsqueeze": _with_xshape("unsqueeze2", _axes("unsqueeze")),
    "1.full": full, "1.full_int_array": full_int_array, "0.combine": combine, "1.fetch": fetch,
    "1.data": data,
}
