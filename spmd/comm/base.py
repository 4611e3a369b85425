"""The comm protocol: the few collectives everything else is built from.

Every method runs on one rank and takes that rank's ``Group`` (from ``mesh.group``).
Uneven sizes are normal: ``all_gather`` takes chunks of different lengths along ``dim``,
``reduce_scatter``, ``all_to_all`` and ``scatter`` take one chunk per member, each of any
shape.
``name`` is the public op that asked (for timeout and mismatch messages).
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..core.errors import CommError, SpecError
from ..core.mesh import Group
from .stats import waited

__all__ = ["Comm", "Work", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "max", "min")


class Work(Protocol):
    """A started asynchronous collective."""

    def wait(self) -> torch.Tensor:
        """Block (bounded by the mesh's timeout) until it finished; return its result.

        Raises ``CommTimeout`` naming the ranks that did not arrive, like blocking ops.
        """


class Pending:
    """A collective in flight: ``wait()`` finishes it (once) and returns its result.
    ``token``: ``comm_stats``' (``count``'s return), told when the wait starts."""

    __slots__ = ("finish", "result", "token")

    def __init__(self, finish, token: list | None = None):
        self.finish, self.result, self.token = finish, None, token

    @classmethod
    def done(cls, result, token: list | None = None) -> Pending:
        """One that finished at its start (a group of one, nothing to send)."""
        p = cls(None, token)
        p.result = result
        return p

    def wait(self):
        if self.token is not None:
            token, self.token = self.token, None
            waited(token)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            self.result = finish()
        return self.result


class Comm(Protocol):
    def all_reduce(self, x: torch.Tensor, op: str, group: Group, *, name: str) -> torch.Tensor:
        """Elementwise reduction of ``x`` over the group; same shape on every member."""

    def all_reduce_async(self, x: torch.Tensor, op: str, group: Group, *,
                         name: str) -> Work:
        """Start reducing contiguous ``x`` over the group, in place; return at once.

        ``work.wait()`` returns ``x`` holding the result. Until then ``x`` must not be
        read or written. It counts as a collective of the group like the blocking ops:
        every member starts the same collectives in the same order.
        """

    def all_gather(self, x: torch.Tensor, group: Group, dim: int, *, name: str,
                   sizes: tuple[int, ...] | None = None) -> list[torch.Tensor]:
        """Every member's ``x`` (sizes along ``dim`` may differ; ``sizes`` if known)."""

    def reduce_scatter(self, chunks: list[torch.Tensor], op: str, group: Group, *,
                       name: str) -> torch.Tensor:
        """Member i gets the reduction over members of their ``chunks[i]``."""

    def all_to_all(self, chunks: list[torch.Tensor], group: Group, *, name: str,
                   shapes: list[tuple[int, ...]] | None = None) -> list[torch.Tensor]:
        """Member i gets ``[m.chunks[i] for m in members]``.

        ``shapes``: the shapes this member receives, in group order, when the caller's
        plan knows them (all chunks of one dtype): skips a metadata exchange.
        """

    def all_to_all_async(self, chunks: list[torch.Tensor], group: Group, *, name: str,
                         shapes: list[tuple[int, ...]] | None = None) -> Work:
        """``all_to_all`` started; ``work.wait()`` returns its result (a list).

        Lets a caller compute while its blocks travel (a halo exchange behind a
        convolution of the shard). The chunks must not change until the wait. Without
        ``shapes`` (or under validation) the torch backend exchanges the shapes first,
        blocking; only the data is then in flight.
        """

    def scatter(self, chunks: list[torch.Tensor] | None, src: int, group: Group, *,
                name: str, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """Member ``src``'s ``chunks[i]`` on member i, as a new tensor.

        ``chunks``: on ``src``, one tensor per member, in group order (views of one
        tensor, strided ones too: they are read in place, never copied whole); elsewhere
        None. ``shape``, ``dtype``, ``device``: what this member receives, from the
        caller's plan (no metadata exchange). A plan that differs from ``src``'s chunk
        is a CommError: on every member under validation, else on that member (CPU) or
        undefined (accelerators). The source sends nothing to itself and fills its own
        result last, so its peak is its chunks plus that result (strided chunks are
        staged through a few MiB, taken from that result where it has room).
        """

    def permute(self, x: torch.Tensor, group: Group, pairs: tuple[tuple[int, int], ...], *,
                name: str) -> torch.Tensor | None:
        """Send ``x`` along (src index, dst index) pairs; a non-destination gets None."""

    def broadcast(self, x: torch.Tensor, src: int, group: Group, *, name: str) -> torch.Tensor:
        """Member ``src``'s ``x`` on every member (same shape and dtype everywhere)."""

    def barrier(self, group: Group, *, name: str = "barrier") -> None:
        """Return once every member arrived."""

    def open(self, group: Group) -> None:
        """Set up ``group``'s transport now rather than at its first collective.

        Collective over EVERY rank of the mesh (members or not), at the same point of
        the program: on torch.distributed a new channel creates process groups, which
        every process must create in the same order. A no-op where there is nothing to
        set up.
        """


def check_scatter(chunks: list[torch.Tensor] | None, src: int, group: Group,
                  name: str) -> None:
    """``Comm.scatter``'s arguments, checked alike by both backends before anything moves."""
    n = group.size
    if not 0 <= src < n:
        where = f"axis {group.axes[0]!r}" if len(group.axes) == 1 else f"axes {group.axes}"
        raise SpecError(f"{name}: src {src} is not a member index of {where} (0..{n - 1})")
    if group.index == src and (chunks is None or len(chunks) != n):
        raise CommError(f"{name}: rank {group.rank} (the source) passed "
                        f"{'no' if chunks is None else len(chunks)} chunks for a group of {n}")
