"""spmd.ops losses: the global loss (and its gradient) of torch's loss on one device, for
batch and spatial splits, 1-d and 2-d meshes, a dim over a product of axes, uneven and
empty shards, ignore_index, class weights, label smoothing and probability targets;
one psum of at most 3 float64 each way; bad specs and targets raise on every rank.

Tolerance: float64 1e-10 (the toolkit's default: the sharded run only reorders the
float64 sums across ranks); float32 against float64, 1e-5 relative.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops import mesh_and_spec
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.core.errors import SpecError
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst

F64 = torch.float64
ELEMENTWISE = {"mse_loss": {}, "l1_loss": {}, "smooth_l1_loss": {"beta": 0.5},
               "huber_loss": {"delta": 0.7}}


def _without(lay: Layout, d: int, mesh: spmd.Mesh) -> Layout:
    """The layout of a tensor shaped like ``lay`` without dim ``d`` (the class dim)."""
    keep = [k for k in range(len(lay.shape)) if k != d]
    return Layout([lay.shape[k] for k in keep], P(*(lay.spec.entry(k) for k in keep)), mesh,
                  [lay.sizes[k] for k in keep])


@st.composite
def cases(draw):
    """An (N, C, *spatial) input over 1-2 spatial dims, split over batch and/or spatial
    dims (uneven, empty shards included), and the loss's arguments."""
    n = draw(st.integers(1, 2))
    mesh, spec = mesh_and_spec(draw, n)
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)),
             *(draw(st.integers(1, 6)) for _ in range(n)))
    lay = draw(sst.layouts(shape, mesh, spec))
    return mesh, lay, draw(st.sampled_from(["mean", "sum", "none"])), draw(st.integers(0, 2**16))


def _target(lay: Layout, seed: int, ignore: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = lay.shape[1]
    t = torch.randint(0, c, (lay.shape[0], *lay.shape[2:]), generator=g)
    if ignore:
        t[torch.rand(t.shape, generator=g) < 0.3] = -1
    return t


@given(cases(), st.sampled_from(["nll_loss", "cross_entropy"]), st.booleans(), st.booleans(),
       st.sampled_from([0.0, 0.2]))
def test_class_losses_match_one_device(case, name, weighted, ignore, smoothing):
    mesh, lay, reduction, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(lay.shape, generator=g, dtype=F64)
    if name == "nll_loss":
        x = x.log_softmax(1)
    t = _target(lay, seed, ignore)
    w = torch.rand(lay.shape[1], generator=g, dtype=F64) + 0.5 if weighted else None
    kw = dict(ignore_index=-1, reduction=reduction)
    if name == "cross_entropy":
        kw["label_smoothing"] = smoothing
    ours, ref = getattr(spmd.ops, name), getattr(F, name)
    out = _without(lay, 1, mesh) if reduction == "none" else P()
    assert_matches_single_device(
        lambda x, t: ours(x, t, w, mesh=mesh, spec=lay.spec, **kw),
        lambda x, t: ref(x, t, w, **kw), mesh, (lay, _without(lay, 1, mesh)), out, x, t)


@given(cases(), st.booleans())
def test_cross_entropy_with_probability_targets(case, weighted):
    mesh, lay, reduction, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(lay.shape, generator=g, dtype=F64)
    t = torch.rand(lay.shape, generator=g, dtype=F64).softmax(1)
    w = torch.rand(lay.shape[1], generator=g, dtype=F64) + 0.5 if weighted else None
    out = _without(lay, 1, mesh) if reduction == "none" else P()
    assert_matches_single_device(
        lambda x, t: spmd.ops.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.1,
                                            mesh=mesh, spec=lay.spec),
        lambda x, t: F.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.1),
        mesh, (lay, lay), out, x, t)


@given(cases(), st.sampled_from(sorted(ELEMENTWISE)), st.booleans())
def test_elementwise_losses_match_one_device(case, name, weighted):
    mesh, lay, reduction, seed = case
    g = torch.Generator().manual_seed(seed)
    x, t = (torch.randn(lay.shape, generator=g, dtype=F64) for _ in range(2))
    kw = dict(ELEMENTWISE[name], reduction=reduction)
    args = (x, t)
    if weighted and name in ("mse_loss", "l1_loss"):
        args += (torch.rand(lay.shape, generator=g, dtype=F64),)
    specs = (lay,) * len(args)

    def local(x, t, w=None):
        return getattr(spmd.ops, name)(x, t, weight=w, mesh=mesh, spec=lay.spec, **kw) \
            if w is not None else getattr(spmd.ops, name)(x, t, mesh=mesh, spec=lay.spec,
                                                          **kw)

    def glob(x, t, w=None):
        return getattr(F, name)(x, t, weight=w, **kw) if w is not None else \
            getattr(F, name)(x, t, **kw)
    assert_matches_single_device(local, glob, mesh, specs, lay if reduction == "none"
                                 else P(), *args)


