"""The framed convolution: a conv whose window is the shard padded alike on both sides
(a 'same' conv, a strided one on even shards) as the conv of the shard itself plus the
conv of each halo on thin slabs, so no padded copy of the shard is made, forward or
backward, and each halo travels while the shard's own conv runs (``conv.py`` chooses
it; ``_Frame`` says how).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..collectives.vjp import custom_vjp, needs_input_grad
from ..transforms.halo import (
    Fetch,
    add_rows,
    assemble,
    exchange_async,
    frame,
    rows_of,
    take_rows,
    transpose_async,
)
from ._window import narrowed, vjp_through

__all__ = ["frame_plan", "framed", "conv_at", "conv_bwd_at"]


@dataclass(frozen=True)
class _Level:
    """One fetch of a framed conv along ``dim`` of ``shape`` (the shard padded along the
    earlier levels' dims): the window of ``width`` rows holds ``k`` of the shard's rows,
    from its row ``loc``, at ``pos``; the rest is halo (or padding)."""
    f: Fetch
    dim: int
    pos: int
    loc: int
    k: int
    width: int
    shape: tuple[int, ...]
    args: tuple  # the slabs' conv (``conv_at``'s): no padding along this or earlier dims
    slabs: tuple[tuple[tuple[int, int], tuple[int, int], tuple[int, int]], ...]


@dataclass(frozen=True)
class _Frame:
    """A conv whose every fetched dim is, to the conv, the shard zero-padded alike on
    both sides: its window starts ``P >= 0`` rows before the shard's first row, and the
    conv of the shard padded by ``P`` has exactly the rank's output rows (a 'same' conv,
    and a strided one on even shards: any stride, dilation, padding mode).

    The window is the shard, zero-padded, plus each level's halo, so (the conv being
    linear) the output is the conv of the shard itself, zero-padded by the conv (no
    copy), plus the conv of each level's halo alone, which reaches only the first and
    last few output rows along its dim: computed on thin slabs (``slabs``: output rows,
    window rows, halo rows kept; a later level's slabs hold the earlier ones' corners).
    So no padded copy of the shard is made in forward or backward.

    Overlap: the first level's halo travels while the shard's own conv runs, a later
    level's while the slabs of the one before run (it carries their corners). Backward,
    the last level's cotangents travel while the shard's input gradient runs, the next
    level's while its weight gradient runs. The exchanges are the window path's, in its
    order, so ranks that take either path pair their messages alike. (Cutting the
    shard's conv into parts, one per level, would hide every level but cost an
    output-sized copy and temporary; not measured on a GPU.)"""
    levels: tuple[_Level, ...]
    full: tuple  # the shard's conv: padding P along every level's dim
    window_conv: Callable  # the conv of the whole window (for a differentiable backward)


def frame_plan(x_shape: Sequence[int], fetches: list[Fetch], args: tuple,
                kernel: tuple[int, ...], shape: Sequence[int],
                window_conv: Callable) -> _Frame | None:
    """The ``_Frame`` of this conv, or None where it is not one (a window that starts
    inside the shard, or ends further past it than the conv's padding reaches; an empty
    shard or output: the window path is used)."""
    if not fetches or 0 in shape[2:]:
        return None
    stride, native, dilation, _, _ = args
    full = list(native)  # 0 along every fetched dim
    for f in fetches:
        i = f.dim - 2
        n, (pos, loc, k) = f.plan[0][f.me], f.plan[2][f.me]
        span = dilation[i] * (kernel[i] - 1) + 1
        P = pos - loc
        if k == 0 or P < 0 or n + 2 * P < span or (n + 2 * P - span) // stride[i] + 1 != shape[f.dim]:
            return None
        full[i] = P
    levels, cur = [], list(x_shape)
    for j, f in enumerate(fetches):
        i, m, s = f.dim - 2, shape[f.dim], stride[f.dim - 2]
        (a, b), (pos, loc, k) = f.plan[1][f.me], f.plan[2][f.me]
        span = dilation[i] * (kernel[i] - 1) + 1
        slabs = []
        oa = min(-(-pos // s), m)  # the output rows that read a row before the shard's
        if oa:
            slabs.append(((0, oa), (0, s * (oa - 1) + span), (0, pos)))
        ob = max((pos + k - span) // s + 1, 0)  # the first that reads a row after them
        if b - a > pos + k and ob < m:
            slabs.append(((ob, m), (s * ob, s * (m - 1) + span), (pos + k, b - a)))
        pad = list(native)  # later levels' dims are not padded yet: the conv pads them
        for later in fetches[j + 1:]:
            pad[later.dim - 2] = full[later.dim - 2]
        levels.append(_Level(f, f.dim, pos, loc, k, b - a, tuple(cur),
                             (stride, tuple(pad), *args[2:]), tuple(slabs)))
        cur[f.dim] = b - a
    return _Frame(tuple(levels), (stride, tuple(full), *args[2:]), window_conv)


def conv_at(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             args: tuple) -> torch.Tensor:
    """ATen's convolution; ``args = (stride, padding, dilation, transposed, groups)``."""
    stride, padding, dilation, transposed, groups = args
    return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, transposed,
                                      [0] * len(stride), groups)


