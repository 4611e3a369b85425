"""Random draws in a converted forward (spmd/nn/rules/draws.py, spmd/nn/streams.py).

Replicated draws are the same on every rank (check_rep verifies the outputs), and the
gradient is the gradient of the output: compared in float64 with one device given the
mask the converted model drew (read off its output: the dropped input is kept nonzero).
Split draws stay per rank; channel dropout on split dims drops the same channels on
every rank, empty shards too. Under spmd.random.invariant the converted model equals one
device under the same context exactly, on uneven meshes, and two meshes agree.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spmd
from spmd import P

H = P(None, None, "sp")
TOL = dict(rtol=1e-12, atol=1e-12)  # float64: the converted sums differ only in order


def _net(f, width=3):
    torch.manual_seed(0)
    return Fn(f, nn.Conv2d(1, width, 3, padding=1), nn.Linear(width, 2)).double()


def _weights(y):
    return torch.arange(1.0, y.numel() + 1, dtype=y.dtype).view(y.shape)


def _grads(model, run, x):
    """``run(x)``'s outputs, and the gradients of a weighted sum of its first output."""
    x = x.clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    out = run(x)
    y = out[0] if isinstance(out, tuple) else out
    (y * _weights(y)).sum().backward()
    return out, x.grad, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _same(got, want):
    (y, gx, gp), (y1, gx1, gp1) = got, want
    y = y[0] if isinstance(y, tuple) else y
    y1 = y1[0] if isinstance(y1, tuple) else y1
    torch.testing.assert_close(y.detach(), y1.detach(), **TOL)
    torch.testing.assert_close(gx, gx1, **TOL)
    for a, b in zip(gp, gp1):
        torch.testing.assert_close(a, b, **TOL)


def _after_mean(m, x):
    """Dropout after a mean over the split dims (a replicated draw); also returns the
    dropout's output, which shows the mask (its input is > 0)."""
    h = torch.relu(m.layers[0](x)).mean((2, 3)) + 1.0
    d = F.dropout(h, 0.5, training=True)
    return m.layers[1](d), d


@pytest.mark.parametrize("size,h", [(4, 11), (3, 7)])
def test_dropout_after_a_mean_is_one_mask_and_its_gradient_is_exact(size, h):
    mesh = spmd.Mesh((size,), ("sp",))
    net = _net(_after_mean)
    conv = spmd.nn.convert(net, mesh, H)
    run = spmd.shard_map(conv, mesh, H, (P(), P()), check_rep=True)  # the ranks agree
    x = torch.randn(2, 1, h, 6, dtype=torch.float64)
    got = _grads(conv, run, x)
    mask = (got[0][1] != 0).double().detach()
    assert 0 < int(mask.sum()) < mask.numel()
    want = _grads(net, lambda x: net.layers[1](
        (torch.relu(net.layers[0](x)).mean((2, 3)) + 1.0) * mask * 2), x)
    _same(got, want)
    assert not torch.equal(run(x)[1], got[0][1])  # the shared stream moves on


def _diffusion(m, x):
    """A diffusion step's draws: timesteps, noise, a rand_like of a replicated value and
    an in-place draw."""
    b = x.shape[0]
    t = torch.randint(0, 1000, (b,))
    noise = torch.randn(b, 3, dtype=x.dtype)
    h = torch.relu(m.layers[0](x)).mean((2, 3))
    u = torch.rand_like(h) + torch.empty_like(h).uniform_(-1, 1)
    y = m.layers[1](h + noise * t[:, None] / 1000 + u)
    return y, t, noise, u


def test_diffusion_timesteps_and_noise_are_the_same_on_every_rank():
    mesh = spmd.Mesh((4,), ("sp",))
    net = _net(_diffusion)
    conv = spmd.nn.convert(net, mesh, H)
    x = torch.randn(2, 1, 9, 4, dtype=torch.float64)
    run = spmd.shard_map(conv, mesh, H, (P(),) * 4, check_rep=True)
    got = _grads(conv, run, x)
    _, t, noise, u = (v.detach() for v in got[0])
    want = _grads(net, lambda x: net.layers[1](
        torch.relu(net.layers[0](x)).mean((2, 3)) + noise * t[:, None] / 1000 + u), x)
    _same(got, want)


