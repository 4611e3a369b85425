"""Reliability item 5: an op's ``spec=`` that disagrees with how shard_map split its
input is refused under SPMD_VALIDATE=1 (it computed halos from the wrong neighbours and
returned wrong values, silently)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import P
from spmd.core.errors import SpecError
from spmd.core.provenance import mark, marked

MESH = spmd.Mesh((2,), ("sp",))
H = P(None, None, "sp")        # split along H
W = P(None, None, None, "sp")  # split along W


def _conv(x, w, in_spec, op_spec):
    f = lambda s: spmd.ops.conv2d(s, w, padding=1, mesh=MESH, spec=op_spec)  # noqa: E731
    return spmd.shard_map(f, MESH, in_spec, op_spec)(x)


@pytest.mark.parametrize("op_spec, claim", [
    (W, r"\[1, 2, 4, 12\] cut along dim 3"),              # the wrong dim
    (P(), r"\[1, 2, 4, 6\] cut along no dim \(replicated\)"),  # a replicated claim
])
def test_a_spec_that_disagrees_with_the_split_raises_under_validation(monkeypatch, op_spec,
                                                                       claim):
    x, w = torch.randn(1, 2, 8, 6), torch.randn(3, 2, 3, 3)
    monkeypatch.setenv("SPMD_VALIDATE", "1")
    with pytest.raises(SpecError, match=r"conv2d: spec=.* describes x as a shard of " + claim
                       + r".*, but x is a shard_map argument split as \[1, 2, 8, 6\] cut along "
                       r"dim 2 over \('sp',\) \(sizes \[4, 4\]\); pass the split it has "
                       r"\(spec=P\(None, None, 'sp'\)"):
        _conv(x, w, H, op_spec)
    # The agreeing spec passes, and is exact.
    torch.testing.assert_close(_conv(x, w, H, H), F.conv2d(x, w, padding=1))


def test_without_validation_nothing_is_marked(monkeypatch):
    monkeypatch.delenv("SPMD_VALIDATE", raising=False)
    seen = []
    spmd.shard_map(lambda s: seen.append(marked(s)) or s, MESH, H, H)(torch.zeros(1, 1, 4, 2))
    assert seen == [None, None]


def test_a_mark_follows_only_its_own_tensor_and_shape():
    lay = spmd.Layout((4, 6), P("sp"), MESH)
    t = mark(torch.zeros(2, 6), lay)
    assert marked(t) == lay and marked(t * 2) is None and marked(t[:1]) is None
    t.resize_(3, 4)  # an in-place reshape: the mark no longer describes it
    assert marked(t) is None
