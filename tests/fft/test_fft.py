"""spmd.fft: every transform equals torch.fft on the gathered tensor (complex128/float64,
values and gradients to 1e-10) for 1-3 transformed dims, 1-d and 2-d meshes, prime and
tiny extents (empty shards), uneven splits, every norm, ``s`` padding and cropping; the
inverse transforms bring a transform back to its layout with no extra transpose; a slab
moves data once each way, a pencil twice, exactly the bytes that change owner; backward
is the adjoint (dot-product test) and differentiates again; bad arguments raise one
SpecError on every rank before anything moves.

Complex tensors travel through shard_map and the single-device check as their real views
(``view_as_real``), so values and gradients are compared as pairs of float64.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import spmd
import spmd.fft
from spmd import Layout, Mesh, P
from spmd.fft.call import _planned
from spmd.fft.plan import split_dims
from spmd.testing import assert_matches_single_device, check_adjoint
from spmd.testing import strategies as sst

F64 = torch.float64
NAMES = ["fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn",
         "ifftn", "rfftn", "irfftn"]
NORMS = [None, "backward", "forward", "ortho"]
SIDES = [1, 2, 3, 4, 5, 6, 7, 8, 13, 17]


def family(name: str) -> str:
    return "1d" if name[-1] == "t" else "2d" if name[-1] == "2" else "nd"


def kind(name: str) -> str:
    return name.rstrip("2n")


def call_args(name: str, ns, dim) -> dict:
    """torch.fft's keyword arguments for ``name``: ``n`` or ``s``, and ``dim`` if given."""
    kw = {"n" if family(name) == "1d" else "s": ns}
    if dim is not None:
        kw["dim"] = dim
    return kw


def real_view(lay: Layout, mesh: Mesh) -> Layout:
    """The layout of ``view_as_real`` of a complex tensor laid out by ``lay``."""
    return Layout(lay.shape + (2,), lay.spec, mesh,
                  {d: s for d, s in enumerate(lay.sizes) if s is not None} or None)


def torch_ok(name: str, shape, kw: dict, complex_in: bool) -> bool:
    """Whether torch.fft accepts the call (on a meta tensor: nothing computed)."""
    x = torch.empty(shape, dtype=torch.complex128 if complex_in else F64, device="meta")
    try:
        getattr(torch.fft, name)(x, **kw)
    except (RuntimeError, IndexError, ValueError, TypeError):
        return False
    return True


def check_case(name: str, mesh: Mesh, lay: Layout, ns=None, dim=None, norm=None,
               out_spec=None, by_layout: bool = True, real_in: bool = False, seed: int = 0):
    """``spmd.fft.<name>`` under shard_map against ``torch.fft.<name>``: values and
    gradients, the output laid out as ``<name>.output_layout`` says."""
    fn, ref = getattr(spmd.fft, name), getattr(torch.fft, name)
    kw = call_args(name, ns, dim)
    complex_in = kind(name) != "rfft" and not real_in
    complex_out = kind(name) != "irfft"
    out = fn.output_layout(lay, **kw, out_spec=out_spec)
    spec = lay if by_layout else lay.spec

    def wrap(f):
        def g(x):
            y = f(torch.view_as_complex(x) if complex_in else x)
            return torch.view_as_real(y.resolve_conj()) if complex_out else y
        return g

    local = wrap(lambda x: fn(x, **kw, norm=norm, mesh=mesh, spec=spec, out_spec=out_spec))
    glob = wrap(lambda x: ref(x, **kw, norm=norm))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(lay.shape + ((2,) if complex_in else ()), generator=g, dtype=F64)
    return assert_matches_single_device(
        local, glob, mesh, real_view(lay, mesh) if complex_in else lay,
        real_view(out, mesh) if complex_out else out, x)


# -- every transform against torch.fft ---------------------------------------------------------

MESHES = [(2,), (2, 2), (3,), (4,), (2, 2), (1,), (1, 3), (2, 1)]


