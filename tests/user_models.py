"""A user's own model, brought by import path (model.name=tests.user_models:HybridNet): not a built-in.

It mixes the op families real OCR/classification models use and Paddle Lite needs repaired after
jit.save: swish, hardswish, LayerNorm, multi-head self-attention (matmul + softmax), flatten.
Written with plain paddle.nn only, as a user would (nothing imported from pipeline.models).
"""
import paddle
from paddle import nn


class HybridNet(nn.Layer):
    def __init__(self, num_classes: int, in_channels: int = 1, dim: int = 32, heads: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2D(in_channels, 16, 3, padding=1), nn.BatchNorm2D(16), nn.Hardswish(),
                                  nn.Conv2D(16, dim, 3, stride=2, padding=1), nn.BatchNorm2D(dim), nn.Hardswish(),
                                  nn.Conv2D(dim, dim, 3, stride=2, padding=1, groups=dim), nn.BatchNorm2D(dim),
                                  nn.Swish())
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiHeadAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Swish(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = paddle.transpose(paddle.flatten(self.stem(x), 2), [0, 2, 1])     # [N, L, D]
        y = self.norm1(x)
        x = x + self.attn(y, y, y)
        x = x + self.mlp(self.norm2(x))
        return self.head(paddle.mean(x, axis=1))
