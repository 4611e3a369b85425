"""Calls that rearrange dims: views and reshapes, permutations, cat/stack/split, indexing.
A split dim may move, and merge with whole dims behind it (or split back into them), but
never be merged behind another dim, be cut, or be indexed."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from .. import flow
from .._tags import Entries, LocalSize, split_dims
from ._base import Call, _arg, _dim, _dims, _no_local_sizes, _where, broadcast, share
from .per_position import same

_BIG = 1_000_003  # a split dim's stand-in size when matching dims through a view


def _view_target(c: Call) -> list:
    if c.name in ("view", "reshape") and len(c.args) == 2 and \
            isinstance(c.args[1], (tuple, list, torch.Size)):
        return list(c.args[1])
    if c.name == "reshape" and "shape" in c.kwargs:
        return list(c.kwargs["shape"])
    return list(c.args[1:])


def _groups(ins: list[int], outs: list[int]) -> list[tuple[list[int], list[int]]] | None:
    """Match the dims of a view: groups of input and output dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, gj = [], []
        if i < len(ins) and ins[i] == 1 and (j >= len(outs) or outs[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(outs) and outs[j] == 1 and (i >= len(ins) or ins[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        pi = pj = 1
        while True:
            if pi <= pj and i < len(ins):
                pi *= ins[i]
                gi.append(i)
                i += 1
            elif j < len(outs):
                pj *= outs[j]
                gj.append(j)
                j += 1
            else:
                return None
            if pi == pj and gi and gj:
                break
        groups.append((gi, gj))
    return groups


def _canon(c: Call, x: torch.Tensor, e: Entries, target: list, big: int) -> tuple[list, list]:
    """The view's input and target sizes with every split dim's local size ``n_d`` a
    stand-in ``big + d``: a target size read from a split dim (``x.shape[d]``, times plain
    ints: ``h * w``) becomes ``big + d`` times its ratio to ``n_d`` (``h * w`` of a
    merged ``h`` is ``(big + d) * w``; ``h`` of a dim that holds ``h * w`` is
    ``(big + d) / w``), so that two stand-ins tell split sizes from whole ones."""
    ins = [(big + d) if e[d] else int(v) for d, v in enumerate(x.shape)]
    canon: list = []
    if -1 not in target and sum(isinstance(v, LocalSize) for v in target) == 1 and \
            any(x.shape[d] == 0 for d in split_dims(e)):
        # an empty shard tells no ratio: the one size read from a split dim is what the
        # others leave, as on the ranks that hold rows
        target = [-1 if isinstance(v, LocalSize) and v.scale is not None else v
                  for v in target]
    for v in target:
        d = next((k for k in split_dims(e) if isinstance(v, LocalSize) and e[k] == v.origin[1]),
                 None)
        if isinstance(v, LocalSize) and (d is None or v.scale is None or x.shape[d] == 0):
            c.refuse(f"reshapes with {share(c, v)}", "keep split dims as they are (pass -1 or "
                     "x.shape[d] there, or x.shape[d] times whole sizes)")
        canon.append(Fraction(int(v), x.shape[d]) * (big + d) if isinstance(v, LocalSize)
                     else int(v))
    if canon.count(-1) == 1:
        known = math.prod(v for v in canon if v != -1)
        canon[canon.index(-1)] = Fraction(math.prod(ins), known) if known else 0
    return ins, canon


def _merge_refusal(c: Call, d: int, e: Entries) -> None:
    c.refuse(f"reshapes {_where(d, e[d])}, merging it with other dims where it is not the "
             f"outermost (or splitting it otherwise than into itself and whole dims behind "
             f"it): each rank's elements would be scattered over the result",
             "keep the split dim outermost of the dims it merges with (x.view(b, c, h * w) "
             "with h split), reshape only whole dims, or redistribute first")


def view(c: Call) -> Any:
    """A split dim may merge with whole dims behind it (``x.view(b, c, h * w)``, equal to
    ``x.flatten(2)``) or be split into itself and whole dims (the inverse): each rank's
    elements stay one run of the global order, the shard sizes scaled by the whole
    sizes merged in (divided by those split off, which must divide every shard)."""
    x = c.args[0]
    e = c.ent(x)
    sp = split_dims(e)
    if c.name in ("view", "reshape") and len(c.args) == 2 and isinstance(c.args[1], torch.dtype):
        return same(c)
    if not sp:
        _no_local_sizes(c)
        return c.call()
    target = _view_target(c)
    ins, canon = _canon(c, x, e, target, _BIG)
    ins2, canon2 = _canon(c, x, e, target, 2 * _BIG)
    groups = _groups(ins, canon)
    if groups is None or groups != _groups(ins2, canon2):
        _merge_refusal(c, sp[0], e)
    sz = flow.sizes_of(x, c.mesh)
    out: list = [None] * len(canon)
    out_sizes: list = [None] * len(canon)
    for d in sp:
        gi, gj = next(g for g in groups if d in g[0])
        if any(e[k] for k in gi if k != d):  # two split dims: the later one is behind
            _merge_refusal(c, max(k for k in gi if e[k]), e)
        if any(ins[k] != 1 for k in gi[:gi.index(d)]):
            _merge_refusal(c, d, e)
        grown = [k for k in gj if canon[k] != canon2[k]]  # the out dims holding the split one
        if len(grown) != 1 or any(canon[k] != 1 for k in gj[:gj.index(grown[0])]):
            _merge_refusal(c, d, e)
        j = grown[0]
        merged = math.prod(ins[k] for k in gi[gi.index(d) + 1:])
        cut = math.prod(int(canon[k]) for k in gj[gj.index(j) + 1:])
        if sz is not None and sz[d] is not None:
            if any(s * merged % cut for s in sz[d]):
                c.refuse(f"splits {_where(d, e[d])} into whole dims of {cut} elements, which "
                         f"do not divide its shards {list(sz[d])} (times {merged})",
                         "split the dim so that every shard holds whole rows (or "
                         "redistribute first)")
            out_sizes[j] = tuple(s * merged // cut for s in sz[d])
        elif x.shape[d] * merged % cut:
            c.refuse(f"splits {_where(d, e[d])} into whole dims of {cut} elements, which do "
                     f"not divide this rank's {x.shape[d]} rows", "redistribute first")
        out[j] = e[d]
    real = [int(v) for v in target]
    known = None if sz is None else tuple(out_sizes)
    return c.out(c.call(args=(x, real), kwargs={}), tuple(out), known)


def view_as(c: Call) -> Any:
    x, other = c.args[0], c.args[1]
    if c.ent(x) != c.ent(other) or x.ndim != other.ndim:
        if split_dims(c.ent(x)) or split_dims(c.ent(other)):
            c.refuse("reshapes between tensors split differently",
                     "use view(...) with -1 at the split dims")
    return c.out(c.call(), c.ent(other))


def flatten(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    start = _dim(_arg(c, "start_dim", 1, 0), x.ndim) if x.ndim else 0
    end = _dim(_arg(c, "end_dim", 2, -1), x.ndim) if x.ndim else 0
    if c.name == "ravel":
        start, end = 0, max(x.ndim - 1, 0)
    for d in range(start + 1, end + 1):
        # Row-major: the rows of a split leading dim stay one contiguous run of the
        # flattened dim (a patch grid's rows become a run of tokens), a later one's do not.
        if e[d]:
            c.refuse(f"flattens {_where(d, e[d])} behind dim {start}: each rank's elements "
                     f"would be scattered over the flattened dim",
                     "split the first of the flattened dims instead (or only it), or reduce "
                     "(pool) the split dims first")
    out = e[:start] + (e[start],) + e[end + 1:] if x.ndim else ()
    # a split first dim's rows become runs of prod(whole dims behind it) elements
    factor = math.prod(int(v) for v in x.shape[start + 1:end + 1])
    keep = list(range(start + 1)) + list(range(end + 1, x.ndim))
    return c.out(c.call(), out, flow.scaled(c, x, keep, start, factor) if x.ndim else None)


def unflatten(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    d = _dim(_arg(c, "dim", 1, 0), x.ndim)
    sizes = _arg(c, "sizes", 2, ())
    if e[d]:  # as the reshape it is: into itself and whole dims behind it
        shape = [LocalSize(n, (k, e[k])) if e[k] else int(n) for k, n in enumerate(x.shape)]
        target = shape[:d] + list(sizes) + shape[d + 1:]
        return view(Call(c.run, torch.Tensor.reshape, "reshape", (x, target), {}))
    return c.out(c.call(), e[:d] + (None,) * len(sizes) + e[d + 1:])


def squeeze(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    d = _arg(c, "dim", 1, None)
    dims = list(range(x.ndim)) if d is None else _dims(d, x.ndim)
    for k in dims:
        if e[k]:
            c.refuse(f"removes size-1 dims, and {_where(k, e[k])}, whose size differs from "
                     f"rank to rank", "squeeze only whole dims (name them)")
    res = c.call()
    keep = [k for k in range(x.ndim) if not (k in dims and x.shape[k] == 1)]
    return c.out(res, tuple(e[k] for k in keep) if res.ndim == len(keep) else None)


def unsqueeze(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    d = int(_arg(c, "dim", 1, 0))
    d = d % (x.ndim + 1) if d < 0 else d
    return c.out(c.call(), e[:d] + (None,) + e[d:])


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53)


def permutation(c: Call) -> Any:
    """permute, transpose, movedim, t, T, mT, ...: follow the dims."""
    x = c.args[0]
    e = c.ent(x)
    if not any(e):
        return c.call()
    if x.ndim > len(_PRIMES):
        c.refuse(f"permutes {x.ndim} dims (at most {len(_PRIMES)} are followed)")
    probe = torch.empty(_PRIMES[:x.ndim], device="meta")
    moved = c.run.execute_plain(c.func, (probe,) + tuple(c.args[1:]), c.kwargs)
    where = [_PRIMES.index(s) for s in moved.shape]
    return c.out(c.call(), tuple(e[k] for k in where))


def expand(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    if c.name == "expand_as":
        c = flow.agreed(c, [x, c.args[1]])
        entries = broadcast(c, [c.args[0], c.args[1]])
        return c.out(c.call(), entries)
    target = list(c.args[1]) if len(c.args) == 2 and isinstance(c.args[1], (tuple, list,
                                                                            torch.Size)) \
        else list(c.args[1:]) if c.name == "expand" else list(_arg(c, "size", 1, ()))
    lead = len(target) - x.ndim
    for d in split_dims(e):
        v = target[lead + d]
        ok = v == -1 or (isinstance(v, LocalSize) and not v.derived and v.origin[0] == d)
        if not ok:
            c.refuse(f"expands {_where(d, e[d])} to {int(v)}",
                     "pass -1 (or x.shape[d]) at split dims")
    res = c.call()
    return c.out(res, (None,) * lead + e)


def repeat(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    reps = list(c.args[1]) if len(c.args) == 2 and isinstance(c.args[1], (tuple, list,
                                                                          torch.Size)) \
        else list(c.args[1:]) if c.args[1:] else list(_arg(c, "dims", 1, ()))
    lead = len(reps) - x.ndim
    if lead < 0:
        reps = [1] * -lead + reps
        lead = 0
    for d in split_dims(e):
        if int(reps[lead + d]) != 1:
            c.refuse(f"repeats along {_where(d, e[d])}", "repeat only whole dims")
    return c.out(c.call(), (None,) * lead + e)


def cat(c: Call) -> Any:
    ts = c.args[0] if c.args else c.kwargs.get("tensors")
    d = _arg(c, "dim", 1, 0)
    ts = [t for t in ts if not (t.ndim == 1 and t.shape[0] == 0)]  # torch skips empty 1-d
    if not ts:
        return c.call()
    nd = ts[0].ndim
    k = _dim(d, nd)
    es = [c.ent(t) for t in ts]
    if any(e[k] for e in es):
        c.refuse(f"concatenates along {_where(k, next(e[k] for e in es if e[k]))}",
                 "concatenate along whole dims (channels), or redistribute first")
    if any(e != es[0] for e in es):
        c.refuse("concatenates tensors split differently (some whole)",
                 "split all of them the same way")
    c = _agreed(c, ts)
    return c.out(c.call(), es[0])


def _agreed(c: Call, ts: list) -> Call:
    """``c`` with its tensors (the first argument's list) split with the same sizes:
    all but one moved to the layout that moves the fewest bytes (``flow.agree``)."""
    moved = flow.agree(c, ts)
    if not moved:
        return c
    key = "tensors" if not c.args else None
    given = c.args[0] if c.args else c.kwargs["tensors"]
    new = type(given)(moved.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in given)
    if key:
        return Call(c.run, c.func, c.name, c.args, {**c.kwargs, key: new})
    return Call(c.run, c.func, c.name, (new,) + tuple(c.args[1:]), c.kwargs)


def stack(c: Call) -> Any:
    ts = c.args[0] if c.args else c.kwargs.get("tensors")
    d = int(_arg(c, "dim", 1, 0))
    es = [c.ent(t) for t in ts]
    if any(e != es[0] for e in es):
        c.refuse("stacks tensors split differently (some whole)",
                 "split all of them the same way")
    c = _agreed(c, list(ts))
    nd = ts[0].ndim + 1
    d = d % nd if d < 0 else d
    return c.out(c.call(), es[0][:d] + (None,) + es[0][d:])


def pieces(c: Call) -> Any:
    """split, chunk, tensor_split, unbind: along one dim."""
    x = c.args[0]
    e = c.ent(x)
    pos = {"unbind": 1}.get(c.name, 2)
    d = _dim(_arg(c, "dim", pos, 0), x.ndim)
    if e[d]:
        c.refuse(f"cuts along {_where(d, e[d])}", "cut whole dims only")
    res = c.call()
    one = e[:d] + e[d + 1:] if c.name == "unbind" else e
    return c.out(res, [one] * len(res))


def along_dim(pos: int, what: str, keep: str = "self"):
    """narrow, select, index_select, gather, scatter, ...: positions along ``dim``."""
    def rule(c: Call) -> Any:
        x = c.args[0]
        e = c.ent(x)
        d = _dim(_arg(c, "dim", pos, 0), x.ndim)
        if e[d]:
            c.refuse(f"{what} along {_where(d, e[d])}",
                     "index whole dims only, or redistribute first")
        _no_local_sizes(c)
        res = c.call()
        if keep == "drop":
            return c.out(res, e[:d] + e[d + 1:])
        if keep == "index":
            idx = c.kwargs.get("index", c.args[pos + 1] if len(c.args) > pos + 1 else None)
            ie = c.ent(idx) if isinstance(idx, torch.Tensor) else None
            if ie is not None and any(a and b and a != b for a, b in zip(ie, e)):
                c.refuse("indexes with an index split otherwise than the input")
            merged = tuple(a or b for a, b in zip(e, ie)) if ie is not None else e
            return c.out(res, merged if res.ndim == len(merged) else None)
        return c.out(res, e if isinstance(res, torch.Tensor) and res.ndim == x.ndim else None)
    return rule


def _index_items(idx: Any) -> tuple:
    return idx if isinstance(idx, tuple) else (idx,)


def _whole(v: slice) -> bool:
    """``:``, ``0:``, ``0:None:1``: every position, in order (``x[:, 0:]`` in a ViT)."""
    return (v.start is None or (type(v.start) is int and v.start == 0)) and v.stop is None \
        and (v.step is None or (type(v.step) is int and v.step == 1))


def _index_entries(c: Call, x: torch.Tensor, idx: Any, writes: bool) -> Entries:
    """The entries of ``x[idx]``; refuses indexing that picks positions of a split dim."""
    e = c.ent(x)
    items = _index_items(idx)
    consumed = sum(0 if (v is None or v is Ellipsis) else
                   (v.ndim if isinstance(v, torch.Tensor) and v.dtype == torch.bool else 1)
                   for v in items)
    out: list = []
    d = 0
    advanced = 0
    for v in items:
        if v is None:
            out.append(None)
        elif v is Ellipsis:
            for _ in range(x.ndim - consumed):
                out.append(e[d])
                d += 1
        elif isinstance(v, slice):
            if e[d] and not _whole(v):
                if writes:
                    c.refuse(f"writes into part of {_where(d, e[d])}",
                             "write whole split dims only (':')")
                if x.is_complex():  # a spectrum's modes: an FNO layer written out
                    c.refuse(f"slices {_where(d, e[d])} (a spectrum split along its "
                             f"frequencies by the FFT before: keeping low modes needs the "
                             f"modes other ranks hold)",
                             "use spmd.nn.SpectralConv1d/2d/3d for an FNO layer "
                             "(convert(..., types={YourLayer: spmd.nn.SpectralConv2d}))")
                hint = ("; a stencil that reads neighbours (x[..., 1:] - x[..., :-1]) gets "
                        "them with spmd.halo_pad on the shard") if v.step in (None, 1) else ""
                c.refuse(f"slices {_where(d, e[d])}{hint}",
                         "keep split dims whole in indexing (':'), or run the stencil on "
                         "spmd.halo_pad's output in a shard_map body")
            out.append(e[d])
            d += 1
        elif isinstance(v, (bool, int)) and not isinstance(v, torch.Tensor):
            if e[d]:
                c.refuse(f"picks one position of {_where(d, e[d])}", "index whole dims only")
            d += 1
        else:  # advanced: a tensor, a list
            advanced += 1
            n = v.ndim if isinstance(v, torch.Tensor) and v.dtype == torch.bool else 1
            for k in range(d, d + n):
                if e[k]:
                    c.refuse(f"selects positions of {_where(k, e[k])} with an index",
                             "index whole dims only")
            w = v.ndim if isinstance(v, torch.Tensor) and v.dtype != torch.bool else 1
            out.extend([None] * w)
            d += n
    if advanced > 1 and any(e):
        c.refuse("indexes with several index tensors next to split dims",
                 "index one whole dim at a time")
    _no_local_sizes_in_index(c, idx)
    return tuple(out) + tuple(e[d:])


def getitem(c: Call) -> Any:
    x, idx = c.args[0], c.args[1]
    out = _index_entries(c, x, idx, writes=False)
    res = c.call()
    return c.out(res, out if isinstance(res, torch.Tensor) and res.ndim == len(out) else None)


def _no_local_sizes_in_index(c: Call, idx: Any) -> None:
    for v in _index_items(idx):
        vals = [v.start, v.stop, v.step] if isinstance(v, slice) else [v]
        for s in vals:
            if isinstance(s, LocalSize):
                c.refuse(f"indexes with {share(c, s)}")


def setitem(c: Call) -> Any:
    """``x[idx] = value``: split dims of ``x`` must be indexed whole (':'), and the value
    split like its destination (or size 1 there)."""
    x, idx, value = c.args[0], c.args[1], c.args[2]
    dest = _index_entries(c, x, idx, writes=True)
    if isinstance(value, torch.Tensor) and value.ndim == x.ndim:  # split alike: x stays
        c = flow.agreed(c, [x, value], keep=x)
        value = c.args[2]
    if isinstance(value, torch.Tensor):
        ve = c.ent(value)
        for k in range(value.ndim):
            d = len(dest) - value.ndim + k
            t = dest[d] if d >= 0 else None
            if ve[k] and ve[k] != t:
                c.refuse("writes a value split otherwise than its destination",
                         "split the value like the destination")
            if t and not ve[k] and value.shape[k] != 1:
                c.refuse(f"writes a whole value along {_where(d, t)}",
                         "split the value like the destination")
    return c.call()
