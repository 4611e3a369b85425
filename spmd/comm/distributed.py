"""The torch.distributed backend: every rank is a process (gloo on CPU, NCCL on CUDA).

Same semantics as ``spmd/comm/threads.py``, on process groups:

- One process group per group of ranks, built on ``init_device_mesh`` for single axes
  (``dist.new_group`` for tuples of axes, all groups of the partition created at first
  use, in one order on every rank). A group on another channel (``Group.channel``) gets
  process groups of its own, created by ``open`` at the same point on every rank. A
  ``Group`` lists its members in the order of the axes' linearised index (first axis
  major); a process group orders them by global rank.
  Each group keeps both maps (``pg_of``: member index -> process-group rank, ``idx_of``:
  the inverse), and every result list is put back in ``Group`` order.
- Uneven sizes: data moves as bytes. Metadata (shapes, dtypes, byte counts) travels as
  int64 tensors, never pickled objects.
- Every wait is bounded by ``mesh.timeout``; a timeout becomes ``CommTimeout`` naming the
  op, the axes, the rank and, where the job's store can tell (the ranks that did arrive
  mark it there on timing out), the ranks that did not arrive, and the call each rank
  that is waiting elsewhere on the group waits in. After a timeout the process group is
  unusable (the transfer is still pending): tear it down.

What the ranks must agree on is checked with default settings, in the messages that
carry the data (no extra round trip but before a ring reduction), for CPU tensors:

- every collective but broadcast and scatter: an envelope (``_envelope.py``) heads
  every transfer: the collective, the call's number on its group, its argument
  (reduction op, dim, pairs), dtype, shape and byte count. Small ones (at most 512
  bytes: reductions, barriers, all_gathers) are one all_gather of envelopes, the payload
  inline (all_gather without ``sizes``: a second all_gather of the payloads where one did
  not fit, sized from the checked envelopes); larger reductions and reduce_scatter
  exchange their envelopes the same way and start gloo's ring reduction only once they
  agree (one more small collective: gloo aborts the process on a ring reduction whose
  sizes differ); larger all_gathers, all_to_alls and permutes go point to point,
  envelope first, a halo in one message each way (``_envelope.py``, ``_p2p.py``). Ranks
  that disagree about anything, element counts included, raise a ``CommError`` naming
  the op, the ranks and what differs, instead of reading garbage or gloo aborting the
  process (no message is larger than the receive it meets, ``_p2p.py``). Every
  rank raises (a permute: every rank that receives). Small reductions are reduced locally from every member's
  envelope, in process-group order: bitwise equal on every rank.
- ``scatter`` is point to point, source to each other member, in pieces of at most 4 MiB
  that both sides derive from the shape: the source reads its chunks in place (strided
  ones staged piece by piece) and sends nothing to itself; receivers receive straight
  into their result. Without validation, on CPU, each receiver first gets the metadata
  row of what it is sent: plans that differ raise there instead of aborting the process.
- The caller's tensors are never modified; results are new tensors (results of one
  ``all_gather``/``all_to_all`` may share one receive buffer). The one exception is
  ``all_reduce_async``, which reduces a flat buffer in place (GradSync's buckets).

Left to ``SPMD_VALIDATE=1`` (or ``comm.validate = True``), which compares op, arguments,
dtypes and shapes across the group before every collective, at the cost of one more
small collective (a round trip): ``all_reduce_async`` (GradSync's buckets, reduced in
place, carry no envelope; GradSync compares the plan their sizes follow from when it is
built, ``spmd/parallel/agreement.py``), broadcast, a permute's disagreement on a rank that
only sends, and accelerator tensors (reading a fingerprint back there would synchronise
the host with the device on every call). Calls that use different transports (an
all_gather of envelopes, point-to-point envelopes) never meet: they
time out, each naming the call the other waits in. ``SPMD_VALIDATE=0`` turns every
check off (the bare collectives).

This module holds the collectives; ``_groups.py`` the process groups and bounded waits,
``_meta.py`` the metadata rows and their errors, ``_envelope.py`` the fingerprint,
``_checked.py`` the collectives' paths in envelopes and ``_p2p.py`` their
point-to-point transfers, ``_scatter.py`` scatter in pieces, ``_validate.py`` the ``SPMD_VALIDATE`` round trips and ``_work.py``
the async handle.
"""
from __future__ import annotations

import datetime
import math
import os
import threading
import time
import zlib

