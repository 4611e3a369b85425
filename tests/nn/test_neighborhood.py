"""spmd.nn.NeighborhoodAttention2d: the layer on shards equals the layer on one device
(outputs and parameter gradients), and a small NATTEN-style model (patch-embed conv, two
blocks of LayerNorm + neighbourhood attention + MLP, a per-token head) trains 3 Adam steps
on a ("dp", "sp") threads mesh (batch over dp, token rows over sp, uneven) with the
single-device losses and parameters.

Tolerance: float64. One layer: rtol = atol = 1e-10 (the sharded run reorders additions:
per-rank partial weight gradients summed over ranks, halo gradients added after the local
ones). Training: losses and parameters to 1e-10 as well (measured: losses equal, parameters
within 2e-12 after 3 steps; Adam divides by sqrt(v) + 1e-8, so a gradient that is zero up
to rounding could move a parameter by up to lr * 1e-17 / 1e-8 = 1e-11).
"""
from __future__ import annotations

import copy

import pytest
import torch
from _ops import adam_steps
from torch import nn

import spmd
from spmd import Layout, P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def test_layer_on_a_2d_split_matches_one_device():
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    lay = Layout((2, 7, 6, 8), P(None, "x", "y"), mesh, {1: (2, 5), 2: (6, 0)})
    torch.manual_seed(0)
    one = spmd.nn.NeighborhoodAttention2d(8, 2, (3, 4), dilation=(2, 1), is_causal=(False, True),
                                          rel_pos_bias=True, dtype=F64)
    sharded = spmd.nn.NeighborhoodAttention2d(8, 2, (3, 4), dilation=(2, 1),
                                              is_causal=(False, True), rel_pos_bias=True,
                                              mesh=mesh, spec=lay, dtype=F64)
    sharded.load_state_dict(one.state_dict())
    x = torch.randn(lay.shape, dtype=F64)
    assert_matches_single_device(sharded, one, mesh, lay, lay, x, **TOL)


def test_layer_with_a_P_spec_and_a_split_batch():
    mesh = spmd.Mesh((2, 3), ("dp", "sp"))
    spec = P("dp", None, "sp")
    torch.manual_seed(1)
    one = spmd.nn.NeighborhoodAttention2d(6, 3, 3, qkv_bias=False, qk_scale=0.3, dtype=F64)
    sharded = spmd.nn.NeighborhoodAttention2d(6, 3, 3, qkv_bias=False, qk_scale=0.3, mesh=mesh,
                                              spec=spec, dtype=F64)
    sharded.load_state_dict(one.state_dict())
    assert sharded.rpb is None and "mesh=" in repr(sharded)
    x = torch.randn(2, 4, 7, 6, dtype=F64)
    assert_matches_single_device(sharded, one, mesh, spec, spec, x, **TOL)


def test_layer_with_grouped_query_attention_matches_one_device_and_a_plain_reading():
    """num_kv_heads=2 of 4: qkv projects to q (4 heads), k and v (2 each); query head h
    reads key/value head h // 2. On a split with an empty shard it equals one device,
    and one device equals the op's reference on repeated k and v."""
    from spmd.ops import neighborhood_attention_reference
    mesh = spmd.Mesh((3,), ("sp",))
    lay = Layout((2, 9, 5, 8), P(None, "sp"), mesh, {1: (4, 0, 5)})
    torch.manual_seed(2)
    one = spmd.nn.NeighborhoodAttention2d(8, 4, 3, rel_pos_bias=True, num_kv_heads=2, dtype=F64)
    sharded = spmd.nn.NeighborhoodAttention2d(8, 4, 3, rel_pos_bias=True, num_kv_heads=2,
                                              mesh=mesh, spec=lay, dtype=F64)
    assert one.qkv.out_features == 8 + 2 * 2 * 2 and "num_kv_heads=2" in repr(one)
    sharded.load_state_dict(one.state_dict())
    x = torch.randn(lay.shape, dtype=F64)
    assert_matches_single_device(sharded, one, mesh, lay, lay, x, **TOL)
    q, k, v = one.qkv(x).split([8, 4, 4], -1)
    rep = lambda t: t.unflatten(-1, (2, 2)).repeat_interleave(2, dim=-2)  # noqa: E731
    y = neighborhood_attention_reference(q.unflatten(-1, (4, 2)), rep(k), rep(v), 3, rpb=one.rpb)
    torch.testing.assert_close(one(x), one.proj(y.flatten(-2)), **TOL)


