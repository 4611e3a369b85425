"""Ranks that disagree about a collective raise a CommError on every rank, with default
settings (no SPMD_VALIDATE), on threads and on gloo; ranks that agree get exact results.

On gloo the checked collectives carry an envelope (spmd/comm/_envelope.py); on threads
every rank's call is seen whole. Each case below is one per-rank function and the error
it must raise on both ranks (a regex naming the op and what differs).
Functions run by workers are module-level so that spawned processes can import them.
"""
from __future__ import annotations

import re

import pytest
import torch

import spmd
from spmd import P
from spmd.comm import _envelope, comm_of
from spmd.core.errors import CommError
from spmd.core.mesh import Mesh
from spmd.run.launcher import launch

F32, I32 = torch.float32, torch.int32


def _f32_or_i32(mesh, n=2):
    """Equal byte counts: 1.5 read as int32 is 1069547520."""
    if mesh.rank == 0:
        return torch.full((n,), 1.5)
    return torch.full((n,), 7, dtype=I32)


CASES = {
    # name: (per-rank call, what the error says on every rank)
    "all_gather shapes": (
        lambda m: spmd.all_gather(torch.ones((2, 3) if m.rank == 0 else (3, 2)), "sp"),
        r"all_gather over axis 'sp': rank 0 passed f32\[1, 2, 3\] but rank 1 passed "
        r"f32\[1, 3, 2\]; every rank must pass the same dtype and shape"),
    "all_gather dtypes": (
        lambda m: spmd.all_gather(_f32_or_i32(m), "sp"),
        r"all_gather over axis 'sp': rank 0 passed f32\[1, 2\] but rank 1 passed i32\[1, 2\]"),
    "all_gather counts": (
        lambda m: spmd.all_gather(torch.ones(2 + m.rank), "sp"),
        r"all_gather over axis 'sp': rank 0 passed f32\[1, 2\] but rank 1 passed f32\[1, 3\]"),
    "all_gather counts, large": (
        lambda m: spmd.all_gather(torch.ones(3, 200 + m.rank), "sp", axis=0, tiled=True),
        r"all_gather over axis 'sp': rank 0 passed f32\[3, 200\] but rank 1 passed "
        r"f32\[3, 201\]; every rank must pass the same dtype and shape \(except along dim 0\)"),
    "all_gather sizes": (
        lambda m: spmd.all_gather(torch.ones(1 + m.rank), "sp", tiled=True, sizes=[1, 1]),
        r"all_gather.*expected sizes \[1, 1\] along dim 0, got \[1, 2\]"),
    "ppermute dtypes": (
        lambda m: spmd.ppermute(_f32_or_i32(m), "sp", [(0, 1), (1, 0)]),
        r"ppermute over axis 'sp': rank 0 passed f32\[2\] but rank 1 passed i32\[2\]"),
    "ppermute counts": (
        lambda m: spmd.ppermute(torch.ones(2 + m.rank), "sp", [(0, 1), (1, 0)]),
        r"ppermute over axis 'sp': rank 0 passed f32\[2\] but rank 1 passed f32\[3\]"),
    "halo_pad dtypes": (
        lambda m: spmd.halo_pad(_f32_or_i32(m), m, "sp", 0, (1, 1)),
        r"halo_pad over axis 'sp': (rank 0 passed f32\[\d\] but rank 1 passed i32\[\d\]; "
        r"every rank must pass the same dtype|ranks passed blocks of dtypes "
        r"\['torch.float32', 'torch.int32'\]; every rank must pass one dtype)"),
    "halo_pad counts": (
        lambda m: spmd.halo_pad(torch.ones(3, 2 + m.rank), m, "sp", 0, (1, 1)),
        r"halo_pad.*rank \d expected (f32\[1, [23]\] from rank \d but it sent f32\[1, [23]\]; "
        r"the ranks' plans disagree|blocks of shapes \[\[[01], [23]\], \[[01], [23]\]\] but got)"),
    "psum counts": (
        lambda m: spmd.psum(torch.ones(100 + m.rank), "sp"),
        r"psum over axis 'sp': rank 0 passed f32\[100\] but rank 1 passed f32\[101\]"),
    "psum counts, large": (
        lambda m: spmd.psum(torch.ones(1000 + m.rank), "sp"),
        r"psum over axis 'sp': rank 0 passed f32\[1000\] but rank 1 passed f32\[1001\]"),
    "psum counts, straddling 512 bytes": (
        lambda m: spmd.psum(torch.ones(1000 if m.rank == 0 else 100), "sp"),
        r"psum over axis 'sp': rank 0 passed f32\[1000\] but rank 1 passed f32\[100\]"),
    "psum_scatter counts": (
        lambda m: spmd.psum_scatter(torch.ones(400 + 2 * m.rank), "sp", tiled=True),
        # processes name the total of the chunks, threads the first chunk that differs
        r"psum_scatter over axis 'sp': rank 0 passed f32\[(400|200)\] but rank 1 passed "
        r"f32\[(402|201)\]"),
    "psum_scatter chunks": (
        lambda m: comm_of(m).reduce_scatter(
            [torch.ones(300 + m.rank), torch.ones(300 - m.rank)], "sum", m.group("sp"),
            name="psum_scatter"),
        r"psum_scatter over axis 'sp': rank 0 passed (chunk shapes one set but rank 1 passed "
        r"chunk shapes another; every rank must pass the same chunk shapes|f32\[300\] but "
        r"rank 1 passed f32\[301\])"),
    "pmax against psum, large": (
        lambda m: (spmd.pmax if m.rank == 0 else spmd.psum)(torch.ones(300), "sp"),
        r"rank 0 passed reduction op 'max' but rank 1 passed reduction op 'sum'|"
        r"collective mismatch.*all_reduce\((max|sum)\)"),
    "psum against all_gather": (
        lambda m: (spmd.psum if m.rank == 0 else spmd.all_gather)(torch.ones(3), "sp"),
        r"collective mismatch.*(all_reduce.*all_gather|all_gather.*all_reduce)"),
    "pmax against psum": (
        lambda m: (spmd.pmax if m.rank == 0 else spmd.psum)(torch.ones(3), "sp"),
        r"rank 0 passed reduction op 'max' but rank 1 passed reduction op 'sum'|"
        r"collective mismatch.*all_reduce\((max|sum)\)"),
}


