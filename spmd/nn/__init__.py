"""Drop-in domain-parallel layers (``spmd.nn.Conv2d``, ...) and ``spmd.nn.convert``.

Each layer is a subclass of its ``torch.nn`` twin with the same parameters and
``state_dict`` keys; its forward runs the ``spmd.ops`` version on this rank's shard.
No monkey patching: ``convert`` returns a copy of the model with the layers swapped.
"""
from .attention import MultiheadAttention
from .conversion import UNSAFE, convert
from .modules import (
    SHARDED,
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AdaptiveMaxPool1d,
    AdaptiveMaxPool2d,
    AdaptiveMaxPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    LogSoftmax,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    Pad,
    RMSNorm,
    Softmax,
    Upsample,
)
from .neighborhood import NeighborhoodAttention2d
from .spectral import FNO, SpectralConv1d, SpectralConv2d, SpectralConv3d

__all__ = ["convert", "UNSAFE", "SHARDED", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d",
           "ConvTranspose2d", "ConvTranspose3d", "Pad",
           "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
           "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "Upsample",
           "GroupNorm", "LayerNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
           "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "Softmax", "LogSoftmax",
           "SpectralConv1d", "SpectralConv2d", "SpectralConv3d", "FNO",
           "NeighborhoodAttention2d", "MultiheadAttention"]
