"""Point-to-point transfers in envelopes (``_envelope.py``): all_gather, all_to_all and
permute on the checked path of ``TorchComm``.

``_Exchange._start`` sends everything it can (envelope, then the payload's first piece
where it is not inline) and posts the envelope receives; ``_Flight.heads`` waits for the
envelopes; ``_Flight.finish`` receives the payloads the envelopes announced and waits
for the sends. A caller checks the heads between the two, and on a disagreement calls
``drain`` (the payloads are received and dropped, so that no message is left for a
later call) before raising.

No message is ever larger than the receive it meets (gloo aborts the process on that):

- a payload travels in at most two pieces: the first ``PIECE`` bytes, sent at once, and
  the rest;
- each receiver tells each sender its plan: how many payload bytes it posted receives
  for ahead of the envelope (``expect``), or -1 (it receives what the envelope
  announces). A receive posted ahead for the first piece holds ``PIECE`` bytes whatever
  the plan, so any first piece fits; one for the rest holds the plan's rest, and the
  sender cuts its rest to it, which it sends once the plan arrived (while its first
  piece is on the way);
- a sender sends a receiver that planned ahead exactly the pieces it posted receives for
  (a payload smaller than planned, or inline, fills them as far as it goes), so none is
  left waiting. The envelope still says what was sent: a payload of another size than
  planned raises on the receiver.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.errors import CommError
from ._envelope import (HEAD, INLINE, KIND, LEFT, MAGIC, MAGIC_VALUE, NBYTES, PLAN_TAG, SIZE,
                        as_tensor,
                        pack, payload_of, tag_of)
from ._meta import _bytes

__all__ = ["_Exchange", "_Flight", "PIECE"]

# The first piece of a payload, sent without waiting for the receiver's plan: a payload
# of at most this many bytes leaves at once. A receiver that planned fewer receives into
# a buffer of this size (its result: a view where it fills at least half, else a copy).
PIECE = 1 << 20


class _Flight:
    """One started exchange: its receives, sends and what they need kept alive."""

    __slots__ = ("comm", "group", "rec", "seq", "name", "tag", "peers", "deadline", "recvs",
                 "sends", "keep", "_heads", "device", "pre", "plans", "owed")

    def __init__(self, comm, group, rec, seq, name, peers, device):
        self.comm, self.group, self.rec, self.seq, self.name = comm, group, rec, seq, name
        self.tag, self.peers, self.device = tag_of(seq), peers, device
        self.deadline = time.monotonic() + comm.mesh.timeout
        self.recvs: dict[int, tuple[torch.Tensor, object]] = {}
        self.sends: list = []
        self.keep: list[torch.Tensor] = []
        self._heads: dict[int, list[int]] | None = None
        # member -> (buffer, [works]) of the payload receives posted ahead, and its plan
        self.pre: dict[int, tuple[torch.Tensor, list, int]] = {}
        self.plans: dict[int, tuple[torch.Tensor, object]] = {}  # member -> its plan
        self.owed: dict[int, tuple[torch.Tensor, bool]] = {}  # member -> (payload, first sent)

    def _wait(self, work) -> None:
        self.comm._wait(work, self.name, self.group, self.rec, self.seq, self.peers,
                        self.deadline)

    def heads(self) -> dict[int, list[int]]:
        """member -> the head it sent (waits for the envelopes). First the rest of a
        payload larger than a piece leaves, its receiver's plan arrived by now (it left
        with the receiver's envelope), while the first piece is on its way."""
        self.settle(large=True)
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

    def finish(self, keep: bool = True) -> dict[int, torch.Tensor]:
        """member -> its payload as it announced it (dtype and shape; inline ones are views
        of their envelope); waits for this rank's sends too. A payload received ahead
        (``expect``) is the caller's to have checked: its head announced the bytes
        planned. ``keep=False``: receive and drop (``drain``)."""
        heads = self.heads()
        big, ops = {}, []
        pg, ranks = self.rec.pg, self.group.ranks
        for m, h in heads.items():
            nb = h[NBYTES]
            if nb > INLINE and m not in self.pre:  # as announced, in its pieces
                big[m] = torch.empty(nb, dtype=torch.uint8, device=self.device)
                for a, b in ((0, min(nb, PIECE)), (PIECE, nb)):
                    if b > a:
                        ops.append(dist.P2POp(dist.irecv, big[m][a:b], ranks[m], pg,
                                              self.tag))
        self.settle()
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as e:
            raise self.comm._failure(e, self.name, self.group, self.rec, self.seq,
                                     self.peers) from e
        for w in works:
            self._wait(w)
        for m, (buf, ws, plan) in self.pre.items():
            for w in ws:
                self._wait(w)
            nb = heads[m][NBYTES]
            if nb > INLINE and nb == plan:
                big[m] = buf[:nb] if 2 * nb >= buf.numel() else buf[:nb].clone()
        self.wait_sends()
        if not keep:
            return {}
        out = {}
        for m, h in heads.items():
            if m in big:
                out[m] = as_tensor(big[m], h)
            else:
                out[m] = payload_of(self.recvs[m][0], h)
        return out

    def drain(self) -> None:
        """Receive and drop the payloads and finish the sends, before raising a
        disagreement: a message left behind would meet a later call. Heads that are not
        spmd's announce nothing to trust: then nothing is received."""
        try:
            heads = self.heads().values()
            if any(h[KIND] == LEFT for h in heads):
                return  # a peer stopped: it sends nothing more, and this rank stops too
            if all(h[MAGIC] == MAGIC_VALUE for h in heads):
                self.finish(keep=False)
            else:
                self.settle()
                self.wait_sends()
        except CommError:
            pass  # the disagreement is the error to report

    def settle(self, large: bool = False) -> None:
        """Send each member what its plan posted receives for and is still owed: the
        rest of a payload (cut to the plan), or pieces that a payload smaller than
        planned (or inline) does not fill. ``large``: only the members owed the rest of a
        payload larger than a piece (their plans are waited for: sent at once)."""
        owed = self.owed
        todo = [m for m, (p, _) in owed.items()
                if not large or p.numel() * p.element_size() > PIECE]
        for m in todo:
            payload, first = owed.pop(m)
            t, w = self.plans.pop(m)
            if w is not None:
                self._wait(w)
            plan = int(t.item())
            raw = _bytes(payload)
            nb = raw.numel()
            pieces = []
            if not first and plan >= 0:  # an inline payload; the plan posted a first piece
                pieces.append(raw[:min(nb, PIECE)])
            if plan > PIECE or (plan < 0 and nb > PIECE):
                pieces.append(raw[PIECE:nb if plan < 0 else min(nb, plan)])
            for p in pieces:
                p = p if p.numel() else torch.zeros(1, dtype=torch.uint8, device=self.device)
                self.keep.append(p)
                self.sends += self.comm._batch(self, [dist.P2POp(
                    dist.isend, p, self.group.ranks[m], self.rec.pg, self.tag)])

    def wait_sends(self) -> None:
        self.settle()
        sends, self.sends = self.sends, []
        for w in sends:
            if w is not None:
                self._wait(w)
        self.keep = []


