"""``scatter`` on torch.distributed: point to point, source to each other member, in
pieces of at most ``_PIECE`` bytes that both sides derive from the shape (mixed into
``TorchComm``, ``distributed.py``)."""
from __future__ import annotations

import collections
import itertools
import time

import torch
import torch.distributed as dist

from ._meta import (_ROW, _bytes, _copy, _dtype, _numel, _piece_bytes, _plans_disagree, _row,
                    _row_of)
from .base import check_scatter
from .stats import count

__all__ = ["_Scatter"]

# scatter sends every chunk in pieces of at most _PIECE bytes (a plan both sides derive
# from the shape), strided ones copied through _STAGES staging buffers (a piece's copy
# overlaps the previous piece's send), carved from the source's own result where it has
# room: the source never holds more than its tensor plus max(own shard, _STAGES * _PIECE).
# A multiple of 16 bytes, so that every stage is aligned for every dtype.
_PIECE = 4 << 20
_STAGES = 2


class _Scatter:
    """scatter's source and receiving sides; mixed into ``TorchComm``."""

    def scatter(self, chunks, src, group, *, name, shape, dtype, device):
        n, me = group.size, group.index
        check_scatter(chunks, src, group, name)
        count("all_to_all", name, group, chunks=chunks if me == src else [])
        if n == 1:
            return _copy(chunks[0])
        rec = self._rec(group)
        seq = self._enter(rec)
        shape = tuple(shape)
        if self.validate:
            self._validate_scatter(rec, group, seq, chunks, src, shape, dtype, name)
        # Without validation, on CPU (as _checked), each receiver first gets the metadata
        # row of what the source sends it: plans that differ (rank-dependent sizes) are
        # then a CommError on that receiver, not garbage or gloo aborting the process.
        head = self._checked(torch.device(device))
        if me != src:
            return self._recv_pieces(group, rec, seq, src, shape, dtype, device, name, head)
        mine = chunks[me].detach()
        out = torch.empty(mine.shape, dtype=mine.dtype, device=mine.device)
        self._send_pieces(chunks, group, rec, seq, name, _bytes(out), head)
        # Filled last, once every send finished: the peak is the chunks plus this shard.
        return out.copy_(mine)

    def _recv_pieces(self, group, rec, seq, src, shape, dtype, device, name, head):
        """scatter on a receiving member: straight into the result, piece by piece."""
        peer = group.ranks[src]
        deadline = time.monotonic() + self.mesh.timeout
        if head:
            row = torch.empty(_ROW, dtype=torch.int64, device=device)
            self._p2p(dist.irecv, row, peer, name, group, rec, seq, [peer], deadline)
            sent, want = row.tolist(), _row_of(shape, dtype, name)
            if sent != want:
                # Take what the source sends (it must not hang), then refuse it.
                sdt, sshape = _dtype(sent[0], name), tuple(sent[3:3 + sent[1]])
                junk = torch.empty(min(_PIECE, sent[2] * sdt.itemsize), dtype=torch.uint8,
                                   device=device)
                for _, k in _pieces(sshape, sdt.itemsize):
                    self._p2p(dist.irecv, junk[:k * sdt.itemsize], peer, name, group, rec,
                              seq, [peer], deadline)
                raise _plans_disagree(name, group, group.rank, want, peer, sent,
                                      "sizes or spec", ". Raised on this rank only; "
                                      "SPMD_VALIDATE=1 raises it on every rank")
        out = torch.empty(shape, dtype=dtype, device=device)
        works = []
        for idx, _ in _pieces(shape, out.element_size()):
            try:
                works.append(dist.irecv(_piece_bytes(out[idx]), peer, group=rec.pg))
            except RuntimeError as e:
                raise self._failure(e, name, group, rec, seq, [peer]) from e
        for w in works:
            self._wait(w, name, group, rec, seq, [peer], deadline)
        return out

    def _send_pieces(self, chunks, group, rec, seq, name, spare: torch.Tensor,
                     head: bool) -> None:
        """scatter's source side: every other member's chunk, in ``_pieces`` order
        (after its metadata row where ``head``). Contiguous pieces (all of a contiguous
        chunk) go as they are; strided ones through ``_STAGES`` staging buffers, each
        reused once its send finished. The buffers are carved from ``spare`` (the bytes
        of the source's own result, not written yet) where it is large enough, so that
        they cost no memory of their own."""
        me = group.index
        peers = sorted(group.ranks[i] for i in range(group.size) if i != me)
        deadline = time.monotonic() + self.mesh.timeout
        stages: list[torch.Tensor | None] = [None] * _STAGES
        if spare.numel() >= _STAGES * _PIECE:
            stages = [spare[k * _PIECE:(k + 1) * _PIECE] for k in range(_STAGES)]
        free = list(range(_STAGES))
        pending: collections.deque = collections.deque()  # (work, stage or None), oldest first

        def wait_oldest() -> None:
            w, k = pending.popleft()
            self._wait(w, name, group, rec, seq, peers, deadline)
            if k is not None:
                free.append(k)

        rows = None
        if head:
            rows = torch.tensor([_row(c, name) for c in chunks], dtype=torch.int64,
                                device=chunks[me].device)
        for i, c in enumerate(chunks):
            if i == me:
                continue
            if rows is not None:
                try:
                    pending.append((dist.isend(_bytes(rows[i]), group.ranks[i],
                                               group=rec.pg), None))
                except RuntimeError as e:
                    raise self._failure(e, name, group, rec, seq, peers) from e
            c = c.detach()
            for idx, _ in _pieces(tuple(c.shape), c.element_size()):
                piece, k = c[idx], None
                if not piece.is_contiguous():
                    while not free:
                        wait_oldest()
                    k = free.pop()
                    if stages[k] is None:
                        stages[k] = torch.empty(_PIECE, dtype=torch.uint8, device=c.device)
                    buf = stages[k][:piece.numel() * c.element_size()]
                    piece = buf.view(c.dtype).view(piece.shape).copy_(piece)
                try:
                    pending.append((dist.isend(_piece_bytes(piece), group.ranks[i],
                                               group=rec.pg), k))
                except RuntimeError as e:
                    raise self._failure(e, name, group, rec, seq, peers) from e
        while pending:
            wait_oldest()


def _pieces(shape: tuple[int, ...], itemsize: int) -> list[tuple[tuple, int]]:
    """(index, numel) of the pieces that scatter sends a chunk of ``shape`` in: blocks of
    at most ``_PIECE`` bytes in C order, each contiguous in a contiguous tensor of
    ``shape``. A function of the shape alone: sender and receiver agree without a word."""
    total = _numel(shape)
    if total == 0:
        return []
    limit = max(_PIECE // itemsize, 1)
    d, inner = len(shape), 1  # the trailing dims d.. fit whole into one piece
    while d and inner * shape[d - 1] <= limit:
        d -= 1
        inner *= shape[d]
    if d == 0:
        return [((), total)]
    step = max(limit // inner, 1)  # along dim d - 1, under every index of the dims before
    last = shape[d - 1]
    return [((*lead, slice(j, min(j + step, last))), (min(j + step, last) - j) * inner)
            for lead in itertools.product(*map(range, shape[:d - 1]))
            for j in range(0, last, step)]

