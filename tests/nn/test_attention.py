"""spmd.nn.MultiheadAttention and spmd.nn.convert of attention over a split sequence.

The module equals torch's nn.MultiheadAttention loaded with the same state_dict, in
value and in the gradients of the inputs and every parameter, for both strategies, both
batch_first settings, uneven and empty shards, cross-attention, kdim/vdim, bias_kv and
zero_attn, key padding and attention masks (bool and float), the is_causal hint, a batch
split over a second axis, and keys every rank holds whole. With mesh=None it is torch's.
convert swaps F.scaled_dot_product_attention and nn.MultiheadAttention's forward over a
split sequence (a ViT-style model trains 3 Adam steps on a (dp, sp) mesh as on one
device; a model calling SDPA itself; nn.TransformerEncoder) and refuses what would not
be exact (attention weights, dropout in training, a split feature dim, masks split
otherwise than the queries) before anything runs.

Tolerance: float64 within assert_matches_single_device's 1e-10 (only the order of
additions changes: the ring's running softmax, sums of per-rank weight gradients).
Training: losses to 1e-10, parameters to 1e-8 absolute (Adam divides by sqrt(v) + 1e-8,
which turns ~1e-17 differences of near-zero gradients into ~1e-10 steps; see test_unet).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn
from _ops import adam_steps
from torch import nn

import spmd
from spmd import Layout, P
from spmd.testing import assert_matches_single_device

F64 = torch.float64


class Wrap(nn.Module):
    """Calls an attention layer as ``attn(q, k, v, **{names[i]: rest[i]}, **kw)``;
    returns the output only."""

    def __init__(self, attn: nn.Module, names=("key_padding_mask", "attn_mask"), **kw):
        super().__init__()
        self.attn, self.names, self.kw = attn, names, kw

    def forward(self, q, k, v, *rest):
        return self.attn(q, k, v, **dict(zip(self.names, rest)), **self.kw)[0]


def _check(mesh, plain: nn.MultiheadAttention, spec, args, specs, kv_spec=None,
           strategy="ring", names=("key_padding_mask", "attn_mask"), **kw):
    """The sharded module (from_torch: the same parameters) against torch's."""
    sharded = spmd.nn.MultiheadAttention.from_torch(plain, mesh, spec, kv_spec=kv_spec,
                                                   strategy=strategy)
    assert_matches_single_device(Wrap(sharded, names, **kw),
                                 Wrap(plain, names, need_weights=False, **kw),
                                 mesh, specs, specs[0], *args)


def _inputs(bf, N, L, S, E, kdim, vdim, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(n, e):
        return torch.randn((N, n, e) if bf else (n, N, e), generator=g, dtype=F64)
    return t(L, E), t(S, kdim), t(S, vdim), g


CONFIGS = {
    "plain": dict(),
    "bias_kv, zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
    "kdim, vdim, no bias": dict(kdim=3, vdim=5, bias=False),
}


@pytest.mark.parametrize("strategy", ["ring", "heads"])
@pytest.mark.parametrize("bf", [True, False])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_equals_torch_with_masks(strategy, bf, config):
    """Cross-attention (7 queries, 5 keys) over 3 ranks, uneven with an empty shard; a
    key padding mask split like the keys and an (N * heads, L, S) attn_mask holding each
    rank's query rows: bool (True: masked, as torch) or float (added), with gradients."""
    mesh = spmd.Mesh((3,), ("sp",))
    kw = CONFIGS[config]
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2, batch_first=bf, **kw).double()
    N, L, S = 2, 7, 5
    q, k, v = _inputs(bf, N, L, S, 8, kw.get("kdim", 8), kw.get("vdim", 8))[:3]
    g = torch.Generator().manual_seed(1)
    if config == "plain":
        kpm, mask = torch.rand(N, S, generator=g) > 0.6, torch.rand(N * 2, L, S, generator=g) > 0.8
    else:
        kpm, mask = (torch.randn(N, S, generator=g, dtype=F64),
                     torch.randn(N * 2, L, S, generator=g, dtype=F64))
    sd = 1 if bf else 0
    q_lay, kv_lay = ({sd: [3, 0, 4]}, {sd: [2, 2, 1]})
    specs = (Layout(q.shape, P(*[None] * sd, "sp"), mesh, q_lay),
             Layout(k.shape, P(*[None] * sd, "sp"), mesh, kv_lay),
             Layout(v.shape, P(*[None] * sd, "sp"), mesh, kv_lay),
             Layout(kpm.shape, P(None, "sp"), mesh, {1: [2, 2, 1]}),
             Layout(mask.shape, P(None, "sp"), mesh, {1: [3, 0, 4]}))
    _check(mesh, plain, P(*[None] * sd, "sp"), (q, k, v, kpm, mask), specs,
           strategy=strategy)


