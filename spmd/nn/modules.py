"""Drop-in domain-parallel layers: subclasses of their ``torch.nn`` twins whose forward
runs the ``spmd.ops`` version on this rank's shard.

Same constructor arguments (plus ``mesh=`` and ``spec=``, the activation's spec), same
parameters, same ``state_dict`` keys: a checkpoint of the plain model loads into the
sharded one and back, and ``isinstance(layer, nn.Conv2d)`` still holds.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import ops
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P
from ..ops._window import input_layout
from ..ops.normalization import _batch_norm

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
           "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
           "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "Pad", "Upsample",
           "GroupNorm", "LayerNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
           "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "Softmax", "LogSoftmax",
           "SHARDED"]


class _Sharded:
    """What every drop-in layer adds to its torch twin: the mesh and the input's spec."""

    mesh: Mesh
    spec: Any
    _torch_base: type[nn.Module]

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mesh, self.spec = mesh, spec

    @classmethod
    def from_torch(cls, module: nn.Module, mesh: Mesh, spec: Any) -> nn.Module:
        """The sharded twin of ``module``, sharing its parameters and buffers (no copy)."""
        if not isinstance(module, cls._torch_base):
            raise TypeError(f"{cls.__name__}.from_torch expects a {cls._torch_base.__name__}, "
                            f"got {type(module).__name__}")
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)
        new.mesh, new.spec = mesh, spec
        return new

    def to_torch(self) -> nn.Module:
        """The plain torch twin, sharing parameters and buffers."""
        base = self._torch_base.__new__(self._torch_base)
        base.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("mesh", "spec")})
        return base

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mesh={self.mesh!r}, spec={self.spec!r}"


# -- convolutions -------------------------------------------------------------------------------

