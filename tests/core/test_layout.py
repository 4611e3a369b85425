"""spmd.Layout: how a global tensor is cut into shards. Pure arithmetic, no communication."""
import itertools
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spmd import Layout, Mesh, P, SpecError
from spmd.core.layout import balanced_sizes
from spmd.core.spec import entry_axes
from spmd.testing import strategies as sst

# -- balanced_sizes ----------------------------------------------------------------------


def test_balanced_sizes_matches_numpy_exhaustively():
    for n in range(41):
        for k in range(1, 10):
            want = tuple(len(a) for a in np.array_split(np.arange(n), k))
            assert balanced_sizes(n, k) == want, (n, k)


@pytest.mark.parametrize("n, k, want", [
    (10, 4, (3, 3, 2, 2)),
    (3, 4, (1, 1, 1, 0)),
    (2, 4, (1, 1, 0, 0)),
    (257, 8, (33, 32, 32, 32, 32, 32, 32, 32)),
    (0, 3, (0, 0, 0)),
    (8, 4, (2, 2, 2, 2)),
    (5, 1, (5,)),
])
def test_balanced_sizes_named(n, k, want):
    assert balanced_sizes(n, k) == want
    assert sum(want) == n


# -- helpers -----------------------------------------------------------------------------


def _mesh(shape):
    return Mesh(shape, ("x", "y", "z")[: len(shape)], backend="threads")


def check_layout(lay: Layout, mesh: Mesh, given_sizes=None) -> None:
    """Every invariant of a layout, checked by cutting torch.arange and putting it back."""
    shape = lay.shape
    x = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    rebuilt = torch.full(shape, -1, dtype=torch.int64)
    count = torch.zeros(shape, dtype=torch.int64)
    rep_axes = tuple(a for a in mesh.axis_names if a not in lay.spec.axes)
    rep = math.prod(mesh.axis_size(a) for a in rep_axes)
    split = tuple(d for d in range(lay.ndim) if entry_axes(lay.spec.entry(d)))

    # (e) metadata
    assert lay.replicated_axes == rep_axes
    assert lay.split_dims == split
    for d in range(lay.ndim):
        axes = entry_axes(lay.spec.entry(d))
        assert lay.dim_axes(d) == axes
        if not axes:
            assert lay.sizes[d] is None
            continue
        n = mesh.axis_size(axes)
        want = given_sizes.get(d) if given_sizes else None
        want = tuple(want) if want is not None else balanced_sizes(shape[d], n)
        assert lay.sizes[d] == want
    assert lay.is_even == all(len(set(lay.sizes[d])) == 1 for d in split)

    shards = {}
    by_index: dict[tuple, int] = {}
    for r in range(mesh.size):
        s = lay.shard(x, r)
        off = lay.offsets(r)
        # (b) local_shape and slices agree with shard
        assert tuple(s.shape) == lay.local_shape(r)
        assert torch.equal(x[lay.slices(r)], s)
        assert lay.slices(r) == tuple(slice(o, o + n) for o, n in zip(off, s.shape))
        # shard is a view of x, not a copy
        if s.numel():
            assert s.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        lay.size_check(s.shape, r)
        # (a) put it back where it came from
        region = tuple(slice(o, o + n) for o, n in zip(off, s.shape))
        rebuilt[region] = s
        count[region] += 1
        # (d) shard index: linearised over the entry's axes, first major
        idx = []
        for d in range(lay.ndim):
            axes = lay.dim_axes(d)
            if not axes:
                assert lay.shard_index(r, d) == 0
                assert off[d] == 0 and s.shape[d] == shape[d]
                idx.append(0)
                continue
            c = mesh.coords(r)
            sub = [c[mesh.axis_names.index(a)] for a in axes]
            want = int(np.ravel_multi_index(sub, [mesh.axis_size(a) for a in axes]))
            assert lay.shard_index(r, d) == want == mesh.axis_index(axes, r)
            assert off[d] == sum(lay.sizes[d][:want])
            assert s.shape[d] == lay.sizes[d][want]
            idx.append(want)
        shards[r] = s
        by_index.setdefault(tuple(idx), r)
    assert torch.equal(rebuilt, x)
    assert bool((count == rep).all())
    # ranks holding distinct shard indices tile the tensor without overlap
    assert len(by_index) == mesh.size // rep
    tile = torch.zeros(shape, dtype=torch.int64)
    for r in by_index.values():
        tile[lay.slices(r)] += 1
    assert bool((tile == 1).all())
    # (c) ranks differing only in replicated axes hold identical shards
    if rep_axes:
        for r in range(mesh.size):
            for m in mesh.group(rep_axes, r).ranks:
                assert lay.offsets(m) == lay.offsets(r)
                assert torch.equal(shards[m], shards[r])
    # (e) value semantics
    again = Layout(shape, lay.spec, mesh, dict(given_sizes) if given_sizes else None)
    assert again == lay and hash(again) == hash(lay)
    explicit = Layout(shape, lay.spec, mesh, {d: list(lay.sizes[d]) for d in split})
    assert explicit == lay and hash(explicit) == hash(lay)
    back = pickle.loads(pickle.dumps(lay))
    assert back == lay and hash(back) == hash(lay)
    assert repr(back) == repr(lay)
    assert all(back.offsets(r) == lay.offsets(r) for r in range(mesh.size))


