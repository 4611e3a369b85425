"""torch.fft's transforms over split dims inside a converted forward run as spmd.fft's:
the spectrum is tagged with the layout spmd.fft gives it (split along another dim), the
inverse comes back to the spatial layout, and values and gradients are those of one
device (float64, ``assert_matches_single_device``'s 1e-10: the transforms reorder sums).
Four ranks over 37 rows (shards of 10, 9, 9, 9)."""
from __future__ import annotations

import pytest
import torch
from _modules import Fn, assert_refused_before_anything_runs
from torch import nn

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
H = P(None, None, "sp")


class SpectralConv(nn.Module):
    """neuraloperator's SpectralConv2d as written there: low modes of rfft2, mixed by
    complex weights, written into a zero spectrum, irfft2 with s=."""

    def __init__(self, c=3, m1=4, m2=3):
        super().__init__()
        self.m1, self.m2 = m1, m2
        self.w = nn.Parameter(torch.randn(c, c, m1, m2, dtype=torch.cdouble) / c)

    def forward(self, x):
        b, c, h, w = x.shape
        x_ft = torch.fft.rfft2(x)
        out = torch.zeros(b, c, h, w // 2 + 1, dtype=x_ft.dtype)
        out[:, :, :self.m1, :self.m2] = torch.einsum(
            "bixy,ioxy->boxy", x_ft[:, :, :self.m1, :self.m2], self.w)
        return torch.fft.irfft2(out, s=(h, w))


CASES = {
    "rfft2, filter, irfft2 with s=": (
        lambda m, x: torch.fft.irfft2(torch.fft.rfft2(x) * 0.5, s=x.shape[-2:]) + x, "exact"),
    "fft2 and ifft2": (lambda m, x: torch.fft.ifft2(torch.fft.fft2(x).conj()).real, "exact"),
    "fftn and ifftn over H, W": (
        lambda m, x: torch.fft.ifftn(torch.fft.fftn(x, dim=(2, 3)) * 2, dim=(2, 3)).real, "exact"),
    "rfftn and irfftn, norm='ortho'": (
        lambda m, x: torch.fft.irfftn(torch.fft.rfftn(x, dim=(2, 3), norm="ortho").abs() + 0j,
                                      s=x.shape[2:], dim=(2, 3), norm="ortho"), "exact"),
    "fft and ifft over H": (
        lambda m, x: torch.fft.ifft(torch.fft.fft(x, dim=2) * 2, dim=2).real, "exact"),
    "rfft and irfft over H with n=": (
        lambda m, x: torch.fft.irfft(torch.fft.rfft(x, dim=2), n=x.shape[2], dim=2), "exact"),
    "a length computed from a share": (
        lambda m, x: torch.fft.irfft2(torch.fft.rfft2(x), s=(x.shape[2] * 2, x.shape[3])),
        "is given shape[2] * 2, computed from this rank's share of dim 2"),
    "hfft over H": (lambda m, x: torch.fft.hfft(x + 0j, dim=2),
                    "torch.fft.hfft transforms dim 2, which is split over 'sp'"),
    "neuraloperator SpectralConv": (
        SpectralConv(), "indexing x[...] slices dim 3, which is split over 'sp' (a spectrum "
                        "split along its frequencies by the FFT before"),
}


@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_each_transform_is_exact_or_refused(name, batch):
    f, outcome = CASES[name]
    model = (f if isinstance(f, nn.Module) else Fn(f)).double()
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(batch, 3, 37, 10, generator=torch.Generator().manual_seed(0), dtype=F64)
    if outcome != "exact":
        assert_refused_before_anything_runs(model, mesh, H, x, outcome)
        return
    conv = spmd.nn.convert(model, mesh, H, example=x)
    assert "-> spmd.fft." in str(conv.spmd_plan)
    assert_matches_single_device(conv, model, mesh, H, H, x)
    # planned at the first call, from the layout shard_map gives the input
    assert_matches_single_device(spmd.nn.convert(model, mesh, H), model, mesh, H, H, x)


def test_the_spectrum_is_tagged_split_along_the_last_frequency_dim():
    mesh = spmd.Mesh((4,), ("sp",))
    model = Fn(lambda m, x: torch.fft.rfft2(x).abs())
    x = torch.randn(2, 3, 37, 16, dtype=F64)
    conv = spmd.nn.convert(model, mesh, H, example=x)
    plan = str(conv.spmd_plan)
    assert "-> spmd.fft.rfft2 ([2, 3, 37, 9] P(None, None, None, 'sp') sp=[3, 2, 2, 2])" in plan
    assert conv.spmd_plan.outputs[0] == "P(None, None, None, 'sp')"
    out = P(None, None, None, "sp")
    assert_matches_single_device(conv, model, mesh, H, out, x)


def test_uneven_shards_come_back_to_their_layout():
    mesh = spmd.Mesh((4,), ("sp",))
    model = Fn(lambda m, x: x + torch.fft.irfft2(torch.fft.rfft2(x) * 0.5, s=x.shape[-2:]))
    x = torch.randn(2, 3, 37, 10, dtype=F64)
    lay = spmd.Layout(x.shape, H, mesh, {2: [20, 5, 6, 6]})
    y = spmd.shard_map(spmd.nn.convert(model, mesh, H), mesh, H, H)(
        spmd.Sharded.from_global(x, mesh, lay))
    assert y.layout.sizes[2] == (20, 5, 6, 6)
    torch.testing.assert_close(spmd.gather(y, mesh), model(x), rtol=0, atol=1e-12)
    # the inverse itself goes back to the input's sizes (not balanced ones)
    inv = Fn(lambda m, x: torch.fft.irfft2(torch.fft.rfft2(x), s=x.shape[-2:]))
    y = spmd.shard_map(spmd.nn.convert(inv, mesh, H), mesh, H, H)(
        spmd.Sharded.from_global(x, mesh, lay))
    assert y.layout.sizes[2] == (20, 5, 6, 6)


def test_a_pencil_on_a_mesh_of_two_axes():
    """H and W split over two mesh axes: spmd.fft's pencil (two transposes each way)."""
    mesh = spmd.Mesh((2, 2), ("a", "b"))
    spec = P(None, None, "a", "b")
    model = Fn(lambda m, x: torch.fft.irfft2(torch.fft.rfft2(x) * 0.5, s=x.shape[-2:]) + x)
    x = torch.randn(1, 2, 37, 10, dtype=F64)
    conv = spmd.nn.convert(model, mesh, spec, example=x)
    assert_matches_single_device(conv, model, mesh, spec, spec, x)
    assert_matches_single_device(spmd.nn.convert(model, mesh, spec), model, mesh, spec, spec, x)