def test_a_draw_split_over_every_axis_stays_per_rank():
    mesh = spmd.Mesh((4,), ("sp",))
    conv = spmd.nn.convert(Fn(lambda m, x: F.dropout(x, 0.5)), mesh, H)
    x = torch.ones(1, 1, 64, 32, dtype=torch.float64)
    y = spmd.shard_map(conv, mesh, H, H)(x)
    blocks = y.reshape(4, 16 * 32)
    assert not torch.equal(blocks[0], blocks[1])  # each rank its own mask


def test_a_draw_split_over_some_axes_is_shared_by_the_ranks_holding_the_same_block():
    """Mesh (dp, sp), a tensor split over dp only after a mean over sp: the two sp ranks
    of each dp row draw one mask; the dp rows draw their own."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    spec = P("dp", None, "sp")
    conv = spmd.nn.convert(Fn(lambda m, x: F.dropout(x.mean((2, 3)) + 1.0, 0.5)), mesh, spec)
    x = torch.rand(2, 64, 8, 4, dtype=torch.float64)
    y = spmd.shard_map(conv, mesh, spec, P("dp"), check_rep=True)(x)
    assert not torch.equal(y[0] != 0, y[1] != 0)


@pytest.mark.parametrize("size,h", [(4, 11), (4, 3)])
def test_dropout2d_on_split_dims_drops_the_same_channels_on_every_rank(size, h):
    """[3, 3, 3, 2] rows, and [1, 1, 1, 0]: an empty shard draws the mask too."""
    mesh = spmd.Mesh((size,), ("sp",))
    net = _net(lambda m, x: F.dropout2d(torch.relu(m.layers[0](x)) + 1.0, 0.5), width=8)
    conv = spmd.nn.convert(net, mesh, H)
    x = torch.randn(3, 1, h, 5, dtype=torch.float64)
    for _ in range(2):  # the stream stays in step after a call with an empty shard
        got = _grads(conv, spmd.shard_map(conv, mesh, H, H), x)
        y = got[0].detach().flatten(2)
        mask = (y[..., 0] != 0).double()
        assert torch.equal((y != 0).double(), mask[..., None].expand_as(y))  # whole channels
        assert 0 < int(mask.sum()) < mask.numel()
        want = _grads(net, lambda x: (torch.relu(net.layers[0](x)) + 1.0) *
                      mask[:, :, None, None] * 2, x)
        _same(got, want)


def test_the_plan_draws_nothing():
    mesh = spmd.Mesh((4,), ("sp",))
    a, b = _net(_diffusion), _net(lambda m, x: F.dropout2d(m.layers[0](x), 0.5))
    state = torch.get_rng_state()
    spmd.nn.convert(a, mesh, H, example=(2, 1, 9, 4))
    spmd.nn.convert(b, mesh, H, example=(2, 1, 9, 4))
    assert torch.equal(state, torch.get_rng_state())


def test_the_plan_says_which_draws_are_shared():
    conv = spmd.nn.convert(_net(_after_mean), spmd.Mesh((4,), ("sp",)), H,
                           example=(2, 1, 9, 4))
    assert "F.dropout replicated draw -> the stream the ranks share" in str(conv.spmd_plan)


def test_a_shared_draw_on_a_threads_mesh_with_one_generator_is_refused():
    mesh = spmd.Mesh((4,), ("sp",), rng="shared")
    with pytest.raises(spmd.SpecError, match="threads mesh has rng='shared'.*"
                       "use Mesh\\(..., rng='per_rank'\\)"):
        spmd.nn.convert(_net(_after_mean), mesh, H, example=(2, 1, 9, 4))


# -- spmd.random.invariant -------------------------------------------------------------------


def _split_draws(m, x):
    h = torch.relu(m.layers[0](x))
    d = F.dropout(h, 0.5)
    n = torch.randn_like(h)
    c = F.dropout2d(h, 0.5)
    e = torch.rand(h.shape[0], 1, h.shape[2], h.shape[3], dtype=h.dtype)
    return d + 0.1 * n + c * e + F.dropout(h.mean((2, 3)), 0.5)[:, :, None, None]


def _invariant_run(mesh, net, x, seed=3):
    conv = spmd.nn.convert(net, mesh, H)

    def body(x):
        with spmd.random.invariant(seed):
            return conv(x)
    return conv, _grads(conv, spmd.shard_map(body, mesh, H, H), x)


@pytest.mark.parametrize("size,h", [(4, 37), (2, 37), (4, 3)])
def test_under_invariant_a_converted_model_equals_one_device(size, h):
    """H = 37: [10, 9, 9, 9] rows on 4 ranks, [19, 18] on 2; H = 3: [1, 1, 1, 0]."""
    net = _net(_split_draws, width=4)
    x = torch.randn(2, 1, h, 6, dtype=torch.float64)
    _, got = _invariant_run(spmd.Mesh((size,), ("sp",)), net, x)

    def one(x):
        with spmd.random.invariant(3):
            return net(x)
    _same(got, _grads(net, one, x))


@settings(max_examples=15)
@given(ranks=st.integers(1, 4), h=st.integers(1, 12), w=st.integers(1, 5),
       seed=st.integers(0, 2 ** 62))
def test_under_invariant_any_mesh_and_layout_equals_one_device(ranks, h, w, seed):
    """Balanced splits of 1-12 rows over 1-4 ranks (empty shards where h < ranks)."""
    if not _NET:
        _NET.append(_net(_split_draws, width=2))
    net = _NET[0]
    x = torch.randn(2, 1, h, w, dtype=torch.float64)
    _, got = _invariant_run(spmd.Mesh((ranks,), ("sp",)), net, x, seed)

    def one(x):
        with spmd.random.invariant(seed):
            return net(x)
    _same(got, _grads(net, one, x))


_NET: list = []  # one model for all examples (made at the first)


def test_under_invariant_a_2d_mesh_equals_one_device():
    """Samples split over 'dp' and rows over 'sp': global indices along both."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    spec = P("dp", None, "sp")
    net = _net(_split_draws, width=2)
    conv = spmd.nn.convert(net, mesh, spec)
    x = torch.randn(3, 1, 7, 4, dtype=torch.float64)

    def body(x):
        with spmd.random.invariant(11):
            return conv(x)

    def one(x):
        with spmd.random.invariant(11):
            return net(x)
    _same(_grads(conv, spmd.shard_map(body, mesh, spec, spec), x), _grads(net, one, x))


