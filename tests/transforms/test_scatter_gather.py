"""scatter / gather: exact round trips, values and gradients vs a float64 single-device
reference, exact byte counts, the adjoint (dot-product) test, ranks without data taking
part in backward, errors, and gloo vs threads.

Both ops only move data, so values are compared exactly; gradients with 1e-12 (sums of
cotangents from replicas may be reordered).
"""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd import P
from spmd.core.spec import entry_axes
from spmd.testing import check_adjoint, on_mesh
from spmd.testing.memory import peak, reset_peak
from spmd.transforms.scatter_gather import backward, gather, scatter

F64 = torch.float64


def launch(fn, shape, names):
    return spmd.launch(fn, shape, names, timeout=20)


def exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# -- round trips, values and gradients (hypothesis) -----------------------------------------

MESHES = [((1,), ("a",)), ((2,), ("a",)), ((3,), ("a",)), ((4,), ("a",)),
          ((2, 2), ("a", "b")), ((2, 3), ("a", "b")), ((3, 2), ("a", "b"))]
SPECS_1D = [P("a"), P(None, "a"), P()]
SPECS_2D = [P("a"), P("b"), P(("a", "b")), P(("b", "a")), P("a", "b"), P(None, "b"), P()]


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    spec = draw(st.sampled_from(SPECS_1D if len(shape) == 1 else SPECS_2D))
    mesh = spmd.Mesh(shape, names)
    n = math.prod(shape)
    gshape, sizes = [], {}
    explicit = draw(st.booleans())
    for d in range(2):
        axes = entry_axes(spec.entry(d))
        if axes and explicit:
            k = math.prod(mesh.axis_size(a) for a in axes)
            s = draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
            sizes[d] = s
            gshape.append(sum(s))
        else:
            gshape.append(draw(st.integers(0, 7 if axes else 3)))
    sizes_arg = sizes if explicit else None
    src = draw(st.integers(0, n - 1))
    dst = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    other = draw(st.sampled_from(["none", "placeholder"]))
    return shape, names, spec, tuple(gshape), sizes_arg, src, dst, other, draw(st.integers(0, 99))


