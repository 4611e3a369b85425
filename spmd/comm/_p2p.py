"""Point-to-point transfers in envelopes (``_envelope.py``): all_gather, all_to_all and
permute on the checked path of ``TorchComm``.

``_Exchange._start`` sends everything (envelope, then the payload where it is not
inline) and posts the envelope receives; ``_Flight.heads`` waits for the envelopes;
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
                 "sends", "keep", "_heads", "device", "pre")

    def __init__(self, comm, group, rec, seq, name, peers, device):
        self.comm, self.group, self.rec, self.seq, self.name = comm, group, rec, seq, name
        self.tag, self.peers, self.device = tag_of(seq), peers, device
        self.deadline = time.monotonic() + comm.mesh.timeout
        self.recvs: dict[int, tuple[torch.Tensor, object]] = {}
        self.sends: list = []
        self.keep: list[torch.Tensor] = []
        self._heads: dict[int, list[int]] | None = None
        self.pre: dict[int, tuple[torch.Tensor, object]] = {}  # payload receives posted early

    def _wait(self, work) -> None:
        self.comm._wait(work, self.name, self.group, self.rec, self.seq, self.peers,
                        self.deadline)

    def heads(self) -> dict[int, list[int]]:
        """member -> the head it sent (waits for the envelopes)."""
        if self._heads is None:
            for _, w in self.recvs.values():
                if w is not None:
                    self._wait(w)
            if not self.recvs:
                self._heads = {}
            elif len(self.recvs) == 1:  # a permute, a world of 2: no stacking
                (m, (env, _)), = self.recvs.items()
                self._heads = {m: env[:HEAD].view(torch.int64).tolist()}
            else:
                members = list(self.recvs)
                envs = torch.stack([self.recvs[m][0] for m in members])
                heads = envs[:, :HEAD].view(torch.int64).tolist()
                self._heads = dict(zip(members, heads))
        return self._heads

    def finish(self) -> dict[int, torch.Tensor]:
        """member -> its payload as it announced it (dtype and shape; inline ones are views
        of their envelope); waits for this rank's sends too. A payload whose receive was
        posted with the envelope's (``expect``) is the caller's to have checked: its head
        announced the bytes expected."""
        heads = self.heads()
        big, ops = {}, []
        pg, ranks = self.rec.pg, self.group.ranks
        for m, h in heads.items():
            if h[NBYTES] > INLINE and m not in self.pre:
                big[m] = torch.empty(h[NBYTES], dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, big[m], ranks[m], pg, self.tag))
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as e:
            raise self.comm._failure(e, self.name, self.group, self.rec, self.seq,
                                     self.peers) from e
        for w in works:
            self._wait(w)
        for m, (buf, w) in self.pre.items():
            if heads[m][NBYTES] > INLINE:  # else nothing follows the envelope
                self._wait(w)
                big[m] = buf[:heads[m][NBYTES]]
        out = {}
        for m, h in heads.items():
            if m in big:
                out[m] = as_tensor(big[m], h)
            else:
                out[m] = payload_of(self.recvs[m][0], h)
        self.wait_sends()
        return out

    def drain(self) -> None:
        """Receive and drop the announced payloads and finish the sends, before raising a
        disagreement: a message left behind would meet a later call. Heads that are not
        spmd's announce nothing to trust: then nothing is received. (A payload larger
        than a receive posted early has made gloo abort the process already.)"""
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

    def _start(self, group, rec, seq, name, sends, srcs, device, expect=None) -> _Flight:
        """Send each ``(member, head, contiguous payload)`` of ``sends`` (the envelope,
        and the payload after it where it is larger than ``INLINE``), then post an
        envelope receive from each member in ``srcs``. ``expect``: member -> the bytes
        this rank's plan expects from it, where known: a payload larger than an envelope
        is then received in the same batch as the envelope, not after it (gloo's slow
        path): the envelope still says what was sent, so a payload of another size than
        planned still raises (a smaller one arrives; a larger one makes gloo abort)."""
        ranks = group.ranks
        peers = sorted({ranks[m] for m, _, _ in sends} | {ranks[s] for s in srcs})
        f = _Flight(self, group, rec, seq, name, peers, device)
        pg, tag = rec.pg, f.tag
        # Sends first: a receive posted before its peer's send is gloo's slow path
        # (milliseconds on a loaded machine, against ~0.15 ms the other way round).
        ops = []
        envs: dict[int, torch.Tensor] = {}  # one envelope per distinct head
        for m, head, payload in sends:
            env = envs.get(id(head))
            if env is None:
                env = envs[id(head)] = pack(head, payload, device)
                f.keep.append(env)
            ops.append(dist.P2POp(dist.isend, env, ranks[m], pg, tag))
            if head[NBYTES] > INLINE:
                f.keep.append(payload)
                ops.append(dist.P2POp(dist.isend, _bytes(payload), ranks[m], pg, tag))
        nsend = len(ops)
        recv_envs, pre = [], []
        for s in srcs:
            env = torch.empty(SIZE, dtype=torch.uint8, device=device)
            recv_envs.append((s, env))
            ops.append(dist.P2POp(dist.irecv, env, ranks[s], pg, tag))
        nrecv = len(ops)
        for s in srcs:
            if expect is not None and expect[s] > INLINE:
                buf = torch.empty(expect[s], dtype=torch.uint8, device=device)
                pre.append((s, buf))
                ops.append(dist.P2POp(dist.irecv, buf, ranks[s], pg, tag))
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq, peers) from e
        if len(works) != len(ops):  # one work for the whole batch (coalesced): finish it
            for w in works:
                f._wait(w)
            works = [None] * len(ops)
        for (s, env), w in zip(recv_envs, works[nsend:nrecv]):
            f.recvs[s] = (env, w)
        for (s, buf), w in zip(pre, works[nrecv:]):
            f.pre[s] = (buf, w)
        f.sends = [w for w in works[:nsend] if w is not None]
        return f