def test_under_invariant_two_meshes_draw_the_same_masks():
    net = _net(lambda m, x: F.dropout(m.layers[0](x) + 5.0, 0.5), width=2)
    x = torch.randn(1, 1, 13, 4, dtype=torch.float64)
    a = _invariant_run(spmd.Mesh((4,), ("sp",)), net, x)[1][0]
    b = _invariant_run(spmd.Mesh((3,), ("sp",)), net, x)[1][0]
    assert torch.equal(a != 0, b != 0) and 0 < int((a == 0).sum()) < a.numel()


# -- processes ---------------------------------------------------------------------------------


class Diffusion(nn.Module):
    """Dropout after a mean over the split dims, and a timestep drawn in forward."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 3, 3, padding=1), nn.Linear(3, 2)

    def forward(self, x):
        t = torch.randint(0, 1000, (x.shape[0],))
        d = F.dropout(torch.relu(self.conv(x)).mean((2, 3)) + 1.0, 0.5)
        return self.head(d) * (1 + t[:, None] / 1000), d, t


def _per_process(mesh, net, x):
    import torch.distributed as dist
    torch.manual_seed(100 + dist.get_rank())  # the processes' own streams differ
    conv = spmd.nn.convert(net, mesh, H)
    x = x.clone().requires_grad_(True)
    y, d, t = spmd.shard_map(conv, mesh, H, (P(), P(), P()))(x)
    (y * _weights(y)).sum().backward()
    return y.detach(), d.detach(), t, x.grad, [p.grad for p in conv.parameters()]


@pytest.mark.gloo
def test_replicated_draws_agree_on_processes_world2(gloo2):
    torch.manual_seed(0)
    net = Diffusion().double()
    x = torch.randn(2, 1, 9, 4, dtype=torch.float64)
    (y, d, t, gx, gp), other = gloo2.run(_per_process, (2,), ("sp",), args=(net, x))
    assert torch.equal(d, other[1]) and torch.equal(t, other[2]) and torch.equal(y, other[0])
    mask = (d != 0).double()

    def one(x):
        h = (torch.relu(net.conv(x)).mean((2, 3)) + 1.0) * mask * 2
        return net.head(h) * (1 + t[:, None] / 1000)
    _same((y, gx, gp), _grads(net, one, x))
    _same((y, gx, gp), other[:1] + other[3:])


def test_invariant_entered_around_shard_map_reaches_every_rank_thread():
    net = _net(lambda m, x: F.dropout(m.layers[0](x) + 5.0, 0.5), width=2)
    x = torch.randn(1, 1, 13, 4, dtype=torch.float64)
    mesh = spmd.Mesh((4,), ("sp",))
    conv = spmd.nn.convert(net, mesh, H)
    with spmd.random.invariant(3) as s:
        a = spmd.shard_map(conv, mesh, H, H)(x)
        b = spmd.shard_map(conv, mesh, H, H)(x)
    with spmd.random.invariant(3):
        want = net(x), net(x)
    assert s.draws == 2
    torch.testing.assert_close(a, want[0], **TOL)
    torch.testing.assert_close(b, want[1], **TOL)


def test_a_shared_draw_from_a_generator_of_its_own_is_refused():
    g = torch.Generator()
    net = _net(lambda m, x: m.layers[0](x) + torch.rand(1, generator=g, dtype=x.dtype))
    with pytest.raises(spmd.SpecError, match="torch.rand draws a value several ranks hold "
                       "alike from the generator= it is given.*leave generator= out"):
        spmd.nn.convert(net, spmd.Mesh((2,), ("sp",)), H, example=(1, 1, 6, 4))


class SplitDraws(nn.Module):
    """Dropout, channel dropout and noise on split activations."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.conv(x)) + 1.0
        return F.dropout(h, 0.5) + F.dropout2d(h, 0.5) * torch.randn_like(h)


