"""spmd.ops.interpolate: outputs and input gradients equal the float64 single-device
``F.interpolate`` (tolerance: see tests/_ops.py; the weighted sums are ordered differently
from ATen's kernels) for every mode, size, scale factor, align_corners, mesh shape and
uneven split; only the rows each rank's output reads move; what torch refuses raises the
same error type on every rank before data moves.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops import F64, TOL, errors_on_every_rank, mesh_and_spec, spatial_layout
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import spmd
from spmd import Layout, P
from spmd.testing import assert_matches_single_device

interpolate = spmd.ops.interpolate
MODES = {1: ["nearest", "nearest-exact", "linear"],
         2: ["nearest", "nearest-exact", "bilinear", "bicubic"],
         3: ["nearest", "nearest-exact", "trilinear"]}
SCALES = [0.5, 0.6, 0.75, 1.0, 1.1, 1.3, 1.5, 2.0, 2.1, 2.5, 3.0, 1 / 3, 2, 3]


@st.composite
def cases(draw, n):
    mesh, spec = mesh_and_spec(draw, n, channels=True)
    lens = [draw(st.integers(1, 12 if n == 1 else 6 if n == 2 else 4)) for _ in range(n)]
    shape = (2, 2, *lens)
    mode = draw(st.sampled_from(MODES[n]))
    kw = dict(mode=mode)
    how = draw(st.sampled_from(["scale", "scales", "size", "sizes"]))
    if how == "scale":
        kw["scale_factor"] = draw(st.sampled_from(SCALES))
    elif how == "scales":
        kw["scale_factor"] = tuple(draw(st.sampled_from(SCALES)) for _ in range(n))
    elif how == "size":
        kw["size"] = draw(st.integers(1, 2 * min(lens) + 2))
    else:
        kw["size"] = tuple(draw(st.integers(1, 2 * v + 2)) for v in lens)
    if how.startswith("scale"):
        kw["recompute_scale_factor"] = draw(st.sampled_from([None, False, True]))
    if mode not in ("nearest", "nearest-exact"):
        kw["align_corners"] = draw(st.sampled_from([None, False, True]))
    return dict(mesh=mesh, lay=spatial_layout(draw, shape, mesh, spec), shape=shape, kw=kw,
                by_layout=draw(st.booleans()), seed=draw(st.integers(0, 99)))


def _refused_on_every_rank(c, x, want: type) -> None:
    mesh, lay = c["mesh"], c["lay"]

    def per_rank(m):
        spec = Layout(lay.shape, lay.spec, m, {d: s for d, s in enumerate(lay.sizes) if s})
        try:
            interpolate(lay.shard(x, m.rank), mesh=m, spec=spec if c["by_layout"] else lay.spec,
                        **c["kw"])
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            return type(e)
        return None
    got = spmd.launch(per_rank, mesh.shape, mesh.axis_names, timeout=10)
    assert got == [want] * mesh.size, got


def _event(what: str) -> None:
    try:
        event(what)
    except InvalidArgument:  # a named case, not a hypothesis example
        pass


def run_interp(c):
    x = torch.randn(c["shape"], generator=torch.Generator().manual_seed(c["seed"]), dtype=F64)
    mesh, lay, kw = c["mesh"], c["lay"], c["kw"]
    spec = lay if c["by_layout"] else lay.spec
    try:
        F.interpolate(x, **kw)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        _event("torch refuses")
        _refused_on_every_rank(c, x, type(e))
        return None
    local = lambda x: interpolate(x, mesh=mesh, spec=spec, **kw)
    glob = lambda x: F.interpolate(x, **kw)
    out_lay = interpolate.output_layout(lay, **kw)
    try:
        return assert_matches_single_device(local, glob, mesh, lay, out_lay, x, seed=c["seed"], **TOL)
    except AssertionError as e:
        if "gradient of args[0]" not in str(e):
            raise
    # Torch's backward kernel special-cases what its forward does not (see the module
    # docstring of spmd/ops/interpolate.py): fine only if torch's gradient is not the
    # transpose of its forward and ours is.
    _event("torch's backward is not its forward's transpose")
    xt = x.detach().clone().requires_grad_(True)
    assert not _is_transpose(glob, xt, glob(xt))
    xa = x.detach().clone().requires_grad_(True)
    assert _is_transpose(glob, xa, spmd.shard_map(local, mesh, lay, out_lay)(xa))
    return None


def _is_transpose(glob, x, y) -> bool:
    """Whether backprop from ``y = f(x)`` gives ``J^T w`` for the ``J`` of torch's
    forward ``glob``: ``<J e, w> == <e, J^T w>`` for random probes ``e``."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(y.shape, generator=g, dtype=F64)
    (y * w).sum().backward()
    probes = [torch.randn(x.shape, generator=g, dtype=F64) for _ in range(3)]
    return all(torch.allclose((glob(e) * w).sum(), (e * x.grad).sum(), **TOL) for e in probes)


