"""Rank greenlets (spmd/comm/rank_greenlets.py), the simulated mesh's default schedule:
torch's per-thread state stays with its rank across the switches at collectives, a rank
that never arrives or fails is named at once, the caller's state is untouched, and the
backward is one pass whose collectives are the same as on rank threads.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

import spmd
from spmd import P
from spmd.comm.rank_greenlets import run_on_greenlets

F64 = torch.float64


def _mesh(n: int = 3, **kw) -> spmd.Mesh:
    return spmd.Mesh((n,), ("sp",), schedule="greenlets", **kw)


def test_grad_mode_entered_by_one_rank_does_not_leak_to_the_others():
    """Rank 0 waits in psum inside no_grad while ranks 1 and 2 run: they keep grad mode
    on, and rank 0 finds it still off when it resumes."""
    seen = {}

    def fn(rank):
        x = torch.ones(2, requires_grad=True)
        if rank == 0:
            with torch.no_grad():
                spmd.psum(torch.ones(1), "sp")
                seen[rank] = (torch.is_grad_enabled(), (x * 2).requires_grad)
        else:
            spmd.psum(torch.ones(1), "sp")
            seen[rank] = (torch.is_grad_enabled(), (x * 2).requires_grad)
        return rank
    assert run_on_greenlets(_mesh(), fn) == [0, 1, 2]
    assert seen == {0: (False, False), 1: (True, True), 2: (True, True)}


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.names.add(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def test_a_mode_pushed_on_one_rank_sees_only_that_ranks_calls():
    modes = {}

    def fn(rank):
        if rank == 1:
            with _Count() as m:
                modes[rank] = m
                spmd.psum(torch.ones(1), "sp")
                torch.ones(1) + 1
        else:
            spmd.psum(torch.ones(1), "sp")
            torch.cosh(torch.ones(1))
    run_on_greenlets(_mesh(), fn)
    # rank 1's own calls only, never the cosh the other ranks ran while it waited
    assert "add" in modes[1].names and "cosh" not in modes[1].names


def test_saved_tensor_hooks_autocast_and_inference_mode_stay_with_their_rank():
    packed = {0: 0, 1: 0, 2: 0}
    state = {}

    def fn(rank):
        x = torch.ones(3, requires_grad=True)

        def pack(t):
            packed[rank] += 1
            return t
        if rank == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                spmd.psum(torch.ones(1), "sp")
                (x * x).sum()
        elif rank == 1:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                spmd.psum(torch.ones(1), "sp")
                state[rank] = torch.is_autocast_enabled("cpu")
        else:
            with torch.inference_mode():
                spmd.psum(torch.ones(1), "sp")
                state[rank] = torch.is_inference_mode_enabled()
        (x * x).sum()
        state[(rank, "after")] = (torch.is_autocast_enabled("cpu"),
                                  torch.is_inference_mode_enabled(), torch.is_grad_enabled())
    run_on_greenlets(_mesh(), fn)
    assert packed == {0: 2, 1: 0, 2: 0}  # x * x saves x twice, on rank 0 only
    assert state[1] is True and state[2] is True
    for r in range(3):
        assert state[(r, "after")] == (False, False, True)


def test_each_rank_draws_from_its_own_generator_and_torch_manual_seed_seeds_one_rank():
    """On greenlets torch.manual_seed in a body seeds that rank's generator only, as in
    a process; the draws do not depend on when the other ranks run."""
    def body(x):
        r = int(spmd.axis_index("sp"))
        torch.manual_seed(10 + r)
        a = torch.rand(2)
        spmd.psum(torch.ones(1), "sp")  # the others draw meanwhile
        return x + torch.cat([a, torch.rand(2)])
    f = spmd.shard_map(body, _mesh(), P("sp"), P("sp"))
    out = f(torch.zeros(12))
    want = torch.cat([torch.rand(4, generator=torch.Generator().manual_seed(10 + r))
                      for r in range(3)])
    assert torch.equal(out, want)
    # the caller's generator is its own: one draw seeds the ranks, nothing else
    torch.manual_seed(0)
    f(torch.zeros(12))
    after = torch.rand(1)
    torch.manual_seed(0)
    torch.randint(0, 2 ** 62, (1,))
    assert torch.equal(after, torch.rand(1))


def test_the_callers_state_is_restored():
    mode = _Count()

    def fn(rank):
        torch.set_grad_enabled(False)  # a rank that leaves grad mode off
        return torch.is_grad_enabled()
    with mode:
        before = mode.calls
        assert run_on_greenlets(_mesh(), fn) == [False] * 3
        assert mode.calls == before  # the ranks ran without the caller's mode
    assert torch.is_grad_enabled()


def test_a_rank_that_never_arrives_is_named_at_once():
    """No waiting for the timeout: once no rank can run, the waiting ones are told which
    ranks did not arrive and what they did instead."""
    mesh = _mesh(timeout=60.0)

    def body(x):
        if spmd.axis_index("sp") == 2:
            return x.sum() * 0
        return spmd.psum(x.sum(), "sp")
    start = time.monotonic()
    with pytest.raises(spmd.CommTimeout, match=r"rank 0: psum over axis 'sp' on rank 0: ranks "
                       r"\[2\] of the group \[0, 1, 2\] did not arrive \(rank 2 returned "
                       r"without calling it\)") as e:
        spmd.shard_map(body, mesh, P("sp"), P())(torch.ones(3))
    assert time.monotonic() - start < 5.0
    assert e.value.missing == (2,)
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
    assert f(torch.ones(6)).item() == 6.0  # the mesh is usable at once


def test_ranks_waiting_in_different_collectives_are_named():
    """Rank 0 waits in a psum over "b" for rank 1, which returned; rank 2 in one over
    "a" for rank 0: each is told what the missing ranks do instead."""
    mesh = spmd.Mesh((2, 2), ("a", "b"), schedule="greenlets")

    def fn(rank):
        if rank in (1, 3):
            return None
        try:
            return spmd.psum(torch.ones(1), "b" if rank == 0 else "a")
        except spmd.CommTimeout as e:
            return str(e)
    got = run_on_greenlets(mesh, fn)
    assert got[0].startswith("psum over axis 'b' on rank 0: ranks [1] of the group [0, 1] "
                             "did not arrive (rank 1 returned without calling it)")
    assert got[2].startswith("psum over axis 'a' on rank 2: ranks [0] of the group [0, 2] "
                             "did not arrive (rank 0 waits in psum over axis 'b')")


def test_one_backward_pass_gives_the_same_gradients_and_traffic_as_rank_threads():
    """A halo'd conv, a norm and psum on uneven shards, one rank holding none: values,
    gradients and every collective's bytes per rank and pass equal the threads
    schedule's (one rank takes another path through conv2d: its rule differs, its
    collectives do not)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 2, 3, 3, dtype=F64, generator=g)
    x = torch.randn(1, 2, 3, 5, dtype=F64, generator=g)
    spec = P(None, None, ("a", "b"))
    got = {}
    for schedule in ("threads", "greenlets"):
        mesh = spmd.Mesh((2, 2), ("a", "b"), schedule=schedule)
        wg, xg = w.clone().requires_grad_(), x.clone().requires_grad_()

        def body(x):
            y = spmd.halo_pad(x, mesh, ("a", "b"), 2, (1, 1))
            d = (y[:, :, 2:] - y[:, :, :-2]).tanh()
            z = spmd.ops.conv2d(d, wg, padding=1, mesh=mesh, spec=spec)
            z = spmd.ops.layer_norm(z, (5,), mesh=mesh, spec=spec)
            return spmd.psum((z ** 2).sum(), ("a", "b"))
        with spmd.comm_stats() as st:
            out = spmd.shard_map(body, mesh, spec, P())(xg)
            out.backward()
        got[schedule] = (out.detach(), wg.grad, xg.grad, sorted(st.records))
    a, b = got["threads"], got["greenlets"]
    for u, v in zip(a[:3], b[:3]):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)  # same ops, same order
    assert a[3] == b[3]


