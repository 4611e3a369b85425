"""A converted forward changes its layers' state (Python attributes, parameters, buffers)
as one call on one device does, or is refused before any byte moves.

- The plan runs on a planning copy: a step counter, a buffer counted in place or
  replaced, a running mean and a data-dependent first-call initialisation (Glow's
  ActNorm) are left after a call exactly as one device leaves them, with
  ``example=`` or without, on one rank and on gloo processes.
- On a threads mesh every rank thread runs the one model: a forward that changes its
  state is refused before anything runs, naming the layer path and the attribute
  (``comm_stats`` counts no call); where the plan cannot see the change (a branch on
  data), the call raises after the forward instead of leaving a wrong state.

Values and gradients are float64 and compared at 1e-12 (the split mean reorders
additions); counters and flags exactly.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import spmd
from spmd import P

F64 = torch.float64
H = P(None, None, "sp")
TOL = dict(rtol=1e-12, atol=1e-12)


class Counter(nn.Module):
    """Counts its calls three ways and keeps a running mean of its input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1).double()
        self.steps = 0
        self.sizes: list[int] = []
        self.register_buffer("n", torch.zeros((), dtype=F64))
        self.register_buffer("m", torch.zeros((), dtype=F64))
        self.register_buffer("running", torch.zeros(2, dtype=F64))

    def forward(self, x):
        self.steps += 1
        self.sizes.append(x.shape[0])
        self.n += 1  # in place
        self.m = self.m + 1  # a new buffer
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * x.mean((0, 2, 3)))
        return self.conv(x)


class ActNorm(nn.Module):
    """Glow's activation norm: its bias is set from the first batch (a mean over the
    split dims), then trained."""

    def __init__(self, c: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, c, 1, 1, dtype=F64))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.bias.data.copy_(-x.mean(dim=(0, 2, 3), keepdim=True))
            self.initialized = True
        return x + self.bias


