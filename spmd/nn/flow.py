"""How layouts flow through a converted forward: every split tensor's shard sizes.

A split tensor's tag (``_tags.py``) holds the shard sizes of its split dims, so that
with its entries and its shape it is a global ``Layout``: the inputs' come from the
layout ``shard_map`` marked them with (or one size exchange); each call's outputs get
theirs from its inputs, by rank-independent arithmetic only:

- a call that keeps a dim's length (per position, views, norms, a stride-1 'same'
  convolution whatever its padding mode) keeps its sizes exactly;
- a windowed op (convolution, pool, interpolation, padding) gives the layout its
  ``spmd.ops`` twin defines (``output_layout``);
- where two operands of one call (``x + y``, ``torch.cat`` on the channels) are split
  along the same dim with other sizes, the cheaper one moves to the other's layout
  (``spmd.redistribute``: only the rows that change owner travel), and the plan lists
  the move and its bytes.

Where the sizes are not known (a layer not looked into, a tensor made in the forward),
the run learns them when a call needs them (one small exchange of local shapes); the
plan says so.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ..core import _context
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.provenance import marked
from ..ops._window import input_layout
from ..transforms.redistribution import _plan as _moves, redistribute
from ._tags import Tag, axes_str, set_tag, spec_of, tag_of

__all__ = ["layout", "sizes_of", "set_sizes", "assign", "agree", "input_sizes", "describe"]


def sizes_of(t: torch.Tensor, mesh: Mesh) -> tuple | None:
    """``t``'s known shard sizes (one tuple per split dim, None at whole dims), or None."""
    tag = tag_of(t)
    if tag is None or tag.mesh is not mesh or len(tag.entries) != t.ndim:
        return None
    return tag.sizes


def set_sizes(t: torch.Tensor, mesh: Mesh, sizes: tuple | None) -> None:
    tag = tag_of(t)
    if tag is not None and tag.mesh is mesh:
        set_tag(t, mesh, tag.entries, tag.poisoned, sizes)


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple, entries: tuple, sizes: tuple, mesh: Mesh) -> Layout:
    glob = tuple(sum(s) if e else n for n, e, s in zip(shape, entries, sizes))
    return Layout(glob, spec_of(entries), mesh, {d: s for d, s in enumerate(sizes) if s})


def of(t: torch.Tensor, mesh: Mesh, entries: tuple, sizes: tuple | None) -> Layout | None:
    """The global layout of ``t`` from its entries and sizes (None where unknown)."""
    if sizes is None or not any(entries):
        return None
    return _layout(tuple(int(n) for n in t.shape), tuple(entries), tuple(sizes), mesh)


def layout(run: Any, t: torch.Tensor) -> Layout | None:
    """``t``'s global layout: from its tag; where the tag does not know it, at run time
    one small exchange of the local shapes (every rank's tag says so alike) and None in
    a plan. None for a tensor split nowhere."""
    e = run.entries(t)
    if not any(e):
        return None
    lay = of(t, run.mesh, e, sizes_of(t, run.mesh))
    if lay is not None or run.planning:
        return lay
    prev = _context.set_converting(False)
    try:
        lay = input_layout(t, run.mesh, spec_of(e), "convert")[1]
    finally:
        _context.set_converting(prev)
    set_sizes(t, run.mesh, lay.sizes)
    return lay


def input_sizes(run_mesh: Mesh, original: torch.Tensor, tagged: torch.Tensor,
                exchange: bool = False) -> None:
    """The sizes of a forward's input: the layout shard_map marked it with, or with
    ``exchange`` (per-rank code, or an activation handed to a converted layer; after
    the plan, so that a refusal comes before any message) one exchange of local shapes."""
    tag = tag_of(tagged)
    if tag is None or not any(tag.entries) or tag.sizes is not None:
        return
    lay = marked(original)
    if lay is not None and lay.is_for(run_mesh) and all(
            lay.dim_axes(d) == (e or ()) for d, e in enumerate(tag.entries)):
        set_sizes(tagged, run_mesh, lay.sizes)
    elif exchange:
        lay = input_layout(original, run_mesh, spec_of(tag.entries), "convert")[1]
        set_sizes(tagged, run_mesh, lay.sizes)