def _each(mesh, case):
    """What this rank raised (the message), or its result."""
    try:
        return ("returned", CASES[case][0](mesh))
    except CommError as e:
        return ("raised", str(e))


def _rank_sum(mesh):
    return spmd.psum(torch.tensor([float(mesh.rank)]), "sp").item()


def _check(case, got):
    for rank, (what, msg) in enumerate(got):
        assert what == "raised", f"{case}: rank {rank} returned {msg!r}"
        assert re.search(CASES[case][1], msg), f"{case}: rank {rank}: {msg}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_disagreement_raises_on_every_rank_threads(case):
    _check(case, launch(_each, (2,), "sp", args=(case,), timeout=10))


@pytest.mark.gloo
def test_disagreement_raises_on_every_rank_gloo(gloo2):
    """Default settings: no SPMD_VALIDATE. Every rank raises, and the process group is in
    step afterwards (nothing left in flight: the next call is exact)."""
    for case in sorted(CASES):
        _check(case, gloo2.run(_each, (2,), ("sp",), args=(case,), timeout=20))
        assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0], case


def _permute_short(mesh):
    """Rank 0 sends 300 floats to rank 1, whose plan (its own x) says 301: the payload
    arrives with its envelope, which says it is not what was planned."""
    try:
        return ("returned", spmd.ppermute(torch.ones(300 + mesh.rank), "sp", [(0, 1)]).shape)
    except CommError as e:
        return ("raised", str(e))


@pytest.mark.gloo
def test_a_permute_payload_shorter_than_planned_raises_on_the_receiver(gloo2):
    got = gloo2.run(_permute_short, (2,), ("sp",), timeout=20)
    assert got[0] == ("returned", (300,))  # only sends: hears nothing of it
    assert got[1][0] == "raised" and re.search(
        r"ppermute over axis 'sp': rank 0 passed f32\[300\] but rank 1 passed f32\[301\]",
        got[1][1]), got[1]
    assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]


