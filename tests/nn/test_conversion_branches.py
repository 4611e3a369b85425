"""Python branches on split dims' sizes inside a converted forward take the branch one
device takes, on every rank, or are refused before anything moves.

A comparison of sizes read from split dims (``a.shape[2] != b.shape[2]``, ``<``,
``min``, with arithmetic on them: ``h // 2``, against a plain number: ``h > 20``,
``if h % 2``) decides on their global lengths, which the layouts give; where one is not
known it is refused, naming the source line. A pad
amount computed from this rank's share (``round(0.25 * x.shape[2])``) is refused.

Results are compared with one device in float64 on 4 ranks of uneven rows (37 rows: 10,
9, 9, 9), to 1e-12 (convolutions' halo sums may reorder; the branches only move values).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn
from torch import nn

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
H = P(None, None, "sp")


def _mesh():  # made in each test: gloo workers import this module on meshes of 2
    return spmd.Mesh((4,), ("sp",))


class UpCat(nn.Module):
    """Pool twice, upsample, and pad to the skip's size where the pooling floored (as
    U-Nets do for odd sizes): the pad is taken on one device only where the global
    sizes differ, however the ranks' shares compare."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 2, 3, padding=1, dtype=F64)

    def forward(self, x):
        skip = F.max_pool2d(x, 2)  # 37 rows -> 18
        y = F.interpolate(F.max_pool2d(skip, 2), scale_factor=2)  # 18 -> 9 -> 18
        down = F.max_pool2d(x, 4)  # 9 rows
        if skip.shape[2] // 2 != down.shape[2]:  # arithmetic keeps the global value
            raise AssertionError("18 // 2 == 9 on one device")
        up = F.interpolate(down, scale_factor=4)  # 36 rows
        sp = [0, 0, 0, 0]
        if up.shape[2] != x.shape[2]:  # 36 != 37 on one device; 9 == 9 on ranks 1..3
            sp[3] = 1
        up = F.pad(up, sp, "replicate")
        if y.shape[-2] < skip.shape[-2] or min(y.shape[2], skip.shape[2]) != skip.shape[2]:
            raise AssertionError("equal on one device")
        return self.conv(torch.cat([x, up], 1))


def _x(rows=37, seed=0):
    return torch.randn(1, 2, rows, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("rows", [36, 37])
def test_a_branch_on_two_split_sizes_takes_the_one_device_branch_on_every_rank(rows, example):
    torch.manual_seed(0)
    model = UpCat()
    x = _x(rows)
    mesh = _mesh()
    conv = spmd.nn.convert(model, mesh, H, **({"example": x} if example else {}))
    got = spmd.shard_map(conv, mesh, H, H)(x)
    torch.testing.assert_close(got, model(x), rtol=0, atol=1e-12)


class OddPad(nn.Module):
    """Decisions on one split size against plain numbers: one device's, on every rank
    (37 rows are odd, shares 10, 9, 9, 9 are not all; 37 > 20, no share is)."""

    def forward(self, x):
        if x.shape[2] % 2:
            x = F.pad(x, (0, 0, 0, 1), "replicate")  # to an even count, as on one device
        if x.shape[2] > 20 and x.shape[-2] >= 38:
            x = x * 3
        if not x.shape[2] <= 20 and max(x.shape[2], 64) == 64:
            x = x - 1
        return F.avg_pool2d(x, 2)


@pytest.mark.parametrize("example", [True, False])
def test_a_branch_on_a_split_size_and_a_number_takes_the_one_device_branch(example):
    x = _x(37)
    mesh = _mesh()
    conv = spmd.nn.convert(OddPad(), mesh, H, **({"example": x} if example else {}))
    got = spmd.shard_map(conv, mesh, H, H)(x)
    torch.testing.assert_close(got, OddPad()(x), rtol=0, atol=1e-12)


class _Made(nn.Module):
    def forward(self, x):
        z = torch.zeros(x.shape[0], x.shape[1], x.shape[2], x.shape[3], dtype=x.dtype)
        if z.shape[2] != x.shape[2]:
            return x * 2
        return x + z


@pytest.mark.parametrize("example", [True, False])
def test_a_comparison_of_sizes_of_unknown_global_length_is_refused_before_anything_runs(
        example):
    x = _x()
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        mesh = _mesh()
        conv = spmd.nn.convert(_Made(), mesh, H, **({"example": x} if example else {}))
        spmd.shard_map(conv, mesh, H, H)(x)
    assert stats.calls() == 0
    msg = str(e.value)
    assert "nothing has run" in msg and msg.count("\n  - ") == 1, msg
    line = inspect.getsourcelines(_Made.forward)[1] + 2  # the `if z.shape[2] != ...`
    assert (f"  - in _Made (test_conversion_branches.py:{line}): deciding shape[2] != shape[2]: "
            "a split dim's size whose global length is not known here (a tensor made in the "
            "forward, or a layer not looked into): each rank would decide on its own share "
            "and the ranks could take different paths; decide on global sizes") in msg


def test_tracked_sizes_compare_on_their_global_values():
    from spmd.nn._tags import LocalSize
    a = LocalSize(3, (2, ("sp",)), glob=9)
    b = LocalSize(2, (2, ("sp",)), glob=8)
    assert a != b and a > b and not a == b and max(a, b) is a
    assert a // 3 == b // 3 + 1  # 9 // 3 == 8 // 3 + 1 on one device (1 != 0 + 1 here)
    assert (a * 0.5).glob == 4.5 and round(a * 0.5).glob == 4
    assert a == 9 and b < 9 and a % 2 and not b % 2  # a plain number: the global size too
    assert hash(a) == hash(3)  # hashable, as the int it is


class PatchEmbed(nn.Module):
    """timm's PatchEmbed with its default ``strict_img_size`` check (an assert on this
    rank's share of the rows would fail on every rank)."""

    def __init__(self, img=64, p=16, c=3, d=32):
        super().__init__()
        self.img_size, self.proj = (img, img), nn.Conv2d(c, d, p, stride=p, dtype=F64)

    def forward(self, x):
        _, _, h, w = x.shape
        assert h == self.img_size[0], f"Input height ({h}) doesn't match model ({self.img_size[0]})."
        assert w == self.img_size[1], f"Input width ({w}) doesn't match model ({self.img_size[1]})."
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    """A ViT as timm writes it: checked patches, a learned positional table, one block,
    average pooling over the tokens by an identity slice (``t[:, 0:]``)."""

    def __init__(self):
        super().__init__()
        self.patch = PatchEmbed()
        self.pos = nn.Parameter(torch.randn(1, 16, 32, dtype=F64) * 0.02)
        self.block = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True,
                                                dtype=F64)
        self.head = nn.Linear(32, 3, dtype=F64)

    def forward(self, x):
        t = self.block(self.patch(x) + self.pos)
        return self.head(t[:, 0:].mean(1))


