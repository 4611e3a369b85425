"""The differentiable collectives and shard_map on real gloo processes (world 2 and 4).

Every per-rank program here runs on the session pools (``gloo2``, ``gloo4`` in
conftest.py) and is checked twice:

* against a single-device float64 reference computed in this process with plain torch
  ops (the approach of tests/collectives/test_primitives.py and tests/test_mapping.py), and
* for the collectives, against the very same per-rank program run by
  ``spmd.launch(..., backend="threads")``, which tests/collectives/test_primitives.py checks against
  float64 references with many more examples.

Tolerances. Collectives: reductions (psum, pmean, pmax/pmin tie sharing, the psum in
the backward of all_gather / psum_scatter / broadcast) only reorder float64 additions
(gloo's ring may add in another order than the reference), so rtol = atol = 1e-12; ops that
only move data (all_gather, ppermute, all_to_all, broadcast values; ppermute and
all_to_all gradients) must match exactly. shard_map: the sharded run adds partial sums
per shard and then over ranks, and the gradient all-reduce adds per-rank partial
gradients, so results differ from one device by a few ulps of float64: rtol = atol = 1e-10
(as tests/test_mapping.py).

The machine running CI has 2 cores (4 processes are oversubscribed): few, batched runs.
Functions run by workers are module-level so that spawned processes can import them.
"""
from __future__ import annotations

import copy
import math
import re
import time

import numpy as np
import pytest
import torch
from _reference import groups_of, shard_map_vs_single_device
from hypothesis import example, given, settings
from hypothesis import strategies as st

import spmd
from spmd import P

pytestmark = pytest.mark.gloo

F64 = torch.float64
TOL_RED = dict(rtol=1e-12, atol=1e-12)
TOL_SM = dict(rtol=1e-10, atol=1e-10)


# =========================================================================================
# 1. Every collective, value and gradient
# =========================================================================================

def _balanced(length, n):
    return [len(c) for c in np.array_split(np.arange(length), n)]


def _gen(cfg, j, r, salt):
    return torch.Generator().manual_seed(cfg["seed"] * 100_003 + 1009 * j + 31 * r + salt)


def _inputs(cfg, j, r, k, n):
    """Rank r's float64 inputs (group index k of n) for the j-th axes; the same in every
    process (a seeded generator per rank)."""
    g = _gen(cfg, j, r, 0)

    def randn(*s):
        return torch.randn(s, generator=g, dtype=F64)

    def ints(*s):  # three values: ties across ranks are common
        return torch.randint(-1, 2, s, generator=g).to(F64)

    ag, ps, sp, cl = (cfg[key][:n] for key in ("ag", "ps", "a2a_split", "a2a_clen"))
    own = cfg["a2a_own"][k][:n]
    return {
        "psum": randn(2, 3),
        "pmean": randn(3),
        "pmax": ints(2, 3),
        "pmin": ints(3, 2),
        "all_gather": randn(2, 3),                      # stacked at a new dim 1
        "all_gather_tiled": randn(ag[k], 2),            # uneven along dim 0, zeros included
        "all_gather_tiled_last": randn(2, ag[-1 - k]),  # uneven along dim -1, sizes passed
        "psum_scatter": randn(3, n),                    # untiled, scatter_dimension=-1
        "psum_scatter_tiled": randn(2, sum(ps)),        # explicit uneven sizes on dim 1
        "psum_scatter_balanced": randn(7, 2),           # 7 rows by the balanced rule
        "ppermute_partial": randn(3),
        "ppermute_cyclic": randn(2, 2),
        "all_to_all": randn(n, 2),                      # untiled: split 0, concat 1
        "all_to_all_tiled": randn(sum(sp), cl[k]),      # split 0 (uneven), concat 1 (uneven)
        "all_to_all_tiled_same": randn(sum(own), 2),    # split = concat = 0, own sizes
        "broadcast": randn(3),
    }


def _partial(n):  # the halo shift: index 0 receives nothing, index n-1 sends nothing
    return [(i, i + 1) for i in range(n - 1)]


def _cyclic(n):
    return [(i, (i - 1) % n) for i in range(n)]