class Net(nn.Module):
    """ActNorm between two convolutions, and a counter: one of each kind of state."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1).double()
        self.norm = ActNorm(2)
        self.count = Counter()

    def forward(self, x):
        return self.count(self.norm(self.conv(x)))


class Loss(nn.Module):
    """``sum(model(x) * w)``: every output value weighs in the scalar and its gradient."""

    def __init__(self, model: nn.Module, w: torch.Tensor):
        super().__init__()
        self.model, self.w = model, w

    def forward(self, x):
        return (self.model(x) * self.w).sum()


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 37, 5, generator=g, dtype=F64) + 5  # ActNorm's bias near -5
    w = torch.randn(2, 2, 37, 5, generator=g, dtype=F64)
    return x, w


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _attrs(model: nn.Module) -> dict:
    """Every layer's Python attributes (what nn.Module keeps for itself and the plan left
    out), by path."""
    internal = set(nn.Module().__dict__) - {"training"}
    return {f"{path}.{k}": v for path, m in model.named_modules() for k, v in vars(m).items()
            if k not in internal and k not in ("spmd_plan", "w")}


def _state(model: nn.Module, x: torch.Tensor, calls: int, call) -> tuple:
    """``calls`` calls of ``call(x)``; the losses, input and parameter gradients, buffers
    and Python attributes."""
    x = x.clone().requires_grad_()
    losses = []
    for _ in range(calls):
        loss = call(x)
        loss.backward()
        losses.append(loss.detach())
    return (losses, x.grad, {k: p.grad for k, p in model.named_parameters()},
            dict(model.named_parameters()), dict(model.named_buffers()), _attrs(model))


def _sharded_state(mesh, x, w, calls: int, example: bool = False):
    """Per rank (threads or gloo): a converted ``Net`` called ``calls`` times."""
    kw = {"example": x} if example else {}
    conv = spmd.nn.convert(Loss(_net(), w), mesh, H, **kw)
    return _state(conv, x, calls, spmd.shard_map(conv, mesh, H, P()))


def _assert_same(got: tuple, want: tuple, input_grad: bool = True) -> None:
    losses, xg, grads, params, buffers, attrs = got
    wlosses, wxg, wgrads, wparams, wbuffers, wattrs = want
    torch.testing.assert_close(torch.stack(losses), torch.stack(wlosses), **TOL)
    if input_grad:
        torch.testing.assert_close(xg, wxg, **TOL)
    assert grads.keys() == wgrads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], wgrads[k], **TOL, msg=f"gradient of {k}")
    for k in params:
        torch.testing.assert_close(params[k], wparams[k], **TOL, msg=f"parameter {k}")
    assert buffers.keys() == wbuffers.keys()
    for k, b in buffers.items():
        assert b.device.type != "meta", k
        torch.testing.assert_close(b, wbuffers[k], **TOL, msg=f"buffer {k}")
    assert attrs == wattrs


def _one_device(x, w, calls: int) -> tuple:
    one = Loss(_net(), w)
    return _state(one, x, calls, one)


@pytest.mark.parametrize("example", [False, True])
def test_one_call_leaves_the_state_one_device_leaves(example):
    """One rank (nothing shared): the plan's meta run leaves no trace, and ActNorm's
    first-call initialisation happens in the real call, from the real batch."""
    x, w = _data()
    mesh = spmd.Mesh((1,), ("sp",))
    for calls in (1, 2):
        _assert_same(_sharded_state(mesh, x, w, calls, example), _one_device(x, w, calls))


@pytest.mark.parametrize("example", [False, True])
def test_a_forward_that_changes_shared_state_is_refused_on_rank_threads(example):
    """4 rank threads (H = 37 split 10, 9, 9, 9) share the one model: each change of its
    state is named (layer path, attribute, what) before anything runs, nothing moves,
    and the state is as it was."""
    x, w = _data()
    mesh = spmd.Mesh((4,), ("sp",))
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        _sharded_state(mesh, x, w, 1, example)
    assert stats.calls() == 0
    msg = str(e.value)
    for where, attr, what in [
            ("in Loss.model.norm", "self.bias", "updates the parameter in place"),
            ("in Loss.model.norm", "self.initialized", "changes the attribute (bool)"),
            ("in Loss.model.count", "self.steps", "changes the attribute (int)"),
            ("in Loss.model.count", "self.sizes", "changes the attribute (list)"),
            ("in Loss.model.count", "self.n", "updates the buffer in place"),
            ("in Loss.model.count", "self.m", "replaces the buffer"),
            ("in Loss.model.count", "self.running", "updates the buffer in place")]:
        assert f"  - {where}: {attr} {what} in forward, which each of the 4 rank threads " \
               f"would do to the one " in msg
    assert "(a threads mesh runs every rank's forward on the one model: run on processes, " \
           "each rank with its own copy (spmd.launch(..., backend='gloo') or torchrun)" in msg
    assert len(msg) < 2000
    conv = spmd.nn.convert(Loss(_net(), w), mesh, H)
    with pytest.raises(spmd.SpecError, match="self.steps"):
        spmd.shard_map(conv, mesh, H, P())(x)
    assert _attrs(conv) == _attrs(Loss(_net(), w))
    for k, b in conv.named_buffers():
        assert b.device.type != "meta" and not b.any(), k


class Late(nn.Module):
    """Counts its calls behind a branch on data, which a plan on meta tensors cannot
    take."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def forward(self, x):
        if x.sum() > -1e9:
            self.steps += 1
        return 2 * x


def test_a_change_the_plan_cannot_see_raises_after_the_forward_on_rank_threads():
    mesh = spmd.Mesh((4,), ("sp",))
    conv = spmd.nn.convert(Late(), mesh, H)
    with pytest.raises(spmd.SpecError, match=r"(?s)Late's forward changed the state of layers "
                       r"that the rank threads share, where its plan .*cannot be called on "
                       r"meta tensors.*in Late: self.steps changes the attribute \(int\) in "
                       r"forward, which each of the 4 rank threads would do"):
        spmd.shard_map(conv, mesh, H, H)(_data()[0])
    alone = spmd.Mesh((1,), ("sp",))  # nothing shared: the branch runs as on one device
    one = spmd.nn.convert(Late(), alone, H)
    spmd.shard_map(one, alone, H, H)(_data()[0])
    assert one.steps == 1