class Divisible(nn.Module):
    """segmentation-models' check that the input's size divides by 32, then a pyramid
    level pooled and upsampled back."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, dtype=F64)

    def forward(self, x):
        h, w = x.shape[-2:]
        if h % 32 != 0 or w % 32 != 0:
            raise RuntimeError(f"Wrong input shape height={h}, width={w}. Expected image "
                               f"height and width divisible by 32.")
        y = self.conv(x)
        return F.interpolate(F.max_pool2d(y, 2), scale_factor=2) + y


@pytest.mark.parametrize("ranks", [3, 4])
@pytest.mark.parametrize("make,out", [(ViT, P()), (Divisible, H)], ids=["vit", "divisible"])
def test_a_librarys_check_of_the_input_size_sees_the_global_size(make, out, ranks):
    """64 rows over 3 ranks: 22, 21, 21 (each a share no check expects)."""
    torch.manual_seed(0)
    net = make().eval()
    mesh = spmd.Mesh((ranks,), ("sp",))
    conv = spmd.nn.convert(net, mesh, H)
    assert_matches_single_device(conv, net, mesh, H, out, torch.randn(1, 3, 64, 64))


class DomainPadding(nn.Module):
    """neuraloperator's ``DomainPadding(0.25)`` in plain torch: pads each spatial dim by
    a fraction of its size, which on a rank would be its share's (2 rows, not 10)."""

    def __init__(self, fraction: float, left: bool):
        super().__init__()
        self.fraction, self.left = fraction, left

    def forward(self, x):
        pads = [round(self.fraction * r) if self.left else round(r * self.fraction)
                for r in x.shape[2:]]
        full = []
        for p in pads[::-1]:
            full += [0, p]
        return F.pad(x, full, mode="constant")


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("left", [True, False])
def test_a_pad_of_a_fraction_of_the_share_is_refused(left, example):
    x = torch.randn(1, 2, 40, 8, dtype=F64)
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        mesh = _mesh()
        conv = spmd.nn.convert(DomainPadding(0.25, left), mesh, H,
                               **({"example": x} if example else {}))
        spmd.shard_map(conv, mesh, H, H)(x)
    assert stats.calls() == 0
    msg = str(e.value)
    assert "  - in DomainPadding (test_conversion_branches.py:" in msg and "F.pad is given" in msg
    if left:  # Python made it a plain number: found by planning at other sizes
        assert "computed from a split dim's size (it changes with that size" in msg
        assert ("10 at the global sizes" in msg) == example
    else:  # a tracked size
        assert "round(shape[2] * 0.25), computed from this rank's share of dim 2" in msg


def _mean_squares(mesh, model, x):
    """Per-rank (gloo processes): the converted model's mean square, the same on both."""
    conv = spmd.nn.convert(Fn(lambda m, x: m.layers[0](x).square().mean(), model), mesh, H)
    return spmd.shard_map(conv, mesh, H, P())(x).item()


@pytest.mark.gloo
@pytest.mark.parametrize("net", [UpCat, OddPad])
def test_branches_on_split_sizes_agree_on_gloo_processes_world2(gloo2, net):
    # 37 rows as 19 and 18: each process alone would pad (or not) otherwise, and its
    # collectives would wait for the other's
    torch.manual_seed(0)
    model, x = net(), _x(37)
    got = gloo2.run(_mean_squares, (2,), ("sp",), args=(model, x))
    want = model(x).square().mean().item()
    assert got == [pytest.approx(want, rel=1e-12, abs=0)] * 2
