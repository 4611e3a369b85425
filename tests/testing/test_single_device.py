"""spmd.testing: the strategies draw valid meshes, specs and (uneven, empty) layouts;
assert_matches_single_device passes correct sharded ops and catches wrong ones with a
message naming the output, the global index, the rank and local index holding it.

Correct ops are compared in float64 with the default tolerance (1e-10).
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import find, given, settings
from hypothesis import strategies as st

import spmd
from spmd import Layout, Mesh, P
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst
from spmd.testing.single_device import default_tolerance

F64 = torch.float64
FIND = settings(database=None, max_examples=500)


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


# -- strategies ------------------------------------------------------------------------------

@given(mesh=sst.meshes(max_ranks=4))
def test_meshes_are_threads_meshes_within_max_ranks(mesh):
    assert mesh.backend == "threads" and 1 <= mesh.size <= 4
    assert mesh.axis_names == {1: ("sp",), 2: ("x", "y")}[len(mesh.shape)]


@pytest.mark.parametrize("shape", [(3,), (1, 3), (2, 2), (4, 1)])
def test_meshes_include_uneven_and_2d_shapes(shape):
    assert find(sst.meshes(max_ranks=4), lambda m: m.shape == shape, settings=FIND).shape == shape


def test_meshes_axis_names_and_errors():
    m = find(sst.meshes(6, ndims=2, axis_names=("dp", "sp")), lambda m: m.size == 6,
             settings=FIND)
    assert m.axis_names == ("dp", "sp") and m.shape in ((2, 3), (3, 2), (1, 6), (6, 1))
    m = find(sst.meshes(2, ndims=(1, 2), axis_names={1: ("a",), 2: ("b", "c")}),
             lambda m: len(m.shape) == 1, settings=FIND)
    assert m.axis_names == ("a",)
    with pytest.raises(ValueError, match="max_ranks must be a positive int, got 0"):
        sst.meshes(0)
    with pytest.raises(ValueError, match="no default axis names for a 4-d mesh"):
        sst.meshes(ndims=4)
    with pytest.raises(ValueError, match=re.escape("a 2-d mesh needs 2 axis names, got ('a',)")):
        sst.meshes(ndims=2, axis_names=("a",))


@given(n=st.integers(0, 12), parts=st.integers(1, 5), data=st.data())
def test_split_sizes_add_up(n, parts, data):
    sizes = data.draw(sst.split_sizes(n, parts))
    assert len(sizes) == parts and sum(sizes) == n and min(sizes) >= 0
    if n >= parts:
        sizes = data.draw(sst.split_sizes(n, parts, allow_empty=False))
        assert len(sizes) == parts and sum(sizes) == n and min(sizes) >= 1


def test_split_sizes_are_uneven_and_empty():
    assert 0 in find(sst.split_sizes(6, 3), lambda s: 0 in s and s[-1] > 0, settings=FIND)
    # without empty shards: genuinely uneven, not just balanced
    s = find(sst.split_sizes(9, 3, allow_empty=False), lambda s: max(s) - min(s) >= 3,
             settings=FIND)
    assert min(s) >= 1 and sum(s) == 9
    assert find(sst.split_sizes(3, 3, allow_empty=False), lambda s: True) == [1, 1, 1]
    with pytest.raises(ValueError, match="2 elements cannot fill 3 shards of at least 1"):
        sst.split_sizes(2, 3, allow_empty=False)
    with pytest.raises(ValueError, match="parts must be a positive int, got 0"):
        sst.split_sizes(2, 0)


@given(shape=sst.shapes(ndim=range(0, 4), min_side=1, max_side=5))
def test_shapes_within_bounds(shape):
    assert len(shape) <= 3 and all(1 <= s <= 5 for s in shape)


def test_shapes_include_zero_sides_and_errors():
    assert 0 in find(sst.shapes(ndim=2), lambda s: 0 in s, settings=FIND)
    assert find(sst.shapes(ndim=0), lambda s: True) == ()
    with pytest.raises(ValueError, match="min_side <= max_side"):
        sst.shapes(min_side=3, max_side=2)


@given(mesh=sst.meshes(max_ranks=6, ndims=(1, 2, 3)), ndim=st.integers(0, 3), data=st.data())
def test_specs_use_each_axis_once(mesh, ndim, data):
    k = data.draw(st.integers(0, min(ndim, len(mesh.shape))))
    spec = data.draw(sst.specs(mesh, ndim, min_split=k))
    assert isinstance(spec, P) and len(spec) <= ndim
    assert len(set(spec.axes)) == len(spec.axes)
    assert set(spec.axes) <= set(mesh.axis_names)
    assert sum(e is not None for e in spec) >= k
    Layout((3,) * ndim, spec, mesh)  # accepted by Layout


def test_specs_spell_entries_every_way():
    mesh = Mesh((2, 2), ("x", "y"))
    find(sst.specs(mesh, 2), lambda s: ("x", "y") in s or ("y", "x") in s, settings=FIND)
    find(sst.specs(mesh, 2), lambda s: ("x",) in s, settings=FIND)  # a 1-tuple entry
    find(sst.specs(mesh, 3), lambda s: len(s) == 1 and s[0] is not None, settings=FIND)
    with pytest.raises(ValueError, match="min_split=2 needs 0 <= min_split <= "):
        sst.specs(Mesh((2,), ("sp",)), 3, min_split=2)


@given(case=sst.sharded_arrays(max_ranks=4))
def test_sharded_arrays_are_consistent(case):
    mesh, lay, x = case
    assert x.dtype == F64 and tuple(x.shape) == lay.shape
    assert lay.axis_names == mesh.axis_names and lay.mesh_shape == mesh.shape
    for d in lay.split_dims:
        assert sum(lay.sizes[d]) == lay.shape[d] and min(lay.sizes[d]) >= 0
    for r in range(mesh.size):
        assert tuple(case.shard(r).shape) == lay.local_shape(r)


@given(mesh=sst.meshes(), shape=sst.shapes(ndim=2, max_side=6), data=st.data())
def test_layouts_without_empty_shards(mesh, shape, data):
    lay = data.draw(sst.layouts(shape, mesh, allow_empty=False))
    assert all(min(lay.sizes[d]) >= 1 for d in lay.split_dims)
    balanced = data.draw(sst.layouts(shape, mesh, lay.spec, uneven=False))
    assert balanced == Layout(shape, lay.spec, mesh)


def test_layouts_are_uneven_and_have_empty_shards():
    mesh = Mesh((3,), ("sp",))
    lay = find(sst.layouts((7, 2), mesh, P("sp")), lambda lay: 0 in lay.sizes[0],
               settings=FIND)
    assert lay.local_shape(lay.sizes[0].index(0)) == (0, 2)
    find(sst.layouts((7, 2), mesh, P("sp"), allow_empty=False),
         lambda lay: not lay.is_even and lay.sizes[0] != (3, 2, 2), settings=FIND)
    find(sst.sharded_arrays(ndim=2), lambda c: len(c.mesh.shape) == 2
         and any(len(set(s)) > 1 for s in c.layout.sizes if s), settings=FIND)
    with pytest.raises(ValueError, match=r"splits dim 0 of size 2 into 3 shards"):
        sst.layouts((2, 2), mesh, P("sp"), allow_empty=False)


def test_importing_spmd_does_not_import_hypothesis():
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import spmd, spmd.testing\n"
            "assert callable(spmd.testing.assert_matches_single_device)\n"
            "try:\n    spmd.testing.strategies\nexcept ImportError:\n    print('lazy')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "lazy", out.stderr


# -- assert_matches_single_device: correct ops pass ----------------------------------------------

@settings(max_examples=20)
@given(case=sst.sharded_arrays(ndim=range(1, 3)))
def test_elementwise_on_any_layout(case):
    mesh, lay, x = case
    y = assert_matches_single_device(lambda x: torch.sin(x) * x, lambda x: torch.sin(x) * x,
                                     mesh, lay, lay, x)
    torch.testing.assert_close(y, torch.sin(x) * x, rtol=0, atol=0)


def _stencil_global(x):
    """A backward difference along dim 0, zero before the first row."""
    return x - F.pad(x, (0, 0, 1, 0))[:-1]


LAY = Layout((10, 2), P("sp"), Mesh((4,), ("sp",)), {0: [3, 0, 4, 3]})


def _stencil_local(mesh):
    def f(x):
        u = spmd.halo_pad(x, mesh, "sp", 0, (1, 0), sizes=LAY.sizes[0])
        return u[1:] - u[:-1]
    return f


def test_halo_stencil_on_uneven_shards_with_an_empty_one():
    mesh = Mesh((4,), ("sp",))
    assert_matches_single_device(_stencil_local(mesh), _stencil_global, mesh, LAY, LAY,
                                 _x(10, 2))


def test_reduction_and_pytree_outputs():
    mesh = Mesh((2, 2), ("dp", "sp"))
    x = _x(5, 3)

    def local(x):
        return {"u": x * 3, "norm": spmd.psum((x ** 2).sum(), ("dp", "sp")).sqrt()}

    out = assert_matches_single_device(local, lambda x: {"u": x * 3, "norm": x.norm()}, mesh,
                                       P("dp", "sp"), {"u": P("dp", "sp"), "norm": P()}, x)
    assert set(out) == {"u", "norm"}


def test_params_get_compared_gradients():
    mesh = Mesh((3,), ("sp",))
    x, w, b = _x(7, 4), _x(4, 2, seed=1), _x(2, seed=2)
    assert_matches_single_device(lambda x, w, b: torch.tanh(x @ w + b),
                                 lambda x, w, b: torch.tanh(x @ w + b),
                                 mesh, P("sp"), P("sp"), x, params=[w, b])
    # float32 in the sharded run, float64 reference, float32 tolerance
    assert_matches_single_device(lambda x, w, b: torch.tanh(x @ w + b),
                                 lambda x, w, b: torch.tanh(x @ w + b),
                                 mesh, P("sp"), P("sp"), x, params=[w, b], dtype=torch.float32)


def test_a_converted_model_against_the_original_compares_parameters_by_name():
    mesh = Mesh((3,), ("sp",))
    spec = P(None, None, "sp")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Tanh(),
                                torch.nn.Conv2d(3, 1, 3, padding=1))
    sharded = spmd.nn.convert(plain, mesh, spec)
    assert_matches_single_device(sharded, plain, mesh, spec, spec, _x(2, 2, 8, 5))
    # the caller's modules are copied: no gradients, same dtype
    assert all(p.grad is None and p.dtype == torch.float32
               for p in [*plain.parameters(), *sharded.parameters()])


class _Scale(torch.nn.Module):
    def __init__(self, lose_grad=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.5, -0.5], dtype=F64))
        self.lose_grad = lose_grad

    def forward(self, x):
        # the same values; with lose_grad half of w's gradient goes missing
        w = self.w * 0.5 + self.w.detach() * 0.5 if self.lose_grad else self.w
        return x * w


class _Renamed(torch.nn.Module):
    """_Scale's computation with its parameter under another name."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.5, -0.5], dtype=F64))

    def forward(self, x):
        return x * self.scale


