"""Point-to-point transfers in envelopes (``_envelope.py``): all_gather, all_to_all and
permute on the checked path of ``TorchComm``.

Each sender sends each receiver ONE first message: its envelope, followed by the
payload's first ``FIRST`` bytes where the payload is not inline; a payload larger than
that follows at once as a second message, the rest. Each receiver posts, for each
member it receives from, one receive of ``SIZE + FIRST`` bytes before anything else
(``_Exchange._start``), so that any first message fits; ``_Flight.heads`` waits for the
first messages, and ``_Flight.finish`` receives the rests their envelopes announced (of
exactly that size) and waits for the sends. A caller checks the heads between the two,
and on a disagreement calls ``drain`` (the rests are received and dropped, so that no
message is left for a later call) before raising.

No message is ever larger than the receive it meets (gloo aborts the process on that):
a first message holds at most ``SIZE + FIRST`` bytes whatever the sender believes, and a
rest is received at the size its own envelope announced. One message each way is the
point: on gloo over loopback each message costs a wake-up of the peer's transport
thread, and with the cores busy computing a halo exchange of three messages each way
(and a receive posted ahead) took 1.6-2.7 ms around a 0.3 ms convolution, one message
each way 0.8-1.1 ms (docs/performance.md).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.errors import CommError
from ._envelope import (HEAD, INLINE, KIND, LEFT, MAGIC, MAGIC_VALUE, NBYTES, SIZE, as_tensor,
                        pack, payload_of, tag_of)
from ._meta import _bytes

__all__ = ["_Exchange", "_Flight", "FIRST"]

# The payload bytes a first message carries after its envelope: a payload of at most
# this many bytes (a halo, a small gather) travels in one message.
FIRST = 256 << 10


class _Flight:
    """One started exchange: its receives, sends and what they need kept alive."""

    __slots__ = ("comm", "group", "rec", "seq", "name", "tag", "peers", "deadline", "recvs",
                 "sends", "keep", "_heads", "device")

    def __init__(self, comm, group, rec, seq, name, peers, device):
        self.comm, self.group, self.rec, self.seq, self.name = comm, group, rec, seq, name
        self.tag, self.peers, self.device = tag_of(seq), peers, device
        self.deadline = time.monotonic() + comm.mesh.timeout
        self.recvs: dict[int, tuple[torch.Tensor, object]] = {}  # member -> (buffer, work)
        self.sends: list = []
        self.keep: list[torch.Tensor] = []
        self._heads: dict[int, list[int]] | None = None

    def _wait(self, work) -> None:
        self.comm._wait(work, self.name, self.group, self.rec, self.seq, self.peers,
                        self.deadline)

    def heads(self) -> dict[int, list[int]]:
        """member -> the head it sent (waits for the first messages)."""
        if self._heads is None:
            for _, w in self.recvs.values():
                if w is not None:
                    self._wait(w)
            if not self.recvs:
                self._heads = {}
            elif len(self.recvs) == 1:  # a permute, a world of 2: no stacking
                (m, (buf, _)), = self.recvs.items()
                self._heads = {m: buf[:HEAD].view(torch.int64).tolist()}
            else:
                members = list(self.recvs)
                firsts = torch.stack([self.recvs[m][0][:HEAD] for m in members])
                heads = firsts.view(torch.int64).tolist()
                self._heads = dict(zip(members, heads))
        return self._heads

    def finish(self, keep: bool = True) -> dict[int, torch.Tensor]:
        """member -> its payload as it announced it (dtype and shape); waits for this
        rank's sends too. ``keep=False``: receive and drop (``drain``)."""
        heads = self.heads()
        whole, ops = {}, []
        pg, ranks = self.rec.pg, self.group.ranks
        for m, h in heads.items():
            nb = h[NBYTES]
            if nb > FIRST:  # the first piece arrived with the envelope; the rest follows
                buf = whole[m] = torch.empty(nb, dtype=torch.uint8, device=self.device)
                buf[:FIRST].copy_(self.recvs[m][0][SIZE:SIZE + FIRST])
                ops.append(dist.P2POp(dist.irecv, buf[FIRST:], ranks[m], pg, self.tag))
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as e:
            raise self.comm._failure(e, self.name, self.group, self.rec, self.seq,
                                     self.peers) from e
        for w in works:
            self._wait(w)
        self.wait_sends()
        if not keep:
            return {}
        out = {}
        for m, h in heads.items():
            nb, buf = h[NBYTES], self.recvs[m][0]
            if m in whole:
                out[m] = as_tensor(whole[m], h)
            elif nb <= INLINE:  # copies: a view would keep the whole receive alive
                out[m] = payload_of(buf, h).clone()
            else:
                out[m] = as_tensor(buf[SIZE:SIZE + nb].clone(), h)
        return out

    def drain(self) -> None:
        """Receive and drop the rests and finish the sends, before raising a
        disagreement: a message left behind would meet a later call. Heads that are not
        spmd's announce nothing to trust: then nothing more is received."""
        try:
            heads = self.heads().values()
            if any(h[KIND] == LEFT for h in heads):
                return  # a peer stopped: it sends nothing more, and this rank stops too
            if all(h[MAGIC] == MAGIC_VALUE for h in heads):
                self.finish(keep=False)
            else:
                self.wait_sends()
        except CommError:
            pass  # the disagreement is the error to report

    def wait_sends(self) -> None:
        sends, self.sends = self.sends, []
        for w in sends:
            if w is not None:
                self._wait(w)
        self.keep = []