@pytest.mark.parametrize("strategy", ["ring", "heads"])
@pytest.mark.parametrize("with_kpm", [False, True])
def test_is_causal_hint(strategy, with_kpm):
    """torch drops the mask and runs SDPA's causality without a key padding mask, and
    uses mask + key padding with one: both give torch's result."""
    mesh = spmd.Mesh((4,), ("sp",))
    torch.manual_seed(1)
    plain = nn.MultiheadAttention(6, 3, batch_first=True).double()
    x = torch.randn(2, 9, 6, dtype=F64)
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)  # True: masked
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    s = P(None, "sp")
    if with_kpm:
        _check(mesh, plain, s, (x, x, x, kpm, causal), (s, s, s, s, P("sp")),
               strategy=strategy, is_causal=True)
    else:  # the whole (L, L) mask is dropped (torch's hint): it may stay whole
        _check(mesh, plain, s, (x, x, x, causal), (s, s, s, P()), strategy=strategy,
               names=("attn_mask",), is_causal=True)


def test_unbatched_and_fully_padded_and_batch_split_over_dp():
    torch.manual_seed(2)
    plain = nn.MultiheadAttention(4, 2).double()
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(5, 4, dtype=F64)  # unbatched (L, E)
    kpm = torch.tensor([False, True, True, False, True])
    _check(mesh, plain, P("sp"), (x, x, x, kpm), (P("sp"),) * 4)
    # a 2-d mesh: batch over dp (uneven), sequence over sp; one sample fully padded
    mesh2 = spmd.Mesh((2, 2), ("dp", "sp"))
    pb = nn.MultiheadAttention(4, 2, batch_first=True).double()
    xb = torch.randn(3, 5, 4, dtype=F64)
    kb = torch.zeros(3, 5, dtype=torch.bool)
    kb[2] = True  # torch gives this sample zeros before the output projection
    s = P("dp", "sp")
    for strategy in ("ring", "heads"):
        _check(mesh2, pb, s, (xb, xb, xb, kb), (s,) * 4, strategy=strategy)


def test_whole_keys_cross_attention_moves_nothing():
    """Queries split, keys and values whole on every rank (a small context): each rank
    attends its rows to all keys; no communication."""
    mesh = spmd.Mesh((3,), ("sp",))
    torch.manual_seed(3)
    plain = nn.MultiheadAttention(4, 2, kdim=3, vdim=3, batch_first=True).double()
    q = torch.randn(2, 7, 4, dtype=F64)
    ctx = torch.randn(2, 4, 3, dtype=F64)
    kpm = torch.tensor([[False, True, False, False], [False, False, False, True]])
    with spmd.comm_stats() as s:
        _check(mesh, plain, P(None, "sp"), (q, ctx, ctx, kpm), (P(None, "sp"), P(), P(), P()),
               kv_spec=P())
    assert not {"ring_attention", "ring_attention sizes", "all_gather"} & \
        {r[0] for r in s.records if r[3] == "forward"}


def test_mesh_none_is_torch_and_state_dicts_match():
    torch.manual_seed(4)
    ours = spmd.nn.MultiheadAttention(6, 2, kdim=4, vdim=5, add_bias_kv=True)
    plain = nn.MultiheadAttention(6, 2, kdim=4, vdim=5, add_bias_kv=True)
    assert ours.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(ours.state_dict())
    ours.load_state_dict(plain.state_dict())
    q, k, v = torch.randn(3, 2, 6), torch.randn(4, 2, 4), torch.randn(4, 2, 5)
    (a, wa), (b, wb) = ours(q, k, v), plain(q, k, v)  # need_weights=True, as torch
    assert torch.equal(a, b) and torch.equal(wa, wb)
    back = ours.to_torch()
    assert type(back) is nn.MultiheadAttention and back.in_proj_bias is ours.in_proj_bias
    twin = spmd.nn.MultiheadAttention.from_torch(plain, spmd.Mesh((2,), ("sp",)), P("sp"))
    assert twin.q_proj_weight is plain.q_proj_weight