# name -> per-rank program (x, axes, k, n, cfg) -> y; exact value?; exact gradient?
OPS = {
    "psum": (lambda x, ax, k, n, c: spmd.psum(x, ax), False, False),
    "pmean": (lambda x, ax, k, n, c: spmd.pmean(x, ax), False, False),
    "pmax": (lambda x, ax, k, n, c: spmd.pmax(x, ax), True, False),
    "pmin": (lambda x, ax, k, n, c: spmd.pmin(x, ax), True, False),
    "all_gather": (lambda x, ax, k, n, c: spmd.all_gather(x, ax, axis=1), True, False),
    "all_gather_tiled": (lambda x, ax, k, n, c: spmd.all_gather(x, ax, tiled=True),
                         True, False),
    "all_gather_tiled_last": (
        lambda x, ax, k, n, c: spmd.all_gather(x, ax, axis=-1, tiled=True,
                                               sizes=c["ag"][:n][::-1]), True, False),
    "psum_scatter": (lambda x, ax, k, n, c: spmd.psum_scatter(x, ax, scatter_dimension=-1),
                     False, True),
    "psum_scatter_tiled": (
        lambda x, ax, k, n, c: spmd.psum_scatter(x, ax, scatter_dimension=1, tiled=True,
                                                 sizes=c["ps"][:n]), False, True),
    "psum_scatter_balanced": (lambda x, ax, k, n, c: spmd.psum_scatter(x, ax, tiled=True),
                              False, True),
    "ppermute_partial": (lambda x, ax, k, n, c: spmd.ppermute(x, ax, _partial(n)), True, True),
    "ppermute_cyclic": (lambda x, ax, k, n, c: spmd.ppermute(x, ax, _cyclic(n)), True, True),
    "all_to_all": (lambda x, ax, k, n, c: spmd.all_to_all(x, ax, 0, 1), True, True),
    "all_to_all_tiled": (
        lambda x, ax, k, n, c: spmd.all_to_all(x, ax, 0, 1, tiled=True,
                                               split_sizes=c["a2a_split"][:n]), True, True),
    "all_to_all_tiled_same": (
        lambda x, ax, k, n, c: spmd.all_to_all(x, ax, 0, 0, tiled=True,
                                               split_sizes=c["a2a_own"][k][:n]), True, True),
    "broadcast": (lambda x, ax, k, n, c: spmd.broadcast(x, ax, n - 1), True, False),
}


def _sum(xs):
    s = xs[0]
    for x in xs[1:]:
        s = s + x
    return s


def _reference(name, xs, cfg):
    """Single-device outputs of one group, in group order, from its members' inputs."""
    n = len(xs)
    if name == "psum":
        return [_sum(xs)] * n
    if name == "pmean":
        return [_sum(xs) / n] * n
    if name in ("pmax", "pmin"):
        red = torch.amax if name == "pmax" else torch.amin  # ties share the gradient
        return [red(torch.stack(xs), dim=0)] * n
    if name == "all_gather":
        return [torch.stack(xs, dim=1)] * n
    if name == "all_gather_tiled":
        return [torch.cat(xs, dim=0)] * n
    if name == "all_gather_tiled_last":
        return [torch.cat(xs, dim=-1)] * n
    if name == "psum_scatter":
        return list(_sum(xs).unbind(-1))
    if name == "psum_scatter_tiled":
        return list(_sum(xs).split(cfg["ps"][:n], 1))
    if name == "psum_scatter_balanced":
        return list(_sum(xs).split(_balanced(7, n), 0))
    if name.startswith("ppermute"):
        perm = _partial(n) if name == "ppermute_partial" else _cyclic(n)
        ys = [torch.zeros_like(x) for x in xs]  # no source: zeros
        for s, d in perm:
            ys[d] = xs[s]
        return ys
    if name == "all_to_all":
        return [torch.stack([x.select(0, r) for x in xs], dim=1) for r in range(n)]
    if name == "all_to_all_tiled":
        sizes = cfg["a2a_split"][:n]
        return [torch.cat([x.split(sizes, 0)[r] for x in xs], dim=1) for r in range(n)]
    if name == "all_to_all_tiled_same":
        return [torch.cat([x.split(cfg["a2a_own"][j][:n], 0)[r] for j, x in enumerate(xs)])
                for r in range(n)]
    if name == "broadcast":
        return [xs[n - 1]] * n
    raise AssertionError(name)


