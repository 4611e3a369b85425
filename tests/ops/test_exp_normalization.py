"""spmd.ops softmax, log_softmax, logsumexp: each rank's result is its part of torch's op
on the global tensor, in value and gradient, for dims split over one axis or a tuple of
axes, uneven and empty shards, rows of -inf, +inf and NaN; one all-gather forward and one
psum backward when the dim is split, nothing when it is not; bad specs and dims raise
SpecError before anything moves.

Tolerance: float64 runs within the toolkit's 1e-10 (the sharded run only reorders the
sums of exp across ranks); float32 within its 1e-5/1e-6; bfloat16 (computed in float32,
rounded once at the output and at the input gradient) within 2 bf16 ulps, 2e-2 relative
and 1e-2 absolute, vs float64.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.ops import log_softmax, logsumexp, softmax
from spmd.testing import assert_matches_single_device, on_mesh
from spmd.testing import strategies as sst

F64 = torch.float64
MESHES = [((1,), ("a",)), ((2,), ("a",)), ((3,), ("a",)), ((4,), ("a",)),
          ((2, 2), ("a", "b")), ((2, 3), ("a", "b"))]
OPS = {"softmax": (softmax, torch.softmax), "log_softmax": (log_softmax, torch.log_softmax),
       "logsumexp": (logsumexp, torch.logsumexp)}
INF, NAN = float("inf"), float("nan")


def _reduced_spec(spec: P, ndim: int, dims, keepdim: bool) -> P:
    """logsumexp's output spec: the reduced dims' entries set to None, or dropped."""
    ent = [spec.entry(d) for d in range(ndim)]
    if keepdim:
        return P(*[None if d in dims else e for d, e in enumerate(ent)])
    return P(*[e for d, e in enumerate(ent) if d not in dims])


def check(mesh, lay: Layout, xg: torch.Tensor, op: str, dim, keepdim=False,
          dtype=F64, by_layout=False, **tol):
    """shard_map of the op against torch's on the global float64 tensor; the op is given
    the spec as a ``P`` or (``by_layout``) as the ``Layout``."""
    ours, ref = OPS[op]
    spec = lay if by_layout else lay.spec
    if op == "logsumexp":
        dims = tuple(sorted(d % xg.ndim for d in ((dim,) if isinstance(dim, int) else dim)))
        out = _reduced_spec(lay.spec, xg.ndim, dims, keepdim)
        f_local = lambda x: ours(x, dim, keepdim, mesh=mesh, spec=spec)  # noqa: E731
        f_global = lambda x: ref(x, dim, keepdim)  # noqa: E731
    else:
        out = lay
        f_local = lambda x: ours(x, dim, mesh=mesh, spec=spec)  # noqa: E731
        f_global = lambda x: ref(x, dim)  # noqa: E731
    return assert_matches_single_device(f_local, f_global, mesh, lay, out, xg, dtype=dtype,
                                        **tol)


def _values(shape, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64) * 3
    if kind == "-inf":  # many -inf entries: some rows (and whole shards) of only -inf
        x[torch.rand(shape, generator=g) < 0.6] = -INF
    elif kind == "special":  # a few +inf, -inf and NaN entries
        u = torch.rand(shape, generator=g)
        x[u < 0.1] = NAN
        x[(u >= 0.1) & (u < 0.2)] = INF
        x[(u >= 0.2) & (u < 0.4)] = -INF
    return x


@st.composite
def cases(draw):
    """A mesh, an uneven layout (zero-size shards included) that splits the op's dim
    more often than not, the op, dim and keepdim."""
    mesh_shape, names = draw(st.sampled_from(MESHES))
    mesh = spmd.Mesh(mesh_shape, names)
    ndim = draw(st.integers(1, 3))
    spec = draw(sst.specs(mesh, ndim))
    sizes, shape = {}, []
    for d in range(ndim):
        e = spec.entry(d)
        if e is None:
            shape.append(draw(st.integers(1, 3)))
            continue
        n = mesh.axis_size(e)
        s = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        sizes[d] = s
        shape.append(sum(s))
    split = [d for d in range(ndim) if d in sizes]
    op = draw(st.sampled_from(sorted(OPS)))
    if op == "logsumexp" and ndim > 1 and draw(st.booleans()):
        dim = tuple(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim,
                                  unique=True)))
    elif split and draw(st.integers(0, 3)) > 0:
        dim = draw(st.sampled_from(split)) - draw(st.sampled_from([0, ndim]))
    else:
        dim = draw(st.integers(-ndim, ndim - 1))
    return dict(mesh=mesh, lay=Layout(tuple(shape), spec, mesh, sizes or None), op=op,
                dim=dim, keepdim=draw(st.booleans()),
                kind=draw(st.sampled_from(["normal", "normal", "-inf", "special"])),
                seed=draw(st.integers(0, 1000)), by_layout=draw(st.booleans()))


@sst.settings(max_examples=60)
@given(case=cases())
def test_matches_torch_on_global_tensor(case):
    xg = _values(case["lay"].shape, case["kind"], case["seed"])
    check(case["mesh"], case["lay"], xg, case["op"], case["dim"], case["keepdim"],
          by_layout=case["by_layout"])


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_tolerance_of_float64(op, dtype):
    """Large logits (|x| up to ~30) over uneven shards, one empty: the merge is
    max-shifted, so nothing overflows, and half precision is computed in float32."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    xg = torch.randn(3, 11, generator=torch.Generator().manual_seed(3), dtype=F64) * 10
    lay = Layout(xg.shape, P(None, ("dp", "sp")), mesh, {1: [4, 0, 5, 2]})
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    y = check(mesh, lay, xg, op, -1, dtype=dtype, **tol)
    assert y.dtype == dtype


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_dtype_argument_casts_first(op):
    mesh = spmd.Mesh((2,), ("sp",))
    ours, ref = OPS[op]
    x = torch.randn(5, 3, dtype=torch.bfloat16)
    f = spmd.shard_map(lambda x: ours(x, 0, mesh=mesh, spec=P("sp"), dtype=F64),
                       mesh, P("sp"), P("sp"))
    y = f(x)
    assert y.dtype == F64
    torch.testing.assert_close(y, ref(x, 0, dtype=F64), rtol=1e-12, atol=1e-12)


