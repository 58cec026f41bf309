"""Building blocks shared by the zoo models: the op families of Paddle's OCR/classification nets."""
from __future__ import annotations

import paddle
from paddle import nn


class ConvBNAct(nn.Layer):
    """conv (no bias: BN shifts) + BN + activation; groups=cin gives a depthwise conv."""

    def __init__(self, cin: int, cout: int, kernel=3, stride=1, groups: int = 1, act: str | None = "hardswish"):
        super().__init__()
        pad = (kernel - 1) // 2 if isinstance(kernel, int) else tuple((k - 1) // 2 for k in kernel)
        self.conv = nn.Conv2D(cin, cout, kernel, stride=stride, padding=pad, groups=groups, bias_attr=False)
        self.bn = nn.BatchNorm2D(cout)
        self.act = {"hardswish": nn.Hardswish, "relu": nn.ReLU, "swish": nn.Swish,
                    None: nn.Identity}[act]()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class SEModule(nn.Layer):
    """Squeeze-and-excitation as in PP-LCNet: avg-pool, 1x1 conv, relu, 1x1 conv, hardsigmoid, scale."""

    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.conv1 = nn.Conv2D(channels, max(channels // reduction, 8), 1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2D(max(channels // reduction, 8), channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.conv2(self.relu(self.conv1(self.pool(x)))))


class DepthwiseSeparable(nn.Layer):
    """PP-LCNet block: depthwise conv (+SE) then pointwise conv, hardswish after each."""

    def __init__(self, cin: int, cout: int, stride=1, kernel: int = 3, use_se: bool = False):
        super().__init__()
        self.dw = ConvBNAct(cin, cin, kernel, stride, groups=cin)
        self.se = SEModule(cin) if use_se else nn.Identity()
        self.pw = ConvBNAct(cin, cout, 1)

    def forward(self, x):
        return self.pw(self.se(self.dw(x)))


class Attention(nn.Layer):
    """Multi-head self-attention written with matmul + softmax (what jit.save exports for SVTR/ViT)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):                                     # x: [N, L, D]
        qkv = paddle.reshape(self.qkv(x), [0, -1, 3, self.heads, self.head_dim])
        qkv = paddle.transpose(qkv, [2, 0, 3, 1, 4])          # [3, N, heads, L, hd]
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = nn.functional.softmax(paddle.matmul(q, k, transpose_y=True), axis=-1)
        out = paddle.transpose(paddle.matmul(attn, v), [0, 2, 1, 3])   # [N, L, heads, hd]
        return self.proj(paddle.reshape(out, [0, -1, self.heads * self.head_dim]))


class TransformerBlock(nn.Layer):
    """Pre-norm block: LayerNorm → attention → residual; LayerNorm → MLP → residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 2.0, act: str = "swish"):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, epsilon=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, epsilon=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.Swish() if act == "swish" else nn.GELU(),
                                 nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