class _Exchange:
    """Starting envelope exchanges; mixed into ``TorchComm``."""

    def _start(self, group, rec, seq, name, sends, srcs, device, expect=None) -> _Flight:
        """Send each ``(member, head, contiguous payload)`` of ``sends`` its envelope and
        the payload's first piece where it is larger than ``INLINE``, send each member in
        ``srcs`` this rank's plan and post its envelope's receive. ``expect``: member ->
        the bytes this rank's plan expects from it, where known: the payload's receives
        are then posted now, not after its envelope arrived (gloo's slow path)."""
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
            first = head[NBYTES] > INLINE
            if first:
                f.keep.append(payload)
                ops.append(dist.P2POp(dist.isend, _bytes(payload)[:PIECE], ranks[m], pg, tag))
            f.owed[m] = (payload, first)
        plans = {s: expect[s] if expect is not None and expect[s] > INLINE else -1
                 for s in srcs}
        if srcs:
            out = torch.tensor([plans[s] for s in srcs], dtype=torch.int64, device=device)
            f.keep.append(out)
            for k, s in enumerate(srcs):
                ops.append(dist.P2POp(dist.isend, out[k:k + 1], ranks[s], pg, tag + PLAN_TAG))
        nsend = len(ops)
        recv_envs, plan_in = [], []
        for s in srcs:
            env = torch.empty(SIZE, dtype=torch.uint8, device=device)
            recv_envs.append((s, env))
            ops.append(dist.P2POp(dist.irecv, env, ranks[s], pg, tag))
        if sends:
            got = torch.empty(len(sends), dtype=torch.int64, device=device)
            for k, (m, _, _) in enumerate(sends):
                plan_in.append((m, got[k:k + 1]))
                ops.append(dist.P2POp(dist.irecv, got[k:k + 1], ranks[m], pg, tag + PLAN_TAG))
        nrecv = len(ops)
        pre = []
        for s in srcs:
            plan = plans[s]
            if plan >= 0:  # the first piece's receive holds PIECE bytes whatever the plan
                buf = torch.empty(max(plan, PIECE), dtype=torch.uint8, device=device)
                pre.append((s, buf, plan, len(ops)))
                ops.append(dist.P2POp(dist.irecv, buf[:PIECE], ranks[s], pg, tag))
                if plan > PIECE:
                    ops.append(dist.P2POp(dist.irecv, buf[PIECE:plan], ranks[s], pg, tag))
        works = self._batch(f, ops[:nrecv])
        for (s, env), w in zip(recv_envs, works[nsend:]):
            f.recvs[s] = (env, w)
        for (m, t), w in zip(plan_in, works[nsend + len(recv_envs):]):
            f.plans[m] = (t, w)
        f.sends = works[:nsend]
        if works and works[0] is None:  # a coalesced batch waits for all: rests first
            f.settle(large=True)
        ahead = self._batch(f, ops[nrecv:])
        for s, buf, plan, at in pre:
            f.pre[s] = (buf, ahead[at - nrecv:at - nrecv + 1 + (plan > PIECE)], plan)
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