@settings(max_examples=150)
@given(c=cases(1))
def test_interpolate_1d_matches_single_device(c):
    run_interp(c)


@settings(max_examples=150)
@given(c=cases(2))
def test_interpolate_2d_matches_single_device(c):
    run_interp(c)


@settings(max_examples=60)
@given(c=cases(3))
def test_interpolate_3d_matches_single_device(c):
    run_interp(c)


# -- named cases ---------------------------------------------------------------------------------

def _case(shape, mesh, spec, sizes=None, by_layout=False, seed=3, **kw):
    lay = Layout(shape, spec, mesh, sizes)
    return run_interp(dict(mesh=mesh, lay=lay, shape=shape, kw=kw, by_layout=by_layout,
                           seed=seed))


def test_bilinear_x2_on_4_ranks_with_uneven_shards():
    mesh = spmd.Mesh((4,), ("sp",))
    for ac in (False, True):
        y = _case((1, 2, 11, 5), mesh, P(None, None, "sp"), {2: [5, 1, 0, 5]},
                  scale_factor=2, mode="bilinear", align_corners=ac)
        assert y.shape == (1, 2, 22, 10)


def test_fractional_scales_1_5_and_0_6():
    mesh = spmd.Mesh((3,), ("sp",))
    for mode in MODES[2]:
        kw = dict(align_corners=False) if mode in ("bilinear", "bicubic") else {}
        y = _case((1, 1, 10, 7), mesh, P(None, None, "sp"), {2: [2, 5, 3]},
                  scale_factor=(1.5, 0.6), mode=mode, **kw)
        assert y.shape == (1, 1, 15, 4)
        _case((1, 1, 10, 7), mesh, P(None, None, None, "sp"), scale_factor=(0.6, 1.5),
              mode=mode, recompute_scale_factor=True, **kw)


def test_align_corners_on_a_size_1_shard():
    mesh = spmd.Mesh((4,), ("sp",))
    for mode, shape in (("linear", (2, 2, 6)), ("bilinear", (2, 2, 6, 3)),
                        ("bicubic", (2, 2, 6, 3))):
        _case(shape, mesh, P(None, None, "sp"), {2: [1, 1, 3, 1]}, size=(13, 4)[:len(shape) - 2],
              mode=mode, align_corners=True)
    # an output of one row: torch's scale is 0 with align_corners, every rank reads row 0
    _case((1, 2, 7), mesh, P(None, None, "sp"), size=1, mode="linear", align_corners=True)


def test_bicubic_reads_clamped_taps_at_the_global_boundary():
    """Bicubic taps reach 2 rows past the source index and are clamped to [0, L-1]:
    the edge ranks must clamp to the global edge, not their shard's."""
    mesh = spmd.Mesh((4,), ("sp",))
    for sizes in ([1, 3, 3, 1], [2, 2, 2, 2], [0, 4, 4, 0]):
        for ac in (False, True):
            _case((1, 2, 8, 3), mesh, P(None, None, "sp"), {2: sizes}, scale_factor=(2.5, 1),
                  mode="bicubic", align_corners=ac)
            _case((1, 2, 8, 3), mesh, P(None, None, "sp"), {2: sizes}, size=(3, 3),
                  mode="bicubic", align_corners=ac)


def test_trilinear_on_a_2x2_mesh():
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    spec = P(None, None, "x", None, "y")
    _case((1, 2, 5, 3, 6), mesh, spec, {2: [1, 4], 4: [6, 0]}, scale_factor=(2, 1.5, 0.5),
          mode="trilinear")
    _case((2, 1, 4, 4, 4), mesh, spec, size=(7, 2, 9), mode="trilinear", align_corners=True,
          by_layout=True)


