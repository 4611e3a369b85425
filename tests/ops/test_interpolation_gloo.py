"""spmd.ops.interpolate on real gloo processes (world 2): the checks of
tests/ops/test_interpolation.py (float64 single-device comparison, tolerance in tests/_ops.py)
on a few cases, since CI has 2 cores. Per-rank functions are module-level so spawned
workers can import them.
"""
from __future__ import annotations

import pytest
import torch
from test_interpolation import run_interp

import spmd
from spmd import Layout, P

pytestmark = pytest.mark.gloo

CASES_2 = [
    dict(shape=(1, 2, 7, 5), spec=(None, None, "sp"), sizes={2: [1, 6]},
         kw=dict(scale_factor=2, mode="bilinear", align_corners=False)),
    dict(shape=(2, 1, 6, 7), spec=(None, None, None, "sp"),
         kw=dict(scale_factor=(1.5, 0.6), mode="bicubic")),
    dict(shape=(1, 2, 10), spec=(None, None, "sp"), sizes={2: [0, 10]}, by_layout=True,
         kw=dict(size=13, mode="nearest-exact")),
    dict(shape=(1, 1, 4, 3, 5), spec=(None, None, "sp"), sizes={2: [3, 1]},
         kw=dict(size=(7, 3, 2), mode="trilinear", align_corners=True)),
]


def _cases(mesh, cases):
    out = []
    for c in cases:
        lay = Layout(c["shape"], P(*c["spec"]), mesh, c.get("sizes"))
        run_interp(dict(mesh=mesh, lay=lay, shape=c["shape"], kw=c["kw"],
                        by_layout=c.get("by_layout", False), seed=5))
        out.append(True)
    return out


def _nearest_x2_bytes(mesh):
    """Forward and backward payload bytes of a nearest x2 upsample on aligned shards."""
    lay = Layout((1, 2, 8, 3), P(None, None, "sp"), mesh)
    out = spmd.ops.interpolate.output_layout(lay, scale_factor=2)
    x = torch.randn(1, 2, 8, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    f = lambda x: spmd.ops.interpolate(x, scale_factor=2, mesh=mesh, spec=lay)
    with spmd.comm_stats() as stats:
        spmd.shard_map(f, mesh, lay, out)(x).sum().backward()
    return stats.bytes("interpolate"), stats.calls("interpolate")


def test_interpolate_world_2(gloo2):
    assert gloo2.run(_cases, (2,), ("sp",), args=(CASES_2,)) == [[True] * len(CASES_2)] * 2
    got = gloo2.run(_nearest_x2_bytes, (2,), ("sp",))
    assert got == [(0, 0), (0, 0)], got  # every rank reads only its own rows: no exchange
