"""spmd.ops.neighborhood_attention1d/2d/3d and neighborhood_attention_reference.

- The reference equals a brute-force masked SDPA whose (query, key) mask and bias are
  built position by position from NATTEN's window rules (its window-start formula for
  the edge shift, the dilation groups as explicit lists, the rpb offset per dim).
- The sharded ops equal the reference, values and gradients of q, k, v and rpb, for
  every kernel (1..7, even and odd), dilation (1..3), causal dim, mesh shape (1-4 ranks
  on one dim, a (2, 2) mesh over two spatial dims or over one as a product, a split
  batch) and uneven split (empty shards, shards narrower than the halo: several hops).
- Only the needed key/value rows move, in forward and back in backward.
- Bad arguments raise SpecError on every rank before data moves.

Tolerance: float64, rtol = atol = 1e-10. The sharded kernel computes each query's scores
and softmax from the same products as one device; only the order of additions differs
(the reference sums over the gathered window at once, the kernel in slot chunks, and
halo gradients are added after the local ones): a few ulps for O(1) values. The SDPA
comparison uses the same tolerance (float64 both).
"""
from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.nn.functional as F
from _ops import errors_on_every_rank
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.ops import (
    neighborhood_attention1d,
    neighborhood_attention2d,
    neighborhood_attention3d,
    neighborhood_attention_reference,
)
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
_na = importlib.import_module("spmd.ops.neighborhood_attention")
OPS = {1: neighborhood_attention1d, 2: neighborhood_attention2d, 3: neighborhood_attention3d}


# -- brute force: NATTEN's rules, one (query, key) pair at a time --------------------------------

def natten_window(i: int, L: int, k: int, d: int, causal: bool) -> list[tuple[int, int]]:
    """[(key position, rpb index)] of query ``i`` along one dim of length ``L``."""
    group = list(range(i % d, L, d))  # the query's dilation group, as positions
    t, n = group.index(i), len(group)
    if causal:
        start, stop = max(t - k + 1, 0), t + 1
    else:
        left, right = k // 2, k // 2 + k % 2 - 1
        start = max(t - left, 0) + (n - right - t - 1 if t + right >= n else 0)
        stop = start + k
    return [(group[u], u - t + k - 1) for u in range(start, stop)]


def brute_mask(shape, ks, ds, cs):
    """Per dim, ``allowed[L, L]`` and ``rel[L, L]`` (rpb index; 0 where not allowed)."""
    out = []
    for L, k, d, c in zip(shape, ks, ds, cs):
        allowed = torch.zeros(L, L, dtype=torch.bool)
        rel = torch.zeros(L, L, dtype=torch.long)
        for i in range(L):
            for j, r in natten_window(i, L, k, d, c):
                allowed[i, j], rel[i, j] = True, r
        out.append((allowed, rel))
    return out


def brute_force(q, k, v, ks, ds, cs, rpb=None, scale=None):
    """Masked SDPA over all tokens with the mask and bias of ``brute_mask``."""
    n = q.ndim - 3
    spatial = q.shape[1:1 + n]
    per_dim = brute_mask(spatial, ks, ds, cs)
    allowed = torch.ones((), dtype=torch.bool)
    idx = []
    for i, (a, r) in enumerate(per_dim):  # broadcast as [L_0.., L_0..] (queries, keys)
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = a.shape
        allowed = allowed & a.view(shape)
        idx.append(r.view(shape))
    H = q.shape[-2]
    bias = torch.zeros((H, *allowed.shape), dtype=q.dtype)
    if rpb is not None:
        bias = rpb[(slice(None), *idx)]
    bias = bias.masked_fill(~allowed, float("-inf"))
    T = allowed[(...,) + (0,) * n].numel()
    mask = bias.reshape(H, T, T)
    flat = lambda t: t.flatten(1, n).transpose(1, 2)  # noqa: E731 - [B, H, T, D]
    y = F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=mask, scale=scale)
    return y.transpose(1, 2).reshape(*q.shape[:-1], v.shape[-1])


def _qkv(shape, heads=2, dim=3, dim_v=None, seed=0, rpb_ks=None):
    g = torch.Generator().manual_seed(seed)
    full = (*shape[:1], *shape[1:], heads)
    q = torch.randn(*full, dim, generator=g, dtype=F64)
    k = torch.randn(*full, dim, generator=g, dtype=F64)
    v = torch.randn(*full, dim_v or dim, generator=g, dtype=F64)
    rpb = None if rpb_ks is None else torch.randn(heads, *(2 * kk - 1 for kk in rpb_ks),
                                                  generator=g, dtype=F64)
    return q, k, v, rpb


# -- the reference against brute force -----------------------------------------------------------

@pytest.mark.parametrize("k", range(2, 8))
@pytest.mark.parametrize("d", [1, 2, 3])
def test_reference_is_brute_force_1d(k, d):
    L = k * d + 2
    for causal in (False, True):
        for with_rpb in (False, True):
            q, kk, v, rpb = _qkv((2, L), rpb_ks=(k,) if with_rpb else None, seed=k + 10 * d)
            got = neighborhood_attention_reference(q, kk, v, k, d, causal, rpb=rpb)
            torch.testing.assert_close(got, brute_force(q, kk, v, (k,), (d,), (causal,), rpb),
                                       **TOL)


