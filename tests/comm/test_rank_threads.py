"""Rank threads (spmd/comm/rank_threads.py) under concurrency and faults: calls from
several Python threads on one threads mesh take turns; a rank that never arrives is
named at the mesh's timeout, the mesh stays usable, and the late rank's collectives never
reach a later call. A rank stuck outside any collective (a sleep) is a case for
``schedule="threads"``: on rank greenlets (tests/comm/test_rank_greenlets.py) it holds
the one thread they share.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import spmd
from spmd import P


def test_concurrent_callers_on_one_threads_mesh_get_their_own_results():
    """Two threads calling shard_map on one mesh got each other's data (124-234 of 600
    psums wrong): the per-rank call counters and slot keys were shared (reliability
    item 1). Calls now take turns."""
    mesh = spmd.Mesh((4,), ("sp",))
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
    wrong, errors = [], []

    def caller(k):
        try:
            for i in range(150):
                x = torch.arange(8.0) + 1000 * k + i
                got = f(x).item()
                if got != x.sum().item():
                    wrong.append((k, i, got))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not wrong, (errors, wrong[:5])


def _slow_rank(mesh, sleep):
    if mesh.rank == 2:
        time.sleep(sleep)
    return spmd.psum(torch.ones(1), "sp").item()


def test_a_rank_that_never_arrives_is_named_and_the_mesh_stays_usable():
    """Rank 2 sleeps through the timeout: the error names it as soon as the others' wait
    times out, the next call on the same mesh works, and when rank 2 wakes, its psum does
    not reach the call running then."""
    mesh = spmd.Mesh((3,), ("sp",), timeout=1.0, schedule="threads")
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
    start = time.monotonic()
    with pytest.raises(spmd.CommTimeout, match=r"ranks \[2\] of the group \[0, 1, 2\] did not "
                       r"arrive") as e:
        spmd.shard_map(lambda x: _slow_rank(mesh, 4.0) * x.sum(), mesh, P("sp"), P())(
            torch.ones(3))
    assert time.monotonic() - start < 3.5  # not after the sleeping rank wakes (at 4 s)
    assert e.value.missing == (2,)
    assert f(torch.ones(6)).item() == 6.0  # usable at once
    # Keep the mesh busy while rank 2 of the abandoned call wakes up and calls psum.
    deadline = time.monotonic() + 4.0
    n = 0
    while time.monotonic() < deadline:
        x = torch.arange(6.0) + n
        assert f(x).item() == x.sum().item()
        n += 1
    assert n > 10


def test_an_error_on_one_rank_is_reported_without_waiting_for_a_stuck_one():
    """Rank 0 raises while rank 2 is stuck outside any collective: the error comes at
    once, not after the whole run's timeout."""
    mesh = spmd.Mesh((3,), ("sp",), timeout=30.0, schedule="threads")

    def body(x):
        r = spmd.axis_index("sp")
        if r == 0:
            raise ValueError("bad input on rank 0")
        if r == 2:
            time.sleep(3.0)
        return spmd.psum(x.sum(), "sp")
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 0: bad input on rank 0"):
        spmd.shard_map(body, mesh, P("sp"), P())(torch.ones(3))
    assert time.monotonic() - start < 2.5
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
    assert f(torch.ones(3)).item() == 3.0


@pytest.mark.parametrize("runner", ["threads", "greenlets"])
def test_a_cancelled_collective_names_the_rank_that_failed(runner):
    """The ranks whose psum is cancelled by rank 1's failure are told which rank failed,
    in the message and in CommAborted's op, axes and missing (rank threads and rank
    greenlets alike)."""
    from spmd.comm.rank_greenlets import run_on_greenlets
    from spmd.comm.rank_threads import run_on_threads
    run = run_on_threads if runner == "threads" else run_on_greenlets
    mesh = spmd.Mesh((3,), ("sp",))
    seen = {}

    def fn(rank):
        if rank == 1:
            time.sleep(0.2)
            raise ValueError("boom")
        try:
            spmd.psum(torch.ones(1), "sp")
        except spmd.CommAborted as e:
            seen[rank] = e
    with pytest.raises(ValueError, match="rank 1: boom"):
        run(mesh, fn)
    assert sorted(seen) == [0, 2]
    for e in seen.values():
        assert "cancelled because rank 1 failed (ValueError('boom'))" in str(e)
        assert (e.op, e.axes, e.missing) == ("psum", ("sp",), (1,))


