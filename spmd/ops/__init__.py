"""Domain-parallel layers: functional ops on shards of inputs split along spatial dims.

Each op takes this rank's shard plus ``mesh=`` and ``spec=`` (a ``P`` or a ``Layout``),
returns this rank's shard of the single-device result, moves only the halo elements it
needs, and has an ``output_layout(layout, ...)`` that says how its output is split.
"""
from .conv import (
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from .interpolate import interpolate

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "interpolate"]
