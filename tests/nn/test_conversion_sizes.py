"""spmd.nn.convert refuses a number computed from a split dim's size even where Python
made it a plain number (``float(h)``, ``math.sqrt(h)``, ``0.5 * h``, ``1.0 / h``,
``int(h * 1.5)``), which no tracked int can follow: the plan runs again with other sizes
of the split dims and compares the numbers each torch call is given (``sizes.py``).

Refusals are checked for their message (layer path, source line, the fix), one line per
call site, and for moving no data (``comm_stats``); legitimate per-shard uses of the local
size are compared with one device in float64 on 4 ranks of 37 rows (10, 9, 9, 9), to
1e-12 (they only move values or add zeros; the convolution's halo sums may reorder).
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn
from torch import nn

import spmd
from spmd import P

F64 = torch.float64
H = P(None, None, "sp")  # (N, C, H, W) split along H
MESH = spmd.Mesh((4,), ("sp",))


def _x(seed=0):
    return torch.randn(2, 3, 37, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _refusal(model, example):
    """The refusal's message; nothing sent, with or without example=."""
    x = _x()
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        conv = spmd.nn.convert(model, MESH, H, **({"example": x} if example else {}))
        spmd.shard_map(conv, MESH, H, H)(x)
    assert stats.calls() == 0
    msg = str(e.value)
    assert "nothing has run" in msg and len(msg) < 2000
    return msg


# Each form was silently wrong before: a plain number, this rank's share's.
PLAIN = {
    "math.sqrt": (lambda m, x: x / math.sqrt(x.shape[2]), "div", 6.08276),
    "float()": (lambda m, x: x / float(x.shape[2]), "div", 37),
    "a float over it": (lambda m, x: x * (1.0 / x.shape[2]), "mul", 0.027027),
    "a float times it": (lambda m, x: x * (0.5 * x.shape[2]), "mul", 18.5),
    "int() of a float": (lambda m, x: x * int(x.shape[2] * 1.5), "mul", 55),
    "a fill value": (lambda m, x: x + torch.full((1,), float(x.shape[2]), dtype=x.dtype),
                     "torch.full", 37),
    "clamp": (lambda m, x: x.clamp(max=0.1 * x.shape[2]), "clamp", 3.7),
    "attention's scale": (lambda m, x: F.scaled_dot_product_attention(
        x, x, x, scale=1 / math.sqrt(x.shape[2])), "torch.scaled_dot_product_attention", 0.164399),
    "arange's end": (lambda m, x: x + torch.arange(float(x.shape[2]), dtype=x.dtype)[:, None],
                     "torch.arange", 37),
}


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("name", list(PLAIN))
def test_a_plain_number_of_a_split_size_is_refused_before_anything_runs(name, example):
    f, call, value = PLAIN[name]
    msg = _refusal(Fn(f), example)
    assert msg.count("\n  - ") == 1, msg
    assert "  - in Fn (test_conversion_sizes.py:" in msg
    assert f"{call} is given " in msg and "computed from a split dim's size" in msg
    assert ("which each rank would compute from its own share; compute it from the global "
            "size (a constant, or an argument of the model), or pass x.shape[d] itself") in msg
    # with example= the number is shown at the global size (37 rows), never a stand-in's
    assert ("at the global sizes" in msg) == example
    if example:
        assert f"{value:.6g} at the global sizes" in msg
    assert "896" not in msg and "1792" not in msg


def test_each_call_site_has_one_line():
    def f(m, x):
        for _ in range(3):  # one call site reached three times: one line
            x = x * (0.5 * x.shape[2])
        return x / math.sqrt(x.shape[2])
    msg = _refusal(Fn(f), True)
    assert msg.count("\n  - ") == 2 and "2 call(s) in Fn's forward" in msg
    assert "mul is given" in msg and "div is given" in msg


