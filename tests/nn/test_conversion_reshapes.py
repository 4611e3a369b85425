"""Reshapes that merge a split dim with whole dims behind it, and their inverse, are
exact under spmd.nn.convert (the layouts of attention blocks: diffusers' (b, c, h * w)
tokens, timm's qkv heads at batch 1); a split dim merged behind another dim is refused.

Exact cases compare values and gradients with one device in float64
(``assert_matches_single_device``'s default tolerance, 1e-10: sharded sums reorder),
on four ranks over 37 rows (shards of 10, 9, 9, 9)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn, assert_refused_before_anything_runs
from torch import nn

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
H = P(None, None, "sp")  # (N, C, H, W) split along H
T = P(None, "sp")  # (B, N, C) split along the tokens


def _bcn(m, x):
    b, c, h, w = x.shape
    return x.view(b, c, h * w).tanh().view(b, c, h, w)


class Attention(nn.Module):
    """A diffusers-style attention block in plain torch: norm, tokens (b, h * w, c),
    heads, scaled dot-product attention, back to (b, c, h, w), residual."""

    def __init__(self, c=8, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(2, c)
        self.q, self.k, self.v, self.o = (nn.Linear(c, c) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.norm(x).view(b, c, h * w).transpose(1, 2)
        d = c // self.heads
        q, k, v = (f(t).reshape(b, h * w, self.heads, d).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        a = a.transpose(1, 2).reshape(b, h * w, c)
        return self.o(a).transpose(1, 2).view(b, c, h, w) + x


class Processor(Attention):
    """diffusers' AttnProcessor2_0 as written there: -1 for the tokens, heads merged into
    the batch for the norm-free path, transpose(-1, -2).reshape back to the image."""

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.view(b, c, h * w).transpose(1, 2)
        t = self.norm(t.transpose(1, 2)).transpose(1, 2)
        d = c // self.heads
        q, k, v = (f(t).view(b, -1, self.heads, d).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        a = a.transpose(1, 2).reshape(b, -1, self.heads * d)
        return (self.o(a).transpose(-1, -2).reshape(b, c, h, w) + x) / 2.0


class QKV(nn.Module):
    """timm's attention: one qkv Linear reshaped to (3, b, heads, n, d)."""

    def __init__(self, c=8, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        return self.proj(a.reshape(b * n, c)).reshape(b, n, c)


class ChannelMLP(nn.Module):
    """neuraloperator's ChannelMLP: 1x1 Conv1d over the flattened positions."""

    def __init__(self, c=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv1d(c, 2 * c, 1), nn.Conv1d(2 * c, c, 1)

    def forward(self, x):
        b, c = x.shape[:2]
        size = list(x.shape[2:])
        x = self.fc2(F.gelu(self.fc1(x.reshape(b, c, -1))))
        return x.reshape(b, c, *size)


CASES = {
    "view (b, c, h * w)": (Fn(lambda m, x: x.view(x.shape[0], x.shape[1],
                                                  x.shape[2] * x.shape[3]) * 2), H, "exact"),
    "reshape (b, c, -1)": (Fn(lambda m, x: x.reshape(x.shape[0], x.shape[1], -1).exp()), H,
                           "exact"),
    "view (b, c, h * w) and back": (Fn(_bcn), H, "exact"),
    "back with -1": (Fn(lambda m, x: x.flatten(2).view(*x.shape[:2], -1, x.shape[3])), H,
                     "exact"),
    "tokens transposed and back": (
        Fn(lambda m, x: x.flatten(2).transpose(1, 2).sin().transpose(1, 2).reshape(x.shape)),
        H, "exact"),
    "unflatten back": (Fn(lambda m, x: x.flatten(2).unflatten(2, (x.shape[2], x.shape[3]))),
                       H, "exact"),
    "unflatten back with -1": (Fn(lambda m, x: x.flatten(2).unflatten(2, (-1, x.shape[3]))),
                               H, "exact"),
    "neuraloperator ChannelMLP": (ChannelMLP(), H, "exact"),
    "channels-last tokens and back": (
        Fn(lambda m, x: (lambda b, c, h, w: x.permute(0, 2, 3, 1).reshape(b, -1, c).tanh()
                         .reshape(b, h, w, c).permute(0, 3, 1, 2))(*x.shape)), H, "exact"),
    "H merged with C behind it": (
        Fn(lambda m, x: x.permute(0, 2, 1, 3).reshape(x.shape[0], -1, x.shape[3])), H, "exact"),
    "identity slices": (Fn(lambda m, x: x[:, 0:] + x[..., 0:None] + x[:, :, 0::1]), H, "exact"),
    "diffusers attention": (Attention(), H, "exact"),
    "diffusers AttnProcessor2_0": (Processor(), H, "exact"),
    "merged behind W": (Fn(lambda m, x: x.transpose(2, 3).reshape(*x.shape[:2], -1)), H,
                        "reshapes dim 3, which is split over 'sp', merging it with other dims "
                        "where it is not the outermost"),
    "merged behind C": (Fn(lambda m, x: x.reshape(x.shape[0], -1, x.shape[3])), H,
                        "reshapes dim 2, which is split over 'sp', merging it with other dims"),
    "a real slice": (Fn(lambda m, x: x[:, :, 1:]), H, "slices dim 2"),
    "a slice with a step": (Fn(lambda m, x: x[:, :, ::2]), H, "slices dim 2"),
    "a hard-coded size": (Fn(lambda m, x: x.view(x.shape[0], x.shape[1], 37 * 8)), H,
                          "reshapes dim 2"),
    "a size squared": (Fn(lambda m, x: x.reshape(x.shape[0], x.shape[1], x.shape[2] ** 2, -1)),
                       H, "reshapes with"),
}


@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_each_case_is_exact_or_refused(name, batch):
    model, spec, outcome = CASES[name]
    model = model.double()
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(batch, 8, 37, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    if outcome != "exact":
        assert_refused_before_anything_runs(model, mesh, spec, x, outcome)
        return
    conv = spmd.nn.convert(model, mesh, spec, example=x)
    out = eval(conv.spmd_plan.outputs[0], {"P": P})  # noqa: S307 - the plan's own repr
    assert_matches_single_device(conv, model, mesh, spec, out, x)


def test_timm_qkv_heads_and_token_merges_are_exact_at_batch_1():
    """(b, n, c) -> (b, n, 3, heads, d), and (b * n, c) and back, which at batch 1 keeps
    each rank's tokens one run; at batch 2 the tokens of the second sample come behind
    the first's, and the merge is refused."""
    model = QKV().double()
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(1, 37, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    conv = spmd.nn.convert(model, mesh, T, example=x)
    assert_matches_single_device(conv, model, mesh, T, T, x)
    with pytest.raises(spmd.SpecError, match="reshapes dim 1, which is split over 'sp', "
                                             "merging it with other dims where it is not"):
        spmd.nn.convert(model, mesh, T, example=torch.cat([x, x]))


def test_a_mesh_of_two_axes():
    """H and W split: merging them puts W's shards behind H's (refused); a split batch
    in front of a merged H does not matter."""
    mesh = spmd.Mesh((2, 2), ("a", "b"))
    model = Fn(lambda m, x: x.view(x.shape[0], x.shape[1], -1).exp())
    x = torch.randn(2, 3, 37, 6, dtype=F64)
    with pytest.raises(spmd.SpecError, match="reshapes dim 3, which is split over 'b', "
                                             "merging it with other dims where it is not"):
        spmd.nn.convert(model, mesh, P(None, None, "a", "b"), example=x)
    spec = P("b", None, "a")
    conv = spmd.nn.convert(model, mesh, spec, example=x)
    assert_matches_single_device(conv, model, mesh, spec, spec, x)


def test_uneven_shards_keep_their_sizes_through_the_merge_and_back():
    mesh = spmd.Mesh((4,), ("sp",))
    model = Fn(_bcn).double()
    x = torch.randn(2, 3, 37, 6, dtype=F64)
    lay = spmd.Layout(x.shape, H, mesh, {2: [20, 5, 6, 6]})
    conv = spmd.nn.convert(model, mesh, H)
    y = spmd.shard_map(conv, mesh, H, H)(spmd.Sharded.from_global(x, mesh, lay))
    assert y.layout.sizes[2] == (20, 5, 6, 6)
    torch.testing.assert_close(spmd.gather(y, mesh), model(x), rtol=0, atol=1e-12)


def test_empty_shards_merge_and_split_back():
    mesh = spmd.Mesh((4,), ("sp",))
    model = Fn(_bcn).double()
    x = torch.randn(2, 3, 3, 6, dtype=F64)
    lay = spmd.Layout(x.shape, H, mesh, {2: [0, 2, 0, 1]})
    y = spmd.shard_map(spmd.nn.convert(model, mesh, H), mesh, H, H)(
        spmd.Sharded.from_global(x, mesh, lay))
    assert y.layout.sizes[2] == (0, 2, 0, 1)
    torch.testing.assert_close(spmd.gather(y, mesh), model(x), rtol=0, atol=1e-12)


def test_splitting_tokens_into_rows_that_cut_a_shard_is_refused():
    """Tokens (b, c, 37 * 6) split [61, 61, 61, 39] hold no whole rows of 6."""
    mesh = spmd.Mesh((4,), ("sp",))
    model = Fn(lambda m, x: x.view(x.shape[0], x.shape[1], -1, 6))
    x = torch.randn(2, 3, 222, dtype=F64)
    lay = spmd.Layout(x.shape, H, mesh, {2: [61, 61, 61, 39]})
    conv = spmd.nn.convert(model, mesh, H)
    with pytest.raises(spmd.SpecError, match=r"whole dims of 6 elements, which do not divide "
                                             r"its shards \[61, 61, 61, 39\]"):
        spmd.shard_map(conv, mesh, H, H)(spmd.Sharded.from_global(x, mesh, lay))
