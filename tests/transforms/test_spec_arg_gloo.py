"""The one ``spec=`` convention on real gloo processes (world 2): a ``Layout`` with an
empty shard and a ``Sharded`` input, against float64 on one device (tolerance: the
toolkit's float64 default, as in test_spec_arg.py). Per-rank functions are module-level
so spawned workers can import them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Layout, P, Sharded
from spmd.testing import assert_matches_single_device

pytestmark = pytest.mark.gloo


def _per_rank(mesh):
    torch.manual_seed(0)  # the same global tensors on both processes
    x = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    lay = Layout(x.shape, P(None, None, "sp"), mesh, {2: [0, 6]})  # rank 0 holds nothing
    out = spmd.ops.conv2d.output_layout(lay, w.shape, padding=1)
    with spmd.comm_stats() as st:
        assert_matches_single_device(
            lambda t: spmd.ops.conv2d(t, w, padding=1, mesh=mesh, spec=lay),
            lambda t: F.conv2d(t, w, padding=1), mesh, lay, out, x)
        assert_matches_single_device(
            lambda t: spmd.ops.layer_norm(t, (6, 4), mesh=mesh, spec=lay),
            lambda t: F.layer_norm(t, (6, 4)), mesh, lay, lay, x)
    assert not [r for r in st.records if r[0].endswith(" sizes")]
    s = Sharded.from_local(lay.shard(x, mesh.rank), mesh, lay)
    y = spmd.ops.softmax(s, 2)
    assert isinstance(y, Sharded) and y.layout == lay
    torch.testing.assert_close(y.local, lay.shard(torch.softmax(x, 2), mesh.rank))
    m = spmd.reduce(s, mesh, op="mean", dim=(2, 3))
    torch.testing.assert_close(m, x.mean((2, 3)))
    return True


def test_a_layout_and_a_sharded_on_gloo(gloo2):
    assert gloo2.run(_per_rank, (2,), ("sp",)) == [True, True]