def test_float32_and_half_losses_sum_in_float64():
    """A float32 mean over 2 x 300,000 positions: the float64 sum keeps it within 1e-6
    relative of float64, and a bfloat16 input's count is exact (torch's own bfloat16
    mean is no better, so compare with the float64 value rounded to bfloat16)."""
    mesh = spmd.Mesh((2,), ("sp",))
    lay = Layout((1, 3, 600_000), P(None, None, "sp"), mesh, {2: (350_001, 249_999)})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(lay.shape, generator=g, dtype=F64) + 100
    t = torch.randint(0, 3, (1, 600_000), generator=g)
    ref = F.cross_entropy(x, t)
    for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        f = spmd.shard_map(lambda x, t: spmd.ops.cross_entropy(x, t, mesh=mesh, spec=lay.spec),
                           mesh, (lay, _without(lay, 1, mesh)), P())
        y = f(x.to(dt), t)
        assert y.dtype == dt
        assert abs(float(y) - float(ref)) <= tol * float(ref), (dt, float(y), float(ref))


def test_one_psum_of_three_float64_each_way():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    lay = Layout((4, 3, 6, 5), P("dp", None, "sp"), mesh)
    x = torch.randn(lay.shape, requires_grad=True)
    t = torch.randint(0, 3, (4, 6, 5))
    f = spmd.shard_map(lambda x, t: spmd.ops.cross_entropy(x, t, mesh=mesh, spec=lay.spec),
                       mesh, (lay, _without(lay, 1, mesh)), P())
    with spmd.comm_stats() as st_:
        f(x, t).backward()
    # one record per rank: the forward psum of 3 float64 (sum, divisor, bad targets)
    # and its transpose
    assert st_.calls() == st_.calls("loss") == 2 * mesh.size, st_
    assert st_.bytes("loss") == 2 * mesh.size * 24, st_
    with spmd.comm_stats() as st_:
        spmd.shard_map(lambda x, t: spmd.ops.cross_entropy(x, t, reduction="none",
                                                           mesh=mesh, spec=lay.spec),
                       mesh, (lay, _without(lay, 1, mesh)), _without(lay, 1, mesh))(x, t)
    assert st_.calls() == 0, st_


def test_errors_on_every_rank():
    mesh = spmd.Mesh((2, 2), ("c", "sp"))
    x, t = torch.randn(2, 4, 6), torch.randint(0, 4, (2, 6))

    def run(f, specs):
        return spmd.shard_map(f, mesh, specs, P())(x, t)

    with pytest.raises(SpecError, match="class dim 1 .* split over"):
        run(lambda x, t: spmd.ops.cross_entropy(x, t, mesh=mesh, spec=P(None, "c", "sp")),
            (P(None, "c", "sp"), P(None, "sp")))
    with pytest.raises(SpecError, match="target .* must be class indices shaped like input"):
        run(lambda x, t: spmd.ops.nll_loss(x, t[:, :1], mesh=mesh, spec=P(None, None, "sp")),
            (P(None, None, "sp"), P(None, "sp")))
    with pytest.raises(SpecError, match="reduction must be one of"):
        run(lambda x, t: spmd.ops.nll_loss(x, t, reduction="avg", mesh=mesh,
                                           spec=P(None, None, "sp")),
            (P(None, None, "sp"), P(None, "sp")))
    with pytest.raises(SpecError, match="unknown|not an axis|axis 'zz'"):
        run(lambda x, t: spmd.ops.nll_loss(x, t, mesh=mesh, spec=P(None, None, "zz")),
            (P(None, None, "sp"), P(None, "sp")))
    with pytest.raises(SpecError, match="target .* must have the shape of input"):
        spmd.shard_map(lambda x: spmd.ops.mse_loss(x, x[..., :1], mesh=mesh,
                                                   spec=P(None, None, "sp")),
                       mesh, P(None, None, "sp"), P())(x)
    # an out-of-range target on one rank: both ranks of the psum raise after it (torch
    # would raise on that rank alone and leave the other waiting)
    sp = spmd.Mesh((2,), ("sp",))
    bad = t.clone()
    bad[1, 5] = 7
    seen = []

    def f(x, t):
        try:
            return spmd.ops.cross_entropy(x, t, mesh=sp, spec=P(None, None, "sp"))
        except IndexError as e:
            seen.append(str(e))
            raise
    with pytest.raises(Exception, match="1 target"):
        spmd.shard_map(f, sp, (P(None, None, "sp"), P(None, "sp")), P())(x, bad)
    assert len(seen) == 2, seen


def _gloo_cross_entropy(mesh):
    lay = Layout((2, 3, 7), P(None, None, "sp"), mesh, {2: (5, 2)})
    g = torch.Generator().manual_seed(3)
    xg = torch.randn(lay.shape, generator=g, dtype=F64)
    tg = torch.randint(0, 3, (2, 7), generator=g)
    tg[0, 1] = -100
    w = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    x = lay.shard(xg, mesh.rank).requires_grad_()
    t = _without(lay, 1, mesh).shard(tg, mesh.rank)
    y = spmd.ops.cross_entropy(x, t, w, mesh=mesh, spec=lay.spec)
    y.backward()
    xr = xg.clone().requires_grad_()
    ref = F.cross_entropy(xr, tg, w)
    # per-rank code: every rank backprops the replicated loss, and psum's transpose sums
    # the cotangents (docs/design.md: the one autograd convention)
    (ref * mesh.size).backward()
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, lay.shard(xr.grad, mesh.rank), rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.gloo
def test_losses_on_gloo_processes(gloo2):
    assert gloo2.run(_gloo_cross_entropy, (2,), ("sp",)) == [True, True]
