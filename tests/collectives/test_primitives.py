"""Differentiable collectives: values and gradients against a single-device float64 run.

The convention (docs/design.md): in per-rank code every tensor is device-varying, so rank r's
output y_r is its own variable. Each rank r backprops its local loss
``L_r = (y_r * w_r).sum()``; the collectives inside backward meet across ranks, and the
gradient each rank gets for its input x_r must equal ``d(sum_r L_r)/d x_r`` computed on
one device with plain torch ops on the list of every rank's input.

Tolerances: reductions (psum, pmean, pmax/pmin ties, and the psum inside the backward
of all_gather / broadcast) only reorder float64 additions, so rtol = atol = 1e-12.
Ops that only move data (all_gather, ppermute, all_to_all, broadcast values; ppermute and
all_to_all gradients) must match exactly.
"""
import gc
import math
import re
import threading
import time

import numpy as np
import pytest
import torch
from _reference import groups_of
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd.testing import on_mesh

F64 = torch.float64
TIMEOUT = 30  # generous for the value tests on a loaded 2-core machine; errors use 5 or less

MESHES = [((1,), ("i",)), ((2,), ("i",)), ((3,), ("i",)), ((4,), ("i",)),
          ((2, 2), ("a", "b")), ((1, 3), ("a", "b")), ((2, 3), ("a", "b"))]


def axis_options(names):
    if len(names) == 1:
        return [names[0], (names[0],)]
    a, b = names
    return [a, b, (a, b), (b, a)]


ALL_CASES = [(shape, names, ax) for shape, names in MESHES for ax in axis_options(names)]
cases = st.sampled_from(ALL_CASES)
seeds = st.integers(0, 2**31 - 1)


# -- the single-device reference -----------------------------------------------------------

def check(case, make_input, ref, per_rank, *, seed, exact_value=False, exact_grad=False,
          same_in_group=False):
    """Run ``per_rank(x, axes, k)`` on every rank via spmd.launch and compare with ``ref``.

    Args:
        make_input: ``(k, gen) -> float64 tensor`` for the rank at group position k.
        ref: single-device ``[x_0..x_{n-1}] -> [y_0..y_{n-1}]`` for one group.
        per_rank: the per-rank program ``(x_r, axes, k) -> y_r``.
    """
    shape, names, axes = case
    groups = groups_of(shape, names, axes)
    n = len(groups[0])
    size = math.prod(shape)
    where = {r: k for g in groups for k, r in enumerate(g)}
    gen = torch.Generator().manual_seed(seed)
    xs = [make_input(where[r], gen) for r in range(size)]

    leaves = [x.clone().requires_grad_() for x in xs]
    ys = [None] * size
    for g in groups:
        outs = ref([leaves[r] for r in g])
        assert len(outs) == n
        for r, y in zip(g, outs):
            ys[r] = y
    ws = [torch.randn(y.shape, generator=gen, dtype=F64) for y in ys]
    loss = sum((y * w).sum() for y, w in zip(ys, ws))
    if loss.requires_grad:
        ref_grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    else:  # e.g. ppermute with an empty perm: every output is zeros
        ref_grads = [torch.zeros_like(x) for x in xs]

    def body(mesh):
        r = mesh.rank
        k = spmd.axis_index(axes)
        x = xs[r].clone().requires_grad_()
        y = per_rank(x, axes, k)
        (y * ws[r]).sum().backward()
        return k, spmd.axis_size(axes), y.detach(), x.grad

    out = spmd.launch(body, shape, names, timeout=TIMEOUT)
    for r, (k, n_got, y, gx) in enumerate(out):
        assert (k, n_got) == (where[r], n)
        _close(y, ys[r].detach(), exact_value, f"value on rank {r}")
        assert gx is not None, f"no gradient on rank {r}"
        _close(gx, ref_grads[r], exact_grad, f"gradient on rank {r}")
    if same_in_group:  # every member computes a bit-identical result
        for g in groups:
            for r in g[1:]:
                assert torch.equal(out[r][2], out[g[0]][2])
    return out