@st.composite
def geometries(draw, n=None, max_k=None):
    n = n or draw(st.integers(1, 3))
    max_k = max_k or {1: 7, 2: 5, 3: 3}[n]
    ks = tuple(draw(st.integers(1, max_k)) for _ in range(n))
    ds = tuple(draw(st.integers(1, 3 if n < 3 else 2)) for _ in range(n))
    cs = tuple(draw(st.booleans()) for _ in range(n))
    extra = {1: 6, 2: 3, 3: 1}[n]
    spatial = tuple(kk * dd + draw(st.integers(0, extra)) for kk, dd in zip(ks, ds))
    return spatial, ks, ds, cs


@settings(max_examples=60)
@given(geo=geometries(), with_rpb=st.booleans(), dim_v=st.sampled_from([None, 2]),
       seed=st.integers(0, 99))
def test_reference_is_brute_force(geo, with_rpb, dim_v, seed):
    spatial, ks, ds, cs = geo
    q, k, v, rpb = _qkv((2, *spatial), dim_v=dim_v, seed=seed, rpb_ks=ks if with_rpb else None)
    scale = 0.7 if seed % 2 else None
    args = [t.requires_grad_() for t in (q, k, v) + ((rpb,) if with_rpb else ())]
    got = neighborhood_attention_reference(q, k, v, ks, ds, cs, rpb=rpb, scale=scale)
    torch.testing.assert_close(got, brute_force(q, k, v, ks, ds, cs, rpb, scale), **TOL)
    # the fast kernel on one device (mesh=None), values and gradients
    op = OPS[len(spatial)]
    fast = op(q, k, v, ks, ds, cs, rpb=rpb, scale=scale)
    torch.testing.assert_close(fast, got, **TOL)
    w = torch.randn(fast.shape, dtype=F64)
    want = torch.autograd.grad((got * w).sum(), args)
    for a, b in zip(torch.autograd.grad((fast * w).sum(), args), want):
        torch.testing.assert_close(a, b, **TOL)


def test_even_kernel_puts_one_more_position_before_the_query():
    (allowed, rel), = brute_mask((10,), (4,), (1,), (False,))
    assert allowed[5].nonzero().flatten().tolist() == [3, 4, 5, 6]
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 2, 3]  # shifted inward
    assert allowed[9].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert rel[9, 6:].tolist() == [0, 1, 2, 3]  # offsets -3..0: rpb indices 0..3


def test_dilation_groups_and_causal_windows():
    (allowed, _), = brute_mask((7,), (2,), (3,), (False,))
    # groups {0, 3, 6}, {1, 4}, {2, 5}: 4 is the last of its group, its window shifts back
    assert allowed[4].nonzero().flatten().tolist() == [1, 4]
    assert allowed[0].nonzero().flatten().tolist() == [0, 3]
    (allowed, rel), = brute_mask((7,), (3,), (2,), (True,))
    assert allowed[5].nonzero().flatten().tolist() == [1, 3, 5]
    assert allowed[2].nonzero().flatten().tolist() == [0, 2]  # short at the start
    assert rel[2, [0, 2]].tolist() == [1, 2]


# -- sharded against the reference ----------------------------------------------------------------

def run_sharded(mesh, lay, ks, ds, cs, *, with_rpb, dim_v=None, by_layout=False, seed=0,
                heads=2, dim=3):
    """The sharded op on ``lay`` (q's layout) against the reference: outputs, gradients
    of q, k, v and rpb (float64, TOL)."""
    n = len(ks)
    q, k, v, rpb = _qkv((lay.shape[0], *lay.shape[1:1 + n]), heads, dim, dim_v, seed,
                        ks if with_rpb else None)
    assert tuple(q.shape) == lay.shape
    given_sizes = {d: lay.sizes[d] for d in lay.split_dims} or None
    v_lay = Layout(v.shape, lay.spec, mesh, given_sizes)
    spec = lay if by_layout else lay.spec
    op = OPS[n]
    params = (rpb,) if with_rpb else ()

    def local(q, k, v, *p):
        return op(q, k, v, ks, ds, cs, rpb=p[0] if p else None, mesh=mesh, spec=spec)

    def glob(q, k, v, *p):
        return neighborhood_attention_reference(q, k, v, ks, ds, cs, rpb=p[0] if p else None)

    out_lay = op.output_layout(lay, v.shape[-1])
    return assert_matches_single_device(local, glob, mesh, (lay, lay, v_lay), out_lay, q, k, v,
                                        params=params, seed=seed, **TOL)


@st.composite
def sharded_cases(draw, n):
    kind = draw(st.sampled_from(["1d", "dp_sp", "xy_product"] + (["2d"] if n >= 2 else [])))
    spatial, ks, ds, cs = draw(geometries(n))
    batch = draw(st.integers(1, 2))
    if kind == "1d":
        mesh = draw(sst.meshes(4, ndims=1))
        d = draw(st.integers(1, n))
        spec = P(*([None] * d), "sp")
    elif kind == "dp_sp":
        mesh, batch = spmd.Mesh((2, 2), ("dp", "sp")), 2
        spec = P("dp", *([None] * (n - 1)), "sp")
    elif kind == "xy_product":
        mesh, spec = spmd.Mesh((2, 2), ("x", "y")), P(None, ("x", "y"))
    else:
        mesh, spec = spmd.Mesh((2, 2), ("x", "y")), P(None, "x", "y")
    shape = (batch, *spatial, 2, 3)
    lay = draw(sst.layouts(shape, mesh, spec))
    lay = Layout(shape, spec, mesh, {d: lay.sizes[d] for d in lay.split_dims if d >= 1} or None)
    return dict(mesh=mesh, lay=lay, ks=ks, ds=ds, cs=cs, with_rpb=draw(st.booleans()),
                dim_v=draw(st.sampled_from([None, 2])), by_layout=draw(st.booleans()),
                seed=draw(st.integers(0, 99)))