def run_round_trip(shape, names, spec, gshape, sizes, src, dst, other, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    xg = torch.randn(gshape, dtype=F64, generator=g)
    mesh0 = spmd.Mesh(shape, names)
    lay = spmd.Layout(gshape, spec, mesh0, sizes)
    wy = [torch.randn(lay.local_shape(r), dtype=F64, generator=g) for r in range(n)]
    receivers = range(n) if dst is None else [dst]
    wz = {r: torch.randn(gshape, dtype=F64, generator=g) for r in receivers}

    def per_rank(mesh):
        r = mesh.rank
        if r == src:
            x = xg.clone().requires_grad_()
        else:
            x = (spmd.Placeholder(torch.Size(gshape), F64, "cpu", True, None, (src,))
                 if other == "placeholder" else None)
        y = scatter(x, mesh, spec, src=src, sizes=sizes)
        z = gather(y, mesh, spec, dst=dst, sizes=sizes)
        loss = (y * wy[r]).sum()
        if r in wz:
            loss = loss + (z * wz[r]).sum()
            backward(loss)
        else:
            assert isinstance(z, spmd.Placeholder) and z.holders == (dst,)
            assert z.shape == gshape and z.dtype == F64 and z.requires_grad
            assert z.layout == spmd.Layout(gshape, spec, mesh, sizes)
            backward([loss, z])
        return (y.detach(), z.detach() if isinstance(z, torch.Tensor) else z,
                x.grad if r == src else None)

    out = launch(per_rank, shape, names)
    xr = xg.clone().requires_grad_()
    ref = sum((lay.shard(xr, r) * wy[r]).sum() for r in range(n))
    ref = ref + sum((xr * w).sum() for w in wz.values())
    ref.backward()
    for r, (y, z, _) in enumerate(out):
        exact(y, lay.shard(xg, r))
        if r in wz:
            exact(z, xg)
    close(out[src][2], xr.grad)


@settings(max_examples=25)
@given(cases())
def test_round_trip_values_and_grads(case):
    run_round_trip(*case)


@pytest.mark.parametrize("rows, k", [(10, 4), (5, 4), (3, 4), (2, 4), (257, 8)])
def test_named_round_trips(rows, k):
    run_round_trip((k,), ("a",), P("a"), (rows, 3), None, 0, 0, "none", rows)
    run_round_trip((k,), ("a",), P("a"), (rows, 3), None, k - 1, None, "placeholder", rows)


def test_zero_rows_rank_gets_empty_shard():
    def f(mesh):
        x = torch.arange(6.0).reshape(3, 2) if mesh.rank == 0 else None
        return scatter(x, mesh, P("a"), src=0)
    out = launch(f, (4,), ("a",))
    assert [tuple(o.shape) for o in out] == [(1, 2), (1, 2), (1, 2), (0, 2)]


# -- ranks without data ---------------------------------------------------------------------

@pytest.mark.parametrize("other", ["none", "placeholder"])
def test_scatter_without_data_on_other_ranks(other):
    xg = torch.arange(12.0, dtype=F64).reshape(6, 2)

    def f(mesh):
        if mesh.rank == 1:
            x = xg.clone().requires_grad_()
        elif other == "none":
            x = None
        else:
            x = spmd.Placeholder(xg.shape, F64, "cpu", True, None, (1,))
        y = scatter(x, mesh, P("a"), src=1, sizes={0: [1, 0, 5]})
        assert y.requires_grad and y.dtype == F64
        (y * (mesh.rank + 1)).sum().backward()
        return y.detach(), x.grad if mesh.rank == 1 else None

    out = launch(f, (3,), ("a",))
    exact(out[0][0], xg[:1])
    exact(out[1][0], xg[1:1])
    exact(out[2][0], xg[1:])
    exact(out[1][1], torch.tensor([1.0] + [3.0] * 5, dtype=F64)[:, None].expand(6, 2))


def test_scatter_requires_grad_follows_src():
    def f(mesh):
        x = torch.ones(4, 2) if mesh.rank == 0 else None
        y = scatter(x, mesh, P("a"))
        return y.requires_grad
    assert launch(f, (2,), ("a",)) == [False, False]


def test_scatter_placeholder_mismatch():
    def f(mesh):
        x = torch.ones(4, 2) if mesh.rank == 0 else spmd.Placeholder(
            (5, 2), torch.float32, "cpu", False, None, (0,))
        return scatter(x, mesh, P("a"))
    with pytest.raises(spmd.SpecError, match=r"Placeholder on rank 1 is f32\[5, 2\]"):
        launch(f, (2,), ("a",))


# -- communication: each rank receives only its shard ---------------------------------------

@pytest.mark.parametrize("shape, names, spec, src", [
    ((4,), ("a",), P("a"), 1),
    ((2, 2), ("a", "b"), P("b"), 3),        # replicated over "a": copies
    ((2, 3), ("a", "b"), P(("b", "a")), 0)])
def test_scatter_bytes(shape, names, spec, src):
    n = math.prod(shape)
    xg = torch.randn(10, 3)
    lay = spmd.Layout(xg.shape, spec, spmd.Mesh(shape, names))
    shard_bytes = [lay.shard(xg, r).nbytes for r in range(n)]

    def f(mesh):
        x = xg.clone().requires_grad_() if mesh.rank == src else None
        y = scatter(x, mesh, spec, src=src)
        y.sum().backward()
        return y.nbytes

    with spmd.comm_stats() as s:
        got = launch(f, shape, names)
    assert got == shard_bytes  # each rank received exactly its shard
    want = sum(b for r, b in enumerate(shard_bytes) if r != src)
    assert s.bytes("scatter", pass_="forward", rank=src) == want
    assert s.bytes("scatter", pass_="forward") == want  # no one else sends data
    assert s.calls("scatter", pass_="forward") == n
    # backward: every other rank sends its shard's cotangent to src, src sends nothing
    for r in range(n):
        assert s.bytes("scatter", pass_="backward", rank=r) == (0 if r == src else shard_bytes[r])
    assert {rec[0] for rec in s.records} == {"scatter", "scatter meta"}


@pytest.mark.parametrize("shape, names, spec, dst", [
    ((4,), ("a",), P("a"), 2),
    ((2, 2), ("a", "b"), P("b"), 3),        # dst holds shard 1 itself
    ((2, 2), ("a", "b"), P("b"), None),
    ((2, 3), ("a", "b"), P(None, "a"), 0)])
def test_gather_bytes(shape, names, spec, dst):
    n = math.prod(shape)
    xg = torch.randn(7, 5)
    lay = spmd.Layout(xg.shape, spec, spmd.Mesh(shape, names), {0: [4, 3]} if spec == P("b")
                      else None)
    receivers = range(n) if dst is None else [dst]

    def f(mesh):
        x = lay.shard(xg, mesh.rank).clone().requires_grad_()
        z = gather(x, mesh, spec, dst=dst)
        backward(z.sum() if isinstance(z, torch.Tensor) else z)
        return x.grad

    with spmd.comm_stats() as s:
        grads = launch(f, shape, names)
    keys = {}
    for r in range(n):
        keys.setdefault(lay.shard_key(r), r)  # the lowest rank holding each shard
    want = 0
    for rcv in receivers:
        want += sum(lay.shard(xg, r).nbytes for k, r in keys.items() if k != lay.shard_key(rcv))
    assert s.bytes("gather", pass_="forward") == want
    assert s.bytes("gather", pass_="backward") == want
    if dst is not None:
        assert s.bytes("gather", pass_="backward") == s.bytes("gather", pass_="backward", rank=dst)
        # which copy is read: dst's own, else the lowest rank holding the shard
        for r in range(n):
            used = r == dst or (keys[lay.shard_key(r)] == r and lay.shard_key(r) != lay.shard_key(dst))
            exact(grads[r], torch.full_like(grads[r], 1.0 if used else 0.0))


# -- training step where only dst computes the loss -----------------------------------------

def test_training_step_loss_only_on_rank0():
    g = torch.Generator().manual_seed(3)
    xg = torch.randn(10, 3, dtype=F64, generator=g)
    W0 = torch.randn(3, 2, dtype=F64, generator=g)
    t = torch.randn(10, 2, dtype=F64, generator=g)

    def f(mesh, use_method):
        lay = spmd.Layout(xg.shape, P("sp"), mesh)
        x = lay.shard(xg, mesh.rank).clone().requires_grad_()
        W = W0.clone().requires_grad_()
        h = torch.tanh(x @ W)
        z = gather(h, mesh, P("sp"), dst=0)
        out = ((z - t) ** 2).mean() if mesh.rank == 0 else z
        if use_method and mesh.rank != 0:
            out.backward()
        else:
            backward(out)
        return x.grad, spmd.psum(W.grad, "sp")  # W's partial gradients, summed

    xr, Wr = xg.clone().requires_grad_(), W0.clone().requires_grad_()
    ((torch.tanh(xr @ Wr) - t) ** 2).mean().backward()
    for use_method in (False, True):
        out = spmd.launch(f, (4,), ("sp",), args=(use_method,), timeout=20)
        close(torch.cat([o[0] for o in out]), xr.grad)
        for o in out:
            close(o[1], Wr.grad)


def test_backward_accepts_pytrees_and_skips_no_grad():
    x = torch.ones(3, requires_grad=True)
    backward({"a": (x * 2).sum(), "b": torch.zeros(2), "c": None})
    exact(x.grad, torch.full((3,), 2.0))

    def f(mesh):
        z = gather(torch.ones(2), mesh, P("a"))  # nothing needs grad: no node anywhere
        backward(z if isinstance(z, spmd.Placeholder) else z.sum())
        return z.requires_grad
    assert launch(f, (2,), ("a",)) == [False, False]


# -- adjoint (dot-product) tests -----------------------------------------------------------

@pytest.mark.parametrize("shape, names, spec", [
    ((3,), ("a",), P("a")), ((2, 2), ("a", "b"), P("b")), ((2, 3), ("a", "b"), P("b", "a"))])
def test_adjoint_scatter(shape, names, spec):
    """Only rank 1 holds an input; every rank gets a shard (spmd.testing.check_adjoint)."""
    mesh = spmd.Mesh(shape, names)
    xg = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(7))
    check_adjoint(lambda x: scatter(x, mesh, spec, src=1), mesh,
                  lambda r: xg if r == 1 else None)


