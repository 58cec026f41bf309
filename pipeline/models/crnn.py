"""A small CRNN-style text-line recogniser for CTC, built to survive every engine.

    image [N, C, H, W] → conv backbone (height → 1, width → W/4) → 1×k conv sequence head
    → logits [N, T = W/4, num_classes]   (class 0 = CTC blank)

Why no BiLSTM: Paddle Lite's LSTM/GRU coverage is poor (x86 in particular), and a recurrent
head is slow to train on two CPU cores. A stack of 1×k convolutions over the time axis gives
each step ±(k//2)·dilation steps of context; invoice strings have little long-range
structure, so that is enough. Reshape is done with `reshape` and `transpose` only: no
`flatten` (Lite's flatten op segfaults on programs saved by jit.save, see STACK.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import paddle
from paddle import nn

from pipeline.core.errors import ConfigError


def _conv_bn_relu(cin: int, cout: int, kernel: tuple[int, int] | int = 3,
                  padding: tuple[int, int] | int = 1, dilation: tuple[int, int] | int = 1,
                  stride: int = 1) -> nn.Sequential:
    # bias_attr=False: BN's shift makes a conv bias redundant (and Lite fuses conv+bn anyway)
    return nn.Sequential(nn.Conv2D(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation,
                                   bias_attr=False),
                         nn.BatchNorm2D(cout), nn.ReLU())


class _TimeBlock(nn.Layer):
    """Residual 1×k conv over the time axis; the residual keeps a deeper head easy to train."""

    def __init__(self, channels: int, kernel: int, dilation: int, dropout: float):
        super().__init__()
        pad = (kernel // 2) * dilation
        self.conv = _conv_bn_relu(channels, channels, (1, kernel), (0, pad), (1, dilation))
        self.drop = nn.Dropout(dropout)   # identity at inference: exports as a no-op scale

    def forward(self, x):
        return x + self.drop(self.conv(x))


class CRNN(nn.Layer):
    """Conv backbone + conv sequence head; output logits [N, W/4, num_classes].

    height must be a multiple of 8 (three halvings of the height, then one conv collapses
    what is left); width must be a multiple of 4 (two halvings of the width).
    """

    # Defaults are the measured setting on 2 CPU cores (~24 M MACs per 32x256 line): ~95 % exact
    # lines on synthetic invoice text after 5 epochs of 16k lines. Training time grows about
    # linearly with MACs (Paddle's CPU conv is im2col + GEMM), so widen only if you must.
    def __init__(self, num_classes: int, in_channels: int = 1, height: int = 32, hidden: int = 64,
                 channels: Sequence[int] = (16, 32, 64), head_layers: int = 2, head_kernel: int = 3,
                 dropout: float = 0.1):
        super().__init__()
        if num_classes < 2:
            raise ConfigError(f"CRNN needs num_classes >= 2 (blank + 1 character), got {num_classes}")
        if height < 8 or height % 8:
            raise ConfigError(f"CRNN needs an input height that is a multiple of 8, got {height}",
                              hint="use data.height 32 (or 16, 24, 48 ...)")
        if len(channels) != 3 or min(channels) < 1:
            raise ConfigError(f"CRNN channels must be 3 positive widths, got {list(channels)}")
        if head_kernel < 1 or head_kernel % 2 == 0:
            raise ConfigError(f"CRNN head_kernel must be odd, got {head_kernel}")
        c1, c2, c3 = (int(c) for c in channels)
        self.num_classes = num_classes
        # Strided convs instead of conv + max-pool at full resolution: on two CPU cores the
        # full-resolution layers dominated training time (4x the MACs for little accuracy).
        self.backbone = nn.Sequential(
            _conv_bn_relu(in_channels, c1, 3, 1, stride=2),               # H/2, W/2
            _conv_bn_relu(c1, c2, 3, 1, stride=2),                        # H/4, W/4
            _conv_bn_relu(c2, c3),
            nn.MaxPool2D((2, 1), (2, 1)),                                 # H/8, W/4
            _conv_bn_relu(c3, c3),
            # a learned collapse of the remaining rows (rather than average pooling) lets the
            # network weigh ascender/descender rows; a full-height kernel, no padding → height 1
            _conv_bn_relu(c3, hidden, (height // 8, 1), 0),
        )
        # dilation 1, 2, 4, ... widens the context per layer at the same cost
        self.head = nn.Sequential(*[_TimeBlock(hidden, head_kernel, 2 ** i, dropout)
                                    for i in range(head_layers)])
        self.classifier = nn.Conv2D(hidden, num_classes, 1)

    def forward(self, x):
        x = self.classifier(self.head(self.backbone(x)))      # [N, C, 1, T]
        # reshape (not flatten/squeeze) keeps the exported graph Lite-friendly; 0 copies N
        x = paddle.reshape(x, [0, self.num_classes, -1])      # [N, C, T]
        return paddle.transpose(x, [0, 2, 1])                 # [N, T, C], batch-first
