"""spmd.nn.convert follows the whole forward: every call on a split tensor is passed, swapped
for its twin, or refused on every rank before anything runs; never silently wrong.

Exact cases are compared with ``assert_matches_single_device`` in float64 (values, input
and parameter gradients; its default tolerance, 1e-10: sharded sums are reordered).
Refusals are checked for their message (where, the split dim, the fix), for being the
same on every rank, and for moving no data (``comm_stats``).
"""
from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
H = P(None, None, "sp")  # (N, C, H, W) split along H


def _lin(i, o):
    return nn.Linear(i, o).double()


def _conv(i, o, **kw):
    return nn.Conv2d(i, o, 3, padding=1, **kw).double()


# Each case: (model, outcome): "exact", or a piece of the refusal message.
CASES = {
    # norms, softmax and stencils
    # a threads mesh shares the module between rank threads: each updates its own copy
    # of the running statistics, written back once
    "top-level BatchNorm2d": (nn.BatchNorm2d(3), "exact"),
    "batch norm of other buffers": (
        Fn(lambda m, x: F.batch_norm(x, m.rm, m.rv, training=True)),
        "F.batch_norm updates batch norm's running statistics in training, which the rank "
        "threads"),
    "BatchNorm2d untracked": (nn.BatchNorm2d(3, track_running_stats=False), "exact"),
    "BatchNorm2d eval": (nn.BatchNorm2d(3).eval(), "exact"),
    "top-level GroupNorm": (nn.GroupNorm(1, 3), "exact"),
    "InstanceNorm2d": (nn.InstanceNorm2d(3, affine=True), "exact"),
    "GroupNorm over split channels": (Fn(lambda m, x: F.group_norm(x.transpose(1, 2), 3)),
                                      "normalises per channel, and dim 1"),
    "InstanceNorm2d tracked": (nn.InstanceNorm2d(3, track_running_stats=True), "exact"),
    "LPPool2d": (nn.LPPool2d(2, 3, 2), "exact"),
    "Softmax(dim=2)": (nn.Softmax(dim=2), "exact"),
    "Softmin(dim=2)": (nn.Softmin(dim=2), "exact"),
    "LogSoftmax(dim=2)": (nn.LogSoftmax(dim=2), "exact"),
    "F.interpolate": (Fn(lambda m, x: F.interpolate(x, scale_factor=2, mode="bilinear")), "exact"),
    "F.max_pool2d": (Fn(lambda m, x: F.max_pool2d(x, 3, 2, 1)), "exact"),
    "x.mean(dim=(2, 3))": (Fn(lambda m, x: x.mean(dim=(2, 3))), "exact"),
    "softmax over H": (Fn(lambda m, x: torch.softmax(x, dim=2)), "exact"),
    "torch._softmax over H": (Fn(lambda m, x: torch._softmax(x, 2, False)),
                              "normalises along dim 2, which is split"),
    "torch.roll": (Fn(lambda m, x: torch.roll(x, 1, dims=2)), "torch.roll shifts values along dim 2"),
    "finite difference": (Fn(lambda m, x: x[:, :, 1:] - x[:, :, :-1]),
                          "indexing x[...] slices dim 2, which is split over 'sp'; a stencil"),
    "spectral layer": (Fn(lambda m, x: torch.fft.irfft2(torch.fft.rfft2(x) * 2, s=x.shape[-2:])),
                       "exact"),
    "fftshift over H": (Fn(lambda m, x: torch.fft.fftshift(x, dim=2)),
                        "torch.fft.fftshift transforms dim 2"),
    # more of what real models do
    "softmax over C": (nn.Softmax(dim=1), "exact"),
    "mean keepdim": (Fn(lambda m, x: x - x.mean(dim=(2, 3), keepdim=True)), "exact"),
    "amax over H": (Fn(lambda m, x: x.amax(dim=2)), "exact"),
    "sum of all": (Fn(lambda m, x: (x ** 2).sum()), "exact"),
    "squeeze-excite": (Fn(lambda m, x: x * torch.sigmoid(m.layers[0](x.mean((2, 3))))[:, :, None, None],
                          _lin(3, 3)), "exact"),
    "reflect conv": (_conv(3, 4, padding_mode="reflect"), "exact"),
    "Linear on W": (_lin(8, 5), "exact"),
    "conv on a transpose": (Fn(lambda m, x: m.layers[0](x.transpose(2, 3)).transpose(2, 3),
                               _conv(3, 3)), "exact"),
    "cat along C": (Fn(lambda m, x: torch.cat([x, x.relu()], dim=1)), "exact"),
    "cat along H": (Fn(lambda m, x: torch.cat([x, x], dim=2)), "concatenates along dim 2"),
    "shape unpacking": (Fn(lambda m, x: (lambda b, c, h, w: x.reshape(b, c, h, w).tanh())(*x.shape)),
                        "exact"),
    "view keeping H": (Fn(lambda m, x: x.view(x.shape[0], x.shape[1], -1, 4, 2).sum(-1)), "exact"),
    "flatten of H": (Fn(lambda m, x: x.flatten(1)), "flatten flattens dim 2"),
    "view merging H": (Fn(lambda m, x: x.view(x.shape[0], x.shape[1], -1)), "exact"),
    "view merging H behind C": (Fn(lambda m, x: x.view(x.shape[0], -1, x.shape[3])),
                                "reshapes dim 2, which is split over 'sp', merging it with "
                                "other dims where it is not the outermost"),
    "coordinates of a local size": (
        Fn(lambda m, x: x * torch.linspace(0, 1, x.shape[2], dtype=x.dtype)[:, None]),
        "torch.linspace builds coordinates from"),
    "zeros of the shard's shape": (
        Fn(lambda m, x: x + torch.zeros(*x.shape, dtype=x.dtype)), "exact"),
    "interpolate to a local size": (
        Fn(lambda m, x: F.interpolate(x, size=(2 * x.shape[2], x.shape[3]))),
        "this rank's share of dim 2"),
    "MSE loss": (Fn(lambda m, x: F.mse_loss(x, torch.ones_like(x) * 0.5)), "exact"),
    "cross-entropy": (Fn(lambda m, x: F.cross_entropy(x, (x[:, 0] > 0).long(), ignore_index=1)),
                      "exact"),
    "weighted, smoothed cross-entropy": (Fn(lambda m, x: F.cross_entropy(
        x, (x[:, 0] > 0).long(), weight=torch.tensor([1.0, 2.0, 0.5], dtype=x.dtype),
        ignore_index=1, label_smoothing=0.1)), "exact"),
    "cross-entropy of probabilities": (Fn(lambda m, x: F.cross_entropy(
        x, x.detach().softmax(1) * 0.5 + 0.5 / 3)), "exact"),
    "NLL sum": (Fn(lambda m, x: F.nll_loss(x.log_softmax(1), (x[:, 1] > 0).long(),
                                           reduction="sum")), "exact"),
    "Huber loss": (Fn(lambda m, x: F.huber_loss(x, x.detach() * 0.3, delta=0.5)), "exact"),
    "eval BatchNorm": (nn.BatchNorm2d(3).eval(), "exact"),
    "LayerNorm over W": (nn.LayerNorm(8), "exact"),
    "LayerNorm over H, W": (nn.LayerNorm([15, 8]).double(), "exact"),
    "RMSNorm over H, W": (nn.RMSNorm([15, 8], eps=1e-6).double(), "exact"),
    "einsum over C": (Fn(lambda m, x: torch.einsum("nchw,dc->ndhw", x, m.layers[0].weight),
                         _lin(3, 2)), "exact"),
    "einsum over H": (Fn(lambda m, x: torch.einsum("nchw,nchw->nc", x, x)), "sums over dim 2"),
    "matmul over W": (Fn(lambda m, x: x @ m.layers[0].weight.t(), _lin(8, 4)), "exact"),
    "matmul over H": (Fn(lambda m, x: x.transpose(2, 3) @ x), "contracts dim 3"),
    "attention over H": (Fn(lambda m, x: F.scaled_dot_product_attention(x, x, x)), "exact"),
    "Flatten layer": (nn.Flatten(), "flatten flattens dim 2"),
    "PixelShuffle": (Fn(lambda m, x: F.pixel_shuffle(torch.cat([x, x, x, x][:4], 1)[:, :4], 2)),
                     "moves values between channels and positions"),
    "a whole positional field": (Fn(lambda m, x: x + m.pos), "exact"),
    "a field of one shard's size": (Fn(lambda m, x: x + m.pos), "one that is whole along it"),
    "a mean by hand": (Fn(lambda m, x: x.sum((2, 3)) / (x.shape[2] * x.shape[3])),
                       "this rank's share of dim 2"),
    "a float of a local size": (Fn(lambda m, x: x * (x.shape[2] * 0.5)),
                                "mul is given shape[2] * 0.5, computed from this rank's share"),
    "a ratio of a local size": (Fn(lambda m, x: x * math.floor(x.shape[2] / 1.5 * 10)),
                                "mul is given floor((shape[2] / 1.5) * 10), computed"),
    "vector norm of all": (Fn(lambda m, x: x / torch.linalg.vector_norm(x, 2)),
                           "reduces over dim 2, which is split over 'sp' and has no"),
    "torch.where(cond)": (Fn(lambda m, x: torch.stack(torch.where(x > 0)).sum() + x),
                          "lists the positions of nonzero values"),
    "conv2d(input=)": (Fn(lambda m, x: F.conv2d(input=x, weight=m.layers[0].weight, padding=1),
                          _conv(3, 2)), "exact"),
    # patches and resampling spmd.ops has no twin for: refused in the plan
    "F.unfold over H": (Fn(lambda m, x: F.unfold(x, 3, padding=1)),
                        "F.unfold extracts patches across dim 2, which is split over 'sp'"),
    "nn.Unfold over H": (nn.Unfold(2), "F.unfold extracts patches across dim 2"),
    "F.unfold of split channels": (Fn(lambda m, x: F.unfold(x.transpose(1, 2), 2)), "exact"),
    "x.unfold over W": (Fn(lambda m, x: x.unfold(3, 2, 2).sum(-1)), "exact"),
    "area over H": (Fn(lambda m, x: F.interpolate(x, scale_factor=0.5, mode="area")),
                    "F.interpolate averages areas (mode='area') along dim 2"),
    "area's fix": (Fn(lambda m, x: F.adaptive_avg_pool2d(x, (7, 4))), "exact"),
    "area of split channels": (Fn(lambda m, x: F.interpolate(x.transpose(1, 2), size=(3, 4),
                                                             mode="area")), "exact"),
    "antialias over H": (Fn(lambda m, x: F.interpolate(x, scale_factor=0.5, mode="bilinear",
                                                       antialias=True)),
                         "filters with antialias=True along dim 2"),
    # a classifier's head (torchvision's ResNet, VGG): the pool's one row is whole on every
    # rank, so the flatten and the Linear after it see what one device sees
    "AdaptiveAvgPool2d(1) head": (nn.Sequential(_conv(3, 4), nn.ReLU(),
                                                nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                                _lin(4, 5)), "exact"),
    "AdaptiveMaxPool2d(1) head": (nn.Sequential(_conv(3, 4),
                                                nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                                                _lin(4, 5)), "exact"),
    "adaptive pool to one row, three columns": (
        nn.Sequential(nn.AdaptiveAvgPool2d((1, 3)), nn.Flatten(), _lin(9, 2)), "exact"),
    "adaptive pool to two rows, then flatten": (
        nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), _lin(12, 2)),
        "flatten flattens dim 2, which is split"),
}


