"""redistribute: any layout to any layout, lossless, exact values; gradients through
shard_map equal the single-device identity's; the backward is the adjoint; only the
bytes a rank lacks move."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device, check_adjoint, on_mesh
from spmd.testing import strategies as sst

F64 = torch.float64
MESHES = [((1,), ("a",)), ((2,), ("a",)), ((3,), ("a",)), ((4,), ("a",)),
          ((2, 2), ("a", "b")), ((2, 3), ("a", "b"))]


def specs_2d(names):
    """Every spec of a 2-d tensor over the mesh axes (tuples in both orders)."""
    entries = [None] + list(names) + [t for k in (2,) for t in itertools.permutations(names, k)]
    out = []
    for e0, e1 in itertools.product(entries, repeat=2):
        axes = [a for e in (e0, e1) for a in ((e,) if isinstance(e, str) else (e or ()))]
        if len(axes) == len(set(axes)):
            out.append(P(e0, e1))
    return out


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    mesh = spmd.Mesh(shape, names)
    gshape = (draw(st.integers(0, 7)), draw(st.integers(1, 6)))
    specs = specs_2d(names)
    src, dst = draw(st.sampled_from(specs)), draw(st.sampled_from(specs))
    sizes = []
    for spec in (src, dst):
        probe = spmd.Layout(gshape, spec, mesh)
        if draw(st.booleans()):
            sizes.append({d: draw(sst.split_sizes(gshape[d], len(probe.sizes[d])))
                          for d in probe.split_dims})
        else:
            sizes.append(None)
    return mesh, gshape, src, dst, sizes[0], sizes[1]


@settings(max_examples=80)
@given(case=cases(), pass_src_sizes=st.booleans())
def test_values_exact_and_lossless(case, pass_src_sizes):
    mesh, gshape, src, dst, ssz, dsz = case
    xg = torch.arange(gshape[0] * gshape[1], dtype=F64).reshape(gshape)
    src_lay = spmd.Layout(gshape, src, mesh, ssz)
    dst_lay = spmd.Layout(gshape, dst, mesh, dsz)

    def per_rank(m):
        x = src_lay.shard(xg, m.rank)
        y = spmd.redistribute(x, m, src, dst, src_sizes=ssz if pass_src_sizes else None,
                              dst_sizes=dsz)
        back = spmd.redistribute(y, m, dst, src, src_sizes=dsz, dst_sizes=ssz)
        return y, back

    for r, (y, back) in enumerate(spmd.launch(per_rank, mesh.shape, mesh.axis_names, timeout=20)):
        torch.testing.assert_close(y, dst_lay.shard(xg, r), rtol=0, atol=0)
        torch.testing.assert_close(back, src_lay.shard(xg, r), rtol=0, atol=0)


@settings(max_examples=40)
@given(case=cases())
def test_gradients_through_shard_map_equal_identity(case):
    mesh, gshape, src, dst, ssz, dsz = case
    x = torch.randn(gshape, dtype=F64, generator=torch.Generator().manual_seed(0))
    src_lay = spmd.Layout(gshape, src, mesh, ssz)
    dst_lay = spmd.Layout(gshape, dst, mesh, dsz)
    assert_matches_single_device(
        lambda x: spmd.redistribute(x, mesh, src, dst, src_sizes=ssz, dst_sizes=dsz) * 2,
        lambda x: x * 2, mesh, src_lay, dst_lay, x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("src,dst", [(P("a", "b"), P("b", "a")), (P("a", "b"), P()),
                                     (P(("a", "b")), P(None, ("b", "a"))), (P(), P("a")),
                                     (P("a"), P(None, "b"))])
def test_adjoint(src, dst):
    mesh = spmd.Mesh((2, 3), ("a", "b"))
    lay = spmd.Layout((5, 7), src, mesh)
    check_adjoint(lambda x: spmd.redistribute(x, mesh, src, dst), mesh,
                  lambda r: torch.randn(lay.local_shape(r), dtype=F64,
                                        generator=torch.Generator().manual_seed(r)))


def _bytes(mesh, gshape, src, dst):
    xg = torch.randn(gshape)
    lay = spmd.Layout(gshape, src, mesh)
    with spmd.comm_stats() as s:
        spmd.launch(lambda m: spmd.redistribute(lay.shard(xg, m.rank), m, src, dst),
                    mesh.shape, mesh.axis_names)
    return s


def test_replicate_to_shard_moves_nothing():
    s = _bytes(spmd.Mesh((2, 2), ("a", "b")), (6, 4), P(), P("a", "b"))
    assert s.calls() == 0


def test_shard_to_replicate_moves_what_each_rank_lacks():
    # (S1, S2) -> (R, R) on a (2, 2) mesh, 6x4 float32: each rank lacks 3 of 4 blocks of 3x2.
    s = _bytes(spmd.Mesh((2, 2), ("a", "b")), (6, 4), P("a", "b"), P())
    assert s.bytes("redistribute") == 4 * 3 * (3 * 2 * 4)
    assert s.calls("redistribute") == 4


def test_transpose_of_mesh_axes_moves_each_element_once():
    # (S1, S2) -> (S2, S1): rank (i, j) keeps the block it already has, receives the rest.
    mesh = spmd.Mesh((2, 2), ("a", "b"))
    s = _bytes(mesh, (4, 4), P("a", "b"), P("b", "a"))
    # Ranks (0,0) and (1,1) keep their 2x2 blocks; the two others swap theirs.
    assert s.bytes("redistribute") == 2 * (2 * 2 * 4)


def test_uneven_to_even_moves_only_the_difference():
    mesh = spmd.Mesh((2,), ("a",))
    xg = torch.arange(10.0)
    ssz = {0: [7, 3]}
    lay = spmd.Layout((10,), P("a"), mesh, ssz)
    with spmd.comm_stats() as s:
        out = spmd.launch(lambda m: spmd.redistribute(lay.shard(xg, m.rank), m, P("a"), P("a"),
                                                      src_sizes=ssz), (2,), ("a",))
    assert [o.tolist() for o in out] == [xg[:5].tolist(), xg[5:].tolist()]
    assert s.bytes("redistribute") == 2 * 4  # rows 5 and 6 move from rank 0 to rank 1


def test_errors():
    mesh = spmd.Mesh((2,), ("a",))

    def run(fn):
        return spmd.launch(fn, (2,), ("a",), timeout=10)

    with pytest.raises(spmd.SpecError, match="more entries than x"):
        run(lambda m: spmd.redistribute(torch.ones(2), m, P("a", None), P()))
    with pytest.raises(spmd.SpecError, match="'z' is not an axis"):
        run(lambda m: spmd.redistribute(torch.ones(2), m, P("a"), P("z")))
    with pytest.raises(spmd.SpecError, match="gives no sizes for dim 1"):
        run(lambda m: spmd.redistribute(torch.ones(2, 2), m, P(None, "a"), P(),
                                        src_sizes={0: [2]}))
    with pytest.raises(spmd.SpecError, match=r"dim 0 of x has size 2 on rank \d but the layout expects"):
        run(lambda m: spmd.redistribute(torch.ones(2), m, P("a"), P(), src_sizes={0: [3, 1]}))
    other = spmd.Mesh((2,), ("a",))
    with pytest.raises(spmd.SpecError, match="called with"):
        spmd.shard_map(lambda x: spmd.redistribute(x, other, P("a"), P()), mesh, P("a"), P())(
            torch.ones(4))


@on_mesh(2, "a", backends=("threads", "gloo"))
def test_rows_to_columns_to_replicated_on_threads_and_gloo(mesh):
    xg = torch.arange(35.0, dtype=F64).reshape(7, 5) / 3
    w = torch.arange(35.0, dtype=F64).reshape(7, 5)
    x = spmd.Layout(xg.shape, P("a"), mesh).shard(xg, mesh.rank).clone().requires_grad_()
    y = spmd.redistribute(x, mesh, P("a"), P(None, "a"))
    z = spmd.redistribute(y, mesh, P(None, "a"), P())
    (z * w).sum().backward()
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(y, spmd.Layout(xg.shape, P(None, "a"), mesh).shard(xg, mesh.rank),
                               **exact)
    torch.testing.assert_close(z, xg, **exact)
    # Both ranks backprop their own copy of the loss: the rows get both cotangents.
    torch.testing.assert_close(x.grad, 2 * spmd.Layout(w.shape, P("a"), mesh).shard(w, mesh.rank),
                               **exact)
