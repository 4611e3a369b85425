"""Layouts flow through a converted forward: an op that keeps a dim's length keeps its
shard sizes (a conv with a reflect, replicate or circular padding mode too), a pool or
an interpolation gives the layout its spmd.ops twin defines, and where two operands of a
call are split with other sizes (a U-Net's skip concatenation, a residual add) the
cheaper one is redistributed to the other's layout, moving only the rows that change
owner.

float64 throughout. Values and gradients to 1e-10 (the sharded run reorders sums); Adam
parameters to 1e-8 absolute: a conv bias in front of a norm has a gradient that is zero
up to rounding, which Adam's division by sqrt(v) + 1e-8 turns into steps ~1e-10.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _ops import adam_steps
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

import spmd
from spmd import Layout, P

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
ADAM_TOL = dict(rtol=1e-10, atol=1e-8)
H = P(None, None, "sp")


def _sharded(x: torch.Tensor, mesh: spmd.Mesh, sizes) -> spmd.Sharded:
    return spmd.Sharded.from_global(x, mesh, Layout(x.shape, H, mesh, {2: list(sizes)}))


class Residual(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1, padding_mode=mode)

    def forward(self, x):
        return x + self.conv(x)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_a_padding_mode_keeps_the_shard_sizes_through_a_residual(mode):
    mesh = spmd.Mesh((2,), ("sp",))
    torch.manual_seed(0)
    net = Residual(mode).double()
    x = torch.randn(2, 2, 45, 6, dtype=F64, requires_grad=True)
    conv = spmd.nn.convert(net, mesh, H)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(conv, mesh, H, H)(_sharded(x, mesh, [30, 15]))
    assert y.layout.sizes[2] == (30, 15)
    assert stats.calls("redistribute") == 0  # nothing to agree: the conv kept the sizes
    torch.testing.assert_close(spmd.gather(y, mesh), net(x), **TOL)
    plan = str(conv.spmd_plan)
    assert f"spmd.ops.conv2d(padding_mode='{mode}')" in plan
    assert "'conv': [2, 2, 45, 6] P(None, None, 'sp') sp=[30, 15]" in plan
    # gradients, of the input (through the shards' views of it) and of the weights
    one = copy.deepcopy(net)
    loss = spmd.shard_map(lambda t: spmd.psum((conv(t) ** 2).sum(), "sp"), mesh, H, P())
    loss(_sharded(x, mesh, [30, 15])).backward()
    ox = x.detach().requires_grad_()
    (one(ox) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, ox.grad, **TOL)
    for p, q in zip(conv.parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def _per_rank_residual(mesh, net, x, sizes):
    conv = spmd.nn.convert(net, mesh, H)
    lay = Layout(x.shape, H, mesh, {2: sizes})
    with spmd.comm_stats() as stats:
        y = conv(lay.shard(x, mesh.rank))
    return y, stats.calls("convert sizes", rank=mesh.rank)


def test_per_rank_code_learns_the_input_sizes_once():
    """No shard_map, so no layout comes with the input: one exchange of the local shapes
    (after the plan), and the sizes flow from there."""
    net = Residual("circular").double()
    x = torch.randn(1, 2, 45, 6, dtype=F64)
    got = spmd.launch(lambda m: _per_rank_residual(m, net, x, [30, 15]), (2,), ("sp",))
    want = net(x)
    lay = Layout(x.shape, H, spmd.Mesh((2,), ("sp",)), {2: [30, 15]})
    for r, (y, exchanges) in enumerate(got):
        assert exchanges == 1
        torch.testing.assert_close(y, lay.shard(want, r), **TOL)


def test_a_pad_joined_with_its_conv_makes_no_padded_copy_but_the_halo():
    """The conv of a reflect-padded layer moves its halo rows only (two rows of each
    rank's neighbour: 2 ranks, 2 samples x 2 channels x 6 columns, float64)."""
    mesh = spmd.Mesh((2,), ("sp",))
    net = Residual("reflect").double()
    conv = spmd.nn.convert(net, mesh, H)
    x = torch.randn(2, 2, 45, 6, dtype=F64)
    with spmd.comm_stats() as stats:
        spmd.shard_map(conv, mesh, H, H)(_sharded(x, mesh, [30, 15]))
    assert stats.bytes() == 2 * (2 * 2 * 6 * 8)


class UNet(nn.Module):
    """GroupNorm, a strided conv down, an upsampling back to the global size, a skip
    concatenation on the channels; a reflect-padded conv at the bottom."""

    def __init__(self, size: tuple[int, int], mode: str, c: int = 2):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.GroupNorm(1, c), nn.Tanh())
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1, padding_mode="reflect"),
                                 nn.GroupNorm(2, 2 * c), nn.Tanh())
        self.up = nn.Upsample(size=size, mode=mode)
        self.dec = nn.Sequential(nn.Conv2d(3 * c, c, 3, padding=1), nn.Tanh(),
                                 nn.Conv2d(c, 1, 1))

    def forward(self, x):
        skip = self.enc(x)
        y = self.up(self.mid(self.down(skip)))
        return self.dec(torch.cat([y, skip], dim=1))