def test_dropout_in_eval_is_torch():
    mesh = spmd.Mesh((2,), ("sp",))
    torch.manual_seed(5)
    plain = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True).double().eval()
    x = torch.randn(1, 5, 4, dtype=F64)
    s = P(None, "sp")
    _check(mesh, plain, s, (x, x, x), (s, s, s))


def _run(attn, x, spec, mesh, **kw):
    return spmd.shard_map(lambda x: attn(x, x, x, **kw)[0], mesh, spec, spec)(x)


def test_module_errors():
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(1, 4, 4)
    s = P(None, "sp")
    attn = spmd.nn.MultiheadAttention(4, 2, batch_first=True, mesh=mesh, spec=s)
    with pytest.raises(spmd.SpecError, match="pass need_weights=False"):
        _run(attn, x, s, mesh, need_weights=True)
    drop = spmd.nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True, mesh=mesh, spec=s)
    with pytest.raises(NotImplementedError, match="use dropout=0"):
        _run(drop, x, s, mesh)
    feat = spmd.nn.MultiheadAttention(4, 2, batch_first=True, mesh=mesh, spec=P(None, None, "sp"))
    with pytest.raises(spmd.SpecError, match="splits the feature dim"):
        _run(feat, x, P(None, None, "sp"), mesh)
    with pytest.raises(ValueError, match="strategy must be"):
        spmd.nn.MultiheadAttention(4, 2, mesh=mesh, spec=s, strategy="ulysses")
    with pytest.raises(TypeError, match="pass spec="):
        spmd.nn.MultiheadAttention(4, 2, mesh=mesh)
    other = spmd.nn.MultiheadAttention(4, 2, mesh=spmd.Mesh((2, 2), ("a", "b")),
                                       spec=P("a"), kv_spec=P("b"))
    with pytest.raises(spmd.SpecError, match="over the same axes"):
        spmd.shard_map(lambda q, k: other(q, k, k)[0], other.mesh, (P("a"), P("b")),
                       P("a"))(torch.randn(4, 1, 4), torch.randn(4, 1, 4))


