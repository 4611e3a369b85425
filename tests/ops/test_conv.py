"""spmd.ops convolutions: outputs, input gradients and weight/bias gradients equal the
float64 single-device results (tolerance: see tests/_ops.py) for every kernel, stride,
padding, dilation, groups, padding_mode, mesh shape and uneven split; only halo bytes
move; bad input raises the same error on every rank before data moves.
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

MODES = ["zeros", "reflect", "replicate", "circular"]

# torch's own reference warns about 'same' with even kernels; not ours to act on
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")


def _torch_conv(n, w, b, stride, padding, dilation, groups, mode):
    """The single-device reference: nn.ConvNd, or F.pad + conv for (lo, hi) pairs,
    which torch's modules do not take."""
    if isinstance(padding, tuple) and isinstance(padding[0], tuple):
        flat = [p for pair in reversed(padding) for p in pair]
        pmode = "constant" if mode == "zeros" else mode
        conv = getattr(F, f"conv{n}d")
        return lambda x, w, b: conv(F.pad(x, flat, mode=pmode), w, b, stride, 0, dilation, groups)
    cls = getattr(torch.nn, f"Conv{n}d")

    def f(x, w, b):
        m = cls(w.shape[1] * groups, w.shape[0], tuple(w.shape[2:]), stride, padding, dilation,
                groups, bias=b is not None, padding_mode=mode)
        # functional call with the test's tensors, so gradients reach them
        return torch.func.functional_call(m, {"weight": w, **({"bias": b} if b is not None else {})}, (x,))
    return f


