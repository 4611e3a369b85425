"""to_dtensor / from_dtensor: spmd layouts <-> DTensor placements, checked against what
DTensor itself makes (distribute_tensor, full_tensor) on gloo processes."""
from __future__ import annotations

import pytest
import torch

import spmd
from spmd import Layout, Mesh, P, Sharded, SpecError
from spmd.checkpoint.dtensor import _chunk_sizes, _dtensor_sizes, from_dtensor, to_dtensor

F64 = torch.float64


# -- sizes: DTensor's rule, without processes -------------------------------------------------

def _nested_chunk(n: int, counts) -> list[int]:
    """Shard sizes by cutting arange(n) with torch.chunk over each count in turn, each cut
    padded with empty pieces to its count (what DTensor's Shard does); the pieces must
    tile arange(n) in order."""
    pieces = [torch.arange(n)]
    for k in counts:
        nxt = []
        for t in pieces:
            got = list(torch.chunk(t, k)) if t.numel() else []
            nxt += got + [t[:0]] * (k - len(got))
        pieces = nxt
    assert torch.equal(torch.cat(pieces), torch.arange(n))
    return [t.numel() for t in pieces]


@pytest.mark.parametrize("counts", [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (1, 4),
                                    (2, 1, 2)])
def test_sizes_are_torch_chunk_of_torch_chunk(counts):
    for n in range(14):
        assert list(_dtensor_sizes(n, counts)) == _nested_chunk(n, counts), n
    assert _chunk_sizes(10, 4) == (3, 3, 3, 1) and _chunk_sizes(3, 4) == (1, 1, 1, 0)
    assert _dtensor_sizes(10, (2, 2)) == (3, 2, 3, 2)  # not chunk(10, 4) = [3, 3, 3, 1]


def test_threads_mesh_is_refused_with_what_to_do():
    mesh = Mesh((2,), ("sp",), backend="threads")
    s = Sharded.from_global(torch.arange(4.0), mesh, P("sp"))
    with pytest.raises(SpecError, match=r"needs a torch.distributed process group.*"
                                        r"backend='gloo'.*spmd.gather\(x, mesh\)"):
        to_dtensor(s)
    with pytest.raises(SpecError, match="needs a torch.distributed process group"):
        to_dtensor(torch.zeros(2), Layout((4,), P("sp"), mesh), mesh=mesh)


def test_from_dtensor_wants_a_dtensor():
    with pytest.raises(TypeError, match="expected a DTensor, got f32\\[3\\]"):
        from_dtensor(torch.zeros(3))


# -- world 2 -----------------------------------------------------------------------------------

def _round_trip(mesh, shape, spec, sizes):
    from torch.distributed.tensor import Shard, distribute_tensor
    x = torch.arange(float(torch.Size(shape).numel()), dtype=F64).view(shape)
    lay = Layout(shape, spec, mesh, sizes)
    s = Sharded.from_global(x, mesh, lay)
    dt = to_dtensor(s)
    dm = dt.device_mesh
    back = from_dtensor(dt, mesh)
    again = from_dtensor(dt)  # the mesh to_dtensor took it from
    d = lay.split_dims[0]
    made = distribute_tensor(x, dm, [Shard(d)])  # DTensor's own cut of x
    theirs = from_dtensor(made, mesh)
    return {
        "placements": dt.placements == (Shard(d),),
        "names": dm.mesh_dim_names == ("sp",),
        "shape": tuple(dt.shape) == shape,
        "local": dt.to_local().tolist() == s.local.tolist(),
        "full": torch.equal(dt.full_tensor(), x),
        "gather": torch.equal(spmd.gather(s, mesh, dst=None), x),
        "same device mesh": to_dtensor(s).device_mesh is dm,
        "local form": torch.equal(to_dtensor(s.local, lay).full_tensor(), x),
        "back": back.layout == lay and back.mesh is mesh and torch.equal(back.local, s.local),
        "again": again.mesh is mesh and again.layout == lay,
        "dtensor's cut": torch.equal(made.to_local(), s.local),
        "from distribute_tensor": theirs.layout == lay and torch.equal(theirs.local, s.local),
    }


@pytest.mark.gloo
@pytest.mark.parametrize("shape, spec, sizes", [
    ((6, 3), P("sp"), None),              # even
    ((5, 3), P("sp"), None),              # uneven: [3, 2] by both rules
    ((1, 3), P("sp"), None),              # an empty shard: [1, 0]
    ((2, 5), P(None, "sp"), None),        # the last dim, [3, 2]
    ((0, 2), P("sp"), None),              # nothing at all: [0, 0]
], ids=["even", "uneven", "empty-shard", "dim1", "empty"])
def test_round_trip_and_dtensors_own_cut_on_world_2(gloo2, shape, spec, sizes):
    for got in gloo2.run(_round_trip, (2,), ("sp",), args=(shape, spec, sizes)):
        assert all(got.values()), got


