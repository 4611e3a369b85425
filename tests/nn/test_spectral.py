"""spmd.nn.spectral: FNO's spectral convolutions and the FNO on shards.

The single-device layer (``mesh=None``) equals a literal copy of FNO's reference code
(below, complex weights, slice assignments); the sharded layer equals the single-device
one in float64, values and gradients (input and weights) to 1e-10, on 1-d and 2-d
threads meshes (slabs and pencils), uneven and empty shards, shards smaller than the
kept modes, and modes reaching past half the extent; a slab moves data twice each way
(rfft2 and irfft2), nothing else; the FNO trained 3 Adam steps on 4 ranks equals one
device; and one gloo world-2 case. Bad input raises SpecError on every rank.
"""
from __future__ import annotations

import copy

import pytest
import torch
from _ops import adam_steps
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Layout, Mesh, P
from spmd.nn.spectral import FNO, SpectralConv1d, SpectralConv2d, SpectralConv3d
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst

F64 = torch.float64
CONVS = {1: SpectralConv1d, 2: SpectralConv2d, 3: SpectralConv3d}


# -- FNO's reference code (Li et al., fourier_1d/2d/3d.py), complex weights ---------------------

def fno_reference(x: torch.Tensor, ws: list[torch.Tensor], modes: tuple[int, ...]):
    b, o = x.shape[0], ws[0].shape[1]
    n = x.ndim - 2
    x_ft = torch.fft.rfftn(x, dim=tuple(range(2, 2 + n)))
    out_ft = torch.zeros(b, o, *x_ft.shape[2:], dtype=x_ft.dtype)
    if n == 1:
        (m1,) = modes
        out_ft[:, :, :m1] = torch.einsum("bix,iox->box", x_ft[:, :, :m1], ws[0])
    elif n == 2:
        m1, m2 = modes
        mul = lambda a, w: torch.einsum("bixy,ioxy->boxy", a, w)  # noqa: E731
        out_ft[:, :, :m1, :m2] = mul(x_ft[:, :, :m1, :m2], ws[0])
        out_ft[:, :, -m1:, :m2] = mul(x_ft[:, :, -m1:, :m2], ws[1])
    else:
        m1, m2, m3 = modes
        mul = lambda a, w: torch.einsum("bixyz,ioxyz->boxyz", a, w)  # noqa: E731
        out_ft[:, :, :m1, :m2, :m3] = mul(x_ft[:, :, :m1, :m2, :m3], ws[0])
        out_ft[:, :, -m1:, :m2, :m3] = mul(x_ft[:, :, -m1:, :m2, :m3], ws[1])
        out_ft[:, :, :m1, -m2:, :m3] = mul(x_ft[:, :, :m1, -m2:, :m3], ws[2])
        out_ft[:, :, -m1:, -m2:, :m3] = mul(x_ft[:, :, -m1:, -m2:, :m3], ws[3])
    return torch.fft.irfftn(out_ft, s=x.shape[2:], dim=tuple(range(2, 2 + n)))


@pytest.mark.parametrize("shape, modes", [
    ((2, 3, 16), (5,)),
    ((2, 3, 9, 8), (3, 4)),
    ((1, 2, 7, 6), (5, 4)),          # 2 m1 > n1: FNO's corners overlap, the later one wins
    ((1, 2, 6, 5, 7), (2, 3, 4)),
    ((1, 1, 4, 4, 4), (3, 3, 3)),    # overlaps on two dims
])
def test_one_device_layer_is_fno_reference(shape, modes):
    torch.manual_seed(0)
    n = len(modes)
    conv = CONVS[n](shape[1], 4, modes, dtype=F64)
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    y = conv(x)
    ws = [w.detach().clone().requires_grad_() for w in conv.weights()]
    want = fno_reference(x.detach().requires_grad_(), ws, modes)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    gx, *gw = torch.autograd.grad(y, [x, *conv.parameters()], g)
    x2 = x.detach().clone().requires_grad_()
    want = fno_reference(x2, ws, modes)
    rx, *rw = torch.autograd.grad(want, [x2, *ws], g)
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-12)
    for a, b in zip(gw, rw):
        torch.testing.assert_close(torch.view_as_complex(a), b, rtol=1e-12, atol=1e-12)