@st.composite
def conv_cases(draw, n):
    mesh, spec = mesh_and_spec(draw, n)
    lens = [draw(st.integers(1, 14) if n == 1 else st.integers(2, 9)) for _ in range(n)]
    batch = 2 if "dp" in mesh.axis_names else draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2]))
    c_in, c_out = 2 * groups, draw(st.sampled_from([1, 2])) * groups
    k = tuple(draw(st.integers(1, 5 if n == 1 else 4)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(n))
    kind = draw(st.sampled_from(["int", "tuple", "same", "valid", "pairs"]))
    if kind == "same" and any(s != 1 for s in stride):
        kind = "int"
    padding = {"int": draw(st.integers(0, 3)),
               "tuple": tuple(draw(st.integers(0, 3)) for _ in range(n)),
               "same": "same", "valid": "valid",
               "pairs": tuple((draw(st.integers(0, 3)), draw(st.integers(0, 3))) for _ in range(n))}[kind]
    mode = draw(st.sampled_from(MODES))
    shape = (batch, c_in, *lens)
    lay = draw(sst.layouts(shape, mesh, spec))
    return dict(n=n, mesh=mesh, lay=lay, shape=shape, k=k, stride=stride, dilation=dilation,
                padding=padding, groups=groups, c_out=c_out, mode=mode,
                bias=draw(st.booleans()), by_layout=draw(st.booleans()), seed=draw(st.integers(0, 99)))


def run_conv(c):
    g = torch.Generator().manual_seed(c["seed"])
    n = c["n"]
    x = torch.randn(c["shape"], generator=g, dtype=F64)
    w = torch.randn(c["c_out"], c["shape"][1] // c["groups"], *c["k"], generator=g, dtype=F64)
    params = [w] + ([torch.randn(c["c_out"], generator=g, dtype=F64)] if c["bias"] else [])
    ref = _torch_conv(n, w, None, c["stride"], c["padding"], c["dilation"], c["groups"], c["mode"])
    op = getattr(spmd.ops, f"conv{n}d")
    mesh, lay = c["mesh"], c["lay"]
    spec = lay if c["by_layout"] else lay.spec
    kw = dict(stride=c["stride"], padding=c["padding"], dilation=c["dilation"],
              groups=c["groups"], padding_mode=c["mode"])

    def local(x, w, b=None):
        return op(x, w, b, mesh=mesh, spec=spec, **kw)

    def glob(x, w, b=None):
        return ref(x, w, b)

    return _compare_or_refused(local, glob, mesh, lay, lambda: op.output_layout(lay, w.shape, **kw),
                               x, params, c["seed"])


def _compare_or_refused(local, glob, mesh, lay, out_layout, x, params, seed):
    """assert_matches_single_device, or, where torch refuses the global call, a RuntimeError on every rank."""
    try:
        glob(x, *params)
    except RuntimeError:
        event("torch refuses")
        with pytest.raises(RuntimeError):
            spmd.shard_map(lambda x: local(x, *params), mesh, lay, lay.spec)(x)
        return None
    return assert_matches_single_device(local, glob, mesh, lay, out_layout(), x, params=params,
                                        seed=seed, **TOL)


@settings(max_examples=300)
@given(c=conv_cases(1))
def test_conv1d_matches_single_device(c):
    run_conv(c)


@settings(max_examples=200)
@given(c=conv_cases(2))
def test_conv2d_matches_single_device(c):
    run_conv(c)


# -- transposed convolution ---------------------------------------------------------------------

@st.composite
def convt_cases(draw, n):
    mesh, spec = mesh_and_spec(draw, n)
    lens = [draw(st.integers(1, 12 if n == 1 else 6)) for _ in range(n)]
    batch = 2 if "dp" in mesh.axis_names else 1
    groups = draw(st.sampled_from([1, 2]))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(n))
    out_pad = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    shape = (batch, 2 * groups, *lens)
    return dict(n=n, mesh=mesh, lay=draw(sst.layouts(shape, mesh, spec)), shape=shape,
                k=tuple(draw(st.integers(1, 4)) for _ in range(n)), stride=stride,
                dilation=dilation, padding=tuple(draw(st.integers(0, 3)) for _ in range(n)),
                output_padding=out_pad, groups=groups, c_out=draw(st.sampled_from([1, 3])),
                bias=draw(st.booleans()), by_layout=draw(st.booleans()),
                seed=draw(st.integers(0, 99)))


def run_convt(c):
    g = torch.Generator().manual_seed(c["seed"])
    n = c["n"]
    x = torch.randn(c["shape"], generator=g, dtype=F64)
    w = torch.randn(c["shape"][1], c["c_out"], *c["k"], generator=g, dtype=F64)
    params = [w] + ([torch.randn(c["c_out"] * c["groups"], generator=g, dtype=F64)]
                    if c["bias"] else [])
    op = getattr(spmd.ops, f"conv_transpose{n}d")
    ref = getattr(F, f"conv_transpose{n}d")
    mesh, lay = c["mesh"], c["lay"]
    spec = lay if c["by_layout"] else lay.spec
    kw = dict(stride=c["stride"], padding=c["padding"], output_padding=c["output_padding"],
              groups=c["groups"], dilation=c["dilation"])

    def local(x, w, b=None):
        return op(x, w, b, mesh=mesh, spec=spec, **kw)

    def glob(x, w, b=None):
        return ref(x, w, b, **kw)

    return _compare_or_refused(local, glob, mesh, lay, lambda: op.output_layout(lay, w.shape, **kw),
                               x, params, c["seed"])


@settings(max_examples=300)
@given(c=convt_cases(1))
def test_conv_transpose1d_matches_single_device(c):
    run_convt(c)


@settings(max_examples=150)
@given(c=convt_cases(2))
def test_conv_transpose2d_matches_single_device(c):
    run_convt(c)


def test_conv_transpose3d_and_conv3d_on_a_2d_mesh():
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    for case in [dict(n=3, k=(3, 2, 3), stride=(2, 1, 2), dilation=(1, 2, 1), padding=(1, 0, 1),
                      output_padding=(1, 0, 0), groups=1),
                 dict(n=3, k=(2, 2, 2), stride=(2, 2, 2), dilation=(1, 1, 1), padding=(0, 0, 0),
                      output_padding=(0, 0, 0), groups=2)]:
        shape = (1, 4, 5, 6, 3)
        lay = Layout(shape, P(None, None, "x", "y"), mesh, {2: [1, 4], 3: [6, 0]})
        run_convt(dict(case, mesh=mesh, lay=lay, shape=shape, c_out=2, bias=True,
                       by_layout=False, seed=3))
        run_conv(dict(case, mesh=mesh, lay=lay, shape=shape, c_out=2, bias=True, by_layout=True,
                      seed=4, mode="circular", padding=1))


# -- a grid of 1-D, 2-D and 3-D splits ---------------------------------------------------------------

GRID = [(n, lens, m) for n, lens in [(1, (32,)), (1, (256,)), (2, (64, 64)), (2, (128, 128)),
                                      (3, (16, 16, 16))] for m in ("1d", "2x2") if n > 1 or m == "1d"]


@pytest.mark.parametrize("n,lens,mesh_kind", GRID,
                         ids=[f"conv{n}d-{'x'.join(map(str, s))}-{m}" for n, s, m in GRID])
def test_grid(n, lens, mesh_kind):
    """batch 2, channels 16 -> 8, kernel {2, 3} x stride {1, 2} x padding {0, 1}, split
    over dim 2 on 4 ranks or over dims (2, 3) on a (2, 2) mesh."""
    if mesh_kind == "1d":
        mesh, spec = spmd.Mesh((4,), ("sp",)), P(None, None, "sp")
    else:
        mesh, spec = spmd.Mesh((2, 2), ("x", "y")), P(None, None, "x", "y")
    shape = (2, 16, *lens)
    lay = Layout(shape, spec, mesh)
    for k in (2, 3):
        for stride in (1, 2):
            for padding in (0, 1):
                run_conv(dict(n=n, mesh=mesh, lay=lay, shape=shape, k=(k,) * n,
                              stride=stride, dilation=1, padding=padding, groups=1, c_out=8,
                              mode="zeros", bias=True, by_layout=False, seed=k + stride))


# -- named cases ---------------------------------------------------------------------------------

def _named(L, ranks, k, stride=1, padding=0, mode="zeros", sizes=None, dilation=1):
    mesh = spmd.Mesh((ranks,), ("sp",))
    shape = (2, 3, L)
    lay = Layout(shape, P(None, None, "sp"), mesh, {2: sizes} if sizes else None)
    return run_conv(dict(n=1, mesh=mesh, lay=lay, shape=shape, k=(k,), stride=stride,
                         dilation=dilation, padding=padding, groups=1, c_out=2, mode=mode,
                         bias=True, by_layout=False, seed=5))


def test_length_27_on_4_ranks_k3_s2_p1_gives_14():
    # shard offsets 0, 7, 14, 21 are not all multiples of the stride
    assert _named(27, 4, 3, stride=2, padding=1).shape[-1] == 14


def test_length_27_on_4_ranks_k2_s2_gives_13():
    assert _named(27, 4, 2, stride=2).shape[-1] == 13


def test_8_rows_on_8_ranks_k3_p1_shard_size_1():
    assert _named(8, 8, 3, padding=1).shape[-1] == 8


def test_k5_on_shards_of_size_2_halo_wider_than_a_shard():
    _named(8, 4, 5, padding=2)
    _named(8, 4, 5, padding=2, mode="replicate", dilation=2)


def test_circular_padding_wraps_from_last_to_first_rank():
    _named(10, 4, 3, padding=1, mode="circular")
    _named(10, 4, 5, padding=2, mode="circular", sizes=[1, 4, 4, 1])


def test_reflect_padding_2_with_an_edge_shard_of_size_1():
    _named(10, 4, 5, padding=2, mode="reflect", sizes=[1, 4, 4, 1])
    _named(10, 4, 5, padding=2, mode="reflect", sizes=[4, 4, 1, 1])


def test_zero_size_shards_and_layout_kept_for_stride_1():
    """A stride-1 length-preserving conv keeps the input's (uneven) split: pure halo
    exchange; an empty shard stays empty and still takes part."""
    mesh = spmd.Mesh((4,), ("sp",))
    lay = Layout((1, 2, 9), P(None, None, "sp"), mesh, {2: [0, 6, 0, 3]})
    out = spmd.ops.conv1d.output_layout(lay, (2, 2, 3), padding=1)
    assert out.sizes[2] == (0, 6, 0, 3)
    _named(9, 4, 3, padding=1, sizes=[0, 6, 0, 3])
    # stride 2: the output (5 long) is split by the balanced rule
    assert spmd.ops.conv1d.output_layout(lay, (2, 2, 3), stride=2, padding=1).sizes[2] == (2, 1, 1, 1)


# -- bytes moved -------------------------------------------------------------------------------

@pytest.mark.parametrize("k,stride,padding,sizes", [
    (3, 1, 1, None), (3, 2, 1, None), (5, 1, 2, [2, 9, 1, 4]), (2, 2, 0, [5, 3, 5, 3])])
def test_bytes_moved_equal_the_halo_bytes(k, stride, padding, sizes):
    mesh = spmd.Mesh((4,), ("sp",))
    C, H, W = 3, 16, 5
    lay = Layout((1, C, H, W), P(None, None, "sp"), mesh, {2: sizes} if sizes else None)
    w = torch.randn(2, C, k, k, dtype=F64, requires_grad=True)
    out = spmd.ops.conv2d.output_layout(lay, w.shape, stride=stride, padding=padding)
    f = lambda x: spmd.ops.conv2d(x, w, stride=stride, padding=padding, mesh=mesh, spec=lay)
    x = torch.randn(1, C, H, W, dtype=F64, requires_grad=True)
    with spmd.comm_stats() as stats:
        y = spmd.shard_map(f, mesh, lay, out)(x)
        y.sum().backward()
    assert_only_halo_bytes(
        stats, "conv2d", lay.sizes[2], out.sizes[2],
        lambda o0, o1: (stride * o0 - padding, stride * (o1 - 1) + k - padding), H, C * W * 8)


# -- bad input -----------------------------------------------------------------------------------

def test_torch_refusals_raise_runtime_error_on_every_rank():
    s = P(None, None, "sp")
    cases = {
        "channels": (lambda m: spmd.ops.conv1d(torch.randn(1, 5, 4), torch.randn(2, 2, 3),
                                               groups=2, mesh=m, spec=s), "channels"),
        "groups": (lambda m: spmd.ops.conv1d(torch.randn(1, 4, 4), torch.randn(3, 2, 3),
                                             groups=2, mesh=m, spec=s), "divisible by 2"),
        "kernel": (lambda m: spmd.ops.conv1d(torch.randn(1, 2, 2), torch.randn(2, 2, 7),
                                             padding=1, mesh=m, spec=s), "Kernel size can't"),
        "reflect": (lambda m: spmd.ops.conv1d(torch.randn(1, 2, 2), torch.randn(2, 2, 3),
                                              padding=4, padding_mode="reflect", mesh=m, spec=s),
                    "reflect"),
        "same+stride": (lambda m: spmd.ops.conv1d(torch.randn(1, 2, 4), torch.randn(2, 2, 3),
                                                  stride=2, padding="same", mesh=m, spec=s),
                        "strided"),
    }
    for name, (fn, text) in cases.items():
        got, _ = errors_on_every_rank(fn)
        assert all(t is RuntimeError and text in m for t, m in got), (name, got)


def test_sharded_only_refusals_raise_spec_error_before_any_communication():
    cases = {
        "channel split": (lambda m: spmd.ops.conv2d(torch.randn(1, 2, 4, 4), torch.randn(2, 4, 3, 3),
                                                    mesh=m, spec=P(None, "sp")), "splits dim 1"),
        "unbatched": (lambda m: spmd.ops.conv1d(torch.randn(2, 4), torch.randn(2, 2, 3),
                                                mesh=m, spec=P(None, "sp")), "batched input"),
        "bad mode": (lambda m: spmd.ops.conv1d(torch.randn(1, 2, 4), torch.randn(2, 2, 3),
                                               padding_mode="wrap", mesh=m, spec=P(None, None, "sp")),
                     "padding_mode"),
        "bad axis": (lambda m: spmd.ops.conv1d(torch.randn(1, 2, 4), torch.randn(2, 2, 3),
                                               mesh=m, spec=P(None, None, "tp")), "'tp'"),
    }
    for name, (fn, text) in cases.items():
        got, stats = errors_on_every_rank(fn)
        assert all(t is spmd.SpecError and text in m for t, m in got), (name, got)
        assert stats.calls() == 0, (name, str(stats))


def test_a_layout_that_does_not_fit_the_shard_is_named():
    mesh = spmd.Mesh((2,), ("sp",))
    lay = Layout((1, 2, 8), P(None, None, "sp"), mesh)  # [4, 4], but the shards are [5, 3]
    f = lambda x: spmd.ops.conv1d(x, torch.randn(2, 2, 3), mesh=mesh, spec=lay)
    with pytest.raises(spmd.SpecError, match=r"dim 2 of x has size \d on rank \d but the layout expects 4"):
        spmd.shard_map(f, mesh, Layout((1, 2, 8), P(None, None, "sp"), mesh, {2: [5, 3]}),
                       P(None, None, "sp"))(torch.randn(1, 2, 8))


# -- the halo travels while the shard's own conv runs -----------------------------------------

def _record(monkeypatch, on_rank, label) -> list:
    """The all_to_all starts and waits and the local convs (``label(kind, input)``) of
    the rank for which ``on_rank()`` holds, in order, on a threads mesh."""
    from spmd.comm.threads import ThreadComm
    from spmd.ops import conv as conv_mod

    events = []
    start = ThreadComm.all_to_all_async

    def rec_start(self, chunks, group, *, name, shapes=None):
        work = start(self, chunks, group, name=name, shapes=shapes)
        if not on_rank():
            return work
        events.append(label("send", chunks[1]))

        class Waited:
            def wait(self):
                out = work.wait()
                events.append("wait")
                return out
        return Waited()

    def rec(kind, f):
        def g(*args):
            if on_rank():
                events.append(label(kind, args[0] if kind == "conv" else args[1]))
            return f(*args)
        return g

    monkeypatch.setattr(ThreadComm, "all_to_all_async", rec_start)
    from spmd.ops import framed_conv
    for mod in (conv_mod, framed_conv):  # the window path's local conv and the framed one
        monkeypatch.setattr(mod, "conv_at", rec("conv", framed_conv.conv_at))
        monkeypatch.setattr(mod, "conv_bwd_at", rec("bwd", framed_conv.conv_bwd_at))
    return events


def _rows_label(kind: str, t: torch.Tensor) -> str:
    return kind if kind == "send" else f"{kind}{t.shape[2]}"


def _one_split(monkeypatch, rows, w, **kw) -> tuple[list, list, torch.Tensor]:
    """Forward and backward events of rank 1 of 3, over rows split evenly, and x."""
    events = _record(monkeypatch, lambda: spmd.axis_index("sp") == 1, _rows_label)
    mesh = spmd.Mesh((3,), ("sp",))
    s = P(None, None, "sp")
    x = torch.randn(1, 2, rows, 5, dtype=F64, requires_grad=True)
    y = spmd.shard_map(lambda x: spmd.ops.conv2d(x, w, mesh=mesh, spec=s, **kw), mesh, s, s)(x)
    forward = list(events)
    events.clear()
    y.square().sum().backward()
    torch.testing.assert_close(y, F.conv2d(x.detach(), w.detach(), **kw), **TOL)
    return forward, events, x


def test_the_halo_exchange_overlaps_the_shards_own_conv(monkeypatch):
    """Forward: the halo's all_to_all starts, the shard's conv runs, then the wait and the
    thin halo slabs. Backward: the halo cotangents leave, the shard's conv backward runs,
    then the wait. Recorded on rank 1 of a threads mesh (a middle rank: halo both sides)."""
    w = torch.randn(3, 2, 3, 3, dtype=F64)
    forward, backward, _ = _one_split(monkeypatch, 12, w, padding=1)
    # shard of 4 rows: its own conv on all 4, then each halo row's 1-row slab
    assert forward == ["send", "conv4", "wait", "conv3", "conv3"]
    assert backward == ["bwd3", "bwd3", "send", "bwd4", "wait"]


def _levels_seen(monkeypatch) -> list:
    """How many levels each framed conv had (None: the window path ran), on every rank."""
    from spmd.ops import conv as conv_mod
    seen, plan = [], conv_mod.frame_plan

    def spy(*args):
        fr = plan(*args)
        seen.append(None if fr is None else len(fr.levels))
        return fr
    monkeypatch.setattr(conv_mod, "frame_plan", spy)
    return seen


FRAMED = [  # (n, mesh shape, spec, sizes, mode, groups, c_out, levels)
    (2, (2, 2), P(None, None, "x", "y"), {2: [3, 6], 3: [4, 3]}, "zeros", 1, 3, 2),
    (2, (2, 2), P(None, None, "x", "y"), {2: [1, 8], 3: [2, 5]}, "circular", 2, 4, 2),
    (2, (2, 2), P(None, None, "x", "y"), {2: [5, 4], 3: [6, 1]}, "reflect", 1, 1, 2),
    (2, (2, 2), P(None, None, "y", "x"), {2: [4, 5], 3: [3, 4]}, "replicate", 2, 2, 2),
    (2, (3,), P(None, None, "sp"), {2: [2, 4, 3]}, "circular", 1, 2, 2),  # dim 3 wraps
    (3, (2, 2), P(None, None, "x", None, "y"), {2: [2, 4], 4: [3, 3]}, "circular", 1, 3, 3),
]


@pytest.mark.parametrize("n,mesh_shape,spec,sizes,mode,groups,c_out,levels", FRAMED)
def test_a_conv_padding_along_several_dims_is_framed_level_by_level(
        monkeypatch, n, mesh_shape, spec, sizes, mode, groups, c_out, levels):
    """A 'same'-like conv split along two dims (or along one, with an unsplit circular
    dim fetched too) runs as one frame of two or three levels on every rank: the
    shard's conv, each level's halo on thin slabs, corners from the later level.
    Values and every gradient as one device, for each padding mode, dilation, groups,
    uneven shards and shards narrower than the halo."""
    seen = _levels_seen(monkeypatch)
    mesh = spmd.Mesh(mesh_shape, ("x", "y") if len(mesh_shape) == 2 else ("sp",))
    shape = (2, 2 * groups, *[sum(sizes[d]) if d in sizes else 5 for d in range(2, 2 + n)])
    geometry = (dict(k=(3, 5), dilation=(2, 1), padding=(2, 2)) if n == 2 else
                dict(k=(3, 3, 3), dilation=1, padding=(1, 2, 1)))
    run_conv(dict(n=n, mesh=mesh, lay=Layout(shape, spec, mesh, sizes), shape=shape,
                  stride=1, groups=groups, c_out=c_out * groups, mode=mode, bias=True,
                  by_layout=False, seed=7, **geometry))
    assert set(seen) == {levels}, seen


STRIDED = [  # (mesh shape, spec, sizes, k, levels seen on the ranks: zeros, circular)
    ((3,), P(None, None, "sp"), {2: [6, 6, 6]}, (3, 3), ({1}, {2})),  # circular: W too
    ((2, 2), P(None, None, "x", "y"), {2: [4, 4], 3: [6, 6]}, (3, 3), ({2}, {2})),
    # W: the second half's window starts at its shard and reads 2 rows past it: windowed
    ((2, 2), P(None, None, "x", "y"), {2: [6, 6], 3: [4, 4]}, (5, 4), ({2, None}, {2, None})),
    ((4,), P(None, None, "sp"), {2: [7, 7, 7, 6]}, (3, 3), ({1, None}, {2, None})),  # odd
]


@pytest.mark.parametrize("mesh_shape,spec,sizes,k,levels", STRIDED)
def test_a_strided_conv_on_even_shards_is_framed(monkeypatch, mesh_shape, spec, sizes, k,
                                                 levels):
    """A stride-2 conv whose window starts a padding's width before the shard and whose
    shard, padded alike, gives exactly the rank's output rows (even shards) is framed
    too; where a rank's window reaches further past its shard (odd shards), that rank
    takes the window path, and the two pair their messages. Exact either way."""
    mesh = spmd.Mesh(mesh_shape, ("x", "y") if len(mesh_shape) == 2 else ("sp",))
    shape = (2, 3, sum(sizes[2]), sum(sizes[3]) if 3 in sizes else 5)
    for mode, want in zip(("zeros", "circular"), levels):
        seen = _levels_seen(monkeypatch)
        run_conv(dict(n=2, mesh=mesh, lay=Layout(shape, spec, mesh, sizes), shape=shape, k=k,
                      stride=2, dilation=1, padding=(k[0] // 2, k[1] // 2), groups=1,
                      c_out=2, mode=mode, bias=True, by_layout=False, seed=3))
        monkeypatch.undo()
        assert set(seen) == want, (mode, seen)


def test_ranks_on_the_frame_and_the_window_path_pair_their_messages():
    """An empty shard takes the window path while its peers take the frame: both
    exchange the same rows in the same order, so the results are exact."""
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    shape = (1, 2, 6, 7)
    lay = Layout(shape, P(None, None, "x", "y"), mesh, {2: [0, 6], 3: [4, 3]})
    run_conv(dict(n=2, mesh=mesh, lay=lay, shape=shape, k=(3, 3), stride=1, dilation=1,
                  padding=1, groups=1, c_out=2, mode="circular", bias=False, by_layout=False,
                  seed=1))


def test_each_levels_halo_travels_while_the_shards_conv_or_the_slabs_run(monkeypatch):
    """Two levels (a 2x2 mesh, circular: halos on both sides). Forward: the first halo
    leaves, the shard's conv runs, the wait; the second halo leaves (rows padded along
    the first dim: corners included) while the first level's slabs run; the wait, the
    second level's slabs. Backward: the second level's slabs, its halo home while the
    shard's input gradient and the first level's slabs run, the wait (corners added
    into the first level's halo), the first halo home while the weight gradient runs."""
    shapes = lambda t: "x".join(map(str, t.shape[2:]))  # noqa: E731
    events = _record(monkeypatch, lambda: spmd.axis_index("x") == 0 and spmd.axis_index("y") == 0,
                     lambda kind, t: kind + (shapes(t) if kind == "send" else
                                             f"{t.shape[1]}:{shapes(t)}"))
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    s = P(None, None, "x", "y")
    x = torch.randn(1, 2, 8, 6, dtype=F64, requires_grad=True)
    w = torch.randn(4, 2, 3, 3, dtype=F64, requires_grad=True)
    y = spmd.shard_map(lambda x: spmd.ops.conv2d(x, w, padding=1, padding_mode="circular",
                                                 mesh=mesh, spec=s), mesh, s, s)(x)
    forward = list(events)
    events.clear()
    y.square().sum().backward()
    # shard 4 x 3 (two peers per axis: both wrapped rows go to the one peer); the first
    # halo: 2 rows of 3, the second: 2 columns of 4 + 2 corner rows
    assert forward == ["send2x3", "conv2:4x3", "wait", "send6x2", "conv2:3x3", "conv2:3x3",
                       "wait", "conv2:6x3", "conv2:6x3"]
    assert events == ["bwd2:6x3", "bwd2:6x3", "send6x2", "bwd2:4x3", "bwd2:3x3", "bwd2:3x3",
                      "wait", "send2x3", "bwd2:4x3", "wait"]
    want = F.conv2d(F.pad(x.detach(), (1, 1, 1, 1), mode="circular"), w)
    torch.testing.assert_close(y, want, **TOL)
    gx, gw = torch.autograd.grad(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), w)
                                 .square().sum(), (x, w))
    torch.testing.assert_close(x.grad, gx, **TOL)
    torch.testing.assert_close(w.grad, gw, **TOL)


