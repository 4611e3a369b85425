"""A small U-Net (conv, max pool, bilinear upsample, skip connection, circular padding)
converted with spmd.nn.convert trains for 3 SGD steps on a split field (spmd.demo's
training loops) with the losses and parameters of the single-device run: on a 4-rank
threads mesh and on gloo world 2.

float64, rtol = atol = 1e-10: the sharded run reorders the sums of the loss and of the
weight gradients (per-rank partial sums, then over ranks); three steps of SGD keep the
differences at a few ulps.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd
from spmd import P, demo

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
SPEC = P(None, None, "sp")


class TinyUNet(nn.Module):
    def __init__(self, c: int = 3):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.Tanh())
        self.pool = nn.MaxPool2d(2)
        self.enc2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1, padding_mode="circular"),
                                  nn.Tanh())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.dec = nn.Sequential(nn.Conv2d(3 * c, c, 3, padding=1), nn.Tanh(), nn.Conv2d(c, 1, 1))

    def forward(self, x):
        skip = self.enc1(x)
        y = self.up(self.enc2(self.pool(skip)))
        return self.dec(torch.cat([y, skip], dim=1))


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyUNet().double()


def train_single(model, x, t):
    return demo.train_single(model, (x, t), steps=3, lr=0.1, optimizer=torch.optim.SGD)


def train_sharded(mesh, model, x, t):
    # spmd.demo's loop: spmd.nn.convert, then psum(local sum of squares) / count in shard_map
    return demo.train_sharded(model, mesh, (x, t), steps=3, lr=0.1, optimizer=torch.optim.SGD)


def _check(got, want):
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), **TOL)
    assert got.params.keys() == want.params.keys()
    for k, p in want.params.items():
        torch.testing.assert_close(got.params[k], p, **TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("H", [16, 18])  # 18 rows: shards [5, 5, 4, 4], pooled [3, 2, 2, 2]
def test_unet_trains_like_one_device_on_4_threads(H):
    x, t = _data((2, 1, H, 10))
    model = _model()
    want = train_single(model, x, t)  # trains a copy
    got = train_sharded(spmd.Mesh((4,), ("sp",)), model, x, t)
    _check(got, want)
    assert got.losses[2] < got.losses[0]  # it learns


def _unet_rank(mesh, H):
    x, t = _data((2, 1, H, 10))
    return train_sharded(mesh, _model(), x, t)


@pytest.mark.gloo
def test_unet_trains_like_one_device_on_gloo_world_2(gloo2):
    H = 14
    got = gloo2.run(_unet_rank, (2,), ("sp",), args=(H,))
    x, t = _data((2, 1, H, 10))
    want = train_single(_model(), x, t)
    for g in got:
        _check(g, want)
