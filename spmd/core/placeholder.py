"""``Placeholder``: what a rank holds where it has no data. Never ``None``."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._format import shape_str
from .layout import Layout

__all__ = ["Placeholder"]


@dataclass(frozen=True, eq=True)
class Placeholder:
    """Immutable metadata for a tensor that lives on other ranks.

    Attributes:
        shape: the global shape.
        dtype, device, requires_grad: as the tensor's.
        layout: how the data is laid out where it lives (None: whole on ``holders``).
        holders: the global ranks that hold the data.

    It is an optree leaf, so pytrees of outputs keep their structure on every rank.

    A Placeholder made by ``spmd.gather`` with a gradient also holds a private handle to
    the gather's autograd node (not compared, hashed, shown or pickled), so that
    ``p.backward()`` (or ``spmd.backward(p)``) lets a rank without data
    take part in the backward exchange.

    Example:
        >>> Placeholder(torch.Size([8, 16]), torch.float32, torch.device("cpu"), False, None, (0,))
        Placeholder(f32[8, 16], on rank 0)
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    layout: Layout | None
    holders: tuple[int, ...]
    _node: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "holders", tuple(int(r) for r in self.holders))

    @classmethod
    def like(cls, x: torch.Tensor, holders: Sequence[int], layout: Layout | None = None) -> Placeholder:
        """The Placeholder of ``x`` (its shape, dtype, device, requires_grad), held by
        ``holders``, laid out as ``layout`` there."""
        return cls(x.shape, x.dtype, x.device, x.requires_grad, layout, tuple(holders))

    @property
    def ndim(self) -> int:
        """The number of dims of the global tensor, as ``Tensor.ndim``."""
        return len(self.shape)

    def dim(self) -> int:
        """The number of dims of the global tensor, as ``Tensor.dim()``."""
        return len(self.shape)

    def size(self, dim: int | None = None):
        """The global shape, or its size along ``dim``, as ``Tensor.size()``."""
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        """The number of elements of the global tensor, as ``Tensor.numel()``."""
        return self.shape.numel()

    def backward(self) -> None:
        """Take part in the backward of the ``spmd.gather`` that made this Placeholder:
        this rank receives its shard's cotangent from the rank holding the data. A no-op
        when no gradient is needed."""
        root = self._backward_root()
        if root is not None:
            torch.autograd.backward([root[0]], [root[1]])

    def _backward_root(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gather's autograd handle and its (zero) cotangent: backpropagating it runs
        the gather's backward, in which this rank receives its shard's cotangent."""
        if self._node is None:
            return None
        return self._node, torch.zeros_like(self._node)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_node", None)  # the autograd handle stays on its rank
        return state

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_node", None)

    def __repr__(self) -> str:
        h = self.holders
        where = f"on rank {h[0]}" if len(h) == 1 else f"on ranks {list(h)}"
        grad = ", requires_grad" if self.requires_grad else ""
        return f"Placeholder({shape_str(self.shape, self.dtype)}, {where}{grad})"
