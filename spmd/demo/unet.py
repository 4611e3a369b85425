"""``UNet``: a small plain-torch U-Net (conv, max-pool, nearest upsample, skips
concatenated on the channels), the model the planner's notebook, tests and benchmark
split."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["UNet"]


class UNet(nn.Module):
    """``levels`` levels of ``w`` channels on a ``c``-channel input; one output channel.

    Example:
        >>> net = UNet(c=2, w=4, levels=2)
        >>> net(torch.randn(1, 2, 16, 12)).shape
        torch.Size([1, 1, 16, 12])
    """

    def __init__(self, c: int = 2, w: int = 8, levels: int = 2):
        super().__init__()
        self.inc = nn.Conv2d(c, w, 3, padding=1)
        self.down = nn.ModuleList(nn.Conv2d(w, w, 3, padding=1) for _ in range(levels))
        self.up = nn.ModuleList(nn.Conv2d(2 * w, w, 3, padding=1) for _ in range(levels))
        self.out = nn.Conv2d(w, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inc(x))
        skips = []
        for conv in self.down:
            skips.append(h)
            h = torch.relu(conv(F.max_pool2d(h, 2)))
        for conv, s in zip(self.up, reversed(skips)):
            h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = torch.relu(conv(torch.cat([h, s], 1)))
        return self.out(h)
