"""reduce: each rank's result is its slice of torch.sum/mean/amax/amin on the global
tensor, in value and gradient (ties across ranks included), for uneven and empty shards,
tuple-split dims and 2-d meshes; one all-reduce of output size, exactly.

Float64 references. max/min move values without arithmetic, so they are compared
exactly; sums may add in another order, so sum/mean and all gradients use 1e-12.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd import P
from spmd.testing import on_mesh
from spmd.testing import strategies as sst
from spmd.transforms.reduction import reduce

F64 = torch.float64
OPS = ["sum", "mean", "max", "min"]
REF = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}
MESHES = [((1,), ("a",)), ((2,), ("a",)), ((3,), ("a",)), ((4,), ("a",)),
          ((2, 2), ("a", "b")), ((2, 3), ("a", "b"))]


def _norm(dim, ndim):
    if dim is None:
        return tuple(range(ndim))
    ds = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % ndim for d in ds)) or tuple(range(ndim))


def ref_slice(full_keep, lay, rank, dims, keepdim):
    """The part of the (keepdim) global reduction that ``rank`` holds."""
    out = full_keep
    off, shp = lay.offsets(rank), lay.local_shape(rank)
    for d in lay.split_dims:
        if d not in dims:
            out = out.narrow(d, off[d], shp[d])
    if not keepdim:
        for d in sorted(dims, reverse=True):
            out = out.squeeze(d)
    return out


def run_reduce(mesh_shape, names, shape, spec, sizes, op, dim, keepdim, how="none", seed=0,
               ties=False):
    """Per-rank reduce of the shards of a global tensor (value and input gradient for
    random per-rank cotangents) against torch on the global tensor."""
    g = torch.Generator().manual_seed(seed)
    xg = (torch.randint(-2, 3, shape, generator=g).to(F64) if ties
          else torch.randn(shape, dtype=F64, generator=g))
    lay0 = spmd.Layout(shape, spec, spmd.Mesh(mesh_shape, names), sizes)
    dims = _norm(dim, len(shape))
    n_ranks = 1
    for s in mesh_shape:
        n_ranks *= s
    empty = op in ("max", "min") and any(shape[d] == 0 for d in dims)
    if not empty:
        full_keep = REF[op](xg, dim=dims, keepdim=True) if dims else REF[op](xg)
        ws = [torch.randn(ref_slice(full_keep, lay0, r, dims, keepdim).shape, dtype=F64,
                          generator=g) for r in range(n_ranks)]

    def per_rank(mesh):
        lay = spmd.Layout(shape, spec, mesh, sizes)
        x = lay.shard(xg, mesh.rank).clone().requires_grad_()
        kw = {}
        if how == "dict":
            kw["sizes"] = {d: lay.sizes[d] for d in lay.split_dims}
        elif how == "layout":
            kw["sizes"] = lay
        # "spec": the Layout given as the spec (the one spec= convention)
        y = reduce(x, mesh, lay if how == "spec" else spec, op=op, dim=dim, keepdim=keepdim,
                   **kw)
        (y * ws[mesh.rank]).sum().backward()
        return y.detach(), x.grad

    if empty:  # torch.amax raises too; so does every rank, before or in the exchange
        with pytest.raises(spmd.SpecError, match="empty global tensor"):
            spmd.launch(per_rank, mesh_shape, names, timeout=30)
        return
    out = spmd.launch(per_rank, mesh_shape, names, timeout=30)
    exact = op in ("max", "min")
    for r in range(n_ranks):
        want = ref_slice(full_keep, lay0, r, dims, keepdim)
        tol = 0 if exact else 1e-12
        torch.testing.assert_close(out[r][0], want, rtol=tol, atol=tol, equal_nan=True)
    # Gradients (docs/design.md: every rank's output is its own variable): rank r's shard gets
    # the cotangents of the ranks it reduced with, those along the axes of the reduced
    # dims; replicas along other axes are separate copies.
    axes = [a for d in dims for a in lay0.dim_axes(d)]
    mesh0 = spmd.Mesh(mesh_shape, names)
    for r in range(n_ranks):
        xr = xg.clone().requires_grad_()
        full = REF[op](xr, dim=dims, keepdim=True) if dims else REF[op](xr)
        if not full.requires_grad:
            return
        group = mesh0.group(axes, r).ranks if axes else (r,)
        loss = sum((ref_slice(full, lay0, s, dims, keepdim) * ws[s]).sum() for s in group)
        (grad,) = torch.autograd.grad(loss, xr)
        torch.testing.assert_close(out[r][1], lay0.shard(grad, r), rtol=1e-12, atol=1e-12,
                                   equal_nan=True)


@st.composite
def cases(draw):
    mesh_shape, names = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    # Each mesh axis splits one dim or none; a dim split by several axes is tuple-split.
    spec = draw(sst.specs(spmd.Mesh(mesh_shape, names), ndim))
    sizes, shape = {}, []
    for d in range(ndim):
        e = spec.entry(d)
        if e is None:
            shape.append(draw(st.integers(0, 3)) if draw(st.integers(0, 4)) == 0
                         else draw(st.integers(1, 3)))
            continue
        n = 1
        for a in (e,) if isinstance(e, str) else e:
            n *= mesh_shape[names.index(a)]
        s = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        sizes[d] = s
        shape.append(sum(s))
    kind = draw(st.sampled_from(["none", "int", "tuple"]))
    if kind == "none":
        dim = None
    elif kind == "int":
        dim = draw(st.integers(-ndim, ndim - 1))
    else:
        dim = tuple(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim,
                                  unique=True)))
    return dict(mesh_shape=mesh_shape, names=names, shape=tuple(shape), spec=spec, sizes=sizes,
                op=draw(st.sampled_from(OPS)), dim=dim, keepdim=draw(st.booleans()),
                how=draw(st.sampled_from(["none", "dict", "layout", "spec"])),
                seed=draw(st.integers(0, 1000)), ties=draw(st.booleans()))


@settings(max_examples=40)
@given(case=cases())
def test_matches_torch_on_global_tensor(case):
    run_reduce(**case)


@pytest.mark.parametrize("op", ["max", "min"])
def test_ties_across_ranks_with_different_local_counts(op):
    """Rank 0 holds the extremum twice, rank 1 once: torch gives each of them 1/3."""
    v = 5.0 if op == "max" else -5.0
    xg = torch.tensor([[v, 0.0], [v, 1.0], [v, v], [0.0, v]], dtype=F64)
    run_reduce((2,), ("a",), tuple(xg.shape), P("a"), {0: [2, 2]}, op, 0, False)
    run_reduce((2,), ("a",), (6, 3), P("a"), {0: [5, 1]}, op, None, False, ties=True)

    def per_rank(mesh):
        x = spmd.Layout(xg.shape, P("a"), mesh).shard(xg, mesh.rank).clone().requires_grad_()
        reduce(x, mesh, P("a"), op=op, dim=(0, 1)).backward()
        return x.grad

    grads = spmd.launch(per_rank, (2,), ("a",))
    want = torch.zeros_like(xg)
    want[xg == v] = 2 / 5  # two ranks' cotangents of 1, five tied elements
    torch.testing.assert_close(torch.cat(grads), want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("how", ["none", "dict", "layout", "spec"])
def test_mean_of_uneven_and_empty_shards_is_exact(how):
    """Mean over dim 0 of a 3x4 tensor on 2 ranks (rows [2, 1]), and of a
    1x4 tensor (rows [1, 0]: one empty shard), equal torch.mean, not a mean of means."""
    for xg in (torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),
               torch.randn(1, 4, generator=torch.Generator().manual_seed(2))):
        def per_rank(mesh, xg=xg):
            lay = spmd.Layout(xg.shape, P("sp"), mesh)
            kw = {} if how in ("none", "spec") else {
                "sizes": lay if how == "layout" else {0: lay.sizes[0]}}
            return reduce(lay.shard(xg, mesh.rank), mesh, lay if how == "spec" else P("sp"),
                          op="mean", dim=0, **kw)

        for y in spmd.launch(per_rank, (2,), ("sp",)):
            torch.testing.assert_close(y, torch.mean(xg, 0), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("how", ["none", "layout"])
def test_half_precision_mean_sums_in_float32_like_torch(dtype, how):
    """The mean of a float16/bfloat16 shard sums in float32 and rounds once, as torch.mean
    does: before, 70,000 ones per rank overflowed the float16 sum and count (NaN), and a
    bfloat16 count of 301 rounded to 300. Value and gradient as torch's on one device."""
    mesh = spmd.Mesh((2,), ("sp",))
    for n in (301, 70_001):
        xg = torch.ones(2 * n, dtype=dtype)
        xg[::7] = 3
        lay = spmd.Layout(xg.shape, P("sp"), mesh, {0: [n + 1, n - 1]})
        kw = {"sizes": lay} if how == "layout" else {}
        f = spmd.shard_map(lambda x, kw=kw: reduce(x, mesh, P("sp"), op="mean", **kw), mesh,
                           lay, P())
        x, xr = xg.clone().requires_grad_(), xg.clone().requires_grad_()
        y, want = f(x), xr.mean()
        y.backward()
        want.backward()
        assert y.dtype == dtype
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integer_dtypes(op, dtype):
    xg = torch.randint(0, 50, (5, 3), generator=torch.Generator().manual_seed(0)).to(dtype)
    for dim in (0, 1, None):
        def per_rank(mesh, dim=dim):
            lay = spmd.Layout(xg.shape, P("sp"), mesh, {0: [3, 0, 2]})
            return reduce(lay.shard(xg, mesh.rank), mesh, P("sp"), op=op, dim=dim)

        for r, y in enumerate(spmd.launch(per_rank, (3,), ("sp",))):
            want = REF[op](xg) if dim is None else REF[op](xg, dim)
            if dim == 1:
                want = want[[0, 3, 3][r]:[3, 3, 5][r]]  # rows [3, 0, 2]
            assert y.dtype == want.dtype
            assert torch.equal(y, want), (op, dim, r, y, want)


