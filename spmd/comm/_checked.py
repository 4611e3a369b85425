"""The checked paths of ``TorchComm``: collectives in envelopes (``_envelope.py``).

``_Checked`` is mixed into ``TorchComm`` (``distributed.py``), whose collectives take
these paths for CPU tensors with default settings: small reductions, barriers and small
all_gathers as one all_gather of envelopes; larger all_gathers, all_to_alls and
permutes point to point (``_p2p.py``), envelope first.
"""
from __future__ import annotations

import zlib

import torch

from ..core.errors import CommError
from . import _envelope
from ._envelope import Rows
from ._meta import (_ROP_CODE, _all_gather_single, _bytes, _copy, _plans_disagree, _row_of)
from .base import Pending

__all__ = ["_Checked"]


class _Checked:
    """The envelope paths; mixed into ``TorchComm``."""

    def leave(self, rank: int, step: int, exc: BaseException) -> None:
        """This rank stops in the middle of a program (``rank`` left a converted model's
        plan at ``step``; ``exc``: why): every group it opened gets its next call from
        this rank as a ``left`` envelope, both ways, since the others may wait in either
        transport: an all_gather of envelopes, and point to point (the envelope as a
        first message, ``_p2p.py``). The others raise ``CommAborted`` naming ``rank`` and
        pass it on. Nothing is waited for: the process group is spent, as after any
        failure in the middle of a program."""
        import torch.distributed as dist
        kept = self.__dict__.setdefault("_left_behind", [])
        for group, rec in list(self._recs.items()):
            if group.size == 1:
                continue
            seq = self._progress.counts.get(rec.key, 0)
            env = _envelope.leave_envelope(seq, rank, step, self.mesh.device)
            out = torch.empty(group.size * _envelope.SIZE, dtype=torch.uint8,
                              device=env.device)
            tag = _envelope.tag_of(seq)
            works = []
            try:
                works.append(_all_gather_single(out, env, group=rec.pg, async_op=True))
                for m, r in enumerate(group.ranks):
                    if m != group.index:
                        works.append(dist.isend(env, r, group=rec.pg, tag=tag))
            except RuntimeError:
                pass  # a peer already gone: it does not wait
            kept.append((env, out, works))

    def _gathered(self, x, op, group, rec, seq, name):
        """A small reduction as one all_gather of every member's envelope (the head and
        the payload inline, ``_envelope.py``), reduced locally: gloo's ring all-reduce of
        a header and a few elements takes twice the steps of an all-gather, so this is
        the cheap way to check everything (kind, call number, op, dtype, shape) in the
        same round trip. Every member reduces the same rows in the same order, so the
        result is bitwise equal on all of them; NaN wins (amax/amin) with no second round."""
        vals = self._envelopes(group, rec, seq, name, "all_reduce", _ROP_CODE[op], x).vals
        # a new tensor of x's shape: the buffers serve the next call
        if x.dtype == torch.bool:
            return vals.all(0) if op == "min" else vals.any(0)
        if op == "sum":
            return vals.sum(0) if x.is_floating_point() else vals.sum(0, dtype=x.dtype)
        return vals.amax(0) if op == "max" else vals.amin(0)

    def _envelopes(self, group, rec, seq, name, kind, extra, x, *, meta=None, meanwhile=None,
                   **check) -> Rows:
        """Every member's envelope of ``x`` (None: no payload; ``meta``: the (shape, dtype,
        device) it announces instead), in one all_gather, checked (``check``:
        ``check_all``'s options): the rows, in process-group order. ``meanwhile``: local
        work run while the all_gather is in flight. A collective, not point to point: on
        a loaded machine each point-to-point wait can cost a scheduler's time slice
        (milliseconds), a collective's far less."""
        if x is not None:
            shape, dtype, device = x.shape, x.dtype, x.device
        elif meta is not None:
            shape, dtype, device = meta
        else:
            shape, dtype, device = (), torch.uint8, self.mesh.device
        cache = self._local.__dict__.get("rows")
        if cache is None:
            cache = self._local.rows = {}
        key = (kind, extra, dtype, shape, rec, device)
        g = cache.get(key)
        if g is None:
            if len(cache) >= 256:  # a program of many small shapes: start over
                cache.clear()
            g = cache[key] = Rows(kind, extra, shape, dtype, group.size, name, device)
        try:
            self._fill(g, seq, x)
        except RuntimeError:
            # Under a torch.func transform, which refuses writes into tensors made
            # outside it: buffers of this call's own.
            g = Rows(kind, extra, shape, dtype, group.size, name, device)
            self._fill(g, seq, x)
        try:
            work = _all_gather_single(g.out, g.env, group=rec.pg, async_op=True)
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq) from e
        if meanwhile is not None:
            meanwhile()
        self._wait(work, name, group, rec, seq)
        if not torch.equal(g.heads, g.expect):
            heads = _envelope.heads_of(g.heads)
            _envelope.check_all([heads[p] for p in rec.pg_of], group, name, **check)
        return g

    @staticmethod
    def _fill(g: Rows, seq: int, x) -> None:
        """This call's number, and ``x`` where it is inline, into ``g``'s envelope."""
        g.seq.fill_(seq)
        if x is not None and g.mine.shape == x.shape:  # inline (else a (0,) stand-in)
            g.mine.copy_(x.detach())

    def _all_gather_gathered(self, x, group, rec, seq, d, sizes, name):
        """all_gather as one all_gather of envelopes, checked (kind, call number, dim,
        dtype, shape, ``sizes``), payloads inline; where a member's payload did not fit
        (sizes not known beforehand), a second all_gather of the payloads, padded to the
        largest of the verified heads: every rank takes that second round alike."""
        g = self._envelopes(group, rec, seq, name, "all_gather", d, x, skip_dim=d,
                            sizes=sizes)
        heads = None if torch.equal(g.heads, g.expect) else _envelope.heads_of(g.heads)
        if heads is None and sizes is not None and set(sizes) != {x.shape[d]}:
            heads = _envelope.heads_of(g.heads)  # every rank holds the same: raises
            _envelope.check_all(heads, group, name, skip_dim=d, sizes=sizes)
        nb = x.numel() * x.element_size()
        if heads is None and nb <= _envelope.INLINE:  # even: every payload like this one
            return [g.vals[p].clone() for p in rec.pg_of]
        if heads is None:
            heads = _envelope.heads_of(g.heads)
        most = max(h[_envelope.NBYTES] for h in heads)
        if most <= _envelope.INLINE:
            return [_envelope.payload_of(g.rows[p], heads[p]).clone() for p in rec.pg_of]
        send = torch.zeros(most, dtype=torch.uint8, device=x.device)
        send[:nb].copy_(_bytes(x.detach().contiguous()))
        out = torch.empty(group.size * most, dtype=torch.uint8, device=x.device)
        self._call(_all_gather_single, name, group, rec, seq, out, send)
        rows = out.view(group.size, most)
        return [_envelope.as_tensor(rows[p, :heads[p][_envelope.NBYTES]], heads[p])
                for p in rec.pg_of]

    def _all_gather_p2p(self, x, group, rec, seq, d, sizes, name):
        """all_gather in envelopes (``_envelope.py``), point to point: every member reads
        every other's head (kind, call number, dim, dtype, shape) before any payload
        larger than an envelope is received, so a disagreement, sizes included, is the
        same CommError on every rank; no size exchange of its own."""
        me, n = group.index, group.size
        xc = x.detach().contiguous()
        head = _envelope.head_of("all_gather", seq, d, xc.shape, xc.dtype, name)
        others = [i for i in range(n) if i != me]
        f = self._start(group, rec, seq, name, [(i, head, xc) for i in others], others,
                        x.device)
        heads = f.heads()
        try:
            _envelope.check_all([heads[i] if i != me else head for i in range(n)], group,
                                name, skip_dim=d, sizes=sizes)
        except CommError:
            f.drain()
            raise
        got = f.finish()
        got[me] = xc.clone()
        return [got[i] for i in range(n)]

    def _all_to_all_p2p(self, chunks, group, rec, seq, shapes, wait, token, name):
        """all_to_all in envelopes: each member reads every other's head (kind, call
        number, dtype, and the shape its plan expects where ``shapes`` is given) before
        a payload larger than an envelope is received. Needs no shape exchange: the
        envelopes say what arrives."""
        me, n = group.index, group.size
        dtype, dev = chunks[me].dtype, chunks[me].device
        send = [c.detach().contiguous() for c in chunks]
        heads = [_envelope.head_of("all_to_all", seq, 0, c.shape, c.dtype, name) for c in send]
        others = [i for i in range(n) if i != me]
        f = self._start(group, rec, seq, name, [(i, heads[i], send[i]) for i in others], others,
                        dev)

        def finish() -> list[torch.Tensor]:
            got, row = f.heads(), _envelope.ROW
            for i in others:
                h = got[i]
                try:
                    _envelope.check_from(h, heads[me], group.ranks[i], group, name, shape=False)
                    if shapes is not None and h[row:] != _row_of(tuple(shapes[i]), dtype, name):
                        raise _plans_disagree(name, group, group.rank,
                                              _row_of(tuple(shapes[i]), dtype, name),
                                              group.ranks[i], h[row:], "a halo width",
                                              verb="sent")
                except CommError:
                    f.drain()
                    raise
            res = f.finish()
            res[me] = _copy(send[me])
            return [res[i] for i in range(n)]
        return finish() if wait else Pending(finish, token)

    def _permute_p2p(self, xc, group, rec, seq, pairs, srcs, dsts, name):
        """permute in envelopes: a receiver reads the sender's head (kind, call number,
        pairs, dtype, shape) before its payload; a disagreement is a CommError on every
        rank that receives."""
        me = group.index
        head = _envelope.head_of("permute", seq, zlib.crc32(repr(tuple(pairs)).encode()),
                                 xc.shape, xc.dtype, name)
        src = srcs[0] if srcs and srcs[0] != me else None
        f = self._start(group, rec, seq, name, [(d, head, xc) for d in dsts],
                        [] if src is None else [src], xc.device)
        if src is not None:
            try:
                _envelope.check_from(f.heads()[src], head, group.ranks[src], group, name)
            except CommError:
                f.drain()
                raise
        got = f.finish()
        if not srcs:
            return None
        return xc.clone() if src is None else got[src]
