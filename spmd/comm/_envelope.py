"""The fingerprint a checked collective carries in its first message: what every rank
must agree on, travelling with the data, so that a disagreement is a ``CommError``
instead of garbage or gloo aborting the process.

An envelope is ``SIZE`` bytes: a head of ``SLOTS`` int64 and up to ``INLINE`` bytes of
payload. The head holds ``MAGIC``, the collective (``KIND``), the call's number on its
group (``SEQ``: its place in the program), the op's own argument (``EXTRA``: the
reduction op, the gather dim, the permutation's hash), the payload's byte count
(``NBYTES``) and its metadata row (dtype code, ndim, numel, shape).

Every first message of a checked collective is one envelope, of the same size for every
kind of call, so that ranks that disagree about anything still exchange messages of equal
size, and read each other's heads:

- all_reduce of at most ``INLINE`` bytes, barrier, all_gather of at most ``INLINE``
  bytes: one all_gather of envelopes (the payload inline); a reduction is reduced
  locally in process-group order (bitwise equal on every rank). Larger reductions and
  reduce_scatter: the same all_gather of envelopes (no payload), then gloo's ring
  reduction, started only where they agree (reduce_scatter's envelope announces the
  chunks' total element count; ``EXTRA`` holds the op and a hash of the chunk shapes).
- all_gather of more, all_to_all, permute: point to point, tagged with the call number
  (calls in flight together never match each other's messages). A sender sends each
  receiver one first message: its envelope (the payload inline where it fits), then
  the payload's first bytes (up to ``_p2p.FIRST``, 256 KiB), and the rest of a larger
  payload right after it. Each receiver posts one receive per member that holds any
  first message, before the messages arrive, and receives a rest at the size its
  envelope announced (``_p2p.py``): nothing can abort the process, and a halo or a
  small gather is one message each way. A payload of another size than the caller's
  plan (all_gather with ``sizes``, permute, all_to_all with ``shapes``) arrives whole,
  and its envelope says so. all_gather and all_to_all ranks receive from every
  other member, so every rank reads every head: every rank raises. A permute's error
  is raised by the ranks that receive (those that would have received garbage); a rank
  that only sends does not hear of it.

Calls of different transports (an all_gather of envelopes against a point-to-point one)
never meet: they time out, and the
timeout names the call each other rank waits in (``_groups.py``). A rank that stops in
the middle of a program on purpose (``spmd.nn.convert``'s run left its plan) sends each
group's next call both ways, as an envelope of kind ``left`` (``EXTRA``: the rank that
left and its step, ``leave_envelope``): the others raise ``CommAborted`` naming that
rank, whichever transport they wait in.

No extra round trip but for the ring reductions: the head travels in the message that
would carry the data anyway (the payload of a large transfer follows its envelope without
waiting for an answer); a ring reduction's envelopes are one small all_gather before it
(the copy of the payload is made while it is in flight).
"""
from __future__ import annotations

import torch

from ..core._format import shape_str
from ..core.errors import CommAborted, CommError
from ..core.mesh import Group
from ._meta import _DTYPES, _OPCODES, _OPNAMES, _ROW, _axes, _extra, _row_of

__all__ = ["SIZE", "INLINE", "HEAD", "head_of", "pack", "heads_of", "check_all", "check_from",
           "tag_of", "leave_envelope", "LEFT"]

MAGIC_VALUE = 0x53504D44  # "SPMD"
MAGIC, KIND, SEQ, EXTRA, NBYTES, ROW = range(6)
SLOTS = ROW + _ROW
HEAD = 8 * SLOTS
INLINE = 512
SIZE = HEAD + INLINE  # both multiples of 16: an inline payload is aligned for every dtype


def head_of(kind: str, seq: int, extra: int, shape, dtype: torch.dtype, name: str
            ) -> list[int]:
    """The head of a ``kind`` call number ``seq`` sending a tensor of ``shape``/``dtype``."""
    row = _row_of(tuple(shape), dtype, name)
    return [MAGIC_VALUE, _OPCODES[kind], seq, int(extra), row[2] * dtype.itemsize, *row]


def tag_of(seq: int) -> int:
    """The point-to-point tag of call ``seq``: calls in flight together never match each
    other's messages (0 is left to scatter's pieces)."""
    return 1 + seq % (TAGS - 1)


TAGS = 1 << 29  # point-to-point tags in use: 1 .. TAGS - 1


def pack(head: list[int], payload: torch.Tensor | None, device, room: int = 0) -> torch.Tensor:
    """An envelope: ``head``, then ``payload``'s bytes (contiguous) where they fit;
    ``room`` more bytes after it, left to the caller (uninitialised)."""
    env = torch.empty(SIZE + room, dtype=torch.uint8, device=device)
    env[:SIZE].zero_()
    env[:HEAD].view(torch.int64).copy_(torch.tensor(head, dtype=torch.int64))
    nb = head[NBYTES]
    if payload is not None and 0 < nb <= INLINE:
        env[HEAD:HEAD + nb].copy_(payload.reshape(-1).view(torch.uint8))
    return env