def _make(name):
    model, outcome = CASES[name]
    model = model.double()
    if name == "a whole positional field":  # each rank adds its rows of it
        model.pos = nn.Parameter(torch.randn(1, 1, 15, 8, dtype=F64))
    if name == "a field of one shard's size":  # one device could not add it either
        model.pos = nn.Parameter(torch.randn(1, 1, 5, 8, dtype=F64))
    if name == "batch norm of other buffers":  # not the calling layer's buffers
        model.rm, model.rv = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    return model, outcome


def _x(seed=0):
    return torch.randn(2, 3, 15, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_is_exact_or_refused_before_anything_runs(name):
    model, outcome = _make(name)
    mesh = spmd.Mesh((3,), ("sp",))
    x = _x()
    if outcome != "exact":
        with pytest.raises(spmd.SpecError, match=r"would be wrong on shards") as e:
            spmd.nn.convert(model, mesh, H, example=x)
        assert outcome in str(e.value)
        # without example=, the first forward refuses on every rank, before any transfer
        conv = spmd.nn.convert(model, mesh, H)
        if name == "a field of one shard's size":
            # The plan's stand-in sizes cannot tell a shard's size from the global one:
            # the run refuses before data moves, from the layout shard_map gave the input.
            with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError, match=outcome):
                spmd.shard_map(conv, mesh, H, P())(x)
            assert stats.calls() == 0
            return
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError, match="nothing has run"):
            spmd.shard_map(conv, mesh, H, P())(x)
        assert stats.calls() == 0
        return
    conv = spmd.nn.convert(model, mesh, H, example=x)
    out = eval(conv.spmd_plan.outputs[0], {"P": P})  # noqa: S307 - the plan's own repr
    assert_matches_single_device(conv, model, mesh, H, out, x)