def test_layer_errors():
    name = "NeighborhoodAttention2d"
    with pytest.raises(ValueError, match="num_heads=3 must divide dim=8"):
        spmd.nn.NeighborhoodAttention2d(8, 3, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        spmd.nn.NeighborhoodAttention2d(8, 4, 3, num_kv_heads=3)
    with pytest.raises(TypeError, match="together"):
        spmd.nn.NeighborhoodAttention2d(8, 2, 3, spec=P(None, "sp"))
    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(spmd.SpecError, match=f"{name}: spec .* splits the channels"):
        spmd.nn.NeighborhoodAttention2d(8, 2, 3, mesh=mesh, spec=P(None, None, None, "sp"))
    with pytest.raises(spmd.SpecError, match="kernel_size must be an int or 2 ints"):
        spmd.nn.NeighborhoodAttention2d(8, 2, (3, 3, 3))
    with pytest.raises(spmd.SpecError, match=r"expected \[batch, X, Y, 8\]"):
        spmd.nn.NeighborhoodAttention2d(8, 2, 3)(torch.zeros(1, 4, 4, 6))


# -- a NATTEN-style model -----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, dim, heads, kernel, dilation, mesh, spec):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = spmd.nn.NeighborhoodAttention2d(dim, heads, kernel, dilation,
                                                    rel_pos_bias=True, mesh=mesh, spec=spec)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyNAT(nn.Module):
    """[B, C, H, W] -> patch embedding (conv, stride 2) -> tokens [B, H/2, W/2, dim] ->
    2 blocks -> a per-token head [B, H/2, W/2, 1]."""

    def __init__(self, mesh=None, c_in=2, dim=8, heads=2):
        super().__init__()
        conv_spec, tok_spec = (P("dp", None, "sp"), P("dp", "sp")) if mesh else (None, None)
        self.embed = (spmd.nn.Conv2d(c_in, dim, 2, stride=2, mesh=mesh, spec=conv_spec)
                      if mesh else nn.Conv2d(c_in, dim, 2, stride=2))
        self.blocks = nn.Sequential(Block(dim, heads, 3, 1, mesh, tok_spec),
                                    Block(dim, heads, (2, 3), (2, 1), mesh, tok_spec))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x).permute(0, 2, 3, 1)))


def test_natten_style_model_trains_3_adam_steps_like_one_device_on_dp_sp_threads():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 14, 10, generator=g, dtype=F64)  # 7 x 5 tokens: rows [4, 3]
    t = torch.randn(4, 7, 5, 1, generator=g, dtype=F64)
    torch.manual_seed(0)
    one = TinyNAT().double()
    sharded = TinyNAT(mesh).double()
    sharded.load_state_dict(one.state_dict())
    want = adam_steps(one, lambda: ((one(x) - t) ** 2).mean())

    x_lay = Layout(x.shape, P("dp", None, "sp"), mesh, {2: (5, 9)})  # uneven input rows too
    n = t.numel()
    body = lambda x, t: spmd.psum(((sharded(x) - t) ** 2).sum(), ("dp", "sp")) / n  # noqa: E731
    loss_fn = spmd.shard_map(body, mesh, (x_lay, P("dp", "sp")), P(),
                             params=list(sharded.parameters()))
    with spmd.comm_stats() as stats:
        got = adam_steps(sharded, lambda: loss_fn(x, t))
    assert stats.bytes("neighborhood_attention2d") > 0  # the halo moved
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    assert got[2] < got[0]  # it learns
    ref = dict(one.named_parameters())
    for k, p in sharded.named_parameters():
        torch.testing.assert_close(p, ref[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_model_state_dicts_are_interchangeable():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    a, b = TinyNAT(), TinyNAT(mesh)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert a.state_dict().keys() == b.state_dict().keys()
    assert "blocks.0.attn.rpb" in a.state_dict()