def heads_of(envs: torch.Tensor) -> list[list[int]]:
    """The heads of a (k, SIZE) uint8 tensor of envelopes, as lists."""
    return envs[:, :HEAD].contiguous().view(torch.int64).tolist()


def as_tensor(raw: torch.Tensor, head: list[int]) -> torch.Tensor:
    """Received bytes ``raw`` as the dtype and shape ``head`` announced (a view)."""
    code = head[ROW]
    if not 0 <= code < len(_DTYPES):
        raise CommError("received a tensor of a dtype this process does not know")
    dt, shape = _DTYPES[code], head[ROW + 3:ROW + 3 + head[ROW + 1]]
    return (raw if dt == torch.uint8 else raw.view(dt)).view(shape)


def payload_of(env: torch.Tensor, head: list[int]) -> torch.Tensor:
    """The inline payload of a received envelope, as its dtype and shape (a view)."""
    return as_tensor(env[HEAD:HEAD + head[NBYTES]], head)


def describe(h: list[int]) -> str:
    """``f32[2, 3]`` for a head."""
    code = h[ROW]
    dt = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
    return shape_str(h[ROW + 3:ROW + 3 + h[ROW + 1]], dt)


def _kind(h: list[int]) -> str:
    return _OPNAMES.get(h[KIND], f"an unknown collective ({h[KIND]})")


def _foreign(name: str, group: Group, rank: int) -> CommError:
    return CommError(f"{name} over {_axes(group)}: rank {rank} sent a message that is not a "
                     f"spmd collective (another library's collective on the same process "
                     f"group?)", op=name, axes=group.axes)


def _order(name: str, group: Group, ra: int, ha: list[int], rb: int, hb: list[int]
           ) -> CommError | None:
    """The first thing two heads disagree on besides dtype and shape (kind, call number,
    argument), as the error both ranks raise alike (ranks named in order)."""
    if ra > rb:
        ra, ha, rb, hb = rb, hb, ra, ha
    where = f"{name} over {_axes(group)}"
    if ha[KIND] != hb[KIND]:
        return CommError(
            f"{where}: collective mismatch: rank {ra} called {_kind(ha)} while rank {rb} "
            f"called {_kind(hb)} (call #{min(ha[SEQ], hb[SEQ])} on this group); every rank "
            f"must run the same collectives in the same order", op=name, axes=group.axes)
    if ha[SEQ] != hb[SEQ]:
        return CommError(
            f"{where}: rank {ra} is at call #{ha[SEQ]} on this group but rank {rb} at call "
            f"#{hb[SEQ]}: they ran different numbers of collectives on it before this "
            f"{_kind(ha)}; every rank must run the same collectives in the same order",
            op=name, axes=group.axes)
    low = _OPCODES["reduce_scatter"] == ha[KIND]  # the chunk shapes' hash: compared last
    if (ha[EXTRA] & 0xFF if low else ha[EXTRA]) != (hb[EXTRA] & 0xFF if low else hb[EXTRA]):
        label, a, b = _extra(_kind(ha), ha[EXTRA], hb[EXTRA])
        return CommError(f"{where}: rank {ra} passed {label} {a} but rank {rb} passed {label} "
                         f"{b}; every rank must pass the same {label}", op=name, axes=group.axes)
    return None


LEFT = _OPCODES["left"]


def leave_envelope(seq: int, rank: int, step: int, device) -> torch.Tensor:
    """The envelope a rank that stops sends as call ``seq``: ``rank`` left a plan at
    ``step``."""
    return pack(head_of("left", seq, (rank << 32) | (step & 0xFFFFFFFF), (0,), torch.uint8,
                        "leave"), None, device)


def _left(name: str, group: Group, src: int, h: list[int]) -> CommAborted:
    """The error of a rank that received ``left`` from ``src``."""
    origin, step = h[EXTRA] >> 32, h[EXTRA] & 0xFFFFFFFF
    via = "" if origin == src else f" (rank {src} passed it on)"
    e = CommAborted(f"{name} over {_axes(group)}: rank {origin} left the converted model's "
                    f"plan at its communicating step #{step} and raised there (its SpecError "
                    f"names the line and the step the plan expected){via}; rank {group.rank} "
                    f"stops here instead of waiting for it", op=name, axes=group.axes,
                    missing=(origin,))
    e.plan_left = (origin, step)
    return e