def all_specs(ndim, axis_names):
    """Every valid spec of at most ndim entries over axis_names (tuple entries in every
    order), with and without trailing Nones spelled out."""
    out = []
    for assign in itertools.product(range(-1, ndim), repeat=len(axis_names)):
        per_dim = [[a for a, d in zip(axis_names, assign) if d == dim] for dim in range(ndim)]
        choices = []
        for axes in per_dim:
            if not axes:
                choices.append([None])
            elif len(axes) == 1:
                choices.append([axes[0]])
            else:
                choices.append([tuple(p) for p in itertools.permutations(axes)])
        for entries in itertools.product(*choices):
            last = max([i + 1 for i, e in enumerate(entries) if e is not None], default=0)
            out.append(P(*entries[:last]))
            if last < ndim:
                out.append(P(*entries))
    return out


# -- exhaustive small cases --------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (4,), (1, 2), (2, 1), (2, 2), (2, 3),
                                        (3, 2), (3, 3), (2, 4)])
def test_exhaustive(mesh_shape):
    """Every spec, every shape up to 9 (1-d) and 5 or 4 per dim (2-d; 1-d vs 2-d mesh)."""
    mesh = _mesh(mesh_shape)
    for ndim, nmax in ((1, 9), (2, 5 if len(mesh_shape) == 1 else 4)):
        for shape in itertools.product(range(nmax + 1), repeat=ndim):
            for spec in all_specs(ndim, mesh.axis_names):
                check_layout(Layout(shape, spec, mesh), mesh)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2), (1, 3), (2, 1, 2)])
def test_exhaustive_3d_tensor(mesh_shape):
    mesh = _mesh(mesh_shape)
    for shape in itertools.product(range(3 if len(mesh_shape) == 3 else 4), repeat=3):
        for spec in all_specs(3, mesh.axis_names):
            if len(spec) == 3 or not spec:  # the short spellings are covered above
                check_layout(Layout(shape, spec, mesh), mesh)


def test_exhaustive_explicit_sizes_1d():
    """Every partition of n (0..6) into the shards of a 1-d and a 2-d mesh."""
    for mesh_shape, spec in (((3,), P("x")), ((2, 2), P(("y", "x"))), ((2, 2), P("y"))):
        mesh = _mesh(mesh_shape)
        k = mesh.axis_size(spec.axes)
        for n in range(7):
            for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
                b = (0, *cuts, n)
                sizes = [b[i + 1] - b[i] for i in range(k)]
                check_layout(Layout((n, 2), spec, mesh, {0: sizes}), mesh, {0: sizes})


# -- hypothesis: random shapes, meshes, specs, sizes ---------------------------------------


@st.composite
def layouts(draw):
    mesh = draw(sst.meshes(16, axis_names=("x", "y")))
    shape = draw(sst.shapes(range(1, 4), 0, 12))
    spec = draw(sst.specs(mesh, len(shape)))
    # explicit sizes on some split dims, balanced on the others
    probe = Layout(shape, spec, mesh)
    sizes = {d: draw(sst.split_sizes(shape[d], len(probe.sizes[d]))) for d in probe.split_dims
             if draw(st.booleans())}
    as_seq = draw(st.booleans())
    return mesh, shape, spec, sizes, as_seq


