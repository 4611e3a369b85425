"""Shared by the tests of spmd.ops: run a sharded op through shard_map and the same op on
one device, both in float64, and compare output, input gradient and parameter gradients.

The output spec given to shard_map is the op's own ``output_layout``, so every run also
checks that the layout an op reports is the one it produces (shard_map refuses a local
shape the layout does not expect).

Tolerance: float64 with rtol = atol = 1e-10. The sharded run computes the same products
as one device, but weight and bias gradients are sums of per-rank partial sums (and a
conv's input gradient adds halo contributions after the local part), so additions are
reordered: a few ulps of float64, far below 1e-10 for the O(1)-sized values used here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hypothesis import strategies as st

import spmd
from spmd import Layout, P

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def compare_op(f_local: Callable, f_global: Callable, mesh: spmd.Mesh, in_layout,
               out_spec, x: torch.Tensor, params: Sequence[torch.Tensor] = (), *,
               seed: int = 0, tol: dict | None = None, check_grad: bool = True) -> torch.Tensor:
    """``shard_map(lambda x: f_local(x, *params))`` against ``f_global(x, *params)``.

    ``params`` are closed over by the body (as model weights are), so their gradients
    come from shard_map's parameter rule. Returns the sharded output.
    """
    tol = TOL if tol is None else tol
    xa = x.detach().clone().requires_grad_(check_grad)
    xb = x.detach().clone().requires_grad_(check_grad)
    pa = [p.detach().clone().requires_grad_(check_grad) for p in params]
    pb = [p.detach().clone().requires_grad_(check_grad) for p in params]
    y = spmd.shard_map(lambda x: f_local(x, *pa), mesh, in_layout, out_spec)(xa)
    ref = f_global(xb, *pb)
    assert y.shape == ref.shape, f"shape {tuple(y.shape)} != single-device {tuple(ref.shape)}"
    torch.testing.assert_close(y, ref, **tol, msg=lambda m: f"output: {m}")
    if not check_grad:
        return y
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=ref.dtype)
    (y * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, **tol, msg=lambda m: f"input gradient: {m}")
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert (a.grad is None) == (b.grad is None), f"param {i}: gradient presence differs"
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, **tol,
                                       msg=lambda m, i=i: f"param {i} gradient: {m}")
    return y


def split_sizes(draw, st, n: int, parts: int, allow_empty: bool = True) -> list[int]:
    """Hypothesis: ``parts`` non-negative sizes adding up to ``n`` (uneven, zeros allowed)."""
    if parts == 1:
        return [n]
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    if not allow_empty and 0 in sizes:
        return list(spmd.layout.balanced_sizes(n, parts))
    return sizes


def mesh_and_spec(draw, n: int, *, channels: bool = False) -> tuple[spmd.Mesh, P]:
    """Hypothesis: a mesh and the spec of an (N, C, *n spatial dims) input split over it:
    1-4 ranks over dim 2, 2-3 over the last dim, a (2, 2) mesh over two spatial dims or
    over dim 2 as the product of both axes, the batch split too (dp, sp), and with
    ``channels`` the channels split too (c, sp)."""
    kinds = ["1d", "dp_sp", "xy"] + (["c_sp"] if channels else []) + (
        ["2d", "1d_last"] if n >= 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "1d":
        return spmd.Mesh((draw(st.integers(1, 4)),), ("sp",)), P(None, None, "sp")
    if kind == "1d_last":
        return spmd.Mesh((draw(st.integers(2, 3)),), ("sp",)), P(*([None] * (n + 1)), "sp")
    if kind == "2d":
        return spmd.Mesh((2, 2), ("x", "y")), P(None, None, "x", "y")
    if kind == "xy":
        return spmd.Mesh((2, 2), ("x", "y")), P(None, None, ("x", "y"))
    if kind == "c_sp":
        return spmd.Mesh((2, 2), ("c", "sp")), P(None, "c", "sp")
    return spmd.Mesh((2, 2), ("dp", "sp")), P("dp", None, "sp")


def drawn_layout(draw, shape, mesh, spec, *, spatial_only: bool = False) -> Layout:
    """Hypothesis: a layout of ``shape`` with uneven (zeros included) sizes on split dims
    (only the spatial ones, dims >= 2, with ``spatial_only``)."""
    lay = Layout(shape, spec, mesh)
    sizes = {d: split_sizes(draw, st, shape[d], len(lay.sizes[d])) for d in lay.split_dims
             if d >= 2 or not spatial_only}
    return Layout(shape, spec, mesh, sizes or None)


def errors_on_every_rank(fn: Callable, ranks: int = 2):
    """Run ``fn(mesh)`` on every rank of a threads mesh; return each rank's
    (error type, message), and the communication that happened."""
    def per_rank(mesh):
        try:
            fn(mesh)
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            return type(e), str(e)
        return None, ""
    with spmd.comm_stats() as stats:
        got = spmd.launch(per_rank, (ranks,), ("sp",), timeout=10)
    return got, stats


def assert_only_halo_bytes(stats, op: str, in_sizes, out_sizes, window, L: int,
                           row_bytes: int) -> None:
    """The windowed op ``op`` moved exactly the rows each rank lacks (its ``window`` of
    output rows, clipped to the global input of length ``L``, minus its shard), once in
    forward and once back in backward, in one exchange per rank and pass."""
    rows, start, o0 = [], 0, 0
    for s, m in zip(in_sizes, out_sizes):
        if m == 0:
            rows.append(0)
        else:
            a, b = window(o0, o0 + m)
            a, b = max(a, 0), min(b, L)
            rows.append(max(b - a, 0) - max(min(b, start + s) - max(a, start), 0))
        start, o0 = start + s, o0 + m
    want = sum(rows) * row_bytes
    assert stats.bytes(op, pass_="forward") == want > 0
    assert stats.bytes(op, pass_="backward") == want  # the transpose sends them back
    assert stats.calls() == 2 * len(in_sizes)  # no size exchange
    assert stats.bytes() == 2 * want
