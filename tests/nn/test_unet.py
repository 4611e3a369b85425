"""A small U-Net (conv, max pool, bilinear upsample, skip connection, circular padding;
with GroupNorm or BatchNorm too) converted with spmd.nn.convert trains for 3 SGD or Adam
steps on a split field (spmd.demo's training loops) with the losses and parameters of
the single-device run: on a 4-rank threads mesh and on gloo world 2.

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
# Adam divides by sqrt(v) + 1e-8: the bias of a conv in front of a norm has a gradient that
# is zero up to rounding (~1e-17, its value set by the order of additions), which Adam
# turns into steps of lr * g / 1e-8 ~ 1e-10. Parameters to 1e-8 absolute; losses to 1e-10.
ADAM_TOL = dict(rtol=1e-10, atol=1e-8)
SPEC = P(None, None, "sp")


def _norm(kind: str | None, c: int, groups: int) -> nn.Module:
    return {None: nn.Identity(), "group": nn.GroupNorm(groups, c),
            "batch": nn.BatchNorm2d(c)}[kind]


class TinyUNet(nn.Module):
    def __init__(self, c: int = 3, norm: str | None = None):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), _norm(norm, c, 1), nn.Tanh())
        self.pool = nn.MaxPool2d(2)
        self.enc2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1, padding_mode="circular"),
                                  _norm(norm, 2 * c, 2), nn.Tanh())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.dec = nn.Sequential(nn.Conv2d(3 * c, c, 3, padding=1), nn.Tanh(), nn.Conv2d(c, 1, 1))

    def forward(self, x):
        skip = self.enc1(x)
        y = self.up(self.enc2(self.pool(skip)))
        return self.dec(torch.cat([y, skip], dim=1))


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)


def _model(seed=0, norm=None):
    torch.manual_seed(seed)
    return TinyUNet(norm=norm).double()


def train_single(model, x, t, optimizer=torch.optim.SGD):
    return demo.train_single(model, (x, t), steps=3, lr=0.1, optimizer=optimizer)


def train_sharded(mesh, model, x, t, optimizer=torch.optim.SGD):
    # spmd.demo's loop: spmd.nn.convert, then psum(local sum of squares) / count in shard_map
    return demo.train_sharded(model, mesh, (x, t), steps=3, lr=0.1, optimizer=optimizer)


def _check(got, want, tol=TOL):
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), **TOL)
    assert got.params.keys() == want.params.keys()
    for k, p in want.params.items():
        torch.testing.assert_close(got.params[k], p, **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("H", [16, 18])  # 18 rows: shards [5, 5, 4, 4], pooled [3, 2, 2, 2]
def test_unet_trains_like_one_device_on_4_threads(H):
    x, t = _data((2, 1, H, 10))
    model = _model()
    want = train_single(model, x, t)  # trains a copy
    got = train_sharded(spmd.Mesh((4,), ("sp",)), model, x, t)
    _check(got, want)
    assert got.losses[2] < got.losses[0]  # it learns


def test_unet_with_group_norm_trains_3_adam_steps_like_one_device_on_4_threads():
    """GroupNorm(1) and GroupNorm(2) after the convolutions: convert swaps in
    spmd.ops.group_norm (statistics over the whole split sample); 18 rows over 4 ranks,
    9 pooled rows: uneven at both levels."""
    x, t = _data((2, 1, 18, 10), seed=1)
    model = _model(norm="group")
    want = train_single(model, x, t, torch.optim.Adam)
    got = train_sharded(spmd.Mesh((4,), ("sp",)), model, x, t, torch.optim.Adam)
    _check(got, want, ADAM_TOL)


def _unet_rank(mesh, H, norm=None, optimizer=torch.optim.SGD):
    x, t = _data((2, 1, H, 10))
    return train_sharded(mesh, _model(norm=norm), x, t, optimizer)


@pytest.mark.gloo
def test_unet_trains_like_one_device_on_gloo_world_2(gloo2):
    H = 14
    got = gloo2.run(_unet_rank, (2,), ("sp",), args=(H,))
    x, t = _data((2, 1, H, 10))
    want = train_single(_model(), x, t)
    for g in got:
        _check(g, want)


@pytest.mark.gloo
def test_unet_with_batch_norm_trains_3_adam_steps_like_one_device_on_gloo_world_2(gloo2):
    """BatchNorm2d in training: statistics over the global batch and rows (one
    all_gather of (count, mean, M2) per layer), each process updating its own running
    statistics: losses and parameters as one device's."""
    H = 14
    got = gloo2.run(_unet_rank, (2,), ("sp",), args=(H, "batch", torch.optim.Adam))
    x, t = _data((2, 1, H, 10))
    want = train_single(_model(norm="batch"), x, t, torch.optim.Adam)
    for g in got:
        _check(g, want, ADAM_TOL)
