"""spmd.ops on real gloo processes (world 2 and 4): the same checks as tests/ops/test_conv.py
(float64 single-device comparison, tolerance in tests/_ops.py), a few cases each, since
CI has 2 cores. Per-rank functions are module-level so spawned workers can import them.
"""
from __future__ import annotations

import pytest
from test_conv import run_conv, run_convt

from spmd import Layout, P

pytestmark = pytest.mark.gloo


def _conv_case(mesh, case):
    spec = P(*case.pop("spec"))
    shape = case["shape"]
    lay = Layout(shape, spec, mesh, case.pop("sizes", None))
    kind = case.pop("kind")
    base = dict(mesh=mesh, lay=lay, bias=True, by_layout=False, seed=7, groups=1, c_out=2,
                dilation=1, mode="zeros")
    (run_convt if kind == "convt" else run_conv)({**base, **case})
    return True


def _cases(mesh, cases):
    return [_conv_case(mesh, dict(c)) for c in cases]


CASES_2 = [
    dict(kind="conv", n=1, shape=(2, 2, 27), spec=(None, None, "sp"), sizes={2: [20, 7]},
         k=(3,), stride=(2,), padding=1),
    dict(kind="conv", n=2, shape=(1, 2, 7, 6), spec=(None, None, "sp"), sizes={2: [1, 6]},
         k=(5, 3), stride=(1, 1), padding=2, mode="reflect"),
    dict(kind="convt", n=2, shape=(1, 2, 5, 4), spec=(None, None, None, "sp"), k=(3, 3),
         stride=(2, 2), dilation=(1, 1), padding=(1, 1), output_padding=(1, 0)),
]
CASES_4 = [
    dict(kind="conv", n=1, shape=(2, 2, 27), spec=(None, None, "sp"), k=(3,), stride=(2,),
         padding=1),
    dict(kind="conv", n=1, shape=(2, 2, 8), spec=(None, None, "sp"), sizes={2: [2, 0, 5, 1]},
         k=(5,), stride=(1,), padding=2, mode="circular"),
]
CASES_2X2 = [
    dict(kind="conv", n=2, shape=(1, 2, 9, 7), spec=(None, None, "x", "y"), k=(3, 3),
         stride=(1, 2), padding=1, mode="circular"),
    dict(kind="convt", n=2, shape=(1, 2, 4, 5), spec=(None, None, "x", "y"), k=(2, 3),
         stride=(2, 1), dilation=(1, 2), padding=(0, 1), output_padding=(1, 0)),
]


def test_conv_world_2(gloo2):
    assert gloo2.run(_cases, (2,), ("sp",), args=(CASES_2,)) == [[True] * len(CASES_2)] * 2


def test_conv_world_4(gloo4):
    assert gloo4.run(_cases, (4,), ("sp",), args=(CASES_4,)) == [[True] * len(CASES_4)] * 4
    assert gloo4.run(_cases, (2, 2), ("x", "y"), args=(CASES_2X2,)) == [[True] * 2] * 4