@given(layouts())
def test_layout_properties(case):
    mesh, shape, spec, sizes, as_seq = case
    arg = [sizes.get(d) for d in range(len(shape))] if as_seq else (sizes or None)
    lay = Layout(shape, spec, mesh, arg)
    check_layout(lay, mesh, sizes)


@given(layouts())
def test_different_sizes_differ(case):
    mesh, shape, spec, _, _ = case
    lay = Layout(shape, spec, mesh)
    for d in lay.split_dims:
        s = list(lay.sizes[d])
        if len(s) < 2 or s[0] == s[-1]:
            continue
        other = Layout(shape, spec, mesh, {d: s[::-1]})
        assert other != lay
        assert hash(other) != hash(lay)  # not required in general, but true here
        assert not other.is_even


# -- named cases -------------------------------------------------------------------------


def test_docstring_example():
    mesh = Mesh((2, 2), ("dp", "sp"))
    lay = Layout((10, 6), P("sp"), mesh)
    assert (lay.sizes[0], lay.local_shape(rank=1), lay.offsets(rank=1)) == ((5, 5), (5, 6), (5, 0))
    assert lay.replicated_axes == ("dp",)
    assert lay.split_dims == (0,)
    assert lay.is_even
    assert lay.ndim == 2


def test_uneven_named():
    mesh = Mesh(4, "sp")
    lay = Layout((10, 3), P("sp"), mesh)
    assert lay.sizes == ((3, 3, 2, 2), None)
    assert [lay.offsets(r) for r in range(4)] == [(0, 0), (3, 0), (6, 0), (8, 0)]
    assert [lay.local_shape(r) for r in range(4)] == [(3, 3), (3, 3), (2, 3), (2, 3)]
    assert not lay.is_even


