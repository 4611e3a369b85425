"""shard_map(f_local)(x) == f_global(x), in value and gradient.

Float64 throughout; tolerance 1e-10: the sharded run only reorders additions (partial
sums per shard, then psum in rank order), which changes results by a few ulps.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device, on_mesh

TOL = dict(rtol=1e-10, atol=1e-10)
DT = torch.float64

MESHES_1D = [(1,), (2,), (3,), (4,)]
MESHES_2D = [(2, 2), (1, 3), (2, 3)]


def _check(f_local, f_global, mesh, in_specs, out_specs, args, **kw):
    """Values and gradients (of a random linear functional of the outputs) match."""
    assert_matches_single_device(f_local, f_global, mesh, in_specs, out_specs, *args, **TOL,
                                 **kw)


shapes = st.tuples(st.integers(1, 9), st.integers(1, 5))


@given(mesh_shape=st.sampled_from(MESHES_1D), shape=shapes, seed=st.integers(0, 2**16))
def test_psum_to_replicated(mesh_shape, shape, seed):
    mesh = spmd.Mesh(mesh_shape, ("sp",))
    x = torch.randn(shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    _check(lambda x: spmd.psum((x ** 2).sum(0), "sp"), lambda x: (x ** 2).sum(0),
           mesh, P("sp"), P(), [x])


@given(mesh_shape=st.sampled_from(MESHES_1D), shape=shapes, seed=st.integers(0, 2**16))
def test_all_gather_uneven(mesh_shape, shape, seed):
    mesh = spmd.Mesh(mesh_shape, ("sp",))
    x = torch.randn(shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    _check(lambda x: spmd.all_gather(torch.sin(x), "sp", tiled=True).cumsum(0),
           lambda x: torch.sin(x).cumsum(0), mesh, P("sp"), P(), [x])


@given(mesh_shape=st.sampled_from(MESHES_1D), n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_ppermute_halo_stencil(mesh_shape, n, seed):
    """A 3-point stencil: halos from neighbours by ppermute (shards of >= 1 row)."""
    k = mesh_shape[0]
    mesh = spmd.Mesh(mesh_shape, ("sp",))
    x = torch.randn(k * n + (seed % k), 3, dtype=DT, generator=torch.Generator().manual_seed(seed))

    def local(x):
        top = spmd.ppermute(x[-1:], "sp", [(i, i + 1) for i in range(k - 1)])
        bot = spmd.ppermute(x[:1], "sp", [(i + 1, i) for i in range(k - 1)])
        u = torch.cat([top, x, bot])
        return u[:-2] - 2 * u[1:-1] + u[2:]

    def glob(x):
        u = torch.nn.functional.pad(x, (0, 0, 1, 1))
        return u[:-2] - 2 * u[1:-1] + u[2:]

    _check(local, glob, mesh, P("sp"), P("sp"), [x])


@given(mesh_shape=st.sampled_from(MESHES_2D), shape=shapes, seed=st.integers(0, 2**16))
def test_replicated_input_with_sharded(mesh_shape, shape, seed):
    """b is replicated over every axis: its gradient is summed over all ranks."""
    mesh = spmd.Mesh(mesh_shape, ("dp", "sp"))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=DT, generator=g)
    b = torch.randn(shape[1], dtype=DT, generator=g)
    _check(lambda x, b: torch.tanh(x * b + b), lambda x, b: torch.tanh(x * b + b),
           mesh, (P("dp"), P()), P("dp"), [x, b])


@given(mesh_shape=st.sampled_from(MESHES_2D), shape=shapes, seed=st.integers(0, 2**16))
def test_2d_mesh_row_norms(mesh_shape, shape, seed):
    """Rows over dp, columns over sp: row norms need a psum over sp only."""
    mesh = spmd.Mesh(mesh_shape, ("dp", "sp"))
    x = torch.randn(shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    _check(lambda x: spmd.psum((x ** 2).sum(1), "sp").sqrt(),
           lambda x: (x ** 2).sum(1).sqrt(), mesh, P("dp", "sp"), P("dp"), [x])


@given(mesh_shape=st.sampled_from(MESHES_2D), shape=shapes, seed=st.integers(0, 2**16),
       tuple_order=st.booleans())
def test_tuple_axes_dim(mesh_shape, shape, seed, tuple_order):
    """A dim split over a tuple of axes; the reduction over that tuple."""
    axes = ("dp", "sp") if tuple_order else ("sp", "dp")
    mesh = spmd.Mesh(mesh_shape, ("dp", "sp"))
    x = torch.randn(shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    _check(lambda x: (spmd.psum(x.sum(0), axes), spmd.all_gather(x * 2, axes, tiled=True)),
           lambda x: (x.sum(0), x * 2), mesh, P(axes), (P(), P()), [x])


@given(k=st.integers(1, 4), cols=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_pmax_is_amax_over_ranks(k, cols, seed):
    """One row per rank: pmax over ranks is amax over rows, ties sharing the gradient."""
    mesh = spmd.Mesh((k,), ("sp",))
    # Few distinct values: ties across ranks are common.
    x = torch.randint(0, 3, (k, cols), generator=torch.Generator().manual_seed(seed)).to(DT)
    _check(lambda x: spmd.pmax(x[0], "sp"), lambda x: x.amax(0), mesh, P("sp"), P(), [x])
    _check(lambda x: spmd.pmin(x[0], "sp"), lambda x: x.amin(0), mesh, P("sp"), P(), [x])


def test_empty_shard_still_joins_collective_backward():
    """A rank whose shard is empty computes a constant; its psum must still have a
    backward, or the other ranks would wait for it forever."""
    mesh = spmd.Mesh((4,), ("sp",), timeout=20)
    x = torch.randn(2, 3, dtype=DT)  # ranks 2 and 3 hold no rows

    def local(x):
        m = x.amax(0) if x.shape[0] else torch.full(x.shape[1:], -math.inf, dtype=DT)
        return spmd.pmax(m, "sp")

    _check(local, lambda x: x.amax(0), mesh, P("sp"), P(), [x])


@given(k=st.integers(1, 4), rows=st.integers(1, 3), cols=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_all_to_all_transpose_layout(k, rows, cols, seed):
    """Rows split -> columns split with one all_to_all (even sizes)."""
    mesh = spmd.Mesh((k,), ("sp",))
    x = torch.randn(k * rows, k * cols, dtype=DT, generator=torch.Generator().manual_seed(seed))
    _check(lambda x: spmd.all_to_all(x, "sp", 1, 0, tiled=True) * 3, lambda x: x * 3,
           mesh, P("sp"), P(None, "sp"), [x])


@given(mesh_shape=st.sampled_from(MESHES_1D + MESHES_2D), seed=st.integers(0, 2**16))
def test_module_parameters_get_global_gradient(mesh_shape, seed):
    """A body that closes over nn.Linear weights: the parameter gradients are global."""
    names = ("dp", "sp")[-len(mesh_shape):]
    mesh = spmd.Mesh(mesh_shape, names)
    torch.manual_seed(seed)
    lin = torch.nn.Linear(3, 2).double()
    ref = torch.nn.Linear(3, 2).double()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(7, 3, dtype=DT)  # no input requires grad: only parameters do
    ax = names[0]
    loss = spmd.shard_map(lambda x: spmd.psum(torch.tanh(lin(x)).sum(), ax), mesh, P(ax), P())(x)
    loss.backward()
    torch.tanh(ref(x)).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **TOL)


def test_module_as_f_and_autograd_grad():
    mesh = spmd.Mesh((3,), ("sp",))
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(8, 4, dtype=DT)
    f = spmd.shard_map(lin, mesh, P("sp"), P("sp"))
    gw, = torch.autograd.grad((f(x) ** 2).sum(), [lin.weight])
    ref, = torch.autograd.grad((lin(x) ** 2).sum(), [lin.weight])
    torch.testing.assert_close(gw, ref, **TOL)
    assert lin.weight.grad is None  # autograd.grad fills no .grad


def test_pytree_args_and_outputs():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = {"a": torch.randn(5, 4, dtype=DT), "b": torch.randn(4, dtype=DT)}

    def local(d):
        return {"s": spmd.psum(d["a"].sum(0), "dp"), "y": d["a"] * d["b"]}

    def glob(d):
        return {"s": d["a"].sum(0), "y": d["a"] * d["b"]}

    out = spmd.shard_map(local, mesh, ({"a": P("dp", "sp"), "b": P("sp")},),
                         {"s": P("sp"), "y": P("dp", "sp")})(x)
    ref = glob(x)
    torch.testing.assert_close(out["s"], ref["s"], **TOL)
    torch.testing.assert_close(out["y"], ref["y"], **TOL)


def test_explicit_layout_in_specs_uneven():
    mesh = spmd.Mesh((3,), ("sp",))
    x = torch.arange(10.0, dtype=DT)
    lay = spmd.Layout(x.shape, P("sp"), mesh, sizes={0: [0, 7, 3]})
    sizes = spmd.shard_map(lambda x: torch.tensor([x.shape[0]]), mesh, lay, P("sp"))(x)
    assert sizes.tolist() == [0, 7, 3]
    y = spmd.shard_map(lambda x: x * 2, mesh, lay, P("sp"))(x)
    torch.testing.assert_close(y, x * 2)


def test_non_tensor_args_and_outputs_pass_through():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda x, k: (x * k, k + 1), mesh, (P("sp"), None), (P("sp"), None))
    y, k = f(torch.ones(3), 2)
    assert y.tolist() == [2.0, 2.0, 2.0] and k == 3


def test_check_rep_passes_for_psum_and_names_rank_and_index():
    mesh = spmd.Mesh((3,), ("sp",))
    x = torch.arange(6.0)
    ok = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P(), check_rep=True)
    assert ok(x).item() == 15.0
    bad = spmd.shard_map(lambda x: x[:1] * 0 + spmd.axis_index("sp") // 2, mesh, P("sp"), P(),
                         check_rep=True)
    with pytest.raises(spmd.SpecError, match=r"rank 2 differs from rank 0 at local index \[0\]"):
        bad(x)


def test_check_rep_accepts_nan_where_every_rank_has_nan():
    """A replicated NaN (a loss that diverged on every rank alike) is equal everywhere
    for check_rep, as a scalar and as a vector. NaN in different places still differs."""
    mesh = spmd.Mesh((3,), ("sp",))
    x = torch.arange(6.0)
    nan = float("nan")
    f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp") * nan, mesh, P("sp"), P(),
                       check_rep=True)
    assert f(x).isnan().item()
    v = spmd.shard_map(lambda x: torch.tensor([1.0, nan, 2.0]) + 0 * spmd.psum(x.sum(), "sp"),
                       mesh, P("sp"), P(), check_rep=True)(x)
    assert v[1].isnan() and v[0] == 1.0
    bad = spmd.shard_map(lambda x: torch.tensor([nan, 1.0]).roll(int(spmd.axis_index("sp") == 2)),
                         mesh, P("sp"), P(), check_rep=True)
    with pytest.raises(spmd.SpecError, match=r"rank 2 differs from rank 0 at local index \[0\]"):
        bad(x)


def test_non_tensor_outputs_compare_numpy_arrays_and_nan_as_values():
    import numpy as np
    mesh = spmd.Mesh((2,), ("sp",))
    same = spmd.shard_map(lambda x: (x, np.array([1.0, np.nan]), float("nan")), mesh, P("sp"),
                          (P("sp"), None, None))(torch.ones(4))
    assert np.array_equal(same[1], [1.0, np.nan], equal_nan=True)
    differ = spmd.shard_map(lambda x: (x, np.arange(2) * spmd.axis_index("sp")), mesh,
                            P("sp"), (P("sp"), None))
    with pytest.raises(spmd.SpecError, match=r"out\[1\] is array\(\[0, 0\]\) on rank 0 but "
                       r"array\(\[0, 1\]\) on rank 1"):
        differ(torch.ones(4))


def test_an_in_place_op_on_a_replicated_input_acts_once():
    """On a threads mesh every rank sees the caller's replicated tensor: s.add_(1) must add
    1, as processes and one device do, not 4 on 4 ranks. Split inputs are right by
    construction: each rank modifies its own rows."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    s, x = torch.zeros(3), torch.zeros(4, 2)

    def body(s, x):
        s.add_(1)
        x.add_(1)
        return spmd.psum(s.sum(), ("dp", "sp")), x
    total, y = spmd.shard_map(body, mesh, (P(), P("sp")), (P(), P("sp")))(s, x)
    assert s.tolist() == [1.0, 1.0, 1.0] and total.item() == 12.0
    assert x.tolist() == [[1.0, 1.0]] * 4 and y.tolist() == [[1.0, 1.0]] * 4

    def per_rank(mesh, s):  # the per-rank view, with one tensor shared by the rank threads
        spmd.shard_map(lambda s: s.mul_(2), mesh, P(), P())(s)
    s = torch.ones(2)
    spmd.launch(per_rank, (3,), "sp", args=(s,))
    assert s.tolist() == [2.0, 2.0]


