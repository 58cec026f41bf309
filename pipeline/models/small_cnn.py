"""The default classifier: three conv-bn-relu-pool blocks and two linear layers (~0.1 M params)."""
from __future__ import annotations

import paddle
from paddle import nn


class SmallCNN(nn.Layer):
    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 32, height: int = 32,
                 channels: tuple[int, int, int] = (16, 32, 64), hidden: int = 128, dropout: float = 0.1):
        super().__init__()
        blocks, c_in = [], in_channels
        for c in channels:
            blocks += [nn.Conv2D(c_in, c, 3, padding=1, bias_attr=False), nn.BatchNorm2D(c), nn.ReLU(),
                       nn.MaxPool2D(2)]
            c_in = c
        self.features = nn.Sequential(*blocks)
        feat = c_in * (height // 8) * (width // 8)
        self.head = nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x):
        # paddle.flatten on purpose: it is what real models use, and Lite needs it repaired (see lite stage)
        return self.head(paddle.flatten(self.features(x), 1))