def test_layers_not_looked_into_keep_their_state_to_themselves():
    """spmd.nn's BatchNorm2d counts num_batches_tracked once per step on rank threads
    itself: swapped in with types=, its state changes are not refused. torch's, whose
    plan stops at float(num_batches_tracked) (momentum=None), is refused with the twin
    named."""
    mesh = spmd.Mesh((2,), ("sp",))
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=None)).double()
    conv = spmd.nn.convert(net, mesh, H, types={nn.BatchNorm2d: spmd.nn.BatchNorm2d})
    spmd.shard_map(conv, mesh, H, H)(torch.randn(2, 1, 7, 5, dtype=F64))
    assert int(conv[1].num_batches_tracked) == 1
    with pytest.raises(spmd.SpecError, match=r"in Sequential.1: self.num_batches_tracked "
                       r"updates the buffer in place.*types=\{nn.BatchNorm2d: "
                       r"spmd.nn.BatchNorm2d\}"):
        spmd.shard_map(spmd.nn.convert(net, mesh, H), mesh, H, H)(
            torch.randn(2, 1, 7, 5, dtype=F64))


class Running(nn.Module):
    """Buffers updated in place only: a call count, a running mean of the input (its
    first value the first batch's mean: a first-call initialisation without a branch)
    and a flag; the output reads them after the update."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1).double()
        self.register_buffer("n", torch.zeros((), dtype=F64))
        self.register_buffer("running", torch.zeros(2, dtype=F64))
        self.register_buffer("started", torch.zeros((), dtype=torch.bool))

    def forward(self, x):
        self.n += 1
        with torch.no_grad():
            mean = x.mean((0, 2, 3))
            self.running.data.copy_(torch.where(self.started, 0.9 * self.running + 0.1 * mean,
                                                mean))
            self.started.fill_(True)
        return self.conv(x) * self.n + self.running[None, :, None, None]


def test_buffers_updated_in_place_are_exact_on_rank_threads():
    """4 rank threads (H = 37 split 10, 9, 9, 9), 3 calls: each rank updates its own copy
    of the buffers, the ranks' copies agree (the mean is the global one) and are written
    back once: values, gradients and buffers as on one device. The write-back costs two
    barriers per rank and call."""
    x, w = _data()
    mesh = spmd.Mesh((4,), ("sp",))
    torch.manual_seed(0)
    conv = spmd.nn.convert(Loss(Running(), w), mesh, H)
    torch.manual_seed(0)
    one = Loss(Running(), w)
    with spmd.comm_stats() as stats:
        got = _state(conv, x, 3, spmd.shard_map(conv, mesh, H, P()))
    _assert_same(got, _state(one, x, 3, one))
    assert stats.calls("convert: buffers updated in forward") == 3 * 2 * 4


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm2d(3, momentum=0.3),
                                  lambda: nn.InstanceNorm2d(3, track_running_stats=True)],
                         ids=["BatchNorm2d", "InstanceNorm2d"])
def test_torch_norms_with_running_statistics_are_exact_on_rank_threads(norm):
    """torch's BatchNorm2d and tracked InstanceNorm2d in training, 4 rank threads, 3
    calls: running statistics and num_batches_tracked as on one device (each rank
    thread updated its own copy; the copies agree and are written back once)."""
    x, _ = _data()
    w = torch.randn(2, 3, 37, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    mesh = spmd.Mesh((4,), ("sp",))

    def make():
        torch.manual_seed(0)
        return Loss(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), norm()).double(), w)
    conv = spmd.nn.convert(make(), mesh, H)
    one = make()
    _assert_same(_state(conv, x, 3, spmd.shard_map(conv, mesh, H, P())), _state(one, x, 3, one))


def test_buffers_the_rank_threads_update_differently_raise_naming_them():
    """A buffer updated from this rank's own count (the parity of a split size, the same
    at both of the plan's stand-in sizes, so the plan cannot see it): the copies differ,
    every rank raises naming it, and the buffer keeps its value."""
    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rows", torch.zeros((), dtype=F64))

        def forward(self, x):
            self.rows.add_(float(x.shape[2] % 2))  # 10, 9, 9, 9 rows: 0, 1, 1, 1
            return 2 * x

    mesh = spmd.Mesh((4,), ("sp",))
    conv = spmd.nn.convert(Rows(), mesh, H)
    with pytest.raises(spmd.SpecError, match=r"convert: after the forward, the rank threads' "
                       r"copies of Rows.rows differ .*update it from values every rank "
                       r"agrees on"):
        spmd.shard_map(conv, mesh, H, H)(_data()[0])
    assert float(conv.rows) == 0


@pytest.mark.gloo
@pytest.mark.parametrize("example", [False, True])
def test_one_call_leaves_the_state_one_device_leaves_world2(gloo2, example):
    """Two processes (H = 37 split 19, 18), each its own copy: two calls leave each one's
    state as two calls on one device leave it, ActNorm's first-call init included."""
    x, w = _data()
    want = _one_device(x, w, 2)
    for got in gloo2.run(_sharded_state, (2,), ("sp",), args=(x, w, 2, example)):
        _assert_same(got, want)