def _adam(model, loss_fn, steps=3):
    losses = adam_steps(model, loss_fn, steps, lr=0.05)
    return (torch.tensor(losses, dtype=torch.float64),
            {k: p.detach().clone() for k, p in model.named_parameters()})


def _owner_changes(src, dst) -> int:
    """Rows whose owner differs between two splits of one dim."""
    def owners(sizes):
        return [r for r, n in enumerate(sizes) for _ in range(n)]
    return sum(a != b for a, b in zip(owners(src), owners(dst)))


@pytest.mark.parametrize("sizes,mode", [([20, 4, 10, 10], "nearest"),
                                        ([10, 9, 9, 9], "bilinear"),
                                        ([0, 14, 10, 10], "nearest")])
def test_a_unet_on_uneven_rows_trains_like_one_device(sizes, mode):
    mesh = spmd.Mesh((4,), ("sp",))
    rows, cols, n, c = sum(sizes), 6, 2, 2
    torch.manual_seed(1)
    net = UNet((rows, cols), mode, c).double()
    x = torch.randn(n, 1, rows, cols, dtype=F64)
    count = x.numel()
    one = copy.deepcopy(net)
    want_losses, want = _adam(one, lambda: ((one(x) - 0.5) ** 2).sum() / count)
    sharded = spmd.nn.convert(net, mesh, H)
    xs = _sharded(x, mesh, sizes)
    loss = spmd.shard_map(lambda t: spmd.psum(((sharded(t) - 0.5) ** 2).sum(), "sp") / count,
                          mesh, H, P())
    got_losses, got = _adam(sharded, lambda: loss(xs))
    torch.testing.assert_close(got_losses, want_losses, **TOL)
    for k, p in want.items():
        torch.testing.assert_close(got[k], p, **ADAM_TOL, msg=lambda m, k=k: f"{k}: {m}")
    # the skip (c channels, cheaper than the 2c upsampled ones) moves to the upsampled
    # branch's balanced layout: only the rows that change owner travel, there and back
    balanced = spmd.core.layout.balanced_sizes(rows, 4)
    with spmd.comm_stats() as stats:
        loss(xs).backward()
    row_bytes = n * c * cols * 8
    moved = _owner_changes(sizes, balanced)
    plan = str(sharded.spmd_plan)
    if not moved:  # [10, 9, 9, 9] is the balanced split of 37 rows: nothing to agree
        assert stats.calls("redistribute") == 0 and "moved" not in plan
        return
    assert 0 < stats.bytes("redistribute", pass_="forward") <= moved * row_bytes
    assert stats.bytes("redistribute", pass_="backward") <= moved * row_bytes
    assert "torch.cat operand 1" in plan
    assert f"{moved * n * c * cols} elements ({moved * row_bytes} bytes) change owner" in plan


class Pooled(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, x):
        return x * F.interpolate(F.avg_pool2d(x, 2), size=self.size)


def test_interpolating_back_to_the_global_size_agrees_with_the_skip():
    mesh = spmd.Mesh((4,), ("sp",))
    net = Pooled((44, 6))
    x = torch.randn(1, 2, 44, 6, dtype=F64, requires_grad=True)
    sizes = [20, 4, 10, 10]
    conv = spmd.nn.convert(net, mesh, H)
    y = spmd.shard_map(conv, mesh, H, H)(_sharded(x.detach(), mesh, sizes))
    assert y.layout.sizes[2] == tuple(sizes)  # the interpolated branch moved to x's
    torch.testing.assert_close(spmd.gather(y, mesh), net(x), **TOL)
    assert "mul operand 1 dim 2: [11, 11, 11, 11] -> [20, 4, 10, 10]" in str(conv.spmd_plan)