def test_a_wrong_parameter_gradient_is_named():
    mesh = Mesh((2,), ("sp",))
    with pytest.raises(AssertionError, match=r"gradient of parameter 'w' differs .* held by "
                                             r"every rank \(replicated\)"):
        assert_matches_single_device(_Scale(lose_grad=True), _Scale(), mesh, P("sp"), P("sp"),
                                     _x(5, 2))
    with pytest.raises(AssertionError, match=r"the sharded module's parameters \['w'\] are "
                                             r"not the reference module's \['scale'\]"):
        assert_matches_single_device(_Scale(), _Renamed(), mesh, P("sp"), P("sp"), _x(5, 2))


def test_default_tolerances():
    assert default_tolerance(torch.float64) == (1e-10, 1e-10)
    assert default_tolerance(torch.float32) == (1e-5, 1e-6)
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        default_tolerance(torch.int64)


# -- assert_matches_single_device: wrong ops are caught, precisely --------------------------------

def _fails(*args, **kw) -> str:
    with pytest.raises(AssertionError) as e:
        assert_matches_single_device(*args, **kw)
    return str(e.value)


def test_a_stencil_without_its_halo_names_the_ranks_and_local_index():
    mesh = Mesh((4,), ("sp",))
    x = _x(10, 2)
    forgot = lambda x: _stencil_global(x)  # pads every shard with zeros: wrong at shard starts
    msg = _fails(forgot, _stencil_global, mesh, LAY, LAY, x)
    # shards start at rows 0, 3 (rank 1 is empty), 3 and 7: rows 3 and 7 are wrong
    d = abs(float(x[2, 0]))
    assert msg == (
        "assert_matches_single_device: output differs from the float64 single-device "
        "reference in 4 of 20 elements (rtol=1e-10, atol=1e-10). First at global index "
        f"(3, 0), held by rank 2 at local index (0, 0): sharded {float(x[3, 0]):.6g} vs "
        f"reference {float(x[3, 0] - x[2, 0]):.6g} (|diff| {d:.2e} > "
        f"{1e-10 + 1e-10 * abs(float(x[3, 0] - x[2, 0])):.2g}). "
        "Ranks with differing elements: [2, 3].")