def _run(c):
    run_sharded(c.pop("mesh"), c.pop("lay"), c.pop("ks"), c.pop("ds"), c.pop("cs"), **c)


@settings(max_examples=80)
@given(c=sharded_cases(1))
def test_sharded_1d_matches_reference(c):
    _run(c)


@settings(max_examples=60)
@given(c=sharded_cases(2))
def test_sharded_2d_matches_reference(c):
    _run(c)


@settings(max_examples=25)
@given(c=sharded_cases(3))
def test_sharded_3d_matches_reference(c):
    _run(c)


@pytest.mark.parametrize("k,d,causal", [(7, 1, False), (5, 3, False), (4, 2, True), (6, 2, False)])
def test_narrow_and_empty_shards_read_several_ranks_away(k, d, causal):
    """Shards of 1 and 0 rows next to a wide one: windows reach across several ranks."""
    mesh = spmd.Mesh((5,), ("sp",))
    L = 20
    lay = Layout((2, L, 2, 3), P(None, "sp"), mesh, {1: (1, 0, 2, 15, 2)})
    run_sharded(mesh, lay, (k,), (d,), (causal,), with_rpb=True, seed=k)


def test_two_split_spatial_dims_fetch_the_corners():
    mesh = spmd.Mesh((2, 3), ("x", "y"))
    lay = Layout((1, 9, 8, 2, 3), P(None, "x", "y"), mesh, {1: (3, 6), 2: (1, 0, 7)})
    run_sharded(mesh, lay, (5, 3), (1, 2), (False, True), with_rpb=True, by_layout=True)


# -- bytes: exactly the needed rows --------------------------------------------------------------

def needed_rows(L, k, d, causal, sizes):
    (allowed, _), = brute_mask((L,), (k,), (d,), (causal,))
    out, start = [], 0
    for s in sizes:
        keys = set(allowed[start:start + s].nonzero()[:, 1].tolist())
        out.append((len(keys), len(keys - set(range(start, start + s)))))
        start += s
    return out  # (window rows, halo rows) per rank


@pytest.mark.parametrize("k,d,causal,sizes", [
    (5, 1, False, (6, 6, 6)), (4, 3, False, (2, 9, 1, 6)), (3, 2, True, (5, 0, 13)),
    (7, 2, False, (1, 3, 14)),
])
def test_only_the_needed_key_value_rows_move_1d(k, d, causal, sizes):
    mesh = spmd.Mesh((len(sizes),), ("sp",))
    L, B, H, D, Dv = sum(sizes), 2, 2, 3, 4
    lay = Layout((B, L, H, D), P(None, "sp"), mesh, {1: sizes})
    with spmd.comm_stats() as stats:
        run_sharded(mesh, lay, (k,), (d,), (causal,), with_rpb=False, dim_v=Dv, by_layout=True)
    halo = sum(h for _, h in needed_rows(L, k, d, causal, sizes))
    want = halo * B * H * (D + Dv) * 8
    what = "neighborhood_attention1d"
    assert stats.bytes(what, pass_="forward") == want > 0
    assert stats.bytes(what, pass_="backward") == want
    assert stats.calls(what) == 2 * 2 * len(sizes)  # k and v, forward and backward
    assert stats.bytes() == 2 * want  # nothing else: no size exchange with a Layout


def test_only_the_needed_tokens_move_2d():
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    s0, s1 = (4, 7), (2, 8)
    ks, ds, cs = (3, 4), (2, 1), (False, True)
    lay = Layout((1, 11, 10, 2, 3), P(None, "x", "y"), mesh, {1: s0, 2: s1})
    with spmd.comm_stats() as stats:
        run_sharded(mesh, lay, ks, ds, cs, with_rpb=True, by_layout=True)
    w0 = needed_rows(11, ks[0], ds[0], cs[0], s0)
    w1 = needed_rows(10, ks[1], ds[1], cs[1], s1)
    tokens = sum(w0[a][0] * w1[b][0] - s0[a] * s1[b] for a in range(2) for b in range(2))
    want = tokens * 2 * 3 * 2 * 8  # heads x head_dim x (k and v) x float64
    assert stats.bytes("neighborhood_attention2d", pass_="forward") == want
    assert stats.bytes("neighborhood_attention2d", pass_="backward") == want


def test_sizes_exchange_once_with_a_P_spec_and_nothing_moves_without_a_split():
    mesh = spmd.Mesh((2,), ("sp",))
    q, k, v, _ = _qkv((1, 6, 5))
    f = lambda q, k, v: neighborhood_attention2d(q, k, v, 3, mesh=mesh, spec=P(None, "sp"))  # noqa: E731
    with spmd.comm_stats() as stats:
        spmd.shard_map(f, mesh, (P(None, "sp"),) * 3, P(None, "sp"))(q, k, v)
    assert stats.calls("neighborhood_attention2d sizes") == 2
    g = lambda q, k, v: neighborhood_attention2d(q, k, v, 3, mesh=mesh, spec=P("sp"))  # noqa: E731
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(g, mesh, (P("sp"),) * 3, P("sp"))(*(t.expand(2, *t.shape[1:])
                                                              for t in (q, k, v)))
    assert stats.calls("neighborhood_attention2d") == 0  # a split batch moves nothing
    torch.testing.assert_close(y[1], neighborhood_attention_reference(q, k, v, 3)[0], **TOL)