def meshes():
    """1-d and 2-d threads meshes of 1 to 4 ranks, (2, 2) (pencils) among the first."""
    return st.sampled_from(MESHES).map(
        lambda s: Mesh(s, ("sp",) if len(s) == 1 else ("x", "y")))


@st.composite
def layouts_over(draw, shape, mesh: Mesh, dims):
    """Uneven layouts of ``shape`` whose mesh axes mostly cut the transformed ``dims``
    (slabs and pencils), sometimes other dims, sometimes none."""
    others = [d for d in range(len(shape)) if d not in dims]
    entries = [() for _ in shape]
    axes = draw(st.permutations(mesh.axis_names))
    if len(axes) == 2 and len(dims) >= 2 and draw(st.booleans()):  # a pencil
        picked = draw(st.permutations(dims))
        entries[picked[0]], entries[picked[1]] = (axes[0],), (axes[1],)
        axes = []
    for a in axes:
        d = draw(st.sampled_from(list(dims) * 2 + others + [None]))
        if d is not None:
            entries[d] += (a,)
    spec = P(*[e[0] if len(e) == 1 and draw(st.booleans()) else e or None for e in entries])
    return draw(sst.layouts(shape, mesh, spec))


@st.composite
def fft_cases(draw):
    name = draw(st.sampled_from(NAMES))
    fam = family(name)
    mesh = draw(meshes())
    ndim = draw(st.integers(2 if fam == "2d" else 1, 4))
    shape = tuple(draw(st.sampled_from(SIDES)) for _ in range(ndim))
    assume(math.prod(shape) <= 2000)
    if fam == "1d":
        dim = draw(st.integers(-ndim, ndim - 1))
        dims = (dim % ndim,)
    elif fam == "2d":
        dims = tuple(draw(st.permutations(range(ndim)))[:2])
        dim = None if dims == (ndim - 2, ndim - 1) and draw(st.booleans()) else dims
    else:
        k = draw(st.integers(1, min(3, ndim)))
        default = draw(st.booleans())  # dim=None: all dims, or the last len(s) with s
        dims = tuple(range(ndim - k, ndim)) if default else tuple(
            draw(st.permutations(range(ndim)))[:k])
    sizes = [draw(st.integers(1, shape[d] + 3)) for d in dims]
    if fam == "1d":
        ns = draw(st.sampled_from([None, sizes[0]]))
    else:
        ns = draw(st.sampled_from([None, tuple(sizes),
                                   tuple(-1 if i % 2 else v for i, v in enumerate(sizes))]))
    if fam == "nd":
        dim = None if default and (ns is not None or k == ndim) else dims
    lay = draw(layouts_over(shape, mesh, dims))
    real_in = kind(name) in ("fft", "ifft") and draw(st.booleans())
    assume(torch_ok(name, shape, call_args(name, ns, dim), kind(name) != "rfft" and not real_in))
    out_spec = draw(st.one_of(st.none(), st.just(lay.spec), sst.specs(mesh, ndim)))
    return dict(name=name, mesh=mesh, lay=lay, ns=ns, dim=dim, norm=draw(st.sampled_from(NORMS)),
                out_spec=out_spec, by_layout=draw(st.booleans()), real_in=real_in,
                seed=draw(st.integers(0, 99)))


@sst.settings()
@given(case=fft_cases())
def test_every_transform_matches_torch_fft(case):
    check_case(**case)


PRIMES = [  # (name, mesh shape, global shape, spec, sizes, n or s, dim)
    ("rfft2", (4,), (1, 2, 7, 13), (None, None, "sp"), None, None, None),
    ("rfftn", (2, 2), (17, 7, 13), ("x", "y"), None, None, None),
    ("irfftn", (2, 2), (17, 7, 13), ("x", "y"), None, (17, 7, 13), None),
    ("fftn", (3,), (13, 17), (None, "sp"), None, None, None),
    ("ifft2", (2, 2), (7, 13), (("x", "y"),), None, (5, 17), None),
    ("rfft", (4,), (2, 3), (None, "sp"), None, 7, -1),          # 3 over 4 ranks: one empty
    ("irfft", (4,), (3, 2), ("sp",), None, 13, 0),
    ("fft", (4,), (2,), ("sp",), None, 5, 0),                   # a 1-d tensor, padded
    ("rfftn", (4,), (1, 2, 3, 7), (None, None, "sp"), {2: [0, 3, 0, 0]}, (2, 5), (2, 3)),
    ("irfft2", (3,), (2, 4, 5), (None, "sp"), {1: [0, 0, 4]}, (3, 7), (1, 2)),
    ("fft2", (2, 2), (1, 2, 3), (None, "x", "y"), None, (4, 1), (1, 2)),
]