def _cotangent(cfg, j, r, i, shape):
    return torch.randn(shape, generator=_gen(cfg, j, r, 1 + i), dtype=F64)


def _collectives(mesh, axes_list, cfg):
    """Per-rank: every collective over each axes of ``axes_list``; per axes, the rank's
    (axis_index, axis_size) and, per op, its output and its input's gradient from the
    local loss ``(y * w).sum()`` (one backward per op)."""
    r = mesh.rank
    res = []
    for j, axes in enumerate(axes_list):
        k, n = spmd.axis_index(axes), spmd.axis_size(axes)
        xs = _inputs(cfg, j, r, k, n)
        ops = {}
        for i, (name, (fn, _, _)) in enumerate(OPS.items()):
            x = xs[name].requires_grad_()
            y = fn(x, axes, k, n, cfg)
            (y * _cotangent(cfg, j, r, i, y.shape)).sum().backward()
            ops[name] = (y.detach(), x.grad)
        res.append(((k, n), ops))
    return res


def _close(got, want, exact, what):
    assert got is not None, f"{what}: missing"
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    if exact:
        assert torch.equal(got, want), (what, got, want)
    else:
        torch.testing.assert_close(got, want, **TOL_RED, msg=what)


def _check_collectives(got, shape, names, axes_list, cfg):
    size = math.prod(shape)
    threads = spmd.launch(_collectives, shape, names, backend="threads",
                          args=(axes_list, cfg), timeout=30)
    for j, axes in enumerate(axes_list):
        groups = groups_of(shape, names, axes)
        n = len(groups[0])
        where = {r: k for g in groups for k, r in enumerate(g)}
        for r in range(size):
            assert got[r][j][0] == (where[r], n), (axes, r, got[r][j][0])
            assert threads[r][j][0] == (where[r], n)
        xs = {r: _inputs(cfg, j, r, where[r], n) for r in range(size)}
        for i, (name, (_, exact_v, exact_g)) in enumerate(OPS.items()):
            leaves = {r: xs[r][name].clone().requires_grad_() for r in range(size)}
            ys = {}
            for g in groups:
                ys.update(zip(g, _reference(name, [leaves[r] for r in g], cfg)))
            loss = sum((ys[r] * _cotangent(cfg, j, r, i, ys[r].shape)).sum()
                       for r in range(size))
            grads = torch.autograd.grad(loss, [leaves[r] for r in range(size)],
                                        allow_unused=True, materialize_grads=True)
            for r in range(size):
                what = f"{name} over {axes!r} on rank {r}"
                y, gx = got[r][j][1][name]
                ty, tgx = threads[r][j][1][name]
                _close(y, ys[r].detach(), exact_v, "value of " + what)
                _close(gx, grads[r], exact_g, "gradient of " + what)
                # the same per-rank program on the threads backend
                _close(y, ty, exact_v, "value vs threads of " + what)
                _close(gx, tgx, exact_g, "gradient vs threads of " + what)


sizes4 = st.lists(st.integers(0, 3), min_size=4, max_size=4)
configs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**20),
    "ag": sizes4, "ps": sizes4, "a2a_split": sizes4,
    "a2a_clen": st.lists(st.integers(0, 2), min_size=4, max_size=4),
    "a2a_own": st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4),
                        min_size=4, max_size=4),
})
# Zero-size blocks on some ranks (and an empty receive) for every uneven op.
ZEROS = {"seed": 7, "ag": [0, 3, 1, 0], "ps": [2, 0, 1, 0], "a2a_split": [1, 0, 2, 0],
         "a2a_clen": [2, 0, 1, 1], "a2a_own": [[0, 2, 1, 0], [2, 0, 0, 1], [1, 1, 0, 2],
                                               [0, 0, 0, 0]]}


@settings(max_examples=2)
@given(cfg=configs)
@example(cfg=ZEROS)
def test_collectives_world2(gloo2, cfg):
    axes_list = ["sp", ("sp",)]
    got = gloo2.run(_collectives, (2,), ("sp",), args=(axes_list, cfg))
    _check_collectives(got, (2,), ("sp",), axes_list, cfg)


