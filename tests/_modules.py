"""Small modules shared by the tests of ``spmd.nn.convert``."""
from __future__ import annotations

from torch import nn


class Fn(nn.Module):
    """A module whose forward is ``f(self, x)``, with sub-layers in ``self.layers``."""

    def __init__(self, f, *layers):
        super().__init__()
        self.f = f
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return self.f(self, x)
