"""spmd.checkpoint.save / load: any layout to any layout, on threads, gloo and one process.

Round trips are bit-exact (``torch.equal``): a checkpoint moves bytes, it computes
nothing. "Reads only its new shard" is checked with ``read_stats``: the tensor bytes a
load reads equal the bytes of the shards it fills (each distinct shard once in a
process holding several ranks).
"""
from __future__ import annotations

import collections
import math
import os

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings

import spmd
import spmd.checkpoint as ck
from spmd import Layout, Mesh, P, Sharded, SpecError
from spmd.testing import strategies as sst


def _distinct_bytes(lay: Layout, ranks, itemsize: int) -> int:
    seen = {}
    for r in ranks:
        seen.setdefault(lay.shard_key(r), math.prod(lay.local_shape(r)))
    return sum(seen.values()) * itemsize


def _chunks(path, key):
    md = dcp.FileSystemReader(ck.latest(path)).read_metadata()
    return md.state_dict_metadata[key]


@st.composite
def _moves(draw):
    """A global tensor saved in one layout on one mesh, loaded in another on another."""
    shape = draw(sst.shapes(range(0, 4), max_side=7))
    src = draw(sst.meshes(max_ranks=4))
    dst = draw(sst.meshes(max_ranks=4))
    return (shape, draw(sst.layouts(shape, src)), draw(sst.layouts(shape, dst)),
            draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.int64,
                                  torch.bool, torch.complex64])),
            draw(st.integers(0, 2**31 - 1)))


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 100
    if dtype.is_complex:
        return torch.complex(x, x.flip(-1) if x.ndim else x).to(dtype)
    return x.to(dtype) if dtype != torch.bool else x > 0


@given(case=_moves())
@settings(deadline=2000)  # each example fsyncs a checkpoint: disk time, not ours (~50 ms here)
def test_any_layout_loads_into_any_other_bit_exact_reading_only_the_new_shards(tmp_path_factory,
                                                                              case):
    shape, src, dst, dtype, seed = case
    path = str(tmp_path_factory.mktemp("ck"))
    x = _tensor(shape, dtype, seed)
    m_src = Mesh(src.mesh_shape, src.axis_names)
    m_dst = Mesh(dst.mesh_shape, dst.axis_names)
    ck.save({"x": Sharded.from_global(x, m_src, src)}, path, m_src)
    # Each element written once: the stored chunks tile the tensor without overlap.
    md = _chunks(path, "x")
    assert sum(math.prod(c.sizes) for c in md.chunks) == (x.numel() or 0)
    with ck.read_stats() as stats:
        got = ck.load({"x": dst}, path, m_dst)["x"]
    assert got.layout == dst and sorted(got.shards) == list(range(m_dst.size))
    for r in range(m_dst.size):
        assert torch.equal(got.shards[r], dst.shard(x, r)), r
    assert stats.payload_bytes == _distinct_bytes(dst, range(m_dst.size), x.element_size())
    assert stats.full_reads == 0


def test_a_whole_state_round_trips_with_its_structure(tmp_path):
    mesh = Mesh((2, 2), ("dp", "sp"))
    u = Sharded.from_global(torch.arange(30.0).view(5, 6), mesh, P("sp", "dp"))
    state = {"u": u, "w": torch.ones(3, dtype=torch.float16), "step": 7,
             "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}],
             "sd": collections.OrderedDict(a=torch.zeros(2), b=None),
             "moments": {0: {"exp_avg": torch.full((2,), 2.0), "step": torch.tensor(3.0)}}}
    ck.save(state, tmp_path, mesh)
    tmpl = {"u": u, "w": torch.empty(3, dtype=torch.float16), "step": 0, "groups": ck.AS_SAVED,
            "sd": ck.AS_SAVED, "moments": ck.AS_SAVED}
    back = ck.load(tmpl, tmp_path, mesh)
    assert back["step"] == 7 and back["groups"] == state["groups"]
    assert isinstance(back["sd"], collections.OrderedDict) and back["sd"]["b"] is None
    assert torch.equal(back["sd"]["a"], torch.zeros(2))
    assert list(back["moments"]) == [0] and torch.equal(back["moments"][0]["step"],
                                                         torch.tensor(3.0))
    assert torch.equal(spmd.gather(back["u"], mesh), spmd.gather(u, mesh))
    assert back["u"].shards[0] is not u.shards[0]  # a new state: the template is untouched


