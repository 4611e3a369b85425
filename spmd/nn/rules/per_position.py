"""Calls that act per position: elementwise ops, identity-like ops, sizes (the size of a
split dim is this rank's share: a ``LocalSize``), and tensors made in the forward."""
from __future__ import annotations

import math
from typing import Any

import torch

from ...core._context import current_rank
from .. import flow
from .._tags import LocalSize, local_sizes
from ._base import (
    Call,
    _arg,
    _dim,
    _no_local_sizes,
    _split,
    _tensors,
    _where,
    broadcast,
    share,
)


def pointwise(c: Call) -> Any:
    if c.name == "where" and len(c.args) + len(c.kwargs) == 1:  # torch.where(cond): positions
        x = c.args[0] if c.args else next(iter(c.kwargs.values()))
        if _split(c, x):
            c.refuse("lists the positions of nonzero values")
        return c.call()
    ts = _tensors(c)
    inplace = c.name.endswith("_") and not c.name.startswith("__") or "out" in c.kwargs
    cut = {} if inplace else _cut_whole(c, ts)
    args, kwargs = c.args, c.kwargs
    if cut:
        args, kwargs = _swapped(args, cut), {k: _swapped(v, cut) for k, v in kwargs.items()}
        ts = [cut.get(id(t), t) for t in ts]
    target = c.kwargs.get("out", c.args[0] if c.args else None) if inplace else None
    moved = flow.agree(c, ts, keep=target)  # operands split alike, else one moves
    if moved:
        args, kwargs = _swapped(args, moved), {k: _swapped(v, moved) for k, v in kwargs.items()}
        ts = [moved.get(id(t), t) for t in ts]
        c = Call(c.run, c.func, c.name, args, kwargs)
    entries = broadcast(c, ts)
    _no_local_sizes(c)
    if inplace:
        target = c.kwargs.get("out", c.args[0] if c.args else None)
        if isinstance(target, torch.Tensor) and c.ent(target) != entries[len(entries) - target.ndim:]:
            c.refuse("writes a value split over the mesh into a tensor that is whole (or "
                     "split otherwise)", "write into a new tensor instead of in place")
    res = c.call(None, args, kwargs)
    if isinstance(res, torch.Tensor):
        entries = entries[len(entries) - res.ndim:] if res.ndim <= len(entries) else \
            (None,) * (res.ndim - len(entries)) + entries
    return c.out(res, entries)