@settings(max_examples=1)
@given(cfg=configs)
@example(cfg=ZEROS)
def test_collectives_world4(gloo4, cfg):
    got = gloo4.run(_collectives, (4,), ("sp",), args=(["sp"], cfg))
    _check_collectives(got, (4,), ("sp",), ["sp"], cfg)


@settings(max_examples=1)
@given(cfg=configs)
@example(cfg=ZEROS)
def test_collectives_2d_mesh(gloo4, cfg):
    """A (2, 2) mesh: over each axis and over ("sp", "dp"), whose group order (0, 2, 1, 3)
    differs from the global rank order."""
    shape, names = (2, 2), ("dp", "sp")
    axes_list = ["sp", "dp", ("sp", "dp")]
    got = gloo4.run(_collectives, shape, names, args=(axes_list, cfg))
    _check_collectives(got, shape, names, axes_list, cfg)


# =========================================================================================
# 2. shard_map: every process calls it with the same global tensors
# =========================================================================================

def _with_params(mod, f_local, f_global, mesh, in_specs, out_specs, args, **kw):
    """Like _sm_case for a body closing over ``mod`` (a copy runs the reference); only
    the module's parameters require grad; returns its parameter gradients too."""
    ref_mod = copy.deepcopy(mod)
    got, want = shard_map_vs_single_device(lambda *a: f_local(mod, *a), lambda *a: f_global(ref_mod, *a),
                         mesh, in_specs, out_specs, args, **kw)
    return (got + [p.grad for p in mod.parameters()],
            want + [p.grad for p in ref_mod.parameters()])


def _heat(u):  # one explicit diffusion step; u carries one halo row above and below
    core = u[1:-1]
    return core + 0.2 * (u[:-2] + u[2:] + core.roll(1, 1) + core.roll(-1, 1) - 4 * core)


def _shard_map_1d(mesh, rows, seed):
    """Per-rank: shard_map cases on a 1-d mesh; {case: (got, single-device)}."""
    n = mesh.size
    torch.manual_seed(seed)  # every process builds the same global tensors
    x = torch.randn(rows, 3, dtype=F64)
    nograd = x.detach()  # no input requires grad: only parameters do
    res = {}
    # (a) psum to a replicated output, uneven shards
    res["psum"] = shard_map_vs_single_device(lambda x: spmd.psum((x ** 2).sum(0), "sp"),
                           lambda x: (x ** 2).sum(0), mesh, P("sp"), P(), [x])
    # (b) all_gather of uneven shards inside the body
    res["all_gather"] = shard_map_vs_single_device(
        lambda x: spmd.all_gather(torch.sin(x), "sp", tiled=True).cumsum(0),
        lambda x: torch.sin(x).cumsum(0), mesh, P("sp"), P(), [x])

    # (c) a halo stencil: two diffusion steps, halo rows by ppermute (zeros at the ends)
    def local(u):
        for _ in range(2):
            top = spmd.ppermute(u[-1:], "sp", [(i, i + 1) for i in range(n - 1)])
            bottom = spmd.ppermute(u[:1], "sp", [(i + 1, i) for i in range(n - 1)])
            u = _heat(torch.cat([top, u, bottom]))
        return u, spmd.psum((u ** 2).sum(), "sp")

    def glob(u):
        for _ in range(2):
            u = _heat(torch.nn.functional.pad(u, (0, 0, 1, 1)))
        return u, (u ** 2).sum()

    res["halo"] = shard_map_vs_single_device(local, glob, mesh, P("sp"), (P("sp"), P()), [x])

    # (d) a body closing over nn.Linear: replicated and sharded outputs, found in the
    # graph or named by params=
    torch.manual_seed(seed + 1)
    lin = torch.nn.Linear(3, 2).double()
    res["linear_replicated"] = _with_params(
        lin, lambda m, x: spmd.psum(torch.tanh(m(x)).sum(), "sp"),
        lambda m, x: torch.tanh(m(x)).sum(), mesh, P("sp"), P(), [nograd])
    lin = torch.nn.Linear(3, 2).double()
    res["linear_sharded"] = _with_params(lin, lambda m, x: torch.tanh(m(x)) ** 2,
                                         lambda m, x: torch.tanh(m(x)) ** 2,
                                         mesh, P("sp"), P("sp"), [nograd])
    lin = torch.nn.Linear(3, 2).double()
    res["linear_params"] = _with_params(lin, lambda m, x: m(x).cos(), lambda m, x: m(x).cos(),
                                        mesh, P("sp"), P("sp"), [x],
                                        params=list(lin.parameters()))

    # (f) an nn.Module as f: input and parameter gradients
    mod = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh()).double()
    ref = copy.deepcopy(mod)
    got, want = shard_map_vs_single_device(mod, ref, mesh, P("sp"), P("sp"), [x])
    res["module_as_f"] = (got + [p.grad for p in mod.parameters()],
                          want + [p.grad for p in ref.parameters()])
    return res


