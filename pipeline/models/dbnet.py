"""A small DB (differentiable binarization) text detector, built to survive every engine.

    page [N, C, H, W] → conv backbone (1/4 … 1/32) → FPN neck (top-down sum, 1/4 concat)
    → DB head: probability map P and threshold map T at full resolution (×2 transposed convs)
    training: [P, T, B = sigmoid(k·(P − T))] as [N, 3, H, W]; inference (eval): P as [N, 1, H, W]

Only conv, batch norm, relu, nearest upsampling, transposed conv and sigmoid: ops Paddle
Inference, oneDNN INT8 and Paddle Lite (x86/arm) all have. H and W must be multiples of 32.
"""
from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from pipeline.core.errors import ConfigError


def _cbr(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2D(cin, cout, kernel, stride=stride, padding=kernel // 2, bias_attr=False),
                         nn.BatchNorm2D(cout), nn.ReLU())


class _Stage(nn.Layer):
    """Downsample ×2, then a residual 3×3 block."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.down = _cbr(cin, cout, stride=2)
        self.conv = nn.Sequential(_cbr(cout, cout), nn.Conv2D(cout, cout, 3, padding=1, bias_attr=False),
                                  nn.BatchNorm2D(cout))

    def forward(self, x):
        x = self.down(x)
        return F.relu(x + self.conv(x))


class _Head(nn.Layer):
    """1/4-resolution features → full-resolution probability and threshold logits.

    The two maps share the trunk and differ in the last ×2 layer: the threshold map only
    guides training, and a second full trunk would cost as much as the backbone on a CPU.
    """

    def __init__(self, cin: int, mid: int):
        super().__init__()
        self.conv = _cbr(cin, mid)
        self.up1 = nn.Sequential(nn.Conv2DTranspose(mid, mid, 2, stride=2, bias_attr=False),
                                 nn.BatchNorm2D(mid), nn.ReLU())
        self.prob = nn.Conv2DTranspose(mid, 1, 2, stride=2)
        self.thresh = nn.Conv2DTranspose(mid, 1, 2, stride=2)

    def forward(self, x, with_thresh: bool):
        h = self.up1(self.conv(x))
        return self.prob(h), (self.thresh(h) if with_thresh else None)


class DBNet(nn.Layer):
    def __init__(self, in_channels: int = 1, channels: tuple[int, ...] = (8, 16, 32, 64, 96), neck: int = 32,
                 head: int = 16, k: float = 50.0):
        super().__init__()
        if len(channels) != 5:
            raise ConfigError(f"dbnet channels needs 5 widths (stem, 1/4, 1/8, 1/16, 1/32), got {list(channels)}")
        self.k = k
        self.stem = _cbr(in_channels, channels[0], stride=2)                       # 1/2
        self.stages = nn.LayerList([_Stage(channels[i], channels[i + 1]) for i in range(4)])   # 1/4 … 1/32
        self.lateral = nn.LayerList([nn.Conv2D(c, neck, 1, bias_attr=False) for c in channels[1:]])
        self.smooth = nn.LayerList([_cbr(neck, neck // 4) for _ in channels[1:]])
        self.head = _Head(neck, head)

    def _neck(self, feats):
        lat = [conv(f) for conv, f in zip(self.lateral, feats)]
        for i in range(len(lat) - 2, -1, -1):          # top-down: coarse context into fine maps
            lat[i] = lat[i] + F.interpolate(lat[i + 1], scale_factor=2, mode="nearest")
        outs = [self.smooth[i](lat[i]) for i in range(len(lat))]
        outs = [outs[0]] + [F.interpolate(o, scale_factor=2 ** i, mode="nearest") for i, o in enumerate(outs[1:], 1)]
        return paddle.concat(outs, axis=1)

    def forward(self, x):
        feats, h = [], self.stem(x)
        for stage in self.stages:
            h = stage(h)
            feats.append(h)
        prob, thresh = self.head(self._neck(feats), with_thresh=self.training)
        prob = F.sigmoid(prob)
        if not self.training:
            return prob
        thresh = F.sigmoid(thresh)
        binary = F.sigmoid(self.k * (prob - thresh))
        return paddle.concat([prob, thresh, binary], axis=1)