def test_per_rank_on_launch_threads_gives_global_gradient():
    x = torch.randn(7, 2, dtype=DT)

    def per_rank(mesh, x):
        x = x.clone().requires_grad_()  # every rank its own tensor
        y = spmd.shard_map(lambda x: spmd.psum((x ** 3).sum(), "sp"), mesh, P("sp"), P())(x)
        y.backward()
        return y.item(), x.grad

    ref = (x ** 3).sum().item()
    for val, grad in spmd.launch(per_rank, (3,), ("sp",), args=(x,)):
        assert abs(val - ref) < 1e-10
        torch.testing.assert_close(grad, 3 * x ** 2, **TOL)


def test_per_rank_shared_tensor_not_double_counted():
    x = torch.randn(5, dtype=DT, requires_grad=True)

    def per_rank(mesh, x):
        y = spmd.shard_map(lambda x: spmd.all_gather(x * 2, "sp", tiled=True), mesh, P("sp"), P())(x)
        y.sum().backward()

    spmd.launch(per_rank, (2,), ("sp",), args=(x,))
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


# -- errors: raised before any communication, with the key path ------------------------------

def test_error_in_specs_not_a_prefix_names_key_path():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a, b: a, mesh, (P("sp"), {"w": P()}), P("sp"))
    with pytest.raises(spmd.SpecError, match=r"in_specs\[1\]\['w'\] matches nothing"):
        f(torch.ones(2), {"v": torch.ones(2)})


