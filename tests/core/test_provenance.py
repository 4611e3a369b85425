"""An op's ``spec=`` that disagrees with how shard_map split its input is refused (it
would compute halos from the wrong neighbours and return wrong values, silently)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import P
from spmd.core.errors import SpecError
from spmd.core.provenance import mark, marked
from spmd.testing import on_mesh

MESH = spmd.Mesh((2,), ("sp",))
H = P(None, None, "sp")        # split along H
W = P(None, None, None, "sp")  # split along W


def _conv(x, w, in_spec, op_spec):
    f = lambda s: spmd.ops.conv2d(s, w, padding=1, mesh=MESH, spec=op_spec)  # noqa: E731
    return spmd.shard_map(f, MESH, in_spec, op_spec)(x)


@pytest.mark.parametrize("op_spec, claim", [
    (W, r"splits dim 3 over \('sp',\)"),             # the wrong dim
    (P(), r"splits no dim \(replicated\)"),          # a replicated claim
])
def test_a_spec_that_disagrees_with_the_split_raises_under_validation(monkeypatch, op_spec,
                                                                       claim):
    x, w = torch.randn(1, 2, 8, 6), torch.randn(3, 2, 3, 3)
    monkeypatch.setenv("SPMD_VALIDATE", "1")
    # Checked from the spec alone, before the ranks exchange their sizes.
    with pytest.raises(SpecError, match=r"conv2d: spec=P\(.*\) " + claim
                       + r", but x is a shard_map argument split as \[1, 2, 8, 6\] cut along "
                       r"dim 2 over \('sp',\) \(sizes \[4, 4\]\); pass the split it has "
                       r"\(spec=P\(None, None, 'sp'\)"):
        _conv(x, w, H, op_spec)
    # The agreeing spec passes, and is exact.
    torch.testing.assert_close(_conv(x, w, H, H), F.conv2d(x, w, padding=1))


def test_inputs_are_marked_with_default_settings(monkeypatch):
    monkeypatch.delenv("SPMD_VALIDATE", raising=False)
    seen = []
    spmd.shard_map(lambda s: seen.append(marked(s)) or s, MESH, H, H)(torch.zeros(1, 1, 4, 2))
    assert seen == [spmd.Layout((1, 1, 4, 2), H, MESH)] * 2


# Ops that take a P: a spec that contradicts the split of a marked input raises on every
# rank, with default settings; the agreeing spec is exact. Rows split by shard_map (dim 0),
# the op told dim 1 is split: the statistics would merge over the wrong dim.
ROWS, COLS = P("sp"), P(None, "sp")
SPEC_OPS = {
    "reduce": (lambda x, s: spmd.reduce(x, MESH, s, op="sum", dim=1),
               lambda x: x.sum(1), ROWS),
    "softmax": (lambda x, s: spmd.ops.softmax(x, 1, mesh=MESH, spec=s),
                lambda x: torch.softmax(x, 1), ROWS),
    "layer_norm": (lambda x, s: spmd.ops.layer_norm(x, (4,), mesh=MESH, spec=s),
                   lambda x: F.layer_norm(x, (4,)), ROWS),
    "logsumexp": (lambda x, s: spmd.ops.logsumexp(x, 1, mesh=MESH, spec=s),
                  lambda x: torch.logsumexp(x, 1), ROWS),
    "rms_norm": (lambda x, s: spmd.ops.rms_norm(x, (4,), mesh=MESH, spec=s),
                 lambda x: F.rms_norm(x, (4,)), ROWS),
}


@pytest.mark.parametrize("op", sorted(SPEC_OPS))
@pytest.mark.parametrize("op_spec, claim", [
    (COLS, r"splits dim 1 over \('sp',\)"),     # the wrong dim
    (P(), r"splits no dim \(replicated\)"),  # a replicated claim for a split input
])
def test_an_op_spec_that_contradicts_the_split_raises_by_default(monkeypatch, op, op_spec,
                                                                  claim):
    f, ref, out_spec = SPEC_OPS[op]
    x = torch.randn(6, 4, dtype=torch.float64)
    monkeypatch.delenv("SPMD_VALIDATE", raising=False)
    with pytest.raises(SpecError, match=op + r": spec=.* " + claim + r", but x is a shard_map "
                       r"argument split as \[6, 4\] cut along dim 0 over \('sp',\) "
                       r"\(sizes \[3, 3\]\); pass the split it has \(spec=P\('sp'\)"):
        spmd.shard_map(lambda t: f(t, op_spec), MESH, ROWS, out_spec)(x)
    got = spmd.shard_map(lambda t: f(t, ROWS), MESH, ROWS, out_spec)(x)
    torch.testing.assert_close(got, ref(x), rtol=1e-12, atol=1e-12)


def test_a_split_claim_for_a_replicated_input_raises():
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(SpecError, match=r"reduce: spec=P\('sp'\) splits dim 0 over \('sp',\), "
                       r"but x is a shard_map argument split as \[6, 4\] cut along no dim"):
        spmd.shard_map(lambda t: spmd.reduce(t, MESH, P("sp"), dim=0), MESH, P(), P())(x)


def test_sizes_that_contradict_the_split_raise():
    x = torch.randn(6, 4, dtype=torch.float64)
    lay = spmd.Layout((6, 4), ROWS, MESH, sizes={0: (4, 2)})
    # [4, 5]: rank 0's own shape agrees, rank 1's does not; the mark refuses it on both.
    f = lambda t: spmd.reduce(t, MESH, ROWS, op="mean", dim=0, sizes={0: [4, 5]})  # noqa: E731
    with pytest.raises(SpecError, match=r"rank [01]: reduce: sizes \{0: \[4, 5\]\} give dim 0 the "
                       r"shard sizes \[4, 5\], but x is a shard_map argument split as \[6, 4\] "
                       r"cut along dim 0 over \('sp',\) \(sizes \[4, 2\]\)"):
        spmd.shard_map(f, MESH, lay, P())(x)


def test_a_mark_follows_only_its_own_tensor_and_shape():
    lay = spmd.Layout((4, 6), P("sp"), MESH)
    t = mark(torch.zeros(2, 6), lay)
    assert marked(t) == lay and marked(t * 2) is None and marked(t[:1]) is None
    t.resize_(3, 4)  # an in-place reshape: the mark no longer describes it
    assert marked(t) is None


@pytest.mark.parametrize("op", ["reduce", "softmax", "layer_norm"])
def test_a_sparse_tensor_given_to_an_op_is_a_clear_type_error(op):
    f = SPEC_OPS[op][0]
    x = torch.ones(6, 4).to_sparse()
    with pytest.raises(TypeError, match=rf"{op}: x is a sparse tensor \(torch.sparse_coo\); "
                       r"collectives and spmd ops take dense tensors: pass x.to_dense\(\)"):
        spmd.launch(lambda m: f(x, P()), (2,), "sp")


@pytest.mark.parametrize("op, call", [
    ("redistribute: src_spec", lambda t: spmd.redistribute(t, MESH, COLS, P())),
    ("gather", lambda t: spmd.gather(t, MESH, COLS, dst=None)),
])
def test_a_source_spec_that_contradicts_the_split_raises(op, call):
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(SpecError, match=op + r": spec=P\(None, 'sp'\) splits dim 1 over "
                       r"\('sp',\), but x is a shard_map argument split as \[6, 4\] cut along "
                       r"dim 0"):
        spmd.shard_map(call, MESH, ROWS, P())(x)


@on_mesh(2, "sp", backends=("threads", "gloo"))
def test_every_rank_raises_the_same_error_on_every_backend(mesh):
    f = lambda t: spmd.ops.softmax(t, 1, mesh=mesh, spec=COLS)  # noqa: E731
    with pytest.raises(SpecError, match=r"^(rank \d: )?softmax: spec=P\(None, 'sp'\) splits dim 1"):
        spmd.shard_map(f, mesh, ROWS, ROWS)(torch.randn(4, 4))


def test_an_axis_of_one_rank_cuts_nothing():
    """P('sp') and P() lay a tensor out alike over an axis of size 1: neither is refused."""
    mesh = spmd.Mesh((1, 2), ("sp", "dp"))
    x = torch.randn(6, 4, dtype=torch.float64)
    f = lambda t: spmd.reduce(t, mesh, P(None, "dp"), dim=0)  # noqa: E731
    got = spmd.shard_map(f, mesh, P("sp", "dp"), P("dp"))(x)
    torch.testing.assert_close(got, x.sum(0), rtol=1e-12, atol=1e-12)
    # A window op compares whole layouts: the same there.
    w = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    xi = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    g = lambda t: spmd.ops.conv2d(t, w, padding=1, mesh=mesh, spec=P(None, None, "dp"))  # noqa: E731
    got = spmd.shard_map(g, mesh, P("sp", None, "dp"), P(None, None, "dp"))(xi)
    torch.testing.assert_close(got, F.conv2d(xi, w, padding=1), rtol=1e-12, atol=1e-12)
