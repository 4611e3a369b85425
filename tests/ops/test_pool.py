"""spmd.ops pooling: outputs and input gradients equal the float64 single-device results
(max values and indices exactly; avg and gradients within tests/_ops.py's tolerance) for
every kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override,
output size, mesh shape and uneven split; only halo bytes move; what torch refuses raises
the same error on every rank before data moves.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops import F64, TOL, assert_only_halo_bytes, errors_on_every_rank, mesh_and_spec
from hypothesis import event, given, settings
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst

EXACT = dict(rtol=0, atol=0, equal_nan=True)


def _input(shape, values: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if values == "ties":  # few distinct values: torch's pick among equal maxima matters
        return torch.randint(-2, 3, shape, generator=g).to(F64)
    x = torch.randn(shape, generator=g, dtype=F64)
    if values == "-inf":  # windows whose real elements are all -inf
        x[torch.rand(shape, generator=g) < 0.6] = float("-inf")
    return x


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _window_without_data(shape, kw) -> bool:
    """A dilated max-pool window that reads only padding (e.g. L=1, k=2, d=2, p=1):
    torch returns -inf and an index past the dim, and its backward writes the gradient
    there (into the next plane's memory); we return the same value and index, and drop
    that gradient."""
    n = len(shape) - 2
    k, p, d = (_nt(kw.get(a, dflt), n) for a, dflt in
               (("kernel_size", 1), ("padding", 0), ("dilation", 1)))
    s = k if kw.get("stride") is None else _nt(kw["stride"], n)
    ceil = kw.get("ceil_mode", False)
    for L, kk, ss, pp, dd in zip(shape[2:], k, s, p, d):
        n_out = (L + 2 * pp - dd * (kk - 1) - 1 + (ss - 1 if ceil else 0)) // ss + 1
        if ceil and (n_out - 1) * ss >= L + pp:
            n_out -= 1
        if any(all(not 0 <= o * ss - pp + dd * j < L for j in range(kk)) for o in range(n_out)):
            return True
    return False


def _nt(v, n):
    return (v,) * n if isinstance(v, int) else tuple(v)


def run_pool(c):
    """``spmd.ops.<op>`` against ``F.<op>`` on the global input: max values and indices
    exactly, outputs and input gradients by assert_matches_single_device; a torch refusal must be raised by
    the sharded call too."""
    name, kw, mesh, lay = c["op"], c["kw"], c["mesh"], c["lay"]
    x = _input(lay.shape, c.get("values", "randn"), c["seed"])
    op, ref = getattr(spmd.ops, name), getattr(F, name)
    spec = lay if c.get("by_layout") else lay.spec

    def local(x):
        return op(x, **kw, mesh=mesh, spec=spec)

    try:
        want = ref(x, **kw)
    except RuntimeError:  # torch refuses this on one device: so must every rank
        event("torch refuses")
        with pytest.raises(RuntimeError):
            spmd.shard_map(local, mesh, lay, lay.spec)(x)
        return None
    out_lay = op.output_layout(lay, **kw)
    if "max" in name:  # values and indices: exactly torch's
        ri = kw.get("return_indices", False)
        got = spmd.shard_map(local, mesh, lay, (out_lay, out_lay) if ri else out_lay)(x)
        torch.testing.assert_close(_first(got), _first(want), **EXACT)
        if ri:
            assert torch.equal(got[1], want[1]), f"indices {got[1]} != {want[1]}"
        if _window_without_data(lay.shape, kw):
            event("a window without data")
            return None
    # an empty output: torch's adaptive_max backward refuses it, so compare values only
    return assert_matches_single_device(
        lambda x: _first(local(x)), lambda x: _first(ref(x, **kw)), mesh, lay, out_lay, x,
        seed=c["seed"], check_grad=_first(want).numel() > 0, **TOL)


# -- hypothesis -------------------------------------------------------------------------------

@st.composite
def pool_cases(draw, n, kind):
    mesh, spec = mesh_and_spec(draw, n, channels=True)
    lo_len, hi_len, hi_k = {1: (1, 14, 4), 2: (1, 8, 4), 3: (2, 5, 3)}[n]
    lens = [draw(st.integers(lo_len, hi_len)) for _ in range(n)]
    batch = 2 if "dp" in mesh.axis_names else draw(st.integers(1, 2))
    channels = draw(st.integers(1, 3)) if "c" in mesh.axis_names else draw(st.integers(1, 2))
    shape = (batch, channels, *lens)
    k = tuple(draw(st.integers(1, hi_k)) for _ in range(n))
    # mostly padding torch accepts (at most k // 2), sometimes one more: a refusal
    p = tuple(draw(st.integers(0, kk // 2 + (draw(st.integers(0, 5)) == 0))) for kk in k)
    stride = draw(st.one_of(st.none(), st.tuples(*[st.integers(1, 3)] * n)))
    kw = dict(kernel_size=k if draw(st.booleans()) or n == 1 else k[0] if len(set(k)) == 1 else k,
              stride=stride, padding=p, ceil_mode=draw(st.booleans()))
    if kind == "max":
        kw.update(dilation=tuple(draw(st.integers(1, 2)) for _ in range(n)),
                  return_indices=draw(st.booleans()))
        values = draw(st.sampled_from(["randn", "ties", "-inf"]))
    else:
        kw["count_include_pad"] = draw(st.booleans())
        if n > 1 and draw(st.integers(0, 3)) == 0:
            kw["divisor_override"] = draw(st.sampled_from([-3, 0, 1, 2, 5]))
        values = "randn"
    return dict(op=f"{kind}_pool{n}d", kw=kw, mesh=mesh, lay=draw(sst.layouts(shape, mesh, spec)),
                values=values, by_layout=draw(st.booleans()), seed=draw(st.integers(0, 99)))


@st.composite
def adaptive_cases(draw, n, kind):
    mesh, spec = mesh_and_spec(draw, n, channels=True)
    hi_len = {1: 14, 2: 8, 3: 5}[n]
    lens = [draw(st.integers(1, hi_len)) for _ in range(n)]
    batch = 2 if "dp" in mesh.axis_names else draw(st.integers(1, 2))
    shape = (batch, draw(st.integers(1, 3)), *lens)
    size = [draw(st.one_of(st.integers(0, L + 3), st.just(L), st.just(1))) for L in lens]
    if n > 1:
        size = [None if draw(st.integers(0, 4)) == 0 else s for s in size]
    out = size[0] if n == 1 and draw(st.booleans()) else tuple(size)
    kw = dict(output_size=out)
    values = "randn"
    if kind == "max":
        kw["return_indices"] = draw(st.booleans())
        values = draw(st.sampled_from(["randn", "ties", "-inf"]))
    return dict(op=f"adaptive_{kind}_pool{n}d", kw=kw, mesh=mesh,
                lay=draw(sst.layouts(shape, mesh, spec)), values=values,
                by_layout=draw(st.booleans()), seed=draw(st.integers(0, 99)))


@settings(max_examples=150)
@given(c=pool_cases(1, "max"))
def test_max_pool1d_matches_single_device(c):
    run_pool(c)


@settings(max_examples=150)
@given(c=pool_cases(2, "max"))
def test_max_pool2d_matches_single_device(c):
    run_pool(c)


@settings(max_examples=120)
@given(c=pool_cases(1, "avg"))
def test_avg_pool1d_matches_single_device(c):
    run_pool(c)


@settings(max_examples=120)
@given(c=pool_cases(2, "avg"))
def test_avg_pool2d_matches_single_device(c):
    run_pool(c)


@settings(max_examples=40)
@given(c=st.sampled_from(["max", "avg"]).flatmap(lambda k: pool_cases(3, k)))
def test_pool3d_matches_single_device(c):
    run_pool(c)


@settings(max_examples=120)
@given(c=st.sampled_from([1, 2]).flatmap(lambda n: adaptive_cases(n, "max")))
def test_adaptive_max_pool_matches_single_device(c):
    run_pool(c)


@settings(max_examples=120)
@given(c=st.sampled_from([1, 2]).flatmap(lambda n: adaptive_cases(n, "avg")))
def test_adaptive_avg_pool_matches_single_device(c):
    run_pool(c)


@settings(max_examples=40)
@given(c=st.sampled_from(["max", "avg"]).flatmap(lambda k: adaptive_cases(3, k)))
def test_adaptive_pool3d_matches_single_device(c):
    run_pool(c)


# -- named cases ---------------------------------------------------------------------------------

def _named(op, L, ranks, sizes=None, values="randn", **kw):
    mesh = spmd.Mesh((ranks,), ("sp",))
    lay = Layout((2, 3, L), P(None, None, "sp"), mesh, {2: sizes} if sizes else None)
    return run_pool(dict(op=op, kw=kw, mesh=mesh, lay=lay, values=values, seed=5))


def test_stride_not_kernel_and_overlapping_windows():
    """PhysicsNeMo pools only with stride == kernel; here windows overlap (k3 s2) or
    leave gaps (k2 s3), and shard offsets are not multiples of the stride."""
    for op in ("max_pool1d", "avg_pool1d"):
        assert _named(op, 27, 4, kernel_size=3, stride=2, padding=1).shape[-1] == 14
        assert _named(op, 27, 4, kernel_size=2, stride=3).shape[-1] == 9
    _named("max_pool1d", 27, 4, kernel_size=3, stride=1, dilation=3, return_indices=True)


def test_ceil_mode_window_past_the_end_on_the_last_rank():
    mesh = spmd.Mesh((3,), ("sp",))
    lay = Layout((1, 1, 10), P(None, None, "sp"), mesh)
    out = spmd.ops.max_pool1d.output_layout(lay, 3, 2, ceil_mode=True)
    assert out.shape[2] == 5 and out.sizes[2] == (2, 2, 1)  # last window [8, 11)
    for op, kw in [("max_pool1d", dict(return_indices=True)),
                   ("avg_pool1d", dict(count_include_pad=True)),
                   ("avg_pool1d", dict(count_include_pad=False))]:
        _named(op, 10, 3, kernel_size=3, stride=2, ceil_mode=True, **kw)
        # with padding: the last window reaches past the padded end, [8, 12) for L + p = 11
        _named(op, 10, 3, kernel_size=4, stride=3, padding=1, ceil_mode=True, **kw)


def test_shard_of_size_1_with_kernel_3():
    for op in ("max_pool1d", "avg_pool1d"):
        _named(op, 8, 8, kernel_size=3, stride=1, padding=1)
        _named(op, 9, 4, sizes=[1, 1, 6, 1], kernel_size=3, stride=1, padding=1)
        _named(op, 9, 4, sizes=[3, 1, 0, 5], kernel_size=3, stride=2, padding=1)


def test_adaptive_to_sizes_that_do_not_divide_the_input():
    for size in (3, 4, 7, 10, 13, 1):
        _named("adaptive_avg_pool1d", 10, 4, output_size=size)
        _named("adaptive_max_pool1d", 10, 4, output_size=size, return_indices=True)
        _named("adaptive_max_pool1d", 10, 3, sizes=[0, 9, 1], output_size=size,
               return_indices=True, values="ties")
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    lay = Layout((1, 2, 11, 9), P(None, None, "x", "y"), mesh, {2: [2, 9]})
    for op, kw in [("adaptive_max_pool2d", dict(output_size=(4, 5), return_indices=True)),
                   ("adaptive_avg_pool2d", dict(output_size=(7, None)))]:
        run_pool(dict(op=op, kw=kw, mesh=mesh, lay=lay, seed=1))


def test_adaptive_pool_to_the_input_size_moves_nothing():
    mesh = spmd.Mesh((4,), ("sp",))
    lay = Layout((1, 2, 10), P(None, None, "sp"), mesh, {2: [1, 6, 0, 3]})
    out = spmd.ops.adaptive_avg_pool1d.output_layout(lay, 10)
    assert out.sizes[2] == (1, 6, 0, 3)
    f = lambda x: spmd.ops.adaptive_avg_pool1d(x, 10, mesh=mesh, spec=lay)
    x = torch.randn(1, 2, 10, dtype=F64, requires_grad=True)
    with spmd.comm_stats() as stats:
        spmd.shard_map(f, mesh, lay, out)(x).sum().backward()
    assert stats.bytes() == 0
    assert torch.equal(x.grad, torch.ones_like(x))


def test_nan_and_inf_are_picked_as_torch_picks_them():
    """torch's max pools pick the last NaN of a window, and for a window whose real
    elements are all -inf, its first real element (not the padding)."""
    mesh = spmd.Mesh((3,), ("sp",))
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([-inf, -inf, 1.0, nan, 2.0, nan, 0.0, -inf, -inf, nan, 3.0, 3.0],
                     dtype=F64).view(1, 1, -1)
    lay = Layout(x.shape, P(None, None, "sp"), mesh, {2: [1, 6, 5]})
    cases = [("max_pool1d", dict(kernel_size=3, stride=1, padding=1, return_indices=True)),
             ("max_pool1d", dict(kernel_size=2, stride=2, padding=1, dilation=3,
                                 return_indices=True)),
             ("adaptive_max_pool1d", dict(output_size=5, return_indices=True))]
    for name, kw in cases:
        op, ref = getattr(spmd.ops, name), getattr(F, name)
        f = lambda x, op=op, kw=kw: op(x, **kw, mesh=mesh, spec=lay)
        out = op.output_layout(lay, **kw)
        y, i = spmd.shard_map(f, mesh, lay, (out, out))(x)
        ry, ri = ref(x, **kw)
        torch.testing.assert_close(y, ry, **EXACT)
        assert torch.equal(i, ri), (name, i, ri)
    x2 = x.view(1, 1, 3, 4).transpose(2, 3).contiguous()  # the same in 2-d, split both ways
    mesh2 = spmd.Mesh((2, 2), ("x", "y"))
    lay2 = Layout(x2.shape, P(None, None, "x", "y"), mesh2, {2: [3, 1], 3: [1, 2]})
    for name, kw in [("max_pool2d", dict(kernel_size=3, stride=1, padding=1,
                                         return_indices=True)),
                     ("adaptive_max_pool2d", dict(output_size=(3, 2), return_indices=True))]:
        op, ref = getattr(spmd.ops, name), getattr(F, name)
        f = lambda x, op=op, kw=kw: op(x, **kw, mesh=mesh2, spec=lay2)
        out = op.output_layout(lay2, **kw)
        y, i = spmd.shard_map(f, mesh2, lay2, (out, out))(x2)
        ry, ri = ref(x2, **kw)
        torch.testing.assert_close(y, ry, **EXACT)
        assert torch.equal(i, ri), (name, i, ri)


def test_3d_pools_on_a_2d_mesh_with_empty_shards():
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    lay = Layout((1, 2, 5, 6, 3), P(None, None, "x", "y"), mesh, {2: [1, 4], 3: [6, 0]})
    for op, kw in [("max_pool3d", dict(kernel_size=(3, 2, 3), stride=(2, 1, 2),
                                       padding=(1, 0, 1), dilation=(1, 2, 1),
                                       ceil_mode=True, return_indices=True)),
                   ("avg_pool3d", dict(kernel_size=3, stride=(1, 2, 1), padding=1,
                                       ceil_mode=True, count_include_pad=False)),
                   ("avg_pool3d", dict(kernel_size=2, divisor_override=3)),
                   ("adaptive_max_pool3d", dict(output_size=(2, None, 2), return_indices=True)),
                   ("adaptive_avg_pool3d", dict(output_size=(4, 4, 1)))]:
        run_pool(dict(op=op, kw=kw, mesh=mesh, lay=lay, seed=2))


def test_split_channels_and_batch_move_nothing_along_them():
    """Pooling is per channel: with N and C split and the spatial dims whole, no rank
    needs anything from another."""
    mesh = spmd.Mesh((2, 2), ("dp", "c"))
    lay = Layout((3, 5, 7, 6), P("dp", "c"), mesh, {0: [3, 0], 1: [1, 4]})
    for op, kw in [("max_pool2d", dict(kernel_size=3, stride=2, padding=1,
                                       return_indices=True)),
                   ("avg_pool2d", dict(kernel_size=2, ceil_mode=True)),
                   ("adaptive_max_pool2d", dict(output_size=(3, 4))),
                   ("adaptive_avg_pool2d", dict(output_size=2))]:
        with spmd.comm_stats() as stats:
            run_pool(dict(op=op, kw=kw, mesh=mesh, lay=lay, by_layout=True, seed=3))
        assert stats.bytes() == 0, (op, str(stats))


def test_output_layout_is_kept_for_stride_1_else_balanced():
    mesh = spmd.Mesh((4,), ("sp",))
    lay = Layout((1, 2, 9), P(None, None, "sp"), mesh, {2: [0, 6, 0, 3]})
    assert spmd.ops.max_pool1d.output_layout(lay, 3, 1, 1).sizes[2] == (0, 6, 0, 3)
    assert spmd.ops.avg_pool1d.output_layout(lay, 3, 1, 1).sizes[2] == (0, 6, 0, 3)
    assert spmd.ops.max_pool1d.output_layout(lay, 3, 2, 1).sizes[2] == (2, 1, 1, 1)
    assert spmd.ops.adaptive_max_pool1d.output_layout(lay, 5).sizes[2] == (2, 1, 1, 1)
    _named("max_pool1d", 9, 4, sizes=[0, 6, 0, 3], kernel_size=3, stride=1, padding=1)


# -- bytes moved -------------------------------------------------------------------------------

@pytest.mark.parametrize("op,k,stride,padding,sizes", [
    ("max_pool2d", 3, 1, 1, None), ("max_pool2d", 3, 1, 1, [2, 9, 1, 4]),
    ("max_pool2d", 3, 2, 1, None), ("avg_pool2d", 2, 2, 0, [5, 3, 5, 3])])
def test_bytes_moved_equal_the_halo_bytes(op, k, stride, padding, sizes):
    mesh = spmd.Mesh((4,), ("sp",))
    C, H, W = 3, 16, 5
    lay = Layout((1, C, H, W), P(None, None, "sp"), mesh, {2: sizes} if sizes else None)
    fn = getattr(spmd.ops, op)
    out = fn.output_layout(lay, k, stride, padding)
    if stride == 1:
        assert out.sizes[2] == lay.sizes[2]  # kept: a pure halo exchange
    f = lambda x: fn(x, k, stride, padding, mesh=mesh, spec=lay)
    x = torch.randn(1, C, H, W, dtype=F64, requires_grad=True)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(f, mesh, lay, out)(x)
        y.sum().backward()
    assert_only_halo_bytes(
        stats, op, lay.sizes[2], out.sizes[2],
        lambda o0, o1: (stride * o0 - padding, stride * (o1 - 1) + k - padding), H, C * W * 8)


# -- bad input -----------------------------------------------------------------------------------

def test_torch_refusals_raise_runtime_error_on_every_rank_before_data_moves():
    mesh_lay = lambda m, shape: Layout(shape, P(None, None, "sp"), m)
    ops = spmd.ops
    cases = {
        "padding": (lambda m: ops.max_pool1d(torch.randn(1, 2, 4), 3, padding=2, mesh=m,
                                             spec=mesh_lay(m, (1, 2, 8))), "half of kernel"),
        "kernel": (lambda m: ops.avg_pool2d(torch.randn(1, 2, 4, 4), 0, mesh=m,
                                            spec=mesh_lay(m, (1, 2, 8, 4))), "kernel_size"),
        "stride": (lambda m: ops.max_pool2d(torch.randn(1, 2, 4, 4), 2, 0, mesh=m,
                                            spec=mesh_lay(m, (1, 2, 8, 4))), "stride"),
        "divisor": (lambda m: ops.avg_pool2d(torch.randn(1, 2, 4, 4), 2, divisor_override=0,
                                             mesh=m, spec=mesh_lay(m, (1, 2, 8, 4))), "divisor"),
        "too small": (lambda m: ops.max_pool1d(torch.randn(1, 2, 2), 5, mesh=m,
                                               spec=mesh_lay(m, (1, 2, 4))), "too small"),
        "empty": (lambda m: ops.adaptive_max_pool1d(torch.randn(1, 2, 0), 2, mesh=m,
                                                    spec=mesh_lay(m, (1, 2, 0))), "non-empty"),
        "negative": (lambda m: ops.adaptive_avg_pool2d(torch.randn(1, 2, 2, 2), (2, -1), mesh=m,
                                                       spec=mesh_lay(m, (1, 2, 4, 2))),
                     "greater than or equal"),
    }
    for name, (fn, text) in cases.items():
        got, stats = errors_on_every_rank(fn)
        assert all(t is RuntimeError and text in m for t, m in got), (name, got)
        assert stats.calls() == 0, (name, str(stats))


def test_integer_inputs_are_refused_on_every_rank():
    got, stats = errors_on_every_rank(
        lambda m: spmd.ops.max_pool2d(torch.zeros(1, 1, 2, 4, dtype=torch.long), 2, mesh=m,
                                      spec=P(None, None, "sp")))
    assert all(t is NotImplementedError and "floating" in m for t, m in got), got
    assert stats.calls() == 0