def test_an_edge_error_on_a_2d_mesh_names_the_replicas():
    mesh = Mesh((2, 3), ("dp", "sp"))
    lay = Layout((4, 9), P(None, "sp"), mesh, {1: [2, 5, 2]})
    msg = _fails(lambda x: _stencil_global(x.T).T, lambda x: _stencil_global(x.T).T,
                 mesh, lay, lay, _x(4, 9))
    # columns 2 and 7 are wrong; column 2 is rank 1's (and its dp replica rank 4's) first
    assert "in 8 of 36 elements" in msg
    assert "First at global index (0, 2), held by ranks [1, 4] at local index (0, 0)" in msg
    assert msg.endswith("Ranks with differing elements: [1, 2, 4, 5].")


@spmd.custom_vjp
def _square(x):
    return x * x


_square.defvjp(lambda x: (x * x, x), lambda x, g: (g * x,))  # forgets the factor 2


def test_a_wrong_gradient_names_the_argument():
    mesh = Mesh((3,), ("sp",))
    x = _x(6, 2) + 3  # no zeros: every gradient element is wrong
    msg = _fails(lambda x, w: _square(x) * w, lambda x, w: x * x * w, mesh, P("sp"),
                 P("sp"), x, params=[_x(2, seed=1)])
    assert msg.startswith("assert_matches_single_device: gradient of args[0] differs from "
                          "the float64 single-device reference in 12 of 12 elements ")
    assert "First at global index (0, 0), held by rank 0 at local index (0, 0)" in msg
    assert msg.endswith("Ranks with differing elements: [0, 1, 2].")


