"""What ``spmd.nn.convert`` takes as a model: a layer of your own swapped for an spmd.nn
layer with ``types=`` (the advice its FFT refusal prints, followed as printed), and not a
model it made already.

Exact cases are float64: values and gradients within 1e-10 of one device (the split FFTs
reorder additions). The reference layer's complex weights are compared with the twin's
real pairs (``assert_matches_single_device`` casts a model's tensors to a real dtype).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
H = P(None, None, "sp")


class ReferenceSpectralConv2d(nn.Module):
    """The reference FNO's spectral convolution (Li et al.): complex weights for the low
    and the high rows of the kept modes."""

    def __init__(self, cin: int, cout: int, m1: int, m2: int):
        super().__init__()
        self.cin, self.cout, self.m1, self.m2 = cin, cout, m1, m2
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cdouble))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cdouble))

    def forward(self, x):
        xf = torch.fft.rfft2(x)
        out = torch.zeros(x.shape[0], self.cout, x.shape[-2], x.shape[-1] // 2 + 1,
                          dtype=xf.dtype)
        out[:, :, :self.m1, :self.m2] = torch.einsum(
            "bixy,ioxy->boxy", xf[:, :, :self.m1, :self.m2], self.weights1)
        out[:, :, -self.m1:, :self.m2] = torch.einsum(
            "bixy,ioxy->boxy", xf[:, :, -self.m1:, :self.m2], self.weights2)
        return torch.fft.irfft2(out, s=(x.shape[-2], x.shape[-1]))


def _fno(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 1, dtype=F64), ReferenceSpectralConv2d(3, 3, 4, 3),
                         nn.GELU(), nn.Conv2d(3, 1, 1, dtype=F64))


def _run(model: nn.Module, x: torch.Tensor, w: torch.Tensor, call=None):
    """The output, and the gradients of ``sum(out * w)`` for x and every weight."""
    x = x.clone().requires_grad_()
    y = (call or model)(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


def test_the_fft_refusals_advice_works_as_printed():
    """The refusal names ``types={YourLayer: spmd.nn.SpectralConv2d}``; passed as such,
    the model is exact (values, input and weight gradients) on 3 ranks of H = 13."""
    mesh = spmd.Mesh((3,), ("sp",))
    x = torch.randn(2, 2, 13, 8, dtype=F64)
    with pytest.raises(spmd.SpecError, match=r"types=\{YourLayer: spmd.nn.SpectralConv2d\}"):
        spmd.nn.convert(_fno(), mesh, H, example=x)
    conv = spmd.nn.convert(_fno(), mesh, H, example=x,
                           types={ReferenceSpectralConv2d: spmd.nn.SpectralConv2d})
    assert type(conv[1]) is spmd.nn.SpectralConv2d and conv[1].modes == (4, 3)
    ref = _fno()
    # the twin holds the reference's complex weights as real pairs, under the same names
    for k in ("weights1", "weights2"):
        assert torch.equal(torch.view_as_complex(getattr(conv[1], k)), getattr(ref[1], k))
    w = torch.randn(2, 1, 13, 8, dtype=F64)
    got = _run(conv, x, w, spmd.shard_map(conv, mesh, H, H))
    want = _run(ref, x, w)
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for g, r in zip(got[2], want[2]):  # the twin's real pairs against complex gradients
        torch.testing.assert_close(g, torch.view_as_real(r) if r.is_complex() else r, **tol)


def test_a_layer_without_fno_weights_is_named():
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights1 = nn.Parameter(torch.zeros(3, 3, 4, 3, dtype=torch.cdouble))
            self.weights2 = nn.Parameter(torch.zeros(3, 3, 4, dtype=torch.cdouble))

    mesh = spmd.Mesh((2,), ("sp",))
    with pytest.raises(TypeError, match=r"SpectralConv2d.from_torch expects a SpectralConv2d, "
                       r"or a layer computing FNO's spectral convolution with its weights "
                       r"weights1, weights2 .*; got Other whose weights2 is \[3, 3, 4\] "
                       r"complex128 \(weights1 is \[3, 3, 4, 3\]\)"):
        spmd.nn.convert(nn.Sequential(Other()), mesh, H,
                        types={Other: spmd.nn.SpectralConv2d})
    with pytest.raises(TypeError, match=r"got Linear whose weights1 is no such tensor"):
        spmd.nn.convert(nn.Sequential(nn.Linear(2, 2)), mesh, H,
                        types={nn.Linear: spmd.nn.SpectralConv2d})


def test_a_converted_model_is_not_converted_again():
    """Its forward already runs on shards of its own mesh: refused at convert, before
    any call, for the model and for a model that holds it as a layer."""
    net = nn.Conv2d(1, 1, 3, padding=1)
    once = spmd.nn.convert(net, spmd.Mesh((4,), ("sp",)), H)
    with spmd.comm_stats() as stats:
        with pytest.raises(spmd.SpecError, match=r"convert: Conv2d cannot be converted: it is "
                           r"already a model made by spmd.nn.convert.*convert the original "
                           r"single-device model once"):
            spmd.nn.convert(once, spmd.Mesh((2,), ("sp",)), H)
        with pytest.raises(spmd.SpecError, match=r"its layer '1' is already a model made by"):
            spmd.nn.convert(nn.Sequential(nn.ReLU(), once), spmd.Mesh((2,), ("sp",)), H)
    assert stats.calls() == 0


def test_a_lazy_layer_is_initialised_on_one_device_first():
    """A lazy layer's parameters appear at its first call: refused at convert (rank
    threads would each create them), named with the fix; after one call on one device,
    it converts and is exact."""
    mesh = spmd.Mesh((3,), ("sp",))
    torch.manual_seed(0)
    net = nn.Sequential(nn.LazyConv2d(2, 3, padding=1, dtype=F64), nn.GELU())
    with pytest.raises(spmd.SpecError, match=r"convert: LazyConv2d \(layer '0'\) has "
                       r"uninitialized parameters \(weight, bias: .*call the model once on "
                       r"one device with a small input"):
        spmd.nn.convert(net, mesh, H)
    net(torch.zeros(1, 2, 8, 8, dtype=F64))
    x, w = torch.randn(2, 2, 13, 8, dtype=F64), torch.randn(2, 2, 13, 8, dtype=F64)
    conv = spmd.nn.convert(net, mesh, H)
    got, want = _run(conv, x, w, spmd.shard_map(conv, mesh, H, H)), _run(net, x, w)
    for g, r in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dim", [2, 3])
def test_spmds_own_spectral_layers_and_fno_convert_as_they_are(dim):
    """A one-device spmd.nn.FNO (its SpectralConv layers) converts without types=: the
    spectral layers become their sharded selves, with the same weights, on uneven rows."""
    from spmd.nn import FNO
    torch.manual_seed(dim)
    fno = FNO(2, 1, modes=3, width=4, hidden=4, dim=dim, blocks=2).double()
    shape = (2, 2, 11, 6) if dim == 2 else (1, 2, 7, 5, 4)
    mesh = spmd.Mesh((3,), ("sp",))  # rows [4, 4, 3] and [3, 2, 2]
    conv = spmd.nn.convert(fno, mesh, H)
    x = torch.randn(shape, dtype=F64)
    assert_matches_single_device(conv, fno, mesh, H, H, x)
    assert conv.state_dict().keys() == fno.state_dict().keys()  # checkpoints load both ways
    assert type(conv.spectral[0]).__name__ == f"SpectralConv{dim}d" and conv.spectral[0].mesh is mesh


def test_spmds_own_multihead_attention_converts_as_it_is():
    torch.manual_seed(0)
    mha = spmd.nn.MultiheadAttention(8, 2, batch_first=True).double()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    mesh = spmd.Mesh((3,), ("sp",))
    s = P(None, "sp")
    block = Block()
    conv = spmd.nn.convert(block, mesh, s, example=(2, 10, 8))
    x = torch.randn(2, 10, 8, dtype=F64)
    assert_matches_single_device(conv, block, mesh, s, s, x)
