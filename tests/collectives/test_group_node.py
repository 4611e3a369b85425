"""psum, all_gather, psum_scatter and ppermute on rank greenlets as one autograd node
over their group (spmd/collectives/group_node.py): values, gradients, retained graphs
and traffic equal the thread-per-rank schedule's bit for bit; a member in no_grad, a member whose
input needs no gradient and a per-rank backward requested after the node are each
handled or refused on every rank."""
from __future__ import annotations

import pytest
import torch

import spmd
from spmd import P
from spmd.comm.threads import per_rank_backward

F64 = torch.float64


def _run(schedule: str, body, x: torch.Tensor, spec, out_spec, *, twice: bool = False):
    mesh = spmd.Mesh((2, 3), ("a", "b"), schedule=schedule)
    xg = x.clone().requires_grad_()
    with spmd.comm_stats() as st:
        out = spmd.shard_map(body, mesh, spec, out_spec)(xg)
        loss = (out * torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape)).sum()
        (g,) = torch.autograd.grad(loss, xg, retain_graph=twice)
        if twice:  # the retained graph gives the same gradient again
            (g2,) = torch.autograd.grad(loss, xg)
            assert torch.equal(g, g2)
    return out.detach(), g, sorted(st.records)


def _same_as_threads(body, x, spec, out_spec, *, twice: bool = True) -> tuple:
    """Values, gradients and traffic on rank greenlets equal rank threads' to the bit;
    the greenlets' (output, gradient, records)."""
    a = _run("threads", body, x, spec, out_spec, twice=twice)
    b = _run("greenlets", body, x, spec, out_spec, twice=twice)
    for u, v in zip(a[:2], b[:2]):
        assert torch.equal(u, v)
    assert a[2] == b[2]
    return b


@pytest.mark.parametrize("twice", [False, True])
def test_values_gradients_and_traffic_equal_the_threads_schedule(twice):
    """psum over one axis of a 2-D mesh (two groups of three), uneven shards (one rank
    holds none), then pmean over the other: equal to rank threads to the bit, and to one
    device within float64 rounding."""
    x = torch.randn(5, 6, dtype=F64, generator=torch.Generator().manual_seed(1))

    def body(t):
        s = spmd.psum((t * t).sum(0), "b")
        return (s * spmd.pmean(t.sum(), ("a", "b"))).tanh()
    spec, out_spec = P(("b",), "a"), P("a")
    b = _same_as_threads(body, x, spec, out_spec, twice=twice)
    # one device, float64 (the same sums in another order: 1e-12)
    ref = x.clone().requires_grad_()
    want = ((ref * ref).sum(0) * ref.sum() / 6).tanh()
    (want * torch.arange(1, 7, dtype=F64)).sum().backward()
    torch.testing.assert_close(b[0], want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b[1], ref.grad, rtol=1e-12, atol=1e-12)


def test_a_member_in_no_grad_counts_as_a_constant():
    """Rank 0 sums in no_grad, rank 1 with a gradient: rank 0's result needs none, and
    its term (computed in no_grad) is a constant in rank 1's."""
    mesh = spmd.Mesh((2,), ("sp",), schedule="greenlets")
    x = torch.randn(4, dtype=F64, generator=torch.Generator().manual_seed(2))

    def body(t):
        if spmd.axis_index("sp") == 0:
            with torch.no_grad():
                s = spmd.psum(t.sum(), "sp")
            assert not s.requires_grad
        else:
            s = spmd.psum(t.sum(), "sp")
            assert s.requires_grad
        return s * t
    xg = x.clone().requires_grad_()
    spmd.shard_map(body, mesh, P("sp"), P("sp"))(xg).sum().backward()
    total, x1 = x.sum(), x[2:].sum()
    want = torch.full((4,), total.item(), dtype=F64)  # d(S * t)/dt
    want[2:] += x1  # rank 1: through S, whose rank-0 term is a constant
    torch.testing.assert_close(xg.grad, want, rtol=1e-12, atol=1e-12)