@pytest.mark.parametrize("norm", ["backward", "ortho", "forward"])
@pytest.mark.parametrize("name, mshape, shape, spec, sizes, ns, dim", PRIMES)
def test_primes_tiny_extents_and_s(name, mshape, shape, spec, sizes, ns, dim, norm):
    mesh = Mesh(mshape, ("sp",) if len(mshape) == 1 else ("x", "y"))
    check_case(name, mesh, Layout(shape, P(*spec), mesh, sizes), ns, dim, norm)


# -- round trips and layouts ----------------------------------------------------------------

@st.composite
def round_trip_cases(draw):
    mesh = draw(meshes())
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.sampled_from(SIDES)) for _ in range(ndim))
    assume(math.prod(shape) <= 2000)
    k = draw(st.integers(1, min(3, ndim)))
    dims = tuple(draw(st.permutations(range(ndim)))[:k])
    lay = draw(layouts_over(shape, mesh, dims))
    return mesh, lay, dims, draw(st.sampled_from(["rfftn", "fftn"])), draw(st.booleans())


@sst.settings()
@given(case=round_trip_cases())
def test_inverse_returns_to_the_input_layout_with_no_extra_transpose(case):
    mesh, lay, dims, name, back = case
    inv = getattr(spmd.fft, "i" + name)
    fwd = getattr(spmd.fft, name)
    s = tuple(lay.shape[d] for d in dims)
    # both frequency layouts: the one the plan leaves, and out_spec = the input's
    freq = fwd.output_layout(lay, dim=dims, out_spec=lay.spec if back else None)
    f_plan = _planned(kind(name), name, lay, dims, None, lay.spec if back else None)
    for want in (None, lay):  # no extra transpose, ever
        i_plan = _planned("i" + kind(name), "i" + name, freq, dims, s, want)
        assert i_plan.transposes <= f_plan.transposes

    def trip(x):
        y = fwd(x, dim=dims, mesh=mesh, spec=lay, out_spec=lay.spec if back else None)
        z = inv(y, s, dims, mesh=mesh, spec=freq, out_spec=lay)
        return z if name == "rfftn" else z.real

    x = torch.randn(lay.shape, dtype=F64)
    y = spmd.shard_map(trip, mesh, lay, lay)(x)
    torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mshape, spec, dims, freq_spec", [
    ((2,), (None, None, "sp"), (2, 3), (None, None, None, "sp")),              # slab 2-d
    ((2,), (None, None, "sp"), (2, 3, 4), (None, None, None, None, "sp")),      # slab 3-d
    ((2, 2), (None, None, "x", "y"), (2, 3, 4), (None, None, None, "x", "y")),  # pencil
    ((2, 2), ("x", None, "y"), (2, 3, 4), ("x", None, None, None, "y")),        # dp x slab
])
@pytest.mark.parametrize("uneven", [False, True])
def test_round_trip_in_the_default_layout(mshape, spec, dims, freq_spec, uneven):
    """The spatial layouts FNOs use come back by default (balanced), or exactly with
    out_spec=the input's Layout; one transpose per split dim each way, either way."""
    mesh = Mesh(mshape, ("sp",) if len(mshape) == 1 else ("x", "y"))
    shape = (2, 3, 7, 6, 5)[:max(dims) + 1]
    split = [d for d, e in enumerate(spec) if e is not None]
    sizes = {split[-1]: [shape[split[-1]], 0] + [0] * (mesh.size - 2)
             if len(mshape) == 1 else [shape[split[-1]] - 1, 1]} if uneven else None
    lay = Layout(shape, P(*spec), mesh, sizes)
    freq = spmd.fft.rfftn.output_layout(lay, dim=dims)
    assert freq.spec == P(*freq_spec)
    s = tuple(shape[d] for d in dims)
    back = spmd.fft.irfftn.output_layout(freq, s, dims)
    assert back == Layout(shape, P(*spec), mesh)  # the cut, with balanced sizes
    want = lay if uneven else None

    def trip(x):
        y = spmd.fft.rfftn(x, dim=dims, mesh=mesh, spec=lay)
        return spmd.fft.irfftn(y, s, dims, mesh=mesh, spec=freq, out_spec=want)

    x = torch.randn(shape, dtype=F64)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(trip, mesh, lay, lay)(x)
    torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10)
    transposes = len(split_dims(lay, dims)) * 2  # uneven sizes too: the last one aims there
    assert stats.calls("fft transpose") == transposes * mesh.size
    assert stats.calls() == stats.calls("fft transpose")  # no size exchange, nothing else


