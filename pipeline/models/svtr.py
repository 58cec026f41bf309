"""SVTR-LCNet-style text recogniser (PP-OCRv3 family): LCNet-like backbone, SVTR neck, CTC head.

    image [N, C, H, W] → backbone (height → H/16, width → W/8) → avg-pool height to 1
    → neck: conv 3x3 + conv 1x1 (swish) → transformer blocks over the W/8 time steps
      (LayerNorm, multi-head self-attention with matmul/softmax, MLP with swish)
    → conv 1x1 back, concat with the shortcut, conv 3x3 + conv 1x1 (swish) → CTC head (linear)
    → logits [N, T = W/8, num_classes]   (class 0 = CTC blank)

The width reduction is 8, not the CRNN's 4: the recognition task learns T from the model.
"""
from __future__ import annotations

import paddle
from paddle import nn

from pipeline.models.layers import ConvBNAct, DepthwiseSeparable, TransformerBlock


class SVTRNeck(nn.Layer):
    def __init__(self, cin: int, dim: int, depth: int, heads: int):
        super().__init__()
        self.conv1 = ConvBNAct(cin, cin // 2, 3, act="swish")
        self.conv2 = ConvBNAct(cin // 2, dim, 1, act="swish")
        self.blocks = nn.LayerList([TransformerBlock(dim, heads, act="swish") for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, epsilon=1e-6)
        self.conv3 = ConvBNAct(dim, cin, 1, act="swish")
        self.conv4 = ConvBNAct(2 * cin, cin // 2, 3, act="swish")
        self.conv1x1 = ConvBNAct(cin // 2, dim, 1, act="swish")

    def forward(self, x):                                     # x: [N, C, 1, T]
        shortcut = x
        z = self.conv2(self.conv1(x))                         # [N, D, 1, T]
        z = paddle.transpose(paddle.squeeze(z, axis=2), [0, 2, 1])   # [N, T, D]
        for blk in self.blocks:
            z = blk(z)
        z = paddle.unsqueeze(paddle.transpose(self.norm(z), [0, 2, 1]), axis=2)   # [N, D, 1, T]
        z = self.conv4(paddle.concat([shortcut, self.conv3(z)], axis=1))
        return self.conv1x1(z)


class SVTRRecognizer(nn.Layer):
    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 32, dim: int = 64,
                 depth: int = 2, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        w = width
        # strides (2,2),(2,2),(2,1),(2,2),(1,1): height /16, width /8 (PP-OCRv3 keeps more width
        # than height: characters are narrow)
        self.backbone = nn.Sequential(
            ConvBNAct(in_channels, w // 2, 3, stride=2),
            DepthwiseSeparable(w // 2, w, stride=2),
            DepthwiseSeparable(w, w, stride=(2, 1)),
            DepthwiseSeparable(w, 2 * w, stride=2, kernel=5, use_se=True),
            DepthwiseSeparable(2 * w, 2 * w, stride=(2, 1), kernel=5, use_se=True),
        )
        self.pool = nn.AdaptiveAvgPool2D((1, None))
        self.neck = SVTRNeck(2 * w, dim, depth, heads)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.neck(self.pool(self.backbone(x)))            # [N, D, 1, T]
        x = paddle.transpose(paddle.squeeze(x, axis=2), [0, 2, 1])   # [N, T, D]
        return self.head(self.drop(x))                        # [N, T, num_classes]