def _refusal_on_every_rank(mesh, model, x):
    try:
        model(x)
    except spmd.SpecError as e:
        return str(e)


def test_a_refusal_is_the_same_on_every_rank_of_uneven_shards():
    """Ranks hold 6, 5 and 4 rows: every one raises the same error (decided from the
    split, never from a rank's size)."""
    mesh = spmd.Mesh((3,), ("sp",))
    conv = spmd.nn.convert(Fn(lambda m, x: torch.roll(x, 1, dims=2) + x.mean()), mesh, H)
    lay = spmd.Layout((2, 3, 15, 8), H, mesh, {2: [6, 5, 4]})
    x = _x()
    msgs = spmd.launch(lambda m: _refusal_on_every_rank(m, conv, lay.shard(x, m.rank)),
                       (3,), ("sp",))
    assert len(set(msgs)) == 1 and "torch.roll" in msgs[0]


def test_the_refusal_names_the_layer_the_line_the_dim_and_the_fix():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = _conv(3, 3)

        def forward(self, x):
            y = self.conv(x)
            return y[:, :, 1:] - y[:, :, :-1]  # the line named below

    model = nn.Sequential(_conv(3, 3), Block()).double()
    with pytest.raises(spmd.SpecError) as e:
        spmd.nn.convert(model, spmd.Mesh((2,), ("sp",)), H, example=(1, 3, 10, 4))
    msg = str(e.value)
    assert "in '1' (test_conversion.py:" in msg
    assert "slices dim 2, which is split over 'sp'" in msg and "spmd.halo_pad" in msg