class Piece(nn.Module):
    """One kind of state a forward may change (``kind``), then a per-position op."""

    KINDS = ("none", "buffer +=", "running mean", "attribute", "buffer replaced",
             "parameter in place")

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.register_buffer("b", torch.zeros(2, dtype=F64))
        self.scale = nn.Parameter(torch.ones(1, 2, 1, 1, dtype=F64))
        self.count = 0

    def forward(self, x):
        with torch.no_grad():
            if self.kind == "buffer +=":
                self.b += 1
            elif self.kind == "running mean":
                self.b.mul_(0.5).add_(x.mean((0, 2, 3)))
            elif self.kind == "buffer replaced":
                self.b = self.b + 1
            elif self.kind == "parameter in place":
                self.scale.mul_(1.5)
        if self.kind == "attribute":
            self.count += 1
        return torch.tanh(x * self.scale + self.b[None, :, None, None])


_EXACT_ON_THREADS = {"none", "buffer +=", "running mean"}


@given(kinds=st.lists(st.sampled_from(Piece.KINDS), min_size=1, max_size=3),
       ranks=st.integers(1, 4), h=st.integers(4, 9), seed=st.integers(0, 2 ** 16))
def test_random_state_changes_are_exact_or_refused_before_anything_moves(kinds, ranks, h,
                                                                         seed):
    """Layers that change their state in any of six ways, on 1 to 4 rank threads of an
    uneven H: two calls equal two on one device (values, gradients, parameters,
    buffers, attributes), or, where a rank thread would change what the others share,
    the first call is refused naming every such layer, before any byte moves."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, h, 3, generator=g, dtype=F64)
    w = torch.randn(2, 2, h, 3, generator=g, dtype=F64)
    mesh = spmd.Mesh((ranks,), ("sp",))

    def make():
        return Loss(nn.Sequential(*[Piece(k) for k in kinds]), w)
    conv = spmd.nn.convert(make(), mesh, H)
    shared = [i for i, k in enumerate(kinds) if k not in _EXACT_ON_THREADS]
    if ranks > 1 and shared:
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
            spmd.shard_map(conv, mesh, H, P())(x)
        assert stats.calls() == 0
        for i in shared:
            assert f"in Loss.model.{i}: self." in str(e.value)
        assert _attrs(conv) == _attrs(make())
        return
    one = make()
    _assert_same(_state(conv, x, 2, spmd.shard_map(conv, mesh, H, P())), _state(one, x, 2, one))
