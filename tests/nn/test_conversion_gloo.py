"""spmd.nn.convert on real gloo processes (world 2): a model written with functional calls
trains like one device, and a refused call raises the same error on both processes before
any collective (the plan runs on meta tensors, in each process alike). Per-rank functions
are module-level so that spawned workers can import them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_conversion import Fn, Functional

import spmd
from spmd import P

pytestmark = pytest.mark.gloo

H = P(None, None, "sp")


class WithLoss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, t):
        return F.mse_loss(self.net(x), t)


def _train(mesh, model, x, t, steps, buffers=False):
    """Per-rank (torch processes): shard_map's per-rank view with global arguments."""
    model = spmd.nn.convert(WithLoss(model), mesh, (H, H))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = spmd.shard_map(model, mesh, (H, H), P())(x, t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.detach() for p in model.parameters()]
    return (losses, params, [b.detach() for b in model.buffers()]) if buffers else \
        (losses, params)


def _one_device(model, x, t, steps):
    """The reference: the same SGD steps on one device; the model and its losses."""
    one = WithLoss(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = one(x, t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return one, losses


def _refused(mesh, x):
    conv = spmd.nn.convert(Fn(lambda m, x: torch.roll(x, 1, dims=2)), mesh, H)
    with spmd.comm_stats() as stats:
        try:
            spmd.shard_map(conv, mesh, H, H)(x)
        except spmd.SpecError as e:
            return str(e), stats.calls()
    return None, stats.calls()


def test_a_functional_model_trains_like_one_device_world2(gloo2):
    torch.manual_seed(0)
    plain = Functional()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 10, 6, generator=g, dtype=torch.float64)
    t = torch.randn(2, 1, 10, 6, generator=g, dtype=torch.float64)
    got = gloo2.run(_train, (2,), ("sp",), args=(plain, x, t, 3))
    one, want = _one_device(plain, x, t, 3)
    for losses, params in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-10, atol=1e-10)
        for p, q in zip(params, one.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)


def test_a_refusal_is_the_same_on_both_processes_before_any_collective(gloo2):
    x = torch.randn(1, 2, 7, 4, dtype=torch.float64)
    (m0, n0), (m1, n1) = gloo2.run(_refused, (2,), ("sp",), args=(x,))
    assert m0 == m1 and "torch.roll shifts values along dim 2" in m0
    assert n0 == n1 == 0


def _norm_net():
    """A CNN with the norms a scientific model uses, and a softmax over a split dim."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=0.2),
        torch.nn.GELU(), torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
        torch.nn.Softmax(dim=2), torch.nn.Conv2d(4, 1, 1)).double()


def test_norms_and_softmax_over_split_dims_train_like_one_device_world2(gloo2):
    """BatchNorm (running statistics, each process its own copy), GroupNorm and
    a softmax along the split H, converted, 3 SGD steps on 2 processes: losses,
    parameters and running statistics equal to one device."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 10, 6, generator=g, dtype=torch.float64)
    t = torch.randn(2, 1, 10, 6, generator=g, dtype=torch.float64)
    plain = _norm_net()
    got = gloo2.run(_train, (2,), ("sp",), args=(plain, x, t, 3, True))
    one, want = _one_device(plain, x, t, 3)
    for losses, params, buffers in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-10, atol=1e-10)
        for p, q in zip(params, one.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)
        for b, c in zip(buffers, one.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12)