def _shard_map_2d(mesh, rows, seed):
    """Per-rank: shard_map cases on a ("dp", "sp") = (2, 2) mesh."""
    torch.manual_seed(seed)
    x = torch.randn(rows, 5, dtype=F64)
    b = torch.randn(5, dtype=F64)
    c = torch.randn(1, dtype=F64)
    res = {}

    # rows over dp, columns over sp; b split over sp (gradient summed over dp); c
    # replicated (gradient summed over the whole mesh); a psum over each axis and over
    # ("sp", "dp")
    def local(x, b, c):
        y = torch.tanh(x * b + c)
        norms = spmd.psum((y ** 2).sum(1), "sp").sqrt()
        cols = spmd.psum(y.sum(0), "dp")
        return norms, cols, spmd.psum(y.sum(), ("sp", "dp")), y

    def glob(x, b, c):
        y = torch.tanh(x * b + c)
        return (y ** 2).sum(1).sqrt(), y.sum(0), y.sum(), y

    res["dp_sp"] = shard_map_vs_single_device(local, glob, mesh, (P("dp", "sp"), P("sp"), P()),
                            (P("dp"), P("sp"), P(), P("dp", "sp")), [x, b, c])
    # rows over the tuple ("sp", "dp") (group order differs from rank order)
    ax = ("sp", "dp")
    res["tuple"] = shard_map_vs_single_device(
        lambda x: (spmd.all_gather(x * 2, ax, tiled=True), spmd.psum(x.sum(0), ax) ** 2,
                   spmd.pmax(x.amax(0), ax)),
        lambda x: (x * 2, x.sum(0) ** 2, x.amax(0)), mesh, P(ax), (P(), P(), P()), [x])
    # parameters used on a batch split over dp, replicated over sp: the loss is replicated
    # over both axes and the parameter gradient is summed over the whole mesh
    torch.manual_seed(seed + 1)
    lin = torch.nn.Linear(5, 3).double()
    res["linear_dp"] = _with_params(lin, lambda m, x: spmd.psum(torch.tanh(m(x)).sum(), "dp"),
                                    lambda m, x: torch.tanh(m(x)).sum(), mesh, P("dp"), P(),
                                    [x.detach()])
    # an nn.Module as f over dp, its output split over dp
    mod = torch.nn.Linear(5, 2).double()
    ref = copy.deepcopy(mod)
    got, want = shard_map_vs_single_device(mod, ref, mesh, P("dp"), P("dp"), [x])
    res["module_as_f"] = (got + [p.grad for p in mod.parameters()],
                          want + [p.grad for p in ref.parameters()])
    return res


def _check_shard_map(got):
    world = len(got)
    for case in got[0]:
        for r in range(world):
            mine, want = got[r][case]
            assert len(mine) == len(want)
            for i, (a, b) in enumerate(zip(mine, want)):
                what = f"{case}[{i}] on rank {r}"
                if b is None:
                    assert a is None, what
                    continue
                assert a is not None, f"{what}: no gradient"
                assert a.shape == b.shape and a.dtype == b.dtype, (what, a, b)
                torch.testing.assert_close(a, b, **TOL_SM, msg=what)
                # every process holds the same global outputs and gradients
                assert torch.equal(a, got[0][case][0][i]), what