def test_a_collective_is_a_node_only_when_some_ranks_input_needs_a_gradient():
    """No rank's input needs a gradient: psum makes no node and its result needs none.
    Only the ranks holding rows of a grad-requiring input need one: the node spans every
    rank anyway, so the cotangent of the replicated output reaches each rank's bwd, and
    the empty ranks' psum still meets in backward (the gradient is exact)."""
    mesh = _mesh(4)
    body = lambda x: spmd.psum((x * 2).sum(), "sp")  # noqa: E731
    out = spmd.shard_map(body, mesh, P("sp"), P())(torch.randn(6, dtype=F64))
    assert not out.requires_grad
    with spmd.comm_stats() as st:
        x = torch.randn(2, dtype=F64, requires_grad=True)  # ranks 2 and 3 hold nothing
        y = spmd.shard_map(lambda x: spmd.psum((x * x).sum(), "sp") * 3, mesh, P("sp"),
                           P())(x)
        y.backward()
    torch.testing.assert_close(x.grad, 6 * x.detach(), rtol=1e-12, atol=0)
    assert sorted(r for r, p in {(rec[2], rec[3]) for rec in st.records}) == \
        [0, 0, 1, 1, 2, 2, 3, 3]  # every rank: one psum forward, one backward


def test_communication_outside_a_custom_vjp_in_backward_is_refused_clearly():
    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return spmd.psum(g, "sp")
    f = spmd.shard_map(Sum.apply, _mesh(2), P("sp"), P("sp"))
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(spmd.SpecError, match=r"psum: called in the backward of a shard_map "
                       r"that ran on rank greenlets, outside a spmd.custom_vjp rule"):
        f(x).sum().backward()
    g = spmd.shard_map(Sum.apply, spmd.Mesh((2,), ("sp",), schedule="threads"), P("sp"),
                       P("sp"))
    g(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))


