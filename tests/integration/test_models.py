"""Real models of other libraries through ``spmd.nn.convert``, where those libraries are
installed (``pip install -e ".[models]"``; skipped otherwise): small configurations built
in the test (no downloads), float64, 4 rank threads on rows that split unevenly (at the
input or after the first pooling), compared with one device.

Tolerance 1e-12: only the order of the convolutions' halo sums and of the norms'
reductions differs from one device.
"""
from __future__ import annotations

import pytest
import torch

import spmd
from spmd import P

F64 = torch.float64
ROWS = P(None, None, "sp")
MESH = spmd.Mesh((4,), ("sp",))


def _sample(out):
    return getattr(out, "sample", out)  # diffusers returns an output dataclass


def _converted(model, x, **kw):
    conv = spmd.nn.convert(model, MESH, ROWS)
    return spmd.shard_map(lambda x: _sample(conv(x, **kw)), MESH, ROWS, ROWS)(x)


def _exact(model, x, **kw):
    torch.testing.assert_close(_converted(model, x, **kw), _sample(model(x, **kw)),
                               rtol=0, atol=1e-12)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("rows", [36, 37])
def test_monai_basic_unet_2d_on_rows_the_poolings_floor(rows):
    # 36 rows pool to 9 then 4: its UpCat pads 8 back to 9, where the ranks' shares of 9
    # (3, 2, 2, 2) and of 8 (2, 2, 2, 2) compare otherwise on rank 0 than on the others
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.BasicUNet(spatial_dims=2, in_channels=1, out_channels=2,
                           features=(4, 4, 8, 8, 16, 4)).double().eval()
    _exact(model, _x(1, 1, rows, 16))


def test_monai_basic_unet_3d_on_37_slices():
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.BasicUNet(spatial_dims=3, in_channels=1, out_channels=1,
                           features=(2, 2, 4, 4, 8, 2)).double().eval()
    _exact(model, _x(1, 1, 37, 16, 16))


def test_monai_unet_with_residual_units():
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16),
                      strides=(2, 2), num_res_units=1).double().eval()
    _exact(model, _x(1, 1, 36, 16))  # 9 rows a rank, then 5, 5, 4, 4


def _diffusers():
    return pytest.importorskip("diffusers")


def test_diffusers_unet2d_without_attention():
    diffusers = _diffusers()
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(
        in_channels=2, out_channels=2, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), layers_per_block=1, norm_num_groups=4,
        add_attention=False).double().eval()
    _exact(model, _x(1, 2, 38, 16), timestep=3)  # 10, 10, 9, 9 rows


def _attention_unet(diffusers):
    return diffusers.UNet2DModel(
        in_channels=2, out_channels=2, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
        norm_num_groups=4, attention_head_dim=4).double().eval()


def _vae(diffusers):
    return diffusers.AutoencoderKL(
        in_channels=2, out_channels=2, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=2, norm_num_groups=4,
        layers_per_block=1).double().eval()


ATTENTION = {
    "UNet2DModel with attention": (_attention_unet, {"timestep": 3}),
    "AutoencoderKL": (_vae, {"sample_posterior": False}),
}


@pytest.mark.parametrize("name", list(ATTENTION))
def test_models_with_attention_are_exact(name):
    """Their attention flattens the split rows with the columns (``view(b, c, h * w)``,
    heads reshaped at batch 1) and back: convert follows those reshapes, and the
    attention over the split tokens runs as ring attention."""
    diffusers = _diffusers()
    torch.manual_seed(0)
    make, kw = ATTENTION[name]
    model = make(diffusers)
    x = _x(1, 2, 38, 16)
    got = _converted(model, x, **kw)
    torch.testing.assert_close(got, _sample(model(x, **kw)), rtol=0, atol=1e-12)


def _fno(kind, **kw):
    """neuraloperator's FNO or TFNO, small, float64 (its complex weights follow torch's
    default dtype), without positional embedding."""
    models = pytest.importorskip("neuralop.models")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        torch.manual_seed(0)
        return getattr(models, kind)(n_modes=(4, 4), in_channels=1, out_channels=1,
                                     hidden_channels=8, n_layers=2,
                                     positional_embedding=None, **kw).eval()
    finally:
        torch.set_default_dtype(prev)


@pytest.mark.parametrize("kind", ["FNO", "TFNO"])
def test_neuraloperator_fno_is_refused_where_it_keeps_the_low_modes(kind):
    # its SpectralConv slices the low modes of a spectrum that the FFT split along its
    # frequencies: the modes other ranks hold (spmd.nn.SpectralConv2d is that layer on
    # shards, with weights of its own)
    with pytest.raises(spmd.SpecError) as e:
        _converted(_fno(kind), _x(1, 1, 37, 12))
    msg = str(e.value)
    assert "1 call(s) in " + kind + "'s forward would be wrong on shards" in msg
    assert "in 'fno_blocks.convs.0' (spectral_convolution.py:" in msg
    assert "indexing x[...] slices dim 3, which is split over 'sp' (a spectrum split along " \
        "its frequencies by the FFT before: keeping low modes needs the modes other ranks " \
        "hold)" in msg


def test_neuraloperator_domain_padding_is_refused():
    # DomainPadding pads by a fraction of the size it is given: Python makes a rank's
    # share of the rows a plain number, and the layer stores its paddings in forward
    with pytest.raises(spmd.SpecError) as e:
        _converted(_fno("FNO", domain_padding=0.25), _x(1, 1, 37, 12))
    msg = str(e.value)
    assert "in FNO (padding.py:" in msg and \
        "F.pad is given a number computed from a split dim's size" in msg
    assert "in FNO.domain_padding: self._padding changes the attribute (dict) in forward" in msg
