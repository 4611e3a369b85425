"""Domain-parallel layers: functional ops on shards of inputs split along spatial dims.

Each op takes this rank's shard plus ``mesh=`` and ``spec=`` (a ``P`` or a ``Layout``;
or ``x`` is a ``spmd.Sharded``, whose layout is the spec and which gets a Sharded back:
one convention, read by ``spmd/transforms/spec_arg.py``), returns this rank's shard of
the single-device result, moves only the halo elements it needs, and has an
``output_layout(layout, ...)`` that says how its output is split. The sequence-parallel
attentions (``ring_attention``, ``head_parallel_attention``) take ``axis=`` and
``seq_dim=`` instead of ``spec=`` (and take q, k, v as ``Sharded`` too).
"""
from .adaptive_pool import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool1d,
    adaptive_max_pool2d,
    adaptive_max_pool3d,
)
from .conv import (
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from .exp_normalization import log_softmax, logsumexp, softmax
from .head_parallel import head_parallel_attention
from .interpolation import interpolate
from .losses import cross_entropy, huber_loss, l1_loss, mse_loss, nll_loss, smooth_l1_loss
from .neighborhood_attention import (
    neighborhood_attention1d,
    neighborhood_attention2d,
    neighborhood_attention3d,
    neighborhood_attention_reference,
)
from .normalization import (
    batch_norm,
    group_norm,
    instance_norm,
    layer_norm,
    moments,
    rms_norm,
)
from .padding import pad
from .pool import (
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    max_pool1d,
    max_pool2d,
    max_pool3d,
)
from .ring import ring_attention, zigzag_order

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "pad", "interpolate",
           "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
           "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
           "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
           "moments", "group_norm", "layer_norm", "instance_norm", "batch_norm", "rms_norm",
           "softmax", "log_softmax", "logsumexp",
           "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss", "cross_entropy",
           "ring_attention", "zigzag_order", "head_parallel_attention",
           "neighborhood_attention1d", "neighborhood_attention2d",
           "neighborhood_attention3d", "neighborhood_attention_reference"]