# -- what moves -------------------------------------------------------------------------------

def owner_change_bytes(src: Layout, dst: Layout, itemsize: int) -> int:
    """The bytes of the elements whose rank changes from ``src`` to ``dst`` (each element
    has one owner in both): the least any transpose between them can send."""
    moved = 0
    for r in range(math.prod(src.mesh_shape)):
        mine = math.prod(src.local_shape(r))
        kept = math.prod(max(0, min(a + m, b + k) - max(a, b)) for a, m, b, k in zip(
            src.offsets(r), src.local_shape(r), dst.offsets(r), dst.local_shape(r)))
        moved += mine - kept
    return moved * itemsize


def run_counting(mesh, lay, f):
    """Forward and backward of ``f`` under shard_map, counted."""
    x = torch.randn(lay.shape, dtype=F64, requires_grad=True)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(f, mesh, lay, f.out)(x)
        torch.view_as_real(y).sum().backward()
    return stats


def plan_transposes(name, lay, dims):
    return [st for st in _planned(kind(name), name, lay, dims, None, None).steps
            if type(st).__name__ == "Transpose"]


@pytest.mark.parametrize("sizes", [None, {2: [7, 1]}])
def test_slab_rfft2_moves_once_each_way(sizes):
    mesh = Mesh((2,), ("sp",))
    lay = Layout((1, 3, 8, 10), P(None, None, "sp"), mesh, sizes)
    f = lambda x: spmd.fft.rfft2(x, mesh=mesh, spec=lay)
    f.out = spmd.fft.rfft2.output_layout(lay)
    stats = run_counting(mesh, lay, f)
    for pass_ in ("forward", "backward"):
        assert stats.calls("fft transpose", axes="sp", pass_=pass_) == 2  # once per rank
    (t,) = plan_transposes("rfft2", lay, (2, 3))
    want = owner_change_bytes(t.src, t.layout, 16)
    assert stats.bytes("fft transpose", pass_="forward") == want
    assert stats.bytes("fft transpose", pass_="backward") == want
    assert stats.calls() == 4
    if sizes is None:  # even: (P-1)/P of the complex half-spectrum, per rank
        assert want == 2 * (3 * 8 * 6 * 16) // 2 // 2


def test_pencil_rfftn_moves_twice_each_way():
    mesh = Mesh((2, 2), ("x", "y"))
    lay = Layout((2, 6, 5, 8), P(None, "x", "y"), mesh)
    dims = (1, 2, 3)
    f = lambda x: spmd.fft.rfftn(x, dim=dims, mesh=mesh, spec=lay)
    f.out = spmd.fft.rfftn.output_layout(lay, dim=dims)
    stats = run_counting(mesh, lay, f)
    t1, t2 = plan_transposes("rfftn", lay, dims)
    assert (t1.axes, t2.axes) == (("y",), ("x",))
    for pass_ in ("forward", "backward"):
        assert stats.calls("fft transpose", axes="y", pass_=pass_) == 4
        assert stats.calls("fft transpose", axes="x", pass_=pass_) == 4
        want = owner_change_bytes(t1.src, t1.layout, 16) + owner_change_bytes(
            t2.src, t2.layout, 16)
        assert stats.bytes("fft transpose", pass_=pass_) == want
    assert stats.calls() == 16