def _loop(m, x):
    rows = [x[:, :, i].sum() for i in range(x.shape[2])]  # this rank's count of rows
    return torch.stack(rows).sum() + x


@pytest.mark.parametrize("example", [True, False])
def test_a_refusal_shows_sizes_as_computed_one_line_per_call_site(example):
    """A split dim's size shows as the expression it came from, never the plan's
    stand-in size as if it were a share; with example= the global size and its balanced
    shares (37 over 4 ranks: 10, 9, 9, 9). A loop repeats one call site: one line. Many
    call sites: under 2,000 characters, the rest counted."""
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(2, 3, 37, 8, dtype=F64)

    def refusal(f):
        model = f if isinstance(f, nn.Module) else Fn(f)
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
            conv = spmd.nn.convert(model, mesh, H, **({"example": x} if example else {}))
            spmd.shard_map(conv, mesh, H, P())(x)
        assert stats.calls() == 0
        return str(e.value)
    msg = refusal(lambda m, x: x.sum((2, 3)) / (x.shape[2] * x.shape[3]))
    assert ("div is given shape[2] * 8, computed from this rank's share of dim 2, which is "
            "split over 'sp', where the global size is meant") in msg
    msg = refusal(lambda m, x: x * torch.linspace(0, 1, x.shape[2], dtype=x.dtype)[:, None])
    assert "builds coordinates from shape[2], this rank's share of dim 2, which is split over " \
           "'sp'" + (" (37 in all: 10, 9, 9, 9 on its 4 ranks if balanced)" if example else ":") \
           in msg
    for msg in (msg, refusal(lambda m, x: x.sum((2, 3)) / (x.shape[2] * x.shape[3]))):
        assert "896" not in msg and "7168" not in msg
    msg = refusal(_loop)
    assert msg.count("\n  - ") == 1 and "1 call(s) in Fn's forward" in msg
    assert "picks one position of dim 2" in msg and "reached more than once" in msg
    rolls = [Fn(lambda m, x: torch.roll(x, 1, dims=2)) for _ in range(29)]
    msg = refusal(Fn(lambda m, x: sum(layer(x) for layer in m.layers), *rolls))
    assert len(msg) < 2000 and "29 call(s) in Fn's forward" in msg
    shown = msg.count("\n  - ")
    assert 1 < shown < 29 and f"... and {29 - shown} more call site(s)" in msg


def test_a_refusal_at_run_time_shows_this_ranks_size():
    """After a branch on data (the plan stops there), a refusal comes as the call runs,
    with the share each rank holds (10, 9, 9, 9), still before that call moves data."""
    def f(m, x):
        if x.mean() > -1e9:  # meta tensors cannot say which branch runs
            return F.interpolate(x, size=(2 * x.shape[2], x.shape[3]))
        return x
    x = _x().new_zeros(2, 3, 37, 8)

    def per_rank(mesh):
        lay = spmd.Layout((2, 3, 37, 8), H, mesh, {2: [10, 9, 9, 9]})
        conv = spmd.nn.convert(Fn(f), mesh, H)
        return _refusal_on_every_rank(mesh, conv, lay.shard(x, mesh.rank))
    msgs = spmd.launch(per_rank, (4,), ("sp",))
    for rank, msg in enumerate(msgs):
        assert (f"F.interpolate is given 2 * shape[2], computed from this rank's share of dim "
                f"2, which is split over 'sp' (here {2 * [10, 9, 9, 9][rank]}), where the "
                f"global size is meant") in msg


def test_the_halo_pad_rewrite_of_a_finite_difference_is_exact():
    """What the refusal points at: the stencil on halo_pad's output, in a shard_map
    body, equals the one-device difference with a zero row past the end."""
    mesh = spmd.Mesh((3,), ("sp",))
    x = _x(1)

    def local(x):
        xp = spmd.halo_pad(x, mesh, "sp", 2, (0, 1))
        return xp[:, :, 1:] - xp[:, :, :-1]

    def whole(x):
        xp = F.pad(x, (0, 0, 0, 1))
        return xp[:, :, 1:] - xp[:, :, :-1]
    assert_matches_single_device(local, whole, mesh, H, H, x)


