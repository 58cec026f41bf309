"""PP-LCNet-style classifier: depthwise-separable convs, hardswish, SE, 1x1 'last conv', flatten, fc.

Scaled down (channels, depth) so a conformance run trains in seconds on 2 CPU cores; the op
families are those of PaddleClas PP-LCNet (conv2d, depthwise_conv2d, batch_norm, hard_swish,
hard_sigmoid, elementwise_mul, pool2d, flatten_contiguous_range, matmul/fc).
"""
from __future__ import annotations

import paddle
from paddle import nn

from pipeline.models.layers import ConvBNAct, DepthwiseSeparable

# (cin, cout, stride, kernel, SE) per block, PP-LCNet's layout at a fraction of its width
_BLOCKS = ((16, 32, 1, 3, False), (32, 32, 2, 3, False), (32, 64, 2, 3, False),
           (64, 64, 1, 5, False), (64, 128, 2, 5, True), (128, 128, 1, 5, True))


class LCNet(nn.Layer):
    def __init__(self, num_classes: int, in_channels: int = 3, scale: float = 1.0,
                 class_expand: int = 256, dropout: float = 0.1):
        super().__init__()
        s = (lambda c: max(8, int(c * scale)))
        self.stem = ConvBNAct(in_channels, s(16), 3, stride=2)
        self.blocks = nn.Sequential(*[DepthwiseSeparable(s(a), s(b), st, k, se) for a, b, st, k, se in _BLOCKS])
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.last_conv = nn.Conv2D(s(128), class_expand, 1, bias_attr=False)
        self.act = nn.Hardswish()
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(class_expand, num_classes)

    def forward(self, x):
        x = self.act(self.last_conv(self.pool(self.blocks(self.stem(x)))))
        return self.fc(paddle.flatten(self.drop(x), 1))