def test_rows_of_minus_inf_plus_inf_and_nan_like_torch():
    """Rows whose elements are split over 3 ranks: all -inf (softmax NaN, logsumexp
    -inf), one +inf, a NaN, -inf beside finite values, a rank holding nothing, and a row
    whose max (-999) is far below 0 next to a shard of only -inf, where a careless merge
    scales that shard's zero sum by exp(999) = inf and gets 0 * inf = NaN."""
    mesh = spmd.Mesh((3,), ("sp",))
    xg = torch.tensor([[-INF, -INF, -INF, -INF, -INF],
                       [1.0, INF, 2.0, -INF, 0.0],
                       [1.0, 2.0, NAN, 0.0, -1.0],
                       [-INF, -INF, 3.0, -INF, -INF],
                       [0.5, -1.0, 2.0, 4.0, -INF],
                       [-INF, -INF, -1000.0, -999.0, -INF]], dtype=F64)
    lay = Layout(xg.shape, P(None, "sp"), mesh, {1: [2, 0, 3]})
    for op in OPS:
        y = check(mesh, lay, xg, op, 1)
        want = OPS[op][1](xg, 1)
        torch.testing.assert_close(y, want, rtol=1e-12, atol=0, equal_nan=True)


def test_empty_global_dim():
    """Every shard empty along the dim: softmax of nothing is empty, logsumexp -inf."""
    mesh = spmd.Mesh((2,), ("sp",))
    xg = torch.zeros(0, 3, dtype=F64)
    lay = Layout(xg.shape, P("sp"), mesh)
    for op in OPS:
        check(mesh, lay, xg, op, 0)


@pytest.mark.parametrize("op", sorted(OPS))
def test_one_all_gather_forward_one_psum_backward(op):
    """4 ranks, rows [3, 3, 2, 2] of a 10 x 5 float32 tensor, softmax over the rows."""
    mesh = spmd.Mesh((4,), ("sp",))
    ours, _ = OPS[op]
    out = P() if op == "logsumexp" else P("sp")
    f = spmd.shard_map(lambda x: ours(x, 0, mesh=mesh, spec=P("sp")), mesh, P("sp"), out)
    x = torch.randn(10, 5, requires_grad=True)
    with spmd.comm_stats() as s:
        y = f(x)
        (y * torch.randn(y.shape)).sum().backward()
    assert s.calls(op, pass_="forward") == 4 == s.calls(pass_="forward"), str(s)
    assert s.calls(op, pass_="backward") == 4 == s.calls(pass_="backward"), str(s)
    # forward: each rank sends its (max, sum) pair per column, 2 x 5 float32, to each of
    # the 3 others; backward: a psum of 5 float32 per rank
    assert s.bytes(op, pass_="forward") == 4 * 3 * 2 * 5 * 4, str(s)
    assert s.bytes(op, pass_="backward") == 4 * 5 * 4, str(s)