def test_a_missing_parameter_gradient_is_caught():
    mesh = Mesh((2,), ("sp",))
    msg = _fails(lambda x, w: x * w.detach(), lambda x, w: x * w, mesh, P("sp"), P("sp"),
                 _x(4, 3), params=[_x(3, seed=1)])
    assert msg == ("assert_matches_single_device: gradient of params[0]: the single-device "
                   "reference has one but the sharded run has none")


def test_a_wrong_replicated_output_and_a_pytree_key():
    mesh = Mesh((2,), ("sp",))
    msg = _fails(lambda x: {"u": x, "s": spmd.psum(x.sum(), "sp") * 2},
                 lambda x: {"u": x, "s": x.sum()}, mesh, P("sp"), {"u": P("sp"), "s": P()},
                 _x(4) + 1)
    assert "output['s'] differs" in msg and "in 1 of 1 elements" in msg
    assert "First at global index (), held by every rank (replicated)" in msg
    assert msg.endswith("Ranks with differing elements: [0, 1].")


def test_a_wrong_output_shape_names_both_shapes():
    mesh = Mesh((3,), ("sp",))
    msg = _fails(lambda x: (x, x[:-1]), lambda x: (x, x), mesh, P("sp"), P("sp"), _x(6, 2))
    assert msg == ("assert_matches_single_device: output[1] is f64[3, 2] but the "
                   "single-device reference is f64[6, 2]")


def test_a_wrong_structure_and_bad_arguments():
    mesh = Mesh((2,), ("sp",))
    msg = _fails(lambda x: (x, x), lambda x: [x, x], mesh, P("sp"), P("sp"), _x(4))
    assert msg.startswith("assert_matches_single_device: the sharded output is PyTreeSpec((")
    with pytest.raises(TypeError, match="mesh must be a spmd.Mesh, got tuple"):
        assert_matches_single_device(lambda x: x, lambda x: x, (2,), P("sp"), P("sp"), _x(4))
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        assert_matches_single_device(lambda x: x, lambda x: x, mesh, P("sp"), P("sp"), _x(4),
                                     dtype=torch.int32)


def test_per_rank_code_checks_and_names_ranks_of_balanced_shards():
    x = _x(7, 2)

    def per_rank(mesh):
        assert_matches_single_device(lambda x: spmd.psum(x.sum(0), "sp"), lambda x: x.sum(0),
                                     mesh, P("sp"), P(), x)
        try:
            assert_matches_single_device(lambda x: x + (spmd.axis_index("sp") == 2),
                                         lambda x: x, mesh, P("sp"), P("sp"), x)
        except AssertionError as e:
            return str(e)

    msgs = spmd.launch(per_rank, (3,), ("sp",), timeout=20)
    # balanced sizes 3, 2, 2: rank 2 holds rows 5 and 6
    assert all("output differs from the float64 single-device reference in 4 of 14" in m
               and "First at global index (5, 0), held by rank 2 at local index (0, 0)" in m
               and m.endswith("Ranks with differing elements: [2].") for m in msgs), msgs