class _Exchange:
    """Starting envelope exchanges; mixed into ``TorchComm``."""

    def _start(self, group, rec, seq, name, sends, srcs, device) -> _Flight:
        """Send each ``(member, head, contiguous payload)`` of ``sends`` its first message
        (the envelope, then the payload's first ``FIRST`` bytes where it is not inline)
        and the rest of a larger payload, and post the first message's receive of each
        member in ``srcs``."""
        ranks = group.ranks
        peers = sorted({ranks[m] for m, _, _ in sends} | {ranks[s] for s in srcs})
        f = _Flight(self, group, rec, seq, name, peers, device)
        pg, tag = rec.pg, f.tag
        # Sends first: a receive posted before its peer's send is gloo's slow path
        # (milliseconds on a loaded machine, against ~0.15 ms the other way round).
        ops = []
        firsts: dict[int, torch.Tensor] = {}  # one first message per distinct head
        for m, head, payload in sends:
            msg = firsts.get(id(head))
            if msg is None:
                msg = firsts[id(head)] = _first(head, payload, device)
                f.keep.append(msg)
            ops.append(dist.P2POp(dist.isend, msg, ranks[m], pg, tag))
            if head[NBYTES] > FIRST:
                f.keep.append(payload)
                ops.append(dist.P2POp(dist.isend, _bytes(payload)[FIRST:], ranks[m], pg, tag))
        nsend = len(ops)
        bufs = []
        for s in srcs:
            buf = torch.empty(SIZE + FIRST, dtype=torch.uint8, device=device)
            bufs.append((s, buf))
            ops.append(dist.P2POp(dist.irecv, buf, ranks[s], pg, tag))
        works = self._batch(f, ops)
        for (s, buf), w in zip(bufs, works[nsend:]):
            f.recvs[s] = (buf, w)
        f.sends = works[:nsend]
        return f

    def _batch(self, f: _Flight, ops: list) -> list:
        """Start ``ops``: one work per op (None each where the batch came back as one
        work, which is waited for here)."""
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as e:
            raise self._failure(e, f.name, f.group, f.rec, f.seq, f.peers) from e
        if len(works) != len(ops):  # one work for the whole batch (coalesced): finish it
            for w in works:
                f._wait(w)
            works = [None] * len(ops)
        return works


def _first(head: list[int], payload: torch.Tensor, device) -> torch.Tensor:
    """The first message of ``payload`` (contiguous) under ``head``: its envelope (the
    payload inline where it fits), then the payload's first ``FIRST`` bytes where not."""
    nb = head[NBYTES]
    if nb <= INLINE:
        return pack(head, payload, device)
    msg = pack(head, None, device, room=min(nb, FIRST))
    msg[SIZE:].copy_(_bytes(payload)[:FIRST])
    return msg