def test_tuple_split_dim_on_2d_mesh_with_shard_map():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    xg = torch.randn(10, 3, dtype=F64)
    run_reduce((2, 2), ("dp", "sp"), (10, 3), P(("dp", "sp")), {0: [4, 3, 3, 0]}, "mean", 0,
               False, how="dict")
    run_reduce((2, 2), ("dp", "sp"), (10, 3), P(("sp", "dp")), {0: [4, 3, 3, 0]}, "max", -2,
               True, ties=True)
    g = spmd.shard_map(lambda x: reduce(x, mesh, P(("dp", "sp")), op="sum", dim=0),
                       mesh, P(("dp", "sp")), P())
    torch.testing.assert_close(g(xg), xg.sum(0), rtol=1e-12, atol=1e-12)


def test_bytes_mean_with_sizes_is_output_size():
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(10, 5, requires_grad=True)  # float32, rows [3, 3, 2, 2]
    for sizes, extra in (({0: [3, 3, 2, 2]}, 0), (None, 1)):
        f = spmd.shard_map(lambda x, sizes=sizes: reduce(x, mesh, P("sp"), op="mean", dim=0,
                                                          sizes=sizes),
                           mesh, P("sp"), P())
        with spmd.comm_stats() as s:
            y = f(x)
            y.sum().backward()
        torch.testing.assert_close(y, x.detach().mean(0))
        assert s.calls(pass_="forward") == 4 and s.calls("reduce", pass_="forward") == 4
        assert s.bytes("reduce", pass_="forward") == 4 * (5 + extra) * 4  # per rank: 5 (+1) f32
        assert s.bytes("reduce", pass_="backward") == 4 * 5 * 4