def _back(x):  # balanced rows: pooled, then interpolated back to the global size
    return F.interpolate(F.avg_pool2d(x, 2), size=(44, 6))


def _set(x):
    y = x.clone()
    y[:] = _back(x)  # written into x's layout
    return y


AGREE = {
    "where": (lambda x: torch.where(x > 0, x, _back(x)), H),
    "in place": (lambda x: x.clone().mul_(_back(x)), H),
    "stack": (lambda x: torch.stack([x, _back(x)]).sum(0), H),
    "x[:] = y": (_set, H),
    "einsum": (lambda x: torch.einsum("bchw,bchw->bhw", x, _back(x)), P(None, "sp")),
    "cosine_similarity": (lambda x: F.cosine_similarity(x, _back(x), dim=1), P(None, "sp")),
    "expand_as": (lambda x: x[:, :1].expand_as(_back(x)) * 1, H),
    "broadcast_tensors": (lambda x: sum(torch.broadcast_tensors(x, _back(x))), H),
    "fewer dims": (lambda x: x + _back(x)[0], H),  # (C, H, W) against (N, C, H, W)
}


class Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize("name", list(AGREE))
def test_every_call_combining_operands_agrees_on_their_layouts(name):
    f, out = AGREE[name]
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(1, 2, 44, 6, dtype=F64)
    conv = spmd.nn.convert(Fn(f), mesh, H)
    y = spmd.shard_map(conv, mesh, H, out)(_sharded(x, mesh, [20, 4, 10, 10]))
    torch.testing.assert_close(spmd.gather(y, mesh), f(x), **TOL)
    assert "moved" in str(conv.spmd_plan)


class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, stride=2, padding=1)

    def forward(self, x, t):
        return F.mse_loss(F.interpolate(self.conv(x), size=(44, 6)), t)


def test_a_loss_between_a_balanced_output_and_an_uneven_target_agrees():
    mesh = spmd.Mesh((4,), ("sp",))
    net = WithLoss().double()
    x, t = torch.randn(2, 2, 1, 44, 6, dtype=F64)
    conv = spmd.nn.convert(net, mesh, (H, H))
    xs, ts = (_sharded(v, mesh, [20, 4, 10, 10]) for v in (x, t))
    loss = spmd.shard_map(conv, mesh, (H, H), P())(xs, ts)
    loss.backward()
    one = copy.deepcopy(net)
    want = one(x, t)
    want.backward()
    torch.testing.assert_close(loss, want, **TOL)
    torch.testing.assert_close(conv.conv.weight.grad, one.conv.weight.grad, **TOL)
    assert "F.mse_loss operand 1 dim 2: [20, 4, 10, 10] -> [11, 11, 11, 11]" in \
        str(conv.spmd_plan)


def test_operands_of_other_global_sizes_are_refused_not_torchs_error():
    mesh = spmd.Mesh((2,), ("sp",))
    conv = spmd.nn.convert(_Mismatch(), mesh, H)
    x = torch.randn(1, 1, 9, 4, dtype=F64)
    with pytest.raises(spmd.SpecError, match="global sizes \\[8, 9\\] along dim 2"):
        spmd.shard_map(conv, mesh, H, H)(x)


class _Mismatch(nn.Module):
    def forward(self, x):
        return x + F.interpolate(F.max_pool2d(x, 2), scale_factor=2)


# -- random stacks ------------------------------------------------------------------------------

_KEEP = ["conv_zeros", "conv_reflect", "conv_replicate", "conv_circular", "tanh"]
_CHANGE = ["avg_pool", "max_pool", "strided", "up_nearest", "up_bilinear", "to_size"]