def _larger_than_planned(mesh, case):
    """A payload larger than its receiver planned (gloo aborts the process on a message
    larger than its receive): every first message fits the receive posted for it, and
    a rest is received at the size its envelope announced. 1.2 MB payloads travel in
    two messages (the first 256 KiB with the envelope, then the rest)."""
    r, g, c = mesh.rank, mesh.group("sp"), comm_of(mesh)
    try:
        if case == "permute":  # rank 0 sends 301 floats to rank 1, which planned 300
            out = spmd.ppermute(torch.ones(301 - r), "sp", [(0, 1)])
        elif case == "permute, two pieces":
            out = spmd.ppermute(torch.ones(300_001 - r), "sp", [(0, 1), (1, 0)])
        elif case == "permute, inline against planned":
            out = spmd.ppermute(torch.ones(300_000 if r else 3), "sp", [(0, 1), (1, 0)])
        elif case == "all_gather sizes":
            out = c.all_gather(torch.ones(300 + r, 2), g, 0, name="all_gather", sizes=(300, 300))
        else:  # all_to_all with shapes (a halo width that differs)
            out = c.all_to_all([torch.ones(2, 200 + r)] * 2, g, name="all_to_all",
                               shapes=[(2, 200), (2, 200)])
        return ("returned", out)
    except CommError as e:
        return ("raised", str(e))


LARGER = {
    "permute": (r"ppermute over axis 'sp': rank 0 passed f32\[301\] but rank 1 passed "
                r"f32\[300\]", (1,)),
    "permute, two pieces": (r"ppermute over axis 'sp': rank 0 passed f32\[300001\] but rank 1 "
                            r"passed f32\[300000\]", (0, 1)),
    "permute, inline against planned": (r"rank 0 passed f32\[3\] but rank 1 passed "
                                        r"f32\[300000\]", (0, 1)),
    "all_gather sizes": (r"expected sizes \[300, 300\] along dim 0, got \[300, 301\]", (0, 1)),
    "all_to_all shapes": (r"all_to_all over axis 'sp': rank 0 expected f32\[2, 200\] from rank 1 "
                          r"but it sent f32\[2, 201\]", (0,)),
}


@pytest.mark.gloo
def test_a_payload_larger_than_planned_raises_on_the_receiver(gloo2):
    """Default settings: no abort, a CommError on the ranks that receive it, and the
    process group in step afterwards."""
    for case, (want, raising) in LARGER.items():
        got = gloo2.run(_larger_than_planned, (2,), ("sp",), args=(case,), timeout=20)
        for rank in raising:
            assert got[rank][0] == "raised" and re.search(want, got[rank][1]), (case, got)
        assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0], case


def _two_pieces(mesh):
    """Payloads above a first message's 256 KiB, exact: the rest follows it."""
    r, g, c = mesh.rank, mesh.group("sp"), comm_of(mesh)
    x = torch.arange(600_000, dtype=torch.float32) + r
    return (spmd.ppermute(x, "sp", [(0, 1), (1, 0)]),
            c.all_gather(x[:300_001] * 2, g, 0, name="all_gather", sizes=(300_001,) * 2),
            c.all_to_all([x[:290_000] + 10 * j for j in range(2)], g, name="all_to_all"))


@pytest.mark.gloo
def test_payloads_of_two_pieces_are_exact(gloo2):
    got = gloo2.run(_two_pieces, (2,), ("sp",), timeout=30)
    x = torch.arange(600_000, dtype=torch.float32)
    for r, (pp, ag, a2a) in enumerate(got):
        assert torch.equal(pp, x + 1 - r)
        assert all(torch.equal(ag[i], (x[:300_001] + i) * 2) for i in range(2))
        assert all(torch.equal(a2a[i], x[:290_000] + i + 10 * r) for i in range(2))


