"""One ``spec=`` convention (spmd/transforms/spec_arg.py) for every function of spmd.ops
and spmd.reduce: a ``P``, a ``Layout`` (its sizes used, none exchanged), or x as a
``Sharded``; the same checks with the same words everywhere.

Every public op is run on a threads mesh of 4 with uneven sizes, one shard empty, and
compared with the float64 single-device op. Tolerance: spmd.testing's float64 default
(rtol = atol = 1e-10): the sharded run computes the same products as one device and only
reorders additions (partial sums over ranks, halo contributions), a few ulps of float64
for the O(1) values used here.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
import spmd.ops as ops
from spmd import Layout, P, Sharded, SpecError
from spmd.testing import assert_matches_single_device
from spmd.transforms.spec_arg import reduced_layout

F64 = torch.float64
MESH = spmd.Mesh((4,), ("sp",))
SIZES = [5, 0, 3, 2]  # L = 10; rank 1 holds nothing
L = sum(SIZES)
H = P(None, None, "sp")


def _x(*shape):
    return torch.randn(*shape, dtype=F64)


def _same(lay, *args):
    return lay


def _reduced(dims, keepdim=False):
    return lambda lay, *a: reduced_layout(lay, dims, keepdim)


def _attached(op, *args, **kw):
    return lambda lay, *a: op.output_layout(lay, *args, **kw)


def _replicated(lay, *a):
    return P()


def _window(n, name, fn, ref, **kw):
    """A windowed op of ``n`` spatial dims on (2, 3, L, 4, ...) split along L."""
    shape = (2, 3, L) + (4,) * (n - 1)
    return dict(shape=shape, call=lambda x, mesh, spec, cut: fn(x, **kw, mesh=mesh, spec=spec),
                ref=lambda x: ref(x, **kw), out=_attached(getattr(ops, name), **kw))


def _conv(n, transpose):
    name = f"conv_transpose{n}d" if transpose else f"conv{n}d"
    op, ref = getattr(ops, name), getattr(F, name)
    w = _x(*((3, 4) if transpose else (4, 3)), *(3,) * n)
    shape = (2, 3, L) + (4,) * (n - 1)
    return dict(shape=shape,
                call=lambda x, mesh, spec, cut: op(x, w, padding=1, mesh=mesh, spec=spec),
                ref=lambda x: ref(x, w, padding=1),
                out=lambda lay: op.output_layout(lay, w.shape, padding=1))


def _na(n):
    op = getattr(ops, f"neighborhood_attention{n}d")
    shape = (1, L) + (3,) * (n - 1) + (2, 4)  # (B, *spatial, heads, head_dim)
    k, v = _x(*shape), _x(*shape)

    def call(q, mesh, spec, cut):
        # k and v split as q: each rank cuts its block of the global k, v
        kl, vl = (cut.shard(t, mesh.rank) for t in (k, v))
        return op(q, kl, vl, 3, mesh=mesh, spec=spec)
    return dict(shape=shape, spec=P(None, "sp"), call=call,
                ref=lambda q: ops.neighborhood_attention_reference(q, k, v, 3), out=_same)


def _loss(name, classes=False):
    op = getattr(ops, name)
    ref = getattr(F, name)
    shape = (2, 3, L, 4)
    if classes:
        t = torch.randint(0, 3, (2, L, 4))

        def call(x, mesh, spec, cut):
            tl = Layout(t.shape, P(None, "sp"), mesh, {1: cut.sizes[2]}).shard(t, mesh.rank)
            return op(x, tl, mesh=mesh, spec=spec)
        return dict(shape=shape, call=call, ref=lambda x: ref(x, t), out=_replicated)
    tgt = _x(*shape)

    def call(x, mesh, spec, cut):
        return op(x, cut.shard(tgt, mesh.rank), mesh=mesh, spec=spec)
    return dict(shape=shape, call=call, ref=lambda x: ref(x, tgt), out=_replicated)


def _attention(fn):
    shape = (1, 2, L, 4)  # (batch, heads, seq, feat)
    k, v = _x(*shape), _x(*shape)

    def call(q, mesh, spec, cut):
        kl, vl = (cut.shard(t, mesh.rank) for t in (k, v))
        return fn(q, kl, vl, mesh, "sp", seq_dim=2)
    return dict(shape=shape, call=call, ref=lambda q: F.scaled_dot_product_attention(q, k, v),
                out=_same)


def _cases():
    c = {}
    for n in (1, 2, 3):
        c[f"conv{n}d"] = _conv(n, False)
        c[f"conv_transpose{n}d"] = _conv(n, True)
        for kind in ("max", "avg"):
            c[f"{kind}_pool{n}d"] = _window(n, f"{kind}_pool{n}d", getattr(ops, f"{kind}_pool{n}d"),
                                            getattr(F, f"{kind}_pool{n}d"), kernel_size=3,
                                            stride=1, padding=1)
            c[f"adaptive_{kind}_pool{n}d"] = _window(
                n, f"adaptive_{kind}_pool{n}d", getattr(ops, f"adaptive_{kind}_pool{n}d"),
                getattr(F, f"adaptive_{kind}_pool{n}d"), output_size=(4,) * n)
        c[f"neighborhood_attention{n}d"] = _na(n)
    c["pad"] = _window(2, "pad", ops.pad, F.pad, pad=(1, 1, 2, 2), mode="replicate")
    c["interpolate"] = _window(2, "interpolate", ops.interpolate, F.interpolate,
                               scale_factor=2, mode="bilinear")
    x4 = (2, 3, L, 4)
    c["moments"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.moments(
        x, (0, 2, 3), mesh=mesh, spec=spec), ref=lambda x: torch.var_mean(
            x, (0, 2, 3), correction=0)[::-1], out=lambda lay: (P(), P()))
    c["group_norm"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.group_norm(
        x, 3, mesh=mesh, spec=spec), ref=lambda x: F.group_norm(x, 3), out=_same)
    c["layer_norm"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.layer_norm(
        x, (L, 4), mesh=mesh, spec=spec), ref=lambda x: F.layer_norm(x, (L, 4)), out=_same)
    c["rms_norm"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.rms_norm(
        x, (L, 4), mesh=mesh, spec=spec), ref=lambda x: F.rms_norm(x, (L, 4)), out=_same)
    c["instance_norm"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.instance_norm(
        x, mesh=mesh, spec=spec), ref=lambda x: F.instance_norm(x), out=_same)
    c["batch_norm"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.batch_norm(
        x, None, None, training=True, mesh=mesh, spec=spec),
        ref=lambda x: F.batch_norm(x, None, None, training=True), out=_same)
    for name in ("softmax", "log_softmax"):
        c[name] = dict(shape=x4, call=lambda x, mesh, spec, cut, f=getattr(ops, name): f(
            x, 2, mesh=mesh, spec=spec), ref=lambda x, f=getattr(torch, name): f(x, 2),
            out=_same)
    c["logsumexp"] = dict(shape=x4, call=lambda x, mesh, spec, cut: ops.logsumexp(
        x, (2, 3), mesh=mesh, spec=spec), ref=lambda x: torch.logsumexp(x, (2, 3)),
        out=_reduced((2, 3)))
    for name in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"):
        c[name] = _loss(name)
    for name in ("nll_loss", "cross_entropy"):
        c[name] = _loss(name, classes=True)
    c["ring_attention"] = _attention(ops.ring_attention)
    c["head_parallel_attention"] = _attention(ops.head_parallel_attention)
    return c


CASES = _cases()
# Not functions of a split tensor: a permutation, and the single-device reference.
NOT_SHARDED = {"zigzag_order", "neighborhood_attention_reference"}
# They take the split as (axis, seq_dim) and learn the sizes from the shards.
AXIS_ARGS = {"ring_attention", "head_parallel_attention"}


def test_every_op_has_a_case():
    assert set(ops.__all__) == set(CASES) | NOT_SHARDED


def _layout(case, mesh=MESH, sizes=SIZES):
    spec = case.get("spec", H)
    dim = next(d for d, e in enumerate(spec) if e is not None)
    return Layout(case["shape"], spec, mesh, {dim: sizes})


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_layout_with_an_empty_shard_matches_one_device(name):
    case = CASES[name]
    torch.manual_seed(0)
    lay = _layout(case)
    x = _x(*lay.shape)
    spec = P(*lay.spec) if name in AXIS_ARGS else lay
    out = case["out"](lay)
    for o in out if isinstance(out, tuple) else (out,):
        d = lay.split_dims[0]
        if isinstance(o, Layout) and o.ndim == lay.ndim and o.shape[d] == L:
            assert o.sizes[d] == tuple(SIZES)  # a dim that keeps its length keeps its split
    with spmd.comm_stats() as st:
        assert_matches_single_device(lambda t: case["call"](t, MESH, spec, lay), case["ref"], MESH,
                                     lay, case["out"](lay), x)
    # A Layout's sizes are used as given: no collective asks the ranks for theirs.
    if name not in AXIS_ARGS:
        assert not [r for r in st.records if r[0].endswith(" sizes")], st


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_p_matches_one_device(name):
    case = CASES[name]
    torch.manual_seed(1)
    lay = Layout(case["shape"], case.get("spec", H), MESH)
    assert_matches_single_device(lambda t: case["call"](t, MESH, lay.spec, lay), case["ref"], MESH,
                                 lay.spec, case["out"](lay), _x(*lay.shape), check_grad=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_sharded_x_gives_its_layout_and_gets_the_output_layout(name):
    case = CASES[name]
    torch.manual_seed(2)
    lay = _layout(case)
    x = _x(*lay.shape)
    want = case["out"](lay)

    def body(t):
        s = Sharded.from_local(t, MESH, lay)
        y = case["call"](s, MESH, None, lay)
        ys = y if isinstance(y, tuple) else (y,)
        wants = want if isinstance(want, tuple) else (want,)
        for yi, w in zip(ys, wants):
            if isinstance(w, Layout) and w.split_dims:
                assert isinstance(yi, Sharded) and yi.layout == w, (yi, w)
            else:
                assert isinstance(yi, torch.Tensor), yi
        out = tuple(yi.local if isinstance(yi, Sharded) else yi for yi in ys)
        return out if isinstance(y, tuple) else out[0]
    assert_matches_single_device(body, case["ref"], MESH, lay, want, x, check_grad=False)


# -- errors: one wording everywhere ---------------------------------------------------------

REPRESENTATIVE = ["conv2d", "max_pool1d", "interpolate", "pad", "softmax", "logsumexp",
                  "layer_norm", "group_norm", "mse_loss", "neighborhood_attention1d"]


def _raise_on_every_rank(call):
    """Run ``call(mesh, rank)`` on each rank of a threads mesh of 4; each rank's message."""
    def per_rank(mesh):
        try:
            call(mesh)
        except SpecError as e:
            return str(e)
        return None
    return spmd.launch(per_rank, (4,), ("sp",), timeout=10)