def test_error_in_specs_does_not_cover_argument():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a, b: a, mesh, (P("sp"),), P("sp"))
    with pytest.raises(spmd.SpecError, match=r"does not cover args\[1\]"):
        f(torch.ones(2), torch.ones(2))


def test_error_unknown_axis_in_specs():
    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(spmd.SpecError, match=r"in_specs\[0\] = P\('dp'\) names axis 'dp'"):
        spmd.shard_map(lambda a: a, mesh, (P("dp"),), P())


def test_error_spec_longer_than_tensor():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a: a, mesh, P(None, "sp"), P())
    with pytest.raises(spmd.SpecError, match=r"args\[0\] \(f32\[4\]\).*2 entries.*1 dims"):
        f(torch.ones(4))


def test_error_split_spec_on_non_tensor():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a, k: a, mesh, (P("sp"), P("sp")), P("sp"))
    with pytest.raises(spmd.SpecError, match=r"args\[1\].*not a tensor"):
        f(torch.ones(4), 3)


def test_error_output_unsplit_dim_differs_between_ranks():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a: a, mesh, P("sp"), P())  # claims replicated, but shards differ
    with pytest.raises(spmd.SpecError, match=r"dim 0 of out has size 2 on rank 1 but 3 on rank 0"):
        f(torch.ones(5))