@pytest.mark.parametrize("world,rows", [(2, 7), (4, 10)])
def test_shard_map_1d(request, world, rows):
    pool = request.getfixturevalue(f"gloo{world}")
    got = pool.run(_shard_map_1d, (world,), ("sp",), args=(rows, 3))
    _check_shard_map(got)


def test_shard_map_2d_mesh(gloo4):
    got = gloo4.run(_shard_map_2d, (2, 2), ("dp", "sp"), args=(7, 5))
    assert set(got[0]) == {"dp_sp", "tuple", "linear_dp", "module_as_f"}
    _check_shard_map(got)


# =========================================================================================
# 3. Failures: no hang, a clear error, and the pool works afterwards
# =========================================================================================

def _psum_rank_1_never_arrives(mesh):
    if mesh.rank == 1:
        time.sleep(60)  # ended by the pool
    return spmd.psum(torch.ones(2), "sp")


def _psum_backward_rank_1_never_arrives(mesh):
    x = torch.ones(2, requires_grad=True)
    y = spmd.psum(x * 2, "sp")
    if mesh.rank == 1:
        return None  # skips the backward: rank 0's backward psum waits for it
    y.sum().backward()
    return x.grad


def _raises_in_body_on_1(mesh):
    def body(x):
        if spmd.axis_index("sp") == 1:
            raise ValueError("boom in the body")
        return spmd.psum(x.sum(), "sp")

    x = torch.arange(5.0, dtype=F64, requires_grad=True)
    return spmd.shard_map(body, mesh, P("sp"), P())(x)


def _sum_of_squares(mesh):
    x = torch.arange(5.0, dtype=F64, requires_grad=True)
    y = spmd.shard_map(lambda x: spmd.psum((x ** 2).sum(), "sp"), mesh, P("sp"), P())(x)
    y.backward()
    return y.item(), x.grad


def _check_pool_works(pool):
    for y, g in pool.run(_sum_of_squares, (2,), ("sp",)):
        assert y == 30.0 and torch.equal(g, 2 * torch.arange(5.0, dtype=F64))


def test_missing_rank_times_out(gloo2):
    t0 = time.monotonic()
    with pytest.raises(spmd.CommTimeout, match=r"rank 0: psum over axis 'sp' timed out after "
                       r"3 s on rank 0: ranks \[1\] of the group \[0, 1\] did not arrive") as e:
        gloo2.run(_psum_rank_1_never_arrives, (2,), ("sp",), timeout=3)
    assert (e.value.op, e.value.axes, e.value.missing) == ("psum", ("sp",), (1,))
    assert time.monotonic() - t0 < 20
    _check_pool_works(gloo2)
    # in backward: the psum that is psum's transpose
    with pytest.raises(spmd.CommTimeout, match=r"rank 0: psum over axis 'sp' timed out after "
                       r"3 s on rank 0: ranks \[1\] of the group \[0, 1\] did not arrive"):
        gloo2.run(_psum_backward_rank_1_never_arrives, (2,), ("sp",), timeout=3)
    _check_pool_works(gloo2)


def test_exception_in_body_reaches_caller(gloo2):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^rank 1: boom in the body"):
        gloo2.run(_raises_in_body_on_1, (2,), ("sp",))
    assert time.monotonic() - t0 < 15  # rank 0 waits in psum: the pool ends it, no hang
    _check_pool_works(gloo2)


# =========================================================================================
# 4. spmd.launch(backend="gloo"), one shot: training through shard_map
# =========================================================================================