@pytest.mark.parametrize("shape, names, spec, dst", [
    ((3,), ("a",), P("a"), 2), ((2, 2), ("a", "b"), P("b"), 1),
    ((2, 2), ("a", "b"), P("a"), None), ((2, 3), ("a", "b"), P(("a", "b")), 0)])
def test_adjoint_gather(shape, names, spec, dst):
    """Ranks other than dst hold a Placeholder; replicas hold different values (every
    rank's shard is its own variable)."""
    mesh = spmd.Mesh(shape, names)
    lay = spmd.Layout((5, 4), spec, mesh)
    check_adjoint(lambda x: gather(x, mesh, spec, dst=dst), mesh,
                  lambda r: torch.randn(lay.local_shape(r), dtype=F64,
                                        generator=torch.Generator().manual_seed(8 + r)))


# -- errors ---------------------------------------------------------------------------------

def _raises(fn, match, shape=(2,)):
    with pytest.raises(spmd.SpecError, match=match):
        launch(fn, shape, ("a",) if len(shape) == 1 else ("a", "b"))


def test_errors():
    full = lambda m: torch.ones(4, 2) if m.rank == 0 else None  # noqa: E731
    _raises(lambda m: scatter(full(m), m, P("a"), src=2), r"scatter: src=2 is not a global rank")
    _raises(lambda m: gather(torch.ones(2), m, P("a"), dst=-1), r"gather: dst=-1 is not a global")
    _raises(lambda m: scatter(None, m, P("a")), r"scatter: x is missing on src rank 0")
    _raises(lambda m: scatter(full(m), m, P("a"), sizes={0: [1, 2]}),
            r"dim 0 has size 4 but the sizes \[1, 2\]")
    _raises(lambda m: scatter(full(m), m, P("a", None, None)), r"has 3 entries but")
    _raises(lambda m: scatter(full(m), m, P("zz")), r"names axis 'zz'")
    other = spmd.Mesh((2,), ("a",))
    _raises(lambda m: scatter(full(m), other, P("a")), r"scatter: called with .* but this code")
    _raises(lambda m: gather(torch.ones(2), other, P("a")), r"gather: called with")
    # shard shapes that do not fit the spec / sizes (raised on every rank)
    _raises(lambda m: gather(torch.ones(2 + m.rank, 3), m, P("a"), sizes={0: [2, 2]}),
            r"dim 0 of x has size 3 on rank 1 but the layout expects 2")
    _raises(lambda m: gather(torch.ones(2, 3 + m.rank), m, P("a")),
            r"dim 1 of x has size 4 on rank 1 but the layout expects 3")
    _raises(lambda m: gather(torch.ones(2, 3 + m.rank % 2), m, P("b")),
            r"dim 1 of x has size 4 on rank 1", shape=(2, 2))
    _raises(lambda m: gather(torch.ones(2, dtype=torch.float32 if m.rank else torch.float64),
                             m, P("a")), r"different dtypes")