def test_report_prints_the_plan():
    model = nn.Sequential(_conv(3, 4), nn.ReLU(), nn.GroupNorm(2, 4),
                          Fn(lambda m, x: F.avg_pool2d(x, 2).mean(dim=(2, 3)))).double()
    out = io.StringIO()
    with redirect_stdout(out):
        conv = spmd.nn.convert(model, spmd.Mesh((2,), ("sp",)), H, example=(2, 3, 10, 6),
                               report=True)
    text = out.getvalue()
    assert "swapped  in '0': torch.conv2d -> spmd.ops.conv2d" in text
    assert "swapped  in '2': F.group_norm -> spmd.ops.group_norm" in text
    assert "passed   1 calls on split tensors" in text and "F.relu" in text
    assert not conv.spmd_plan.refused and str(conv.spmd_plan) == text.strip()
    with pytest.raises(TypeError, match="report=True needs example="):
        spmd.nn.convert(model, spmd.Mesh((2,), ("sp",)), H, report=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(1, 3)

    def forward(self, x):
        return self.norm(x)


class ShardedBlock(nn.Module):
    """A hand-made sharded Block: the GroupNorm statistics summed over the mesh."""

    def __init__(self, block, mesh, spec):
        super().__init__()
        self.norm, self.mesh = block.norm, mesh

    @classmethod
    def from_torch(cls, block, mesh, spec):
        return cls(block, mesh, spec)

    def forward(self, x):
        n = spmd.psum(torch.tensor(float(x[0].numel()), dtype=x.dtype), "sp")
        mean = spmd.psum(x.sum((1, 2, 3), keepdim=True), "sp") / n
        var = spmd.psum(((x - mean) ** 2).sum((1, 2, 3), keepdim=True), "sp") / n
        y = (x - mean) / torch.sqrt(var + self.norm.eps)
        return y * self.norm.weight[:, None, None] + self.norm.bias[:, None, None]


def test_types_replacements_are_not_looked_into():
    mesh = spmd.Mesh((3,), ("sp",))
    model = nn.Sequential(_conv(3, 3), Block(), nn.ReLU()).double()
    conv = spmd.nn.convert(model, mesh, H, types={Block: ShardedBlock}, example=(2, 3, 15, 8))
    assert isinstance(conv[1], ShardedBlock)
    assert [e.kind for e in conv.spmd_plan.entries][:2] == ["swapped", "allowed"]
    assert_matches_single_device(conv, model, mesh, H, H, _x(), rtol=1e-9, atol=1e-9)


def test_spmd_calls_inside_a_converted_forward_are_refused():
    mesh = spmd.Mesh((2,), ("sp",))
    model = Fn(lambda m, x: x / spmd.psum(x.sum(), "sp"))
    conv = spmd.nn.convert(model, mesh, H)
    with pytest.raises(spmd.SpecError, match=r"psum is called inside the forward of a model "
                       r"made by spmd.nn.convert.*allow=\(ThatLayer,\)"):
        spmd.shard_map(conv, mesh, H, H)(_x())


def test_an_spmd_nn_layer_with_the_wrong_spec_is_refused():
    mesh = spmd.Mesh((2,), ("sp",))
    layer = spmd.nn.Conv2d(3, 3, 3, padding=1, mesh=mesh, spec=P(None, None, None, "sp"))
    conv = spmd.nn.convert(nn.Sequential(layer).double(), mesh, H)
    with pytest.raises(spmd.SpecError, match=r"has spec=P\(None, None, None, 'sp'\), but its "
                       r"input is split as P\(None, None, 'sp'\)"):
        spmd.shard_map(conv, mesh, H, H)(_x())


def test_data_dependent_control_flow_is_followed_at_run_time():
    """Meta tensors cannot say which branch runs: the plan stops there and the calls
    that run are checked as they run (the refused branch raises when taken)."""
    mesh = spmd.Mesh((3,), ("sp",))

    def f(m, x):
        if x.mean() > 0:  # a replicated mean (spmd.reduce): the same branch on every rank
            return m.layers[0](x)
        return torch.roll(x, 1, dims=2)
    model = Fn(f, _conv(3, 3))
    conv = spmd.nn.convert(model, mesh, H, example=(2, 3, 15, 8))
    assert "plan incomplete" in str(conv.spmd_plan)
    x = _x().abs()
    assert_matches_single_device(conv, model, mesh, H, H, x)
    with pytest.raises(spmd.SpecError, match="torch.roll shifts values along dim 2"):
        spmd.shard_map(conv, mesh, H, H)(-x)
    with pytest.raises(spmd.SpecError, match=r"strict=True\): the plan of Fn's forward stops "
                       r"short: RuntimeError"):
        spmd.nn.convert(model, mesh, H, example=(2, 3, 15, 8), strict=True)
    strict = spmd.nn.convert(model, mesh, H, strict=True)
    with pytest.raises(spmd.SpecError, match="stops short"):
        spmd.shard_map(strict, mesh, H, H)(x)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = _conv(3, 2)

    def forward(self, x, y):
        return self.conv(x) * y.mean(dim=1, keepdim=True)


def test_several_inputs_with_their_own_specs_and_a_2d_mesh():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    s = P("dp", None, "sp")
    model = TwoInputs()
    conv = spmd.nn.convert(model, mesh, (s, s))
    x, y = _x(2)[:, :, :9], _x(3)[:, :, :9]
    assert_matches_single_device(conv, model, mesh, (s, s), s, x, y)


class SequenceFirst(nn.Module):
    """nn.MultiheadAttention in its default (L, N, E) layout with a (N, L) padding mask."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2).double()

    def forward(self, x, key_padding_mask=None):
        return self.att(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]


def test_a_spec_per_input_by_name_reaches_a_keyword_padding_mask():
    mesh = spmd.Mesh((4,), ("sp",))
    model = SequenceFirst()
    specs = {"x": P("sp"), "key_padding_mask": P(None, "sp")}
    conv = spmd.nn.convert(model, mesh, specs, example={"x": (37, 2, 8),
                                                        "key_padding_mask": (2, 37)})
    assert "input 'x': P('sp'), input 'key_padding_mask': P(None, 'sp')" in str(conv.spmd_plan)
    x = torch.randn(37, 2, 8, dtype=F64)
    mask = torch.zeros(2, 37, dtype=torch.bool)
    mask[0, 30:] = True  # the padding lies in the last rank's keys
    assert_matches_single_device(conv, model, mesh, (P("sp"), P(None, "sp")), P("sp"), x, mask)
    # passed by keyword, as a caller writes it
    y = spmd.shard_map(lambda a, m: conv(a, key_padding_mask=m), mesh,
                       (P("sp"), P(None, "sp")), P("sp"))(x, mask)
    torch.testing.assert_close(y, model(x, key_padding_mask=mask), rtol=1e-10, atol=1e-10)


def test_one_spec_for_a_mask_of_other_dims_is_refused_with_the_spec_by_name():
    mesh = spmd.Mesh((2,), ("sp",))
    conv = spmd.nn.convert(SequenceFirst(), mesh, P("sp"))  # splits the mask's batch
    x, mask = torch.randn(9, 2, 8, dtype=F64), torch.zeros(2, 9, dtype=torch.bool)
    with spmd.comm_stats() as stats, pytest.raises(
            spmd.SpecError, match=r"key padding mask whose batch is not split .*"
                                  r"'key_padding_mask': P\(None, 'sp'\)"):
        spmd.shard_map(lambda a, m: conv(a, key_padding_mask=m), mesh,
                       (P("sp"), P(None, "sp")), P("sp"))(x, mask)
    assert stats.calls() == 0
    with pytest.raises(spmd.SpecError, match=r"spec names 'mask', which SequenceFirst.forward "
                                             r"does not take \(its parameters: x, "
                                             r"key_padding_mask\)"):
        spmd.nn.convert(SequenceFirst(), mesh, {"mask": P(None, "sp")})


def test_bad_arguments():
    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        spmd.nn.convert(lambda x: x, mesh, H)
    with pytest.raises(TypeError, match="mesh must be a spmd.Mesh"):
        spmd.nn.convert(nn.ReLU(), "sp", H)
    with pytest.raises(spmd.SpecError, match="'dp' is not an axis"):
        spmd.nn.convert(nn.ReLU(), mesh, P("dp"))
    with pytest.raises(TypeError, match="allow takes nn.Module types and functions"):
        spmd.nn.convert(nn.ReLU(), mesh, H, allow=(3,))
    with pytest.raises(TypeError, match="example must be a tensor, a shape"):
        spmd.nn.convert(nn.ReLU(), mesh, H, example=("x",))
    conv = spmd.nn.convert(nn.ReLU(), mesh, P(None, None, None, None, "sp"))
    with pytest.raises(spmd.SpecError, match="has 4 dims but its spec"):
        spmd.shard_map(conv, mesh, H, H)(_x())


def test_allowed_functions_pass():
    mesh = spmd.Mesh((2,), ("sp",))
    model = Fn(lambda m, x: torch.roll(x, 1, dims=3))  # W is whole: no refusal needed
    spmd.nn.convert(model, mesh, H, example=(1, 3, 8, 8))
    model = Fn(lambda m, x: torch.cumsum(x, dim=2))
    with pytest.raises(spmd.SpecError, match="cumsum mixes values along dim 2"):
        spmd.nn.convert(model, mesh, H, example=(1, 3, 8, 8))
    conv = spmd.nn.convert(model, mesh, H, example=(1, 3, 8, 8), allow=(torch.cumsum,))
    assert [e.kind for e in conv.spmd_plan.entries] == ["allowed"]


# -- random models from a menu: exact, or refused; never silently wrong --------------------------

class Counter(nn.Module):
    """A step counter kept in a buffer, updated in place in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros((), dtype=F64))

    def forward(self, x):
        self.n += 1
        return x * (1 + 0.1 * self.n)