def test_local_dims_move_nothing_and_a_p_spec_exchanges_shapes_once():
    mesh = Mesh((2,), ("sp",))
    lay = Layout((4, 6, 5), P("sp"), mesh, {0: [3, 1]})
    x = torch.randn(4, 6, 5, dtype=F64)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(lambda x: spmd.fft.rfft2(x, mesh=mesh, spec=P("sp")), mesh, lay,
                           spmd.fft.rfft2.output_layout(lay))(x)
    torch.testing.assert_close(y, torch.fft.rfft2(x))
    assert stats.calls("fft transpose") == 0 and stats.calls("rfft2 sizes") == 2
    assert stats.calls() == 2


# -- backward ---------------------------------------------------------------------------------

ADJOINT_LAYOUTS = [  # (mesh shape, global shape, spec, sizes, dims)
    ((3,), (2, 5, 4), (None, "sp"), {1: [0, 4, 1]}, (1, 2)),
    ((2, 2), (3, 4, 5), ("x", None, "y"), {0: [3, 0]}, (0, 1, 2)),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mshape, shape, spec, sizes, dims", ADJOINT_LAYOUTS)
def test_backward_is_the_adjoint(name, mshape, shape, spec, sizes, dims):
    mesh = Mesh(mshape, ("sp",) if len(mshape) == 1 else ("x", "y"))
    lay = Layout(shape, P(*spec), mesh, sizes)
    fam = family(name)
    dim = dims[-1] if fam == "1d" else dims[-2:] if fam == "2d" else dims
    fn = getattr(spmd.fft, name)
    complex_in, complex_out = kind(name) != "rfft", kind(name) != "irfft"

    def T(x):
        y = fn(torch.view_as_complex(x) if complex_in else x, dim=dim, norm="ortho",
               mesh=mesh, spec=lay)
        return torch.view_as_real(y.resolve_conj()) if complex_out else y

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(lay.local_shape(r) + ((2,) if complex_in else ()), generator=g,
                      dtype=F64) for r in range(mesh.size)]
    check_adjoint(T, mesh, xs)


@pytest.mark.parametrize("name", ["rfftn", "irfftn", "fftn"])
def test_double_backward_matches_one_device(name):
    """A Hessian-vector product, taken on each rank (as per-rank training would): each
    transpose's backward is a transpose too, so it differentiates again. A backward on
    each rank inside the body needs a thread per rank (schedule="threads")."""
    mesh = Mesh((2, 2), ("x", "y"), schedule="threads")
    lay = Layout((5, 4, 6), P("x", "y"), mesh)
    fn, ref = getattr(spmd.fft, name), getattr(torch.fft, name)
    out = fn.output_layout(lay)

    def hvp(x, v, w, transform):
        x = x.detach().requires_grad_()
        loss = (transform(x).abs() ** 2 * w).sum()
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), x)
        return h

    x, v = torch.randn(lay.shape, dtype=F64), torch.randn(lay.shape, dtype=F64)
    w = torch.rand(out.shape, dtype=F64)
    body = lambda x, v, w: hvp(x, v, w, lambda t: fn(t, mesh=mesh, spec=lay))
    got = spmd.shard_map(body, mesh, (lay, lay, out), lay)(x, v, w)
    torch.testing.assert_close(got, hvp(x, v, w, ref), rtol=1e-10, atol=1e-10)


# -- errors ---------------------------------------------------------------------------------