def test_no_node_when_no_input_needs_a_gradient_and_results_are_private():
    """Grad mode on, no input needs a gradient: plain results; each rank's result is its
    own tensor (an in-place change on one rank leaves the others' alone)."""
    mesh = spmd.Mesh((3,), ("sp",), schedule="greenlets")

    def body(t):
        s = spmd.psum(t.sum(), "sp")
        assert not s.requires_grad
        if spmd.axis_index("sp") == 0:
            s.add_(100.0)
        return s.reshape(1)
    got = spmd.shard_map(body, mesh, P("sp"), P("sp"))(torch.ones(6))
    assert got.tolist() == [106.0, 6.0, 6.0]


def test_in_place_on_one_ranks_result_leaves_the_others_gradient_exact():
    mesh = spmd.Mesh((3,), ("sp",), schedule="greenlets")

    def body(t):
        s = spmd.psum(t.sum(), "sp")
        if spmd.axis_index("sp") == 2:
            s = s * 1.0
            s.mul_(2.0)
        return (s * t).sum().reshape(1)
    x = torch.arange(6.0, dtype=F64, requires_grad=True)
    spmd.shard_map(body, mesh, P("sp"), P("sp"))(x).sum().backward()
    S, rank_sums, k = 15.0, torch.tensor([1.0, 5.0, 9.0], dtype=F64), torch.tensor(
        [1.0, 1.0, 2.0], dtype=F64)
    want = S * k.repeat_interleave(2) + (k * rank_sums).sum()
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=0)


def test_a_per_rank_backward_asked_for_after_a_psum_node_is_refused():
    """A converted model's backward runs per rank; after a psum node the call cannot
    do both, and says so on every rank."""
    mesh = spmd.Mesh((2,), ("sp",), schedule="greenlets")

    def body(t):
        s = spmd.psum(t.sum(), "sp")
        per_rank_backward()
        return s.reshape(1)
    with pytest.raises(spmd.SpecError, match="call the converted model first"):
        spmd.shard_map(body, mesh, P("sp"), P("sp"))(torch.ones(4, requires_grad=True))


def test_a_member_in_no_grad_gets_a_private_copy():
    """Rank 0 sums in no_grad (it asks for no node) and reads its result after rank 2,
    the last to arrive, changed its own in place: rank 0 still reads the sum."""
    mesh = spmd.Mesh((3,), ("sp",), schedule="greenlets")

    def body(t):
        r = spmd.axis_index("sp")
        if r == 0:
            with torch.no_grad():
                s = spmd.psum(t.sum(), "sp")
        else:
            s = spmd.psum(t.sum(), "sp")
            if r == 2:
                s.add_(100.0)
        return s.reshape(1)
    got = spmd.shard_map(body, mesh, P("sp"), P("sp"))(torch.ones(6, requires_grad=True))
    assert got.tolist() == [6.0, 6.0, 106.0]


@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_equals_the_threads_schedule(tiled):
    """all_gather over one axis of a 2-D mesh, uneven tiles (one rank holds none when
    tiled), its cotangent depending on the position: values, gradients and traffic
    equal rank threads' to the bit (psum_scatter's sums in the same order)."""
    x = torch.randn(2, 4, dtype=F64, generator=torch.Generator().manual_seed(3))  # rows 1, 1, 0

    def body(t):
        if tiled:
            g = spmd.all_gather(t * t, "b", axis=0, tiled=True)  # (2, 2): every row
        else:
            g = spmd.all_gather((t * t).sum(0), "b", axis=0)  # (3, 2): one row per rank
        return (g * spmd.pmean(t.sum(), "b")).sin()  # the same over 'b', as P('a') claims
    spec = P(("b",), "a")
    b = _same_as_threads(body, x, spec, P("a"))
    assert any(rec[0] == "psum_scatter" and rec[3] == "backward" for rec in b[2])


def test_all_gather_of_shards_of_other_sizes_untiled_names_tiled_on_every_rank():
    mesh = spmd.Mesh((2,), ("sp",), schedule="greenlets")
    f = spmd.shard_map(lambda t: spmd.all_gather(t, "sp").sum().reshape(1), mesh, P("sp"),
                       P("sp"))
    with pytest.raises(spmd.CommError, match="pass tiled=True"):
        f(torch.ones(3, requires_grad=True))