def _messages(mesh):
    """The point-to-point messages this rank starts for an all_to_all of a halo-sized
    block (3 KB: one message each way) and of a block above 256 KiB (a first message
    and the rest; the rest's receive is posted once its envelope has arrived)."""
    import torch.distributed as dist
    started = []
    real = dist.batch_isend_irecv

    def counting(ops):
        started.extend("send" if op.op is dist.isend else "recv" for op in ops)
        return real(ops)

    g, c = mesh.group("sp"), comm_of(mesh)
    out = []
    dist.batch_isend_irecv = counting
    try:
        for n in (768, 100_000):
            started.clear()
            got = c.all_to_all([torch.full((n,), float(mesh.rank))] * 2, g, name="all_to_all",
                               shapes=[(n,), (n,)])
            out.append((sorted(started), [t.tolist()[:2] for t in got]))
    finally:
        dist.batch_isend_irecv = real
    return out


@pytest.mark.gloo
def test_a_halo_is_one_message_each_way(gloo2):
    for r, (small, large) in enumerate(gloo2.run(_messages, (2,), ("sp",), timeout=20)):
        assert small == (["recv", "send"], [[0.0, 0.0], [1.0, 1.0]])
        assert large == (["recv", "recv", "send", "send"], [[0.0, 0.0], [1.0, 1.0]])


# -- ranks that agree: exact ------------------------------------------------------------------

def _agreeing(mesh):
    """Payloads inline and larger than an envelope, zero-size parts, two all_to_alls in
    flight on one group at once, every dtype class."""
    g, c, r = mesh.group("sp"), comm_of(mesh), mesh.rank
    i, n = g.index, g.size
    out = {}
    for k in (0, 1, 100, 1000):  # up to 4000 bytes: the payload follows its envelope
        x = torch.arange(k * (i + 1), dtype=torch.float64).reshape(i + 1, k) + 1000 * r
        out[f"ag{k}"] = c.all_gather(x, g, 0, name="all_gather")
        out[f"ag{k}_sizes"] = c.all_gather(x, g, 0, name="all_gather",
                                           sizes=tuple(range(1, n + 1)))
        y = torch.arange(k, dtype=torch.int16) + r
        out[f"pp{k}"] = c.permute(y, g, tuple((s, (s + 1) % n) for s in range(n)),
                                  name="ppermute")
        out[f"ar{k}"] = [c.all_reduce(y.to(dt), op, g, name="p" + op)
                         for dt in (torch.int64, torch.bool, torch.float32)
                         for op in ("sum", "max", "min")]
    chunks = [torch.full((j + 1, 300 * i), float(r * 10 + j)) for j in range(n)]
    w1 = c.all_to_all_async(chunks, g, name="all_to_all")
    w2 = c.all_to_all_async([ch[:, :1].to(torch.bool) for ch in chunks], g, name="all_to_all",
                            shapes=[(i + 1, min(1, 300 * s)) for s in range(n)])
    out["a2a"], out["a2a_bool"] = w1.wait(), w2.wait()
    c.barrier(g)
    return out


@pytest.mark.gloo
def test_agreeing_ranks_get_exact_results(gloo2):
    """Against the threads backend, exactly (integers in float64: sums are exact in any
    order), at world 2 (the shared pool) and 3 (point-to-point fan-out to two peers)."""
    from tests.comm.test_distributed import _same
    for n in (2, 3):
        if n == 2:
            got = gloo2.run(_agreeing, (n,), ("sp",))
        else:
            got = launch(_agreeing, (n,), "sp", backend="gloo", timeout=60)
        _same(got, launch(_agreeing, (n,), "sp", timeout=30))
    assert got[1]["ag1000"][2].shape == (3, 1000) and got[0]["pp1000"][0].item() == 2


# -- arguments of higher layers that differ: the next collective tells --------------------------

def _out_specs_differ(mesh):
    """Rank 0 gathers the output (split), rank 1 claims it replicated and gathers nothing;
    both then reduce a loss. Rank 0's gather meets rank 1's psum."""
    f = spmd.shard_map(lambda x: x * 2, mesh, P("sp"), P("sp") if mesh.rank == 0 else P())
    f(torch.arange(4.0))
    return spmd.psum(torch.ones(3), "sp")


def _requires_grad_differs(mesh):
    """Only rank 0's input requires grad: its backward runs a psum that rank 1 never runs;
    rank 1 goes on to its next psum."""
    x = torch.arange(4.0).requires_grad_(mesh.rank == 0)
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
    y = f(x)
    if y.requires_grad:
        y.backward()
    return spmd.psum(torch.ones(3), "sp")


