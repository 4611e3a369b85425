"""The header a reduction carries on the torch backend: op, dtype and shape, checked
without an extra round trip.

Gloo reduces whatever bytes it is given: a rank calling ``psum`` where another calls
``pmax``, or passing ``int32`` where another passes ``float32``, or ``(2, 3)`` where
another passes ``(3, 2)``, gets garbage back and no error. ``SPMD_VALIDATE=1`` compares
everything first, at the cost of one more collective per call. This header is the
always-on part: a few elements put in front of the payload, reduced with it, and read
back on every rank.

What travels. Min is sent as max of the order-reversed values (``-x`` for floats,
``~x`` for integers and bools), so the wire carries only two ops, sum and max, over
header values that are all >= 0. Both ops only grow such values: a mark any rank puts
in a slot stays nonzero in every rank's result, whichever rank applied which op. The
slots:

- ``OP`` (3 slots): the rank's op, one-hot (sum, max, min).
- ``FLAG``: 1 where a float max/min rank holds a NaN (``TorchComm.all_reduce``: NaN
  travels as max's identity, so the flag is what makes it win, as in ``torch.amax``).
- ``SIG`` (2 slots per bit of a 24-bit signature): for each bit, the rank marks the
  slot of its bit's value. The signature is the dtype's code (6 bits, exact) and 18
  bits of a hash of the shape (reduce_scatter: of every chunk's shape).

Each rank knows the header it would read back had every rank called it as it did:
with sum, ``n * mark`` in its marked slots; with max, ``mark``; zero elsewhere. Any
rank that differs in op or signature marks a slot this rank left at zero, or leaves
unmarked one this rank marked (sum then falls short of ``n * mark``), so every rank
sees a difference and raises. For ranks of one dtype that holds exactly; ranks of
different dtypes read each other's marks reinterpreted, and the marks are chosen so
that such readings are nonzero and normal (an integer's max mark is ``2**(bits-2)``,
which reads as 2.0 in the float of its size, not as a denormal that flush-to-zero
would erase). Shapes that differ only in a hash collision (one in 2**18) pass.

What it cannot catch: ranks passing different element counts. Gloo aborts the process
(SIGABRT, "Received data size doesn't match expected size") before any result exists,
and only an exchange before the call could prevent that: ``SPMD_VALIDATE=1``. Nor the
call's number on its group: ranks reach gloo's ring reductions in gloo's own order.

It is used for CPU tensors without ``SPMD_VALIDATE`` (which checks all of it already):
reading the header back on an accelerator would synchronise the host with the device
on every call. ``SPMD_VALIDATE=0`` turns it off too. Reductions of at most 512 bytes
do not use it: they travel in envelopes (``_envelope.py``), point to point, and are
reduced locally, which checks everything, element counts included, and is cheaper than
a ring all-reduce of a header and a few elements. For larger ones the header costs
~16 us of local work; from 64 KiB on, it is within noise
(``benchmarks/collective_overhead.py``). Ranks whose payloads straddle 512 bytes
differ in element count and never meet (an envelope against a ring reduction): both
time out, each naming the call the other waits in.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict

import torch

from ..core._format import shape_str

__all__ = ["Header", "header_for", "SIZE"]

_BITS = 24
_DTYPE_BITS = 6
OP, FLAG, SIG = 0, 3, 4
SIZE = SIG + 2 * _BITS
_OPS = ("sum", "max", "min")
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 512


class Header:
    """The header of one kind of call: what to send and what to read back."""

    __slots__ = ("send", "expect", "op", "what")

    def __init__(self, send: torch.Tensor, expect: torch.Tensor, op: str, what: str):
        self.send, self.expect, self.op, self.what = send, expect, op, what

    def ok(self, got: torch.Tensor) -> bool:
        """Whether the reduced header ``got`` is what this call expects (the NaN flag
        slot is the reduction's business, not compared)."""
        e = self.expect
        return torch.equal(got[:FLAG], e[:FLAG]) and torch.equal(got[SIG:], e[SIG:])


def header_for(op: str, dtype: torch.dtype, wire: torch.dtype, shapes, n: int,
               dcode: int) -> Header | None:
    """The header for an ``op`` reduction of ``shapes`` (one shape, or reduce_scatter's
    chunks) of ``dtype`` over ``n`` ranks, sent as ``wire`` (``dtype`` as the process
    group reduces it). None where the wire dtype cannot count to ``n`` exactly."""
    key = (op, dtype, wire, shapes, n)
    h = _CACHE.get(key)
    if h is not None:
        _CACHE.move_to_end(key)
        return h
    h = _build(op, dtype, wire, shapes, n, dcode)
    _CACHE[key] = h
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return h


def wire_op(op: str, dtype: torch.dtype) -> str:
    """The op on the wire: bool sums are logical or (max); min is max of reversed values."""
    if dtype == torch.bool and op == "sum":
        return "max"
    return "sum" if op == "sum" else "max"


def reverse_(t: torch.Tensor) -> torch.Tensor:
    """Reverse the order of ``t``'s values in place (its own inverse): min = rev(max(rev))."""
    if t.is_floating_point():
        return t.neg_()
    return t.bitwise_not_()


def _build(op, dtype, wire, shapes, n, dcode) -> Header | None:
    summed = wire_op(op, dtype) == "sum"
    if wire.is_floating_point:
        mark = 1.0
        top = int(2 / torch.finfo(wire).eps)  # counts above this are rounded
    else:
        bits = torch.iinfo(wire).bits
        mark = 1 if summed else 2 ** (bits - 2)
        top = torch.iinfo(wire).max
    if summed and n * mark > top:
        return None
    want = n * mark if summed else mark
    sig = (dcode & ((1 << _DTYPE_BITS) - 1)) | (
        (zlib.crc32(repr(shapes).encode()) & ((1 << (_BITS - _DTYPE_BITS)) - 1)) << _DTYPE_BITS)
    send = [0] * SIZE
    expect = [0] * SIZE
    k = OP + _OPS.index(op) if dtype != torch.bool or op != "sum" else OP + 1
    send[k], expect[k] = mark, want
    for b in range(_BITS):
        s = SIG + 2 * b + ((sig >> b) & 1)
        send[s], expect[s] = mark, want
    if all(isinstance(s, int) for s in shapes):
        what = f"{op!r} of {shape_str(shapes, dtype)}"
    else:
        what = f"{op!r} of chunks {', '.join(shape_str(s, dtype) for s in shapes)}"
    return Header(torch.tensor(send, dtype=wire), torch.tensor(expect, dtype=wire), op, what)