@pytest.mark.parametrize("name", sorted(set(REPRESENTATIVE) - {"neighborhood_attention1d"}))
def test_a_shard_of_the_wrong_size_names_dim_sizes_and_fix(name):
    """Only rank 2 can see it; it raises before any message and launch cancels the
    others."""
    case = CASES[name]

    def call(mesh):
        lay = _layout(case, mesh)
        d = lay.split_dims[0]
        shape = list(lay.local_shape(mesh.rank))
        if mesh.rank == 2:
            shape[d] = 4  # the layout says 3
        case["call"](_x(*shape), mesh, lay, lay)
    d = _layout(case).split_dims[0]
    with pytest.raises(SpecError) as e:
        spmd.launch(call, (4,), ("sp",), timeout=10)
    assert str(e.value) == (f"rank 2: {name}: dim {d} of x has size 4 on rank 2 but the layout "
                            f"expects 3 over axis 'sp' (sizes [5, 0, 3, 2]); pass sizes=... or "
                            f"reshard first")


@pytest.mark.parametrize("name", REPRESENTATIVE)
@pytest.mark.parametrize("bad, words", [
    (P(None, None, "tp"), "{name}: spec: 'tp' is not an axis of {mesh}; its axes "
                          "are ['sp']"),
    ("long", "{name}: spec {spec} has {k} entries but x ({x}) has {n} dims; a spec may leave "
             "out trailing dims but not add dims"),
    ("other mesh", "{name}: the layout is for a mesh {{'sp': 2}} but the call runs on "
                   "{mesh}"),
])
def test_bad_specs_raise_the_same_words_on_every_rank(name, bad, words):
    case = CASES[name]
    shape = case["shape"]

    def call(mesh):
        lay = _layout(case, mesh)
        x = _x(*lay.local_shape(mesh.rank))
        spec = {"long": P(*([None] * len(shape)), "sp"),
                "other mesh": Layout(shape, lay.spec, spmd.Mesh((2,), ("sp",)))}.get(bad, bad)
        if name.startswith("neighborhood") and bad == P(None, None, "tp"):
            spec = P(None, "tp")
        case["call"](x, mesh, spec, lay)
    got = _raise_on_every_rank(call)
    lay = _layout(case)
    xs = [spmd.core._format.describe(torch.zeros(lay.local_shape(r), dtype=F64))
          for r in range(4)]
    for r in range(4):
        assert got[r] == words.format(name=name, mesh=MESH, spec=P(*([None] * len(shape)), "sp"),
                                      k=len(shape) + 1, n=len(shape), x=xs[r]), got[r]