class _ConvN(_Sharded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = getattr(ops, f"conv{self._n}d")
        return op(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                  self.groups, mesh=self.mesh, spec=self.spec, padding_mode=self.padding_mode)


class Conv1d(_ConvN, nn.Conv1d):
    """``nn.Conv1d`` on a shard; ``spmd.nn.Conv1d(2, 4, 3, padding=1, mesh=mesh,
    spec=P(None, None, "sp"))``. See ``spmd.ops.conv1d``."""
    _torch_base, _n = nn.Conv1d, 1


class Conv2d(_ConvN, nn.Conv2d):
    """``nn.Conv2d`` on a shard. See ``spmd.ops.conv2d``.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> conv = spmd.nn.Conv2d(2, 4, 3, padding=1, mesh=mesh, spec=P(None, None, "sp"))
        >>> plain = torch.nn.Conv2d(2, 4, 3, padding=1)
        >>> plain.load_state_dict(conv.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(1, 2, 5, 6)
        >>> y = spmd.shard_map(conv, mesh, P(None, None, "sp"), P(None, None, "sp"))(x)
        >>> torch.allclose(y, plain(x), atol=1e-6)
        True
    """
    _torch_base, _n = nn.Conv2d, 2


class Conv3d(_ConvN, nn.Conv3d):
    """``nn.Conv3d`` on a shard. See ``spmd.ops.conv3d``."""
    _torch_base, _n = nn.Conv3d, 3


class _ConvTransposeN(_Sharded):
    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        n = self._n
        spec = self.spec
        output_padding = self.output_padding
        if output_size is not None:
            # torch derives output_padding from the input's size: use the global one
            _, spec = input_layout(x, self.mesh, self.spec, f"ConvTranspose{n}d")
            whole = torch.empty(spec.shape, device="meta")
            output_padding = self._output_padding(whole, output_size, self.stride, self.padding,
                                                  self.kernel_size, n, self.dilation)
        op = getattr(ops, f"conv_transpose{n}d")
        return op(x, self.weight, self.bias, self.stride, self.padding, output_padding,
                  self.groups, self.dilation, mesh=self.mesh, spec=spec)


class ConvTranspose1d(_ConvTransposeN, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` on a shard (``output_size`` is the global size). See
    ``spmd.ops.conv_transpose1d``."""
    _torch_base, _n = nn.ConvTranspose1d, 1


class ConvTranspose2d(_ConvTransposeN, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on a shard (``output_size`` is the global size)."""
    _torch_base, _n = nn.ConvTranspose2d, 2


class ConvTranspose3d(_ConvTransposeN, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on a shard (``output_size`` is the global size)."""
    _torch_base, _n = nn.ConvTranspose3d, 3


# -- pooling -------------------------------------------------------------------------------------

class _Pool(_Sharded):
    _op: str

    def forward(self, x: torch.Tensor):
        return getattr(ops, self._op)(x, *self._args(self), mesh=self.mesh, spec=self.spec)


_POOL_ARGS = {
    "MaxPool": lambda m: (m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode,
                          m.return_indices),
    "AvgPool": lambda m: (m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                          *([m.divisor_override] if hasattr(m, "divisor_override") else [])),
    "AdaptiveMaxPool": lambda m: (m.output_size, m.return_indices),
    "AdaptiveAvgPool": lambda m: (m.output_size,),
}


def _pool_twin(kind: str, n: int) -> type:
    base = getattr(nn, f"{kind}{n}d")
    op = "adaptive_" * kind.startswith("Adaptive") + kind.removeprefix("Adaptive")[:3].lower() \
        + f"_pool{n}d"
    return type(base.__name__, (_Pool, base), {
        "_torch_base": base, "_op": op, "_args": staticmethod(_POOL_ARGS[kind]),
        "__module__": __name__,
        "__doc__": f"``nn.{base.__name__}`` on a shard (same arguments plus ``mesh=``, "
                   f"``spec=``). See ``spmd.ops.{op}``.",
    })


MaxPool1d, MaxPool2d, MaxPool3d = (_pool_twin("MaxPool", n) for n in (1, 2, 3))
AvgPool1d, AvgPool2d, AvgPool3d = (_pool_twin("AvgPool", n) for n in (1, 2, 3))
AdaptiveMaxPool1d, AdaptiveMaxPool2d, AdaptiveMaxPool3d = (
    _pool_twin("AdaptiveMaxPool", n) for n in (1, 2, 3))
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = (
    _pool_twin("AdaptiveAvgPool", n) for n in (1, 2, 3))
_POOLS = [MaxPool1d, MaxPool2d, MaxPool3d, AvgPool1d, AvgPool2d, AvgPool3d, AdaptiveMaxPool1d,
          AdaptiveMaxPool2d, AdaptiveMaxPool3d, AdaptiveAvgPool1d, AdaptiveAvgPool2d,
          AdaptiveAvgPool3d]


class Upsample(_Sharded, nn.Upsample):
    """``nn.Upsample`` (and ``nn.UpsamplingNearest2d``/``UpsamplingBilinear2d``, which
    ``convert`` turns into this) on a shard. See ``spmd.ops.interpolate``."""
    _torch_base = nn.Upsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                               self.recompute_scale_factor, mesh=self.mesh, spec=self.spec)


# -- padding layers --------------------------------------------------------------------------

class Pad(_Sharded, nn.Module):
    """Any of torch's padding layers (``nn.ZeroPad2d``, ``nn.ReflectionPad1d``, ...) on a
    shard: ``spmd.nn.Pad(padding, mode, value, mesh=..., spec=...)`` with ``padding`` in
    F.pad's order. ``spmd.nn.convert`` turns torch's padding layers into these.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> pad = spmd.nn.Pad((1, 1), "reflect", mesh=mesh, spec=P(None, None, "sp"))
        >>> x = torch.arange(6.0).reshape(1, 1, 6)
        >>> spmd.shard_map(pad, mesh, P(None, None, "sp"), P(None, None, "sp"))(x).tolist()
        [[[1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 4.0]]]
    """
    _torch_base = nn.Module

    def __init__(self, padding: tuple[int, ...], mode: str = "constant", value: float = 0.0, *,
                 mesh: Mesh, spec: Any):
        nn.Module.__init__(self)
        self.padding, self.mode, self.value = tuple(padding), mode, value
        self.mesh, self.spec = mesh, spec

    @classmethod
    def from_torch(cls, module: nn.Module, mesh: Mesh, spec: Any) -> nn.Module:
        """The sharded twin of one of torch's padding layers (``ZeroPad2d``,
        ``ReflectionPad*``, ``ReplicationPad*``, ``CircularPad*``, ``ConstantPad*``): the
        same widths, mode and fill value, padding the global tensor's edges.

        Example:
            >>> mesh = spmd.Mesh((2,), ("sp",))
            >>> pad = spmd.nn.Pad.from_torch(torch.nn.ReflectionPad1d(2), mesh, P(None, None, "sp"))
            >>> pad.padding, pad.mode
            ((2, 2), 'reflect')
        """
        mode = _PAD_MODES.get(type(module).__name__[:-2]) if type(module) in _PAD_LAYERS else None
        if mode is None:
            raise TypeError(f"Pad.from_torch expects one of torch's padding layers, got "
                            f"{type(module).__name__}")
        return cls(tuple(module.padding), mode, float(getattr(module, "value", 0.0)), mesh=mesh,
                   spec=spec)

    def to_torch(self) -> nn.Module:
        raise TypeError("spmd.nn.Pad has no single torch twin; build the torch padding layer")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.pad(x, self.padding, self.mode, self.value if self.mode == "constant" else None,
                       mesh=self.mesh, spec=self.spec)

    def extra_repr(self) -> str:
        return (f"padding={self.padding}, mode={self.mode!r}, value={self.value}, "
                f"mesh={self.mesh!r}, spec={self.spec!r}")


_PAD_MODES = {"ZeroPad": "constant", "ConstantPad": "constant", "ReflectionPad": "reflect",
              "ReplicationPad": "replicate", "CircularPad": "circular"}
_PAD_LAYERS = [getattr(nn, f"{kind}{n}d") for kind in _PAD_MODES for n in (1, 2, 3)
               if hasattr(nn, f"{kind}{n}d")]

# -- normalisation and softmax -------------------------------------------------------------

def _batched(spec: Any, what: str) -> P:
    """The spec of an unbatched input with a batch dim put in front (as torch does)."""
    if isinstance(spec, Layout):
        raise SpecError(f"{what}: an unbatched input needs spec= as a P (not a Layout); "
                        f"or add the batch dim yourself")
    return P(None, *spec)


class GroupNorm(_Sharded, nn.GroupNorm):
    """``nn.GroupNorm`` on a shard split along batch and/or spatial dims. See
    ``spmd.ops.group_norm``.

    Example:
        >>> mesh, s = spmd.Mesh((2,), ("sp",)), P(None, None, "sp")
        >>> gn = spmd.nn.GroupNorm(2, 4, mesh=mesh, spec=s)
        >>> x = torch.randn(1, 4, 6, 5)
        >>> torch.allclose(spmd.shard_map(gn, mesh, s, s)(x), gn.to_torch()(x), atol=1e-5)
        True
    """
    _torch_base = nn.GroupNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.group_norm(x, self.num_groups, self.weight, self.bias, self.eps,
                              mesh=self.mesh, spec=self.spec)


class LayerNorm(_Sharded, nn.LayerNorm):
    """``nn.LayerNorm`` whose normalised dims may be split; over whole dims it moves
    nothing. See ``spmd.ops.layer_norm``."""
    _torch_base = nn.LayerNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                              mesh=self.mesh, spec=self.spec)


class RMSNorm(_Sharded, nn.RMSNorm):
    """``nn.RMSNorm`` whose normalised dims may be split. See ``spmd.ops.rms_norm``."""
    _torch_base = nn.RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps, mesh=self.mesh,
                            spec=self.spec)


class _BatchNormN(_Sharded):
    axes: Any = None

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, axes: Any = None, **kwargs: Any):
        super().__init__(*args, mesh=mesh, spec=spec, **kwargs)
        self.axes = axes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        track = self.training and self.track_running_stats
        training = self.training or (self.running_mean is None and self.running_var is None)
        # torch's module logic, except that num_batches_tracked is counted where the
        # running statistics are updated: once per step, also by rank threads sharing them
        return _batch_norm(x, self.running_mean if not self.training or track else None,
                           self.running_var if not self.training or track else None,
                           self.weight, self.bias, training,
                           self.momentum if track else 0.0, self.eps, self.mesh, self.spec,
                           self.axes, self.num_batches_tracked if track else None)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", axes={self.axes!r}" if self.axes is not None else "")


class BatchNorm1d(_BatchNormN, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on a shard; ``axes=`` as in ``spmd.ops.batch_norm``."""
    _torch_base = nn.BatchNorm1d


class BatchNorm2d(_BatchNormN, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` on a shard: in training, statistics over the global batch and
    spatial dims (SyncBatchNorm when the batch is split too; ``axes="sp"`` for per-replica
    statistics on a (dp, sp) mesh), running statistics and ``num_batches_tracked``
    updated once per step as torch does, on processes and on rank threads alike. See
    ``spmd.ops.batch_norm``.

    Example:
        >>> mesh, s = spmd.Mesh((2,), ("sp",)), P(None, None, "sp")
        >>> bn = spmd.nn.BatchNorm2d(3, momentum=None, mesh=mesh, spec=s)
        >>> plain = torch.nn.BatchNorm2d(3, momentum=None)
        >>> for _ in range(3):
        ...     x = torch.randn(2, 3, 5, 4)
        ...     _ = spmd.shard_map(bn, mesh, s, s)(x), plain(x)
        >>> int(bn.num_batches_tracked), torch.allclose(bn.running_var, plain.running_var)
        (3, True)
    """
    _torch_base = nn.BatchNorm2d


class BatchNorm3d(_BatchNormN, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` on a shard; see ``BatchNorm2d``."""
    _torch_base = nn.BatchNorm3d


class _InstanceNormN(_Sharded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        spec = self.spec
        unbatched = x.dim() == self._get_no_batch_dim()
        if unbatched:
            x, spec = x.unsqueeze(0), _batched(spec, type(self).__name__)
        y = ops.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                              self.training or not self.track_running_stats,
                              self.momentum if self.momentum is not None else 0.0, self.eps,
                              mesh=self.mesh, spec=spec)
        return y.squeeze(0) if unbatched else y


class InstanceNorm1d(_InstanceNormN, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` on a shard. See ``spmd.ops.instance_norm``."""
    _torch_base = nn.InstanceNorm1d


class InstanceNorm2d(_InstanceNormN, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` on a shard. See ``spmd.ops.instance_norm``."""
    _torch_base = nn.InstanceNorm2d


class InstanceNorm3d(_InstanceNormN, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` on a shard. See ``spmd.ops.instance_norm``."""
    _torch_base = nn.InstanceNorm3d


def implicit_softmax_dim(ndim: int) -> int:
    """The dim torch's softmax family takes when given none (a legacy rule)."""
    return 0 if ndim in (0, 1, 3) else 1


class _SoftmaxN(_Sharded):
    _op: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.dim if self.dim is not None else implicit_softmax_dim(x.ndim)
        return getattr(ops, self._op)(x, dim, mesh=self.mesh, spec=self.spec)


class Softmax(_SoftmaxN, nn.Softmax):
    """``nn.Softmax`` over a dim that may be split. See ``spmd.ops.softmax``."""
    _torch_base, _op = nn.Softmax, "softmax"


class LogSoftmax(_SoftmaxN, nn.LogSoftmax):
    """``nn.LogSoftmax`` over a dim that may be split. See ``spmd.ops.log_softmax``."""
    _torch_base, _op = nn.LogSoftmax, "log_softmax"


_NORMS = [GroupNorm, LayerNorm, RMSNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d, InstanceNorm1d,
          InstanceNorm2d, InstanceNorm3d, Softmax, LogSoftmax]

#: torch layer type -> its sharded twin (what ``spmd.nn.convert`` swaps).
SHARDED: dict[type[nn.Module], type[_Sharded]] = {
    nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d,
    **{t: Pad for t in _PAD_LAYERS},
    **{t._torch_base: t for t in _POOLS},
    nn.Upsample: Upsample, nn.UpsamplingNearest2d: Upsample, nn.UpsamplingBilinear2d: Upsample,
    **{t._torch_base: t for t in _NORMS},
}