def _hooked(x):
    if x.requires_grad:  # the gradient scaled by its global largest value
        x.register_hook(lambda g: g / (1 + g.abs().amax()))
    return x * 1.5


def _ckpt(f):
    return lambda m, x: checkpoint(lambda t: f(m, t), x, use_reentrant=False)


def _menu(split_dim: int):
    """Steps (name, layer or function, mixes along the split dim?)."""
    other = 5 - split_dim
    return {
        # backward-time code, state and random draws
        "checkpointed conv": lambda c: (Fn(_ckpt(lambda m, t: m.layers[0](t)), _conv(c, c)),
                                        False),
        "checkpointed mean": lambda c: (Fn(_ckpt(lambda m, t: t * t.mean((2, 3), keepdim=True))),
                                        False),
        "checkpointed norm": lambda c: (Fn(_ckpt(lambda m, t: m.layers[0](t).relu()),
                                           nn.GroupNorm(1, c).double()), False),
        "gradient hook": lambda c: (Fn(lambda m, x: _hooked(x)), False),
        "counter": lambda c: (Counter(), False),
        "dropout after mean": lambda c: (Fn(lambda m, x: x * F.dropout(
            x.mean((2, 3), keepdim=True), 0.3)), False),
        "dropout": lambda c: (nn.Dropout(0.3), False),
        "channel dropout": lambda c: (nn.Dropout2d(0.3), False),
        "conv": lambda c: (_conv(c, c), False),
        "conv stride 2": lambda c: (nn.Conv2d(c, c, 3, stride=2, padding=1).double(), False),
        "reflect conv": lambda c: (_conv(c, c, padding_mode="reflect"), False),
        "max pool": lambda c: (nn.MaxPool2d(2, ceil_mode=True), False),
        "avg pool": lambda c: (Fn(lambda m, x: F.avg_pool2d(x, 3, 1, 1)), False),
        "upsample": lambda c: (nn.Upsample(scale_factor=2, mode="bilinear"), False),
        "group norm": lambda c: (nn.GroupNorm(1, c).double(), False),
        "batch norm": lambda c: (nn.BatchNorm2d(c).double(), False),
        "batch norm untracked": lambda c: (nn.BatchNorm2d(c, track_running_stats=False)
                                           .double(), False),
        "gelu": lambda c: (nn.GELU(), False),
        "residual": lambda c: (Fn(lambda m, x: x + m.layers[0](x), _conv(c, c)), False),
        "cat channels": lambda c: (Fn(lambda m, x: m.layers[0](torch.cat([x, x.tanh()], 1)),
                                      nn.Conv2d(2 * c, c, 1).double()), False),
        "mean over H, W": lambda c: (Fn(lambda m, x: x - x.mean((2, 3), keepdim=True)), False),
        "mean over C": lambda c: (Fn(lambda m, x: x - x.mean(1, keepdim=True)), False),
        "roll split": lambda c: (Fn(lambda m, x: torch.roll(x, 1, split_dim)), True),
        "roll whole": lambda c: (Fn(lambda m, x: torch.roll(x, 1, other)), False),
        "diff split": lambda c: (Fn(lambda m, x: torch.diff(x, dim=split_dim)), True),
        "softmax C": lambda c: (nn.Softmax(dim=1), False),
        "softmax split": lambda c: (nn.LogSoftmax(dim=split_dim), False),
        "transposed conv": lambda c: (nn.ConvTranspose2d(c, c, 2, stride=2).double(), False),
        "reflect pad": lambda c: (Fn(lambda m, x: F.pad(x, (1, 2, 2, 1), mode="reflect")), False),
        "linear on channels": lambda c: (Fn(lambda m, x: m.layers[0](x.permute(0, 2, 3, 1))
                                            .permute(0, 3, 1, 2), _lin(c, c)), False),
        "squeeze-excite": lambda c: (Fn(lambda m, x: x * torch.sigmoid(
            m.layers[0](x.mean((2, 3))))[:, :, None, None], _lin(c, c)), False),
        "cumsum split": lambda c: (Fn(lambda m, x: x.cumsum(split_dim)), True),
        "cumsum whole": lambda c: (Fn(lambda m, x: x.cumsum(other)), False),
        "slice split": lambda c: (Fn(lambda m, x: x.narrow(split_dim, 1, x.shape[split_dim] - 1)
                                     - x.narrow(split_dim, 0, x.shape[split_dim] - 1)), True),
        "slice whole": lambda c: (Fn(lambda m, x: x[..., 1:] - x[..., :-1] if other == 3 else
                                     x[:, :, 1:] - x[:, :, :-1]), False),
    }