def test_a_sharded_with_a_disagreeing_spec_is_refused():
    def call(mesh):
        lay = Layout((2, 3, L, 4), H, mesh, {2: SIZES})
        s = Sharded.from_local(_x(*lay.local_shape(mesh.rank)), mesh, lay)
        for agrees in (H, lay):  # a spec that describes it is fine
            assert ops.softmax(s, 2, mesh=mesh, spec=agrees).layout == lay
        ops.softmax(s, 2, mesh=mesh, spec=P(None, None, None, "sp"))
    got = _raise_on_every_rank(call)
    assert all(m.startswith("softmax: spec P(None, None, None, 'sp') does not describe "
                            "Sharded(f64[2, 3, 10, 4], P(None, None, 'sp'), sp=[5, 0, 3, 2]")
               and m.endswith("omit it (a Sharded knows its layout)") for m in got), got


@pytest.mark.parametrize("sizes, words", [
    ({2: [5, 0, 3]}, "sizes for dim 2 has 3 entries but axis 'sp' has 4 shards; give one size "
                     "per shard"),
    ({2: [5, 0, 3, 3]}, "dim 2 has size 10 but the sizes [5, 0, 3, 3] over axis 'sp' add up "
                        "to 11"),
])
def test_a_layout_whose_sizes_do_not_fit_is_refused_where_it_is_built(sizes, words):
    with pytest.raises(SpecError) as e:
        Layout((2, 3, L, 4), H, MESH, sizes)
    assert str(e.value) == words