def check_all(heads: list[list[int]], group: Group, name: str, *, skip_dim: int | None = None,
              sizes: tuple[int, ...] | None = None) -> None:
    """Every member's head (member order) against member 0's; the first difference is a
    ``CommError``, the same on every rank that read the same heads.

    ``skip_dim``: the dim whose size may differ (all_gather); ``sizes``: what it must be."""
    ranks = group.ranks
    for i, h in enumerate(heads):
        if h[MAGIC] != MAGIC_VALUE:
            raise _foreign(name, group, ranks[i])
        if h[KIND] == LEFT:
            raise _left(name, group, ranks[i], h)
    h0 = heads[0]
    for i, h in enumerate(heads[1:], 1):
        e = _order(name, group, ranks[0], h0, ranks[i], h)
        if e is not None:
            raise e
    for i, h in enumerate(heads[1:], 1):
        a, b = h0[ROW:ROW + 2] + h0[ROW + 3:], h[ROW:ROW + 2] + h[ROW + 3:]
        if skip_dim is not None and h0[ROW + 1] == h[ROW + 1]:
            a[2 + skip_dim] = b[2 + skip_dim] = -1
        if a != b:
            raise CommError(
                f"{name} over {_axes(group)}: rank {ranks[0]} passed {describe(h0)} but rank "
                f"{ranks[i]} passed {describe(h)}; every rank must pass the same dtype and "
                f"shape" + (f" (except along dim {skip_dim})" if skip_dim is not None else ""),
                op=name, axes=group.axes)
    for i, h in enumerate(heads[1:], 1):
        if h[EXTRA] != h0[EXTRA]:  # reduce_scatter's chunk shapes, the total alike
            label, a, b = _extra(_kind(h0), h0[EXTRA], h[EXTRA])
            raise CommError(f"{name} over {_axes(group)}: rank {ranks[0]} passed {label} {a} "
                            f"but rank {ranks[i]} passed {label} {b}; every rank must pass "
                            f"the same {label}", op=name, axes=group.axes)
    if sizes is not None:
        got = tuple(h[ROW + 3 + skip_dim] for h in heads)
        if got != sizes:
            raise CommError(f"{name} over {_axes(group)}: expected sizes {list(sizes)} along "
                            f"dim {skip_dim}, got {list(got)}", op=name, axes=group.axes)


def check_from(head: list[int], mine: list[int], src: int, group: Group, name: str, *,
               shape: bool = True) -> None:
    """A head received from rank ``src`` against this rank's own (``mine``): kind, call
    number, argument, dtype and (``shape``) shape must be equal."""
    if head[MAGIC] != MAGIC_VALUE:
        raise _foreign(name, group, src)
    if head[KIND] == LEFT:
        raise _left(name, group, src, head)
    e = _order(name, group, group.rank, mine, src, head)
    if e is not None:
        raise e
    same = head[ROW] == mine[ROW] and (not shape or head[ROW + 1:] == mine[ROW + 1:])
    if not same:
        (ra, ha), (rb, hb) = sorted(((group.rank, mine), (src, head)))
        what = "dtype and shape" if shape else "dtype"
        raise CommError(f"{name} over {_axes(group)}: rank {ra} passed {describe(ha)} but rank "
                        f"{rb} passed {describe(hb)}; every rank must pass the same {what}",
                        op=name, axes=group.axes)


class Rows:
    """The buffers of a gathered call (a small reduction, a barrier, a small all_gather),
    made once per kind of call and reused: the envelope this rank sends (only the call
    number and the payload change from call to call), one per member as they arrive, in
    process-group order, views of their heads and payloads, and the heads expected
    (this rank's, n times: a view of its own envelope, so the call number written into
    it is expected too).

    ``mine`` is this rank's inline payload as the tensor's dtype and shape (one
    ``copy_`` fills it, whatever the caller's strides), ``vals`` every member's, as
    ``(n, *shape)``: a call costs a few hundred microseconds, each torch call saved on a
    slow CPU several."""

    __slots__ = ("env", "rows", "out", "seq", "mine", "heads", "expect", "vals")

    def __init__(self, kind: str, extra: int, shape, dtype: torch.dtype, n: int, name: str,
                 device):
        head = head_of(kind, 0, extra, shape, dtype, name)
        nb = head[NBYTES]
        self.env = pack(head, None, device)
        self.out = torch.zeros(n * SIZE, dtype=torch.uint8, device=device)
        self.rows = self.out.view(n, SIZE)
        self.seq = self.env[:HEAD].view(torch.int64)[SEQ:SEQ + 1]
        self.heads = self.rows[:, :HEAD]
        self.expect = self.env[:HEAD].expand(n, -1)
        inline = nb <= INLINE  # a larger payload is not inline (see all_gather)
        nb = nb if inline else 0
        mine, vals = self.env[HEAD:HEAD + nb], self.rows[:, HEAD:HEAD + nb]
        if dtype != torch.uint8:
            mine, vals = mine.view(dtype), vals.view(dtype)
        shape = tuple(shape) if inline else (0,)
        self.mine = mine.view(shape)
        self.vals = vals.view(n, *shape)
