"""spmd.Mesh: geometry of ranks on a named n-d grid (no communication)."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Mesh, SpecError
from spmd.core.mesh import Group, coords_of

NAMES = ("a", "b", "c", "d")


@st.composite
def meshes(draw, max_dims=4):
    nd = draw(st.integers(1, max_dims))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=nd, max_size=nd)))
    names = tuple(draw(st.permutations(NAMES))[:nd])
    return Mesh(shape, names, backend="threads")


@st.composite
def mesh_and_axes(draw):
    """A mesh and a non-empty ordered subset of its axes (any order)."""
    mesh = draw(meshes())
    k = draw(st.integers(1, len(mesh.shape)))
    axes = tuple(draw(st.permutations(mesh.axis_names))[:k])
    return mesh, axes


# -- construction ------------------------------------------------------------------------


def test_construction_and_attributes():
    m = Mesh((2, 4), ("dp", "sp"))
    assert m.shape == (2, 4)
    assert m.axis_names == ("dp", "sp")
    assert m.size == 8
    assert m.backend == "threads"


def test_repr():
    assert repr(Mesh((2, 4), ("dp", "sp"))) == "Mesh(dp=2, sp=4, backend='threads')"
    assert repr(Mesh(3, "x", backend="threads")) == "Mesh(x=3, backend='threads')"


def test_int_shape_and_str_name():
    m = Mesh(4, "sp")
    assert m.shape == (4,)
    assert m.axis_names == ("sp",)
    assert m.size == 4


def test_list_arguments():
    m = Mesh([2, 3], ["dp", "sp"])
    assert m.shape == (2, 3) and m.axis_names == ("dp", "sp")


def test_default_backend_is_threads_without_process_group():
    import torch.distributed as dist
    assert not (dist.is_available() and dist.is_initialized())
    assert Mesh((2,), ("x",)).backend == "threads"


def test_size_one_axes_allowed():
    m = Mesh((1, 1, 1), ("a", "b", "c"))
    assert m.size == 1
    assert m.coords(0) == (0, 0, 0)
    assert m.group("b", 0).ranks == (0,)


def test_docstring_example():
    mesh = Mesh((2, 4), ("dp", "sp"), backend="threads")
    assert (mesh.coords(5), mesh.rank_of((1, 1)), mesh.axis_size("sp")) == ((1, 1), 5, 4)


# -- rank <-> coords ---------------------------------------------------------------------


@given(meshes())
def test_rank_coords_round_trip(mesh):
    seen = set()
    for r in range(mesh.size):
        c = mesh.coords(r)
        assert len(c) == len(mesh.shape)
        assert all(0 <= ci < s for ci, s in zip(c, mesh.shape))
        assert mesh.rank_of(c) == r
        assert c == tuple(int(v) for v in np.unravel_index(r, mesh.shape))
        assert coords_of(mesh.shape, r) == c
        seen.add(c)
    assert len(seen) == mesh.size


@given(meshes())
def test_rank_of_is_row_major(mesh):
    for c in itertools.product(*(range(s) for s in mesh.shape)):
        assert mesh.rank_of(c) == int(np.ravel_multi_index(c, mesh.shape))
        assert mesh.coords(mesh.rank_of(c)) == c


def test_last_axis_fastest():
    m = Mesh((2, 3), ("dp", "sp"))
    assert [m.coords(r) for r in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


# -- axis_size / axis_index ---------------------------------------------------------------


def test_axis_size():
    m = Mesh((2, 3, 4), ("dp", "x", "y"))
    assert m.axis_size("dp") == 2
    assert m.axis_size("y") == 4
    assert m.axis_size(("x", "y")) == 12
    assert m.axis_size(["y", "dp"]) == 8
    assert m.axis_size(("dp", "x", "y")) == 24


@given(mesh_and_axes())
def test_axis_size_is_product(ma):
    mesh, axes = ma
    want = math.prod(mesh.shape[mesh.axis_names.index(a)] for a in axes)
    assert mesh.axis_size(axes) == want
    if len(axes) == 1:
        assert mesh.axis_size(axes[0]) == want


def test_axis_index_named():
    m = Mesh((2, 3), ("dp", "sp"))
    assert [m.axis_index("dp", r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [m.axis_index("sp", r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    # tuples: the first axis major
    assert [m.axis_index(("dp", "sp"), r) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    assert [m.axis_index(("sp", "dp"), r) for r in range(6)] == [0, 2, 4, 1, 3, 5]


@given(mesh_and_axes())
def test_axis_index_linearised_first_major(ma):
    mesh, axes = ma
    sizes = [mesh.axis_size(a) for a in axes]
    for r in range(mesh.size):
        c = mesh.coords(r)
        sub = tuple(c[mesh.axis_names.index(a)] for a in axes)
        want = int(np.ravel_multi_index(sub, sizes))
        assert mesh.axis_index(axes, r) == want
        assert 0 <= want < mesh.axis_size(axes)
        for a in axes:
            assert mesh.axis_index(a, r) == c[mesh.axis_names.index(a)]


# -- groups ------------------------------------------------------------------------------


def test_group_named_case():
    m = Mesh((2, 4), ("dp", "sp"))
    g = m.group("sp", 5)
    assert isinstance(g, Group)
    assert g.axes == ("sp",)
    assert g.ranks == (4, 5, 6, 7)
    assert g.index == 1
    assert g.size == 4
    assert g.rank == 5
    g = m.group("dp", 6)
    assert g.ranks == (2, 6) and g.index == 1


def test_group_non_ascending_axes_order():
    # axes ('sp', 'dp') on a ('dp', 'sp') mesh: 'sp' is major in the group order.
    m = Mesh((2, 3), ("dp", "sp"))
    g = m.group(("sp", "dp"), 4)
    assert g.axes == ("sp", "dp")
    assert g.ranks == (0, 3, 1, 4, 2, 5)
    assert g.index == 3
    assert g.rank == 4
    g2 = m.group(("dp", "sp"), 4)
    assert g2.ranks == (0, 1, 2, 3, 4, 5)
    assert g2.index == 4


def test_group_accepts_list():
    m = Mesh((2, 2), ("dp", "sp"))
    assert m.group(["sp", "dp"], 0).ranks == (0, 2, 1, 3)


@given(mesh_and_axes())
def test_group_properties(ma):
    mesh, axes = ma
    pos = [mesh.axis_names.index(a) for a in axes]
    others = [p for p in range(len(mesh.shape)) if p not in pos]
    seen: dict[int, tuple[int, ...]] = {}
    for r in range(mesh.size):
        g = mesh.group(axes, r)
        assert g.axes == axes
        assert g.size == mesh.axis_size(axes)
        assert len(set(g.ranks)) == g.size
        assert g.rank == r
        assert g.ranks[g.index] == r
        # the caller's position is its linearised index over the given axes
        assert g.index == mesh.axis_index(axes, r)
        c = mesh.coords(r)
        for i, m in enumerate(g.ranks):
            cm = mesh.coords(m)
            # members share every coordinate outside the group's axes
            assert all(cm[p] == c[p] for p in others)
            # and are ordered by the linearised index over axes (first major)
            assert mesh.axis_index(axes, m) == i
        # every member sees the same group
        for m in g.ranks:
            assert mesh.group(axes, m).ranks == g.ranks
        seen[r] = g.ranks
    # the groups partition all ranks
    distinct = set(seen.values())
    assert sum(len(gr) for gr in distinct) == mesh.size
    assert set().union(*distinct) == set(range(mesh.size))
    assert len(distinct) == mesh.size // mesh.axis_size(axes)


def test_group_is_cached_and_stable():
    m = Mesh((2, 2), ("dp", "sp"))
    assert m.group("sp", 1) is m.group("sp", 1)
    assert m.group("sp", 1) == Group(("sp",), (0, 1), 1)
    # a name, a tuple and a list of names are one group (cached under each spelling)
    assert m.group("sp", 1) is m.group(("sp",), 1) is m.group(["sp"], 1)
    g = m.group(["sp", "dp"], 3)
    assert g is m.group(("sp", "dp"), 3) and (g.size, g.rank) == (4, 3)
    assert repr(g) == "Group(axes=('sp', 'dp'), ranks=(0, 2, 1, 3), index=3, channel='')"


def test_a_channel_is_another_group_of_the_same_ranks():
    m = Mesh((2, 2), ("dp", "sp"))
    g, c = m.group("sp", 1), m.group("sp", 1, channel="grad_sync")
    assert c is m.group("sp", 1, channel="grad_sync") and c != g and hash(c) != hash(g)
    assert (c.axes, c.ranks, c.index, c.channel) == (("sp",), (0, 1), 1, "grad_sync")
    assert g.channel == ""


# -- errors ------------------------------------------------------------------------------


def test_shape_names_length_mismatch():
    with pytest.raises(SpecError, match=r"2 axes but 1 names"):
        Mesh((2, 4), ("dp",))
    with pytest.raises(SpecError, match=r"one name per axis"):
        Mesh((2,), ("dp", "sp"))


def test_repeated_names():
    with pytest.raises(SpecError, match=r"distinct.*'dp', 'dp'"):
        Mesh((2, 2), ("dp", "dp"))


@pytest.mark.parametrize("shape", [(0,), (2, 0), (-1, 2), (2, 1.0), (True, 2)])
def test_non_positive_or_non_int_sizes(shape):
    names = ("a", "b")[: len(shape)]
    with pytest.raises(SpecError, match=r"positive ints"):
        Mesh(shape, names)


@pytest.mark.parametrize("names", [("a", ""), ("a", 1), ("a", None)])
def test_bad_axis_names(names):
    with pytest.raises(SpecError, match=r"non-empty strings"):
        Mesh((2, 2), names)


def test_unknown_axis_in_axis_size():
    m = Mesh((2, 4), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"'tp' is not an axis of .*\['dp', 'sp'\]"):
        m.axis_size("tp")
    with pytest.raises(SpecError, match=r"'tp'.*\['dp', 'sp'\]"):
        m.axis_size(("sp", "tp"))


def test_unknown_axis_in_axis_index():
    m = Mesh((2, 4), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"'tp'.*\['dp', 'sp'\]"):
        m.axis_index("tp", 0)


def test_unknown_axis_in_group():
    m = Mesh((2, 4), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"'tp' is not an axis of Mesh\(dp=2, sp=4.*\['dp', 'sp'\]"):
        m.group("tp", 0)
    with pytest.raises(SpecError, match=r"'tp'.*\['dp', 'sp'\]"):
        m.group(("dp", "tp"), 0)


def test_repeated_axis_in_group():
    m = Mesh((2, 4), ("dp", "sp"))
    with pytest.raises(SpecError, match=r"repeat"):
        m.group(("sp", "sp"), 0)


def test_check_axes():
    m = Mesh((2, 4), ("dp", "sp"))
    assert m.check_axes("sp", "psum") == ("sp",)
    assert m.check_axes(("sp", "dp"), "psum") == ("sp", "dp")
    with pytest.raises(SpecError, match=r"^psum: 'tp' is not an axis of .*\['dp', 'sp'\]"):
        m.check_axes("tp", "psum")
    with pytest.raises(SpecError, match=r"all_gather: .*repeat"):
        m.check_axes(("sp", "sp"), "all_gather")
    with pytest.raises(SpecError, match=r"psum: expected a mesh axis name"):
        m.check_axes(3, "psum")


def test_check_axes_remembers_only_valid_names_and_raises_again():
    m = Mesh((2, 4), ("dp", "sp"))
    for _ in range(2):  # the second time from the cache
        assert m.check_axes("sp", "psum") == ("sp",)
        assert m.check_axes(["dp", "sp"], "psum") == ("dp", "sp")
        with pytest.raises(SpecError, match=r"^pmax: 'tp' is not an axis"):
            m.check_axes("tp", "pmax")
        with pytest.raises(SpecError, match=r"^pmax: axis names \('sp', 'sp'\) repeat"):
            m.check_axes(("sp", "sp"), "pmax")
        with pytest.raises(SpecError, match=r"pmax: expected a mesh axis name"):
            m.check_axes(("sp", ["dp"]), "pmax")
    with pytest.raises(SpecError, match=r"psum: expected a mesh axis name"):
        m.check_axes((), "psum")


def test_unknown_backend():
    with pytest.raises(SpecError, match=r"backend must be one of .*'threads'.*'torch'.*'mpi'"):
        Mesh((2,), ("x",), backend="mpi")


def test_torch_backend_without_process_group():
    with pytest.raises(SpecError, match=r"backend='torch'.*process group.*torchrun.*threads"):
        Mesh((2,), ("x",), backend="torch")


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_coords_rank_out_of_range(rank):
    m = Mesh((2, 4), ("dp", "sp"))
    with pytest.raises(SpecError, match=rf"rank {rank} is outside Mesh\(dp=2, sp=4.*0\.\.7"):
        m.coords(rank)
    with pytest.raises(SpecError, match=rf"rank {rank} is outside"):
        m.axis_index("sp", rank)
    with pytest.raises(SpecError, match=rf"rank {rank} is outside"):
        m.group("sp", rank)


@pytest.mark.parametrize("coords", [(2, 0), (0, 4), (-1, 0), (0,), (0, 0, 0)])
def test_coords_out_of_range(coords):
    m = Mesh((2, 4), ("dp", "sp"))
    pat = r"coordinates \(" + r",\s*".join(str(c) for c in coords) + r",?\) are outside Mesh\(dp=2, sp=4"
    with pytest.raises(SpecError, match=pat):
        m.rank_of(coords)


def test_rank_outside_rank_threads():
    m = Mesh((2,), ("x",))
    with pytest.raises(SpecError, match=r"threads mesh.*shard_map.*launch"):
        m.rank  # noqa: B018
    with pytest.raises(SpecError, match=r"shard_map"):
        m.axis_index("x")
    with pytest.raises(SpecError, match=r"launch"):
        m.group("x")


def test_rank_inside_a_rank_context():
    from spmd.core._context import RankContext
    m = Mesh((2, 2), ("dp", "sp"))
    with RankContext(m, 3):
        assert m.rank == 3
        assert m.axis_index("sp") == 1
        assert m.group("dp").ranks == (1, 3)
    other = Mesh((2, 2), ("dp", "sp"))
    with RankContext(m, 2), pytest.raises(SpecError, match="shard_map"):
        other.rank  # noqa: B018


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1.0, 1e300])
def test_timeouts_that_never_expire_overflow_or_expire_at_once_are_refused(bad):
    """NaN hung every wait, inf and 1e300 overflowed them, 0 and negatives timed out at
    once."""
    with pytest.raises(SpecError, match=r"timeout must be a positive, finite number of seconds"):
        Mesh((2,), ("sp",), timeout=bad)
    with pytest.raises(SpecError, match=r"^launch: timeout must be"):
        spmd.launch(lambda mesh: None, (2,), ("sp",), timeout=bad)
    from spmd.run.processes import ProcessPool
    with pytest.raises(SpecError, match=r"^ProcessPool: timeout must be"):
        ProcessPool(2, timeout=bad)


@pytest.mark.parametrize("bad", ["3", True, None])
def test_a_timeout_must_be_a_number(bad):
    if bad is None:
        assert Mesh((2,), ("sp",), timeout=None).timeout == 300.0  # None: the default
        return
    with pytest.raises(TypeError, match=r"timeout must be a number of seconds, got"):
        Mesh((2,), ("sp",), timeout=bad)