def _refusals(mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    out = {}
    x = torch.arange(5.0)
    s = Sharded.from_global(x, mesh, Layout((5,), P("sp"), mesh, sizes={0: [2, 3]}))
    try:
        to_dtensor(s)
    except SpecError as e:
        out["sizes"] = str(e)
    # The advice works: re-cut to DTensor's sizes, then convert.
    fixed = spmd.redistribute(s, mesh, P("sp"))
    out["fixed"] = torch.equal(to_dtensor(fixed).full_tensor(), x)
    dm = to_dtensor(fixed).device_mesh
    local = torch.ones(3 - mesh.rank)
    for name, pl in [("partial", Partial()), ("strided", _StridedShard(0, split_factor=2))]:
        try:
            from_dtensor(DTensor.from_local(local, dm, [pl], run_check=False,
                                            shape=torch.Size([5]), stride=(1,)))
        except SpecError as e:
            out[name] = str(e)
    try:
        from_dtensor(distribute_tensor(x, dm, [Replicate()]), Mesh((2,), ("tp",)))
    except SpecError as e:
        out["mesh"] = str(e)
    try:
        to_dtensor(x[:3], Layout((5,), P("sp"), mesh), mesh=mesh)  # rank 1's shard is 2 long
    except SpecError as e:
        out["shard"] = str(e)
    # Shard(-1) of a 2-d tensor is dim 1.
    neg = distribute_tensor(torch.arange(10.0).view(2, 5), dm, [Shard(-1)])
    got = from_dtensor(neg, mesh)
    out["negative"] = got.spec == P(None, "sp") and got.layout.sizes[1] == (3, 2)
    return out


@pytest.mark.gloo
def test_what_has_no_dtensor_or_spmd_form_is_refused_on_every_rank(gloo2):
    for r, got in enumerate(gloo2.run(_refusals, (2,), ("sp",))):
        assert got["sizes"] == (
            "to_dtensor: DTensor cuts a dim of size n over k shards the torch.chunk way "
            "(ceil(n/k) each, the last ones smaller or empty; over several mesh dims, each "
            "cut in turn), and this layout's shards have other sizes: dim 0 over axis 'sp': "
            "spmd has [2, 3], DTensor needs [3, 2]; re-cut it first with "
            "spmd.redistribute(x, mesh, P('sp')), or build it with Layout((5,), P('sp'), mesh)")
        assert got["fixed"] and got["negative"]
        assert "Partial(sum) on mesh dim 0 ('sp')" in got["partial"]
        assert "dt.redistribute(dt.device_mesh, [Replicate()])" in got["partial"]
        assert "full_tensor()" in got["partial"]
        assert "_StridedShard(dim=0, sf=2) on mesh dim 0 ('sp')" in got["strided"]
        assert "spmd takes Shard(d) and Replicate()" in got["strided"]
        assert "DeviceMesh is (sp=2) but the mesh given is Mesh(tp=2" in got["mesh"]
        if r == 1:
            assert "dim 0 of the shard has size 3 on rank 1 but the layout expects 2" in \
                got["shard"]


def _gradients(mesh):
    from torch.distributed.tensor import DTensor, Shard
    lay = Layout((5, 2), P("sp"), mesh)  # [3, 2]
    w = torch.arange(10.0, dtype=F64).view(5, 2)
    leaf = torch.ones(lay.local_shape(mesh.rank), dtype=F64, requires_grad=True)
    dt = to_dtensor(Sharded.from_local(leaf, mesh, lay))
    (dt.full_tensor() * w).sum().backward()
    # back from DTensor: to_local keeps the graph too
    leaf2 = torch.ones(lay.local_shape(mesh.rank), dtype=F64, requires_grad=True)
    dt2 = DTensor.from_local(leaf2, dt.device_mesh, [Shard(0)], run_check=False,
                             shape=torch.Size([5, 2]), stride=(2, 1))
    (from_dtensor(dt2, mesh).local * 3).sum().backward()
    return (torch.equal(leaf.grad, w[lay.slices(mesh.rank)]),
            torch.equal(leaf2.grad, torch.full_like(leaf2, 3.0)))


@pytest.mark.gloo
def test_gradients_flow_through_both_directions(gloo2):
    for got in gloo2.run(_gradients, (2,), ("sp",)):
        assert got == (True, True)


def _foreign_device_mesh(mesh):
    """A DeviceMesh spmd did not make: from_dtensor makes one Mesh for it, and to_dtensor
    on that Mesh uses it again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dm = init_device_mesh(mesh.device.type, (2,), mesh_dim_names=("tp",))
    x = torch.arange(6.0)
    a = from_dtensor(distribute_tensor(x, dm, [Shard(0)]))
    b = from_dtensor(distribute_tensor(x * 2, dm, [Shard(0)]))
    out = {"one mesh": a.mesh is b.mesh and a.mesh is not mesh,
           "named": a.mesh.axis_names == ("tp",) and a.mesh.backend == "torch",
           "reused": to_dtensor(a).device_mesh is dm}
    with b.mesh:  # spmd's collectives run on the mesh in context
        out["spmd works on it"] = torch.equal(spmd.gather(b, b.mesh, dst=None), x * 2)
    unnamed = init_device_mesh(mesh.device.type, (2,))
    dt = distribute_tensor(x, unnamed, [Shard(0)])
    try:
        from_dtensor(dt)
    except SpecError as e:
        out["unnamed"] = str(e)
    out["unnamed, mesh given"] = from_dtensor(dt, mesh).spec == P("sp")
    return out


@pytest.mark.gloo
def test_a_device_mesh_spmd_did_not_make(gloo2):
    for got in gloo2.run(_foreign_device_mesh, (2,), ("sp",)):
        assert "has no mesh_dim_names" in got.pop("unnamed")
        assert all(got.values()), got


# -- world 4: a (2, 2) mesh ---------------------------------------------------------------------

def _two_d(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    out = {}
    rank = mesh.rank

    def check(name, x, spec, placements, sizes=None):
        s = Sharded.from_global(x, mesh, Layout(x.shape, spec, mesh, sizes))
        dt = to_dtensor(s)
        made = distribute_tensor(x, dt.device_mesh, placements)
        theirs = from_dtensor(made, mesh)
        out[name] = {
            "placements": dt.placements == tuple(placements),
            "local": torch.equal(dt.to_local(), made.to_local()),
            "full": torch.equal(dt.full_tensor(), x),
            "back": from_dtensor(dt, mesh).layout == s.layout,
            "theirs": theirs.layout == s.layout and torch.equal(theirs.local,
                                                                x[s.layout.slices(rank)]),
        }

    ss, r = [Shard(0), Shard(0)], Replicate()
    check("3 over (dp, sp)", torch.arange(3.0), P(("dp", "sp")), ss)  # [1, 1, 1, 0]
    check("10 over (dp, sp) at DTensor's sizes", torch.arange(10.0), P(("dp", "sp")), ss,
          {0: [3, 2, 3, 2]})
    check("replicated over dp", torch.arange(10.0).view(5, 2), P("sp"), [r, Shard(0)])
    check("replicated over sp", torch.arange(10.0).view(2, 5), P(None, "dp"), [Shard(1), r])
    check("both dims", torch.arange(15.0).view(3, 5), P("dp", "sp"), [Shard(0), Shard(1)])
    check("dims swapped", torch.arange(15.0).view(3, 5), P("sp", "dp"), [Shard(1), Shard(0)])
    x = torch.arange(10.0)
    for name, spec in [("balanced", P(("dp", "sp"))), ("order", P(("sp", "dp")))]:
        try:
            to_dtensor(Sharded.from_global(x, mesh, spec))
        except SpecError as e:
            out[name] = str(e)
    # DTensor's own 10 over (dp, sp) reads as P(("dp", "sp")) at [3, 2, 3, 2].
    lay = from_dtensor(distribute_tensor(x, to_dtensor(
        Sharded.from_global(x, mesh, P("dp"))).device_mesh, ss), mesh).layout
    out["theirs 10"] = (lay.spec, lay.sizes)
    # Gradient through a value replicated over dp: each copy gets its block's gradient.
    leaf = torch.ones(Layout((5,), P("sp"), mesh).local_shape(rank), requires_grad=True)
    (to_dtensor(Sharded.from_local(leaf, mesh, Layout((5,), P("sp"), mesh))).full_tensor()
     * torch.arange(5.0)).sum().backward()
    out["grad"] = leaf.grad.tolist()
    return out


@pytest.mark.gloo
def test_two_d_mesh_tuple_splits_and_replicated_axes_on_world_4(gloo4):
    got = gloo4.run(_two_d, (2, 2), ("dp", "sp"))
    for r, g in enumerate(got):
        for name in ("3 over (dp, sp)", "10 over (dp, sp) at DTensor's sizes",
                     "replicated over dp", "replicated over sp", "both dims", "dims swapped"):
            assert all(g[name].values()), (r, name, g[name])
        assert ("dim 0 over axes ('dp', 'sp'): spmd has [3, 3, 2, 2], DTensor needs "
                "[3, 2, 3, 2]; re-cut it first with spmd.redistribute(x, mesh, "
                "P(('dp', 'sp')), dst_sizes={0: [3, 2, 3, 2]})") in g["balanced"]
        assert g["order"] == (
            "to_dtensor: dim 0 is split over axes ('sp', 'dp'), 'sp' major, but DTensor "
            "splits a dim over several mesh dims in the mesh's order (dp=2, sp=2), so "
            "('dp', 'sp') major; re-lay it first: spmd.redistribute(x, mesh, "
            "P(('dp', 'sp')), dst_sizes={0: [3, 2, 3, 2]})")
        assert g["theirs 10"] == (P(("dp", "sp")), ((3, 2, 3, 2),))
        assert g["grad"] == [[0.0, 1.0, 2.0], [3.0, 4.0]][r % 2]