@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_bytes_max_min_sum(op):
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(10, 5, requires_grad=True)
    f = spmd.shard_map(lambda x: reduce(x, mesh, P("sp"), op=op, dim=0, sizes={0: [3, 3, 2, 2]}),
                       mesh, P("sp"), P())
    with spmd.comm_stats() as s:
        f(x).sum().backward()
    assert s.calls(pass_="forward") == 4 and s.bytes("reduce", pass_="forward") == 4 * 5 * 4
    # backward: sum/mean a psum of the cotangent; max/min tie counts stacked with it
    assert s.bytes("reduce", pass_="backward") == 4 * 5 * 4 * (2 if op != "sum" else 1)


@pytest.mark.parametrize("op", OPS)
def test_no_communication_when_no_reduced_dim_is_split(op):
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = torch.randn(6, 4, dtype=F64, requires_grad=True)
    f = spmd.shard_map(lambda x: reduce(x, mesh, P("sp"), op=op, dim=1, keepdim=True),
                       mesh, P("sp"), P("sp"))
    with spmd.comm_stats() as s:
        y = f(x)
        y.sum().backward()
    assert s.calls() == 0, str(s)
    torch.testing.assert_close(y, REF[op](x.detach(), 1, keepdim=True), rtol=1e-12, atol=1e-12)


