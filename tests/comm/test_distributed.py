"""TorchComm (spmd/comm/distributed.py) through the comm protocol, on real gloo processes.

Every suite runs the same per-rank function on gloo processes and on the threads backend
and compares the results exactly (values are integers, so sums are exact in any order).
Functions run by workers are module-level so that spawned processes can import them.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import time

import pytest
import torch

import spmd
from spmd.comm import comm_of
from spmd.core.errors import CommAborted, CommError, CommTimeout
from spmd.run.launcher import launch

pytestmark = pytest.mark.gloo


# -- per-rank programs ----------------------------------------------------------------------

def _suite(mesh, axes):
    """Every protocol op over ``axes``, with uneven sizes, zero-size parts and odd dtypes."""
    g, c, r = mesh.group(axes), comm_of(mesh), mesh.rank
    i, n = g.index, g.size
    out = {"group": (g.ranks, g.index)}
    x = torch.tensor([[r, -r, 3], [2 * r, 5, -1]], dtype=torch.float32)
    x0 = x.clone()
    for op in ("sum", "max", "min"):
        out["ar_" + op] = c.all_reduce(x.t(), op, g, name="p" + op)  # non-contiguous input
    out["ar_int"] = c.all_reduce(torch.arange(3) * (r + 1), "sum", g, name="psum")
    # the same small reduction again (it reuses its buffers): the first result stays put
    first = c.all_reduce(torch.tensor([r, 1.0]), "sum", g, name="psum")
    out["ar_again"] = [first, c.all_reduce(torch.tensor([10.0 * r, 2.0]), "sum", g, name="psum"),
                       first.clone()]
    b = torch.tensor([r == 0, False, True])
    out["ar_bool"] = [c.all_reduce(b, op, g, name="p" + op) for op in ("sum", "min")]
    for dt in (torch.int8, torch.uint8, torch.int64, torch.float16, torch.bfloat16):
        lo, hi = (torch.iinfo(dt).min, torch.iinfo(dt).max) if not dt.is_floating_point \
            else (-65504, 65504)
        v = torch.tensor([lo, hi, r, 3 - r], dtype=dt)
        out[f"ar_{dt}"] = [c.all_reduce(v, op, g, name="p" + op) for op in ("max", "min")]
        out[f"ar_{dt}_sum"] = c.all_reduce(v[2:], "sum", g, name="psum")
    # Above 512 bytes reductions are ring reductions, after their envelopes.
    big = torch.arange(300.0).view(3, 100) * (r + 1) - 7 * r
    for op in ("sum", "max", "min"):
        out["ar_big_" + op] = c.all_reduce(big.t(), op, g, name="p" + op)
        out["ar_big_i8_" + op] = c.all_reduce(big.to(torch.int8), op, g, name="p" + op)
    out["ar_big_bool"] = [c.all_reduce(big > 150 * r, op, g, name="p" + op) for op in ("sum", "min")]
    out["ar_c64"] = c.all_reduce(torch.tensor([1 + 2j, r * 1j], dtype=torch.complex64), "sum",
                                 g, name="psum")
    # all_gather: member i holds i columns (member 0 holds none).
    y = torch.arange(3 * i, dtype=torch.float64).reshape(3, i) + 100 * r
    out["ag"] = c.all_gather(y, g, 1, name="all_gather")
    out["ag_sizes"] = c.all_gather(y, g, -1, name="all_gather", sizes=tuple(range(n)))
    out["ag_rank"] = c.all_gather(torch.tensor([r]), g, 0, name="all_gather")
    out["ag_even"] = c.all_gather(torch.full((2, 2), r, dtype=torch.int32), g, 0, name="all_gather")
    # reduce_scatter: chunk j has shape (j + 1, 2) on every rank.
    chunks = [torch.full((j + 1, 2), float((r + 1) * (j + 1))) + torch.arange(2) * r
              for j in range(n)]
    for op in ("sum", "max", "min"):
        out["rs_" + op] = c.reduce_scatter(chunks, op, g, name="psum_scatter")
    out["rs_even"] = c.reduce_scatter([torch.full((2,), r + j) for j in range(n)], "sum", g,
                                      name="psum_scatter")
    # all_to_all: the chunk member i sends to member j has shape (i + 1, j).
    out["a2a"] = c.all_to_all([torch.full((i + 1, j), float(10 * r + j)) for j in range(n)], g,
                              name="all_to_all")
    out["a2a_bool"] = c.all_to_all([torch.tensor([r == j, True]) for j in range(n)], g,
                                   name="all_to_all")
    # permute: a cyclic shift, a partial permutation, a self pair.
    z = torch.arange(4.0) + 10 * r
    out["shift"] = c.permute(z, g, tuple((k, (k + 1) % n) for k in range(n)), name="ppermute")
    out["partial"] = c.permute(z, g, ((0, n - 1),), name="ppermute")
    out["self"] = c.permute(z, g, ((0, 0), (1, n - 1)), name="ppermute")
    out["bcast"] = c.broadcast(z * 2, n - 1, g, name="broadcast")
    out["bcast0"] = c.broadcast(z[:1].int(), 0, g, name="broadcast")
    c.barrier(g)
    out["unchanged"] = torch.equal(x, x0)
    return out


def _validated_suite(mesh, axes):
    """The suite with cross-rank validation on (SPMD_VALIDATE=1) where the backend has it."""
    c = comm_of(mesh)
    old = getattr(c, "validate", None)
    if old is not None:
        c.validate = True
    try:
        return _suite(mesh, axes)
    finally:
        if old is not None:
            c.validate = old


def _mismatch(mesh):
    c = comm_of(mesh)
    c.validate = True
    try:
        return c.all_reduce(torch.zeros(2 + mesh.rank), "sum", mesh.group("sp"), name="psum")
    finally:
        c.validate = False


def _gather_mismatch(mesh):
    # No validation: the size exchange of all_gather catches a shape mismatch off dim.
    x = torch.zeros(3, 1 + mesh.rank)
    return comm_of(mesh).all_gather(x, mesh.group("sp"), 0, name="all_gather")


def _never_arrives(mesh):
    if mesh.rank == 1:
        time.sleep(60)
    return comm_of(mesh).all_reduce(torch.ones(1), "sum", mesh.group("sp"), name="psum")


def _raises_on_1(mesh):
    if mesh.rank == 1:
        raise ValueError("boom")
    return comm_of(mesh).all_reduce(torch.ones(1), "sum", mesh.group("sp"), name="psum")


class _Unpicklable(Exception):
    def __init__(self, *, code):
        super().__init__(f"code {code}")


def _raises_unpicklable(mesh):
    if mesh.rank == 1:
        raise _Unpicklable(code=7)
    return 0


def _unalike(mesh, calls, checks=True, scale=1):
    """Each rank makes the call ``calls[case][rank]`` per case (op, dtype, shape, or a
    reduce_scatter's chunk shapes; dim 0 times ``scale``): what each raised, then whether
    the mesh still works. ``checks=False`` does what SPMD_VALIDATE=0 does."""
    g, c, r = mesh.group("sp"), comm_of(mesh), mesh.rank
    c.checks, was = checks, c.checks
    try:
        out = []
        for case in calls:
            op, dtype, shape = case[r % len(case)]
            up = (lambda s: (s[0] * scale, *s[1:]))  # noqa: E731
            shape = tuple(map(up, shape)) if isinstance(shape[0], tuple) else up(shape)
            try:
                if isinstance(shape[0], tuple):
                    c.reduce_scatter([torch.ones(s, dtype=dtype) for s in shape], op, g,
                                     name="psum_scatter")
                else:
                    c.all_reduce(torch.ones(shape, dtype=dtype), op, g, name="p" + op)
                out.append(None)
            except CommError as e:
                out.append(str(e))
        return out, _rank_sum(mesh)
    finally:
        c.checks = was  # the pool's processes serve later tests


def _counts_differ(mesh, n):
    return comm_of(mesh).all_reduce(torch.ones(n + mesh.rank), "sum", mesh.group("sp"),
                                    name="psum")


def _dies_on_1(mesh):
    if mesh.rank == 1:
        os._exit(3)
    return comm_of(mesh).all_reduce(torch.ones(1), "sum", mesh.group("sp"), name="psum")


def _sleeps(mesh):
    time.sleep(30)


def _rank_sum(mesh):
    return comm_of(mesh).all_reduce(torch.tensor([float(mesh.rank)]), "sum", mesh.group("sp"),
                                name="psum").item()


# -- helpers -------------------------------------------------------------------------------

def _channels(mesh, axes):
    """Rank 0 starts an all-reduce on a channel of its own and then meets the others in a
    psum on the default channel; the other ranks take the psum first. On one channel this
    is a mismatch (or a hang); on two, both complete. The channel is opened first."""
    c = comm_of(mesh)
    g = mesh.group(axes)
    side = mesh.group(axes, channel="side")
    c.open(side)
    x = torch.arange(4.0) + 10 * mesh.rank
    if g.index == 0:
        w = c.all_reduce_async(x, "sum", side, name="side")
        s = c.all_reduce(torch.tensor([1.0]), "sum", g, name="psum")
    else:
        s = c.all_reduce(torch.tensor([1.0]), "sum", g, name="psum")
        w = c.all_reduce_async(x, "sum", side, name="side")
    return w.wait(), s


def _same(a, b, path="out"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a!r} vs {b!r}"
        assert torch.equal(a, b), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths {len(a)} vs {len(b)}"
        for k, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{path}[{k}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _check_suite(got, shape, names, axes):
    want = launch(_suite, shape, names, backend="threads", args=(axes,), timeout=30)
    _same(got, want)
    for res in got:
        ranks, _ = res["group"]
        assert [int(t) for t in res["ag_rank"]] == list(ranks)  # group order, not rank order
        assert res["unchanged"]
        assert [t.shape[1] for t in res["ag"]] == list(range(len(ranks)))


# -- tests ----------------------------------------------------------------------------------

def test_suite_world2(gloo2):
    got = gloo2.run(_suite, (2,), ("sp",), args=("sp",))
    _check_suite(got, (2,), ("sp",), "sp")
    # A few values spelled out.
    assert got[0]["ar_sum"].tolist() == [[1, 2], [-1, 10], [6, -2]]
    assert got[0]["partial"] is None and got[1]["partial"].tolist() == [0, 1, 2, 3]
    assert got[1]["shift"].tolist() == [0, 1, 2, 3] and got[0]["shift"].tolist() == [10, 11, 12, 13]
    assert got[0]["rs_sum"].tolist() == [[3, 4]] and got[1]["rs_sum"].shape == (2, 2)
    assert [t.shape for t in got[1]["a2a"]] == [(1, 1), (2, 1)]


def test_suite_validated_world2(gloo2):
    got = gloo2.run(_validated_suite, (2,), ("sp",), args=("sp",))
    _check_suite(got, (2,), ("sp",), "sp")


def test_suite_2d_mesh_tuple_group(gloo4):
    # ("sp", "dp") on a ("dp", "sp") mesh: group order differs from global-rank order.
    got = gloo4.run(_suite, (2, 2), ("dp", "sp"), args=(("sp", "dp"),))
    assert got[0]["group"][0] == (0, 2, 1, 3)
    _check_suite(got, (2, 2), ("dp", "sp"), ("sp", "dp"))
    got = gloo4.run(_suite, (2, 2), ("dp", "sp"), args=("dp",))
    _check_suite(got, (2, 2), ("dp", "sp"), "dp")
    # Tuples of some of the axes: process groups from dist.new_group (two partitions for
    # ("tp", "sp")); a size-1 axis needs no communication at all.
    shape, names = (2, 2, 1), ("dp", "sp", "tp")
    for axes in (("sp", "dp"), ("tp", "sp"), "tp"):
        _check_suite(gloo4.run(_suite, shape, names, args=(axes,)), shape, names, axes)


def test_suite_world4(gloo4):
    got = gloo4.run(_suite, (4,), ("sp",), args=("sp",))
    _check_suite(got, (4,), ("sp",), "sp")


def test_channels_are_independent_world2(gloo2):
    got = gloo2.run(_channels, (2,), ("sp",), args=("sp",), timeout=20)
    want = launch(_channels, (2,), ("sp",), args=("sp",))
    for (a, s), (wa, ws) in zip(got, want):
        assert torch.equal(a, torch.arange(4.0) * 2 + 10) and torch.equal(a, wa)
        assert torch.equal(s, torch.tensor([2.0])) and torch.equal(s, ws)


def test_channels_are_independent_2d_world4(gloo4):
    got = gloo4.run(_channels, (2, 2), ("dp", "sp"), args=("dp",), timeout=20)
    want = launch(_channels, (2, 2), ("dp", "sp"), args=("dp",))
    for (a, s), (wa, ws) in zip(got, want):
        assert torch.equal(a, wa) and torch.equal(s, ws)


def test_validation_mismatch_same_error_everywhere(gloo2):
    with pytest.raises(CommError, match=r"rank \d: psum over axis 'sp': rank 0 passed "
                       r"f32\[2\] but rank 1 passed f32\[3\]"):
        gloo2.run(_mismatch, (2,), ("sp",))
    with pytest.raises(CommError, match=r"f32\[3, 1\] but rank 1 passed f32\[3, 2\].*except "
                       r"along dim 0"):
        gloo2.run(_gather_mismatch, (2,), ("sp",))
    assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]


_F32 = torch.float32
UNALIKE_2 = [
    [("sum", _F32, (4,)), ("max", _F32, (4,))],                # psum on one, pmax on the other
    [("min", _F32, (4,)), ("max", _F32, (4,))],
    [("sum", _F32, (4,)), ("sum", torch.int32, (4,))],         # equal byte size
    [("max", torch.float64, (3,)), ("max", torch.int64, (3,))],
    [("sum", _F32, (2, 3)), ("sum", _F32, (3, 2))],            # equal element count
    [("sum", torch.bool, (5,)), ("sum", torch.uint8, (5,))],
    [("sum", _F32, ((2, 3), (1,))), ("sum", _F32, ((3, 2), (1,)))],  # reduce_scatter
    [("min", torch.int8, (4,)), ("sum", torch.int8, (4,))],
]


def test_unalike_reductions_raise_on_every_rank_without_validation(gloo2):
    """Without SPMD_VALIDATE, a reduction called with another op, dtype or shape on
    another rank must not return garbage (or, psum against pmax, abort the process).
    Every reduction first exchanges its envelope (small ones with the payload inline):
    the same error, naming both calls, on every rank, at any size."""
    small = gloo2.run(_unalike, (2,), ("sp",), args=(UNALIKE_2,))
    large = gloo2.run(_unalike, (2,), ("sp",), args=(UNALIKE_2, True, 200))
    for got in (small, large):
        for rank, (errs, after) in enumerate(got):
            assert after == 1.0  # the process group is still in step
            for case, err in zip(UNALIKE_2, errs):
                assert err is not None, f"rank {rank} returned for {case}"
        for case, e0, e1 in zip(UNALIKE_2, got[0][0], got[1][0]):
            # The same message on both (but for the op's name, e.g. psum against pmax).
            assert e0.split(" ", 1)[1] == e1.split(" ", 1)[1], (e0, e1)
            assert "rank 0 passed" in e0 and "rank 1 passed" in e0, e0
            assert "every rank must pass the same" in e0, e0
    # Alike calls pass.
    same = [[c[0], c[0]] for c in UNALIKE_2] + [[c[1], c[1]] for c in UNALIKE_2]
    for scale in (1, 200):
        errs = gloo2.run(_unalike, (2,), ("sp",), args=(same, True, scale))
        assert errs == [([None] * len(same), 1.0)] * 2
    # SPMD_VALIDATE=0 opts out: the same byte-size mismatch then passes unnoticed.
    errs = gloo2.run(_unalike, (2,), ("sp",), args=([UNALIKE_2[2]], False, 64))
    assert errs == [([None], 1.0)] * 2


def test_one_pmin_among_four_pmaxes_raises_everywhere(gloo4):
    calls = [[("max", _F32, (8,)), ("min", _F32, (8,)), ("max", _F32, (8,)),
              ("max", _F32, (8,))]]
    got = gloo4.run(_unalike, (4,), ("sp",), args=(calls, True, 200))  # a ring reduction
    assert all(errs[0] is not None and after == 6.0 for errs, after in got), got


def _counts_scatter(mesh, n):
    return comm_of(mesh).reduce_scatter([torch.ones(n + mesh.rank), torch.ones(n)], "sum",
                                        mesh.group("sp"), name="psum_scatter")


@pytest.mark.parametrize("n", [4, 400, 1 << 18])
def test_unequal_element_counts_raise_on_every_rank(gloo2, n):
    """Differing element counts never reach gloo (which aborts the process on them): a
    reduction's envelope is agreed before its ring reduction starts, at every size (1 MiB
    too) and for reduce_scatter; the process group stays in step."""
    for fn, what in ((_counts_differ, "psum"), (_counts_scatter, "psum_scatter")):
        got = gloo2.run(_each_error, (2,), ("sp",), args=(fn, n))
        for err in got:
            assert err is not None and re.search(
                rf"{what} over axis 'sp': rank 0 passed f32\[{n * (1 + (what != 'psum'))}\] "
                rf"but rank 1 passed f32\[{n * (1 + (what != 'psum')) + 1}\]; every rank must "
                rf"pass the same dtype and shape", err), err
        assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]


def _each_error(mesh, fn, n):
    try:
        fn(mesh, n)
    except CommError as e:
        return str(e)


def test_timeout_names_missing_rank_and_pool_recovers(gloo2):
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match=r"rank 0: psum over axis 'sp' timed out after 2 s on "
                       r"rank 0: ranks \[1\] of the group \[0, 1\] did not arrive") as e:
        gloo2.run(_never_arrives, (2,), ("sp",), timeout=2)
    assert e.value.missing == (1,) and e.value.axes == ("sp",) and e.value.op == "psum"
    assert time.monotonic() - t0 < 15
    assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]


def test_exception_on_one_rank(gloo2):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 1: boom"):
        gloo2.run(_raises_on_1, (2,), ("sp",))
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match=r"(?s)rank 1: _Unpicklable\('code 7'\).*traceback on rank 1"):
        gloo2.run(_raises_unpicklable, (2,), ("sp",))
    with pytest.raises(RuntimeError, match=r"rank 1: process exited \(exit code 3\)"):
        gloo2.run(_dies_on_1, (2,), ("sp",))
    assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]


def test_whole_run_deadline():
    from spmd.run.processes import ProcessPool
    # 3 s: the first all_reduce (gloo connects lazily) must fit even on a loaded machine
    with ProcessPool(2, timeout=3, slack=0.5) as pool:
        assert pool.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]
        pids = {p.pid for p in pool._procs}
        with pytest.raises(CommTimeout, match=r"ranks \[0, 1\] of 2 did not finish") as e:
            pool.run(_sleeps, (2,), ("sp",))
        assert e.value.missing == (0, 1) and not pool.started
    assert not pids & {p.pid for p in multiprocessing.active_children()}


def test_launch_one_shot():
    before = {p.pid for p in multiprocessing.active_children()}
    assert launch(_rank_sum, (2,), ("sp",), backend="gloo", timeout=30) == [1.0, 1.0]
    with pytest.raises(ValueError, match="rank 1: boom"):
        launch(_raises_on_1, (2,), ("sp",), backend="gloo", timeout=30)
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_no_children_left():
    from spmd.testing import runner
    runner.close_pools()  # gloo2, gloo4 and on_mesh's: they restart if a later test runs one
    assert multiprocessing.active_children() == []


def _dies_and_peer_reports(mesh, path):
    if mesh.rank == 1:
        time.sleep(0.5)
        os._exit(3)
    try:
        comm_of(mesh).all_reduce(torch.ones(1), "sum", mesh.group("sp"), name="psum")
    except CommAborted as e:
        import pickle
        with open(path, "wb") as f:
            pickle.dump((str(e), e.op, e.axes, e.missing), f)
        raise


def test_a_dead_peer_is_named_in_commaborted(gloo2, tmp_path):
    """Rank 1's process dies before its psum: rank 0's CommAborted names it (reliability
    item 11); the pool reports the death itself first."""
    import pickle
    path = tmp_path / "seen.pkl"
    with pytest.raises(RuntimeError, match=r"rank 1: process exited \(exit code 3\)"):
        gloo2.run(_dies_and_peer_reports, (2,), ("sp",), args=(str(path),))
    msg, op, axes, missing = pickle.loads(path.read_bytes())
    assert (op, axes, missing) == ("psum", ("sp",), (1,)), msg
    assert "ranks [1] never reached it" in msg


SCRIPT = '''
import torch
import spmd


def body(mesh):
    return spmd.psum(torch.ones(1), "sp").item()

{call}
'''


def test_launch_from_a_script_needs_the_main_guard_and_says_so(tmp_path):
    """Without ``if __name__ == "__main__":`` every spawned process would run the script
    again; the parent says what to write instead, before starting anything."""
    import subprocess
    import sys
    call = 'print(spmd.launch(body, (2,), ("sp",), backend="gloo"))'
    bad, good = tmp_path / "bad.py", tmp_path / "good.py"
    bad.write_text(SCRIPT.format(call=call))
    good.write_text(SCRIPT.format(call=f'if __name__ == "__main__":\n    {call}'))
    r = subprocess.run([sys.executable, str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "runs bad.py again in every process; line 9 would then start processes again" in \
        r.stderr and 'if __name__ == "__main__":' in r.stderr
    assert "bootstrapping phase" not in r.stderr
    r = subprocess.run([sys.executable, str(good)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[2.0, 2.0]", r.stderr


def _rank_dependent_halo(mesh):
    comm_of(mesh).validate = True
    try:
        x = torch.arange(8.0).reshape(4, 2)[2 * mesh.rank:2 * mesh.rank + 2]
        return spmd.halo_pad(x, mesh, "sp", 0, (1, 1 + mesh.rank))
    except CommError as e:
        return str(e)
    finally:
        comm_of(mesh).validate = False


def test_validation_compares_the_plans_of_an_all_to_all(gloo2):
    """A halo width that differs by rank: each rank's plan expects other shapes than the
    others send. Validation compared no all_to_all shapes (an internal IndexError, or an
    abort without validation); now every rank raises the same CommError (item 10)."""
    got = gloo2.run(_rank_dependent_halo, (2,), ("sp",))
    assert got[0] == got[1] and "the ranks' plans disagree" in got[0], got
    assert "expected f32[" in got[0] and "but it sent f32[" in got[0]