def example_sizes(shape: Sequence[int], entries: tuple, mesh: Mesh) -> tuple | None:
    """Balanced sizes of a global ``shape`` (a plan made from ``example=``)."""
    if not any(entries):
        return None
    return Layout(tuple(shape), spec_of(entries), mesh).sizes


# -- outputs: sizes from the inputs, or as a rule says ------------------------------------------

def _tensors(c: Any) -> list[torch.Tensor]:
    """The call's tensor arguments, also those inside a list or tuple argument."""
    out = []
    for a in list(c.args) + list(c.kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(v for v in a if isinstance(v, torch.Tensor))
    return out


def candidates(c: Any) -> dict[tuple, set]:
    """For every mesh axes tuple splitting a dim of the call's tensor arguments: the sizes
    those dims have (``None`` in the set where one is not known)."""
    out: dict[tuple, set] = {}
    for t in _tensors(c):
        e = c.ent(t)
        if not any(e):
            continue
        sz = sizes_of(t, c.mesh)
        for d, a in enumerate(e):
            if a:  # with this rank's length, which an output keeping the sizes keeps
                out.setdefault(a, set()).add((None if sz is None else sz[d], t.shape[d]))
    return out


def assign(c: Any, result: Any, given: Any, found: dict[tuple, set]) -> None:
    """Give the outputs of ``c`` their sizes: ``given`` (a ``Layout``, a sizes tuple, or
    a list of them per output), else those of the inputs' dims split over the same axes
    (a mesh axis splits one dim of a tensor at most), when they all agree."""
    if isinstance(result, torch.Tensor):
        _one(c, result, given, found)
    elif isinstance(result, (tuple, list)):
        for k, r in enumerate(result):
            _one(c, r, given[k] if isinstance(given, list) else given, found)


def _one(c: Any, t: Any, given: Any, found: dict[tuple, set]) -> None:
    if not isinstance(t, torch.Tensor):
        return
    tag: Tag | None = tag_of(t)
    if tag is None or tag.mesh is not c.mesh or tag.poisoned or not any(tag.entries):
        return
    e = tag.entries
    if isinstance(given, Layout):
        sizes = given.sizes if len(given.sizes) == t.ndim else None
        if sizes is not None and any(bool(a) != (s is not None) for a, s in zip(e, sizes)):
            sizes = None
    elif given is not None:
        sizes = tuple(given)
    else:  # as the arguments' (each checked against its shard when it was made)
        sizes = []
        for d, a in enumerate(e):
            if not a:
                sizes.append(None)
                continue
            got = {sz for sz, _ in found.get(a, {(None, 0)})}
            if len(got) != 1 or None in got:
                sizes = None
                break
            if not c.planning and any(n != t.shape[d] for _, n in found[a]):
                raise SpecError(f"convert: spmd bug, please report: {c.name} gives a shard "
                                f"{list(t.shape)} whose dim {d} is not as long as its "
                                f"arguments' ({sorted(n for _, n in found[a])}), with the same "
                                f"shard sizes {list(next(iter(got)))}")
            sizes.append(next(iter(got)))
        set_sizes(t, c.mesh, tuple(sizes) if sizes is not None else None)
        return
    set_sizes(t, c.mesh, sizes)
    if sizes is not None and not c.planning:
        _check(c, t, e, sizes)


@functools.lru_cache(maxsize=4096)
def _fits(shape: tuple, entries: tuple, sizes: tuple, mesh: Mesh, rank: int) -> bool:
    return _layout(shape, entries, sizes, mesh).local_shape(rank) == shape


def _check(c: Any, t: torch.Tensor, e: tuple, sizes: tuple) -> None:
    """A layout that does not fit this rank's shard is spmd's own mistake: say so."""
    rank = _context.current_rank(c.mesh)
    if not _fits(tuple(t.shape), tuple(e), tuple(sizes), c.mesh, rank):
        lay = of(t, c.mesh, e, sizes)
        raise SpecError(f"convert: spmd bug, please report: {c.name} gives rank {rank} a "
                        f"shard {list(t.shape)} but its layout {lay!r} says "
                        f"{list(lay.local_shape(rank))}")


def scaled(c: Any, x: torch.Tensor, keep: Sequence[int], dim: int, factor: int) -> tuple | None:
    """The sizes of an output whose dims are ``x``'s dims ``keep`` (in order), the one
    from ``dim`` ``factor`` times as long on every rank (a flatten, F.unfold's channels);
    None where ``x``'s are not known."""
    sz = sizes_of(x, c.mesh)
    if sz is None:
        return None
    return tuple(None if sz[k] is None else
                 (tuple(v * factor for v in sz[k]) if k == dim else sz[k]) for k in keep)


# -- agreement: operands split alike ------------------------------------------------------------

def moved_elements(src: Layout, dst: Layout) -> int:
    """Elements that change owner when ``src`` is laid out as ``dst``."""
    pieces, _, _ = _moves(src, dst)
    return sum(math.prod(shape) for r, mine in enumerate(pieces)
               for s, _, _, shape in mine if s != r)


def agree(c: Any, ts: Sequence[torch.Tensor], keep: torch.Tensor | None = None,
          align: Callable[[torch.Tensor, int], Hashable] | None = None
          ) -> dict[int, torch.Tensor]:
    """Operands of ``c`` split along the same dims with other shard sizes: all but one
    are redistributed to the layout that moves the fewest bytes (never ``keep``, which
    an in-place call writes into). Returns ``{id(operand): its replacement}``.

    Dims are matched by ``align(t, dim)`` (default: from the right, as broadcasting
    does; einsum matches its subscripts). In a plan (meta tensors), the replacements
    also take the kept operand's stand-in sizes, so the call runs; the move is listed
    with its bytes where the layouts are known."""
    split = [t for t in ts if isinstance(t, torch.Tensor) and any(c.ent(t))]
    if len(split) < 2:
        return {}
    first = split[0]
    if align is None and all(  # the common case: alike in every way that matters here
            t.ndim == first.ndim and c.ent(t) == c.ent(first) and
            sizes_of(t, c.mesh) == sizes_of(first, c.mesh) is not None and
            (not c.planning or t.shape == first.shape) for t in split[1:]):
        return {}
    if align is None:
        nd = max(t.ndim for t in ts if isinstance(t, torch.Tensor))

        def align(t: torch.Tensor, k: int) -> Hashable:
            return nd - t.ndim + k
    where = [{align(t, k): k for k in range(t.ndim)} for t in split]
    dims: dict[Hashable, tuple] = {}  # matched dim -> axes
    for t in split:
        for k, a in enumerate(c.ent(t)):
            if a:
                dims.setdefault(align(t, k), a)
    if any(c.ent(t)[w[d]] not in (None, a) for t, w in zip(split, where)
           for d, a in dims.items() if d in w):
        return {}  # split two ways: the rule refuses it
    layouts = [layout(c.run, t) for t in split]
    out: dict[int, torch.Tensor] = {}
    if all(lay is not None for lay in layouts):
        keys = [tuple((d, lay.sizes[w[d]] if d in w else None) for d in sorted(dims, key=str))
                for lay, w in zip(layouts, where)]
        if len(set(keys)) > 1:
            _lengths(c, split, layouts, where, dims)
            best, best_cost = None, None
            keep = keep if any(t is keep for t in split) else None
            for j in range(len(split)):  # the target every other operand moves to
                if keep is not None and split[j] is not keep:
                    continue
                cost = sum(_cost(lay, t, w, keys[j]) for lay, t, w in zip(layouts, split, where))
                if best_cost is None or cost < best_cost:
                    best, best_cost = j, cost
            for lay, t, w, key in zip(layouts, split, where, keys):
                if key != keys[best]:
                    k = next(i for i, u in enumerate(ts) if u is t)
                    out[id(t)] = _move(c, t, lay, _target(lay, w, keys[best]), f"operand {k}")
    if c.planning:  # stand-in sizes: take the kept operand's
        r = next((i for i, t in enumerate(split) if id(t) not in out), 0)
        ref, wr = split[r], where[r]
        for t, w in zip(split, where):
            cur = out.get(id(t), t)
            shape = list(cur.shape)
            for d in dims:
                if d in w and d in wr and c.ent(t)[w[d]] and c.ent(ref)[wr[d]]:
                    shape[w[d]] = ref.shape[wr[d]]
            if shape != list(cur.shape):
                m = torch.empty(shape, dtype=cur.dtype, device="meta")
                m.requires_grad_(cur.requires_grad and cur.is_floating_point())
                set_tag(m, c.mesh, c.ent(t), False, sizes_of(cur, c.mesh))
                out[id(t)] = m
    return out


def agreed(c: Any, ts: Sequence[torch.Tensor], **kw: Any) -> Any:
    """``c`` with its tensor arguments (also those in a list) after ``agree``."""
    moved = agree(c, ts, **kw)
    if not moved:
        return c

    def swap(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return moved.get(id(a), a)
        if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            return type(a)(swap(v) for v in a)
        return a
    return type(c)(c.run, c.func, c.name, tuple(swap(a) for a in c.args),
                   {k: swap(v) for k, v in c.kwargs.items()})


def _target(lay: Layout, where: dict, key: tuple) -> Layout:
    sizes = {d: s for d, s in enumerate(lay.sizes) if s is not None}
    for d, s in key:
        if d in where and s is not None and lay.sizes[where[d]] is not None:
            sizes[where[d]] = s
    return Layout(lay.shape, lay.spec, _MeshOfLayout(lay), sizes)


def _cost(lay: Layout, t: torch.Tensor, where: dict, key: tuple) -> int:
    return moved_elements(lay, _target(lay, where, key)) * t.element_size()


def _lengths(c: Any, split: list, layouts: list, where: list, dims: dict) -> None:
    """Operands whose global lengths differ along a split dim do not match (one device
    raises too): a SpecError on every rank alike, before anything moves."""
    for d, a in dims.items():
        n = {lay.shape[w[d]] for lay, t, w in zip(layouts, split, where)
             if d in w and c.ent(t)[w[d]]}
        if len(n) > 1:
            dim = f"dim {d}" if isinstance(d, int) else f"subscript {d!r}"
            c.refuse(f"combines tensors of global sizes {sorted(n)} along {dim}, which is "
                     f"split over {axes_str(a)}: they do not match (as on one device)",
                     "make them the same global size (interpolate with size= the other's "
                     "global size, or pad)")


def _move(c: Any, t: torch.Tensor, src: Layout, dst: Layout, what: str) -> torch.Tensor:
    """``t`` redistributed from ``src`` to ``dst`` (recorded in the plan with its bytes);
    once per forward (a skip added to two branches moves once)."""
    done = c.run.__dict__.setdefault("moves", {})
    key = (id(t), dst)
    if key in done and done[key][0] is t:
        return done[key][1]
    n = moved_elements(src, dst)
    rows = ", ".join(f"dim {d}: {list(src.sizes[d])} -> {list(dst.sizes[d])}"
                     for d in range(src.ndim) if src.sizes[d] != dst.sizes[d])
    c.record("moved", f"{what} {rows} -> spmd.redistribute: {n} elements "
                      f"({n * t.element_size()} bytes) change owner")
    e = c.ent(t)
    if c.planning:
        res = c.call(lambda x: x.detach().clone().requires_grad_(x.requires_grad)
                     if x.is_floating_point() else x.clone(), (t,), {})
    else:
        spec = spec_of(e)
        src_sizes = {d: s for d, s in enumerate(src.sizes) if s is not None}
        dst_sizes = {d: s for d, s in enumerate(dst.sizes) if s is not None}
        res = c.call(lambda x: redistribute(x, c.mesh, spec, spec, src_sizes=src_sizes,
                                            dst_sizes=dst_sizes), (t,), {})
    set_tag(res, c.mesh, e, False, dst.sizes)
    done[key] = (t, res)
    return res


class _MeshOfLayout:
    def __init__(self, lay: Layout):
        self.axis_names, self.shape = lay.axis_names, lay.mesh_shape


def describe(lay: Layout | None) -> str:
    """``[2, 3, 45, 6] P(None, None, 'sp') sp=[30, 15]``."""
    if lay is None:
        return "sizes not known here (learnt at run time)"
    split = ", ".join(f"{'x'.join(lay.dim_axes(d))}={list(s)}" for d, s in enumerate(lay.sizes)
                      if s is not None)
    return f"{list(lay.shape)} {lay.spec!r} {split}".rstrip()