def test_errors():
    mesh = spmd.Mesh((2,), ("sp",))

    def call(spec=None, x=None, fresh=False, **kw):
        # fresh: reduce a tensor made in the body, which carries no mark of shard_map's
        # split, so that the rank's own shape check answers (core/provenance.py)
        spec = P("sp") if spec is None else spec
        return spmd.shard_map(lambda x: reduce(x + 0 if fresh else x, mesh, spec, **kw), mesh,
                              P("sp"), P())(torch.ones(4, 2) if x is None else x)

    with pytest.raises(spmd.SpecError, match="op must be one of"):
        call(op="prod")
    with pytest.raises(spmd.SpecError, match="dim=2 is out of range"):
        call(dim=2)
    with pytest.raises(spmd.SpecError, match="dim=-3 is out of range"):
        call(dim=-3)
    with pytest.raises(spmd.SpecError, match=r"dim=\(0, -2\) repeats a dim"):
        call(dim=(0, -2))
    with pytest.raises(spmd.SpecError, match="dim must be an int"):
        call(dim="0")
    with pytest.raises(spmd.SpecError, match="'tp' is not an axis"):
        call(spec=P("tp"))
    with pytest.raises(spmd.SpecError, match="spec .* has 3 entries but x"):
        call(spec=P("sp", None, None))
    with pytest.raises(spmd.SpecError, match=r"but sizes=\[3, 1\] says"):
        call(dim=0, sizes={0: [3, 1]}, fresh=True)
    with pytest.raises(spmd.SpecError, match=r"sizes \{0: \[3, 1\]\} give dim 0 the shard "
                       r"sizes \[3, 1\], but x is a shard_map argument split as \[4, 2\]"):
        call(dim=0, sizes={0: [3, 1]})
    with pytest.raises(spmd.SpecError, match="sizes for dim 0 has 3 entries"):
        call(dim=0, sizes={0: [2, 2, 0]})
    with pytest.raises(spmd.SpecError, match="dim 1, which spec"):
        call(dim=0, sizes={1: [1, 1]})
    with pytest.raises(spmd.SpecError, match="says its shard is"):
        call(dim=0, sizes=spmd.Layout((5, 2), P("sp"), mesh), fresh=True)
    with pytest.raises(spmd.SpecError, match=r"x \(its sizes Layout\) as a shard of \[5, 2\]"):
        call(dim=0, sizes=spmd.Layout((5, 2), P("sp"), mesh))
    with pytest.raises(spmd.SpecError, match="needs a floating-point"):
        call(op="mean", x=torch.ones(4, 2, dtype=torch.int64))
    with pytest.raises(spmd.SpecError, match="needs a real x"):
        call(op="max", x=torch.ones(4, 2, dtype=torch.complex64))
    with pytest.raises(spmd.SpecError, match="empty global tensor"):
        call(op="max", dim=0, x=torch.ones(0, 2))  # sizes unknown: found in the exchange
    with pytest.raises(spmd.SpecError, match="empty global tensor"):
        call(op="min", dim=0, x=torch.ones(0, 2), sizes={0: [0, 0]})
    other = spmd.Mesh((2,), ("sp",))
    with pytest.raises(spmd.SpecError, match="called with"):
        spmd.shard_map(lambda x: reduce(x, other, P("sp")), mesh, P("sp"), P())(torch.ones(4))
    with pytest.raises(spmd.SpecError, match="needs a mesh"):
        reduce(torch.ones(2), mesh, P("sp"))


def test_errors_come_before_any_communication():
    mesh = spmd.Mesh((2,), ("sp",))
    with spmd.comm_stats() as s:
        with pytest.raises(spmd.SpecError):
            spmd.shard_map(lambda x: reduce(x, mesh, P("sp"), dim=0, sizes={0: [3, 1]}),
                           mesh, P("sp"), P())(torch.ones(4))
    assert s.calls() == 0


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("rows", [[2, 1], [3, 0]])
@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_matches_torch_on_threads_and_gloo(mesh, op, rows):
    xg = torch.tensor([[1.0, 4.0], [4.0, 2.0], [4.0, -1.0]], dtype=F64)
    lay = spmd.Layout(xg.shape, P("sp"), mesh, {0: rows})
    x = lay.shard(xg, mesh.rank).clone().requires_grad_()
    y = reduce(x, mesh, P("sp"), op=op)  # ties: 4.0 three times, on both ranks for [2, 1]
    y.backward()
    xr = xg.clone().requires_grad_()
    want = REF[op](xr)
    want.backward()
    torch.testing.assert_close(y, want.detach(), rtol=1e-12, atol=1e-12)
    # Both ranks backprop their copy of y: twice torch's gradient, ties shared as torch does.
    torch.testing.assert_close(x.grad, lay.shard(2 * xr.grad, mesh.rank), rtol=1e-12, atol=1e-12)
