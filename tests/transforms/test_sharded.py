"""``spmd.Sharded``: building one (from a local shard, a global tensor, a loader), what it
shows, and ``gather``/``redistribute``/``visualize`` taking it, in the global view of a
threads mesh and in per-rank code. Values are compared exactly (only copies move)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd
from spmd import Layout, P, Sharded, SpecError


def _field(shape=(10, 6), dtype=torch.float64):
    return torch.arange(float(np.prod(shape)), dtype=dtype).view(shape)


def test_from_global_holds_views_of_every_rank_shard_in_the_global_view():
    mesh = spmd.Mesh((4,), ("sp",))
    x = _field()
    s = Sharded.from_global(x, mesh, P("sp"))
    assert s.ranks == (0, 1, 2, 3) and s.shape == x.shape and s.dtype == x.dtype
    assert [tuple(t.shape) for t in s.shards.values()] == [(3, 6), (3, 6), (2, 6), (2, 6)]
    assert s.shards[2].data_ptr() == x[6:].data_ptr()  # a view, no copy
    assert repr(s) == "Sharded(f64[10, 6], P('sp'), sp=[3, 3, 2, 2], shards on ranks [0, 1, 2, 3])"
    with pytest.raises(SpecError, match=r"holds the shards of ranks \[0, 1, 2, 3\].*\.shards\[rank\]"):
        _ = s.local
    with pytest.raises(TypeError):
        s.shards[0] = x  # read-only


def _from_local_rank(mesh):
    s = Sharded.from_local(torch.ones(3 - mesh.rank, 2), mesh, P("sp"))
    return repr(s), s.layout.sizes[0], tuple(s.local.shape)


@pytest.mark.parametrize("backend", ["threads"])
def test_from_local_learns_uneven_sizes_with_one_exchange(backend):
    got = spmd.launch(_from_local_rank, (3,), ("sp",), backend=backend)
    assert [g[1] for g in got] == [(3, 2, 1)] * 3
    assert got[1][0] == "Sharded(f32[6, 2], P('sp'), sp=[3, 2, 1], shard of rank 1)"
    assert [g[2] for g in got] == [(3, 2), (2, 2), (1, 2)]


def test_from_local_with_a_layout_checks_the_shard_and_moves_nothing():
    def per_rank(mesh):
        lay = Layout((5, 2), P("sp"), mesh, sizes={0: [4, 1]})
        with spmd.comm_stats() as st:
            s = Sharded.from_local(torch.zeros(lay.local_shape(mesh.rank)), mesh, lay)
        assert st.calls() == 0
        try:
            Sharded.from_local(torch.zeros(3, 2), mesh, lay)
        except SpecError as e:
            return s.layout == lay, str(e)
    got = spmd.launch(per_rank, (2,), ("sp",), backend="threads")
    assert got[0][0] and "dim 0 of the shard has size 3 on rank 0 but the layout expects 4 over " \
        "axis 'sp' (sizes [4, 1]); pass sizes=... or reshard first" in got[0][1]


def test_from_local_outside_per_rank_code_says_what_to_use():
    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(SpecError, match="per-rank code.*Sharded.from_global"):
        Sharded.from_local(torch.zeros(2), mesh, P("sp"))


def test_load_reads_each_rank_block_from_a_memmap(tmp_path):
    x = _field((7, 4), torch.float32)
    path = tmp_path / "field.npy"
    np.save(path, x.numpy())
    field = np.load(path, mmap_mode="r")
    mesh = spmd.Mesh((2, 2), ("a", "b"))
    lay = Layout(field.shape, P("b", "a"), mesh)
    asked = []

    def loader(sl):
        asked.append(sl)
        return field[sl]
    s = Sharded.load(loader, mesh, lay)
    assert asked == [lay.slices(r) for r in range(4)]
    for r, t in s.shards.items():
        assert torch.equal(t, x[lay.slices(r)])
    assert torch.equal(spmd.gather(s, mesh), x)


def test_load_refuses_a_block_of_the_wrong_shape():
    mesh = spmd.Mesh((2,), ("sp",))
    lay = Layout((5, 3), P("sp"), mesh)
    with pytest.raises(SpecError, match=r"returned f32\[2, 3\] for rank 0's block \[0:3, 0:3\], "
                                        r"whose shape is \[3, 3\]"):
        Sharded.load(lambda sl: torch.zeros(2, 3), mesh, lay)


@pytest.mark.parametrize("bad, err, match", [
    (lambda m, lay: Sharded({5: torch.zeros(3)}, lay, m), SpecError, "rank 5 is not a rank"),
    (lambda m, lay: Sharded({0: torch.zeros(4)}, lay, m), SpecError,
     "dim 0 of the shard has size 4 on rank 0 but the layout expects 3"),
    (lambda m, lay: Sharded({0: torch.zeros(3), 1: torch.zeros(3, dtype=torch.float64)}, lay, m),
     SpecError, "different dtypes"),
    (lambda m, lay: Sharded({0: [1, 2, 3]}, lay, m), TypeError, "not a tensor"),
    (lambda m, lay: Sharded({}, lay, m), TypeError, "non-empty"),
    (lambda m, lay: Sharded({0: torch.zeros(3)}, P("sp"), m), TypeError, "must be a spmd.Layout"),
    (lambda m, lay: Sharded({0: torch.zeros(3)}, Layout((6,), P("x"), spmd.Mesh((2,), ("x",))), m),
     SpecError, "is for a mesh {'x': 2}"),
])
def test_constructor_refuses_what_does_not_fit(bad, err, match):
    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(err, match=match):
        bad(mesh, Layout((6,), P("sp"), mesh))


def test_visualize_draws_its_layout():
    mesh = spmd.Mesh((2,), ("sp",))
    s = Sharded.from_global(_field((5, 4), torch.float32), mesh, P("sp"))
    text = str(spmd.visualize(s))
    assert text.startswith("f32[5, 4] P('sp') over Mesh(sp=2)") and "3x4" in text and "2x4" in text


def test_gather_and_redistribute_in_the_global_view_are_differentiable():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    s = Sharded.from_global(x, mesh, P("sp", "dp"))
    t = spmd.redistribute(s, mesh, P(None, ("sp", "dp")))
    assert t.layout == Layout((9, 5), P(None, ("sp", "dp")), mesh)
    for r in range(4):
        assert torch.equal(t.shards[r], x.detach()[t.layout.slices(r)])
    w = torch.randn(9, 5, dtype=torch.float64)
    (spmd.gather(t, mesh) * w).sum().backward()
    torch.testing.assert_close(x.grad, w, rtol=0, atol=0)


def test_gather_and_redistribute_refuse_a_spec_that_does_not_describe_it():
    mesh = spmd.Mesh((2,), ("sp",))
    s = Sharded.from_global(_field(), mesh, P("sp"))
    with pytest.raises(SpecError, match=r"spec P\(None, 'sp'\) does not describe Sharded"):
        spmd.gather(s, mesh, P(None, "sp"))
    with pytest.raises(SpecError, match="does not describe"):
        spmd.redistribute(s, mesh, P(None, "sp"), P())
    with pytest.raises(SpecError, match="another Mesh object"):
        spmd.gather(s, spmd.Mesh((2,), ("sp",)))
    with pytest.raises(TypeError, match="src_spec and dst_spec are both needed"):
        spmd.redistribute(torch.zeros(2), mesh, P("sp"))


def _per_rank_moves(mesh):
    x = _field((7, 6))
    lay = Layout(x.shape, P("sp"), mesh, sizes={0: [5, 0, 2]})
    s = Sharded.from_local(x[lay.slices(mesh.rank)].clone(), mesh, lay)
    with spmd.comm_stats() as st:
        t = spmd.redistribute(s, mesh, P(None, "sp"))
    full = spmd.gather(t, mesh, dst=None)
    on0 = spmd.gather(s, mesh, dst=0)
    return (repr(t), torch.equal(t.local, x[t.layout.slices(mesh.rank)]), torch.equal(full, x),
            type(on0).__name__, st.calls("redistribute sizes"))


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_gather_and_redistribute_in_per_rank_code(backend):
    got = spmd.launch(_per_rank_moves, (3,), ("sp",), backend=backend)
    assert got[0][0].startswith("Sharded(f64[7, 6], P(None, 'sp'), sp=[2, 2, 2], shard of rank 0")
    assert all(g[1] and g[2] for g in got)
    assert [g[3] for g in got] == ["Tensor", "Placeholder", "Placeholder"]
    assert all(g[4] == 0 for g in got)  # the layout is known: no size exchange


def _returns_a_sharded(mesh):
    return Sharded.from_local(torch.full((mesh.rank + 1,), float(mesh.rank)), mesh, P("sp"))


def test_copies_pickles_and_comes_back_from_a_threads_launch():
    import copy
    import pickle
    mesh = spmd.Mesh((2,), ("sp",))
    s = Sharded.from_global(_field((4, 2)), mesh, P("sp"))
    for c in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert c.layout == s.layout and all(torch.equal(c.shards[r], s.shards[r]) for r in (0, 1))
    assert copy.deepcopy(s).mesh is mesh  # a Mesh is not copied
    got = spmd.launch(_returns_a_sharded, (2,), ("sp",), backend="threads")
    assert [g.local.tolist() for g in got] == [[0.0], [1.0, 1.0]]
    assert all(g.layout.sizes[0] == (1, 2) for g in got)


@pytest.mark.gloo
def test_a_sharded_on_processes_says_how_to_send_it():
    with pytest.raises(TypeError, match=r"cannot be pickled: .*whose process groups cannot be "
                                        r"pickled: send its .local and .layout instead"):
        spmd.launch(_returns_a_sharded, (2,), ("sp",), backend="gloo")