def test_nearest_same_size_is_a_copy_and_keeps_the_split():
    mesh = spmd.Mesh((3,), ("sp",))
    lay = Layout((1, 2, 7, 4), P(None, None, "sp"), mesh, {2: [0, 5, 2]})
    assert interpolate.output_layout(lay, size=(7, 8)).sizes[2] == (0, 5, 2)
    with spmd.comm_stats() as stats:
        _case((1, 2, 7, 4), mesh, P(None, None, "sp"), {2: [0, 5, 2]}, size=(7, 8),
              by_layout=True)
    assert stats.calls("interpolate") == 0


def test_torch_backward_special_cases_do_not_leak_into_ours():
    """F.interpolate(mode='nearest', scale_factor=1.1) on 5 rows gives 5 rows from
    floor(o / 1.1) on a 3-d input; torch's backward copies instead (same size), and its
    bicubic backward copies when no size changes. Ours is the transpose of the forward
    (run_interp checks it by probes where torch's is not)."""
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(1, 1, 5, dtype=F64, requires_grad=True)
    assert not _is_transpose(lambda x: F.interpolate(x, scale_factor=1.1), x,
                             F.interpolate(x, scale_factor=1.1))
    _case((1, 1, 5), mesh, P(None, None, "sp"), scale_factor=1.1, mode="nearest")
    _case((1, 1, 5, 4, 3), mesh, P(None, None, "sp"), scale_factor=(1.1, 2.1, 1),
          mode="nearest")
    _case((1, 1, 5, 4), mesh, P(None, None, "sp"), scale_factor=1.1, mode="bicubic")
    # on 4-d inputs torch's nearest forward uses the same float32 rule as its backward
    _case((1, 1, 5, 4), mesh, P(None, None, "sp"), scale_factor=(1.1, 2.1), mode="nearest")


# -- bytes moved -------------------------------------------------------------------------------

def _support_rows(M, in_sizes, out_sizes):
    """Rows each rank lacks: the hull of the input rows its output rows depend on
    (the nonzero columns of torch's own interpolation matrix ``M``, out x in), minus
    its shard."""
    rows, start, o0 = [], 0, 0
    for s, m in zip(in_sizes, out_sizes):
        used = M[o0:o0 + m].abs().sum(0).nonzero().flatten()
        if len(used) == 0:
            rows.append(0)
        else:
            a, b = int(used.min()), int(used.max()) + 1
            rows.append(b - a - max(min(b, start + s) - max(a, start), 0))
        start, o0 = start + s, o0 + m
    return rows


@pytest.mark.parametrize("mode,scale,sizes,zero", [
    ("nearest", 2, None, True), ("nearest", 2, [2, 1, 3, 2], False),
    ("bilinear", 2, None, False), ("bilinear", 2, [5, 0, 1, 2], False),
    ("bicubic", 1.5, [3, 3, 1, 1], False), ("nearest-exact", 0.6, None, False),
    ("bilinear", 0.5, [1, 4, 2, 1], False)])