def _close(got, want, exact, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    if exact:
        assert torch.equal(got, want), (what, got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=what)


def _sum(xs):
    s = xs[0]
    for x in xs[1:]:
        s = s + x
    return s


def randn(shape):
    return lambda k, gen: torch.randn(shape, generator=gen, dtype=F64)


small_shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


def group_size(case):
    shape, names, axes = case
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(shape[names.index(a)] for a in axes)


# -- psum / pmean / pmax / pmin ---------------------------------------------------------------

@given(case=cases, shape=small_shapes, seed=seeds, op=st.sampled_from(["psum", "pmean"]))
def test_psum_pmean(case, shape, seed, op):
    fn = getattr(spmd, op)

    def ref(xs):
        s = _sum(xs)
        return [s if op == "psum" else s / len(xs)] * len(xs)

    check(case, randn(shape), ref, lambda x, axes, k: fn(x, axes), seed=seed,
          same_in_group=True)


@given(case=cases, shape=small_shapes, seed=seeds, op=st.sampled_from(["pmax", "pmin"]),
       lo=st.integers(-2, 0), hi=st.integers(0, 2))
def test_pmax_pmin_with_ties(case, shape, seed, op, lo, hi):
    """Integer values from a tiny range: many ties, whose gradient is shared equally
    (as torch.amax / torch.amin do on one device)."""
    fn = getattr(spmd, op)
    red = torch.amax if op == "pmax" else torch.amin

    def make(k, gen):
        return torch.randint(lo, hi + 1, shape, generator=gen).to(F64)

    def ref(xs):
        return [red(torch.stack(xs), dim=0)] * len(xs)

    check(case, make, ref, lambda x, axes, k: fn(x, axes), seed=seed, same_in_group=True)


def test_pmax_all_tied_splits_gradient_equally():
    def body(mesh):
        x = torch.ones(2, dtype=F64, requires_grad=True)
        spmd.pmax(x, "i").sum().backward()
        return x.grad

    for g in spmd.launch(body, (4,), "i", timeout=TIMEOUT):
        # sum over 4 ranks of cotangent 1, shared by 4 tied ranks
        assert torch.equal(g, torch.ones(2, dtype=F64))


# -- bool and integer inputs --------------------------------------------------------------------
# psum counts (int64, as torch's sum of bools), pmean is the fraction (the default float
# dtype), pmax / pmin are any / all (bool): the single-device results of
# torch.stack(xs).sum(0), .to(float).mean(0), .any(0), .all(0). Exact: integer counts.

def _bool_ref(op, xs):
    s = torch.stack(xs)
    return {"psum": lambda: s.sum(0),
            "pmean": lambda: s.to(torch.get_default_dtype()).mean(0),
            "pmax": lambda: s.any(0), "pmin": lambda: s.all(0),
            "psum_scatter": lambda: s.sum(0)}[op]()


@given(case=cases, shape=small_shapes, seed=seeds,
       op=st.sampled_from(["psum", "pmean", "pmax", "pmin"]))
def test_bool_reductions_count(case, shape, seed, op):
    shape_m, names, axes = case
    groups = groups_of(shape_m, names, axes)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.rand(shape, generator=gen) < 0.5 for _ in range(math.prod(shape_m))]
    out = spmd.launch(lambda mesh: getattr(spmd, op)(xs[mesh.rank], axes), shape_m, names,
                      timeout=TIMEOUT)
    for g in groups:
        want = _bool_ref(op, [xs[r] for r in g])
        for r in g:
            assert out[r].dtype == want.dtype and torch.equal(out[r], want), (op, r, out[r])


def test_bool_psum_scatter_counts():
    xs = [torch.tensor([[True, False, True], [r == 0, True, False]]).T for r in range(2)]
    out = spmd.launch(lambda m: spmd.psum_scatter(xs[m.rank], "i", tiled=True), (2,), "i",
                      timeout=TIMEOUT)
    want = _bool_ref("psum_scatter", xs)
    assert torch.equal(torch.cat(out), want) and out[0].dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integer_pmean_is_the_float_mean(dtype):
    xs = [torch.tensor([r, 1, 2 * r], dtype=dtype) for r in range(3)]
    out = spmd.launch(lambda m: spmd.pmean(xs[m.rank], "i"), (3,), "i", timeout=TIMEOUT)
    want = torch.stack(xs).to(torch.get_default_dtype()).mean(0)
    for y in out:
        assert y.dtype == want.dtype and torch.allclose(y, want)


@on_mesh(2, "i", backends=("threads", "gloo"))
def test_bool_reductions_on_every_backend(mesh):
    x = torch.tensor([mesh.rank == 0, True, False])
    assert torch.equal(spmd.psum(x, "i"), torch.tensor([1, 2, 0]))
    assert torch.equal(spmd.pmean(x, "i"), torch.tensor([0.5, 1.0, 0.0]))
    assert torch.equal(spmd.pmax(x, "i"), torch.tensor([True, True, False]))
    assert torch.equal(spmd.pmin(x, "i"), torch.tensor([False, True, False]))


# -- all_gather -------------------------------------------------------------------------------

@given(case=cases, shape=small_shapes, seed=seeds, data=st.data())
def test_all_gather_stacked(case, shape, seed, data):
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)), label="axis")

    def ref(xs):
        return [torch.stack(xs, dim=axis)] * len(xs)

    check(case, randn(shape), ref, lambda x, axes, k: spmd.all_gather(x, axes, axis=axis),
          seed=seed, exact_value=True, same_in_group=True)


@given(case=cases, seed=seeds, data=st.data())
def test_all_gather_tiled_uneven(case, seed, data):
    n = group_size(case)
    base = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3), label="base")
    axis = data.draw(st.integers(-len(base), len(base) - 1), label="axis")
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="sizes")
    pass_sizes = data.draw(st.booleans(), label="pass_sizes")

    def make(k, gen):
        s = list(base)
        s[axis] = sizes[k]
        return torch.randn(s, generator=gen, dtype=F64)

    def ref(xs):
        return [torch.cat(xs, dim=axis)] * len(xs)

    def per_rank(x, axes, k):
        return spmd.all_gather(x, axes, axis=axis, tiled=True,
                               sizes=sizes if pass_sizes else None)

    check(case, make, ref, per_rank, seed=seed, exact_value=True, same_in_group=True)


# -- psum_scatter ------------------------------------------------------------------------------

@given(case=cases, shape=small_shapes, seed=seeds, data=st.data())
def test_psum_scatter_untiled(case, shape, seed, data):
    n = group_size(case)
    d = data.draw(st.integers(-len(shape) - 1, len(shape)), label="scatter_dimension")
    full = list(shape)
    full.insert(d % (len(shape) + 1), n)  # the scatter dim has one entry per rank

    def ref(xs):
        return list(_sum(xs).unbind(d))

    check(case, randn(full), ref,
          lambda x, axes, k: spmd.psum_scatter(x, axes, scatter_dimension=d), seed=seed)