# -- sharded vs one device --------------------------------------------------------------------

def check_layer(mesh: Mesh, lay: Layout, modes, out_channels: int = 3, by_layout: bool = True,
                seed: int = 0):
    """The sharded layer under shard_map against the same layer on one device: values,
    the input's gradient and every weight's, in float64 to 1e-10."""
    n = lay.ndim - 2
    torch.manual_seed(seed)
    one = CONVS[n](lay.shape[1], out_channels, modes, dtype=F64)
    sharded = CONVS[n].from_torch(copy.deepcopy(one), mesh, lay if by_layout else lay.spec)
    out = Layout((lay.shape[0], out_channels) + lay.shape[2:], lay.spec, mesh,
                 {d: s for d, s in enumerate(lay.sizes) if s is not None} or None)
    x = torch.randn(lay.shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return assert_matches_single_device(sharded, one, mesh, lay, out, x)


CASES = [  # (mesh shape, global shape, spec, sizes, modes)
    ((2,), (2, 3, 8, 8), (None, None, "sp"), None, (3, 4)),             # slab
    ((3,), (1, 2, 10, 7), (None, None, "sp"), {2: [6, 0, 4]}, (4, 3)),  # uneven, an empty shard
    ((4,), (1, 2, 9, 12), (None, None, None, "sp"), None, (4, 7)),      # the last dim split
    ((4,), (1, 2, 6, 16), (None, None, "sp"), None, (3, 9)),            # shards < modes
    ((4,), (1, 2, 7, 6), (None, None, "sp"), {2: [1, 1, 5, 0]}, (5, 4)),  # 2 m > n (overlap)
    ((3,), (3, 2, 5, 6), ("sp",), None, (2, 3)),                        # the batch split
    ((2, 2), (1, 2, 7, 6), (None, None, "x", "y"), {2: [5, 2]}, (3, 4)),  # pencil (H, W)
    ((2, 2), (2, 2, 6, 6), ("x", None, "y"), None, (2, 4)),             # batch x slab
    ((4,), (1, 2, 13), (None, None, "sp"), {2: [2, 7, 0, 4]}, (7,)),    # 1-d, modes = n//2+1
    ((2,), (1, 2, 5, 6, 6), (None, None, "sp"), None, (2, 3, 4)),       # 3-d slab
    ((2, 2), (1, 1, 4, 6, 5), (None, None, "x", "y"), {3: [1, 5]}, (3, 2, 3)),  # 3-d pencil
]


@pytest.mark.parametrize("mshape, shape, spec, sizes, modes", CASES)
def test_sharded_layer_matches_one_device(mshape, shape, spec, sizes, modes):
    mesh = Mesh(mshape, ("sp",) if len(mshape) == 1 else ("x", "y"))
    check_layer(mesh, Layout(shape, P(*spec), mesh, sizes), modes)


@st.composite
def layer_cases(draw):
    mesh = draw(st.sampled_from([(2,), (3,), (4,), (2, 2), (1, 3)]))
    mesh = Mesh(mesh, ("sp",) if len(mesh) == 1 else ("x", "y"))
    n = draw(st.integers(1, 2))
    spatial = tuple(draw(st.integers(1, 9)) for _ in range(n))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) + spatial
    modes = tuple(draw(st.integers(1, s)) for s in spatial[:-1]) + (
        draw(st.integers(1, spatial[-1] // 2 + 1)),)
    entries: list = [None] * len(shape)
    for a in mesh.axis_names:  # each axis on the batch or a spatial dim (or nowhere)
        d = draw(st.sampled_from([0, None] + list(range(2, len(shape)))))
        if d is not None:
            entries[d] = (entries[d] or ()) + (a,)
    lay = draw(sst.layouts(shape, mesh, P(*entries)))
    return mesh, lay, modes, draw(st.booleans()), draw(st.integers(0, 9))


@sst.settings(max_examples=25)
@given(case=layer_cases())
def test_any_layout_matches_one_device(case):
    mesh, lay, modes, by_layout, seed = case
    check_layer(mesh, lay, modes, out_channels=2, by_layout=by_layout, seed=seed)


def test_slab_moves_only_kept_modes_twice_each_way(monkeypatch):
    """rfft2 and irfft2 take one all_to_all each, forward and backward, and nothing else
    moves (a Layout spec: no size exchange). The spectrum is cut to its kept modes before
    it moves: W' = 8 columns would be split [4, 4], the 3 kept ones are split [2, 1], so
    every rank mixes and the transposes carry 3 columns, not 8."""
    mesh = Mesh((2,), ("sp",))
    lay = Layout((1, 2, 8, 14), P(None, None, "sp"), mesh)  # H = 8 rows: 4 and 4
    conv = SpectralConv2d(2, 2, (2, 3), mesh=mesh, spec=lay, dtype=F64)
    x = torch.randn(lay.shape, dtype=F64, requires_grad=True)
    calls = []
    orig = torch.einsum

    def einsum(*a):
        calls.append(spmd.axis_index("sp"))
        return orig(*a)

    monkeypatch.setattr(torch, "einsum", einsum)  # counts the layer's mixing, per rank
    with spmd.comm_stats() as stats:
        spmd.shard_map(conv, mesh, lay, lay)(x).sum().backward()
    monkeypatch.undo()
    assert sorted(calls) == [0, 0, 1, 1]  # two corners on each rank
    # complex128 (16 B) x 2 channels x 4 rows x the kept columns: into the spectrum a
    # rank sends its rows of the other's columns, out of it the other's rows of its own,
    # so each rank sends 1 + 2 columns' worth (all 8 would be 4 + 4)
    for pass_ in ("forward", "backward"):
        assert stats.calls("fft transpose", pass_=pass_) == 2 * 2  # two transposes, 2 ranks
        for r in (0, 1):
            assert stats.bytes("fft transpose", pass_=pass_, rank=r) == 16 * 2 * 4 * (1 + 2)
    assert stats.calls() == stats.calls("fft transpose")


# -- the FNO --------------------------------------------------------------------------------

def fno_data(shape=(3, 2, 13, 10)):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(shape, generator=g, dtype=F64),
            torch.randn((shape[0], 1) + shape[2:], generator=g, dtype=F64))


@pytest.mark.parametrize("how", ["module", "convert"])
def test_fno_trains_like_one_device(how):
    """3 Adam steps of an FNO whose H is split unevenly over 4 threads ranks (``mesh=``, or
    ``convert`` with the spectral layers swapped): losses and parameters as one device's."""
    mesh = Mesh((4,), ("sp",))
    x, t = fno_data()
    lay = Layout(x.shape, P(None, None, "sp"), mesh, {2: [5, 1, 0, 7]})
    tlay = Layout(t.shape, lay.spec, mesh, {2: lay.sizes[2]})
    torch.manual_seed(0)
    one = FNO(2, 1, modes=(4, 3), width=6, hidden=8, dtype=F64)
    if how == "module":
        sharded = FNO(2, 1, modes=(4, 3), width=6, hidden=8, mesh=mesh, spec=lay, dtype=F64)
        sharded.load_state_dict(one.state_dict())
    else:
        sharded = spmd.nn.convert(one, mesh, lay.spec, types={SpectralConv2d: SpectralConv2d})
    n = t.numel()
    body = lambda x, t: spmd.psum(((sharded(x) - t) ** 2).sum(), "sp") / n  # noqa: E731
    loss = spmd.shard_map(body, mesh, (lay, tlay), P())
    got = adam_steps(sharded, lambda: loss(x, t))
    want = adam_steps(one, lambda: ((one(x) - t) ** 2).mean())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=1e-9)
    assert got[-1] < got[0]
    for (k, a), b in zip(sharded.state_dict().items(), one.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=k)


def _gloo_case(mesh):
    """On each gloo process: the layer against one device (uneven), then an FNO trained
    3 steps through shard_map (parameters named: their gradients are summed over 'sp')."""
    check_layer(mesh, Layout((2, 2, 7, 6), P(None, None, "sp"), mesh, {2: [6, 1]}), (3, 4))
    x, t = fno_data((2, 1, 9, 8))
    torch.manual_seed(0)
    one = FNO(1, 1, modes=3, width=4, hidden=4, dtype=F64)
    sharded = copy.deepcopy(one)
    for m in sharded.spectral:
        m.mesh, m.spec = mesh, P(None, None, "sp")
    n = t.numel()
    s = P(None, None, "sp")
    loss = spmd.shard_map(lambda x, t: spmd.psum(((sharded(x) - t) ** 2).sum(), "sp") / n,
                          mesh, (s, s), P(), params=list(sharded.parameters()))
    got = adam_steps(sharded, lambda: loss(x, t))
    want = adam_steps(one, lambda: ((one(x) - t) ** 2).mean())
    diff = max((a - b).abs().max().item() for a, b in zip(sharded.parameters(),
                                                          one.parameters()))
    return max(abs(a - b) for a, b in zip(got, want)) < 1e-9 and diff < 1e-9


@pytest.mark.gloo
def test_layer_and_fno_on_gloo_world_2(gloo2):
    assert gloo2.run(_gloo_case, (2,), ("sp",)) == [True, True]


# -- errors ---------------------------------------------------------------------------------

def test_errors():
    mesh = Mesh((2,), ("sp",))
    s = P(None, None, "sp")
    with pytest.raises(spmd.SpecError, match="splits the channels"):
        SpectralConv2d(2, 2, 3, mesh=mesh, spec=P(None, "sp"))
    with pytest.raises(ValueError, match="modes must be"):
        SpectralConv2d(2, 2, (3,))
    with pytest.raises(TypeError, match="pass spec="):
        SpectralConv2d(2, 2, 3, mesh=mesh)
    conv = SpectralConv2d(2, 2, (3, 4), mesh=mesh, spec=s)
    cases = [
        (torch.randn(1, 3, 8, 8), "expected 2 input channels"),
        (torch.randn(2, 8, 8), "expected a 4-d tensor"),
        (torch.randn(1, 2, 8, 5), "modes 4 on spatial dim 1 .* exceeds the 3 frequencies"),
        (torch.randn(1, 2, 2, 8), "modes 3 on spatial dim 0 .* exceeds the 2"),
    ]
    for x, msg in cases:
        with pytest.raises(spmd.SpecError, match=msg):
            spmd.shard_map(conv, mesh, s, s)(x)
        with pytest.raises(spmd.SpecError, match=msg):
            SpectralConv2d(2, 2, (3, 4))(x)  # one device: the same words
    lay = Layout((1, 2, 8, 8), P(None, "sp"), mesh)
    with pytest.raises(spmd.SpecError, match="splits the channels"):
        SpectralConv2d(2, 2, 3, mesh=mesh, spec=lay)
    with pytest.raises(spmd.SpecError, match="splits the channels"):
        SpectralConv2d.from_torch(SpectralConv2d(2, 2, 3), mesh, P(None, ("sp",)))
    with pytest.raises(spmd.SpecError, match="more than two|pencil"):  # spmd.fft's refusal
        m3 = Mesh((2, 2, 2), ("a", "b", "c"))
        s3 = P(None, None, "a", "b", "c")
        conv3 = SpectralConv3d(1, 1, 1, mesh=m3, spec=s3)
        spmd.shard_map(conv3, m3, s3, s3)(torch.randn(1, 1, 4, 4, 4))