@settings(max_examples=25)
@given(steps=st.lists(st.sampled_from(sorted(_menu(2))), min_size=1, max_size=4),
       split=st.sampled_from([2, 3]), ranks=st.sampled_from([2, 3]),
       hw=st.tuples(st.integers(7, 12), st.integers(7, 12)), seed=st.integers(0, 3))
def test_random_models_are_exact_or_refused(steps, split, ranks, hw, seed):
    torch.manual_seed(seed)
    menu = _menu(split)
    layers, mixes = [], False
    for s in steps:
        layer, m = menu[s](2)
        layers.append(layer)
        mixes |= m
    model = nn.Sequential(*layers).double()
    spec = P(*([None] * split), "sp")
    mesh = spmd.Mesh((ranks,), ("sp",))
    x = torch.randn(2, 2, *hw, generator=torch.Generator().manual_seed(seed), dtype=F64)
    try:
        model(x)
    except RuntimeError:  # torch refuses it on one device (a pad wider than the input):
        with pytest.raises((RuntimeError, ValueError)):  # so must every rank
            spmd.shard_map(spmd.nn.convert(model, mesh, spec), mesh, spec, spec)(x)
        return
    try:
        conv = spmd.nn.convert(model, mesh, spec, example=x)
    except spmd.SpecError as e:
        assert mixes, f"refused a model that is exact on shards: {steps}\n{e}"
        return
    assert not mixes, f"accepted a model that mixes along the split dim: {steps}"
    out = eval(conv.spmd_plan.outputs[0], {"P": P})  # noqa: S307
    if any("dropout" in s for s in steps):
        _matches_with_the_same_draws(conv, model, mesh, spec, out, x)
    else:
        assert_matches_single_device(conv, model, mesh, spec, out, x)