C128 = torch.complex128
OTHER_MESH = SimpleNamespace(axis_names=("sp",), shape=(4,))  # what Layout reads of a mesh
ERRORS = [  # (transform, global shape, dtype, spec, kwargs, words of the error)
    ("fftn", (4, 6), F64, P("sp"), dict(dim=(0, 2)), "dim 2 is out of range for a 2-d input"),
    ("fft", (4, 6), F64, P("sp"), dict(dim=(0,)), "dim must be an int"),
    ("fftn", (4, 6), F64, P("sp"), dict(dim=(0, -2)), "names a dim twice"),
    ("rfftn", (4, 6), F64, P("sp"), dict(s=(4,), dim=(0, 1)), "s has 1 entries"),
    ("fft2", (4, 6), F64, P("sp"), dict(s=(4, 0)), "every entry of s must be positive"),
    ("rfft", (4, 6), F64, P("sp"), dict(n=0), "n must be a positive int"),
    ("irfft", (4, 1), C128, P("sp"), {}, "over 0 points"),
    ("rfft2", (4, 6), C128, P("sp"), {}, "expects a real input"),
    ("fftn", (4, 6), F64, P("sp"), dict(norm="sum"), "norm must be None"),
    ("fftn", (4, 6), F64, P("dp"), {}, "'dp'"),
    ("fftn", (4, 6, 2), F64, P("a", "b", "c"), {}, "splits 3 of the transformed dims"),
    ("fftn", (4, 6), F64, P("sp"), dict(out_spec=P(None, None, "sp")), "out_spec"),
    ("rfftn", (4, 6), F64, P("sp"), dict(out_spec=Layout((4, 6), P("sp"), OTHER_MESH)),
     "out_spec"),
    ("rfftn", (4, 6), F64, P("sp"), dict(dim=()), "must transform at least one dim"),
    ("fftn", (1, 6), torch.bfloat16, P("sp"), {}, "cannot transform bf16 tensors"),  # 1 empty
]


@pytest.mark.parametrize("name, shape, dtype, spec, kwargs, words", ERRORS)
def test_bad_arguments_raise_one_spec_error_on_every_rank_before_anything_moves(
        name, shape, dtype, spec, kwargs, words):
    fn = getattr(spmd.fft, name)
    mesh_shape, names = ((2, 2, 2), ("a", "b", "c")) if "a" in spec.axes else ((2,), ("sp",))

    def per_rank(mesh):
        try:
            lay = Layout(shape, spec, mesh)
            x = lay.shard(torch.zeros(shape, dtype=dtype), mesh.rank)
        except spmd.SpecError:  # a spec naming an axis the mesh lacks: passed as it is
            lay, x = spec, torch.zeros(shape, dtype=dtype)
        try:
            fn(x, **kwargs, mesh=mesh, spec=lay)
        except spmd.SpecError as e:
            return str(e)
        return None

    with spmd.comm_stats() as stats:
        got = spmd.launch(per_rank, mesh_shape, names, timeout=10)
    assert all(g is not None and words in g for g in got), got
    assert len(set(got)) == 1  # the same words on every rank
    assert stats.calls() == 0  # nothing moved


def test_a_tensor_needs_mesh_and_spec():
    with pytest.raises(TypeError, match="pass mesh= and spec="):
        spmd.fft.fftn(torch.zeros(3))


# -- Sharded ----------------------------------------------------------------------------------

def test_sharded_in_sharded_out_both_views():
    mesh = Mesh((3,), ("sp",))
    x = torch.randn(2, 7, 5, dtype=F64)
    s = spmd.Sharded.from_global(x, mesh, Layout(x.shape, P(None, "sp"), mesh, {1: [1, 6, 0]}))
    y = spmd.fft.rfftn(s, dim=(1, 2))  # the global view: every rank's shard here
    assert y.layout == spmd.fft.rfftn.output_layout(s.layout, dim=(1, 2))
    torch.testing.assert_close(spmd.gather(y, mesh), torch.fft.rfftn(x, dim=(1, 2)))

    def per_rank(mesh):
        local = spmd.Sharded.from_local(s.shards[mesh.rank], mesh, s.layout)
        out = spmd.fft.irfftn(spmd.fft.rfftn(local, dim=(1, 2)), s=(7, 5), dim=(1, 2),
                              out_spec=s.layout)
        return out.layout == s.layout and torch.allclose(out.local, s.shards[mesh.rank])

    assert spmd.launch(per_rank, (3,), ("sp",)) == [True] * 3