def test_tuple_entry_first_axis_major():
    mesh = Mesh((2, 3), ("dp", "sp"))
    lay = Layout((12,), P(("dp", "sp")), mesh)
    assert [lay.shard_index(r, 0) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    lay = Layout((12,), P(("sp", "dp")), mesh)
    assert [lay.shard_index(r, 0) for r in range(6)] == [0, 2, 4, 1, 3, 5]
    assert [lay.offsets(r)[0] for r in range(6)] == [0, 4, 8, 2, 6, 10]


def test_zero_sized_shards():
    mesh = Mesh(4, "sp")
    lay = Layout((3,), P("sp"), mesh, {0: [0, 3, 0, 0]})
    x = torch.arange(3)
    assert [lay.local_shape(r) for r in range(4)] == [(0,), (3,), (0,), (0,)]
    assert torch.equal(lay.shard(x, 1), x)
    assert lay.shard(x, 3).shape == (0,)
    assert lay.offsets(3) == (3,)


def test_fully_replicated():
    mesh = Mesh((2, 2), ("dp", "sp"))
    for spec in (None, P(), P(None, None)):
        lay = Layout((4, 5), spec, mesh)
        assert lay.replicated_axes == ("dp", "sp")
        assert lay.split_dims == ()
        assert lay.is_even
        assert all(lay.local_shape(r) == (4, 5) for r in range(4))
    assert Layout((4, 5), None, mesh) == Layout((4, 5), P(), mesh)


def test_spec_as_plain_tuple():
    mesh = Mesh(2, "sp")
    assert Layout((4, 5), (None, "sp"), mesh) == Layout((4, 5), P(None, "sp"), mesh)


def test_sizes_forms():
    mesh = Mesh((2, 2), ("dp", "sp"))
    a = Layout((5, 7), P("dp", "sp"), mesh, {0: [1, 4], 1: [7, 0]})
    b = Layout((5, 7), P("dp", "sp"), mesh, [[1, 4], [7, 0]])
    c = Layout((5, 7), P("dp", "sp"), mesh, {-2: (1, 4), -1: (7, 0)})
    assert a == b == c
    assert a.sizes == ((1, 4), (7, 0))
    d = Layout((5, 7), P("dp", "sp"), mesh, [None, [7, 0]])
    assert d.sizes == ((3, 2), (7, 0))


def test_sizes_for_unsplit_dim_equal_to_the_dim_is_accepted():
    mesh = Mesh(2, "sp")
    assert Layout((4, 6), P("sp"), mesh, [None, [6]]) == Layout((4, 6), P("sp"), mesh)


def test_repr():
    mesh = Mesh((2, 2), ("dp", "sp"))
    assert repr(Layout((10, 6), P("sp"), Mesh(2, "sp"))) == "Layout([10, 6], P('sp'), sp=[5, 5])"
    assert repr(Layout((3,), None, mesh)) == "Layout([3], P())"
    assert (repr(Layout((10, 5), P("sp", "dp"), mesh))
            == "Layout([10, 5], P('sp', 'dp'), sp=[5, 5], dp=[3, 2])")
    assert (repr(Layout((10,), P(("dp", "sp")), mesh))
            == "Layout([10], P(('dp', 'sp')), (dp, sp)=[3, 3, 2, 2])")


def test_equality_and_hash():
    m = Mesh((2, 2), ("dp", "sp"))
    a = Layout((10, 6), P("sp"), m)
    assert a == Layout((10, 6), P("sp"), Mesh((2, 2), ("dp", "sp")))
    assert a == Layout((10, 6), P("sp"), m, {0: [5, 5]})
    assert len({a, Layout((10, 6), P("sp"), m, {0: [5, 5]})}) == 1
    assert a != Layout((10, 6), P("sp"), m, {0: [6, 4]})
    assert a != Layout((10, 6), P("dp"), m)
    assert a != Layout((10, 7), P("sp"), m)
    assert a != Layout((10, 6), P("sp"), Mesh((1, 2), ("dp", "sp")))
    assert a != Layout((10, 6), P("sp"), Mesh((2, 2), ("tp", "sp")))
    assert a != "Layout"
    assert a != (10, 6)


@pytest.mark.parametrize("other", [P("sp", None), P(("sp",)), P(("sp",), None)])
def test_equal_cut_different_spelling_is_equal(other):
    m = Mesh(4, "sp")
    a = Layout((10, 6), P("sp"), m)
    b = Layout((10, 6), other, m)
    assert all(a.slices(r) == b.slices(r) for r in range(4))
    assert a == b and hash(a) == hash(b)


def test_pickle_round_trip():
    mesh = Mesh((2, 3), ("dp", "sp"))
    lay = Layout((7, 5, 4), P(None, ("sp", "dp")), mesh, {1: [1, 0, 2, 0, 1, 1]})
    back = pickle.loads(pickle.dumps(lay))
    assert back == lay
    assert hash(back) == hash(lay)
    assert back.spec == lay.spec and type(back.spec) is P
    assert back.axis_names == ("dp", "sp") and back.mesh_shape == (2, 3)
    assert [back.slices(r) for r in range(6)] == [lay.slices(r) for r in range(6)]


def test_layout_is_immutable_ish():
    lay = Layout((4,), P("sp"), Mesh(2, "sp"))
    with pytest.raises(AttributeError):
        lay.extra = 1  # __slots__


# -- errors ------------------------------------------------------------------------------


def test_spec_longer_than_ndim():
    mesh = Mesh((2, 2), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"P\('dp', None, 'sp'\) has 3 entries .* \[4, 4\] has 2 dims"):
        Layout((4, 4), P("dp", None, "sp"), mesh)


def test_unknown_axis_in_spec():
    mesh = Mesh((2, 2), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"names axis 'tp'.*dp=2, sp=2"):
        Layout((4, 4), P("tp"), mesh)
    with pytest.raises(SpecError, match=r"'tp'"):
        Layout((4, 4), P(None, ("sp", "tp")), mesh)


def test_invalid_spec_type():
    with pytest.raises(SpecError, match=r"spmd.P"):
        Layout((4,), "sp", Mesh(2, "sp"))


def test_sizes_wrong_count():
    mesh = Mesh(4, "sp")
    with pytest.raises(SpecError, match=r"dim 0 has 3 entries but axis 'sp' has 4 shards"):
        Layout((10,), P("sp"), mesh, {0: [4, 3, 3]})
    mesh = Mesh((2, 2), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"dim 1 has 2 entries but axes \('dp', 'sp'\) has 4 shards"):
        Layout((3, 10), P(None, ("dp", "sp")), mesh, {1: [5, 5]})


def test_sizes_not_adding_up():
    mesh = Mesh(4, "sp")
    with pytest.raises(SpecError, match=r"dim 0 has size 10 but the sizes \[3, 3, 3, 3\] "
                                        r"over axis 'sp' add up to 12"):
        Layout((10,), P("sp"), mesh, {0: [3, 3, 3, 3]})
    mesh = Mesh((2, 2), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"dim 1 .* \[1, 1, 1, 1\] over axes \('sp', 'dp'\)"):
        Layout((3, 10), P(None, ("sp", "dp")), mesh, {1: [1, 1, 1, 1]})


def test_negative_sizes():
    mesh = Mesh(2, "sp")
    with pytest.raises(SpecError, match=r"sizes for dim 0 must be non-negative ints, got \[-1, 5\]"):
        Layout((4,), P("sp"), mesh, {0: [-1, 5]})
    with pytest.raises(SpecError, match=r"non-negative ints"):
        Layout((4,), P("sp"), mesh, {0: [2.0, 2.0]})


def test_sizes_for_unsplit_dim():
    mesh = Mesh(2, "sp")
    with pytest.raises(SpecError, match=r"sizes were given for dim 1, which P\('sp'\) does not split"):
        Layout((4, 6), P("sp"), mesh, {1: [3, 3]})


def test_sizes_sequence_wrong_length():
    mesh = Mesh(2, "sp")
    with pytest.raises(SpecError, match=r"sizes has 3 entries for a 2-d tensor.*one entry per dim"):
        Layout((4, 6), P("sp"), mesh, [[2, 2], None, None])


def test_sizes_bad_dim_key():
    mesh = Mesh(2, "sp")
    with pytest.raises(SpecError, match=r"sizes names dim 2, but the tensor has 2 dims"):
        Layout((4, 6), P("sp"), mesh, {2: [2, 2]})
    with pytest.raises(SpecError, match=r"dict"):
        Layout((4, 6), P("sp"), mesh, 5)


def test_sizes_flat_list_for_2d_tensor_names_the_dim():
    mesh = Mesh(2, "sp")
    with pytest.raises((SpecError, TypeError), match=r"dim 0"):
        Layout((6, 4), P("sp"), mesh, [4, 2])


def test_negative_global_shape_is_refused():
    with pytest.raises(SpecError):
        Layout((-1,), P("sp"), Mesh(2, "sp"))


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_rank_out_of_range(rank):
    lay = Layout((10,), P("sp"), Mesh(4, "sp"))
    with pytest.raises(SpecError, match=rf"rank {rank}"):
        lay.offsets(rank)


def test_shard_wrong_global_shape():
    lay = Layout((10, 6), P("sp"), Mesh(2, "sp"))
    with pytest.raises(SpecError, match=r"the tensor is \[10, 5\] but the layout is for \[10, 6\]"):
        lay.shard(torch.zeros(10, 5), 0)
    with pytest.raises(SpecError, match=r"\[10\] but the layout is for \[10, 6\]"):
        lay.shard(torch.zeros(10), 0)


def test_size_check_message():
    lay = Layout((10, 6), P("sp"), Mesh(4, "sp"))
    lay.size_check((3, 6), 1)  # fine
    msg = ("dim 0 of x has size 5 on rank 1 but the layout expects 3 over axis 'sp' "
           "(sizes [3, 3, 2, 2]); pass sizes=... or reshard first")
    with pytest.raises(SpecError) as e:
        lay.size_check((5, 6), 1)
    assert str(e.value) == msg


def test_size_check_unsplit_dim_and_ndim():
    mesh = Mesh((2, 2), ("dp", "sp"))
    lay = Layout((10, 6), P(("dp", "sp")), mesh)
    with pytest.raises(SpecError, match=r"^dim 1 of w has size 5 on rank 2 but the layout expects 6; pass"):
        lay.size_check((2, 5), 2, what="w")
    with pytest.raises(SpecError, match=r"over axes \('dp', 'sp'\) \(sizes \[3, 3, 2, 2\]\)"):
        lay.size_check((3, 6), 2)
    with pytest.raises(SpecError, match=r"x is \[3\] on rank 0 but the layout expects 2 dims \(\[3, 6\]\)"):
        lay.size_check((3,), 0)
