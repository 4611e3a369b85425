"""Process groups of a ``TorchComm`` and waiting on them: setup, timeouts, failures.

``_ProcessGroups`` is the part of ``TorchComm`` (``distributed.py``) that maps a ``Group``
to its torch ProcessGroup (``_PG``), counts each group's calls (the call number every
message and timeout names), and bounds every wait by the mesh's timeout, turning
failures into ``CommTimeout``/``CommAborted``/``CommError``. ``_Progress`` is the
post-mortem of a timeout: which ranks never arrived.
"""
from __future__ import annotations

import datetime
import os
import time
import zlib

import torch.distributed as dist

from ..core.errors import CommAborted, CommError, CommTimeout
from ..core.mesh import Group
from ._meta import _axes, _bytes

__all__ = ["_PG", "_ProcessGroups", "_Progress"]


class _PG:
    """A group's process group and the maps between member index and its ranks."""

    __slots__ = ("pg", "pg_of", "idx_of", "key")

    def __init__(self, pg, pg_of: tuple[int, ...], key: int):
        self.pg = pg
        self.pg_of = pg_of  # member index -> process-group rank
        idx = [0] * len(pg_of)
        for i, p in enumerate(pg_of):
            idx[p] = i
        self.idx_of = tuple(idx)  # process-group rank -> member index
        self.key = key  # the same on every member: names the group in progress counts



class _ProcessGroups:
    """Process groups and bounded waits; mixed into ``TorchComm``, which sets ``mesh``,
    ``_td``, ``_recs``, ``_pgs``, ``_dm`` and ``_progress``."""

    # -- process groups -----------------------------------------------------------

    @property
    def device_mesh(self):
        """The ``torch.distributed.device_mesh.DeviceMesh`` of this mesh (built on first use)."""
        if self._dm is None:
            from torch.distributed.device_mesh import init_device_mesh
            self._dm = init_device_mesh(self.mesh.device.type, self.mesh.shape,
                                        mesh_dim_names=self.mesh.axis_names)
        return self._dm

    def process_group(self, group: Group):
        """The torch ProcessGroup of ``group`` (created on first use, on every rank)."""
        return self._rec(group).pg

    def open(self, group: Group) -> None:
        self._rec(group)

    def _rec(self, group: Group) -> _PG:
        rec = self._recs.get(group)
        if rec is None:
            pg = self._make_pg(group)
            pg_of = tuple(dist.get_group_rank(pg, r) for r in group.ranks)
            m = self.mesh
            key = zlib.crc32(repr((m.shape, m.axis_names, group.axes, group.ranks,
                                   group.channel)).encode())
            rec = self._recs[group] = _PG(pg, pg_of, key)
        return rec

    def _make_pg(self, group: Group):
        axes, mesh = group.axes, self.mesh
        if not group.channel:
            if len(axes) == 1:
                return self.device_mesh.get_group(axes[0])
            if len(set(axes)) == len(mesh.axis_names):
                return dist.group.WORLD
        # Another channel gets process groups of its own, so that its collectives never
        # queue behind (or meet) the default channel's.
        key = (frozenset(axes), group.channel)
        pgs = self._pgs.get(key)
        if pgs is None:
            # new_group is collective over the whole world: every rank creates every
            # group of the partition, in the same (sorted) order.
            parts = sorted({tuple(sorted(mesh.group(axes, r).ranks)) for r in range(mesh.size)})
            pgs = self._pgs[key] = {p: dist.new_group(list(p)) for p in parts}
        return pgs[tuple(sorted(group.ranks))]

    # -- waiting --------------------------------------------------------------------

    def _enter(self, rec: _PG) -> int:
        counts = self._progress.counts
        seq = counts.get(rec.key, 0)
        counts[rec.key] = seq + 1
        return seq

    def _wait(self, work, name: str, group: Group, rec: _PG, seq: int, peers=None,
              deadline: float | None = None) -> None:
        td = self._td if deadline is None else datetime.timedelta(
            seconds=max(deadline - time.monotonic(), 0.001))
        try:
            work.wait(timeout=td)
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq, peers) from e

    def _call(self, fn, name, group, rec, seq, *args, **kw) -> None:
        """Run a collective with ``async_op=True`` and wait for it, bounded by the timeout."""
        try:
            work = fn(*args, group=rec.pg, async_op=True, **kw)
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq) from e
        self._wait(work, name, group, rec, seq)

    def _failure(self, e: BaseException, name: str, group: Group, rec: _PG, seq: int,
                 peers=None) -> CommError:
        msg = str(e)
        where = f"{name} over {_axes(group)}"
        low = msg.lower()
        if "timed out" in low or "timeout" in low:
            if peers is None:
                peers = [r for r in group.ranks if r != group.rank]
            # Ranks that arrived later time out later: give them a moment to mark.
            grace = min(5.0, max(1.0, 0.1 * self.mesh.timeout))
            missing, elsewhere = self._progress.missing(rec.key, seq, peers, grace, name,
                                                         self.mesh.timeout + 2 * grace + 5)
            who = (f"ranks {list(missing)} of the group {list(group.ranks)} did not arrive"
                   if missing else "")
            if elsewhere:
                who += ("; " if who else "") + "; ".join(
                    f"rank {r} is waiting in {w} instead" for r, w in sorted(elsewhere.items()))
                who += (": the ranks do not run the same collectives in the same order "
                        "(e.g. an argument such as out_specs, or requires_grad, that "
                        "differs from rank to rank)")
            if not who:
                who = (f"could not tell which ranks of the group {list(group.ranks)} did "
                       f"not arrive")
            return CommTimeout(f"{where} timed out after {self.mesh.timeout:g} s on rank "
                               f"{group.rank}: {who}", op=name, axes=group.axes, missing=missing)
        if "closed" in low or "reset" in low or "abort" in low:
            # A peer's process died (or aborted): the ranks that never reached this call
            # say which, as for a timeout.
            if peers is None:
                peers = [r for r in group.ranks if r != group.rank]
            # the others fail now too: a short grace
            missing, _ = self._progress.missing(rec.key, seq, peers, 0.3, name)
            who = f"; ranks {list(missing)} never reached it" if missing else ""
            return CommAborted(f"{where} failed on rank {group.rank} (group "
                               f"{list(group.ranks)}): {msg}{who}", op=name, axes=group.axes,
                               missing=missing)
        return CommError(f"{where} failed on rank {group.rank} (group {list(group.ranks)}): "
                         f"{msg}", op=name, axes=group.axes)

    def _p2p(self, fn, t, peer, name, group, rec, seq, peers, deadline) -> None:
        """One blocking isend/irecv of contiguous ``t``, bounded by ``deadline``."""
        try:
            work = fn(_bytes(t), peer, group=rec.pg)
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq, peers) from e
        self._wait(work, name, group, rec, seq, peers, deadline)



