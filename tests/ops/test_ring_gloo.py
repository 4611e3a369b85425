"""``spmd.ops.ring_attention`` on real gloo processes (world 2 and 4): the threads tests'
float64 comparison with SDPA (values and gradients to 1e-10, see test_ring.py),
a few cases, since CI has 2 cores. The transfers are real asynchronous all_to_alls here:
several in flight at once in backward (the K/V block and the dK/dV accumulator)."""
from __future__ import annotations

import math

import pytest
import torch
from test_ring import _qkv, check

import spmd

pytestmark = pytest.mark.gloo


def _cases_2(mesh):
    q, k, v = _qkv(b=2, hq=4, hkv=2, lq=13, s=9, e=8, ev=5)
    check(mesh, q, k, v, causal=True, gqa=True, q_sizes=(13, 0), kv_sizes=(4, 5))
    mask = torch.rand(13, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    check(mesh, q, k, v, mask=mask, causal=True, gqa=True, zigzag=True)
    fmask = torch.randn(2, 1, 13, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fmask[0, 0, 3] = -math.inf  # a fully masked row
    check(mesh, q, k, v, mask=fmask, gqa=True)
    with spmd.comm_stats() as stats:
        check(mesh, *_qkv(lq=8, s=8), causal=True)
    # each process counts its own: forward n-1 = 1 K/V block, backward 1 K/V + 1 dK/dV
    return sorted((op, p, c, b) for (op, _, p), (c, b) in stats.by_op().items()
                  if op.startswith("ring_attention"))


def _cases_4(mesh):
    # zigzag of 3 queries over 8 chunks: q sizes (1, 1, 1, 0), an empty shard; kv (1, 2, 2, 2)
    q, k, v = _qkv(lq=3, s=7)
    check(mesh, q, k, v, causal=True, zigzag=True)
    return True


def test_world_2(gloo2):
    got = gloo2.run(_cases_2, (2,), ("sp",))
    block = 4 * 2 * 16 * 8  # this rank's 4 K/V positions, 2 heads, E + Ev = 16, float64
    want = [("ring_attention", "backward", 1, block), ("ring_attention", "forward", 1, block),
            ("ring_attention dkv", "backward", 1, block),
            ("ring_attention sizes", "forward", 1, 4 * 4 * 8)]  # q, k, v, mask shapes
    assert got == [want, want]


def test_world_4(gloo4):
    assert gloo4.run(_cases_4, (4,), ("sp",)) == [True] * 4