def test_error_output_structure_differs_between_ranks():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a: (a,) if spmd.axis_index("sp") else [a], mesh, P("sp"), P("sp"))
    with pytest.raises(spmd.SpecError, match=r"on rank 1 but .* on rank 0"):
        f(torch.ones(4))


def test_error_out_specs_not_a_prefix():
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda a: (a, a), mesh, P("sp"), (P("sp"),))
    with pytest.raises(spmd.SpecError, match=r"out_specs does not cover out\[1\]"):
        f(torch.ones(4))


def test_error_bad_mesh_and_f():
    with pytest.raises(TypeError, match="mesh must be a spmd.Mesh"):
        spmd.shard_map(lambda a: a, "mesh", P(), P())
    with pytest.raises(TypeError, match="f must be callable"):
        spmd.shard_map(3, spmd.Mesh((2,), ("sp",)), P(), P())
    with pytest.raises(spmd.SpecError, match="specs must be spmd.P"):
        spmd.shard_map(lambda a: a, spmd.Mesh((2,), ("sp",)), ("sp",), P())


def test_error_layout_for_other_shape():
    mesh = spmd.Mesh((2,), ("sp",))
    lay = spmd.Layout((6,), P("sp"), mesh)
    with pytest.raises(spmd.SpecError, match=r"args\[0\] is f32\[4\] but its Layout is for \[6\]"):
        spmd.shard_map(lambda a: a, mesh, lay, P("sp"))(torch.ones(4))


def test_exception_in_body_is_reraised_with_rank_and_mesh_recovers():
    mesh = spmd.Mesh((3,), ("sp",), timeout=10)

    def body(x):
        if spmd.axis_index("sp") == 1:
            raise ValueError("boom")
        return spmd.psum(x.sum(), "sp")  # the others wait here: they must be cancelled

    with pytest.raises(ValueError, match="rank 1: boom"):
        spmd.shard_map(body, mesh, P("sp"), P())(torch.ones(6))
    # The mesh is usable again afterwards.
    assert spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())(torch.ones(6)).item() == 6


def test_no_grad_needed_gives_output_without_grad_fn():
    """Collectives anchor their inputs for backward; the anchors are not parameters, so
    a call where nothing requires grad builds no autograd node."""
    mesh = spmd.Mesh((3,), ("sp",))
    y = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())(torch.ones(5))
    assert not y.requires_grad and y.grad_fn is None