def test_placeholder_pickles_without_node():
    import pickle

    def f(mesh):
        z = gather(torch.ones(2, requires_grad=True), mesh, P("a"))
        backward(z.sum() if isinstance(z, torch.Tensor) else z)
        return z if isinstance(z, spmd.Placeholder) else None
    p = launch(f, (2,), ("a",))[1]
    assert p._node is not None
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q._node is None and hash(q) == hash(p) and repr(q) == repr(p)


# -- gloo -----------------------------------------------------------------------------------

@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_scatter_then_gather_on_threads_and_gloo(mesh):
    xg = torch.arange(14.0, dtype=F64).reshape(7, 2)
    x = xg.clone().requires_grad_() if mesh.rank == 0 else None
    y = scatter(x, mesh, P("sp"), src=0, sizes={0: [5, 2]})
    exact(y, [xg[:5], xg[5:]][mesh.rank])
    z = gather(y * (mesh.rank + 2), mesh, P("sp"), dst=1)
    scale = torch.tensor([2.0] * 5 + [3.0] * 2, dtype=F64)[:, None]  # each row's rank + 2
    if mesh.rank == 1:
        exact(z, xg * scale)
    else:
        assert isinstance(z, spmd.Placeholder) and z.shape == (7, 2) and z.dtype == F64
    backward((z ** 2).sum() if mesh.rank == 1 else z)  # rank 0 takes part without a loss
    if mesh.rank == 0:
        exact(x.grad, 2 * xg * scale ** 2)


# -- scatter's source memory -----------------------------------------------------------------

def _scatter_peaks(mesh, nbytes):
    """Per split dim: this rank's peak resident memory during one scatter from rank 0,
    counted from before the tensor was made, as a multiple of the tensor; and whether
    its shard was exact."""
    if reset_peak() is None:  # the same on every rank (one machine): none goes on
        return None
    cols = 2048
    rows = nbytes // (8 * cols)
    out = []
    for spec in (P("sp"), P(None, "sp")):
        scatter(torch.ones(4, 4) if mesh.rank == 0 else None, mesh, spec)  # warm up
        base = reset_peak()
        x = torch.arange(rows * cols, dtype=F64).view(rows, cols) if mesh.rank == 0 else None
        y = scatter(x, mesh, spec)
        top = (peak() - base) / (rows * cols * 8)
        del x
        want = spmd.Layout((rows, cols), spec, mesh).shard(
            torch.arange(rows * cols, dtype=F64).view(rows, cols), mesh.rank)
        out.append((top, torch.equal(y, want)))
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 4])
def test_scatter_source_peak_memory_on_gloo(request, world):
    """The source holds the tensor plus the shard it keeps (1 + 1/P times the tensor),
    whether the shards are contiguous (dim 0) or strided (dim 1); receivers hold their
    shard. An all_to_all copied every shard and then all of them into one buffer: 2.5x
    (dim 0) to 3.5x (dim 1) at world 2."""
    pool = request.getfixturevalue(f"gloo{world}")
    got = pool.run(_scatter_peaks, (world,), ("sp",), args=(32 << 20,), timeout=60)
    if got[0] is None:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure peak memory")
    slack = 0.05  # the process's own allocations while it waits: well under 1 MiB
    for dim in (0, 1):
        peaks = [g[dim][0] for g in got]
        assert all(g[dim][1] for g in got), f"dim {dim}: a shard differs"
        assert peaks[0] <= 1 + 1 / world + slack, (dim, peaks)
        assert max(peaks[1:]) <= 1 / world + slack, (dim, peaks)


