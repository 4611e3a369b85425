"""spmd.ops pools on real gloo processes (world 2): the same checks as tests/ops/test_pool.py
(float64 single-device comparison: max values and indices exactly, gradients within
tests/_ops.py's tolerance), a few cases, since CI has 2 cores. Per-rank functions are
module-level so spawned workers can import them.
"""
from __future__ import annotations

import pytest
from test_pool import run_pool

from spmd import Layout, P

pytestmark = pytest.mark.gloo


def _pool_cases(mesh, cases):
    out = []
    for c in cases:
        c = dict(c)
        lay = Layout(c.pop("shape"), P(*c.pop("spec")), mesh, c.pop("sizes", None))
        run_pool(dict(c, mesh=mesh, lay=lay, seed=7))
        out.append(True)
    return out


CASES_2 = [
    dict(op="max_pool2d", shape=(2, 2, 9, 6), spec=(None, None, "sp"), sizes={2: [1, 8]},
         kw=dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, return_indices=True)),
    dict(op="avg_pool1d", shape=(2, 2, 27), spec=(None, None, "sp"), sizes={2: [20, 7]},
         kw=dict(kernel_size=4, stride=3, padding=2, ceil_mode=True, count_include_pad=False)),
    dict(op="adaptive_max_pool2d", shape=(1, 3, 7, 5), spec=(None, None, None, "sp"),
         kw=dict(output_size=(3, 4), return_indices=True), values="ties"),
    dict(op="adaptive_avg_pool1d", shape=(2, 3, 10), spec=(None, "sp", None),
         sizes={1: [1, 2]}, kw=dict(output_size=7), by_layout=True),
]


def test_pools_world_2(gloo2):
    assert gloo2.run(_pool_cases, (2,), ("sp",), args=(CASES_2,)) == [[True] * len(CASES_2)] * 2