def test_check_rep_per_rank_path_names_rank():
    """Per-rank view (each rank calls shard_map, as on torch processes): same check."""
    def per_rank(mesh):
        f = spmd.shard_map(lambda x: x[:1] * 0 + spmd.axis_index("sp"), mesh, P("sp"), P(),
                           check_rep=True)
        try:
            f(torch.arange(4.0))
        except spmd.SpecError as e:
            return str(e)

    for msg in spmd.launch(per_rank, (2,), ("sp",)):
        assert "rank 1 differs from rank 0 at local index [0]" in msg


def test_per_rank_parameters_summed_in_one_flat_all_reduce():
    """Per-rank view with a module: each rank's own copy ends with the global gradient."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    x = torch.randn(7, 3, dtype=DT)
    ref(x).pow(2).sum().backward()

    state = {k: v.clone() for k, v in ref.state_dict().items()}

    def per_rank(mesh):
        # Each rank its own copy (the RNG is process-global: rank threads would race on it).
        mod = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                  torch.nn.Linear(4, 1)).double()
        mod.load_state_dict(state)
        y = spmd.shard_map(lambda x: spmd.psum(mod(x).pow(2).sum(), "sp"), mesh, P("sp"), P())(x)
        y.backward()
        return [p.grad for p in mod.parameters()]

    for grads in spmd.launch(per_rank, (3,), ("sp",)):
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(g, p.grad, **TOL)


def test_closed_over_non_leaf_tensor_used_outside_too():
    """The body closes over sin(w), which the caller also uses: the walk follows it to
    the leaf w, and the outer graph stays usable for the caller's own term."""
    mesh = spmd.Mesh((3,), ("sp",))
    w = torch.randn(4, dtype=DT, requires_grad=True)
    x = torch.randn(7, 4, dtype=DT)
    w2 = torch.sin(w)
    f = spmd.shard_map(lambda x: spmd.psum((x * w2).sum(), "sp") ** 2, mesh, P("sp"), P())
    (f(x) + (w2 ** 2).sum()).backward()
    wr = w.detach().clone().requires_grad_()
    w2r = torch.sin(wr)
    ((x * w2r).sum() ** 2 + (w2r ** 2).sum()).backward()
    torch.testing.assert_close(w.grad, wr.grad, **TOL)


def test_a_second_backward_is_refused_as_for_one_device():
    """shard_map keeps every rank's graph: a second backward must raise as torch does,
    not silently double x.grad. retain_graph=True still allows it."""
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(6, requires_grad=True)
    loss = spmd.shard_map(lambda x: spmd.psum((x.sin() ** 2).sum(), "sp"), mesh, P("sp"), P())(x)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * (2 * x.sin() * x.cos()).detach())
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()


def _activations_freed(mesh, retain):
    import weakref
    seen = []

    def body(x):
        h1 = x * 3
        h2 = h1.sin()  # saved by the next sin
        late = weakref.ref(h2)
        h1.register_hook(lambda g: seen.append(late() is None))  # runs after sin(h2)'s node
        return spmd.psum(h2.sin().sum(), "sp")
    x = torch.randn(8, requires_grad=True)
    spmd.shard_map(body, mesh, P("sp"), P())(x).backward(retain_graph=retain)
    return seen


@pytest.mark.parametrize("retain", [False, True])
def test_per_rank_activations_go_while_their_backward_runs(retain):
    """In per-rank code each node of the body's graph frees what it saved once it has
    run, as on one device (the whole graph was kept to the end of the backward: 16% more
    peak memory for the demo CNN), unless the caller retains the graph."""
    got = spmd.launch(_activations_freed, (2,), ("sp",), backend="threads", args=(retain,))
    assert got == [[not retain]] * 2


def _closed_over_caller_graph(mesh):
    w = torch.tensor([0.3, -1.2, 2.0], dtype=DT, requires_grad=True)
    w2 = torch.sin(w)  # the caller's node, which the body's graph reaches
    x = torch.arange(12.0, dtype=DT).view(4, 3)
    f = spmd.shard_map(lambda x: spmd.psum((x * w2).sum(), "sp") ** 2, mesh, P("sp"), P())
    (f(x) + (w2 ** 2).sum()).backward()  # the caller's term needs sin's saved w after f's
    return w.grad


def test_per_rank_body_reaching_the_callers_graph_keeps_it():
    got = spmd.launch(_closed_over_caller_graph, (2,), ("sp",), backend="threads")
    wr = torch.tensor([0.3, -1.2, 2.0], dtype=DT, requires_grad=True)
    w2r = torch.sin(wr)
    x = torch.arange(12.0, dtype=DT).view(4, 3)
    ((x * w2r).sum() ** 2 + (w2r ** 2).sum()).backward()
    for g in got:
        torch.testing.assert_close(g, wr.grad, **TOL)


