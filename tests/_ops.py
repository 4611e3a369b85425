"""Shared by the tests of spmd.ops, on top of the public spmd.testing toolkit.

Each op is checked by ``assert_matches_single_device`` (shard_map against the op on one
device, both float64: output, input gradient and parameter gradients). The output spec
given to shard_map is the op's own ``output_layout``, so every run also checks that the
layout an op reports is the one it produces (shard_map refuses a local shape the layout
does not expect).

Tolerance: float64 with rtol = atol = 1e-10 (the toolkit's float64 default). The sharded
run computes the same products as one device, but weight and bias gradients are sums of
per-rank partial sums (and a conv's input gradient adds halo contributions after the
local part), so additions are reordered: a few ulps of float64, far below 1e-10 for the
O(1)-sized values used here.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.testing import strategies as sst

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def mesh_and_spec(draw, n: int, *, channels: bool = False) -> tuple[spmd.Mesh, P]:
    """Hypothesis: a mesh and the spec of an (N, C, *n spatial dims) input split over it:
    1-4 ranks over dim 2, 2-3 over the last dim, a (2, 2) mesh over two spatial dims or
    over dim 2 as the product of both axes, the batch split too (dp, sp), and with
    ``channels`` the channels split too (c, sp). The conv/pool/interpolate shapes of
    ``spmd.testing.strategies.meshes``, with the specs those ops support."""
    kinds = ["1d", "dp_sp", "xy"] + (["c_sp"] if channels else []) + (
        ["2d", "1d_last"] if n >= 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "1d":
        return draw(sst.meshes(4, ndims=1)), P(None, None, "sp")
    if kind == "1d_last":
        mesh = draw(sst.meshes(3, ndims=1).filter(lambda m: m.size >= 2))
        return mesh, P(*([None] * (n + 1)), "sp")
    if kind == "2d":
        return spmd.Mesh((2, 2), ("x", "y")), P(None, None, "x", "y")
    if kind == "xy":
        return spmd.Mesh((2, 2), ("x", "y")), P(None, None, ("x", "y"))
    if kind == "c_sp":
        return spmd.Mesh((2, 2), ("c", "sp")), P(None, "c", "sp")
    return spmd.Mesh((2, 2), ("dp", "sp")), P("dp", None, "sp")


def spatial_layout(draw, shape, mesh, spec) -> Layout:
    """Hypothesis: ``sst.layouts`` with uneven (zeros included) sizes on the spatial
    dims (>= 2) only; a split batch or channel dim stays balanced."""
    lay = draw(sst.layouts(shape, mesh, spec))
    return Layout(shape, spec, mesh, {d: lay.sizes[d] for d in lay.split_dims if d >= 2} or None)


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


def adam_steps(params, loss_fn: Callable[[], torch.Tensor], steps: int = 3,
               lr: float = 1e-2) -> list[float]:
    """``steps`` Adam steps on ``params`` (a module's, or an iterable) from ``loss_fn()``;
    the losses. The model tests train a sharded model and its one-device twin with it."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