# -- scatter in pieces, and ranks whose plans disagree --------------------------------------

_PIECE_CASES = [  # (global shape, spec, sizes, transposed x: every shard strided)
    ((7, 5), P("a"), None, False), ((7, 5), P(None, "b"), None, True),
    ((9, 6, 4), P(None, ("a", "b")), None, False), ((3, 10, 6), P("b", None, "a"), None, False),
    ((6, 5), P("a"), {0: [6, 0]}, False), ((13,), P(("b", "a")), {0: [1, 2, 10, 0]}, False),
    ((0, 5), P("a"), None, False), ((), P(), None, False)]
_PIECE_DTYPES = [torch.float64, torch.bool, torch.complex128, torch.int8, torch.bfloat16]


def _piece_input(shape, trans, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape[::-1] if trans else shape, dtype=F64, generator=g) * 50
    x = x > 0 if dtype == torch.bool else torch.complex(x, -x) if dtype.is_complex else x
    x = x.to(dtype)
    return x.permute(*reversed(range(x.ndim))) if trans else x


def _scatter_in_pieces(mesh):
    """Pieces of 48 bytes: every shard travels in many pieces, strided ones through the
    staging buffers (carved from the source's result, or of their own where it is small)."""
    from spmd.comm import _scatter
    saved = _scatter._PIECE
    _scatter._PIECE = 48
    try:
        bad = []
        for c, (shape, spec, sizes, trans) in enumerate(_PIECE_CASES):
            for j, dt in enumerate(_PIECE_DTYPES):
                src = (c + j) % 4
                x = _piece_input(shape, trans, dt, 10 * c + j)
                y = scatter(x if mesh.rank == src else None, mesh, spec, src=src, sizes=sizes)
                want = spmd.Layout(shape, spec, mesh, sizes).shard(x, mesh.rank)
                if not (y.is_contiguous() and y.dtype == dt and torch.equal(y, want)):
                    bad.append((c, str(dt)))
        return bad
    finally:
        _scatter._PIECE = saved


@pytest.mark.gloo
def test_scatter_in_pieces_on_gloo(gloo4):
    assert gloo4.run(_scatter_in_pieces, (2, 2), ("a", "b"), timeout=60) == [[]] * 4


def _scatter_plans_disagree(mesh, validate):
    """Rank 1 asks for other sizes than the source uses: it must get an error, not
    src's idea of its shard, garbage, or gloo aborting the process."""
    if validate is not None:  # whatever SPMD_VALIDATE says
        comm = spmd.comm.comm_of(mesh)
        comm.validate, comm.checks = validate, True
    x = torch.arange(8.0).reshape(4, 2) if mesh.rank == 0 else None
    try:
        return scatter(x, mesh, P("sp"), sizes={0: [1, 3] if mesh.rank == 0 else [3, 1]})
    except spmd.CommError as e:
        return str(e)


@pytest.mark.parametrize("backend, validate", [
    ("threads", None), pytest.param("gloo", True, marks=pytest.mark.gloo),
    pytest.param("gloo", False, marks=pytest.mark.gloo)])
def test_scatter_plans_disagree(request, backend, validate):
    if backend == "gloo":
        got = request.getfixturevalue("gloo2").run(_scatter_plans_disagree, (2,), ("sp",),
                                                   args=(validate,), timeout=20)
    else:
        got = launch(lambda m: _scatter_plans_disagree(m, None), (2,), ("sp",))
    msg = r"scatter over axis 'sp': rank 1 expected f32\[1, 2\] from rank 0 but it sends f32\[3, 2\]"
    if validate is False:  # only the receiver knows; the source's scatter went through
        exact(got[0], torch.tensor([[0.0, 1.0]]))
        got = got[1:]
    for g in got:
        assert isinstance(g, str), g
        assert re.match(msg, g), g