def test_one_process_without_a_mesh_reads_the_global_tensor(tmp_path):
    mesh = Mesh((3,), ("sp",))
    x = torch.randn(7, 4, dtype=torch.float64)
    lay = Layout((7, 4), P("sp"), mesh, sizes={0: [0, 5, 2]})
    ck.save({"x": Sharded.from_global(x, mesh, lay)}, tmp_path, mesh)
    with ck.read_stats() as stats:
        got = ck.load({"x": torch.empty(7, 4, dtype=torch.float64)}, tmp_path)["x"]
    assert torch.equal(got, x) and stats.payload_bytes == x.numel() * 8


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_files_are_plain_dcp_both_ways(tmp_path):
    mesh = Mesh((2,), ("sp",))
    x = torch.randn(5, 3)
    ck.save({"model": {"w": x}, "u": Sharded.from_global(x, mesh, P("sp"))}, tmp_path / "a",
            mesh)
    plain = {"model.w": torch.empty(5, 3), "u": torch.empty(5, 3)}
    dcp.load(plain, checkpoint_id=ck.latest(tmp_path / "a"), no_dist=True)
    assert torch.equal(plain["model.w"], x) and torch.equal(plain["u"], x)
    # A checkpoint torch wrote loads into any layout (no tree record: no Python values).
    dcp.save({"u": x}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    got = ck.load({"u": Layout((5, 3), P(None, "sp"), mesh)}, tmp_path / "b", mesh)["u"]
    assert torch.equal(spmd.gather(got, mesh), x)
    with pytest.raises(SpecError, match="not written by spmd.checkpoint.save"):
        ck.load({"u": torch.empty(5, 3), "step": 0}, tmp_path / "b")


def test_empty_scalar_and_replicated_values(tmp_path):
    mesh = Mesh((2, 2), ("a", "b"))
    e = Sharded.from_global(torch.empty(0, 3), mesh, P("a", "b"))
    s = Sharded.from_global(torch.tensor(2.5), mesh, P())
    rep = Sharded.from_global(torch.arange(4.0), mesh, P("b"))    # replicated over "a"
    ck.save({"e": e, "s": s, "rep": rep}, tmp_path, mesh)
    assert sum(math.prod(c.sizes) for c in _chunks(tmp_path, "rep").chunks) == 4
    m3 = Mesh((3,), ("sp",))
    back = ck.load({"e": Layout((0, 3), P("sp"), m3), "s": torch.empty(()),
                    "rep": Layout((4,), P(), m3)}, tmp_path, m3)
    assert back["e"].shards[1].shape == (0, 3) and back["s"].item() == 2.5
    assert [back["rep"].shards[r].tolist() for r in range(3)] == [[0.0, 1.0, 2.0, 3.0]] * 3
    assert back["rep"].shards[1].data_ptr() != back["rep"].shards[0].data_ptr()


# -- per-rank code on a threads mesh ----------------------------------------------------

Pair = collections.namedtuple("Pair", "a b")
X = torch.arange(66.0, dtype=torch.float64).view(11, 6)


def _save_per_rank(mesh, path, step):
    u = Sharded.from_global(X, mesh, P(("dp", "sp")))
    seeds = ck.PerRank.of(mesh, lambda r: torch.tensor([100 + r]))
    names = ck.PerRank.of(mesh, lambda r: f"rank {r}")
    return ck.save({"u": u, "seed": seeds, "name": names, "step": step}, path, mesh)


def _load_per_rank(mesh, path):
    lay = Layout((11, 6), P(None, "sp"), mesh, sizes={1: [4, 2]})
    mine = ck.PerRank({mesh.rank: None})
    with ck.read_stats() as stats:
        got = ck.load({"u": lay, "seed": mine, "name": mine, "step": 0}, path, mesh)
    assert torch.equal(got["u"].local, X[lay.slices(mesh.rank)])
    return got["seed"].local.item(), got["name"].local, got["step"], stats.payload_bytes


def test_per_rank_threads_save_and_load(tmp_path):
    out = spmd.launch(_save_per_rank, (2, 2), ("dp", "sp"), args=(str(tmp_path), 4))
    assert len(set(out)) == 1 and out[0] == ck.latest(tmp_path)
    got = spmd.launch(_load_per_rank, (2,), ("sp",), args=(str(tmp_path),))
    # Rank threads share one process: it reads each rank's new shard once, and each
    # rank's seed.
    assert got == [(100, "rank 0", 4, 11 * 6 * 8 + 2 * 8), (101, "rank 1", 4, 11 * 6 * 8 + 16)]


def _mismatched(mesh, path):
    tmpl = {"u": Layout((11, 6), P("sp"), mesh)}
    if mesh.rank == 1:
        tmpl["extra"] = torch.zeros(1)
    try:
        ck.load(tmpl, path, mesh)
    except SpecError as e:
        return str(e)
    return None


def _per_rank_from_larger_mesh(mesh, path):
    try:
        ck.load({"seed": ck.PerRank({mesh.rank: None})}, path, mesh)
    except SpecError as e:
        return str(e)
    return None


def _steps_differ(mesh, path):
    try:
        ck.save({"step": mesh.rank}, path, mesh)
    except SpecError as e:
        return str(e)
    return None


def _replicas_differ(mesh, path):
    try:
        ck.save({"w": torch.full((3,), float(mesh.rank))}, path, mesh)
    except SpecError as e:
        return str(e)
    return None


def test_errors_are_raised_on_every_rank_before_anything_moves(tmp_path):
    path = str(tmp_path / "ck")
    spmd.launch(_save_per_rank, (2, 2), ("dp", "sp"), args=(path, 1))
    msgs = spmd.launch(_mismatched, (2,), ("sp",), args=(path,))
    assert all(m is not None for m in msgs)
    assert "has no 'extra'" in msgs[1] and "has no 'extra'" in msgs[0]
    msgs = spmd.launch(_per_rank_from_larger_mesh, (5,), ("sp",), args=(path,))
    assert all(m and "saved on 4 ranks, so it has none for rank 4" in m for m in msgs), msgs
    msgs = spmd.launch(_steps_differ, (2,), ("sp",), args=(str(tmp_path / "other"),))
    assert all(m and "differs between ranks" in m for m in msgs), msgs
    msgs = spmd.launch(_replicas_differ, (2,), ("sp",), args=(str(tmp_path / "other"),))
    assert all(m and "replicated tensors" in m and "[0] vs [1]" in m for m in msgs), msgs
    assert not os.path.exists(tmp_path / "other" / "LATEST")


def _own_directory(mesh, base):
    try:
        ck.save({"step": 1}, os.path.join(base, f"r{mesh.rank}"), mesh)
    except SpecError as e:
        return str(e)
    return None


def test_ranks_given_different_directories_raise_on_every_rank_naming_them(tmp_path):
    msgs = spmd.launch(_own_directory, (2,), ("sp",), args=(str(tmp_path),))
    real = os.path.realpath(tmp_path)  # the message names resolved paths
    for m in msgs:
        assert m and "the ranks were given different checkpoint directories" in m, msgs
        assert f"ranks [0]: '{real}/r0'; ranks [1]: '{real}/r1'" in m, m
    assert os.listdir(tmp_path) == []  # nothing written


def test_errors_name_the_key_and_both_shapes(tmp_path):
    mesh = Mesh((2,), ("sp",))
    ck.save({"model": {"w": torch.zeros(3, 4)}, "u": Sharded.from_global(
        torch.zeros(6), mesh, P("sp"))}, tmp_path, mesh)
    with pytest.raises(SpecError, match=r"'model.w' has global shape \[3, 4\] in the checkpoint "
                                        r"but \[4, 3\] in the template"):
        ck.load({"model": {"w": torch.empty(4, 3)}}, tmp_path, mesh)
    with pytest.raises(SpecError, match=r"'u' has global shape \[6\] in the checkpoint but "
                                        r"\[7\]"):
        ck.load({"u": Layout((7,), P("sp"), mesh)}, tmp_path, mesh)
    with pytest.raises(SpecError, match="'model.w' is torch.float32 in the checkpoint but "
                                        "torch.float64"):
        ck.load({"model": {"w": torch.empty(3, 4, dtype=torch.float64)}}, tmp_path, mesh)
    with pytest.raises(SpecError, match="has no 'model.b'"):
        ck.load({"model": {"b": torch.empty(3)}}, tmp_path, mesh)
    with pytest.raises(SpecError, match="'u' .* was saved as a Sharded"):
        ck.load({"u": ck.AS_SAVED}, tmp_path, mesh)
    with pytest.raises(SpecError, match="is for a mesh"):
        ck.load({"u": Layout((6,), P("sp"), Mesh((3,), ("sp",)))}, tmp_path, mesh)
    with pytest.raises(SpecError, match="does not exist"):
        ck.load({"u": torch.empty(6)}, tmp_path / "nothing")


def test_what_cannot_be_saved_is_refused_naming_the_key(tmp_path):
    mesh = Mesh((2,), ("sp",))
    with pytest.raises(SpecError, match=r"weights_only=True\) could not read back 'opts.fn' "
                                        r"\(object\) \(it refuses object\)"):
        ck.save({"opts": {"fn": object()}}, tmp_path / "a", mesh)
    with pytest.raises(SpecError, match=r"the state's structure .*it refuses .*\.Pair"):
        ck.save({"pair": Pair(1, 2)}, tmp_path / "a", mesh)
    with pytest.raises(SpecError, match="PerRank holding ranks \\[0\\]"):
        ck.save({"r": ck.PerRank({0: 1})}, tmp_path / "a", mesh)
    with pytest.raises(SpecError, match=r"'u' holds the shards of ranks \[0\], but this "
                                        r"process holds ranks \[0, 1\]"):
        ck.save({"u": Sharded({0: torch.zeros(3)}, Layout((6,), P("sp"), mesh), mesh)},
                tmp_path / "a", mesh)
    with pytest.raises(SpecError, match="both name the key 'a.b'"):
        ck.save({"a.b": 1, "a": {"b": 2}}, tmp_path / "a", mesh)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(SpecError, match="not an spmd checkpoint"):
        ck.save({"a": 1}, tmp_path / "mine", mesh)
    assert not os.path.exists(tmp_path / "a")


def test_versions_replace_each_other_and_partial_ones_are_cleaned(tmp_path):
    mesh = Mesh((1,), ("sp",))
    first = ck.save({"step": 1}, tmp_path, mesh)
    os.makedirs(tmp_path / "v000002")           # what a save cut short leaves behind
    (tmp_path / "v000002" / "__0_0.distcp").write_bytes(b"half")
    assert ck.load({"step": 0}, tmp_path, mesh)["step"] == 1
    third = ck.save({"step": 3}, tmp_path, mesh, keep=2)
    assert third.endswith("v000003")
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v000001", "v000003"]
    ck.save({"step": 4}, tmp_path, mesh)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v000004"]
    assert ck.load({"step": 0}, tmp_path, mesh)["step"] == 4
    assert ck.load({"step": 0}, first.replace("v000001", "v000004"), mesh)["step"] == 4


# -- gloo processes ---------------------------------------------------------------------

Y = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)