@pytest.mark.parametrize("perm", [[(0, 1), (1, 2)], [(0, 2), (2, 1), (1, 0)]])
def test_ppermute_equals_the_threads_schedule(perm):
    """A shift (the last rank sends nothing, the first receives zeros) and a cycle, over
    one axis of a 2-D mesh: values, gradients and traffic equal rank threads' to the
    bit."""
    x = torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(4))

    def body(t):
        y = spmd.ppermute(t * t, "b", perm)
        return (y * t).sin() + y
    b = _same_as_threads(body, x, P("b", "a"), P("b", "a"))
    assert any(rec[0] == "ppermute" and rec[3] == "backward" and rec[4] for rec in b[2])


def test_ppermute_to_a_member_in_no_grad_and_from_one():
    """Rank 1 shifts in no_grad: it still receives rank 0's block (a plain copy), and the
    block it sends is a constant in rank 2's gradient."""
    mesh = spmd.Mesh((3,), ("sp",), schedule="greenlets")

    def body(t):
        if spmd.axis_index("sp") == 1:
            with torch.no_grad():
                y = spmd.ppermute(t * 1.0, "sp", [(0, 1), (1, 2)])
            assert not y.requires_grad
        else:
            y = spmd.ppermute(t * 1.0, "sp", [(0, 1), (1, 2)])
        return y * t
    x = torch.arange(1.0, 7.0, dtype=F64, requires_grad=True)
    out = spmd.shard_map(body, mesh, P("sp"), P("sp"))(x)
    assert out.tolist() == [0.0, 0.0, 3.0, 8.0, 15.0, 24.0]
    out.sum().backward()
    # rank 0's block goes to rank 1 (no graph there); rank 2 gets rank 1's, a constant
    assert x.grad.tolist() == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter", "ppermute"])
def test_ranks_that_disagree_on_the_dtype_get_one_error_each(op):
    """Rank 1 passes float32, the others float64, in grad mode: a CommError on every
    rank (the check runs before the node is made), never a mixed result."""
    mesh = spmd.Mesh((3,), ("sp",), schedule="greenlets")
    call = {"psum": lambda t: spmd.psum(t, "sp"),
            "all_gather": lambda t: spmd.all_gather(t, "sp", tiled=True),
            "psum_scatter": lambda t: spmd.psum_scatter(t, "sp", tiled=True),
            "ppermute": lambda t: spmd.ppermute(t, "sp", [(0, 1), (1, 2), (2, 0)])}[op]
    seen = []

    def body(t):
        if spmd.axis_index("sp") == 1:
            t = t.float()
        try:
            return call(t).sum().reshape(1).double()
        except spmd.CommError as e:
            seen.append(str(e))
            raise
    with pytest.raises(spmd.CommError, match="every rank must pass the same dtype"):
        spmd.shard_map(body, mesh, P("sp"), P("sp"))(
            torch.ones(6, dtype=F64, requires_grad=True))
    assert len(seen) == 3 and len(set(seen)) == 1


@pytest.mark.parametrize("tiled", [True, False])
def test_psum_scatter_equals_the_threads_schedule(tiled):
    """psum_scatter over one axis of a 2-D mesh: tiled into uneven blocks (one rank's
    empty), or one row per rank: values, gradients and traffic equal rank threads' to
    the bit."""
    x = torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(5))

    def body(t):
        u = torch.cat([t, t * t], 0)  # (4, 2)
        if tiled:
            s = spmd.psum_scatter(u, "b", tiled=True, sizes=(3, 1, 0))
            return (s.sum(0, keepdim=True) * t[:1]).cos()
        s = spmd.psum_scatter(u[:3], "b")  # (2,): this rank's row of the sum
        return (s * t).cos()
    b = _same_as_threads(body, x, P("b", "a"), P("b", "a"))
    assert any(rec[0] == "all_gather" and rec[3] == "backward" and rec[4] for rec in b[2])
