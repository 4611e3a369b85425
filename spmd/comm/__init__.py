"""The comm layer: one small protocol (``base.Comm``) and its two backends.

The only code in spmd that touches torch.distributed or thread rendezvous. The data
layer knows nothing of it: a ``Mesh`` names its backend, and ``comm_of(mesh)`` builds
that backend's communicator on first use and keeps it with the mesh.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch

from .base import REDUCE_OPS, Comm

if TYPE_CHECKING:
    from ..core.mesh import Mesh

__all__ = ["Comm", "REDUCE_OPS", "comm_of", "validating", "gather_ints"]

_lock = threading.Lock()


def comm_of(mesh: Mesh) -> Comm:
    """The communicator of ``mesh``'s backend, created once per mesh (thread-safe).

    Example:
        >>> from spmd.comm import comm_of
        >>> mesh = Mesh((2,), ("sp",), backend="threads")
        >>> comm_of(mesh) is comm_of(mesh), type(comm_of(mesh)).__name__
        (True, 'ThreadComm')
    """
    c = mesh._comm
    if c is None:
        # Rank threads reach for it at once on first use: build exactly one.
        with _lock:
            c = mesh._comm
            if c is None:
                c = mesh._comm = _make(mesh)
    return c


def gather_ints(mesh: Mesh, group, ints, *, name: str, device) -> tuple[tuple[int, ...], ...]:
    """Every member's ``ints`` (the same count on each), in member order: one int64
    all_gather of one row per member. How ops learn the others' shard sizes.

    Example:
        >>> mesh = Mesh((2,), ("sp",))
        >>> f = lambda m: gather_ints(m, m.group("sp", m.rank), (m.rank, 7), name="t",
        ...                           device="cpu")
        >>> spmd.launch(f, (2,), "sp")[1]
        ((0, 7), (1, 7))
    """
    row = torch.tensor([list(ints)], dtype=torch.int64, device=device)
    got = comm_of(mesh).all_gather(row, group, 0, name=name, sizes=(1,) * group.size)
    return tuple(tuple(int(v) for v in t[0].tolist()) for t in got)


def validating(mesh: Mesh) -> bool:
    """Whether the debugging checks are on for ``mesh``: ``SPMD_VALIDATE=1`` in the
    environment, or ``comm_of(mesh).validate = True`` on the torch backend.

    Example:
        >>> validating(Mesh((2,), ("sp",)))  # SPMD_VALIDATE unset
        False
    """
    v = getattr(mesh._comm, "validate", None) if mesh._comm is not None else None
    return v if v is not None else os.environ.get("SPMD_VALIDATE", "") == "1"


def _make(mesh: Mesh) -> Comm:
    if mesh.backend == "threads":
        from .threads import ThreadComm
        return ThreadComm(mesh)
    from .distributed import TorchComm
    return TorchComm(mesh)