def test_reduce_takes_a_layout_and_a_sharded():
    lay = Layout((L, 3), P("sp"), MESH, {0: SIZES})
    x = _x(L, 3)

    def body(t):
        with spmd.comm_stats() as st:
            a = spmd.reduce(t, MESH, lay, op="mean", dim=0)
        s = spmd.reduce(Sharded.from_local(t, MESH, lay), MESH, op="sum", dim=1)
        assert isinstance(s, Sharded) and s.layout == Layout((L,), P("sp"), MESH, {0: SIZES})
        # the count is known from the Layout: one all-reduce of output size, nothing else
        return a, s.local, torch.tensor(st.calls(rank=MESH.rank))
    row = Layout((L,), P("sp"), MESH, {0: SIZES})
    a, s, calls = spmd.shard_map(body, MESH, lay, (P(), row, P()))(x)
    torch.testing.assert_close(a, x.mean(0))
    torch.testing.assert_close(s, x.sum(1))
    assert calls.item() == 1


def test_a_loss_without_reduction_keeps_the_split_of_a_sharded_input():
    lay = Layout((2, 3, L, 4), H, MESH, {2: SIZES})
    x, t = _x(*lay.shape), _x(*lay.shape)

    def body(a, b):
        y = ops.mse_loss(Sharded.from_local(a, MESH, lay), Sharded.from_local(b, MESH, lay),
                         reduction="none")
        assert isinstance(y, Sharded) and y.layout == lay
        return y.local
    y = spmd.shard_map(body, MESH, (lay, lay), lay)(x, t)
    torch.testing.assert_close(y, F.mse_loss(x, t, reduction="none"))


def test_scatter_gather_and_redistribute_take_a_layout_for_spec_and_sizes():
    cols = Layout((L, 4), P(None, "sp"), MESH, {1: [0, 2, 1, 1]})
    x = _x(L, 4)
    lay4 = Layout((L, 4), P("sp"), MESH, {0: SIZES})

    def per_rank(mesh):
        s = spmd.scatter(x if mesh.rank == 0 else None, mesh, lay4, src=0)
        assert torch.equal(s, lay4.shard(x, mesh.rank))
        c = spmd.redistribute(s, mesh, lay4, cols)
        assert torch.equal(c, cols.shard(x, mesh.rank))
        g = spmd.gather(c, mesh, cols, dst=None)
        with pytest.raises(SpecError, match=r"^gather: spec is a Layout, which holds the "
                                            r"sizes; leave sizes= out$"):
            spmd.gather(c, mesh, cols, sizes={1: [0, 2, 1, 1]})
        return g
    for g in spmd.launch(per_rank, (4,), ("sp",)):
        assert torch.equal(g, x)


def test_a_sharded_seen_from_outside_the_ranks_says_where_to_call_the_op():
    s = Sharded.from_global(_x(L, 3), MESH, P("sp"))
    with pytest.raises(SpecError) as e:
        ops.softmax(s, 0)
    assert str(e.value) == (
        "softmax: Sharded(f64[10, 3], P('sp'), sp=[3, 3, 2, 2], shards on ranks [0, 1, 2, 3]) "
        "is seen from outside the ranks of its threads mesh; call softmax in per-rank code (a "
        "spmd.shard_map body, which gets the shard, or a spmd.launch function, with "
        "Sharded.from_local)")


@pytest.mark.parametrize("fn", [ops.ring_attention, ops.head_parallel_attention])
def test_a_sharded_split_elsewhere_than_seq_dim_is_refused_by_the_attentions(fn):
    def call(mesh):
        lay = Layout((1, 2, L, 4), P(None, None, None, "sp"), mesh)
        q = Sharded.from_local(_x(*lay.local_shape(mesh.rank)), mesh, lay)
        fn(q, q.local, q.local, mesh, "sp", seq_dim=2)
    got = _raise_on_every_rank(call)
    assert got == [f"{fn.__name__}: the Sharded is split as P(None, None, None, 'sp'), but "
                   f"axis='sp' and seq_dim=2 split dim 2 only; redistribute it first"] * 4