def _cut_whole(c: Call, ts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Operands whole on every dim (a learned table: a ViT's positional embedding) whose
    extent along a dim that another operand splits is that dim's GLOBAL size: each rank
    takes its part of them (a differentiable slice at its offset), so ``tokens + table``
    is exact. ``{id(whole): its slice}``, tagged split like the other operand.

    The global size and the offset come from the split operand's layout (``flow.py``:
    known from the input's, or one small size exchange; none while planning, on meta
    tensors, where the slice is only a shape). A table of another size is left whole: broadcasting refuses
    it, on every rank alike (the sizes compared are global)."""
    nd = max((t.ndim for t in ts), default=0)
    whole = [t for t in ts if t.ndim and not any(c.ent(t))]
    if not whole or len(whole) == len(ts):
        return {}
    cut: dict[int, torch.Tensor] = {}
    layouts: dict[int, Any] = {}
    for d in range(nd):
        split = [(t, t.ndim - nd + d) for t in ts
                 if t.ndim - nd + d >= 0 and c.ent(t)[t.ndim - nd + d]]
        if not split or len({c.ent(t)[k] for t, k in split}) > 1:
            continue  # nothing split here, or split two ways: broadcasting says so
        x, kx = split[0]
        n = x.shape[kx]
        for w in whole:
            k = w.ndim - nd + d
            if k < 0 or w.shape[k] == 1:
                continue
            cur = cut.get(id(w), w)
            if c.planning and not c.run.plan.global_sizes:
                # stand-in sizes: only the shape; the run checks the global size
                sl = c.call(lambda t, k=k, m=n: t.narrow(k, 0, m) if t.shape[k] >= m else
                            t.new_empty(t.shape[:k] + (m,) + t.shape[k + 1:]), (cur,), {})
            else:
                if c.planning:  # example=: the global shapes
                    offset, size = 0, n
                else:
                    if id(x) not in layouts:
                        # its layout (known from the flow, or one exchange)
                        layouts[id(x)] = (current_rank(c.mesh), flow.layout(c.run, x))
                    rank, lay = layouts[id(x)]
                    offset, size = lay.offsets(rank)[kx], lay.shape[kx]
                if w.shape[k] != size:
                    continue
                sl = c.call(lambda t, k=k, o=offset, m=n: t.narrow(k, o, m), (cur,), {})
            ent = list(c.ent(cur)) if id(w) in cut else [None] * w.ndim
            ent[k] = c.ent(x)[kx]
            cut[id(w)] = c.out(sl, tuple(ent))
    if cut:
        c.record("sliced", "whole operands cut to this rank's part of the split dims")
    return cut


def _swapped(a: Any, cut: dict[int, torch.Tensor]) -> Any:
    if isinstance(a, torch.Tensor):
        return cut.get(id(a), a)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return type(a)(_swapped(v, cut) for v in a)
    return a


def same(c: Call) -> Any:
    """Identity-like (to, clone, contiguous, detach, ...): the entries of ``self``."""
    x = c.args[0]
    res = c.call()
    return c.out(res, c.ent(x) if isinstance(res, torch.Tensor) and res.ndim == x.ndim else None)


def random_like_mask(c: Call) -> Any:
    """Dropout of whole channels (dropout1d/2d/3d, feature_alpha_dropout): one draw per
    (sample, channel) over all positions, which ranks would draw differently."""
    x = c.args[0]
    training = _arg(c, "training", 2, True)
    sp = [d for d in _split(c, x) if d >= (2 if x.ndim > 2 else 1)]
    if training and sp:
        c.refuse(f"drops whole channels at random, one draw per channel over all positions; "
                 f"along {_where(sp[0], c.ent(x)[sp[0]])} each rank would draw its own",
                 "use F.dropout (independent per element), or allow=(...) to accept it")
    return same(c)


def embedding(c: Call) -> Any:
    idx = c.args[0]
    return c.out(c.call(), c.ent(idx) + (None,))


def one_hot(c: Call) -> Any:
    return c.out(c.call(), c.ent(c.args[0]) + (None,))


def view_as_real(c: Call) -> Any:
    return c.out(c.call(), c.ent(c.args[0]) + (None,))


def view_as_complex(c: Call) -> Any:
    e = c.ent(c.args[0])
    if e and e[-1]:
        c.refuse(f"pairs values along {_where(len(e) - 1, e[-1])}")
    return c.out(c.call(), e[:-1])


def shape(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    s = c.call()
    if not any(e):
        return s
    return torch.Size(_size(c, x, d, v) if e[d] else v for d, v in enumerate(s))


def _size(c: Call, x: torch.Tensor, d: int, v: int, expr: str | None = None) -> LocalSize:
    """This rank's ``v`` of split dim ``d`` of ``x``, with the dim's global length where
    its layout is known (``glob``: a comparison of two such sizes decides on those; a
    call that means the global size, an FFT's ``s=``, takes it)."""
    sizes = flow.sizes_of(x, c.mesh)
    glob = sum(sizes[d]) if sizes is not None and sizes[d] else None
    return LocalSize(v, (d, c.ent(x)[d]), False, expr, glob)


def size(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    s = c.call()
    d = _arg(c, "dim", 1, None)
    if not any(e):
        return s
    if d is None:
        return torch.Size(_size(c, x, k, v) if e[k] else v for k, v in enumerate(s))
    k = _dim(d, x.ndim)
    return _size(c, x, k, s) if e[k] else s


def numel(c: Call) -> Any:
    x = c.args[0]
    sp = _split(c, x)
    n = c.call()
    if not sp:
        return n
    sizes = flow.sizes_of(x, c.mesh)  # the global count, where the layout is known
    glob = math.prod(sum(sizes[d]) if d in sp else v for d, v in enumerate(x.shape)) \
        if sizes is not None and all(sizes[d] for d in sp) else None
    return LocalSize(n, (sp[0], c.ent(x)[sp[0]]), True, "numel()", glob)


def length(c: Call) -> Any:
    x = c.args[0]
    n = c.call()
    e = c.ent(x)
    return _size(c, x, 0, n, "len(x)") if e and e[0] else n


def reads_values(c: Call) -> Any:
    x = c.args[0]
    sp = _split(c, x)
    if sp:
        c.refuse(f"reads the values of this rank's shard (split along "
                 f"{_where(sp[0], c.ent(x)[sp[0]])}) into Python, where they would differ "
                 f"from rank to rank", "reduce first (x.sum(), x.mean(), ...): the result "
                 "is the same on every rank")
    return c.call()


def _size_args(c: Call) -> list:
    if "size" in c.kwargs:
        s = c.kwargs["size"]
        return list(s) if isinstance(s, (tuple, list, torch.Size)) else [s]
    sizes = []
    for a in c.args:
        if isinstance(a, (tuple, list, torch.Size)):
            sizes.extend(a)
        elif isinstance(a, int):
            sizes.append(a)
        else:
            break
    return sizes


def creation(c: Call) -> Any:
    """zeros, ones, empty, full, rand, randn (and new_*): a size built from the sizes of
    split dims gives a tensor split the same way (its values do not depend on position)."""
    sizes = _size_args(c if not c.name.startswith("new_") else
                       Call(c.run, c.func, c.name, c.args[1:], c.kwargs))
    if c.name == "full" and c.args and isinstance(c.args[0], (tuple, list, torch.Size)):
        sizes = list(c.args[0])
    entries = []
    for v in sizes:
        if isinstance(v, LocalSize):
            if v.derived:
                c.refuse(f"makes a dim of size {share(c, v)}",
                         "make it from the shard's own size, or globally")
            entries.append(v.origin[1])
        else:
            entries.append(None)
    res = c.call()
    if isinstance(res, torch.Tensor) and len(entries) == res.ndim and any(entries):
        return c.out(res, tuple(entries))
    return res


def like(c: Call) -> Any:
    return same(c)


def coordinates(c: Call) -> Any:
    """arange, linspace, ...: values that depend on the position."""
    for a in list(c.args) + list(c.kwargs.values()):
        for s in local_sizes(a):
            c.refuse(f"builds coordinates from {share(c, s)}: each rank would count from 0",
                     "build them globally and split them "
                     "like the data, or offset them by the shard's start "
                     "(spmd.axis_index and the layout's sizes)")
    return c.call()
