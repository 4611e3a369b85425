"""``Placeholder``: what a rank holds where it has no data. Never ``None``."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "holders", tuple(int(r) for r in self.holders))

    @classmethod
    def like(cls, x: torch.Tensor, holders: Sequence[int], layout: Layout | None = None) -> Placeholder:
        return cls(x.shape, x.dtype, x.device, x.requires_grad, layout, tuple(holders))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __repr__(self) -> str:
        h = self.holders
        where = f"on rank {h[0]}" if len(h) == 1 else f"on ranks {list(h)}"
        grad = ", requires_grad" if self.requires_grad else ""
        return f"Placeholder({shape_str(self.shape, self.dtype)}, {where}{grad})"