def _saved_per_rank(mesh, lay, kernel) -> dict[int, int]:
    """The bytes autograd saves on each rank for the op on ``lay`` (q's layout; k and v
    alike), the inputs left out."""
    from spmd.testing.memory import SavedBytes
    n = len(lay.shape) - 3
    q, k, v, _ = _qkv(lay.shape[:1 + n], lay.shape[-2], lay.shape[-1])
    got = {}

    def body(q, k, v):
        with SavedBytes(skip=(q, k, v)) as saved:
            y = OPS[n](q, k, v, kernel, mesh=mesh, spec=lay)
        got[mesh.rank] = saved.total
        return y

    spmd.shard_map(body, mesh, (lay,) * 3, lay)(*(t.requires_grad_() for t in (q, k, v)))
    return got


def test_saves_k_v_their_halo_rows_the_output_and_lse_only():
    """Per rank, autograd keeps q, k and v, the halo rows of k and v that arrived, the
    output and the log-sum-exp: never a copy of the shard, nor the kernel_size-fold
    gathered keys or scores."""
    mesh = spmd.Mesh((3,), ("sp",))
    B, L, H, D, kk = 2, 18, 2, 4, 5
    lay = Layout((B, L, H, D), P(None, "sp"), mesh)
    got = _saved_per_rank(mesh, lay, kk)
    halo = [2, 4, 2]  # kernel 5: 2 rows from each neighbour
    for r in range(3):
        n = lay.sizes[1][r]
        want = 2 * B * halo[r] * H * D * 8 + B * n * H * D * 8 + B * n * H * 8
        assert got[r] == want, (r, got[r], want)


def test_double_backward_matches_the_reference():
    q, k, v, rpb = _qkv((1, 7), rpb_ks=(3,))
    args = [t.requires_grad_() for t in (q, k, v, rpb)]

    def gg(fn):
        y = fn(q, k, v, 3, 2, rpb=rpb)
        g = torch.autograd.grad(y.square().sum(), args, create_graph=True)
        return torch.autograd.grad(sum(t.sin().sum() for t in g), args)

    for a, b in zip(gg(neighborhood_attention1d), gg(neighborhood_attention_reference)):
        torch.testing.assert_close(a, b, **TOL)


# -- one split dim: the halo travels while the interior attends ---------------------------------

@pytest.mark.parametrize("L,k,d,causal,sizes", [
    (20, 5, 1, False, (7, 6, 7)), (20, 3, 3, False, (9, 2, 9)), (17, 4, 2, True, (5, 0, 12)),
    (12, 7, 1, False, (6, 6)), (9, 9, 1, False, (4, 5)),
])
def test_the_interior_is_the_longest_run_of_queries_whose_windows_stay_home(L, k, d, causal,
                                                                             sizes):
    (allowed, _), = brute_mask((L,), (k,), (d,), (causal,))
    start = 0
    for n in sizes:
        a, b = _na._interior(L, k, d, causal, start, n)
        home = [bool(allowed[start + t, :start].sum() + allowed[start + t, start + n:].sum() == 0)
                for t in range(n)]
        assert all(home[a:b])
        runs = [j - i for i in range(n + 1) for j in range(i, n + 1) if all(home[i:j])]
        assert b - a == max(runs, default=0)
        start += n


def _events(mesh, lay, kernel):
    """The op on ``lay`` (values checked against the reference) and, per rank, the order
    of its fetches, transposes, waits and attention calls (``attend_* N``: a block of N
    queries), forward then backward."""
    n = len(lay.shape) - 3
    q, k, v, _ = _qkv(lay.shape[:1 + n])
    log: dict[int, list] = {}
    real = {n: getattr(_na, n) for n in ("exchange_async", "transpose_async", "attend_forward",
                                         "attend_backward")}

    def note(what):
        log.setdefault(mesh.rank, []).append(what)

    class Waited:
        def __init__(self, pending, what):
            self.pending, self.what = pending, what

        def wait(self, **kw):
            note(f"wait {self.what}")
            return self.pending.wait(**kw)

    def patched(name, what):
        def f(*args, **kw):
            out = real[name](*args, **kw)
            if what == "attend":
                note(f"{name} {args[0].shape[1]}")
                return out
            note(f"start {what}")
            return Waited(out, what)
        return f

    for name, what in (("exchange_async", "fetch"), ("transpose_async", "transpose"),
                       ("attend_forward", "attend"), ("attend_backward", "attend")):
        setattr(_na, name, patched(name, what))
    try:
        f = lambda q, k, v: OPS[n](q, k, v, kernel, mesh=mesh, spec=lay)  # noqa: E731
        y = spmd.shard_map(f, mesh, (lay,) * 3, lay)(*(t.requires_grad_() for t in (q, k, v)))
        y.square().sum().backward()
    finally:
        for name, fn in real.items():
            setattr(_na, name, fn)
    torch.testing.assert_close(y, neighborhood_attention_reference(q, k, v, kernel), **TOL)
    return log