def test_dropout_on_rank_threads_is_reproducible_under_a_seed():
    """Rank threads sharing torch's one generator would draw in whatever order they ran,
    so dropout in a body would differ from run to run under the same seed. Each rank
    draws from its own state, seeded from the caller's generator."""
    mesh = spmd.Mesh((4,), ("sp",))
    f = spmd.shard_map(lambda x: torch.nn.functional.dropout(x, 0.5, training=True), mesh,
                       P("sp"), P("sp"))
    runs = []
    for _ in range(4):
        torch.manual_seed(0)
        runs.append(f(torch.ones(4 * 256)))
    for r in runs[1:]:
        assert torch.equal(r, runs[0])
    masks = runs[0].view(4, 256) != 0
    assert all(not torch.equal(masks[0], masks[k]) for k in (1, 2, 3))  # independent ranks
    torch.manual_seed(1)
    assert not torch.equal(f(torch.ones(4 * 256)), runs[0])


def test_spmd_manual_seed_seeds_each_rank_like_a_process():
    """Every rank seeded alike draws what one device seeded alike draws, in launch's
    per-rank programs and in shard_map bodies, whatever order the threads run in."""
    def per_rank(mesh):
        spmd.manual_seed(5)
        return torch.randn(3), torch.nn.Linear(4, 2).weight.detach()

    want = (torch.randn(3, generator=torch.Generator().manual_seed(5)),)
    torch.manual_seed(5)
    torch.randn(3)
    want += (torch.nn.Linear(4, 2).weight.detach(),)
    for _ in range(5):
        for got in spmd.launch(per_rank, (4,), ("sp",)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def body(x):
        spmd.manual_seed(int(spmd.axis_index("sp")))  # a seed per rank, by choice
        return x + torch.rand(x.shape)
    mesh = spmd.Mesh((3,), ("sp",))
    out = spmd.shard_map(body, mesh, P("sp"), P("sp"))(torch.zeros(6))
    assert torch.equal(out, torch.cat([torch.rand(2, generator=torch.Generator().manual_seed(r))
                                       for r in range(3)]))


def test_spmd_manual_seed_outside_rank_threads_is_torch_manual_seed():
    spmd.manual_seed(3)
    a = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        spmd.manual_seed(1.5)


@pytest.mark.parametrize("where", ["launch", "shard_map"])
def test_torch_manual_seed_on_a_rank_thread_raises_at_the_next_draw(where):
    """torch.manual_seed on a rank thread seeds the generator every rank thread shares:
    which rank's seed a draw sees would depend on thread timing, so the draw raises."""
    msg = r"torch's shared random generator changed while rank threads ran.*spmd\.manual_seed"
    if where == "launch":
        def per_rank(mesh):
            torch.manual_seed(0)
            return torch.nn.Linear(3, 3).weight
        with pytest.raises(spmd.SpecError, match=msg):
            spmd.launch(per_rank, (2,), ("sp",))
    else:
        def body(x):
            torch.manual_seed(0)
            return torch.nn.functional.dropout(x, 0.5)
        with pytest.raises(spmd.SpecError, match=msg):
            spmd.shard_map(body, spmd.Mesh((2,), ("sp",), schedule="threads"), P("sp"),
                           P("sp"))(torch.ones(4))
    # seeding and drawing outside rank threads is untouched, and the next run is clean
    torch.manual_seed(0)
    assert spmd.launch(lambda mesh: torch.rand(1).shape, (2,), ("sp",)) == [(1,), (1,)]


def test_rng_shared_opts_out_and_bad_values_are_refused():
    mesh = spmd.Mesh((2,), ("sp",), rng="shared")
    f = spmd.shard_map(lambda x: torch.rand(x.shape) + x, mesh, P("sp"), P("sp"))
    assert f(torch.zeros(6)).shape == (6,)
    with pytest.raises(spmd.SpecError, match="rng must be 'per_rank' or 'shared', got 'x'"):
        spmd.Mesh((2,), ("sp",), rng="x")