@given(case=cases, seed=seeds, data=st.data())
def test_psum_scatter_tiled_uneven(case, seed, data):
    n = group_size(case)
    explicit = data.draw(st.booleans(), label="explicit sizes")
    if explicit:
        sizes = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="sizes")
        length = sum(sizes)
    else:
        length = data.draw(st.integers(0, 7), label="length")
        sizes = [len(c) for c in np.array_split(np.arange(length), n)]  # the balanced rule
    other = data.draw(st.lists(st.integers(1, 2), max_size=2), label="other dims")
    d = data.draw(st.integers(-len(other) - 1, len(other)), label="scatter_dimension")
    full = list(other)
    full.insert(d % (len(other) + 1), length)

    def ref(xs):
        return list(_sum(xs).split(sizes, d))

    def per_rank(x, axes, k):
        return spmd.psum_scatter(x, axes, scatter_dimension=d, tiled=True,
                                 sizes=sizes if explicit else None)

    check(case, randn(full), ref, per_rank, seed=seed)


# -- ppermute ----------------------------------------------------------------------------------

@st.composite
def perms(draw, n):
    if draw(st.booleans()):
        shift = draw(st.integers(-n, n))
        return [(i, (i + shift) % n) for i in range(n)]
    srcs = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    dsts = draw(st.permutations(range(n)))[:len(srcs)]
    return list(zip(srcs, dsts))


@given(case=cases, shape=small_shapes, seed=seeds, data=st.data())
def test_ppermute(case, shape, seed, data):
    perm = data.draw(perms(group_size(case)), label="perm")

    def ref(xs):
        ys = [torch.zeros_like(x) for x in xs]  # a rank that is no destination gets zeros
        for s, d in perm:
            ys[d] = xs[s]
        return ys

    check(case, randn(shape), ref, lambda x, axes, k: spmd.ppermute(x, axes, perm),
          seed=seed, exact_value=True, exact_grad=True)


# -- all_to_all -------------------------------------------------------------------------------

@given(case=cases, seed=seeds, data=st.data())
def test_all_to_all_untiled(case, seed, data):
    n = group_size(case)
    other = data.draw(st.lists(st.integers(0, 2), max_size=2), label="other dims")
    ndim = len(other) + 1
    sa = data.draw(st.integers(-ndim, ndim - 1), label="split_axis")
    ca = data.draw(st.integers(-ndim, ndim - 1), label="concat_axis")
    full = list(other)
    full.insert(sa % ndim, n)

    def ref(xs):
        # rank r gets block r of every rank's split dim, stacked at concat_axis
        return [torch.stack([x.select(sa, r) for x in xs], dim=ca) for r in range(len(xs))]

    check(case, randn(full), ref, lambda x, axes, k: spmd.all_to_all(x, axes, sa, ca),
          seed=seed, exact_value=True, exact_grad=True)


@given(case=cases, seed=seeds, data=st.data())
def test_all_to_all_tiled_uneven(case, seed, data):
    n = group_size(case)
    base = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=3), label="base")
    ndim = len(base)
    sa = data.draw(st.integers(-ndim, ndim - 1), label="split_axis")
    ca = data.draw(st.integers(-ndim, ndim - 1), label="concat_axis")
    explicit = data.draw(st.booleans(), label="explicit split_sizes")
    rank_sizes = st.lists(st.integers(0, 2), min_size=n, max_size=n)
    if sa % ndim == ca % ndim:
        # blocks are concatenated along the split dim itself: each rank splits its own way
        own = data.draw(st.lists(rank_sizes, min_size=n, max_size=n), label="sizes per rank")
        if not explicit:
            own = [[len(c) for c in np.array_split(np.arange(sum(s)), n)] for s in own]
        split = lambda k: own[k]
        concat_len = lambda k: base[ca]
    else:
        # every rank splits alike; the concat dim may differ per rank
        common = data.draw(rank_sizes, label="split sizes")
        if not explicit:
            common = [len(c) for c in np.array_split(np.arange(sum(common)), n)]
        clens = data.draw(rank_sizes, label="concat dim per rank")
        split = lambda k: common
        concat_len = lambda k: clens[k]

    def make(k, gen):
        s = list(base)
        s[ca] = concat_len(k)
        s[sa] = sum(split(k))
        return torch.randn(s, generator=gen, dtype=F64)

    def ref(xs):
        return [torch.cat([x.split(split(j), sa)[r] for j, x in enumerate(xs)], dim=ca)
                for r in range(len(xs))]

    def per_rank(x, axes, k):
        return spmd.all_to_all(x, axes, sa, ca, tiled=True,
                               split_sizes=split(k) if explicit else None)

    check(case, make, ref, per_rank, seed=seed, exact_value=True, exact_grad=True)


# -- broadcast, axis_index, axis_size -------------------------------------------------------------

@given(case=cases, shape=small_shapes, seed=seeds, data=st.data())
def test_broadcast(case, shape, seed, data):
    src = data.draw(st.integers(0, group_size(case) - 1), label="src")

    def ref(xs):
        return [xs[src]] * len(xs)

    check(case, randn(shape), ref, lambda x, axes, k: spmd.broadcast(x, axes, src),
          seed=seed, exact_value=True, same_in_group=True)