def _train(mesh, seed, steps):
    """Per-rank: SGD steps of a tiny model, the loss through shard_map over uneven shards
    (9 rows over 2 ranks), and the same steps on one device."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 1)).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(9, 3, dtype=F64), torch.randn(9, 1, dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn = spmd.shard_map(lambda x, y: spmd.psum(((model(x) - y) ** 2).sum(), "sp") / 9,
                             mesh, (P("sp"), P("sp")), P())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        opt_ref.zero_grad()
        loss_ref = ((ref(x) - y) ** 2).mean()
        loss_ref.backward()
        opt_ref.step()
        losses.append((loss.item(), loss_ref.item()))
    return ([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
            losses)


def test_launch_gloo_training_matches_single_device():
    out = spmd.launch(_train, (2,), ("sp",), backend="gloo", args=(0, 2), timeout=60)
    assert len(out) == 2
    for r, (params, ref, losses) in enumerate(out):
        assert len(losses) == 2 and losses[1][1] < losses[0][1]
        for a, b in losses:
            assert math.isclose(a, b, rel_tol=1e-10, abs_tol=1e-10), (r, losses)
        for i, (p, q) in enumerate(zip(params, ref)):
            torch.testing.assert_close(p, q, **TOL_SM, msg=f"parameter {i} on rank {r}")
            assert torch.equal(p, out[0][0][i]), f"parameter {i} differs on rank {r}"
    # the parameters moved (the comparison would be vacuous otherwise)
    torch.manual_seed(0)
    init = torch.nn.Linear(3, 5).double()
    assert not torch.allclose(out[0][0][0], init.weight.detach())


def test_launch_refuses_function_from_interactive_main():
    """A function typed into a REPL or notebook cannot be imported by spawned processes:
    say so before starting any, instead of a child dying without a report."""
    import subprocess
    import sys
    code = ("import spmd\n"
            "def per_rank(mesh):\n    return mesh.rank\n"
            "try:\n    spmd.launch(per_rank, (2,), ('sp',), backend='gloo')\n"
            "except TypeError as e:\n    print('TypeError:', e)\n")
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=120)
    assert "defined in an interactive __main__" in out.stdout, out.stdout + out.stderr


def _transforms_2x2(mesh):
    """Every transform on a (2, 2) mesh, forward and backward."""
    xg = torch.arange(30.0, dtype=F64).reshape(6, 5) / 7
    lay = spmd.Layout(xg.shape, P("dp", "sp"), mesh)
    x = lay.shard(xg, mesh.rank).clone().requires_grad_()
    h = spmd.halo_pad(x, mesh, ("dp", "sp"), (0, 1), ((1, 2), (2, 1)), mode="reflect")
    r = spmd.redistribute(x, mesh, P("dp", "sp"), P("sp", "dp"))
    m = spmd.reduce(x, mesh, P("dp", "sp"), op="mean", dim=0)
    g = spmd.gather(x, mesh, P("dp", "sp"), dst=3)
    s = spmd.scatter(xg.clone() if mesh.rank == 0 else None, mesh, P(None, ("sp", "dp")))
    loss = (h ** 2).sum() + (r * 3).sum() + m.sum() + s.sum()
    spmd.backward([loss, g if isinstance(g, spmd.Placeholder) else g.sum()])
    return [t.detach() if isinstance(t, torch.Tensor) else repr(t) for t in (h, r, m, g, s)], x.grad


def test_transforms_world_4_match_threads(gloo4):
    got = gloo4.run(_transforms_2x2, (2, 2), ("dp", "sp"))
    want = spmd.launch(_transforms_2x2, (2, 2), ("dp", "sp"))
    for (gv, gg), (wv, wg) in zip(got, want):
        for a, b in zip(gv, wv):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                assert a == b
        torch.testing.assert_close(gg, wg, rtol=0, atol=0)


def _divergent_params(mesh):
    torch.manual_seed(0)  # one process per rank: the same weights everywhere
    lin1, lin2 = torch.nn.Linear(2, 2).double(), torch.nn.Linear(2, 2).double()

    def body(x):
        y = lin1(x)
        if spmd.axis_index("sp") == 1:  # a data-dependent branch: rank 1 uses lin2 too
            y = lin2(y)
        return spmd.psum(y.sum(), "sp")

    x = torch.ones(4, 2, dtype=F64)
    try:
        spmd.shard_map(body, mesh, P("sp"), P())(x).backward()
    except spmd.SpecError as e:
        return str(e)
    return "no error"


def test_ranks_finding_different_parameters_get_a_clear_error(gloo2):
    """Without the check, gloo would abort the processes on mismatched buffer sizes."""
    for msg in gloo2.run(_divergent_params, (2,), ("sp",)):
        assert "ranks found different tensors to differentiate" in msg
        assert "rank 0: 0 inputs + 2 parameters" in msg and "rank 1: 0 inputs + 4 parameters" in msg
    assert gloo2.run(_gloo_ok, (2,), ("sp",)) == [True, True]  # the processes survived


def _gloo_ok(mesh):
    return True


def _extremes_with_nan(mesh):
    """Rank 1 holds a NaN (and rank 0 an inf where rank 1 has a NaN): every extreme is
    NaN there, as torch.amax/amin of the stacked values."""
    nan, inf = float("nan"), float("inf")
    r = mesh.rank
    x = torch.tensor([1.0, nan, 3.0, inf, -inf]) if r == 1 else \
        torch.tensor([2.0, 0.0, inf, nan, 5.0])
    lay = spmd.Layout((4, 5), P("sp"), mesh)
    block = torch.full((2, 5), float(r)).index_put_((torch.tensor([1]), torch.tensor([r])),
                                                   torch.tensor(nan))
    return (x, spmd.pmax(x, "sp"), spmd.pmin(x, "sp"),
            spmd.reduce(block, mesh, P("sp"), op="max", dim=0, sizes=lay),
            spmd.reduce(block, mesh, P("sp"), op="min", dim=0),
            spmd.pmax(torch.tensor([1.0, 2.0]) * (r + 1), "sp"),
            # 800 bytes: a ring reduction (the small ones above are gathered)
            spmd.pmax(x.repeat(40), "sp"), spmd.pmin(x.repeat(40), "sp"))


def test_max_and_min_keep_nan_on_gloo(gloo2):
    """gloo's MAX and MIN drop a NaN held by a later rank; spmd's, threads
    and one device keep it."""
    got = gloo2.run(_extremes_with_nan, (2,), ("sp",))
    want = spmd.launch(_extremes_with_nan, (2,), ("sp",))
    xs = torch.stack([got[0][0], got[1][0]])
    for rank in (0, 1):
        for g, w in zip(got[rank][1:], want[rank][1:]):
            torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(got[rank][1], xs.amax(0), equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(got[rank][2], xs.amin(0), equal_nan=True, rtol=0, atol=0)
        assert got[rank][3].isnan().tolist() == [True, True, False, False, False]
        assert got[rank][5].tolist() == [2.0, 4.0]
        for k, red in ((6, xs.amax(0)), (7, xs.amin(0))):
            torch.testing.assert_close(got[rank][k], red.repeat(40), equal_nan=True, rtol=0,
                                       atol=0)


def _differing_globals(mesh, what):
    """Per-rank shard_map on processes where rank 1's copy of one global differs: the
    argument, a params= tensor, or a parameter found in the graph. What each rank got."""
    c = spmd.comm.comm_of(mesh)
    c.validate = True
    try:
        r = mesh.rank
        x = torch.arange(8.0) + (r if what == "args" else 0)
        w = torch.tensor(2.0 + (r if what in ("params", "found") else 0), requires_grad=True)
        f = spmd.shard_map(lambda s: spmd.psum((s * w).sum(), "sp"), mesh, P("sp"), P(),
                           params=[w] if what == "params" else None)
        try:
            f(x).backward()
            return w.grad.item()
        except spmd.SpecError as e:
            return str(e)
    finally:
        c.validate = False  # the pool's processes serve later tests


@pytest.mark.parametrize("what, err", [
    ("args", r"shard_map \(SPMD_VALIDATE=1\): args\[0\] differs between ranks: rank 0 and "
             r"rank 1 passed different values"),
    ("params", r"params\[0\] differs between ranks"),
    ("found", r"shard_map backward \(SPMD_VALIDATE=1\): the parameters the body used differ "
              r"between rank 0 and rank 1"),
])
def test_ranks_passing_different_globals_raise_under_validation(gloo2, what, err):
    """Processes that pass different global arguments (or parameters) must not have their
    splits silently mixed: under validation every rank raises."""
    got = gloo2.run(_differing_globals, (2,), ("sp",), args=(what,))
    assert all(isinstance(g, str) and re.search(err, g) for g in got), got
    assert gloo2.run(_differing_globals, (2,), ("sp",), args=("none",)) == [28.0, 28.0]