class _Progress:
    """Per-process call counts per group, and the post-mortem of a timeout.

    Nothing is published while things work. On a timeout, each rank that did arrive
    marks ``(group, call number)`` in the job's store (a ``TCPStore`` client to
    ``MASTER_ADDR:MASTER_PORT``, as set by torchrun and spmd.launch), waits a short
    grace for the other arrivals to time out and mark too, and names the members that
    never marked: they did not arrive.
    """

    _instance: _Progress | None = None

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.rank = _rank_or(-1)
        self._store = None

    @classmethod
    def get(cls) -> _Progress:
        inst = cls._instance
        if inst is None or inst.rank != _rank_or(-2):
            inst = cls._instance = cls()
        return inst

    def _connect(self):
        if self._store is None:
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not addr or not port:
                return None
            self._store = dist.TCPStore(addr, int(port), is_master=False,
                                        timeout=datetime.timedelta(seconds=5))
        return self._store

    def missing(self, key: int, seq: int, peers, grace: float, what: str = "",
                max_age: float = 0.0) -> tuple[tuple[int, ...], dict[int, str]]:
        """Peers that never marked call ``seq`` of group ``key`` (empty if unknown), after
        ``grace`` seconds for the others to mark; and the peers that are waiting in
        another call of this group (timing out as well, at most ``max_age`` seconds ago),
        with that call: ``what`` (this rank's op) and the call number are published for
        them to read."""
        try:
            store = self._connect()
            if store is None:
                return (), {}
            store.set(f"spmd/arrived/{key}/{seq}/{self.rank}", "1")
            store.set(f"spmd/in/{key}/{self.rank}", f"{what}\n{seq}\n{time.time()}")
            time.sleep(grace)
            missing = tuple(r for r in peers
                            if not store.check([f"spmd/arrived/{key}/{seq}/{r}"]))
            elsewhere = {}
            for r in peers:
                if store.check([f"spmd/in/{key}/{r}"]):
                    op, s, when = store.get(f"spmd/in/{key}/{r}").decode().split("\n")
                    # older than ``max_age``: a record of an earlier timeout (the store
                    # outlives a run), not of this one
                    if (op, int(s)) != (what, seq) and time.time() - float(when) < max_age:
                        elsewhere[r] = f"{op} (call #{s} on this group)"
            return missing, elsewhere
        except Exception:  # noqa: BLE001 - best effort: then the message says "could not tell"
            return (), {}


def _rank_or(default: int) -> int:
    try:
        return dist.get_rank()
    except Exception:  # noqa: BLE001
        return default