@pytest.mark.parametrize("shape,names,axes", ALL_CASES)
def test_axis_index_and_size(shape, names, axes):
    groups = groups_of(shape, names, axes)
    want = {r: (k, len(g)) for g in groups for k, r in enumerate(g)}
    t = (axes,) if isinstance(axes, str) else axes
    coords = np.unravel_index(np.arange(math.prod(shape)), shape)

    def body(mesh):
        r = mesh.rank
        # the linearised index over the axes, first axis major, by hand
        lin = 0
        for a in t:
            p = names.index(a)
            lin = lin * shape[p] + int(coords[p][r])
        return spmd.axis_index(axes), spmd.axis_size(axes), lin

    for r, (k, n, lin) in enumerate(spmd.launch(body, shape, names, timeout=TIMEOUT)):
        assert (k, n) == want[r] and k == lin


# -- torch.func.grad inside per-rank code --------------------------------------------------------

FUNC_OPS = {
    "psum": lambda x, ax: spmd.psum(x, ax),
    "pmean": lambda x, ax: spmd.pmean(x, ax),
    "pmax": lambda x, ax: spmd.pmax(x, ax),
    "pmin": lambda x, ax: spmd.pmin(x, ax),
    "all_gather": lambda x, ax: spmd.all_gather(x, ax, axis=1),
    "all_gather_tiled": lambda x, ax: spmd.all_gather(x[: spmd.axis_index(ax) % 3], ax,
                                                      tiled=True),
    "psum_scatter": lambda x, ax: spmd.psum_scatter(x, ax),
    "psum_scatter_tiled": lambda x, ax: spmd.psum_scatter(x, ax, scatter_dimension=1,
                                                          tiled=True),
    "ppermute": lambda x, ax: spmd.ppermute(x, ax, [(i, (i + 1) % spmd.axis_size(ax))
                                                    for i in range(spmd.axis_size(ax))]),
    "all_to_all": lambda x, ax: spmd.all_to_all(x, ax, 0, 1),
    "all_to_all_tiled": lambda x, ax: spmd.all_to_all(x, ax, 1, 0, tiled=True),
    "broadcast": lambda x, ax: spmd.broadcast(x, ax, 1),
    "psum+all_gather": lambda x, ax: spmd.psum(x, ax) * spmd.all_gather(x, ax, tiled=True)[:len(x)],
}


@pytest.mark.parametrize("power", [1, 2], ids=["linear", "squared"])
@pytest.mark.parametrize("shape,names,axes", [((3,), ("i",), "i"),
                                              ((2, 2), ("a", "b"), ("b", "a"))])
@pytest.mark.parametrize("op", sorted(FUNC_OPS))
def test_func_grad_matches_autograd(op, shape, names, axes, power):
    """torch.func.grad of a per-rank loss through each collective equals .backward().
    ``power=2`` makes the cotangent depend on x (backward runs with create_graph)."""
    fn = FUNC_OPS[op]

    def body(mesh):
        r = mesh.rank
        n = spmd.axis_size(axes)
        # integer-valued, so pmax/pmin have ties
        x0 = ((torch.arange(3 * n, dtype=F64).reshape(n, 3) * (r + 2)) % 3) - 1

        def loss(x):
            y = fn(x, axes)
            w = torch.cos(torch.arange(y.numel(), dtype=F64).reshape(y.shape) + r)
            return (y ** power * w).sum()

        g_func = torch.func.grad(loss)(x0)
        x = x0.clone().requires_grad_()
        loss(x).backward()
        return g_func, x.grad

    for r, (g_func, g_auto) in enumerate(spmd.launch(body, shape, names, timeout=TIMEOUT)):
        torch.testing.assert_close(g_func, g_auto, rtol=1e-12, atol=1e-12, msg=f"rank {r}")


