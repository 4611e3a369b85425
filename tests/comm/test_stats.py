"""Communication accounting: exact calls and bytes, forward and backward."""
from __future__ import annotations

import torch

import spmd
from spmd import P
from spmd.testing import on_mesh

F32 = 4


def test_ppermute_halo_counts_only_halo_bytes_forward_and_backward():
    """A one-row halo exchange: each sending rank sends one row forward, and the
    backward ppermute sends one row of cotangent back."""
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(10, 6, requires_grad=True)

    def body(x):
        top = spmd.ppermute(x[-1:], "sp", [(i, i + 1) for i in range(3)])
        return torch.cat([top, x])

    with spmd.comm_stats() as s:
        spmd.shard_map(body, mesh, P("sp"), P("sp"))(x).sum().backward()
    assert s.calls("ppermute", pass_="forward") == 4  # every rank takes part
    assert s.bytes("ppermute", pass_="forward") == 3 * 6 * F32  # ranks 0..2 send one row
    assert s.bytes("ppermute", pass_="forward", rank=3) == 0
    assert s.calls("ppermute", pass_="backward") == 4
    assert s.bytes("ppermute", pass_="backward") == 3 * 6 * F32  # ranks 1..3 send back
    assert s.bytes("ppermute", pass_="backward", rank=0) == 0


def test_psum_bytes_are_output_size_and_gather_is_scatter_in_backward():
    mesh = spmd.Mesh((2, 3), ("dp", "sp"))
    x = torch.randn(6, 5, requires_grad=True)
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(1), "sp"), mesh, P("dp", "sp"), P("dp"))
    with spmd.comm_stats() as s:
        f(x)
    # Each of 6 ranks contributes the partial sums of its 3 rows: output size, no input.
    assert s.by_op() == {("psum", ("sp",), "forward"): (6, 6 * 3 * F32)}

    g = spmd.shard_map(lambda x: spmd.all_gather(x, "sp", tiled=True), mesh, P("sp"), P())
    with spmd.comm_stats() as s:
        g(x).sum().backward()
    # all_gather forward; its backward is exactly one psum_scatter per rank.
    assert s.calls("all_gather", axes="sp", pass_="forward") == 6
    assert s.calls("psum_scatter", axes="sp", pass_="backward") == 6
    assert s.calls(pass_="backward") == 6
    # Rows [2, 2, 2]: each rank sends its 2x5 part to 2 others; in backward, the 2
    # blocks of the 6x5 cotangent meant for others.
    assert s.bytes("all_gather") == 6 * 2 * 5 * F32 * 2
    assert s.bytes("psum_scatter") == 6 * 2 * (2 * 5 * F32)


def test_other_collectives_and_nothing_outside_the_block():
    def body(mesh):
        x = torch.ones(4)
        spmd.broadcast(x, "sp", src=1)
        spmd.all_to_all(torch.ones(3, 2), "sp", 0, 0)
        spmd.pmax(x, "sp")

    with spmd.comm_stats() as s:
        spmd.launch(body, (3,), ("sp",))
    spmd.launch(body, (3,), ("sp",))  # not counted
    assert s.bytes("broadcast") == 4 * F32 * 2 and s.bytes("broadcast", rank=0) == 0
    assert s.bytes("all_to_all") == 3 * (2 * 2 * F32)  # each rank: two 1x2 blocks out
    assert s.calls("pmax") == 3 and s.bytes("pmax") == 3 * 4 * F32
    assert "broadcast" in str(s)
    head = str(s).splitlines()[0].split()
    assert head == ["op", "axes", "pass", "calls", "bytes"]  # the rows had no header


@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_each_rank_counts_the_same_on_threads_and_gloo(mesh):
    x = torch.ones(3, requires_grad=True)
    with spmd.comm_stats() as s:
        spmd.ppermute(x, "sp", [(0, 1)]).sum().backward()
    # A threads block sees every rank, a process only its own: look at this rank's calls.
    r = mesh.rank
    got = (s.calls("ppermute", pass_="forward", rank=r), s.bytes("ppermute", pass_="forward", rank=r),
           s.calls("ppermute", pass_="backward", rank=r), s.bytes("ppermute", pass_="backward", rank=r))
    # Rank 0 sends forward; the backward ppermute sends the cotangent from rank 1 back.
    assert got == [(1, 3 * F32, 1, 0), (1, 0, 1, 3 * F32)][r]
    assert s.calls(rank=r) == 2