HIGHER = {"out_specs": _out_specs_differ, "requires_grad": _requires_grad_differs}


def _each_higher(mesh, case):
    try:
        return ("returned", HIGHER[case](mesh))
    except (CommError, spmd.SpecError) as e:
        return ("raised", str(e))


def test_arguments_that_differ_by_rank_raise_at_the_next_collective_threads():
    """shard_map's out_specs or an input's requires_grad that differ from rank to rank make
    the rank threads run different collectives: the first one that meets another kind of
    call (or another shape) raises on every rank, naming both."""
    for case in sorted(HIGHER):
        got = launch(_each_higher, (2,), "sp", args=(case,), timeout=10)
        for rank, (what, msg) in enumerate(got):
            assert what == "raised", (rank, msg)
            # out_specs: rank 1's check of its replicated output meets rank 0's gather
            assert re.search(r"collective mismatch|passed f32\[\] but rank 1 passed f32\[3\]|"
                             r"rank 0 passed f32\[2\] but rank 1 passed f32\[1, 2\]|"
                             r"ranks found different", msg), (rank, msg)


HIGHER_GLOO = {
    "out_specs": r"shard_map: out_specs differ between rank 0 and rank 1 \(rank {r} passed "
                 r"P\({spec}\)\); every rank must pass the same out_specs",
    "requires_grad": r"shard_map: whether args\[0\] requires grad differs between rank 0 and "
                     r"rank 1 \(it does on rank 0 only\); every rank must pass inputs that "
                     r"require grad alike",
}


@pytest.mark.gloo
def test_arguments_that_differ_by_rank_raise_before_the_body_gloo(gloo2):
    """On processes shard_map exchanges a fingerprint of its specs and of which inputs
    require grad before the body runs (default settings): a SpecError on every rank,
    naming what differs and the ranks, instead of a timeout."""
    for case in sorted(HIGHER):
        got = gloo2.run(_each_higher, (2,), ("sp",), args=(case,), timeout=10)
        for rank, (what, msg) in enumerate(got):
            want = HIGHER_GLOO[case].format(r=rank, spec="'sp'" if rank == 0 else "")
            assert what == "raised" and re.search(want, msg), (rank, msg)
        assert gloo2.run(_rank_sum, (2,), ("sp",)) == [1.0, 1.0]


def _grad_mode_differs(mesh):
    f = spmd.shard_map(lambda x: x * 2, mesh, P("sp"), P("sp"))
    with torch.set_grad_enabled(mesh.rank == 0):
        try:
            f(torch.ones(4, requires_grad=True))
        except spmd.SpecError as e:
            return str(e)


@pytest.mark.gloo
def test_grad_mode_that_differs_by_rank_raises_before_the_body_gloo(gloo2):
    for msg in gloo2.run(_grad_mode_differs, (2,), ("sp",), timeout=10):
        assert msg and "shard_map: grad mode differs between rank 0 and rank 1 (rank 0: on, " \
            "rank 1: off)" in msg, msg


def _calls_differ_large(mesh):
    """A large psum (envelopes gathered) against a ppermute (point to point): the calls
    never meet."""
    x = torch.ones(300)
    try:
        if mesh.rank == 0:
            spmd.psum(x, "sp")
        else:
            spmd.ppermute(x, "sp", [(0, 1), (1, 0)])
    except CommError as e:
        return type(e).__name__, str(e)


@pytest.mark.gloo
def test_calls_that_never_meet_time_out_naming_what_each_rank_waits_in():
    """The two calls use different transports (an all_gather of envelopes, point-to-point
    envelopes), so neither sees the other's fingerprint: they time out, and the timeout
    names the call the other rank waits in. (The rank that times out later may see its
    connection closed first: then it raises CommAborted.)"""
    got = launch(_calls_differ_large, (2,), "sp", backend="gloo", timeout=4)
    first = [msg for kind, msg in got if kind == "CommTimeout"]
    assert first and all(isinstance(g, tuple) for g in got), got
    assert any(re.search(r"psum over axis 'sp' timed out .* rank 1 is waiting in ppermute "
                         r"\(call #0 on this group\) instead: the ranks do not run the same "
                         r"collectives", m) or
               re.search(r"ppermute over axis 'sp' timed out .* rank 0 is waiting in psum "
                         r"\(call #0 on this group\) instead", m) for m in first), got