def _invariant_per_process(mesh, net, x):
    conv = spmd.nn.convert(net, mesh, H)
    with spmd.random.invariant(5):
        return spmd.shard_map(conv, mesh, H, H)(x).detach()


@pytest.mark.gloo
def test_under_invariant_processes_equal_one_device_world2(gloo2):
    torch.manual_seed(0)
    net = SplitDraws().double()
    x = torch.randn(2, 1, 9, 4, dtype=torch.float64)
    a, b = gloo2.run(_invariant_per_process, (2,), ("sp",), args=(net, x))
    with spmd.random.invariant(5):
        want = net(x)
    torch.testing.assert_close(a, want, **TOL)
    assert torch.equal(a, b)


def test_invariant_entered_inside_a_converted_forward_is_refused():
    def f(m, x):
        with spmd.random.invariant(0):
            return F.dropout(x, 0.5)
    mesh = spmd.Mesh((2,), ("sp",))
    conv = spmd.nn.convert(Fn(f), mesh, H)
    with pytest.raises(spmd.SpecError, match="dropout is drawn inside a converted forward "
                       "under a context entered inside it; enter invariant\\(...\\) around"):
        spmd.shard_map(conv, mesh, H, H)(torch.ones(1, 1, 6, 4))


class Noisy(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


def test_under_invariant_a_draw_in_a_layer_convert_does_not_look_into_is_refused():
    mesh = spmd.Mesh((2,), ("sp",))
    conv = spmd.nn.convert(nn.Sequential(Noisy()), mesh, H, allow=(Noisy,))
    spmd.shard_map(conv, mesh, H, H)(torch.ones(1, 1, 6, 4))  # each rank its own: allowed
    with spmd.random.invariant(0), pytest.raises(
            spmd.SpecError, match="rand_like is drawn inside a layer convert does not look "
            "into \\(allow=, types=\\).*would draw by this rank's local indices"):
        spmd.shard_map(conv, mesh, H, H)(torch.ones(1, 1, 6, 4))


def test_a_draw_under_invariant_inside_a_checkpoint_is_refused_in_the_plan():
    from torch.utils.checkpoint import checkpoint
    mesh = spmd.Mesh((4,), ("sp",))
    net = Fn(lambda m, t: checkpoint(lambda u: F.dropout(u, 0.5) * u, t, use_reentrant=False))
    conv = spmd.nn.convert(net, mesh, H)
    x = torch.randn(2, 3, 37, 4, dtype=torch.float64, requires_grad=True)
    with spmd.comm_stats() as stats, spmd.random.invariant(0), pytest.raises(
            spmd.SpecError, match=r"(?s)nothing has run.*F.dropout is drawn under "
                                  r"spmd.random.invariant inside torch.utils.checkpoint"):
        spmd.shard_map(conv, mesh, H, H)(x)
    assert stats.calls() == 0
