"""A small ViT-style classifier: patch-embedding conv, class token, learned positions, pre-norm
transformer blocks (LayerNorm, matmul/softmax attention, GELU MLP), LayerNorm, linear head."""
from __future__ import annotations

import paddle
from paddle import nn

from pipeline.core.errors import ConfigError
from pipeline.models.layers import TransformerBlock


class ViT(nn.Layer):
    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, patch: int = 4,
                 dim: int = 64, depth: int = 3, heads: int = 4, mlp_ratio: float = 2.0):
        super().__init__()
        if image_size % patch:
            raise ConfigError(f"ViT image_size {image_size} is not a multiple of patch {patch}",
                              hint="set model.args.image_size to data.height (square inputs)")
        n = (image_size // patch) ** 2
        self.embed = nn.Conv2D(in_channels, dim, patch, stride=patch)
        self.cls = self.create_parameter([1, 1, dim], default_initializer=nn.initializer.TruncatedNormal(std=0.02))
        self.pos = self.create_parameter([1, n + 1, dim], default_initializer=nn.initializer.TruncatedNormal(std=0.02))
        self.blocks = nn.Sequential(*[TransformerBlock(dim, heads, mlp_ratio, act="gelu") for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, epsilon=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = paddle.transpose(paddle.flatten(self.embed(x), 2), [0, 2, 1])     # [N, L, D]
        cls = paddle.expand(self.cls, [paddle.shape(x)[0], 1, self.cls.shape[2]])
        x = self.blocks(paddle.concat([cls, x], axis=1) + self.pos)
        return self.head(self.norm(x)[:, 0])