def _matches_with_the_same_draws(conv, model, mesh, spec, out, x):
    """Values and gradients (input, parameters) equal one device's where both draw from
    ``spmd.random.invariant`` with one seed: the same masks, whatever the mesh (float64,
    1e-10: sharded sums only reorder additions)."""
    got = []
    for f, run in ((model, lambda a: model(a)),
                   (conv, lambda a: spmd.shard_map(conv, mesh, spec, out)(a))):
        a = x.clone().requires_grad_()
        with spmd.random.invariant(11):
            y = run(a)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
        params = [p for _, p in f.named_parameters()]
        grads = torch.autograd.grad((y * w).sum(), [a] + params, allow_unused=True)
        got.append((y.detach(), grads))
    (y0, g0), (y1, g1) = got
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-10)
    for k, (a, b) in enumerate(zip(g1, g0)):
        assert (a is None) == (b is None), k
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"gradient {k}")


# -- training: a model written only with torch.nn.functional calls ------------------------------

class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 1, 3, 3, dtype=F64) * 0.3)
        self.w2 = nn.Parameter(torch.randn(4, 4, 3, 3, dtype=F64) * 0.3)
        self.w3 = nn.Parameter(torch.randn(1, 8, 1, 1, dtype=F64) * 0.3)
        self.gate = nn.Parameter(torch.randn(4, 4, dtype=F64) * 0.3)

    def forward(self, x):
        h = F.gelu(F.conv2d(x, self.w1, padding=1))
        d = F.max_pool2d(h, 2)
        d = F.silu(F.conv2d(F.pad(d, (1, 1, 1, 1), mode="circular"), self.w2))
        g = torch.sigmoid(d.mean(dim=(2, 3)) @ self.gate)[:, :, None, None]
        u = F.interpolate(d * g, scale_factor=2, mode="nearest")
        return F.conv2d(torch.cat([u, h], dim=1), self.w3)


def test_a_functional_model_trains_like_one_device():
    """F.conv2d, F.max_pool2d, circular F.pad, a mean over H and W, F.interpolate and a
    cat, written as functions: converted, with F.mse_loss inside the converted module
    (spmd.reduce under it), 3 SGD steps equal one device."""
    torch.manual_seed(0)
    plain = Functional()

    class WithLoss(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, t):
            return F.mse_loss(self.net(x), t)

    mesh = spmd.Mesh((3,), ("sp",))
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 1, 14, 6, generator=g, dtype=F64), torch.randn(2, 1, 14, 6, generator=g,
                                                                        dtype=F64)
    one = WithLoss(plain)
    sharded = spmd.nn.convert(WithLoss(plain), mesh, (H, H), example=(x, t))
    assert {e.call for e in sharded.spmd_plan.swapped} >= {"torch.conv2d", "F.max_pool2d", "F.pad",
                                                          "F.interpolate", "F.mse_loss", "mean"}
    opt1 = torch.optim.SGD(one.parameters(), lr=0.05)
    opt2 = torch.optim.SGD(sharded.parameters(), lr=0.05)
    for _ in range(3):
        opt1.zero_grad()
        opt2.zero_grad()
        l1 = one(x, t)
        l2 = spmd.shard_map(sharded, mesh, (H, H), P())(x, t)
        l1.backward()
        l2.backward()
        opt1.step()
        opt2.step()
        torch.testing.assert_close(l2, l1, rtol=1e-10, atol=1e-10)
    for (n, a), b in zip(sharded.named_parameters(), one.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=n)
