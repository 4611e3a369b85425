"""What a converted U-Net keeps for backward, per rank: at most what one device keeps
divided by P, plus the halo rows its halo'd layers receive. Counted with
``torch.autograd.graph.saved_tensors_hooks`` (thread-local: installed inside the
shard_map body, on each rank thread), by unique storage (a tensor saved by two nodes
counts once, on one device as on a rank), without the parameters (every rank keeps
the replicated weights whole) and the caller's input (held by the caller either way; on
the threads mesh a rank's shard is a view of it), and without the meta tensors of
convert's plan. Deterministic: no timing, no allocator statistics.
"""
from __future__ import annotations

import pytest
import torch
from test_unet import TinyUNet  # the U-Net of the training tests

import spmd
from spmd import P
from spmd.testing.memory import SavedBytes

SPEC = P(None, None, "sp")


def _halo_allowance(n: int, c: int, w: int, elem: int) -> int:
    """The rows a rank receives (2 per 3x3 conv or bilinear upsample: one from each
    neighbour) times each layer's row bytes, for TinyUNet(c) on an input of width w:
    enc1 conv (1 channel, w), enc2 conv (c, w/2), upsample (2c, w/2), dec conv (3c, w)."""
    rows = [(1, w), (c, w // 2), (2 * c, w // 2), (3 * c, w)]
    return sum(2 * n * ch * width * elem for ch, width in rows)


@pytest.mark.parametrize("norm", [None, "group"])  # GroupNorm: convert's spmd.ops.group_norm
@pytest.mark.parametrize("ranks", [2, 4])
def test_converted_unet_saves_one_device_bytes_over_p_plus_halos(ranks, norm):
    n, h, w = 2, 64, 24
    torch.manual_seed(0)
    model = TinyUNet(c=3, norm=norm).double()
    x = torch.randn(n, 1, h, w, dtype=torch.float64, requires_grad=True)
    params = list(model.parameters())
    with SavedBytes([*params, x]) as one:
        model(x).sum().backward()
    mesh = spmd.Mesh((ranks,), ("sp",))
    sharded = spmd.nn.convert(model, mesh, SPEC)
    per_rank: dict[int, int] = {}

    def body(t):
        with SavedBytes([*sharded.parameters(), x]) as saved:
            y = sharded(t)
        per_rank[spmd.axis_index("sp")] = saved.total
        return spmd.psum(y.sum(), "sp")

    spmd.shard_map(body, mesh, SPEC, P())(x).backward()
    bound = one.total / ranks + _halo_allowance(n, 3, w, 8)
    assert set(per_rank) == set(range(ranks))
    for r, got in per_rank.items():
        assert got <= bound, (f"rank {r} saved {got} bytes; one device {one.total}, / {ranks} "
                              f"+ halos = {bound:.0f}")
