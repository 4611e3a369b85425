"""The reduction header (spmd/comm/_header.py), on a model of what the wire does.

The model: ranks' headers are combined in some order (a chain, as a ring's reduce-scatter
does, or a random binary tree), each combination applied by one rank with its own wire
op in its own dtype, reading the bytes it receives as that dtype. The claim under test:
when every rank calls alike, every rank's header reads back as expected; when any rank
differs in op, dtype or shape, no rank's does, whatever the order and whoever combines.
The gloo tests (tests/comm/test_distributed.py) check the same on real processes.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spmd.comm import _header
from spmd.comm.distributed import _DCODE, _reducible

DTYPES = [torch.float32, torch.int32, torch.float16, torch.bfloat16, torch.int16,
          torch.float64, torch.int64, torch.uint8, torch.int8, torch.bool]
SHAPES = [(), (4,), (2, 2), (4, 1), (1, 4), (2, 3), (3, 2)]


def _header_of(op, dtype, shape, n):
    wire = _reducible(torch.empty(0, dtype=dtype)).dtype
    return _header.header_for(op, dtype, wire, shape, n, _DCODE[dtype]), wire


def _combine(acc, rank_op, wire, own):
    a = acc.view(wire)
    out = a + own if rank_op == "sum" else torch.maximum(a, own)
    return out.view(acc.dtype)


def _reduce(calls, heads, order, tree: bool):
    """The header every rank reads back, combined in ``order`` (chain or tree)."""
    def op_of(q):
        return _header.wire_op(calls[q][0], calls[q][1])
    if not tree:
        acc = heads[order[0]][0].send.clone()
        for q in order[1:]:
            h, w = heads[q]
            acc = _combine(acc, op_of(q), w, h.send)
        return acc
    # A binary tree: at each node the root rank of the right subtree combines.
    items = [(q, heads[q][0].send.clone()) for q in order]
    while len(items) > 1:
        nxt = []
        for i in range(0, len(items) - 1, 2):
            (_, left), (q, right) = items[i], items[i + 1]
            nxt.append((q, _combine(left, op_of(q), heads[q][1], right.view(heads[q][1]))))
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0][1]


def _same(calls) -> bool:
    # A bool sum is a logical or, the same call as a bool max.
    return len({("max" if d == torch.bool and o == "sum" else o, d, s)
                for o, d, s in calls}) == 1


@st.composite
def _calls(draw):
    n = draw(st.integers(2, 8))
    size = draw(st.sampled_from([1, 2, 4, 8]))
    dts = [d for d in DTYPES if torch.empty(0, dtype=d).element_size() == size]
    base = (draw(st.sampled_from(["sum", "max", "min"])), draw(st.sampled_from(dts)),
            draw(st.sampled_from(SHAPES)))
    # Mostly alike, with a few ranks changing one thing (the realistic mistake).
    calls = []
    for _ in range(n):
        c = list(base)
        if draw(st.integers(0, 3)) == 0:
            k = draw(st.integers(0, 2))
            c[k] = draw(st.sampled_from([["sum", "max", "min"], dts, SHAPES][k]))
        calls.append(tuple(c))
    return calls


@given(_calls(), st.randoms(use_true_random=False), st.booleans())
def test_every_rank_sees_a_difference_and_none_sees_one_that_is_not_there(calls, rnd, tree):
    n = len(calls)
    heads = [_header_of(op, dt, sh, n) for op, dt, sh in calls]
    if any(h is None for h, _ in heads):  # 8-bit sums of more ranks than they count
        return
    order = list(range(n))
    rnd.shuffle(order)
    got = _reduce(calls, heads, order, tree)
    seen = [h.ok(got.view(w)) for h, w in heads]
    if _same(calls):
        assert all(seen), calls
    else:
        assert not any(seen), (calls, order, tree, seen)


def test_every_order_of_one_max_among_mins_and_maxes():
    """The case that rules out sending min as min: max(min(h, h_min), h) == h erases
    the min rank's marks, so min travels as max of reversed values."""
    calls = [("max", torch.float32, (4,)), ("min", torch.float32, (4,)),
             ("max", torch.float32, (4,))]
    heads = [_header_of(*c, 3) for c in calls]
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0], [0, 2, 1]):
        got = _reduce(calls, heads, order, tree=False)
        assert not any(h.ok(got.view(w)) for h, w in heads), order


def test_no_header_where_the_wire_cannot_count_the_ranks():
    assert _header_of("sum", torch.bfloat16, (4,), 256)[0] is not None
    assert _header_of("sum", torch.bfloat16, (4,), 257)[0] is None  # bf16 counts to 256
    assert _header_of("max", torch.bfloat16, (4,), 4096)[0] is not None  # max does not count
    assert _header_of("sum", torch.int8, (4,), 127)[0] is not None
    assert _header_of("sum", torch.int8, (4,), 128)[0] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.uint8,
                                   torch.int64, torch.bool])
def test_reversing_turns_max_into_min(dtype):
    rng = random.Random(1)
    if dtype == torch.bool:
        xs = [torch.tensor([rng.random() < 0.5 for _ in range(9)]) for _ in range(3)]
        wire = [x.view(torch.uint8).clone() for x in xs]
    elif dtype.is_floating_point:
        xs = [torch.tensor([rng.uniform(-5, 5) for _ in range(9)], dtype=dtype)
              for _ in range(3)]
        wire = [x.clone() for x in xs]
    else:
        info = torch.iinfo(dtype)
        xs = [torch.tensor([rng.choice([info.min, info.max, 0, 1, -1 if info.min else 2])
                            for _ in range(9)], dtype=dtype) for _ in range(3)]
        wire = [x.clone() for x in xs]
    rev = [_header.reverse_(w) for w in wire]
    m = rev[0]
    for w in rev[1:]:
        m = torch.maximum(m, w)
    got = _header.reverse_(m)
    want = torch.stack(xs).amin(0) if dtype != torch.bool else torch.stack(xs).all(0)
    assert torch.equal(got.view(dtype) if dtype == torch.bool else got, want)