def test_the_interior_attends_while_the_halo_travels_and_its_backward_while_gradients_do():
    """The order of events on every rank: both fetches start, the interior attends, the
    halo is awaited, the edges attend; backward, the edges' gradients first, their halo
    parts sent, the interior's backward, then the sends awaited."""
    mesh = spmd.Mesh((3,), ("sp",))
    log = _events(mesh, Layout((1, 24, 2, 3), P(None, "sp"), mesh, {1: (8, 9, 7)}), 5)
    # rank 1, rows [8, 17): 2 rows at each edge read the halo, 5 in between do not
    assert log[1] == ["start fetch", "start fetch", "attend_forward 5", "wait fetch", "wait fetch",
                      "attend_forward 2", "attend_forward 2",
                      "attend_backward 2", "attend_backward 2", "start transpose",
                      "start transpose", "attend_backward 5", "wait transpose", "wait transpose"]
    # rank 0 holds the domain's start: windows shift inward there, only its end reads a halo
    assert log[0] == ["start fetch", "start fetch", "attend_forward 6", "wait fetch", "wait fetch",
                      "attend_forward 2", "attend_backward 2", "start transpose",
                      "start transpose", "attend_backward 6", "wait transpose", "wait transpose"]


def test_two_split_dims_attend_level_by_level_while_each_halo_travels():
    """Two split dims: the interior attends while the first halo (along x) travels; the
    x-edges whose windows stay home along y attend while the second (along y, from the
    x-padded window: corners included) travels; then the y-edges, every row. Backward
    the other way round: each level's gradients travel while the level below's
    backward runs."""
    mesh = spmd.Mesh((2, 3), ("x", "y"))
    log = _events(mesh, Layout((1, 14, 21, 2, 3), P(None, "x", "y"), mesh), 5)
    fetches = ["start fetch"] * 2
    waits = lambda what: [f"wait {what}"] * 2  # noqa: E731 - for k and v
    # the middle rank of y holds rows [7, 14) x cols [7, 14): an x-edge of 2 rows at the
    # top, y-edges of 2 cols on both sides
    assert log[mesh.rank_of((1, 1))] == [
        *fetches, "attend_forward 15", *waits("fetch"), *fetches, "attend_forward 6",
        *waits("fetch"), "attend_forward 14", "attend_forward 14",
        "attend_backward 14", "attend_backward 14", "start transpose", "start transpose",
        "attend_backward 6", *waits("transpose"), "start transpose", "start transpose",
        "attend_backward 15", *waits("transpose")]
    # rank (0, 0): the domain's corner, halos only after its last row and column
    assert log[0] == [
        *fetches, "attend_forward 25", *waits("fetch"), *fetches, "attend_forward 10",
        *waits("fetch"), "attend_forward 14",
        "attend_backward 14", "start transpose", "start transpose", "attend_backward 10",
        *waits("transpose"), "start transpose", "start transpose", "attend_backward 25",
        *waits("transpose")]


@pytest.mark.parametrize("spatial,kernel,dilation,causal,mesh_shape,sizes", [
    ((9, 8), (5, 3), (1, 2), (False, True), (2, 3), {1: (3, 6), 2: (1, 0, 7)}),
    ((20, 11), (3, 5), (2, 1), (True, False), (3, 2), {1: (12, 2, 6), 2: (6, 5)}),
    ((7, 9, 8), (3, 3, 5), (1, 2, 1), (False, False, True), (2, 2, 2), None),
])
def test_the_levels_blocks_cover_every_query_once(spatial, kernel, dilation, causal, mesh_shape,
                                                  sizes):
    """The blocks of every rank partition its queries; level 0 is the interior along
    every split dim, and there are at most 1 + 2 x (split dims) of them."""
    names = ("x", "y", "z")[:len(mesh_shape)]
    mesh = spmd.Mesh(mesh_shape, names)
    lay = Layout((1, *spatial, 1, 2), P(None, *names), mesh, sizes)
    for rank in range(mesh.size):
        dims = []
        fetches = []
        off, shp = lay.offsets(rank), lay.local_shape(rank)
        for i in range(len(spatial)):
            geo = (spatial[i], kernel[i], dilation[i], causal[i])
            rows, plan = _na.dim_plan(*geo, tuple(lay.sizes[1 + i]))
            me = mesh.coords(rank)[i]
            fetches.append(_na.Fetch(None, (names[i],), me, 1 + i, plan, 0.0, "t"))
            dims.append((*geo, off[1 + i], shp[1 + i], rows[me], len(rows[me])))
        q = torch.zeros(shp)
        sp = _na._levels_plan(tuple(fetches), tuple(dims), q, q, q, 1.0)
        seen = torch.zeros(shp[1:-2], dtype=torch.long)
        for level, cuts, _ in sp.parts:
            block = seen
            for d, r0, n in cuts:
                block = block.narrow(d - 1, r0, n)
            block += 1
            if level == 0:
                assert [c[1:] for c in cuts] == [
                    (a, b - a) for a, b in (_na._interior(*dm[:6]) for dm in dims)]
        assert bool((seen == 1).all()), (rank, seen)
        assert len(sp.parts) <= 1 + 2 * len(spatial)