def test_bytes_moved_are_the_rows_the_output_reads(mode, scale, sizes, zero):
    mesh = spmd.Mesh((4,), ("sp",))
    C, H, W = 3, 8, 5
    lay = Layout((1, C, H, W), P(None, None, "sp"), mesh, {2: sizes} if sizes else None)
    kw = dict(scale_factor=scale, mode=mode)
    out = interpolate.output_layout(lay, **kw)
    f = lambda x: interpolate(x, mesh=mesh, spec=lay, **kw)
    x = torch.randn(1, C, H, W, dtype=F64, requires_grad=True)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(f, mesh, lay, out)(x)
        y.sum().backward()
    # torch's matrix along H, from an (H, 1) image of each unit vector
    M = F.interpolate(torch.eye(H, dtype=F64).view(H, 1, H, 1), scale_factor=(scale, 1),
                      mode=mode)[:, 0, :, 0].T
    rows = _support_rows(M, lay.sizes[2], out.sizes[2])
    w_fetched = W if scale >= 1 else out.shape[3]  # growing dims are fetched before applied
    want = sum(rows) * C * w_fetched * 8
    assert (want == 0) == zero
    assert stats.bytes("interpolate", pass_="forward") == want
    assert stats.bytes("interpolate", pass_="backward") == want  # the transpose sends them back
    # one exchange per rank and pass (no size exchange), none where every rank reads
    # only its own rows
    assert stats.calls() == (0 if zero else 2 * 4)
    assert stats.bytes() == 2 * want


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,kw", [
    ((1, 2, 4), dict(size=3, scale_factor=2)),
    ((1, 2, 4), dict(size=3, align_corners=True)),
    ((1, 2, 4), dict(size=3, mode="nearest-exact", align_corners=False)),
    ((1, 2, 4), dict(scale_factor=2, mode="bilinear")),
    ((1, 2, 4, 4), dict(scale_factor=2, mode="linear")),
    ((1, 2, 4, 4), dict(scale_factor=2, mode="trilinear")),
    ((1, 2, 4, 4, 4), dict(scale_factor=2, mode="bicubic")),
    ((1, 2, 4), dict(scale_factor=2, mode="cubic")),
    ((2, 4), dict(scale_factor=2)),
    ((1, 2, 4), dict(size=(3, 3))),
    ((1, 2, 4, 4), dict(scale_factor=(2, 2, 2))),
    ((1, 2, 4), dict(size=2.5)),
    ((1, 2, 4), dict()),
    ((1, 2, 4), dict(size=3, recompute_scale_factor=True)),
    ((1, 2, 4), dict(scale_factor=2, antialias=True, mode="linear")),
    ((1, 2, 4, 4), dict(size=2, mode="lanczos")),
])
def test_argument_refusals_match_torch_on_every_rank_before_any_communication(shape, kw):
    with pytest.raises(Exception) as ref:
        F.interpolate(torch.randn(shape), **kw)
    spec = P(*([None] * (len(shape) - 1)), "sp")
    got, stats = errors_on_every_rank(
        lambda m: interpolate(torch.randn(shape), mesh=m, spec=spec, **kw))
    assert [t for t, _ in got] == [ref.type] * 2, (got, ref.value)
    assert stats.calls() == 0, str(stats)


def test_global_size_refusals_raise_runtime_error_on_every_rank():
    """An empty output (scale 0.1 on 5 rows split 3 + 2) depends on the global size."""
    for shape, kw in [((1, 2, 5), dict(scale_factor=0.1)), ((1, 2, 5), dict(size=0)),
                      ((1, 0, 4), dict(size=3))]:
        with pytest.raises(RuntimeError):
            F.interpolate(torch.randn(shape), **kw)
        local = torch.randn(shape[:2] + (3,)), torch.randn(shape[:2] + (shape[2] - 3,))
        got, stats = errors_on_every_rank(
            lambda m, local=local, kw=kw: interpolate(local[m.rank], mesh=m,
                                                      spec=P(None, None, "sp"), **kw))
        assert all(t is RuntimeError for t, _ in got), got
        assert stats.calls("interpolate") == 0  # only the sizes were exchanged


def test_what_torch_accepts_but_we_do_not_is_not_implemented():
    cases = [((1, 2, 4, 4), dict(size=2, mode="area")),
             ((1, 2, 4, 4), dict(size=6, mode="bilinear", antialias=True)),
             ((1, 2, 4, 4), dict(size=6, mode="bicubic", antialias=True))]
    for shape, kw in cases:
        F.interpolate(torch.randn(shape), **kw)
        got, _ = errors_on_every_rank(
            lambda m, shape=shape, kw=kw: interpolate(torch.randn(shape), mesh=m,
                                                      spec=P(None, None, "sp"), **kw))
        assert all(t is NotImplementedError for t, _ in got), got
    with pytest.raises(NotImplementedError, match="floating dtype"):
        interpolate(torch.zeros(1, 1, 4, dtype=torch.uint8), scale_factor=2, mode="linear",
                    mesh=spmd.Mesh((1,), ("sp",)), spec=P())


def test_float32_and_bfloat16_are_close_to_torch():
    mesh = spmd.Mesh((3,), ("sp",))
    s = P(None, None, "sp")
    x = torch.randn(1, 2, 9, 4)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        f = lambda x: interpolate(x, scale_factor=1.7, mode="bicubic", mesh=mesh, spec=s)
        out = interpolate.output_layout(Layout(x.shape, s, mesh), scale_factor=1.7,
                                        mode="bicubic")
        y = spmd.shard_map(f, mesh, s, out)(x.to(dtype))
        assert y.dtype == dtype
        ref = F.interpolate(x.to(dtype).float(), scale_factor=1.7, mode="bicubic")
        torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
