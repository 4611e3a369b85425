"""halo_pad: each rank's result is its slice of F.pad on the global tensor, in value and
gradient, for every mode, uneven and empty shards, and halos wider than a shard.

Float64 and exact equality: halo_pad only moves and copies data, and its backward adds
the same terms as autograd through F.pad (duplicates from replicate/reflect included),
so a tolerance of 1e-12 is used only for gradients, where additions may be reordered.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd import P
from spmd.testing import check_adjoint, on_mesh

F64 = torch.float64
MODES = ["constant", "reflect", "replicate", "circular"]


def ref_pad(x: torch.Tensor, dim: int, lo: int, hi: int, mode: str, value: float) -> torch.Tensor:
    """F.pad along one dim of any tensor (F.pad wants (batch, channels, W) for modes)."""
    if mode == "constant":
        pad = [0, 0] * (x.ndim - 1 - dim) + [lo, hi]
        return F.pad(x, pad, value=value)
    if lo == hi == 0:
        return x.clone()
    y = x.movedim(dim, -1)
    shape = y.shape
    out = F.pad(y.reshape(1, shape[:-1].numel(), shape[-1]), (lo, hi), mode=mode)
    return out.reshape(*shape[:-1], out.shape[-1]).movedim(-1, dim)


def valid(n: int, lo: int, hi: int, mode: str) -> bool:
    w = max(lo, hi)
    if mode == "reflect":
        return w <= n - 1 or w == 0
    if mode == "circular":
        return w <= n and (n > 0 or w == 0)
    if mode == "replicate":
        return n > 0 or w == 0
    return True


def run_halo(sizes, lo, hi, mode, value=0.5, dim=0, cols=3, seed=0):
    """Per-rank halo_pad of the shards of a global tensor, its value and input gradient
    for a random cotangent, and the single-device reference."""
    k = len(sizes)
    n = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    shape = [n, cols] if dim == 0 else [cols, n]
    xg = torch.randn(shape, dtype=F64, generator=g)
    mesh_sizes = {dim: list(sizes)}
    ws = [torch.randn(*(s if d != dim else sizes[r] + lo + hi for d, s in enumerate(shape)),
                      dtype=F64, generator=g) for r in range(k)]

    def per_rank(mesh):
        lay = spmd.Layout(xg.shape, P(*(["sp"] if dim == 0 else [None, "sp"])), mesh, mesh_sizes)
        x = lay.shard(xg, mesh.rank).clone().requires_grad_()
        y = spmd.halo_pad(x, mesh, "sp", dim, (lo, hi), mode=mode, value=value)
        (y * ws[mesh.rank]).sum().backward()
        return y.detach(), x.grad

    out = spmd.launch(per_rank, (k,), ("sp",), timeout=20)
    xr = xg.clone().requires_grad_()
    full = ref_pad(xr, dim, lo, hi, mode, value)
    loss, off = 0.0, 0
    for r in range(k):
        part = full.narrow(dim, off, sizes[r] + lo + hi)
        torch.testing.assert_close(out[r][0], part.detach(), rtol=0, atol=0)
        loss = loss + (part * ws[r]).sum()
        off += sizes[r]
    loss.backward()
    got_grad = torch.cat([o[1] for o in out], dim)
    torch.testing.assert_close(got_grad, xr.grad, rtol=1e-12, atol=1e-12)


sizes_st = st.lists(st.integers(0, 4), min_size=1, max_size=4)


@settings(max_examples=120)
@given(sizes=sizes_st, lo=st.integers(0, 5), hi=st.integers(0, 5), mode=st.sampled_from(MODES),
       dim=st.integers(0, 1), seed=st.integers(0, 1000))
def test_matches_f_pad_any_sizes_modes_and_widths(sizes, lo, hi, mode, dim, seed):
    if not valid(sum(sizes), lo, hi, mode):
        with pytest.raises(spmd.SpecError, match="halo_pad"):
            run_halo(sizes, lo, hi, mode, dim=dim, seed=seed)
        return
    run_halo(sizes, lo, hi, mode, dim=dim, seed=seed)


@pytest.mark.parametrize("mode", MODES)
def test_width_2_on_8_elements_over_8_ranks(mode):
    run_halo([1] * 8, 2, 2, mode)


@pytest.mark.parametrize("mode", MODES)
def test_asymmetric_and_shard_size_one(mode):
    run_halo([1, 3, 1, 2], 3, 1, mode)
    run_halo([2, 1], 0, 2, mode)


def test_circular_wraps_last_to_first():
    run_halo([3, 2, 3], 2, 2, "circular")


def test_reflect_wider_than_edge_shard():
    run_halo([1, 4, 4, 1], 3, 3, "reflect")


def test_empty_shards_get_halos_from_nearest_data():
    run_halo([0, 3, 0, 0, 2], 2, 2, "constant")
    run_halo([0, 3, 0, 0, 2], 1, 1, "replicate")


def test_impossible_reflect_raises_on_every_rank():
    def per_rank(mesh):
        try:
            spmd.halo_pad(torch.ones(2), mesh, "sp", 0, (4, 0), mode="reflect")
        except spmd.SpecError as e:
            return str(e)

    msgs = spmd.launch(per_rank, (2,), ("sp",), timeout=10)
    assert all("width (4, 0) on dim 0 along axis 'sp' (sizes [2, 2]): mode='reflect' needs at most 3" in m for m in msgs), msgs


@pytest.mark.parametrize("mode", MODES)
def test_two_dims_with_corners_on_2d_mesh(mode):
    """Pad dims 0 and 1 split over a (2, 3) mesh at once: corners as F.pad fills them."""
    xg = torch.randn(7, 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    w0, w1 = (2, 1), (1, 3)

    def per_rank(mesh):
        lay = spmd.Layout(xg.shape, P("x", "y"), mesh)
        x = lay.shard(xg, mesh.rank)
        y = spmd.halo_pad(x, mesh, ("x", "y"), (0, 1), (w0, w1), mode=mode, value=-1.0)
        return lay.offsets(mesh.rank), y

    if mode == "constant":
        ref = F.pad(xg, (*w1, *w0), value=-1.0)
    else:
        ref = F.pad(xg[None, None], (*w1, *w0), mode=mode)[0, 0]
    for (o0, o1), y in spmd.launch(per_rank, (2, 3), ("x", "y"), timeout=20):
        torch.testing.assert_close(y, ref[o0:o0 + y.shape[0], o1:o1 + y.shape[1]], rtol=0, atol=0)


def test_moves_only_halo_bytes_forward_and_backward():
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(10, 5, requires_grad=True)  # rows [3, 3, 2, 2], float32
    sizes = [3, 3, 2, 2]
    f = spmd.shard_map(lambda x: spmd.halo_pad(x, mesh, "sp", 0, (1, 2), sizes=sizes),
                       mesh, P("sp"), P("sp"))
    with spmd.comm_stats() as s:
        f(x).sum().backward()
    row = 5 * 4
    # Interior halos: ranks 1..3 get 1 row from below, ranks 0..2 get 2 rows from above.
    assert s.bytes("halo_pad", pass_="forward") == (3 * 1 + 3 * 2) * row
    assert s.bytes("halo_pad", pass_="backward") == (3 * 1 + 3 * 2) * row
    assert s.calls(pass_="forward") == 4 and s.calls(pass_="backward") == 4


def test_halo_wider_than_neighbour_comes_from_further_ranks():
    """Width 3 on shards of 1: the halo spans three ranks (multi-hop); bytes still exact."""
    mesh = spmd.Mesh((6,), ("sp",))
    f = spmd.shard_map(lambda x: spmd.halo_pad(x, mesh, "sp", 0, (3, 0)), mesh, P("sp"), P("sp"))
    with spmd.comm_stats() as s:
        y = f(torch.arange(6.0))
    assert y.view(6, 4).tolist()[5] == [2.0, 3.0, 4.0, 5.0]
    assert s.bytes("halo_pad") == (0 + 1 + 2 + 3 + 3 + 3) * 4


@pytest.mark.parametrize("mode", MODES)
def test_adjoint_dot_product(mode):
    """<T x, y> == <x, T* y> in float64, T* through autograd (spmd.testing)."""
    mesh = spmd.Mesh((3,), ("sp",))
    sizes = [2, 1, 3]
    check_adjoint(lambda x: spmd.halo_pad(x, mesh, "sp", 0, (1, 2), mode=mode, sizes=sizes),
                  mesh, lambda r: torch.randn(sizes[r], 2, dtype=F64,
                                              generator=torch.Generator().manual_seed(r)))


def test_halo_trim_inverts_pad():
    mesh = spmd.Mesh((3,), ("sp",))
    x = torch.randn(7, 2, dtype=F64)
    f = spmd.shard_map(lambda x: spmd.halo_trim(
        spmd.halo_pad(x, mesh, "sp", 0, (2, 1), mode="reflect"), 0, (2, 1)), mesh, P("sp"), P("sp"))
    torch.testing.assert_close(f(x), x, rtol=0, atol=0)


def test_errors():
    mesh = spmd.Mesh((2,), ("sp",))

    def call(**kw):
        args = dict(axis="sp", dim=0, width=(1, 1))
        args.update(kw)

        def body(x):
            return spmd.halo_pad(x, mesh, args["axis"], args["dim"], args["width"],
                                 **{k: v for k, v in args.items() if k not in ("axis", "dim", "width")})
        return spmd.shard_map(body, mesh, P("sp"), P("sp"))(torch.ones(4))

    with pytest.raises(spmd.SpecError, match="mode must be one of"):
        call(mode="wrap")
    with pytest.raises(spmd.SpecError, match=r"width \(-1, 1\) must be non-negative"):
        call(width=(-1, 1))
    with pytest.raises(spmd.SpecError, match="width must be an int or a pair"):
        call(width=(1, 2, 3))
    with pytest.raises(spmd.SpecError, match="dim=3 is out of range"):
        call(dim=3)
    with pytest.raises(spmd.SpecError, match="'tp' is not an axis"):
        call(axis="tp")
    with pytest.raises(spmd.SpecError, match=r"but sizes=\[3, 1\] says"):
        call(sizes=[3, 1])
    with pytest.raises(spmd.SpecError, match="circular.*would wrap more than once"):
        call(width=(5, 0), mode="circular")
    with pytest.raises(spmd.SpecError, match="with dims"):
        spmd.launch(lambda m: spmd.halo_pad(torch.ones(2, 2), m, "sp", (0, 1), (1, 1)), (2,), "sp")
    other = spmd.Mesh((2,), ("sp",))
    with pytest.raises(spmd.SpecError, match="called with"):
        spmd.shard_map(lambda x: spmd.halo_pad(x, other, "sp", 0, 1), mesh, P("sp"), P("sp"))(
            torch.ones(4))
    with pytest.raises(spmd.SpecError, match="halo_trim: width"):
        spmd.halo_trim(torch.ones(3), 0, (2, 2))


@pytest.mark.parametrize("mode", ["reflect", "circular"])
@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_matches_f_pad_on_threads_and_gloo(mesh, mode):
    xg = torch.arange(14.0, dtype=F64).reshape(7, 2)
    x = spmd.Layout(xg.shape, P("sp"), mesh).shard(xg, mesh.rank).clone().requires_grad_()
    y = spmd.halo_pad(x, mesh, "sp", 0, (3, 2), mode=mode)  # rows [4, 3]
    y.sum().backward()
    xr = xg.clone().requires_grad_()
    full = ref_pad(xr, 0, 3, 2, mode, 0.0)
    parts = [full[0:9], full[4:12]]  # each rank's 4 or 3 rows and the 3 + 2 halo rows
    torch.testing.assert_close(y, parts[mesh.rank].detach(), rtol=0, atol=0)
    sum(p.sum() for p in parts).backward()  # every rank's loss, on one device
    torch.testing.assert_close(x.grad, xr.grad[[0, 4][mesh.rank]:][:x.shape[0]], rtol=0, atol=0)


def test_another_mesh_object_of_the_same_shape_is_refused_with_a_hint():
    other = spmd.Mesh((2,), ("sp",))

    def per_rank(mesh):
        spmd.halo_pad(torch.ones(2), other, "sp", 0, 1)

    with pytest.raises(spmd.SpecError, match="different Mesh objects of the same shape"):
        spmd.launch(per_rank, (2,), ("sp",))