def test_func_grad_psum_all_gather_against_reference():
    n = 3
    xs = [torch.randn(2, dtype=F64, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    ws = [torch.randn(2, dtype=F64), torch.randn(2 * n, dtype=F64)]

    def local_loss(x):
        return (spmd.psum(x, "i") ** 2 * ws[0]).sum() + (spmd.all_gather(x, "i", tiled=True) * ws[1]).sum()

    got = spmd.launch(lambda m: torch.func.grad(local_loss)(xs[m.rank]), (n,), "i",
                      timeout=TIMEOUT)
    leaves = [x.clone().requires_grad_() for x in xs]
    s, cat = _sum(leaves), torch.cat(leaves)
    loss = n * ((s ** 2 * ws[0]).sum() + (cat * ws[1]).sum())
    want = torch.autograd.grad(loss, leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# -- pytrees ------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["greenlets", "threads"])
@pytest.mark.parametrize("op", ["psum", "pmean", "pmax", "pmin"])
def test_reductions_of_a_pytree_in_shard_map(op, schedule):
    """In a shard_map body on either schedule: each leaf reduced as alone. (On rank
    greenlets the leaves were mapped by optree from C++, and pybind11 aborted the
    process at the second rank.)"""
    mesh = spmd.Mesh((3,), ("sp",), schedule=schedule)
    x = torch.randn(6, 2, dtype=F64, generator=torch.Generator().manual_seed(4))

    def body(s):
        return getattr(spmd, op)({"a": s.sum(0), "b": [s.max(), (s * 2,)]}, "sp")
    got = spmd.shard_map(body, mesh, spmd.P("sp"), spmd.P())(x)
    parts = list(x.split(2))
    red = {"psum": lambda v: torch.stack(v).sum(0), "pmean": lambda v: torch.stack(v).mean(0),
           "pmax": lambda v: torch.stack(v).amax(0), "pmin": lambda v: torch.stack(v).amin(0)}[op]
    torch.testing.assert_close(got["a"], red([p.sum(0) for p in parts]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["b"][0], red([p.max() for p in parts]), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["b"][1][0], red([p * 2 for p in parts]), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_psum_on_a_pytree(op):
    n = 3
    gen = torch.Generator().manual_seed(0)
    trees = [{"a": torch.randn(2, generator=gen, dtype=F64),
              "b": [torch.randn(3, 1, generator=gen, dtype=F64)],
              "c": (torch.randn((), generator=gen, dtype=F64),)} for _ in range(n)]
    ws = [torch.randn(2, dtype=F64, generator=gen), torch.randn(3, 1, dtype=F64, generator=gen)]

    def body(mesh):
        t = trees[mesh.rank]
        leaves = [t["a"].clone().requires_grad_(), t["b"][0].clone().requires_grad_(),
                  t["c"][0].clone().requires_grad_()]
        out = getattr(spmd, op)({"a": leaves[0], "b": [leaves[1]], "c": (leaves[2],)}, "i")
        assert set(out) == {"a", "b", "c"} and isinstance(out["b"], list)
        assert isinstance(out["c"], tuple)
        ((out["a"] * ws[0]).sum() + (out["b"][0] * ws[1]).sum() + 3 * out["c"][0]).backward()
        return out, [v.grad for v in leaves]

    res = spmd.launch(body, (n,), "i", timeout=TIMEOUT)
    scale = 1.0 if op == "psum" else 1.0 / n
    for key, get in (("a", lambda t: t["a"]), ("b", lambda t: t["b"][0]),
                     ("c", lambda t: t["c"][0])):
        want = _sum([get(t) for t in trees]) * scale
        for out, _ in res:
            torch.testing.assert_close(get(out), want, rtol=1e-12, atol=1e-12, msg=key)
    for _, grads in res:
        # every rank's loss uses the same weights, so each gradient is n * scale * w
        for g, w in zip(grads, [ws[0], ws[1], torch.tensor(3.0, dtype=F64)]):
            torch.testing.assert_close(g, n * scale * w, rtol=1e-12, atol=1e-12)


# -- errors: validated locally, before any communication ------------------------------------------

def _launch(fn, shape=(3,), names=("i",), timeout=5):
    return spmd.launch(fn, shape, names, timeout=timeout)


def x3():
    return torch.ones(3, dtype=F64)


ALL_OPS = {
    "psum": lambda ax: spmd.psum(x3(), ax),
    "pmean": lambda ax: spmd.pmean(x3(), ax),
    "pmax": lambda ax: spmd.pmax(x3(), ax),
    "pmin": lambda ax: spmd.pmin(x3(), ax),
    "all_gather": lambda ax: spmd.all_gather(x3(), ax),
    "psum_scatter": lambda ax: spmd.psum_scatter(x3(), ax, tiled=True),
    "ppermute": lambda ax: spmd.ppermute(x3(), ax, [(0, 1)]),
    "all_to_all": lambda ax: spmd.all_to_all(x3(), ax, 0, 0, tiled=True),
    "broadcast": lambda ax: spmd.broadcast(x3(), ax),
    "axis_index": lambda ax: spmd.axis_index(ax),
    "axis_size": lambda ax: spmd.axis_size(ax),
}


@pytest.mark.parametrize("op", sorted(ALL_OPS))
@pytest.mark.parametrize("bad", ["x", ("a", "x")])
def test_unknown_axis_lists_the_mesh_axes(op, bad):
    msg = rf"{op}: 'x' is not an axis of Mesh\(a=1, b=3.*its axes are \['a', 'b'\]"
    with pytest.raises(spmd.SpecError, match=msg):
        _launch(lambda m: ALL_OPS[op](bad), (1, 3), ("a", "b"))


@pytest.mark.parametrize("op", sorted(ALL_OPS))
def test_outside_any_rank_context(op):
    with pytest.raises(spmd.SpecError, match=rf"{op} needs a mesh: .*shard_map.*spmd\.launch"):
        ALL_OPS[op]("i")


@pytest.mark.parametrize("op", ["psum", "all_gather", "axis_index"])
def test_threads_mesh_used_from_a_non_rank_thread(op):
    mesh = spmd.Mesh((2,), ("i",), backend="threads")
    with mesh, pytest.raises(spmd.SpecError, match=r"not running on one of its rank threads.*"
                                                   r"shard_map.*launch"):
        ALL_OPS[op]("i")


@pytest.mark.parametrize("perm,pair", [([(0, 3)], r"\(0, 3\)"), ([(1, 2), (-1, 0)], r"\(-1, 0\)"),
                                       ([(5, 0)], r"\(5, 0\)")])
def test_ppermute_pair_out_of_range(perm, pair):
    with pytest.raises(spmd.SpecError, match=rf"ppermute: pair {pair} is outside axis 'i', "
                                             r"whose indices are 0\.\.2"):
        _launch(lambda m: spmd.ppermute(x3(), "i", perm))


@pytest.mark.parametrize("perm,which", [([(0, 1), (2, 1)], "destinations"),
                                        ([(0, 1), (0, 2)], "sources"),
                                        ([(1, 1), (1, 1)], "sources")])
def test_ppermute_repeats(perm, which):
    with pytest.raises(spmd.SpecError, match=rf"ppermute: perm .* repeats {which}"):
        _launch(lambda m: spmd.ppermute(x3(), "i", perm))


@pytest.mark.parametrize("perm", [[(0, 1, 2)], [0, 1], [(0,)], [(0, "x")], 3, [(None, 1)]])
def test_ppermute_non_pair_perm(perm):
    with pytest.raises(TypeError, match=r"ppermute: perm must be a sequence of \(source, "
                                        r"destination\) index pairs"):
        _launch(lambda m: spmd.ppermute(x3(), "i", perm))


def test_ppermute_bad_perm_on_one_rank_does_not_hang():
    """Only rank 0 is wrong; the others wait in the collective and are cancelled."""
    t0 = time.monotonic()
    with pytest.raises(spmd.SpecError, match=r"rank 0: ppermute: pair \(0, 9\)"):
        _launch(lambda m: spmd.ppermute(x3(), "i", [(0, 9)] if m.rank == 0 else [(0, 1)]),
                timeout=5)
    assert time.monotonic() - t0 < 4


def test_psum_scatter_untiled_wrong_dim_size():
    with pytest.raises(spmd.SpecError, match=r"psum_scatter: dim 1 of x \(f64\[2, 2\]\) has size "
                                             r"2 but axis 'i' has 3 ranks.*tiled=True"):
        _launch(lambda m: spmd.psum_scatter(torch.ones(2, 2, dtype=F64), "i",
                                            scatter_dimension=1))


@pytest.mark.parametrize("sizes", [[1, 2], [1, 1, 1, 0], [1, 1, 0], [2, 2, 0], [3, -1, 1]])
def test_psum_scatter_bad_sizes(sizes):
    with pytest.raises(spmd.SpecError, match=r"psum_scatter: sizes=.* must be 3 non-negative "
                                             r"sizes adding up to dim 0 of x \(f64\[3\]\)"):
        _launch(lambda m: spmd.psum_scatter(x3(), "i", tiled=True, sizes=sizes))


def test_all_to_all_untiled_wrong_split_size():
    with pytest.raises(spmd.SpecError, match=r"all_to_all: split_axis 1 of x \(f64\[3, 2\]\) has "
                                             r"size 2 but axis 'i' has 3 ranks"):
        _launch(lambda m: spmd.all_to_all(torch.ones(3, 2, dtype=F64), "i", 1, 0))


@pytest.mark.parametrize("sizes", [[1, 2], [1, 1, 0], [4, -1, 0]])
def test_all_to_all_bad_split_sizes(sizes):
    with pytest.raises(spmd.SpecError, match=r"all_to_all: split_sizes=.* must be 3 "
                                             r"non-negative sizes"):
        _launch(lambda m: spmd.all_to_all(x3(), "i", 0, 0, tiled=True, split_sizes=sizes))


@pytest.mark.parametrize("kw,dim", [(dict(axis=2), 2), (dict(axis=-3), -3),
                                    (dict(axis=1, tiled=True), 1)])
def test_all_gather_axis_out_of_range(kw, dim):
    with pytest.raises(spmd.SpecError, match=rf"all_gather: axis={dim} is out of range"):
        _launch(lambda m: spmd.all_gather(x3(), "i", **kw))


@pytest.mark.parametrize("src", [3, -1, 10])
def test_broadcast_src_out_of_range(src):
    with pytest.raises(spmd.SpecError, match=rf"broadcast: src={src} is outside axis 'i', whose "
                                             r"indices are 0\.\.2"):
        _launch(lambda m: spmd.broadcast(x3(), "i", src))


NON_TENSOR_OPS = {
    "all_gather": lambda v: spmd.all_gather(v, "i"),
    "psum_scatter": lambda v: spmd.psum_scatter(v, "i", tiled=True),
    "ppermute": lambda v: spmd.ppermute(v, "i", [(0, 1)]),
    "all_to_all": lambda v: spmd.all_to_all(v, "i", 0, 0, tiled=True),
    "broadcast": lambda v: spmd.broadcast(v, "i"),
}


@pytest.mark.parametrize("value", [1.0, np.ones(3), [1.0, 2.0, 3.0]], ids=["float", "ndarray", "list"])
@pytest.mark.parametrize("op", sorted(NON_TENSOR_OPS))
def test_non_tensor_input(op, value):
    with pytest.raises(TypeError, match=rf"{op}: expected a tensor, got"):
        _launch(lambda m: NON_TENSOR_OPS[op](value))


@pytest.mark.parametrize("value", [1.0, np.ones(3)], ids=["float", "ndarray"])
@pytest.mark.parametrize("op", ["psum", "pmean", "pmax", "pmin"])
def test_non_tensor_input_to_reductions(op, value):
    with pytest.raises(TypeError, match=rf"{op}: expected a tensor, got"):
        _launch(lambda m: getattr(spmd, op)(value, "i"))


# -- errors: ranks disagree ---------------------------------------------------------------------

def _catch_each(fn, shape=(3,), names=("i",), timeout=5, exc=spmd.CommError):
    """Run ``fn`` on every rank; return what each rank raised (or its result)."""
    def body(mesh):
        try:
            return fn(mesh)
        except exc as e:
            return e
    return _launch(body, shape, names, timeout)


@pytest.mark.parametrize("call", [
    pytest.param(lambda m: spmd.psum(torch.ones(m.rank + 1, dtype=F64), "i"), id="psum shape"),
    pytest.param(lambda m: spmd.psum(torch.ones(2, dtype=F64 if m.rank else torch.float32), "i"),
                 id="psum dtype"),
    pytest.param(lambda m: spmd.pmax(torch.ones(2, m.rank % 2 + 1, dtype=F64), "i"),
                 id="pmax shape"),
    pytest.param(lambda m: spmd.all_gather(torch.ones(2, m.rank + 1, dtype=F64), "i", tiled=True),
                 id="all_gather non-gathered dim"),
    pytest.param(lambda m: spmd.broadcast(torch.ones(m.rank + 1, dtype=F64), "i"), id="broadcast"),
    pytest.param(lambda m: spmd.ppermute(torch.ones(m.rank + 1, dtype=F64), "i", [(0, 1)]),
                 id="ppermute"),
    pytest.param(lambda m: spmd.psum_scatter(torch.ones(3, m.rank + 1, dtype=F64), "i"),
                 id="psum_scatter"),
    pytest.param(lambda m: spmd.psum_scatter(torch.ones(4, dtype=F64), "i", tiled=True,
                                             sizes=[2, 1, 1] if m.rank else [1, 2, 1]),
                 id="psum_scatter sizes differ"),
    pytest.param(lambda m: spmd.all_to_all(torch.ones(3, 2, dtype=F64 if m.rank else torch.float32),
                                           "i", 0, 1, tiled=True),
                 id="all_to_all dtype"),
    pytest.param(lambda m: spmd.all_to_all(torch.ones(3, m.rank + 1, dtype=F64), "i", 0, 1),
                 id="all_to_all shape"),
])
def test_shape_or_dtype_mismatch_raises_on_every_rank(call):
    out = _catch_each(call)
    for r, e in enumerate(out):
        assert isinstance(e, spmd.CommError), (r, e)
        assert re.search(r"every rank must pass (the same dtype and shape|one dtype)|blocks must "
                         r"agree in dtype", str(e)), (r, str(e))


def test_all_gather_sizes_that_do_not_match_raise_on_every_rank():
    out = _catch_each(lambda m: spmd.all_gather(torch.ones(m.rank, dtype=F64), "i", tiled=True,
                                                sizes=[1, 1, 1]))
    for r, e in enumerate(out):
        assert isinstance(e, spmd.CommError), (r, e)
        assert re.search(r"expected sizes \[1, 1, 1\] along dim 0, got \[0, 1, 2\]", str(e))


ALIAS_OPS = {
    "psum": lambda x, ax: spmd.psum(x, ax),
    "pmax": lambda x, ax: spmd.pmax(x, ax),
    "all_gather": lambda x, ax: spmd.all_gather(x, ax, tiled=True),
    "psum_scatter": lambda x, ax: spmd.psum_scatter(x, ax, tiled=True),
    "ppermute": lambda x, ax: spmd.ppermute(x, ax, [(i, i) for i in range(spmd.axis_size(ax))]),
    "all_to_all": lambda x, ax: spmd.all_to_all(x, ax, 0, 0, tiled=True),
    "broadcast": lambda x, ax: spmd.broadcast(x, ax),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("op", sorted(ALIAS_OPS))
def test_results_never_alias_inputs_or_other_ranks(op, n):
    """Each rank may modify its result in place without touching anyone's data."""
    def body(mesh):
        x = torch.arange(6, dtype=F64) + 10 * mesh.rank
        y = ALIAS_OPS[op](x, "i")
        return x, y

    out = _launch(body, (n,), ("i",), timeout=TIMEOUT)
    ptrs = [t.untyped_storage().data_ptr() for pair in out for t in pair]
    assert len(set(ptrs)) == len(ptrs)


@pytest.mark.parametrize("a,b", [
    ("psum", "all_gather"), ("all_gather", "psum_scatter"), ("ppermute", "broadcast"),
    ("psum_scatter", "all_to_all"), ("broadcast", "pmin"),
    ("psum", "pmax"), ("pmax", "pmin"),
])
def test_collective_mismatch_raises_on_every_rank(a, b):
    ops = {**ALL_OPS, "psum_scatter": lambda ax: spmd.psum_scatter(x3(), ax)}
    out = _catch_each(lambda m: ops[a if m.rank == 0 else b]("i"))
    for r, e in enumerate(out):
        assert isinstance(e, spmd.CommError), (r, e)
        assert "collective mismatch" in str(e), (r, str(e))


@pytest.mark.parametrize("shape,names,axis,skip,waiting", [
    ((3,), ("i",), "i", 2, (0, 1)),
    ((2, 3), ("a", "b"), "b", 5, (3, 4)),
    ((2, 3), ("a", "b"), "a", 4, (1,)),
    ((2, 2), ("a", "b"), ("b", "a"), 3, (0, 1, 2)),
])
def test_rank_that_never_arrives_times_out(shape, names, axis, skip, waiting):
    """One rank skips the collective: the members of its group wait ``timeout`` seconds,
    then raise CommTimeout naming the op, the axis and the (global) missing rank; other
    groups are unaffected."""
    def fn(mesh):
        if mesh.rank == skip:
            return "skipped"
        return spmd.psum(torch.ones(1, dtype=F64), axis)

    t0 = time.monotonic()
    out = _catch_each(fn, shape, names, timeout=1, exc=spmd.CommTimeout)
    assert time.monotonic() - t0 < 5
    axes = (axis,) if isinstance(axis, str) else axis
    for r, e in enumerate(out):
        if r == skip:
            assert e == "skipped"
        elif r in waiting:
            assert isinstance(e, spmd.CommTimeout), (r, e)
            assert (e.op, e.axes, e.missing) == ("psum", axes, (skip,))
            assert "psum" in str(e) and "timed out" in str(e)
            assert re.search(rf"ranks \[{skip}\] .*did not arrive", str(e)), str(e)
            assert all(repr(a) in str(e) for a in axes), str(e)
        else:
            assert isinstance(e, torch.Tensor), (r, e)


def test_uncaught_timeout_is_reraised_by_launch():
    with pytest.raises(spmd.CommTimeout, match=r"rank [01]: psum over axis 'i' timed out"):
        _launch(lambda m: None if m.rank == 2 else spmd.psum(x3(), "i"), timeout=1)


def test_launch_reraises_one_ranks_exception_without_hanging():
    seen = {}

    def body(mesh):
        if mesh.rank == 1:
            raise ValueError("boom")
        try:
            return spmd.psum(x3(), "i")
        except BaseException as e:
            seen[mesh.rank] = e
            raise

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^rank 1: boom$"):
        _launch(body, (4,), ("i",), timeout=5)
    assert time.monotonic() - t0 < 4  # cancelled, not timed out
    assert set(seen) == {0, 2, 3}
    assert all(isinstance(e, spmd.CommAborted) for e in seen.values()), seen


def test_launch_reraises_an_exception_raised_in_backward():
    def body(mesh):
        x = x3().requires_grad_()
        y = spmd.psum(x, "i")
        if mesh.rank == 1:
            raise RuntimeError("no backward here")
        y.sum().backward()  # the psum inside backward waits for rank 1, then is cancelled

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1: no backward here"):
        _launch(body, timeout=5)
    assert time.monotonic() - t0 < 4


def test_launch_leaves_no_threads_running():
    before = threading.active_count()
    _launch(lambda m: m.rank, (4,), ("i",))
    deadline = time.monotonic() + 2
    while threading.active_count() > before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert threading.active_count() <= before


# -- the launcher itself --------------------------------------------------------------------------

def test_launch_returns_results_in_rank_order():
    assert _launch(lambda m: (m.rank, spmd.axis_index("b")), (2, 2), ("a", "b")) == \
        [(0, 0), (1, 1), (2, 0), (3, 1)]


@settings(max_examples=5)
@given(n=st.integers(1, 4))
def test_repeated_collectives_keep_their_order(n):
    """Many collectives in a row on one group (the rendezvous sequence numbers)."""
    def body(mesh):
        x = torch.tensor([float(mesh.rank)], dtype=F64)
        acc = []
        for k in range(20):
            acc.append(spmd.psum(x + k, "i").item())
        return acc

    for res in _launch(body, (n,), ("i",)):
        assert res == [sum(range(n)) + n * k for k in range(20)]


@pytest.mark.parametrize("ranks, share", [(2, 2), (3, 1), (8, 1)])
def test_rank_threads_share_the_intra_op_threads(ranks, share):
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        seen = spmd.launch(lambda mesh: torch.get_num_threads(), (ranks,), ("sp",))
        assert seen == [share] * ranks  # as `ranks` processes on 4 cores would get
        assert torch.get_num_threads() == 4  # the caller's setting is back
        x = torch.ones(ranks, 3, requires_grad=True)
        spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), spmd.Mesh((ranks,), ("sp",)),
                       spmd.P("sp"), spmd.P())(x).backward()  # backward: on the rank threads too
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


# -- errors that say what to do ------------------------------------------------------------------

def test_untiled_all_gather_of_uneven_shards_suggests_tiled():
    with pytest.raises(spmd.CommError, match=r"all_gather\(tiled=False\) stacks one x of the same "
                       r"shape per rank: if the shards differ in size along dim 0, pass "
                       r"tiled=True"):
        _launch(lambda m: spmd.all_gather(torch.ones(m.rank + 1), "i"), shape=(2,))


SPARSE_OPS = {
    "psum": lambda x: spmd.psum(x, "i"),
    "pmean": lambda x: spmd.pmean(x, "i"),
    "pmax": lambda x: spmd.pmax(x, "i"),
    "all_gather": lambda x: spmd.all_gather(x, "i", tiled=True),
    "psum_scatter": lambda x: spmd.psum_scatter(x, "i", tiled=True),
    "ppermute": lambda x: spmd.ppermute(x, "i", [(0, 1)]),
    "all_to_all": lambda x: spmd.all_to_all(x, "i", 0, 0, tiled=True),
    "broadcast": lambda x: spmd.broadcast(x, "i"),
}


@pytest.mark.parametrize("op", sorted(SPARSE_OPS))
@pytest.mark.parametrize("to", ["to_sparse", "to_sparse_csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's own
def test_a_sparse_tensor_is_a_clear_type_error(op, to):
    x = getattr(torch.ones(2, 2, dtype=F64), to)()
    with pytest.raises(TypeError, match=rf"{op}: x is a sparse tensor \(torch.sparse_(coo|csr)\); "
                       r"collectives and spmd ops take dense tensors: pass x.to_dense\(\)"):
        _launch(lambda m: SPARSE_OPS[op](x), shape=(2,))
