"""Communication accounting: calls and bytes per op, axis, rank and pass.

Both backends report every collective here (a no-op unless a ``comm_stats()`` block is
open), so tests can prove that a halo moves only halo bytes, in forward and backward.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..core._local import RankLocal
from ..core._records import OpenRecords

__all__ = ["comm_stats", "CommStats"]

_open: OpenRecords[CommStats] = OpenRecords()
_local = RankLocal()


@dataclass
class CommStats:
    """What ran while a ``comm_stats()`` block was open.

    ``records`` holds one ``(op, axes, rank, pass_, nbytes)`` tuple per collective call
    on each rank, where ``pass_`` is ``"forward"`` or ``"backward"`` and ``nbytes`` the
    payload this rank sent to *other* ranks:

    - ``ppermute``: the tensor's bytes if this rank sends to another rank, else 0;
    - ``all_gather``: its part's bytes times (group size - 1);
    - ``psum_scatter`` / ``all_to_all``: the bytes of the blocks meant for other ranks;
    - ``broadcast``: the tensor's bytes times (group size - 1) on the source, else 0;
    - ``psum`` (and pmean, pmax, pmin) and asynchronous all-reduces (``GradSync``'s
      buckets): its contribution's bytes (what crosses the wire beyond that depends on
      the reduction algorithm).

    Only payloads count: the torch backend's int64 metadata exchanges inside one
    collective (sizes, when ``sizes=`` is not given; ``SPMD_VALIDATE=1``) do not. A
    collective of its own that spmd issues to learn the shards' sizes does, under its
    own name: e.g. ``conv2d sizes``, when an op is given a ``P`` rather than a ``Layout``.
    """

    records: list[tuple[str, tuple[str, ...], int, str, int]] = field(default_factory=list)
    details: list[tuple[str, int, int, int]] = field(default_factory=list)
    """Parallel to ``records`` (same index, same call): ``(kind, group_size, peers,
    payload)``. ``kind`` is the protocol's collective (``all_reduce``,
    ``all_reduce_async``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
    ``permute``, ``broadcast``, ``barrier``), ``peers`` the number of other ranks this
    rank sends a non-empty payload to, ``payload`` the bytes it passes in (its tensor,
    or all its blocks): what a cost model needs beyond the bytes sent."""
    times: list[list[float | None]] = field(default_factory=list)
    """Parallel to ``records``: ``[start, waited]``, ``time.perf_counter()`` when the
    call was made and, for an asynchronous all-to-all (a halo on its way while compute
    runs), when its result was first waited for (None until then, and for calls that
    block; a blocking all-to-all on threads is its asynchronous form waited for at
    once): the compute a transfer can hide behind, for ``spmd.perf``."""

    def calls(self, op: str | None = None, *, axes: tuple[str, ...] | str | None = None,
              pass_: str | None = None, rank: int | None = None) -> int:
        """Number of calls matching the filters (each rank's call counts once)."""
        return sum(1 for r in self._match(op, axes, pass_, rank))

    def bytes(self, op: str | None = None, *, axes: tuple[str, ...] | str | None = None,
              pass_: str | None = None, rank: int | None = None) -> int:
        """Bytes sent, summed over the matching calls."""
        return sum(r[4] for r in self._match(op, axes, pass_, rank))

    def by_op(self) -> dict[tuple[str, tuple[str, ...], str], tuple[int, int]]:
        """``{(op, axes, pass): (calls, bytes)}`` over all ranks."""
        out: dict = defaultdict(lambda: (0, 0))
        for op, axes, _, p, n in self.records:
            c, b = out[(op, axes, p)]
            out[(op, axes, p)] = (c + 1, b + n)
        return dict(out)

    def _match(self, op, axes, pass_, rank) -> Iterator[tuple]:
        if isinstance(axes, str):
            axes = (axes,)
        for r in self.records:
            if ((op is None or r[0] == op) and (axes is None or r[1] == tuple(axes))
                    and (pass_ is None or r[3] == pass_) and (rank is None or r[2] == rank)):
                yield r

    def __str__(self) -> str:
        """A table: one row per (op, axes, pass), every rank's calls and bytes summed."""
        rows = [f"{op:>24} {'/'.join(axes):>10} {p:>8} {c:>6} {b:>12,}"
                for (op, axes, p), (c, b) in sorted(self.by_op().items())]
        if not rows:
            return "(no communication)"
        head = f"{'op':>24} {'axes':>10} {'pass':>8} {'calls':>6} {'bytes':>12}"
        return "\n".join([head, *rows])


@contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Count the collectives run while the block is open, on every rank of this process.

    On a threads mesh that is every rank; on torch processes, each process counts its own.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
        >>> with spmd.comm_stats() as s:
        ...     _ = f(torch.ones(4))
        >>> s.calls("psum"), s.bytes("psum")
        (2, 8)
    """
    with _open.opened(CommStats()) as stats:
        yield stats


@contextmanager
def uncounted() -> Iterator[None]:
    """Collectives in the block are not counted: spmd's own agreement checks (like the
    envelopes a collective carries), not the program's communication."""
    _local.quiet = _local.get("quiet", 0) + 1
    try:
        yield
    finally:
        _local.quiet -= 1


def count(kind: str, name: str, group, *, x=None, chunks=None, pairs=None,
          src=None) -> list | None:
    """Called by both comm backends at every collective (cheap when nothing is open):
    the rules for what a rank sends, in one place. Returns the token ``waited`` takes
    (None when nothing is open)."""
    if not _open or _local.get("quiet", 0):
        return None
    n, me = group.size, group.index
    payload = 0 if x is None else x.nbytes
    peers = n - 1
    if kind in ("reduce_scatter", "all_to_all"):
        payload = sum(c.nbytes for c in chunks)
        peers = sum(1 for i, c in enumerate(chunks) if i != me and c.nbytes)
    if n == 1 or kind == "barrier":
        nbytes = 0
    elif kind in ("all_reduce", "all_reduce_async"):
        nbytes = x.nbytes
    elif kind == "all_gather":
        nbytes = x.nbytes * (n - 1)
    elif kind in ("reduce_scatter", "all_to_all"):
        nbytes = sum(c.nbytes for i, c in enumerate(chunks) if i != me)
    elif kind == "permute":
        peers = sum(1 for s, d in pairs if s == me and d != me)
        nbytes = x.nbytes if peers else 0
    elif kind == "broadcast":
        nbytes = x.nbytes * (n - 1) if me == src else 0
        peers = n - 1 if me == src else 0
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    rec = (name, group.axes, group.rank, "backward" if _local.get("backward", 0) else "forward",
           int(nbytes))
    det = (kind, n, peers if n > 1 else 0, int(payload))
    start, token = time.perf_counter(), []

    def add(s: CommStats) -> None:
        s.records.append(rec)
        s.details.append(det)
        s.times.append([start, None])
        token.append(s.times[-1])
    _open.each(add)
    return token


def waited(token: list | None) -> None:
    """An asynchronous collective counted with ``token`` is being waited for now."""
    if token:
        t = time.perf_counter()
        for entry in token:
            entry[1] = t


class in_backward:
    """Marks collectives run inside a backward rule (custom_vjp's bwd) as backward."""

    def __enter__(self) -> None:
        _local.backward = _local.get("backward", 0) + 1

    def __exit__(self, *exc) -> None:
        _local.backward -= 1