@pytest.mark.parametrize("stride", [1, 2])  # the framed path and the window path
def test_torch_func_grad_of_a_weight_that_does_not_require_grad(stride):
    """torch.func.grad differentiates a plain tensor: the rule's fwd sees it one level
    down, without requires_grad, so which gradients to make is asked in bwd. (Read in
    fwd, it gave a zero weight gradient, silently.)"""
    mesh = spmd.Mesh((3,), ("sp",), schedule="threads")  # torch.func inside the body
    spec = P(None, None, "sp")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 11, 6, dtype=F64, generator=g)
    w = torch.randn(4, 3, 3, 3, dtype=F64, generator=g)
    b = torch.randn(4, dtype=F64, generator=g)

    def body(x):
        def loss(w, b):
            y = spmd.ops.conv2d(x, w, b, stride=stride, padding=1, mesh=mesh, spec=spec)
            return spmd.psum((y ** 2).sum(), "sp")
        gw, gb = torch.func.grad(loss, argnums=(0, 1))(w, b)
        # every rank differentiates its own copy of the psum'd loss: n times its part
        return spmd.psum(gw, "sp") / mesh.size, spmd.psum(gb, "sp") / mesh.size

    got = spmd.shard_map(body, mesh, in_specs=spec, out_specs=(P(), P()))(x)
    want = torch.func.grad(lambda w, b: (F.conv2d(x, w, b, stride=stride, padding=1) ** 2)
                           .sum(), argnums=(0, 1))(w, b)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)