class Stack(nn.Module):
    """``ops`` in turn, each followed by a skip from the activation ``k`` steps back where
    its global shape matches: decided once, on one device, at construction (a branch on
    a shard's shape would be one rank's own)."""

    def __init__(self, ops: list[tuple[str, int]], shape: tuple[int, int]):
        super().__init__()
        self.ops, self.shape = ops, shape
        self.convs = nn.ModuleDict()
        for i, (op, _) in enumerate(ops):
            if op.startswith("conv_"):
                self.convs[str(i)] = nn.Conv2d(2, 2, 3, padding=1, padding_mode=op[5:])
            elif op == "strided":
                self.convs[str(i)] = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.skips: list[bool] | None = None
        found: list[bool] = []
        try:
            self.forward(torch.zeros(1, 2, *shape), found)
        except RuntimeError:
            pass  # one device refuses it too: the test skips the example
        self.skips = found

    def forward(self, x, found=None):
        saved = [x]
        for i, (op, k) in enumerate(self.ops):
            if op.startswith("conv_") or op == "strided":
                x = self.convs[str(i)](x)
            elif op == "tanh":
                x = torch.tanh(x)
            elif op == "avg_pool":
                x = F.avg_pool2d(x, 2)
            elif op == "max_pool":
                x = F.max_pool2d(x, 2)
            elif op == "up_nearest":
                x = F.interpolate(x, scale_factor=2, mode="nearest")
            elif op == "up_bilinear":
                x = F.interpolate(x, scale_factor=2, mode="bilinear")
            elif op == "to_size":
                x = F.interpolate(x, size=self.shape, mode="nearest")
            s = saved[-1 - k] if len(saved) > k else None
            if found is not None:  # construction, on one device: the global shapes
                found.append(s is not None and s.shape == x.shape)
            if (found if found is not None else self.skips)[i]:
                x = torch.cat([x, s], 1)[:, :2] + s if k % 2 else x + s
            saved.append(x)
        return x


# every example plans and runs a new model on a threads mesh (~0.25 s): no deadline, and
# few examples (300 of them, all exact, a third with a move, were run once)
@settings(deadline=None, max_examples=15)
@given(st.data())
def test_random_stacks_on_random_uneven_rows_are_exact_or_refused(data):
    ranks = data.draw(st.sampled_from([2, 3]), label="ranks")
    sizes = data.draw(st.lists(st.integers(0, 7), min_size=ranks, max_size=ranks), label="sizes")
    sizes[data.draw(st.integers(0, ranks - 1), label="long shard")] += 4
    ops = data.draw(st.lists(st.tuples(st.sampled_from(_KEEP + _CHANGE), st.integers(1, 3)),
                             min_size=1, max_size=4), label="ops")
    ops.append(("to_size", len(ops)))  # back to the input's global shape: a long skip
    rows = sum(sizes)
    torch.manual_seed(0)
    net = Stack(ops, (rows, 4)).double()
    x = torch.randn(1, 2, rows, 4, dtype=F64, requires_grad=True)
    try:
        want = net(x)
    except RuntimeError:
        event("one device raises")
        return  # not a model one device runs either (a pool of one row, a reflect too wide)
    mesh = spmd.Mesh((ranks,), ("sp",), timeout=30)
    conv = spmd.nn.convert(net, mesh, H)
    try:
        y = spmd.shard_map(conv, mesh, H, H)(_sharded(x.detach(), mesh, sizes))
    except spmd.SpecError as e:
        event(f"refused: {str(e)[:60]}")
        return  # refused, before anything ran
    torch.testing.assert_close(spmd.gather(y, mesh), want, **TOL)
    event("exact" + (" (moved)" if "moved" in str(conv.spmd_plan) else ""))
    # and the gradient of the input (through the shards' views of it)
    (want ** 2).sum().backward()
    gx, x.grad = x.grad, None
    spmd.shard_map(lambda t: spmd.psum((conv(t) ** 2).sum(), "sp"), mesh, H, P())(
        _sharded(x, mesh, sizes)).backward()
    torch.testing.assert_close(x.grad, gx, **TOL)


# -- gloo -------------------------------------------------------------------------------------

def _unet_adam(mesh, net, x, sizes):
    sharded = spmd.nn.convert(net, mesh, H)
    xs = _sharded(x, mesh, sizes)
    count = x.numel()
    loss = spmd.shard_map(lambda t: spmd.psum(((sharded(t) - 0.5) ** 2).sum(), "sp") / count,
                          mesh, H, P())
    losses, params = _adam(sharded, lambda: loss(xs))
    return losses, params


@pytest.mark.gloo
def test_a_unet_on_uneven_rows_trains_like_one_device_world2(gloo2):
    torch.manual_seed(2)
    net = UNet((44, 4), "bilinear").double()
    x = torch.randn(1, 1, 44, 4, dtype=F64)
    one = copy.deepcopy(net)
    want_losses, want = _adam(one, lambda: ((one(x) - 0.5) ** 2).sum() / x.numel())
    for losses, params in gloo2.run(_unet_adam, (2,), ("sp",), args=(net, x, [25, 19])):
        torch.testing.assert_close(losses, want_losses, **TOL)
        for k, p in want.items():
            torch.testing.assert_close(params[k], p, **ADAM_TOL)