def _gloo_save(mesh, path):
    ck.save({"y": Sharded.from_global(Y, mesh, Layout((7, 5), P("sp"), mesh,
                                                      sizes={0: [6, 1]})),
             "w": torch.ones(4), "step": 2}, path, mesh)


def _gloo_load(mesh, path):
    lay = Layout((7, 5), P(None, "sp"), mesh, sizes={1: [1, 4]})
    with ck.read_stats() as stats:
        got = ck.load({"y": lay, "w": torch.empty(4), "step": 0}, path, mesh)
    assert torch.equal(got["y"].local, Y[lay.slices(mesh.rank)]) and got["step"] == 2
    return stats.payload_bytes, got["y"].local.numel() * 4 + 16


@pytest.mark.gloo
def test_gloo_each_rank_reads_only_its_new_shard(gloo2, tmp_path):
    path = str(tmp_path / "ck")
    gloo2.run(_gloo_save, (2,), ("sp",), args=(path,))
    # Each rank wrote its own file: the tensor was not gathered anywhere.
    assert sorted(os.listdir(ck.latest(path))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    got = gloo2.run(_gloo_load, (2,), ("sp",), args=(path,))
    assert [a == b for a, b in got] == [True, True], got
    assert torch.equal(ck.load({"y": torch.empty(7, 5)}, path)["y"], Y)


@pytest.mark.gloo
def test_gloo_ranks_given_different_directories_raise_on_every_rank(gloo2, tmp_path):
    msgs = gloo2.run(_own_directory, (2,), ("sp",), args=(str(tmp_path),))
    real = os.path.realpath(tmp_path)
    for m in msgs:
        assert m and f"ranks [0]: '{real}/r0'; ranks [1]: '{real}/r1'" in m, msgs
    assert os.listdir(tmp_path) == []


def _save_then_die(mesh, path):
    # Replicated tensors take turns: rank 0 writes "a", rank 1 writes "b".
    ck.save({"a": torch.zeros(64, 64), "b": torch.zeros(3), "step": 1}, path, mesh)
    if mesh.rank == 1:
        from spmd.checkpoint import planners

        def die(self, item):
            os._exit(3)  # killed while writing its part of the second save
        planners.ChunkSavePlanner.resolve_data = die
    ck.save({"a": torch.ones(64, 64), "b": torch.ones(3), "step": 2}, path, mesh)


@pytest.mark.gloo
def test_a_save_cut_short_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(Exception):  # noqa: B017 - rank 1 dies: how the launch fails varies
        spmd.launch(_save_then_die, (2,), ("sp",), backend="gloo", args=(path,), timeout=60)
    # The second save had begun (its directory exists) but never finished.
    assert "v000002" in os.listdir(path)
    assert not os.path.exists(os.path.join(path, "v000002", ".metadata"))
    got = ck.load({"a": torch.empty(64, 64), "b": torch.empty(3), "step": 0}, path)
    assert got["step"] == 1 and not got["a"].any() and not got["b"].any()
    assert ck.latest(path).endswith("v000001")
    ck.save({"step": 3}, path, Mesh((1,), ("sp",)))
    assert sorted(os.listdir(path)) == ["LATEST", "v000003"]


@st.composite
def _gloo_moves(draw):
    shape = draw(sst.shapes(range(1, 3), max_side=6))
    names = {1: ("sp",), 2: ("dp", "sp")}
    src = draw(st.sampled_from([(2,), (1, 2), (2, 1)]))
    dst = draw(st.sampled_from([(2,), (1, 2), (2, 1)]))
    a, b = (Mesh((2,) if len(m) == 1 else m, names[len(m)], backend="threads")
            for m in (src, dst))
    return shape, draw(sst.layouts(shape, a)), draw(sst.layouts(shape, b))


def _gloo_round_trip(mesh, path, src, dst, x):
    def on(lay):  # the torch mesh of a layout's shape: the pool's own, or one over it
        same = lay.mesh_shape == tuple(mesh.shape) and lay.axis_names == mesh.axis_names
        return mesh if same else Mesh(lay.mesh_shape, lay.axis_names)
    m = on(src)
    ck.save({"x": Sharded.from_local(src.shard(x, m.rank), m, src)}, path, m)
    m2 = on(dst)
    with ck.read_stats() as stats:
        got = ck.load({"x": dst}, path, m2)["x"].local
    return torch.equal(got, dst.shard(x, m2.rank)), stats.payload_bytes, got.numel() * 8


@pytest.mark.gloo
@given(case=_gloo_moves())
@sst.settings(max_examples=6)
def test_gloo_any_layout_to_any_other(gloo2, tmp_path_factory, case):
    shape, src, dst = case
    path = str(tmp_path_factory.mktemp("ck"))
    x = torch.randn(shape, dtype=torch.float64)
    got = gloo2.run(_gloo_round_trip, (2,), ("sp",), args=(path, src, dst, x))
    assert all(ok and read == want for ok, read, want in got), got


def _rng_save(mesh, path):
    torch.manual_seed(10 + mesh.rank)            # every process draws its own stream
    torch.rand(3)
    ck.save({"rng": ck.PerRank.of(mesh, lambda r: torch.get_rng_state())}, path, mesh)
    return torch.rand(4)                         # what a run that went on would draw next


def _rng_resume(mesh, path):
    torch.manual_seed(999)
    got = ck.load({"rng": ck.PerRank.of(mesh, lambda r: None)}, path, mesh)
    torch.set_rng_state(got["rng"].local)
    return torch.rand(4)


@pytest.mark.gloo
def test_gloo_per_rank_rng_states_resume_each_rank_stream(gloo2, tmp_path):
    path = str(tmp_path / "ck")
    want = gloo2.run(_rng_save, (2,), ("sp",), args=(path,))
    got = gloo2.run(_rng_resume, (2,), ("sp",), args=(path,))
    assert not torch.equal(want[0], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
