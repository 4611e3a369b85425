"""``transpose``: re-cut a tensor between two layouts over the same mesh axes in one
all_to_all (a slab or pencil transpose of a distributed FFT).

Every rank of a group (the ranks that differ only along the moved axes) sends each other
member the box where its source shard meets that member's destination shard, and writes
the boxes it receives at their place: uneven and empty shards need nothing special, and
the plan knows every box, so no sizes are exchanged. The adjoint of a permutation is its
inverse: backward is the same transpose from the destination back to the source, itself
differentiable, so double backward works too.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..collectives._anchor import anchor
from ..collectives.vjp import custom_vjp
from ..comm import comm_of
from ..core._context import RankContext
from ..core.layout import Layout

__all__ = ["transpose", "NAME"]

NAME = "fft transpose"  # what comm_stats calls its all_to_all


Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # src offset, dst offset, shape


@lru_cache(maxsize=512)
def _boxes(src: Layout, dst: Layout, members: tuple[int, ...]):
    """``box[i][j]``: what member i sends member j (None: nothing), and whether anything
    crosses ranks at all (decided from every member's boxes: the same on each)."""
    rows, crosses = [], False
    for i, ri in enumerate(members):
        so, ss = src.offsets(ri), src.local_shape(ri)
        row: list[Box | None] = []
        for j, rj in enumerate(members):
            do, ds = dst.offsets(rj), dst.local_shape(rj)
            lo = [max(a, b) for a, b in zip(so, do)]
            hi = [min(a + m, b + k) for a, m, b, k in zip(so, ss, do, ds)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                row.append(None)
                continue
            row.append((tuple(a - o for a, o in zip(lo, so)), tuple(a - o for a, o in zip(lo, do)),
                        tuple(h - a for a, h in zip(lo, hi))))
            crosses |= i != j
        rows.append(tuple(row))
    return tuple(rows), crosses


def _box(t: torch.Tensor, off: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    for d, (o, k) in enumerate(zip(off, shape)):
        if o or k != t.shape[d]:
            t = t.narrow(d, o, k)
    return t


def transpose(x: torch.Tensor, rc: RankContext, src: Layout, dst: Layout,
              axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's shard of ``x`` (laid out by ``src``) laid out by ``dst``, where the two
    differ only in how the mesh ``axes`` cut; one all_to_all over ``axes``.

    Backward: the same transpose from ``dst`` to ``src`` (the inverse permutation).
    """
    if not axes:  # only axes of size 1 differ: every rank already holds its shard
        return x
    return _transpose(anchor(x), rc, src, dst, axes)


@custom_vjp
def _transpose(x, rc, src, dst, axes):
    x = x.resolve_conj().resolve_neg()  # torch.fft's lazy conjugates: the bytes must be right
    group = rc.mesh.group(axes, rc.rank)
    boxes, crosses = _boxes(src, dst, group.ranks)
    me = group.index
    out = x.new_empty(dst.local_shape(rc.rank))
    own = boxes[me][me]
    if own is not None:
        _box(out, own[1], own[2]).copy_(_box(x, own[0], own[2]))
    if not crosses:
        return out
    empty = x.new_empty(0)
    chunks = [empty if j == me or b is None else _box(x, b[0], b[2])
              for j, b in enumerate(boxes[me])]
    shapes = [(0,) if i == me or row[me] is None else row[me][2] for i, row in enumerate(boxes)]
    got = comm_of(rc.mesh).all_to_all(chunks, group, name=NAME, shapes=shapes)
    for i, row in enumerate(boxes):
        if i != me and row[me] is not None:
            _box(out, row[me][1], row[me][2]).copy_(got[i].view(row[me][2]))
    return out


def _transpose_fwd(x, rc, src, dst, axes):
    return _transpose(x, rc, src, dst, axes), (rc, src, dst, axes)


def _transpose_bwd(res, g):
    rc, src, dst, axes = res
    with rc:
        return transpose(g, rc, dst, src, axes), None, None, None, None


_transpose.defvjp(_transpose_fwd, _transpose_bwd)
