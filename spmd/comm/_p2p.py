"""Point-to-point transfers in envelopes (``_envelope.py``): all_gather, all_to_all and
permute on the checked path of ``TorchComm``.

``_Exchange._start`` posts the envelope receives and sends everything (envelope, then
the payload where it is not inline); ``_Flight.heads`` waits for the envelopes;
``_Flight.finish`` receives the payloads the envelopes announced and waits for the sends.
A caller checks the heads between the two, and on a disagreement calls ``drain`` (the
announced payloads are received and dropped, so that no message is left for a later
call) before raising.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.errors import CommError
from ._envelope import (HEAD, INLINE, MAGIC, MAGIC_VALUE, NBYTES, SIZE, as_tensor, pack,
                        payload_of, tag_of)
from ._meta import _bytes

__all__ = ["_Exchange", "_Flight"]


class _Flight:
    """One started exchange: its receives, sends and what they need kept alive."""

    __slots__ = ("comm", "group", "rec", "seq", "name", "tag", "peers", "deadline", "recvs",
                 "sends", "keep", "_heads", "device")

    def __init__(self, comm, group, rec, seq, name, peers, device):
        self.comm, self.group, self.rec, self.seq, self.name = comm, group, rec, seq, name
        self.tag, self.peers, self.device = tag_of(seq), peers, device
        self.deadline = time.monotonic() + comm.mesh.timeout
        self.recvs: dict[int, tuple[torch.Tensor, object]] = {}
        self.sends: list = []
        self.keep: list[torch.Tensor] = []
        self._heads: dict[int, list[int]] | None = None

    def _wait(self, work) -> None:
        self.comm._wait(work, self.name, self.group, self.rec, self.seq, self.peers,
                        self.deadline)

    def heads(self) -> dict[int, list[int]]:
        """member -> the head it sent (waits for the envelopes)."""
        if self._heads is None:
            for _, w in self.recvs.values():
                self._wait(w)
            if not self.recvs:
                self._heads = {}
            else:
                members = list(self.recvs)
                envs = torch.stack([self.recvs[m][0] for m in members])
                heads = envs[:, :HEAD].view(torch.int64).tolist()
                self._heads = dict(zip(members, heads))
        return self._heads

    def finish(self) -> dict[int, torch.Tensor]:
        """member -> its payload as it announced it (dtype and shape; inline ones are views
        of their envelope); waits for this rank's sends too."""
        heads = self.heads()
        big = {}
        pg, ranks = self.rec.pg, self.group.ranks
        try:
            for m, h in heads.items():
                if h[NBYTES] > INLINE:
                    buf = torch.empty(h[NBYTES], dtype=torch.uint8, device=self.device)
                    big[m] = (buf, dist.irecv(buf, ranks[m], group=pg, tag=self.tag))
        except RuntimeError as e:
            raise self.comm._failure(e, self.name, self.group, self.rec, self.seq,
                                     self.peers) from e
        out = {}
        for m, h in heads.items():
            if m in big:
                buf, w = big[m]
                self._wait(w)
                out[m] = as_tensor(buf, h)
            else:
                out[m] = payload_of(self.recvs[m][0], h)
        self.wait_sends()
        return out

    def drain(self) -> None:
        """Receive and drop the announced payloads and finish the sends, before raising a
        disagreement: a message left behind would meet a later call. Heads that are not
        spmd's announce nothing to trust: then nothing is received."""
        try:
            if all(h[MAGIC] == MAGIC_VALUE for h in self.heads().values()):
                self.finish()
            else:
                self.wait_sends()
        except CommError:
            pass  # the disagreement is the error to report

    def wait_sends(self) -> None:
        sends, self.sends = self.sends, []
        for w in sends:
            self._wait(w)
        self.keep = []


class _Exchange:
    """Starting envelope exchanges; mixed into ``TorchComm``."""

    def _start(self, group, rec, seq, name, sends, srcs, device) -> _Flight:
        """Post an envelope receive from each member in ``srcs``, then send each
        ``(member, head, contiguous payload)`` of ``sends``: the envelope, and the
        payload after it where it is larger than ``INLINE``."""
        ranks = group.ranks
        peers = sorted({ranks[m] for m, _, _ in sends} | {ranks[s] for s in srcs})
        f = _Flight(self, group, rec, seq, name, peers, device)
        pg, tag = rec.pg, f.tag
        try:
            for s in srcs:
                env = torch.empty(SIZE, dtype=torch.uint8, device=device)
                f.recvs[s] = (env, dist.irecv(env, ranks[s], group=pg, tag=tag))
            envs: dict[int, torch.Tensor] = {}  # one envelope per distinct head
            for m, head, payload in sends:
                env = envs.get(id(head))
                if env is None:
                    env = envs[id(head)] = pack(head, payload, device)
                    f.keep.append(env)
                f.sends.append(dist.isend(env, ranks[m], group=pg, tag=tag))
                if head[NBYTES] > INLINE:
                    f.keep.append(payload)
                    f.sends.append(dist.isend(_bytes(payload), ranks[m], group=pg, tag=tag))
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq, peers) from e
        return f
