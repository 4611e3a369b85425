"""spmd.ops.pad: each rank's result is its shard of F.pad on the global tensor, in value
and gradient (float64; pad only moves data, so values match exactly and gradients to
1e-12, where the transpose adds duplicated reflect/replicate contributions in another
order), for every mode, negative pads (crops), uneven and empty shards; the padding sits
on the edge shards, so a constant pad moves nothing and a chain of pads stays consistent.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops import F64
from hypothesis import event, given, settings
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst
from spmd.transforms.halo import check_mode

TOL = dict(rtol=1e-12, atol=1e-12)
MODES = ["constant", "reflect", "replicate", "circular"]


def ref_pad(x, pad, mode, value):
    """F.pad on any tensor: F.pad's non-constant modes want (N, C, *padded dims)."""
    if mode == "constant":
        return F.pad(x, pad, value=value)
    k = len(pad) // 2
    lead = x.shape[:x.ndim - k]
    y = F.pad(x.reshape(1, lead.numel(), *x.shape[x.ndim - k:]), pad, mode=mode)
    return y.reshape(*lead, *y.shape[2:])


@st.composite
def pad_cases(draw):
    ndim = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["1d", "2d"] if ndim >= 2 else ["1d"]))
    if kind == "1d":
        mesh = draw(sst.meshes(4, ndims=1))
        spec = P(*([None] * draw(st.integers(0, ndim - 1))), "sp")
    else:
        mesh = spmd.Mesh((2, 2), ("x", "y"))
        spec = P(*([None] * (ndim - 2)), "x", "y")
    shape = tuple(draw(st.integers(0 if ndim == 1 else 1, 7)) for _ in range(ndim))
    lay = draw(sst.layouts(shape, mesh, spec))
    mode = draw(st.sampled_from(MODES))
    k = draw(st.integers(1, min(ndim, 3) if mode != "constant" else ndim))
    pad = tuple(draw(st.integers(-3, 4)) for _ in range(2 * k))
    return dict(mesh=mesh, lay=lay, pad=pad, mode=mode,
                value=draw(st.sampled_from([None, 1.5])) if mode == "constant" else None,
                by_layout=draw(st.booleans()), seed=draw(st.integers(0, 99)))


def run_pad(c):
    mesh, lay, pad, mode, value = c["mesh"], c["lay"], c["pad"], c["mode"], c["value"]
    x = torch.randn(lay.shape, generator=torch.Generator().manual_seed(c["seed"]), dtype=F64)
    spec = lay if c["by_layout"] else lay.spec
    local = lambda x: spmd.ops.pad(x, pad, mode, value, mesh=mesh, spec=spec)
    glob = lambda x: ref_pad(x, pad, mode, 0.0 if value is None else value)
    k = len(pad) // 2
    if mode != "constant":
        # spmd crops first, then pads what is left; where that is impossible torch's result
        # is ill-defined (uninitialised memory for circular), and spmd refuses
        for i in range(k):
            lo, hi = pad[2 * i], pad[2 * i + 1]
            n = lay.shape[lay.ndim - 1 - i] + min(lo, 0) + min(hi, 0)
            if n == 0:
                event("empty after the crop: torch refuses even a zero pad")
                return None
            if n < 0 or check_mode(n, max(lo, 0), max(hi, 0), mode) is not None:
                event("spmd refuses: nothing to reflect, replicate or wrap after the crop")
                with pytest.raises(RuntimeError):
                    spmd.shard_map(local, mesh, lay, lay.spec)(x)
                return None
    try:
        glob(x)
    except RuntimeError:
        event("torch refuses")
        with pytest.raises(RuntimeError):
            spmd.shard_map(local, mesh, lay, lay.spec)(x)
        return None
    out = spmd.ops.pad.output_layout(lay, pad, mode)
    y = assert_matches_single_device(local, glob, mesh, lay, out, x, seed=c["seed"], **TOL)
    return y, out


@settings(max_examples=300)
@given(c=pad_cases())
def test_pad_matches_single_device(c):
    run_pad(c)


def test_padding_sits_on_the_edge_shards():
    mesh = spmd.Mesh((4,), ("sp",))
    lay = Layout((3, 9), P(None, "sp"), mesh, {1: [2, 0, 4, 3]})
    out = spmd.ops.pad.output_layout(lay, (2, 1))
    assert out.sizes[1] == (4, 0, 4, 4)
    # a crop wider than the edge shard continues into the next ranks
    assert spmd.ops.pad.output_layout(lay, (-3, -4)).sizes[1] == (0, 0, 2, 0)


def test_a_chain_of_pads_on_an_uneven_layout_stays_consistent():
    mesh = spmd.Mesh((3,), ("sp",))
    lay = Layout((2, 1, 8), P(None, None, "sp"), mesh, {2: [1, 6, 1]})
    chain = [((2, 2), "reflect"), ((-3, 1), "constant"), ((1, 3), "circular"), ((0, -2), "replicate")]

    def local(x):
        for p, m in chain:
            x = spmd.ops.pad(x, p, m, mesh=mesh, spec=P(None, None, "sp"))
        return x

    def glob(x):
        for p, m in chain:
            x = ref_pad(x, p, m, 0.0)
        return x

    out = lay
    for p, m in chain:
        out = spmd.ops.pad.output_layout(out, p, m)
    x = torch.randn(2, 1, 8, dtype=F64)
    assert_matches_single_device(local, glob, mesh, lay, out, x, **TOL)


def test_a_constant_pad_moves_no_payload():
    mesh = spmd.Mesh((4,), ("sp",))
    f = lambda x: spmd.ops.pad(x, (1, 2, 3, 1), value=2.0, mesh=mesh, spec=P(None, "sp"))
    lay = Layout((5, 10), P(None, "sp"), mesh)
    with spmd.comm_stats() as stats:
        spmd.shard_map(f, mesh, lay, spmd.ops.pad.output_layout(lay, (1, 2, 3, 1)))(
            torch.randn(5, 10))
    assert stats.bytes("pad") == 0
    assert stats.bytes() == 4 * 2 * 8 * 3  # only the shard sizes (int64 [2]) were exchanged


def test_bad_pads_are_refused_clearly():
    mesh = spmd.Mesh((2,), ("sp",))
    run = lambda **kw: spmd.shard_map(lambda x: spmd.ops.pad(x, mesh=mesh, spec=P("sp"), **kw),
                                      mesh, P("sp"), P("sp"))(torch.randn(4))
    with pytest.raises(spmd.SpecError, match="even number of ints"):
        run(pad=(1,))
    with pytest.raises(spmd.SpecError, match="mode must be one of"):
        run(pad=(1, 1), mode="wrap")
    with pytest.raises(RuntimeError, match="reflect"):
        run(pad=(4, 0), mode="reflect")