@pytest.mark.parametrize("op", sorted(OPS))
def test_no_communication_when_dim_is_not_split(op):
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    ours, ref = OPS[op]
    x = torch.randn(6, 4, dtype=F64, requires_grad=True)
    f = spmd.shard_map(lambda x: ours(x, 1, mesh=mesh, spec=P("dp", None)),
                       mesh, P("dp"), P("dp"))
    with spmd.comm_stats() as s:
        y = f(x)
        y.sum().backward()
    assert s.calls() == 0 and s.bytes() == 0, str(s)
    torch.testing.assert_close(y, ref(x.detach(), 1), rtol=1e-12, atol=1e-12)


def test_tuple_split_dim_and_logsumexp_over_several_dims():
    mesh = spmd.Mesh((2, 3), ("x", "y"))
    xg = torch.randn(4, 7, 2, generator=torch.Generator().manual_seed(5), dtype=F64)
    lay = Layout(xg.shape, P("x", ("y",)), mesh, {0: [1, 3], 1: [3, 0, 4]})
    for op in OPS:
        check(mesh, lay, xg, op, 1)
    check(mesh, lay, xg, "logsumexp", (0, 1), keepdim=True)
    check(mesh, lay, xg, "logsumexp", (2, 0))
    lay2 = Layout((13, 2), P(("y", "x")), mesh, {0: [2, 0, 3, 1, 4, 3]})
    check(mesh, lay2, torch.randn(13, 2, dtype=F64), "log_softmax", 0)


def test_integer_logsumexp_promotes_like_torch():
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.arange(6).reshape(3, 2)
    y = spmd.shard_map(lambda x: logsumexp(x, 0, mesh=mesh, spec=P("sp")), mesh, P("sp"), P())(x)
    assert y.dtype == torch.logsumexp(x, 0).dtype
    torch.testing.assert_close(y, torch.logsumexp(x, 0))


@pytest.mark.parametrize("op", sorted(OPS))
def test_errors_before_any_communication(op):
    mesh = spmd.Mesh((2,), ("sp",))
    ours, _ = OPS[op]

    def call(spec=None, dim=0, x=None):
        spec = P("sp") if spec is None else spec
        x = torch.ones(4, 2) if x is None else x
        return spmd.shard_map(lambda x: ours(x, dim, mesh=mesh, spec=spec), mesh, P("sp"),
                              P())(x)

    with spmd.comm_stats() as s:
        with pytest.raises(spmd.SpecError, match="dim=2 is out of range"):
            call(dim=2)
        with pytest.raises(spmd.SpecError, match="dim=-3 is out of range"):
            call(dim=-3)
        with pytest.raises(spmd.SpecError, match="'tp'"):
            call(spec=P("tp"))
        with pytest.raises(spmd.SpecError, match="has 3 entries"):
            call(spec=P("sp", None, None))
        with pytest.raises(spmd.SpecError, match="dim must be"):
            call(dim="0")
        with pytest.raises(spmd.SpecError, match="called with"):
            spmd.shard_map(lambda x: ours(x, 0, mesh=spmd.Mesh((2,), ("sp",)), spec=P("sp")),
                           mesh, P("sp"), P())(torch.ones(4))
        if op != "logsumexp":
            with pytest.raises(TypeError, match="floating"):
                call(x=torch.ones(4, 2, dtype=torch.int64))
        else:
            with pytest.raises(spmd.SpecError, match="repeats"):
                call(dim=(0, -2))
    assert s.calls() == 0, str(s)


@pytest.mark.parametrize("op", sorted(OPS))
@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_threads_and_gloo(mesh, op):
    """Columns [3, 0] of a 2 x 3 tensor: rank 1 holds nothing along the dim."""
    ours, ref = OPS[op]
    xg = torch.tensor([[1.0, -2.0, 0.5], [-INF, 3.0, 2.0]], dtype=F64)
    lay = Layout(xg.shape, P(None, "sp"), mesh, {1: [3, 0]})
    x = lay.shard(xg, mesh.rank).clone().requires_grad_()
    y = ours(x, 1, mesh=mesh, spec=P(None, "sp"))
    xr = xg.clone().requires_grad_()
    yr = ref(xr, 1)
    w = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.7]], dtype=F64)
    if op == "logsumexp":  # replicated output: each rank's output is its own variable
        torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
        (y * w[:, mesh.rank]).sum().backward()
        (yr * w[:, 0]).sum().add((yr * w[:, 1]).sum()).backward()
    else:
        torch.testing.assert_close(y, lay.shard(yr.detach(), mesh.rank), rtol=1e-12, atol=1e-12)
        (y * lay.shard(w, mesh.rank)).sum().backward()
        (yr * w).sum().backward()
    torch.testing.assert_close(x.grad, lay.shard(xr.grad, mesh.rank), rtol=1e-12, atol=1e-12)
