"""A tiny colour CNN and numpy engines for tests/test_gate_defects.py: seconds, no conversion, no server.

The network (conv 3->8, ReLU, max-pool, conv 8->16, ReLU, global average, fc -> 8 classes) is trained with Paddle on
rendered squares whose class is their colour (so a swapped channel order matters, as it does for PaddleOCR's
BGR-trained models). The engines run it in numpy at fp32, with fp16 or bf16 rounding of weights and of every
activation (as Paddle's mixed-precision pass and its emulation, pipeline/engines/amp_emulation.py, round them), or
with int8 weights (symmetric, per output channel) and int8 activations (symmetric, per tensor, abs-max calibrated on
training images: PaddleSlim's abs_max). Defects are planted in the weights, the input or the output.
"""
from __future__ import annotations

import numpy as np

CLASSES = 8
SIZE = 16
# R != B in every colour: BGR <-> RGB turns each class's colour into its partner's (2k <-> 2k+1)
PALETTE = np.array([(1.0, .2, 0.0), (0.0, .2, 1.0), (1.0, .8, .3), (.3, .8, 1.0),
                    (.8, 0.0, .4), (.4, 0.0, .8), (.6, .5, 0.0), (0.0, .5, .6)], dtype=np.float32)


def render(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, 3, 16, 16] float32 in R, G, B order (noise + one coloured square of random size/place), labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 0.15, (n, 3, SIZE, SIZE)).astype(np.float32)
    y = rng.integers(0, CLASSES, n)
    for i in range(n):
        s = int(rng.integers(4, 9))
        r, c = rng.integers(0, SIZE - s, 2)
        x[i, :, r:r + s, c:c + s] += PALETTE[y[i]][:, None, None] * rng.uniform(0.7, 1.1)
    return x, y.astype(np.int64)


def train(seed: int = 0, steps: int = 150) -> dict[str, np.ndarray]:
    """Weights of the trained net as numpy arrays (conv: [out, in, 3, 3]; fc: [in, out])."""
    import paddle

    paddle.seed(seed)
    np.random.seed(seed)
    net = paddle.nn.Sequential(
        paddle.nn.Conv2D(3, 8, 3, padding=1), paddle.nn.ReLU(), paddle.nn.MaxPool2D(2),
        paddle.nn.Conv2D(8, 16, 3, padding=1), paddle.nn.ReLU(), paddle.nn.AdaptiveAvgPool2D(1),
        paddle.nn.Flatten(), paddle.nn.Linear(16, CLASSES))
    opt = paddle.optimizer.Adam(0.01, parameters=net.parameters())
    x, y = render(2048, seed + 100)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x), 64)
        loss = paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x[idx])), paddle.to_tensor(y[idx]))
        loss.backward()
        opt.step()
        opt.clear_grad()
    p = [t.numpy() for t in net.parameters()]
    return {"w1": p[0], "b1": p[1], "w2": p[2], "b2": p[3], "wf": p[4], "bf": p[5]}


def _round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def _fake_int8(a: np.ndarray, scale) -> np.ndarray:
    return (np.clip(np.round(a / scale), -127, 127) * scale).astype(np.float32)


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))       # N, C, H, W, 3, 3
    return np.einsum("nchwij,ocij->nohw", win, w, optimize=True) + b[None, :, None, None]


def _pool2(x: np.ndarray) -> np.ndarray:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


class Engine:
    """The net in numpy at a precision: fp32 | fp16 | bf16 | int8 (calibrate() first) | fp64 (the reference)."""

    def __init__(self, weights: dict, precision: str = "fp32", softmax: bool = False):
        self.w, self.precision, self.softmax = dict(weights), precision, softmax
        self.act_scale: dict[str, float] = {}
        dtype = np.float64 if precision == "fp64" else np.float32
        self.w = {k: v.astype(dtype) for k, v in self.w.items()}
        if precision in ("fp16", "bf16"):
            self.w = {k: self._round(v) for k, v in self.w.items()}

    def _round(self, a: np.ndarray) -> np.ndarray:
        if self.precision == "fp16":
            return a.astype(np.float16).astype(np.float32)
        if self.precision == "bf16":
            return _round_bf16(a)
        return a

    def _quant_w(self, name: str) -> np.ndarray:
        w = self.w[name]
        axes = tuple(range(1, w.ndim)) if name != "wf" else (0,)
        scale = np.abs(w).max(axis=axes, keepdims=True) / 127.0
        return _fake_int8(w, np.maximum(scale, 1e-12))

    def _layer_input(self, name: str, a: np.ndarray) -> np.ndarray:
        if self.precision != "int8":
            return self._round(a)
        if name not in self.act_scale:          # calibrating
            return a
        return _fake_int8(a, self.act_scale[name])

    def calibrate(self, x: np.ndarray) -> "Engine":
        """abs-max of each quantized layer's input over calibration images (PaddleSlim abs_max)."""
        seen: dict[str, float] = {}
        self._trace = seen
        self.run(x)
        self.act_scale = {k: max(v, 1e-12) / 127.0 for k, v in seen.items()}
        del self._trace
        return self

    def run(self, x: np.ndarray) -> np.ndarray:
        q = self.precision == "int8" and self.act_scale
        w = {k: self._quant_w(k) if q and k.startswith("w") else v for k, v in self.w.items()}
        dt = np.float64 if self.precision == "fp64" else np.float32
        h = x.astype(dt)
        for name, conv_w, conv_b, pool in (("c1", "w1", "b1", True), ("c2", "w2", "b2", False)):
            self._observe(name, h)
            h = self._round(np.maximum(_conv(self._layer_input(name, h), w[conv_w], w[conv_b]), 0))
            h = _pool2(h) if pool else h
        h = self._round(h.mean(axis=(2, 3)))
        self._observe("fc", h)
        out = self._round(self._layer_input("fc", h) @ w["wf"] + w["bf"])
        if self.softmax:
            e = np.exp(out - out.max(axis=1, keepdims=True))
            out = self._round(e / e.sum(axis=1, keepdims=True))
        return out.astype(np.float32)

    def _observe(self, name: str, a: np.ndarray) -> None:
        trace = getattr(self, "_trace", None)
        if trace is not None:
            trace[name] = max(trace.get(name, 0.0), float(np.abs(a).max()))


# ---- defects: what a broken conversion, runtime or bundle really does -------------------------------------------

def layer_scaled(weights: dict, factor: float = 2.0) -> dict:
    """One layer's weights dequantized with the wrong scale: conv2 x2 (int8 vs uint8 range, 255/127 ~ 2)."""
    return {**weights, "w2": weights["w2"] * factor}


def channel_scale_wrong(weights: dict) -> dict:
    """conv2's per-output-channel scales applied one channel off (an indexing bug in a per-channel dequantizer):
    channel c gets scale[c+1] / scale[c] times its weights."""
    w = weights["w2"]
    s = np.abs(w).max(axis=(1, 2, 3))
    return {**weights, "w2": w * (np.roll(s, -1) / s)[:, None, None, None]}


def bgr(x: np.ndarray) -> np.ndarray:
    """The pre-processing step that reverses the channel order (BGR <-> RGB)."""
    return np.ascontiguousarray(x[:, ::-1])


def per_tensor_scale(weights: dict) -> dict:
    """conv2 quantized per output channel but dequantized with one per-tensor scale (the largest channel's):
    channel c gets max(scale) / scale[c] times its weights."""
    w = weights["w2"]
    s = np.abs(w).max(axis=(1, 2, 3))
    return {**weights, "w2": w * (s.max() / s)[:, None, None, None]}