def test_a_collective_inside_a_cpp_guard_is_refused_not_leaked():
    """Below autograd (where torch.compile's code runs) a switch would leave the next
    rank below autograd too: refused, naming the way out."""
    def fn(rank):
        with torch._C._AutoDispatchBelowAutograd():
            return spmd.psum(torch.ones(1), "sp")
    with pytest.raises(spmd.SpecError, match=r"cannot do inside code that runs below "
                       r"autograd.*schedule='threads'"):
        run_on_greenlets(_mesh(2), fn)


def test_a_collective_in_a_function_optree_calls_from_cpp_is_refused_not_an_abort():
    """optree.tree_map calls its function from C++ (pybind11): a rank that waited there
    while another entered it made pybind11 abort the process when the first left. The
    rank gets a SpecError where it waits, naming the ways out; on rank threads it runs."""
    import optree

    def body(s):
        return optree.tree_map(lambda t: spmd.psum(t, "sp"), {"a": s.sum(), "b": s.sum() * 2})
    x = torch.arange(6.0)
    with pytest.raises(spmd.SpecError, match=r"rank 0: psum on rank 0: the simulated mesh "
                       r"switches to another rank at each collective, which it cannot do "
                       r"inside a function that optree calls from C\+\+ .*pass the whole "
                       r"pytree to the collective.*schedule='threads'"):
        spmd.shard_map(body, _mesh(), P("sp"), {"a": P(), "b": P()})(x)
    on_threads = spmd.Mesh((3,), ("sp",), schedule="threads")
    got = spmd.shard_map(body, on_threads, P("sp"), {"a": P(), "b": P()})(x)
    assert got["a"].item() == 15.0 and got["b"].item() == 30.0
    # the mesh is not left broken, and spmd's own pytree form works on greenlets
    got = spmd.shard_map(lambda s: spmd.psum({"a": s.sum(), "b": [s.sum() * 2]}, "sp"), _mesh(),
                         P("sp"), {"a": P(), "b": [P()]})(x)
    assert got["a"].item() == 15.0 and got["b"][0].item() == 30.0


def test_schedule_values():
    assert spmd.Mesh((2,), ("sp",), schedule="threads").schedule == "threads"
    with pytest.raises(spmd.SpecError, match="schedule must be 'greenlets' or 'threads', "
                       "got 'x'"):
        spmd.Mesh((2,), ("sp",), schedule="x")


_DEPTHS = r'''
import torch, spmd
from spmd import P
mesh = spmd.Mesh((3,), ("sp",))
ok = spmd.shard_map(lambda t: t * 2, mesh, P("sp"), P("sp"))
bad = spmd.shard_map(lambda t: t.view(5, -1), mesh, P("sp"), P("sp"))
def nest(n):  # the call made n levels of C recursion deeper (map calls back into Python)
    return ok(torch.ones(6)) if n == 0 else list(map(lambda _: nest(n - 1), [0]))[0]
for n in (3, 4, 5):
    nest(n)
    try:
        bad(torch.ones(6))
    except RuntimeError as e:
        assert "rank 0: shape '[5, -1]' is invalid" in str(e), e
print("ok")
'''


def test_a_torch_error_after_ranks_ran_at_another_stack_depth_is_an_error_not_a_crash():
    """Rank greenlets made by a call deeper in the C stack, reused by a shallower one: a
    torch error in a rank walks the greenlet's stack past its first frame (torch records
    a backtrace). Workers are reused only from where they were made, so the error is
    raised (this crashed the process with SIGSEGV when workers were reused anywhere)."""
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "-c", _DEPTHS], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])
    assert got.stdout.strip() == "ok"


def test_workers_are_kept_between_runs_from_one_depth_and_made_again_at_another(monkeypatch):
    """A training loop (forward, then a backward whose nodes run ranks inside autograd's
    engine) makes its rank greenlets once; calls from another stack depth make new ones
    once, then keep those."""
    import spmd.comm.rank_greenlets as rg
    made = []
    new = rg._new_worker
    monkeypatch.setattr(rg, "_new_worker", lambda parent: made.append(1) or new(parent))
    monkeypatch.setattr(rg, "_pool", __import__("threading").local())  # an empty pool
    mesh = spmd.Mesh((3,), ("sp",))
    s = P(None, None, "sp")
    w = torch.randn(2, 2, 3, 3, requires_grad=True)
    f = spmd.shard_map(lambda t: spmd.ops.conv2d(t, w, padding=1, mesh=mesh, spec=s), mesh,
                       s, s)
    x = torch.randn(1, 2, 9, 6, requires_grad=True)
    for _ in range(3):
        f(x).sum().backward()
    assert len(made) == 6  # 3 for the forwards, 3 for the backwards' nodes
    for _ in range(3):
        list(map(lambda _: f(x), [0]))  # one level of C recursion deeper
    assert len(made) == 9
