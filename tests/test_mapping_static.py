"""Static layouts: a shard_map body's size exchanges happen on its first call only.

Layers given a ``P`` learn their inputs' uneven sizes from every rank's shape (an int64
all_gather named "<op> sizes"; a host synchronisation per layer on GPUs). After the
first call with given input layouts, shard_map hands the body what those exchanges
learnt: zero "sizes" collectives per step, the values unchanged (compared bit for bit
with ``static_layouts=False``, which exchanges every call).
"""
from __future__ import annotations

import pytest
import torch
from nn.test_unet import _data as unet_data
from nn.test_unet import _model as unet_model

import spmd
from spmd import P, SpecError, demo

F64 = torch.float64
SPEC = P(None, None, "sp")


def _sizes_calls(stats, rank=None) -> int:
    return sum(1 for r in stats.records if r[0].endswith(" sizes") and rank in (None, r[2]))


def _steps(mesh, model, x, t, steps=3, static=True):
    """Per step: the loss, and the "sizes" collectives this process counted."""
    sharded = spmd.nn.convert(model, mesh, SPEC)
    n = t.numel()
    f = spmd.shard_map(lambda x, t: spmd.psum(((sharded(x) - t) ** 2).sum(), "sp") / n,
                       mesh, (SPEC, SPEC), P(), static_layouts=static)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        with spmd.comm_stats() as st:
            loss = f(x, t)
            loss.backward()
        opt.step()
        out.append((loss.item(), _sizes_calls(st)))
    params = [p.detach().clone() for p in sharded.parameters()]
    return out, params


@pytest.mark.parametrize("which", ["demo", "unet"])
def test_no_size_exchange_after_the_first_step_and_the_same_values(which):
    mesh = spmd.Mesh((4,), ("sp",))
    if which == "demo":
        model = demo.make_model(hidden=4, dtype=F64)
        x, t = demo.heat_data(2, 18, 8, dtype=F64)   # 18 rows over 4: [5, 5, 4, 4]
    else:
        model = unet_model()
        x, t = unet_data((2, 1, 18, 10))             # pooled rows [3, 2, 2, 2]
    got, p_static = _steps(mesh, model, x, t)
    want, p_dynamic = _steps(mesh, model, x, t, static=False)
    # A converted model exchanges no sizes at all, static layouts or not: its layers'
    # layouts flow from the inputs' (spmd.nn.flow), which shard_map knows.
    assert [c for _, c in got] == [c for _, c in want] == [0, 0, 0]
    assert [v for v, _ in got] == [v for v, _ in want]
    assert all(torch.equal(a, b) for a, b in zip(p_static, p_dynamic))


def test_new_input_layouts_or_python_arguments_exchange_again():
    mesh = spmd.Mesh((3,), ("sp",))
    w = torch.randn(2, 2, 3, 3, dtype=F64)

    def body(x, k):
        return spmd.ops.conv2d(x * k, w, mesh=mesh, spec=SPEC, padding=1)

    f = spmd.shard_map(body, mesh, (SPEC, None), SPEC)
    for shape, k, fresh in [((1, 2, 10, 4), 1.0, True), ((1, 2, 10, 4), 1.0, False),
                            ((1, 2, 11, 4), 1.0, True), ((1, 2, 10, 4), 2.0, True),
                            ((1, 2, 10, 4), 2.0, False)]:
        x = torch.randn(shape, dtype=F64)
        with spmd.comm_stats() as st:
            y = f(x, k)
        assert (_sizes_calls(st) > 0) == fresh, (shape, k)
        torch.testing.assert_close(y, torch.nn.functional.conv2d(x * k, w, padding=1),
                                   rtol=1e-12, atol=1e-12)


def test_control_flow_that_changes_the_calls_exchanges_again():
    mesh = spmd.Mesh((2,), ("sp",))
    w = torch.randn(1, 1, 3, 3, dtype=F64)
    pool_first = [False]

    def body(x):
        if pool_first[0]:  # the same on every rank: the calls' sequence changes
            x = spmd.ops.max_pool2d(x, 2, mesh=mesh, spec=SPEC)
        return spmd.ops.conv2d(x, w, mesh=mesh, spec=SPEC, padding=1)

    f = spmd.shard_map(body, mesh, SPEC, SPEC)
    x = torch.randn(1, 1, 9, 6, dtype=F64)
    f(x)
    pool_first[0] = True
    with spmd.comm_stats() as st:
        y = f(x)
    # The pool's and the conv's, on each rank: nothing is taken from the first call.
    assert _sizes_calls(st, rank=0) == _sizes_calls(st, rank=1) == 2
    want = torch.nn.functional.conv2d(torch.nn.functional.max_pool2d(x, 2), w, padding=1)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    with spmd.comm_stats() as st:
        f(x)
    assert _sizes_calls(st) == 0


def test_shapes_that_depend_on_more_than_the_inputs_raise():
    mesh = spmd.Mesh((2,), ("sp",))
    w = torch.randn(1, 1, 3, 3, dtype=F64)
    rows = [4]

    def body(x):  # the closure decides how many local rows go on: not in any input
        return spmd.ops.conv2d(x[:, :, :rows[0]], w, mesh=mesh, spec=SPEC, padding=1)

    x = torch.randn(1, 1, 10, 4, dtype=F64)
    f = spmd.shard_map(body, mesh, SPEC, SPEC)
    f(x)
    rows[0] = 3
    with pytest.raises(SpecError, match="previous call of this shard_map body with the same "
                                        "input layouts had \\[1, 1, 4, 4\\]"):
        f(x)
    g = spmd.shard_map(body, mesh, SPEC, SPEC, static_layouts=False)
    y = g(x)
    assert y.shape == (1, 1, 6, 4)


def _gloo_demo(mesh):
    model = demo.make_model(hidden=4, dtype=F64)
    x, t = demo.heat_data(2, 13, 8, dtype=F64)
    return _steps(mesh, model, x, t)[0]


@pytest.mark.gloo
def test_gloo_demo_steps_after_the_first_exchange_no_sizes(gloo2):
    got = gloo2.run(_gloo_demo, (2,), ("sp",))
    for steps in got:  # a converted model: the layouts flow, no step exchanges sizes
        assert [c for _, c in steps] == [0, 0, 0]
    assert got[0] == got[1]