# -- convert -----------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, E: int, H: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    """Patch embedding (a linear map of flattened patches), a learned positional
    embedding of each patch's (row, column), two pre-norm transformer blocks, a
    mean-pooled head."""

    def __init__(self, patch: int = 4, E: int = 8, H: int = 2, out: int = 3):
        super().__init__()
        self.embed, self.pos = nn.Linear(patch, E), nn.Linear(2, E)
        self.blocks = nn.Sequential(Block(E, H), Block(E, H))
        self.norm, self.head = nn.LayerNorm(E), nn.Linear(E, out)

    def forward(self, patches, coords):
        x = self.blocks(self.embed(patches) + self.pos(coords))
        return self.head(self.norm(x).mean(1))


def _vit_data(B=3, side=(3, 4), patch=4, out=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = side[0] * side[1]
    patches = torch.randn(B, n, patch, generator=g, dtype=F64)
    rows, cols = torch.meshgrid(torch.arange(side[0]), torch.arange(side[1]), indexing="ij")
    coords = torch.stack([rows, cols], -1).reshape(1, n, 2).expand(B, n, 2).to(F64) / 4
    return patches, coords.contiguous(), torch.randn(B, out, generator=g, dtype=F64)


@pytest.mark.parametrize("side", [(3, 4), (2, 5)])
def test_vit_trains_3_adam_steps_like_one_device_on_dp_sp_mesh(side):
    """Batch 3 over dp=2 ([2, 1]); 12 tokens over sp=3 ([4, 4, 4]) or 10 ([4, 3, 3]):
    convert swaps each block's attention for ring attention and the token mean for
    spmd.reduce; parameters get their global gradients from shard_map."""
    torch.manual_seed(0)
    model = TinyViT().double()
    mesh = spmd.Mesh((2, 3), ("dp", "sp"))
    patches, coords, t = _vit_data(side=side)
    ref = TinyViT().double()
    ref.load_state_dict(model.state_dict())
    want = adam_steps(ref.parameters(), lambda: F.mse_loss(ref(patches, coords), t), lr=0.05)
    spec = P("dp", "sp")
    sharded = spmd.nn.convert(model, mesh, (spec, spec), example=(patches, coords))
    assert [e.call for e in sharded.spmd_plan.swapped] == \
        ["F.multi_head_attention_forward"] * 2 + ["mean"]

    def body(p, c, tl):  # the model's output is whole over sp: the loss sums over dp
        return spmd.psum(((sharded(p, c) - tl) ** 2).sum(), "dp") / t.numel()

    loss_fn = spmd.shard_map(body, mesh, (spec, spec, P("dp")), P())
    got = adam_steps(sharded.parameters(), lambda: loss_fn(patches, coords, t), lr=0.05)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-10, atol=1e-10)
    assert got[2] < got[0]
    for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-8, msg=name)


class StandardViT(nn.Module):
    """A ViT as it is usually written: a strided conv cuts the image into patches, their
    grid is flattened into tokens, a learned positional table (one row per token) is
    added, then pre-norm blocks and a mean-pooled head."""

    def __init__(self, tokens: int, patch: int = 2, E: int = 8, H: int = 2, out: int = 3):
        super().__init__()
        self.embed = nn.Conv2d(3, E, patch, stride=patch)
        self.pos = nn.Parameter(0.1 * torch.randn(1, tokens, E))
        self.blocks = nn.Sequential(Block(E, H), Block(E, H))
        self.norm, self.head = nn.LayerNorm(E), nn.Linear(E, out)

    def forward(self, img):
        x = self.embed(img).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(1))


@pytest.mark.parametrize("rows,example", [([4, 4, 4], True), ([6, 4, 2], True),
                                          ([6, 4, 2], False)])
def test_convert_a_standard_vit_with_an_image_split_along_its_rows(rows, example):
    """The image's rows split over sp (uneven too): the patch conv's rows stay split, the
    flatten of (rows, columns) makes each rank's patch rows one run of tokens, and each
    rank adds its rows of the positional table (sliced at its token offset, which the
    convert learns from one size exchange). Values and all gradients as one device."""
    torch.manual_seed(0)
    model = StandardViT(tokens=6 * 4).double()
    mesh = spmd.Mesh((3,), ("sp",))
    img = torch.randn(2, 3, 12, 8, dtype=F64)
    lay = Layout(img.shape, P(None, None, "sp"), mesh, {2: rows})
    sharded = spmd.nn.convert(model, mesh, P(None, None, "sp"),
                              example=img if example else None)
    # without example=, the first forward plans on stand-in sizes and the run slices
    assert_matches_single_device(sharded, model, mesh, lay, P(), img)
    if example:
        plan = sharded.spmd_plan
        assert "sliced" in [e.kind for e in plan.entries] and not plan.refused
        assert [e.call for e in plan.swapped].count("F.multi_head_attention_forward") == 2


def test_convert_refuses_a_positional_table_of_another_length():
    """A table one token short: one device could not add it; every rank refuses alike
    (the global token count is compared, never a rank's own)."""
    model = StandardViT(tokens=23).double()
    mesh = spmd.Mesh((3,), ("sp",))
    with pytest.raises(spmd.SpecError, match="whole along it"):
        spmd.nn.convert(model, mesh, P(None, None, "sp"), example=(2, 3, 12, 8))


class SDPAAttention(nn.Module):
    """A custom attention layer that calls F.scaled_dot_product_attention itself:
    grouped-query heads, causal."""

    def __init__(self, E=8, H=4, Hkv=2):
        super().__init__()
        self.H, self.Hkv, self.d = H, Hkv, E // H
        self.q, self.kv = nn.Linear(E, E), nn.Linear(E, 2 * Hkv * (E // H))
        self.o = nn.Linear(E, E)

    def forward(self, x, mask=None):
        B, L, E = x.shape
        q = self.q(x).view(B, L, self.H, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, self.Hkv, self.d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, L, E))


def test_convert_a_model_calling_sdpa():
    mesh = spmd.Mesh((3,), ("sp",))
    torch.manual_seed(6)
    model = SDPAAttention().double()
    x = torch.randn(2, 8, 8, dtype=F64)
    s = P(None, "sp")
    conv = spmd.nn.convert(model, mesh, s, example=x)
    assert [e.call for e in conv.spmd_plan.swapped] == ["torch.scaled_dot_product_attention"]
    assert_matches_single_device(conv, model, mesh, s, s, x)
    # a mask holding each rank's query rows (dim -2 split like the sequence), all keys
    mask = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.3
    conv = spmd.nn.convert(model, mesh, (s, P(None, None, "sp")))
    assert_matches_single_device(conv, model, mesh, (s, P(None, None, "sp")), s, x, mask)


def test_convert_transformer_encoder():
    """nn.TransformerEncoder (its layers call the MHA forward with need_weights=False),
    in training without dropout and in eval with it, with a key padding mask."""
    mesh = spmd.Mesh((2,), ("sp",))
    torch.manual_seed(7)
    x = torch.randn(2, 7, 8, dtype=F64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    s = P(None, "sp")

    class Enc(nn.Module):
        def __init__(self, dropout):
            super().__init__()
            self.enc = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True), 2,
                enable_nested_tensor=False)

        def forward(self, x, kpm):
            return self.enc(x, src_key_padding_mask=kpm)
    for model in (Enc(0.0).double(), Enc(0.1).double().eval()):
        conv = spmd.nn.convert(model, mesh, (s, s))
        assert_matches_single_device(conv, model, mesh, (s, s), s, x, kpm)
    with pytest.raises(spmd.SpecError, match="dropout=0.1"):
        spmd.nn.convert(Enc(0.1).double(), mesh, (s, s), example=(x, kpm))


def test_convert_passes_attention_over_a_split_batch_weights_included():
    """Only the batch split (dp): the layer runs as torch's, sample by sample, and its
    weights are split over the batch like the output."""
    class UsesWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            y, w = self.attn(x, x, x)
            return y * w.sum(-1, keepdim=True)
    mesh = spmd.Mesh((2,), ("dp",))
    model = UsesWeights().double()
    x = torch.randn(3, 5, 4, dtype=F64)
    conv = spmd.nn.convert(model, mesh, P("dp"), example=x)
    assert conv.spmd_plan.swapped == []
    assert_matches_single_device(conv, model, mesh, P("dp"), P("dp"), x)


REFUSED = {
    "default need_weights": (Fn(lambda m, x: m.layers[0](x, x, x)[0],
                                nn.MultiheadAttention(8, 2, batch_first=True)),
                             P(None, "sp"), "call the layer with need_weights=False"),
    "MHA dropout in training": (
        Fn(lambda m, x: m.layers[0](x, x, x, need_weights=False)[0],
           nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True)),
        P(None, "sp"), "drops attention weights at random"),
    "SDPA dropout": (Fn(lambda m, x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)),
                     P(None, "sp"), "pass dropout_p=0"),
    "SDPA over split features": (Fn(lambda m, x: F.scaled_dot_product_attention(x, x, x)),
                                 P(None, None, "sp"), "contracts the features"),
    "MHA over split features": (Fn(lambda m, x: m.layers[0](x, x, x, need_weights=False)[0],
                                   nn.MultiheadAttention(8, 2, batch_first=True)),
                                P(None, None, "sp"), "projects the features"),
    "SDPA whole queries, split keys": (
        Fn(lambda m, x: F.scaled_dot_product_attention(x.mean(1, keepdim=True), x, x)),
        P(None, "sp"), "from whole queries"),
    "a whole global mask": (
        Fn(lambda m, x: F.scaled_dot_product_attention(x, x, x, attn_mask=m.mask)),
        P(None, "sp"), "query rows are not split like the queries"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_convert_refuses_before_anything_runs(name):
    model, spec, why = REFUSED[name]
    if name == "a whole global mask":
        model.mask = torch.ones(6, 6, dtype=torch.bool)
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(2, 6, 8)
    with pytest.raises(spmd.SpecError, match="would be wrong on shards") as e:
        spmd.nn.convert(model, mesh, spec, example=x)
    assert why in str(e.value)
    conv = spmd.nn.convert(model, mesh, spec)
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError, match="nothing has run"):
        spmd.shard_map(conv, mesh, spec, spec)(x)
    assert stats.calls() == 0


# -- gloo ----------------------------------------------------------------------------------

def _gloo_rank(mesh):
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True).double()
    q, k, v, _ = _inputs(True, 2, 5, 4, 8, 8, 8)
    kpm = torch.tensor([[False, True, False, False], [True, False, False, False]])
    s = P(None, "sp")
    for strategy in ("ring", "heads"):
        _check(mesh, plain, s, (q, k, v, kpm), (s, s, s, s), strategy=strategy)
    return True


@pytest.mark.gloo
def test_module_on_gloo_world_2(gloo2):
    assert gloo2.run(_gloo_rank, (2,), ("sp",)) == [True, True]
