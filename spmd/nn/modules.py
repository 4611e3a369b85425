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
from ..mesh import Mesh
from ..ops._window import input_layout

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
           "Pad", "SHARDED"]


class _Sharded:
    """What every drop-in layer adds to its torch twin: the mesh and the input's spec."""

    mesh: Mesh
    spec: Any
    _torch_base: type[nn.Module]

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


def _init(self, mesh: Mesh, spec: Any) -> None:
    self.mesh, self.spec = mesh, spec


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

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _init(self, mesh, spec)


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

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _init(self, mesh, spec)


class Conv3d(_ConvN, nn.Conv3d):
    """``nn.Conv3d`` on a shard. See ``spmd.ops.conv3d``."""
    _torch_base, _n = nn.Conv3d, 3

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _init(self, mesh, spec)


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

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _init(self, mesh, spec)


class ConvTranspose2d(_ConvTransposeN, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on a shard (``output_size`` is the global size)."""
    _torch_base, _n = nn.ConvTranspose2d, 2

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _init(self, mesh, spec)


class ConvTranspose3d(_ConvTransposeN, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on a shard (``output_size`` is the global size)."""
    _torch_base, _n = nn.ConvTranspose3d, 3

    def __init__(self, *args: Any, mesh: Mesh, spec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _init(self, mesh, spec)


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
        super().__init__()
        self.padding, self.mode, self.value = tuple(padding), mode, value
        _init(self, mesh, spec)

    @classmethod
    def from_torch(cls, module: nn.Module, mesh: Mesh, spec: Any) -> nn.Module:
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

#: torch layer type -> its sharded twin (what ``spmd.nn.convert`` swaps).
SHARDED: dict[type[nn.Module], type[_Sharded]] = {
    nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d,
    **{t: Pad for t in _PAD_LAYERS},
}