def test_the_ranks_graphs_are_freed_after_backward():
    """Activations saved by the ranks' graphs lived as long as the output; they go with
    the backward now (unless retain_graph)."""
    import gc
    import weakref
    mesh = spmd.Mesh((2,), ("sp",))
    saved = []

    def body(x):
        h = x * 3  # sin saves h for its backward
        saved.append(weakref.ref(h))
        return spmd.psum(h.sin().sum(), "sp")
    x = torch.randn(8, requires_grad=True)
    loss = spmd.shard_map(body, mesh, P("sp"), P())(x)
    gc.collect()
    assert all(r() is not None for r in saved)
    loss.backward()
    gc.collect()
    assert all(r() is None for r in saved), "a rank's activation outlived the backward"
    assert loss.grad_fn is not None  # the output itself is still usable


def test_double_backward_is_refused_clearly():
    """create_graph=True returned a gradient with no graph, silently (item 6)."""
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(4, requires_grad=True)
    loss = spmd.shard_map(lambda x: spmd.psum((x ** 3).sum(), "sp"), mesh, P("sp"), P())(x)
    with pytest.raises(RuntimeError, match=r"create_graph=True, double backward\) is not "
                       r"supported"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap", "jvp"])
def test_torch_func_transforms_are_refused_clearly(transform):
    """grad/jacrev/vmap would fail deep inside functorch, and jvp would return a zero
    tangent silently: one clear error instead, naming what to do."""
    mesh = spmd.Mesh((2,), ("sp",))
    f = spmd.shard_map(lambda x: spmd.psum((x ** 2).sum(), "sp"), mesh, P("sp"), P())
    x = torch.randn(4)
    run = {"grad": lambda: torch.func.grad(f)(x), "jacrev": lambda: torch.func.jacrev(f)(x),
           "vmap": lambda: torch.func.vmap(f)(torch.randn(3, 4)),
           "jvp": lambda: torch.func.jvp(f, (x,), (torch.ones(4),))}[transform]
    with pytest.raises(RuntimeError, match=r"shard_map cannot run under a torch.func "
                       r"transform .* apply torch.func inside the body"):
        run()


def test_torch_func_inside_the_body_works():
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(6, dtype=DT)
    g = spmd.shard_map(lambda x: torch.func.grad(lambda t: (t ** 3).sum())(x), mesh, P("sp"),
                       P("sp"))(x)
    torch.testing.assert_close(g, 3 * x ** 2)


# -- nesting --------------------------------------------------------------------------------
# A shard_map body that splits over an axis has shards, not the global tensor: a nested
# shard_map over the same axis would split them again. Over another axis the values are
# right (the body's values are replicated over it) and are kept; gradients are not yet
# (the inner call would sum them over the outer's axes too) and are refused.

def _nested(inner_spec, outer_spec, mesh):
    inner = spmd.shard_map(lambda v: spmd.psum(v.sum(-1), inner_spec[-1]), mesh,
                           P(*inner_spec), P())
    return spmd.shard_map(lambda v: inner(v), mesh, P(*outer_spec), P(*outer_spec))


def test_nested_shard_map_over_a_mapped_axis_is_refused():
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.arange(8.0, dtype=DT).reshape(2, 4)
    outer = _nested((None, "sp"), (None, "sp"), mesh)
    with pytest.raises(spmd.SpecError, match=r"nested in a shard_map body mapped over axis 'sp' "
                       r".*in_specs = P\(None, 'sp'\) names 'sp' again"):
        outer(x)


def test_nested_shard_map_over_a_mapped_axis_names_the_axis_on_every_rank():
    def body(mesh):
        x = torch.arange(8.0, dtype=DT).reshape(4, 2)
        inner = spmd.shard_map(lambda v: v * 2, mesh, P("dp"), P("dp"))
        outer = spmd.shard_map(lambda v: inner(v), mesh, P("dp", "sp"), P("dp", "sp"))
        try:
            outer(x)
        except spmd.SpecError as e:
            return str(e)
        return None

    msgs = spmd.launch(body, (2, 2), ("dp", "sp"), timeout=10)
    assert all(m is not None and "'dp'" in m and "nested" in m for m in msgs), msgs
    assert len(set(m.split("rank")[0] for m in msgs)) == 1


def test_nested_shard_map_over_another_axis_keeps_its_values():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = torch.arange(16.0, dtype=DT).reshape(4, 4)
    outer = _nested((None, "sp"), ("dp",), mesh)
    with torch.no_grad():
        torch.testing.assert_close(outer(x), x.sum(1), **TOL)


def test_nested_shard_map_over_another_axis_refuses_gradients():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = torch.arange(16.0, dtype=DT).reshape(4, 4).requires_grad_()
    outer = _nested((None, "sp"), ("dp",), mesh)
    with pytest.raises(NotImplementedError, match=r"nested shard_map.*gradient.*'dp'"):
        outer(x)


def test_a_sparse_argument_is_a_clear_type_error():
    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(TypeError, match=r"shard_map: args\[0\]: x is a sparse tensor "
                       r"\(torch.sparse_coo\); .* pass x.to_dense\(\)"):
        spmd.shard_map(lambda x: x, mesh, P("sp"), P("sp"))(torch.ones(4, 2).to_sparse())


@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_nested_over_a_mapped_axis_is_refused_on_every_backend(mesh):
    inner = spmd.shard_map(lambda v: spmd.psum(v.sum(), "sp"), mesh, P("sp"), P())
    outer = spmd.shard_map(lambda v: inner(v), mesh, P("sp"), P())
    with pytest.raises(spmd.SpecError, match=r"nested in a shard_map body mapped over axis 'sp'"):
        outer(torch.arange(8.0))


def test_the_agreement_check_fingerprints_specs_as_they_are_now():
    """shard_map's agreement check keeps the crc of immutable specs (a tuple of P) per
    object; a list of specs changed in place gets a new one."""
    from spmd.mapping._agreement import _crc, _spec_crc
    specs = (P("x", None), P())
    assert _spec_crc(specs) == _crc(repr(specs)) == _spec_crc(specs)
    assert _spec_crc((P(None, "x"), P())) != _spec_crc(specs)
    listed = [P("x")]
    before = _spec_crc(listed)
    listed[0] = P(None, "x")
    assert _spec_crc(listed) == _crc(repr(listed)) != before


# -- a replicated output's claim, checked by default where it costs no message -----------------

@pytest.mark.parametrize("schedule", ["greenlets", "threads"])
def test_a_psum_left_out_is_refused_by_default(schedule):
    """The classic SPMD slip: a rank's partial sum returned under out_specs P(). Checked
    by default on the simulated mesh (no message: every rank's value is at hand), named
    like check_rep=True's, with the way out."""
    mesh = spmd.Mesh((4,), ("sp",), schedule=schedule)
    x = torch.arange(8.0)
    bad = spmd.shard_map(lambda s: s.sum(), mesh, P("sp"), P())
    with pytest.raises(spmd.SpecError, match=r"shard_map: out is claimed replicated over "
                       r"\['sp'\] by out_specs P\(\), but rank 1 differs from rank 0 at "
                       r"local index \[\]: 5\.0 vs 1\.0 \(by more than 0\.00035 of its "
                       r"largest magnitude\); .*\(e\.g\. psum\); check_rep=False skips"):
        bad(x)
    assert spmd.shard_map(lambda s: spmd.psum(s.sum(), "sp"), mesh, P("sp"), P())(x) == 28.0
    # opted out: rank 0's copy, as JAX's check_rep=False
    assert spmd.shard_map(lambda s: s.sum(), mesh, P("sp"), P(), check_rep=False)(x) == 1.0


def test_the_default_check_covers_the_replicated_axes_of_a_split_output():
    """P('sp') on a ('dp', 'sp') mesh claims the shards agree over 'dp'."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = torch.arange(4.0)
    f = spmd.shard_map(lambda s: s + spmd.axis_index("dp"), mesh, P("sp"), P("sp"))
    with pytest.raises(spmd.SpecError, match=r"replicated over \['dp'\] by out_specs "
                       r"P\('sp'\), but rank 2 differs from rank 0 at local index \[0\]"):
        f(x)


def _rotated_sum(s):
    """Every rank sums the same gathered values, each starting at its own index: the same
    number up to rounding (as a ring of ppermutes gives)."""
    v = spmd.all_gather(s, "sp", tiled=True).roll(-int(spmd.axis_index("sp")) * 5)
    total = v[0]
    for t in v[1:]:
        total = total + t
    return total


def test_the_default_check_lets_rounding_pass_and_check_rep_true_does_not():
    mesh = spmd.Mesh((4,), ("sp",))
    g = torch.Generator().manual_seed(1)
    x = torch.rand(40, generator=g) * 10 ** torch.randint(-3, 4, (40,), generator=g).float()
    with pytest.raises(spmd.SpecError, match=r"shard_map\(check_rep=True\): .* rank \d "
                       r"differs from rank 0"):  # the ranks' copies are not bit-equal
        spmd.shard_map(_rotated_sum, mesh, P("sp"), P(), check_rep=True)(x)
    got = spmd.shard_map(_rotated_sum, mesh, P("sp"), P())(x)
    torch.testing.assert_close(got, x.sum(), rtol=1e-5, atol=0)


def test_the_default_check_on_nan_inf_and_integers():
    """NaN where every rank has NaN and equal infinities agree; a NaN or an infinity on one
    rank only does not, nor does an integer off by one (integers are compared exactly)."""
    mesh = spmd.Mesh((2,), ("sp",))
    nan, inf = float("nan"), float("inf")
    one = lambda v: spmd.shard_map(lambda s: torch.tensor(v[int(spmd.axis_index("sp"))]),  # noqa: E731
                                   mesh, P("sp"), P())(torch.ones(2))
    assert one([[nan, inf, 1.0]] * 2)[0].isnan()
    for v, idx in (([[nan, 1.0], [0.0, 1.0]], 0), ([[1.0, inf], [1.0, -inf]], 1),
                   ([[1.0, inf], [1.0, 3e38]], 1), ([[5, 7], [5, 8]], 1)):
        with pytest.raises(spmd.SpecError, match=rf"rank 1 differs from rank 0 at local "
                           rf"index \[{idx}\]"):
            one(v)


def test_the_default_check_follows_spmd_validate_0(monkeypatch):
    monkeypatch.setenv("SPMD_VALIDATE", "0")
    mesh = spmd.Mesh((2,), ("sp",))
    assert spmd.shard_map(lambda s: s.sum(), mesh, P("sp"), P())(torch.arange(4.0)) == 1.0


def test_a_nested_call_checks_only_the_axes_it_maps():
    """Nested in a body mapped over 'dp', a call whose output is P() claims nothing about
    'dp' (each outer rank holds its own rows); over 'sp' it is checked."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    x = torch.arange(16.0, dtype=DT).reshape(4, 4)
    bad = spmd.shard_map(lambda v: v.sum(-1), mesh, P(None, "sp"), P())
    outer = spmd.shard_map(lambda v: bad(v), mesh, P("dp"), P("dp"))
    with torch.no_grad(), pytest.raises(spmd.SpecError, match=r"replicated over \['sp'\]"):
        outer(x)


def test_per_rank_copies_of_a_shared_tensor_are_made_before_any_body_runs():
    """launch's rank threads (or greenlets) passed one tensor: rank 0 runs on it, the
    others on copies, all made before any rank changes it in place (as processes each
    have theirs): every rank returns 2, none 4."""
    def per_rank(mesh, s):
        return spmd.shard_map(lambda s: s.mul_(2), mesh, P(), P(), check_rep=False)(s).tolist()
    s = torch.ones(2)
    assert spmd.launch(per_rank, (3,), "sp", args=(s,)) == [[2.0, 2.0]] * 3
    assert s.tolist() == [2.0, 2.0]


def _replicated_slip(mesh):
    comm = spmd.comm.comm_of(mesh)
    f = spmd.shard_map(lambda s: s.sum(), mesh, P("sp"), P())
    quiet = f(torch.arange(4.0)).item()  # processes: no message by default, rank's own
    comm.validate = True
    try:
        f(torch.arange(4.0))
    except spmd.SpecError as e:
        return quiet, str(e)
    finally:
        comm.validate = False  # the pool's processes serve later tests
    return quiet, None


@pytest.mark.gloo
def test_processes_check_the_claim_under_validation(gloo2):
    got = gloo2.run(_replicated_slip, (2,), ("sp",))
    assert [q for q, _ in got] == [1.0, 5.0]
    assert all(e is not None and "rank 1 differs from rank 0" in e for _, e in got), got


def test_outputs_whose_dtype_or_kind_differs_between_ranks_are_refused():
    """A split output concatenated from f32 and f64 shards came back f64 (torch.cat
    promotes), a replicated one as rank 0's dtype, silently; processes refuse both in the
    gather. So does the simulated mesh now, naming both ranks."""
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.arange(4.0)
    f64_on_1 = lambda t: t.double() if spmd.axis_index("sp") == 1 else t  # noqa: E731
    for out_spec, body in ((P("sp"), f64_on_1), (P(), lambda s: f64_on_1(spmd.psum(s.sum(), "sp")))):
        with pytest.raises(spmd.SpecError, match=r"shard_map: out is f32\[\d?\] on rank 0 but "
                           r"f64\[\d?\] on rank 1; every rank must return a tensor of the same "
                           r"dtype"):
            spmd.shard_map(body, mesh, P("sp"), out_spec)(x)
    with pytest.raises(spmd.SpecError, match=r"out is f32\[\] on rank 0 but float on rank 1"):
        spmd.shard_map(lambda s: s.sum() if spmd.axis_index("sp") == 0 else 3.0, mesh, P("sp"),
                       P())(x)