def test_two_split_dims_save_k_v_the_halo_rows_of_each_level_the_output_and_lse_only():
    """With two split dims autograd keeps what it keeps with one: q, k, v, the key and
    value rows that arrived (at the second level, the corners with them), the output
    and the log-sum-exp; no window."""
    mesh = spmd.Mesh((2, 3), ("x", "y"))
    B, H, D, kk = 2, 2, 4, (3, 5)
    lay = Layout((B, 10, 13, H, D), P(None, "x", "y"), mesh, {1: (4, 6), 2: (5, 1, 7)})
    got = _saved_per_rank(mesh, lay, kk)
    w0 = needed_rows(10, kk[0], 1, False, lay.sizes[1])
    w1 = needed_rows(13, kk[1], 1, False, lay.sizes[2])
    for r in range(mesh.size):
        a, b = mesh.coords(r)
        n0, n1 = lay.sizes[1][a], lay.sizes[2][b]
        halo_tokens = w0[a][0] * w1[b][0] - n0 * n1
        want = 2 * B * halo_tokens * H * D * 8 + B * n0 * n1 * H * D * 8 + B * n0 * n1 * H * 8
        assert got[r] == want, (r, got[r], want)


@pytest.mark.parametrize("sizes", [(8, 9, 7), (12, 0, 12), (2, 20, 2)])
def test_double_backward_and_torch_func_on_a_split_dim_match_the_reference(sizes):
    """With grad mode on in backward the overlapped op differentiates its plain form (the
    window fetched whole): a Hessian-vector product and torch.func.grad equal the
    reference's, on uneven shards, an empty one, and shards narrower than the window."""
    mesh = spmd.Mesh((3,), ("sp",), schedule="threads")  # a backward inside the body
    L = sum(sizes)
    lay = Layout((1, L, 2, 3), P(None, "sp"), mesh, {1: sizes})
    q, k, v, rpb = _qkv((1, L), rpb_ks=(5,))
    loss = lambda y: (y.tanh() ** 2).sum()  # noqa: E731

    def body(q, k, v):
        args = [t.detach().requires_grad_() for t in (q, k, v)]
        f = lambda *a: loss(neighborhood_attention1d(*a, 5, 2, rpb=rpb, mesh=mesh, spec=lay))  # noqa: E731
        g = torch.autograd.grad(f(*args), args, create_graph=True)
        hv = torch.autograd.grad(sum((t ** 2).sum() for t in g), args)
        return (*hv, *torch.func.grad(f, argnums=(0, 1, 2))(q, k, v))

    got = spmd.shard_map(body, mesh, (lay,) * 3, (lay,) * 6)(q, k, v)
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    y = neighborhood_attention_reference(*args, 5, 2, rpb=rpb)
    g = torch.autograd.grad(loss(y), args, create_graph=True)
    hv = torch.autograd.grad(sum((t ** 2).sum() for t in g), args)
    for a, b in zip(got, (*hv, *g)):
        torch.testing.assert_close(a, b.detach(), **TOL)


def test_double_backward_and_torch_func_over_two_split_dims_match_the_reference():
    """The same on a 2 x 3 mesh splitting rows and columns, with an empty shard and
    shards narrower than the window: the plain form fetches both levels again."""
    mesh = spmd.Mesh((2, 3), ("x", "y"), schedule="threads")  # a backward inside the body
    lay = Layout((1, 9, 8, 2, 3), P(None, "x", "y"), mesh, {1: (3, 6), 2: (1, 0, 7)})
    q, k, v, rpb = _qkv((1, 9, 8), rpb_ks=(5, 3))
    loss = lambda y: (y.tanh() ** 2).sum()  # noqa: E731
    op = lambda *a: neighborhood_attention2d(*a, (5, 3), (1, 2), rpb=rpb, mesh=mesh, spec=lay)  # noqa: E731

    def body(q, k, v):
        args = [t.detach().requires_grad_() for t in (q, k, v)]
        g = torch.autograd.grad(loss(op(*args)), args, create_graph=True)
        hv = torch.autograd.grad(sum((t ** 2).sum() for t in g), args)
        return (*hv, *torch.func.grad(lambda *a: loss(op(*a)), argnums=(0, 1, 2))(q, k, v))

    got = spmd.shard_map(body, mesh, (lay,) * 3, (lay,) * 6)(q, k, v)
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    y = neighborhood_attention_reference(*args, (5, 3), (1, 2), rpb=rpb)
    g = torch.autograd.grad(loss(y), args, create_graph=True)
    hv = torch.autograd.grad(sum((t ** 2).sum() for t in g), args)
    for a, b in zip(got, (*hv, *g)):
        torch.testing.assert_close(a, b.detach(), **TOL)


def test_a_nan_in_a_corner_key_reaches_the_same_queries_and_gradients_as_on_one_device():
    """A NaN key at a shard's corner travels in the second level's halo (the corners):
    the outputs it poisons and the gradients, NaN or not, are the reference's."""
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    lay = Layout((1, 8, 9, 2, 3), P(None, "x", "y"), mesh, {1: (4, 4), 2: (5, 4)})
    q, k, v, rpb = _qkv((1, 8, 9), rpb_ks=(3, 3))
    k[0, 3, 4, 1, 2] = float("nan")  # rank (0, 0)'s corner row 3, column 4
    go = torch.randn(q.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    f = lambda q, k, v: neighborhood_attention2d(q, k, v, 3, rpb=rpb, mesh=mesh, spec=lay)  # noqa: E731
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = spmd.shard_map(f, mesh, (lay,) * 3, lay)(*xs)
    grads = torch.autograd.grad(got, xs, go)
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    want = neighborhood_attention_reference(*ys, 3, rpb=rpb)
    gwant = torch.autograd.grad(want, ys, go)
    assert want.isnan().any() and not want.isnan().all()
    torch.testing.assert_close(got, want, equal_nan=True, **TOL)
    for a, b in zip(grads, gwant):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL)