@pytest.mark.parametrize("example", [True, False])
def test_a_loop_over_a_split_size_is_refused_where_the_plans_part(example):
    def f(m, x):
        for _ in range(x.shape[2] // 8):  # each rank would add its own count
            x = x + 1
        return x * 2
    msg = _refusal(Fn(f), example)
    assert msg.count("\n  - ") == 1
    assert ("mul is reached here, where the same forward planned with other sizes of the "
            "split dims calls add: a Python loop or branch on a split dim's size "
            "(range(x.shape[d]), if x.shape[d] ...:) runs with each rank's own share") in msg

    def g(m, x):
        for _ in range(x.shape[2] // 8):
            x = x + 1
        return x
    msg = _refusal(Fn(g), example)
    assert "  - in Fn: the forward ends here, where planned with other sizes of the split " \
           "dims it goes on to call add" in msg


def _exact(f, *layers):
    x = _x()
    model = Fn(f, *layers).double()
    for example in (x, None):
        with spmd.comm_stats() as stats:
            conv = spmd.nn.convert(model, MESH, H, example=example)
            y = spmd.shard_map(conv, MESH, H, H)(x)
        assert example is None or not conv.spmd_plan.refused
        torch.testing.assert_close(y, model(x), rtol=0, atol=1e-12)
    return stats


LEGIT = {
    "view": lambda m, x: x.view(x.shape[0], x.shape[1], x.shape[2], -1) * 2,
    "reshape": lambda m, x: x.reshape(x.shape[0], x.shape[1] * 1, x.shape[2], 4, 2).sum(-1),
    "new_zeros": lambda m, x: x + x.new_zeros(x.shape),
    "zeros of a whole size": lambda m, x: x + torch.zeros(x.shape[0], 1, 1, 1, dtype=x.dtype),
    "flatten": lambda m, x: x.flatten(2) * 3,  # rows first: still split along dim 2
    "expand": lambda m, x: x[:, :1].expand(-1, 3, -1, -1) + x,
    "narrow a whole dim": lambda m, x: x.narrow(3, 1, x.shape[3] - 2),
    "split a whole dim": lambda m, x: torch.cat(x.split(x.shape[1] // 3 + 1, dim=1)[::-1], 1),
    "a whole dim's float": lambda m, x: x / math.sqrt(x.shape[3]),
    "a conv and its scale": lambda m, x: m.layers[0](x) * (1 / math.sqrt(x.shape[1])),
}


@pytest.mark.parametrize("name", list(LEGIT))
def test_per_shard_uses_of_the_local_size_convert_and_are_exact(name):
    _exact(LEGIT[name], nn.Conv2d(3, 3, 3, padding=1))


def test_a_number_that_changes_for_another_reason_is_not_blamed_on_sizes():
    """A counter outside the model and Python's random draws give other numbers in each
    planning run: a run at the plan's own sizes shows it is not the sizes."""
    count = itertools.count()
    model = Fn(lambda m, x: x * next(count))
    spmd.nn.convert(model, MESH, H, example=_x())

    def coin(m, x):
        return x * 2 if random.random() < 0.5 else x + 1
    for seed in range(8):  # the branch and the number: the same in both plans
        random.seed(seed)
        spmd.nn.convert(Fn(lambda m, x: x * random.random()), MESH, H, example=_x())
        spmd.nn.convert(Fn(coin), MESH, H, example=_x())


@pytest.mark.parametrize("example", [True, False])
def test_a_ratio_of_two_split_sizes_is_refused(example):
    """H split over one axis, W over another: the other plan changes them by different
    amounts, so their ratio (1 on a square field of 9 x 9, 5 / 4 on the shard of 5 x 4
    of two ranks) changes too, at the stand-in sizes as well as from the global ones."""
    mesh = spmd.Mesh((2, 2), ("a", "b"))
    s = P(None, None, "a", "b")
    x = torch.randn(1, 2, 9, 9, dtype=F64)
    model = Fn(lambda m, x: x * (float(x.shape[2]) / float(x.shape[3])))
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        conv = spmd.nn.convert(model, mesh, s, **({"example": x} if example else {}))
        spmd.shard_map(conv, mesh, s, s)(x)
    assert stats.calls() == 0
    assert "mul is given a number computed from a split dim's size" in str(e.value)