def conv_bwd_at(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, args: tuple, mask: list[bool]) -> tuple:
    """ATen's convolution backward (no forward recomputed): the ``mask``ed gradients of
    x, weight and bias."""
    stride, padding, dilation, transposed, groups = args
    return torch.ops.aten.convolution_backward(
        g, x, weight, None if bias is None else [bias.shape[0]], stride, padding, dilation,
        transposed, [0] * len(stride), groups, mask)


def _rows(x: torch.Tensor, recvs: list, levels: Sequence[_Level], dim: int):
    """``take`` for a later level's exchange: ``x`` padded along ``levels`` (with what
    arrived), built only at the positions sent along ``dim``."""
    def take(idx: tuple[int, ...]) -> torch.Tensor:
        t = take_rows(x, dim, idx)
        for lv, recv in zip(levels, recvs):
            t = assemble(t, [rows_of(c, dim, idx) for c in recv], lv.f)
        return t
    return take


def _framed_value(x: torch.Tensor, fr: _Frame, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    """The conv, and what arrived at each level. The first halo travels while the
    shard's own conv runs (it needs no halo); each later one while the slabs of the
    level before it run."""
    levels = fr.levels
    pending, recvs = exchange_async(x, levels[0].f), []
    y = conv_at(x, weight, bias, fr.full)
    for j, lv in enumerate(levels):
        recvs.append(pending.wait())
        if j + 1 < len(levels):
            nxt = levels[j + 1]
            pending = exchange_async(x, nxt.f, _rows(x, recvs, levels[:j + 1], nxt.dim))
        for (o0, o1), rows, keep in lv.slabs:
            s = frame(x, recvs[j], lv.f, rows, keep, lv.shape)
            if s is not None:  # the halo's part (the conv is linear): added in place
                y.narrow(lv.dim, o0, o1 - o0).add_(conv_at(s, weight, None, lv.args))
    return y, recvs


def _framed_backward(fr: _Frame, x: torch.Tensor, recvs: list, weight: torch.Tensor,
                     bias: torch.Tensor | None, needs: tuple, g: torch.Tensor) -> tuple:
    levels = fr.levels
    halos: list[torch.Tensor | None] = [None] * len(levels)  # each level's cotangent, apart
    gws, to_shard = [], []

    def halo(j: int) -> torch.Tensor:
        if halos[j] is None:
            shape = list(levels[j].shape)
            shape[levels[j].dim] = levels[j].width - levels[j].k
            halos[j] = g.new_zeros(shape)  # the window outside the shard, in window order
        return halos[j]

    def slabs_backward(j: int) -> None:
        lv = levels[j]
        for (o0, o1), (w0, w1), keep in lv.slabs:
            s = frame(x, recvs[j], lv.f, (w0, w1), keep, lv.shape)
            if s is None:  # nothing arrived there: no gradient to send, none to the weight
                continue
            gi, gw_slab, _ = conv_bwd_at(g.narrow(lv.dim, o0, o1 - o0), s, weight, None,
                                          lv.args, [True, needs[0], False])
            gws.append(gw_slab)
            lo, hi = max(w0, keep[0]), min(w1, keep[1])
            at = lo if lo < lv.pos else lo - lv.k
            halo(j).narrow(lv.dim, at, hi - lo).add_(gi.narrow(lv.dim, lo - w0, hi - lo))

    def returned(j: int, got: list) -> None:
        """What level j > 0's owners sent back, added where its rows lie: the earlier
        levels' halos (corners), the rest into the shard's cotangent (kept for later).
        ``cuts``: the shard rows each later level's window holds, to narrow a target
        tensor (a halo, the shard's cotangent) to the rows that arrived."""
        f, dim = levels[j].f, levels[j].dim
        for r, need in enumerate(f.plan[3]):
            if f.me not in need:
                continue
            at = need[f.me][1]
            t, cuts = got[r], []
            for i in reversed(range(j)):
                lv = levels[i]
                h = narrowed(halo(i), cuts)
                for src, dst, n in ((0, 0, lv.pos), (lv.pos + lv.k, lv.pos, lv.width - lv.pos - lv.k)):
                    if n:
                        add_rows(h.narrow(lv.dim, dst, n), dim, at, t.narrow(lv.dim, src, n))
                t = t.narrow(lv.dim, lv.pos, lv.k)
                cuts.append((lv.dim, lv.loc, lv.k))
            to_shard.append((dim, at, t, cuts))

    # The last level's cotangents leave first. The shard's own conv backward, the bulk
    # of the work, runs while they travel: its input gradient, then (with several
    # levels) its weight gradient while the next level's travel.
    last = len(levels) - 1
    slabs_backward(last)
    back = transpose_async(halo(last), levels[last].f, apart=True)
    for j in reversed(range(len(levels))):
        if j == last:
            mask = [True, *needs] if last == 0 else [True, False, False]
            gx, gw, gb = conv_bwd_at(g, x, weight, bias, fr.full, mask)
        elif j == last - 1 and any(needs):
            _, gw, gb = conv_bwd_at(g, x, weight, bias, fr.full, [False, *needs])
        if j:
            slabs_backward(j - 1)
            returned(j, back.pending.wait())
            back = transpose_async(halo(j - 1), levels[j - 1].f, apart=True)
        else:  # the first level's arrivals land in the shard's cotangent, as any fetch's
            gx = back.wait(owned=True, own_grad=gx)
    for dim, at, t, cuts in to_shard:
        add_rows(narrowed(gx, cuts), dim, at, t)
    if gw is not None:
        for gw_slab in gws:
            gw += gw_slab
    return gx, gw, gb


def _framed_primal(x, fr, weight, bias):
    return _framed_value(x, fr, weight, bias)[0]


framed = custom_vjp(_framed_primal, nondiff_argnums=(1,))


def _framed_fwd(x, fr, weight, bias):
    y, recvs = _framed_value(x, fr, weight, bias)
    return y, (x, recvs, weight, bias)


def _framed_bwd(fr, res, g):
    x, recvs, weight, bias = res
    _, _, nw, nb = needs_input_grad()
    needs = (nw, bias is not None and nb)
    if torch.is_grad_enabled():  # create_graph or torch.func: differentiable all the way
        return vjp_through(x, x.shape, tuple(lv.f for lv in fr.levels), fr.window_conv,
                           (weight, bias), needs, g)
    return _framed_backward(fr, x, recvs, weight, bias, needs, g)


framed.defvjp(_framed_fwd, _framed_bwd)