def test_float32_and_bfloat16_follow_the_float64_reference():
    q, k, v, rpb = _qkv((2, 9, 8), rpb_ks=(3, 5))
    want = neighborhood_attention_reference(q, k, v, (3, 5), rpb=rpb)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        got = neighborhood_attention2d(*(t.to(dtype) for t in (q, k, v)), (3, 5),
                                       rpb=rpb.to(dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.to(F64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("split", ["rows", "rows_and_cols"])
def test_float32_and_bfloat16_on_split_dims_follow_the_float64_reference(split):
    """The overlapped op in half precision: scores, softmax and the gradients of k and v
    (where the levels' parts meet, and what comes back from the neighbours is added) in
    float32, rounded once. The tolerances are those of one bfloat16 rounding (8 bits:
    2^-8 relative) of values and gradients of order 1, and float32's accumulated over
    9 x 5 window slots."""
    if split == "rows":
        mesh = spmd.Mesh((3,), ("sp",))
        lay = Layout((2, 17, 8, 2, 3), P(None, "sp"), mesh, {1: (7, 4, 6)})
    else:
        mesh = spmd.Mesh((2, 2), ("x", "y"))
        lay = Layout((2, 17, 8, 2, 3), P(None, "x", "y"), mesh, {1: (11, 6), 2: (3, 5)})
    q, k, v, rpb = _qkv((2, 17, 8), rpb_ks=(3, 5))
    go = torch.randn(q.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    want = neighborhood_attention_reference(*args, (3, 5), rpb=rpb)
    gwant = torch.autograd.grad(want, args, go)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 4e-2)):
        f = lambda q, k, v: neighborhood_attention2d(  # noqa: E731
            q, k, v, (3, 5), rpb=rpb.to(q.dtype), mesh=mesh, spec=lay)
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        got = spmd.shard_map(f, mesh, (lay,) * 3, lay)(*xs)
        assert got.dtype == dtype
        grads = torch.autograd.grad(got, xs, go.to(dtype))
        torch.testing.assert_close(got.to(F64), want, rtol=tol, atol=tol)
        for a, b in zip(grads, gwant):
            assert a.dtype == dtype
            torch.testing.assert_close(a.to(F64), b, rtol=tol, atol=tol)


# -- grouped-query attention -----------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("case", ["1d_uneven_empty", "2d_split", "product_of_axes"])
def test_gqa_matches_the_reference_and_only_key_value_heads_travel(kv_heads, case):
    """q has 4 heads, k and v ``kv_heads`` (MQA at 1): query head h reads key/value head
    h // (4 / kv_heads), as SDPA's enable_gqa. The reference equals full multi-head
    attention on repeated k and v; the sharded op equals the reference (values and the
    gradients of q, k, v and rpb, float64); the halo holds the key/value heads only."""
    if case == "1d_uneven_empty":
        mesh, spec, spatial, sizes = spmd.Mesh((3,), ("sp",)), P(None, "sp"), (13,), {1: (6, 0, 7)}
        ks, ds, cs = (5,), (2,), (False,)
    elif case == "2d_split":
        mesh, spec, spatial, sizes = spmd.Mesh((2, 2), ("x", "y")), P(None, "x", "y"), (7, 6), None
        ks, ds, cs = (3, 5), (1, 1), (True, False)
    else:  # rows over x and y together: [4, 0, 3, 4]
        mesh, spec = spmd.Mesh((2, 2), ("x", "y")), P(None, ("x", "y"))
        spatial, sizes = (11, 4), {1: (4, 0, 3, 4)}
        ks, ds, cs = (3, 3), (2, 1), (False, False)
    B, H, D, Dv = 2, 4, 3, 2
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(B, *spatial, H, D, dtype=F64, generator=g)
    k = torch.randn(B, *spatial, kv_heads, D, dtype=F64, generator=g)
    v = torch.randn(B, *spatial, kv_heads, Dv, dtype=F64, generator=g)
    rpb = torch.randn(H, *(2 * kk - 1 for kk in ks), dtype=F64, generator=g)
    op = OPS[len(spatial)]
    rep = lambda t: t.repeat_interleave(H // kv_heads, dim=-2)  # noqa: E731
    want = neighborhood_attention_reference(q, k, v, ks, ds, cs, rpb=rpb, enable_gqa=True)
    torch.testing.assert_close(want, neighborhood_attention_reference(q, rep(k), rep(v), ks, ds,
                                                                      cs, rpb=rpb), **TOL)
    lay = Layout(q.shape, spec, mesh, sizes)
    kv = lambda t: Layout(t.shape, spec, mesh, sizes)  # noqa: E731
    with spmd.comm_stats() as stats:
        assert_matches_single_device(
            lambda q, k, v, r: op(q, k, v, ks, ds, cs, rpb=r, mesh=mesh, spec=lay,
                                  enable_gqa=True),
            lambda q, k, v, r: neighborhood_attention_reference(q, k, v, ks, ds, cs, rpb=r,
                                                                enable_gqa=True),
            mesh, (lay, kv(k), kv(v)), op.output_layout(lay, Dv), q, k, v, params=(rpb,), **TOL)
    what = f"neighborhood_attention{len(spatial)}d"
    with spmd.comm_stats() as mha:
        assert_matches_single_device(
            lambda q, k, v, r: op(q, k, v, ks, ds, cs, rpb=r, mesh=mesh, spec=lay),
            lambda q, k, v, r: neighborhood_attention_reference(q, k, v, ks, ds, cs, rpb=r),
            mesh, (lay, lay, Layout((*q.shape[:-1], Dv), spec, mesh, sizes)),
            op.output_layout(lay, Dv), q, rep(k), rep(v), params=(rpb,), **TOL)
    for pass_ in ("forward", "backward"):
        assert stats.bytes(what, pass_=pass_) * (H // kv_heads) == mha.bytes(what, pass_=pass_) > 0


def test_gqa_errors():
    q, k = torch.zeros(1, 5, 4, 2), torch.zeros(1, 5, 3, 2)
    with pytest.raises(spmd.SpecError, match="which must divide q's"):
        neighborhood_attention1d(q, k, k, 3, enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        neighborhood_attention1d(q, q, q, 3, enable_gqa=1)


# -- gloo ------------------------------------------------------------------------------------------

def _gloo_case(mesh):
    lay = Layout((2, 9, 6, 2, 3), P(None, "sp"), mesh, {1: (2, 7)})
    run_sharded(mesh, lay, (4, 3), (2, 1), (False, True), with_rpb=True, dim_v=2)
    run_sharded(mesh, Layout((1, 10, 2, 3), P(None, "sp"), mesh), (4,), (2,), (True,),
                with_rpb=False)
    return True


@pytest.mark.gloo
def test_sharded_matches_reference_on_gloo_world_2(gloo2):
    assert gloo2.run(_gloo_case, (2,), ("sp",)) == [True, True]


# -- errors: SpecError (or TypeError) on every rank, before data moves -------------------------

SP = P(None, "sp")


def _call(spec=SP, shape=(1, 8, 2, 3), ks=3, ds=1, cs=False, k_shape=None,
          v_shape=None, rpb=None, mesh_arg=None, by_layout=True):
    """Per-rank code calling the op with one bad argument; with ``by_layout`` the spec is
    a Layout (no size exchange: nothing at all may move before the error)."""
    def fn(mesh):
        try:
            lay = Layout(shape, spec, mesh)
            local = lay.local_shape(mesh.rank)
        except spmd.SpecError:  # a spec the op must refuse itself
            lay, local = None, shape
        q = torch.randn(local, dtype=F64)
        k = torch.randn(k_shape or local, dtype=F64)
        v = torch.randn(v_shape or local, dtype=F64)
        OPS[len(shape) - 3](q, k, v, ks, ds, cs, rpb=rpb, mesh=mesh_arg or mesh,
                            spec=lay if by_layout and lay is not None else spec)
    return fn


@pytest.mark.parametrize("kwargs,match", [
    (dict(ks=5, ds=2), r"kernel_size 5 x dilation 2 = 10 positions do not fit"),
    (dict(ks=9), r"do not fit in spatial dim 0"),
    (dict(ds=0), r"dilation must be at least 1"),
    (dict(ds=(1, 2)), r"dilation must be an int or 1 ints"),
    (dict(ks=0), r"kernel_size must be at least 1"),
    (dict(cs="yes"), r"is_causal must be a bool"),
    (dict(spec=P(None, None, "sp")), r"splits dim 2 \(heads\)"),
    (dict(spec=P(None, None, None, "sp")), r"splits dim 3 \(head_dim\)"),
    (dict(spec=P(None, "zz")), r"'zz'"),
    (dict(k_shape=(1, 4, 2, 2)), r"k \(f64\[1, 4, 2, 2\]\) must have the shape of q"),
    (dict(v_shape=(1, 4, 3, 3)), r"v \(f64\[1, 4, 3, 3\]\) must match k"),
    (dict(k_shape=(1, 4, 1, 3)), r"for fewer key/value heads \(GQA\) pass enable_gqa=True"),
    (dict(rpb=torch.zeros(2, 3)), r"rpb must be \[heads, 2 \* kernel_size - 1"),
])
def test_bad_arguments_raise_spec_error_on_every_rank_before_data_moves(kwargs, match):
    fn = _call(**kwargs, by_layout="spec" not in kwargs)
    got, stats = errors_on_every_rank(fn)
    for err, msg in got:
        assert err is spmd.SpecError, (err, msg)
        assert re.search(match, msg), msg
    assert stats.calls() == 0


def test_kernel_too_large_with_a_P_spec_raises_after_the_size_exchange_only():
    got, stats = errors_on_every_rank(_call(ks=5, ds=2, by_layout=False))
    assert all(err is spmd.SpecError and "do not fit" in msg for err, msg in got)
    assert stats.calls("neighborhood_attention1d") == 0  # no data moved
    assert stats.calls() == stats.calls("neighborhood_attention1d sizes") == 2


def test_wrong_mesh_and_type_errors():
    other = spmd.Mesh((2,), ("sp",))
    got, stats = errors_on_every_rank(_call(mesh_arg=other))
    assert all(err is spmd.SpecError and "different Mesh objects" in msg for err, msg in got)
    assert stats.calls() == 0
    q = torch.zeros(1, 4, 1, 2)
    with pytest.raises(TypeError, match="pass mesh= too"):
        neighborhood_attention1d(q, q, q, 3, spec=P(None))
    with pytest.raises(TypeError, match="share a dtype"):
        neighborhood_attention1d(q, q.double(), q, 3)
    with pytest.raises(TypeError, match="floating point"):
        neighborhood_attention1d(q.long(), q, q, 3)
    with pytest.raises(spmd.SpecError, match="heads-last"):
        neighborhood_attention2d(q, q, q, 3)