# -- the envelope's checks, without communication ---------------------------------------------

def _heads(calls):
    return [_envelope.head_of(kind, seq, extra, shape, dt, "t") for kind, seq, extra, shape, dt
            in calls]


GROUP = Mesh((3,), ("sp",), backend="threads").group("sp", 0)
GROUP2 = Mesh((3,), ("sp",), backend="threads").group("sp", 2)


@pytest.mark.parametrize("calls,msg", [
    ([("all_gather", 4, 0, (2,), F32)] * 2 + [("permute", 4, 0, (2,), F32)],
     r"t over axis 'sp': collective mismatch: rank 0 called all_gather while rank 2 called "
     r"permute \(call #4 on this group\)"),
    ([("all_gather", 4, 0, (2,), F32), ("all_gather", 5, 0, (2,), F32)] * 2,
     r"rank 0 is at call #4 on this group but rank 1 at call #5"),
    ([("all_gather", 4, 0, (2, 1), F32), ("all_gather", 4, 1, (2, 1), F32)],
     r"rank 0 passed dim 0 but rank 1 passed dim 1"),
    ([("all_gather", 4, 0, (2, 1), F32), ("all_gather", 4, 0, (3, 2), F32)],
     r"rank 0 passed f32\[2, 1\] but rank 1 passed f32\[3, 2\]; every rank must pass the same "
     r"dtype and shape \(except along dim 0\)"),
    ([("all_reduce", 0, 0, (4,), F32), ("all_reduce", 0, 0, (4,), I32)],
     r"rank 0 passed f32\[4\] but rank 1 passed i32\[4\]"),
])
def test_check_all_names_the_first_difference(calls, msg):
    with pytest.raises(CommError, match=msg):
        _envelope.check_all(_heads(calls), GROUP, "t", skip_dim=0)


def test_check_all_passes_alike_calls_and_other_sizes_along_the_gathered_dim():
    _envelope.check_all(_heads([("all_gather", 3, 1, (2, k), F32) for k in (0, 1, 5)]), GROUP,
                        "t", skip_dim=1, sizes=(0, 1, 5))
    with pytest.raises(CommError, match=r"expected sizes \[0, 1, 4\] along dim 1, got "
                       r"\[0, 1, 5\]"):
        _envelope.check_all(_heads([("all_gather", 3, 1, (2, k), F32) for k in (0, 1, 5)]),
                            GROUP, "t", skip_dim=1, sizes=(0, 1, 4))


def test_check_from_names_both_ranks_in_order_and_refuses_foreign_messages():
    mine, theirs = _heads([("permute", 2, 9, (4,), F32), ("permute", 2, 9, (4,), I32)])
    with pytest.raises(CommError, match=r"rank 0 passed i32\[4\] but rank 2 passed f32\[4\]"):
        _envelope.check_from(theirs, mine, 0, GROUP2, "t")
    with pytest.raises(CommError, match=r"rank 1 sent a message that is not a spmd collective"):
        _envelope.check_from([0] * len(mine), mine, 1, GROUP, "t")


def test_envelope_layout():
    """A fixed size for every kind of call (ranks that disagree still exchange equal
    sizes), aligned for every dtype; the payload inline up to INLINE bytes."""
    assert _envelope.SIZE == _envelope.HEAD + _envelope.INLINE and _envelope.SIZE % 16 == 0
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    head = _envelope.head_of("all_gather", 7, 0, x.shape, x.dtype, "t")
    env = _envelope.pack(head, x, "cpu")
    assert env.shape == (_envelope.SIZE,)
    back = _envelope.heads_of(env.unsqueeze(0))[0]
    assert back == head and torch.equal(_envelope.payload_of(env, back), x)
    big = _envelope.head_of("all_gather", 7, 0, (100,), torch.float64, "t")
    assert not _envelope.pack(big, torch.ones(100, dtype=torch.float64), "cpu")[
        _envelope.HEAD:].any()  # 800 bytes: sent after the envelope, not in it