import torch
import torch.distributed as dist

from ..core._format import shape_str
from ..core.errors import CommError, SpecError
from ..core.mesh import Group, Mesh
from . import _envelope
from ._checked import _Checked
from ._groups import _PG, _ProcessGroups, _Progress
from ._meta import (_MAXDIM, _ROP_CODE, _ROPS, _ROW,
                    _all_gather_single, _axes, _bytes, _check_rows, _copy, _dtype,
                    _norm_dim, _numel,
                    _reduce_scatter_single, _reducible, _row, _row_of, _rop, _unreducible,
                    reverse_, wire_op)
from ._p2p import _Exchange
from ._scatter import _Scatter
from ._validate import _Validation
from ._work import _TorchWork
from .base import Pending
from .stats import count

__all__ = ["TorchComm"]



class TorchComm(_ProcessGroups, _Validation, _Exchange, _Checked, _Scatter):
    """The comm protocol (``spmd/comm/base.py``) on torch.distributed.

    Created by ``Mesh.comm`` for ``backend="torch"``; needs an initialised process group
    covering the mesh. Per-call cost over raw torch.distributed: one copy of the input
    (never modified in place), a dict lookup and the fingerprint's envelope (see the
    module docstring); one more small collective before a ring reduction (all_reduce
    above 512 bytes, reduce_scatter), and before every collective under validation.
    """

    def __init__(self, mesh: Mesh):
        if not (dist.is_available() and dist.is_initialized()):
            raise SpecError("TorchComm needs an initialised torch.distributed process group")
        self.mesh = mesh
        self.validate: bool = os.environ.get("SPMD_VALIDATE", "") == "1"
        self.checks: bool = os.environ.get("SPMD_VALIDATE", "") != "0"
        self._td = datetime.timedelta(seconds=mesh.timeout)
        self._recs: dict[Group, _PG] = {}
        self._pgs: dict[tuple, dict[tuple[int, ...], object]] = {}
        self._dm = None
        self._zero: torch.Tensor | None = None
        self._progress = _Progress.get()
        self._local = threading.local()  # per-thread scratch buffers (``_rows``)


    # -- the protocol -------------------------------------------------------------------

    def all_reduce(self, x, op, group, *, name):
        count("all_reduce", name, group, x=x)
        _rop(op, x.dtype, name)
        if group.size == 1:
            return _copy(x)
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "all_reduce", _ROP_CODE[op], [x], name)
        checked = self._checked(x.device) and x.ndim <= _MAXDIM
        if checked and x.numel() * x.element_size() <= _envelope.INLINE:
            return self._gathered(x, op, group, rec, seq, name)
        wop = wire_op(op, x.dtype)
        extreme = wop == "max" and x.is_floating_point()
        made: list = []  # (buf, body, vals, nan), made by fill

        def fill() -> None:
            # One buffer: [NaN flag (float max/min) | the payload as the wire reduces it]
            lead = int(extreme)
            per = 2 if x.dtype.is_complex else 1
            buf = torch.empty(lead + per * x.numel(), dtype=_wire_dtype(x.dtype),
                              device=x.device)
            body = buf[lead:]
            vals = _unreducible(body, x.dtype).view(x.shape)
            vals.copy_(x.detach())
            nan = None
            if op == "min":
                reverse_(body)
            if extreme:
                # NaN wins, as in torch.amax (gloo's and NCCL's max drop it): it travels
                # as max's identity and the flag says some rank holds one; only then does
                # a second all-reduce mark where.
                nan = torch.isnan(body)
                has = bool(nan.any())
                if has:
                    body.masked_fill_(nan, -math.inf)
                buf[0] = int(has)
            made.extend((buf, body, vals, nan))

        if checked:
            # Agreed first (kind, call number, op, dtype, shape: element counts included),
            # in one all_gather of envelopes, started before anything else: the buffer is
            # made and filled while it is in flight (gloo aborts the process on a ring
            # reduction whose sizes differ).
            self._envelopes(group, rec, seq, name, "all_reduce", _ROP_CODE[op], None,
                            meta=(x.shape, x.dtype, x.device), meanwhile=fill)
        else:
            fill()
        buf, body, vals, nan = made
        self._call(dist.all_reduce, name, group, rec, seq, buf, op=_ROPS[wop])
        if extreme and buf[0].item() != 0:  # the same on every rank: all take this branch
            where = nan.to(torch.uint8)
            seq = self._enter(rec)
            self._call(dist.all_reduce, name, group, rec, seq, where, op=_ROPS["max"])
            body.masked_fill_(where.bool(), math.nan)
        if op == "min":
            reverse_(body)
        return vals

    def _checked(self, device: torch.device) -> bool:
        """Whether the always-on checks apply: CPU only (reading a result back on an
        accelerator would synchronise the host on every call), not where SPMD_VALIDATE=1
        checked it all already, and not under SPMD_VALIDATE=0."""
        return not self.validate and self.checks and device.type == "cpu"

    def all_reduce_async(self, x, op, group, *, name):
        # In place on the caller's buffer (no copy: this is the bucket path); the wait,
        # not the start, is bounded by the timeout and reports failures.
        count("all_reduce_async", name, group, x=x)
        rop = _rop(op, x.dtype, name)
        if not x.is_contiguous():
            raise SpecError(f"{name}: all_reduce_async reduces in place and needs a "
                            f"contiguous tensor, got {shape_str(x.shape, x.dtype)} with "
                            f"strides {x.stride()}")
        if group.size == 1:
            return _TorchWork(self, None, x, name, group, None, 0)
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "all_reduce", _ROP_CODE[op], [x], name)
        try:
            work = dist.all_reduce(_reducible(x.detach()), op=rop, group=rec.pg, async_op=True)
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq) from e
        return _TorchWork(self, work, x, name, group, rec, seq)

    def all_gather(self, x, group, dim, *, name, sizes=None):
        count("all_gather", name, group, x=x)
        n = group.size
        d = _norm_dim(x, dim, name)
        if sizes is not None:
            sizes = tuple(int(s) for s in sizes)
            if len(sizes) != n:
                raise SpecError(f"{name}: sizes {list(sizes)} has {len(sizes)} entries for a "
                                f"group of {n} ranks over {_axes(group)}")
        if n == 1:
            if sizes is not None and sizes != (x.shape[d],):
                raise CommError(f"{name}: expected sizes {list(sizes)} along dim {dim}, got "
                                f"{[x.shape[d]]}")
            return [_copy(x)]
        rec = self._rec(group)
        seq = self._enter(rec)
        if self._checked(x.device) and x.ndim <= _MAXDIM:
            if sizes is None:
                return self._all_gather_gathered(x, group, rec, seq, d, None, name)
            # The transport is chosen from what the ranks agree on (sizes, the other dims,
            # dtype), never from this rank's own size alone: every rank takes the same.
            most = max(sizes) * _numel(x.shape[:d] + x.shape[d + 1:]) * x.element_size()
            if most <= _envelope.INLINE:
                return self._all_gather_gathered(x, group, rec, seq, d, sizes, name)
            return self._all_gather_p2p(x, group, rec, seq, d, sizes, name)
        if self.validate or sizes is None:
            if self.validate:
                rows = self._validate(rec, group, seq, "all_gather", d, [x], name, skip_dim=d)
            else:  # the sizes are needed anyway: check dtype and the other dims with them
                rows = self._gather_rows(rec, group, seq, [x], name)
                _check_rows([r[0] for r in rows], group, name, skip_dim=d)
            got = tuple(r[0][3 + d] for r in rows)
            if sizes is not None and got != sizes:
                raise CommError(f"{name}: expected sizes {list(sizes)} along dim {dim}, got "
                                f"{list(got)}")
            sizes = got
        elif x.shape[d] != sizes[group.index]:
            raise CommError(f"{name}: expected sizes {list(sizes)} along dim {dim}, but rank "
                            f"{group.rank} (member {group.index} of {_axes(group)}) has "
                            f"{x.shape[d]}")
        shapes = [x.shape[:d] + (s,) + x.shape[d + 1:] for s in sizes]
        isz = x.element_size()
        nbytes = [_numel(s) * isz for s in shapes]
        m = max(nbytes)
        if m == 0:
            return [x.new_empty(s) for s in shapes]
        xc = x.detach().contiguous()
        if nbytes[group.index] == m:
            send = _bytes(xc)  # the input itself: all_gather only reads it
        else:
            send = torch.zeros(m, dtype=torch.uint8, device=x.device)
            send[:nbytes[group.index]].copy_(_bytes(xc))
        out = torch.empty(n * m, dtype=torch.uint8, device=x.device)
        self._call(_all_gather_single, name, group, rec, seq, out, send)
        res = []
        for i, s in enumerate(shapes):
            off = rec.pg_of[i] * m
            res.append(out[off:off + nbytes[i]].view(x.dtype).view(s))
        return res

    def reduce_scatter(self, chunks, op, group, *, name):
        count("reduce_scatter", name, group, chunks=chunks)
        n = group.size
        if len(chunks) != n:
            raise CommError(f"{name}: rank {group.rank} passed {len(chunks)} chunks for a "
                            f"group of {n}")
        mine = chunks[group.index]
        _rop(op, mine.dtype, name)
        if any(c.dtype != mine.dtype for c in chunks):
            raise SpecError(f"{name}: the chunks must share one dtype, got "
                            f"{[shape_str(c.shape, c.dtype) for c in chunks]}")
        if n == 1:
            return _copy(mine)
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "reduce_scatter", _ROP_CODE[op], chunks, name,
                           count=len(chunks))
        if self._checked(mine.device) and all(c.ndim <= _MAXDIM for c in chunks):
            # Agreed first, in one all_gather of envelopes (gloo aborts the process on a
            # reduce_scatter whose sizes differ): op and the chunks' shapes (a hash), and
            # as the envelope's tensor their total element count and dtype.
            shapes = tuple(tuple(c.shape) for c in chunks)
            extra = _ROP_CODE[op] | (zlib.crc32(repr(shapes).encode()) & 0xFFFFFF) << 8
            self._envelopes(group, rec, seq, name, "reduce_scatter", extra, None,
                            meta=((sum(c.numel() for c in chunks),), mine.dtype, mine.device))
        flat = [_reducible(chunks[i].detach().contiguous()).view(-1) for i in rec.idx_of]
        lens = [f.numel() for f in flat]
        m = max(lens)
        k = flat[rec.pg_of[group.index]].numel()
        if m == 0:
            return mine.new_empty(mine.shape)
        if all(v == m for v in lens):
            inp = torch.cat(flat)
        else:
            inp = flat[0].new_zeros(n, m)
            for p, f in enumerate(flat):
                inp[p, :f.numel()].copy_(f)
            inp = inp.view(-1)
        if op == "min":
            reverse_(inp)
        out = inp.new_empty(m)
        self._call(_reduce_scatter_single, name, group, rec, seq, out, inp,
                   op=_ROPS[wire_op(op, mine.dtype)])
        res = out[:k]
        if op == "min":
            reverse_(res)
        return _unreducible(res, mine.dtype).view(mine.shape)

    def all_to_all(self, chunks, group, *, name, shapes=None):
        return self._all_to_all(chunks, group, name, shapes, wait=True)

    def all_to_all_async(self, chunks, group, *, name, shapes=None):
        # Only the data transfer is in flight. Checked (CPU): envelopes, no metadata
        # exchange; chunks larger than an envelope are sent from the caller's tensors
        # (contiguous ones in place), which must not change until the wait (base.py).
        # Otherwise a metadata exchange (no shapes, or validation) is made first,
        # blocking, and the chunks are copied before the start.
        return self._all_to_all(chunks, group, name, shapes, wait=False)

    def _all_to_all(self, chunks, group, name, shapes, wait):
        token = count("all_to_all", name, group, chunks=chunks)
        n = group.size
        if len(chunks) != n:
            raise CommError(f"{name}: rank {group.rank} passed {len(chunks)} chunks for a "
                            f"group of {n}")
        if n == 1:
            out = [_copy(chunks[0])]
            return out if wait else Pending.done(out, token)
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "all_to_all", 0, [], name, count=len(chunks))
        dev = chunks[group.index].device
        if self._checked(dev) and all(c.ndim <= _MAXDIM for c in chunks):
            return self._all_to_all_p2p(chunks, group, rec, seq, shapes, wait, token, name)
        send = [chunks[i].detach().contiguous() for i in rec.idx_of]  # process-group order
        if shapes is not None and not self.validate:
            # The caller's plan knows what arrives: no metadata exchange.
            dtype = chunks[group.index].dtype
            rows = [_row_of(tuple(shapes[i]), dtype, name) for i in rec.idx_of]
        else:
            meta = torch.tensor([v for t in send for v in _row(t, name)], dtype=torch.int64,
                                device=dev)
            rmeta = torch.empty_like(meta)
            self._call(dist.all_to_all_single, name, group, rec, seq, rmeta, meta)
            rows = rmeta.view(n, _ROW).tolist()
            if shapes is not None:  # validating: what arrives must be what the plan says
                self._check_plan(rec, group, seq, rows, shapes, chunks[group.index].dtype,
                                 name)
        in_bytes = [t.numel() * t.element_size() for t in send]
        out_bytes = [r[2] * _dtype(r[0], name).itemsize for r in rows]
        sbuf = torch.cat([_bytes(t) for t in send])
        rbuf = torch.empty(sum(out_bytes), dtype=torch.uint8, device=dev)
        try:
            work = dist.all_to_all_single(rbuf, sbuf, output_split_sizes=out_bytes,
                                          input_split_sizes=in_bytes, group=rec.pg,
                                          async_op=True)
        except RuntimeError as e:
            raise self._failure(e, name, group, rec, seq) from e

        def finish() -> list[torch.Tensor]:
            self._wait(work, name, group, rec, seq)
            offs = [0]
            for b in out_bytes:
                offs.append(offs[-1] + b)
            res = []
            for i in range(n):
                p = rec.pg_of[i]
                r = rows[p]
                dt = _dtype(r[0], name)
                seg = rbuf[offs[p]:offs[p + 1]]
                if offs[p] % dt.itemsize:
                    seg = seg.clone()
                res.append(seg.view(dt).view(r[3:3 + r[1]]))
            return res
        return finish() if wait else Pending(finish, token)

    def permute(self, x, group, pairs, *, name):
        count("permute", name, group, x=x, pairs=pairs)
        me = group.index
        srcs = [s for s, d in pairs if d == me]
        if group.size == 1:
            return _copy(x) if srcs else None
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "permute", zlib.crc32(repr(tuple(pairs)).encode()),
                           [x], name)
        xc = x.detach().contiguous()
        dsts = [d for s, d in pairs if s == me and d != me]
        if self._checked(x.device) and x.ndim <= _MAXDIM:
            return self._permute_p2p(xc, group, rec, seq, pairs, srcs, dsts, name)
        ops, recv = [], {}
        pg = rec.pg
        for d in dsts:
            if xc.numel():
                ops.append(dist.P2POp(dist.isend, _bytes(xc), group.ranks[d], pg))
        for s in srcs:
            if s != me and s not in recv:
                recv[s] = buf = torch.empty(xc.shape, dtype=xc.dtype, device=xc.device)
                if buf.numel():
                    ops.append(dist.P2POp(dist.irecv, _bytes(buf), group.ranks[s], pg))
        if ops:
            peers = sorted({group.ranks[i] for i in dsts + [s for s in srcs if s != me]})
            try:
                works = dist.batch_isend_irecv(ops)
            except RuntimeError as e:
                raise self._failure(e, name, group, rec, seq, peers) from e
            deadline = time.monotonic() + self.mesh.timeout
            for w in works:
                self._wait(w, name, group, rec, seq, peers, deadline)
        if not srcs:
            return None
        return _copy(x) if srcs[0] == me else recv[srcs[0]]

    def broadcast(self, x, src, group, *, name):
        count("broadcast", name, group, x=x, src=src)
        if not 0 <= src < group.size:
            raise SpecError(f"{name}: src {src} is not a member index of {_axes(group)} "
                            f"(0..{group.size - 1})")
        if group.size == 1:
            return _copy(x)
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "broadcast", src, [x], name)
        if group.index == src:
            y = _copy(x)
        else:
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if y.numel():
            self._call(dist.broadcast, name, group, rec, seq, _bytes(y), src=group.ranks[src])
        return y

    def barrier(self, group, *, name="barrier"):
        count("barrier", name, group)
        if group.size == 1:
            return
        rec = self._rec(group)
        seq = self._enter(rec)
        if self.validate:
            self._validate(rec, group, seq, "barrier", 0, [], name)
        if self._checked(self.mesh.device):
            self._envelopes(group, rec, seq, name, "barrier", 0, None)
            return
        if self._zero is None:
            self._zero = torch.zeros(1, device=self.mesh.device)
        self._call(dist.all_reduce, name, group, rec, seq, self._zero)  # stays zero


_WIRE: dict[torch.dtype, torch.dtype] = {}


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a process group reduces ``dtype`` as (``_reducible``), found once."""
    w = _WIRE.get(dtype)
    if w is None:
        w = _WIRE[dtype] = _reducible(torch.empty(0, dtype=dtype, device="meta")).dtype
    return w
