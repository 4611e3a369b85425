"""The handle of an ``all_reduce_async`` in flight on a process group."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.mesh import Group

if TYPE_CHECKING:
    from ._groups import _PG
    from .distributed import TorchComm

__all__ = ["_TorchWork"]


class _TorchWork:
    """An all_reduce_async in flight on a process group."""

    __slots__ = ("comm", "work", "x", "name", "group", "rec", "seq")

    def __init__(self, comm: TorchComm, work, x: torch.Tensor, name: str, group: Group,
                 rec: _PG | None, seq: int):
        self.comm, self.work, self.x, self.name = comm, work, x, name
        self.group, self.rec, self.seq = group, rec, seq

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            work, self.work = self.work, None
            self.comm._wait(work, self.name, self.group, self.rec, self.seq)
        return self.x

