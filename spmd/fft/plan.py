"""The plan of a distributed transform: which dims each rank transforms locally, in which
order, and the transposes (one all_to_all each) that make the next dims whole.

Pure arithmetic on layouts, cached: every rank computes the same plan from the same
global layout, so a bad argument raises on every rank before any data moves.

The rules (``forward``), for the transformed dims ``dims`` (the halved dim of a real
transform is ``dims[-1]``):

1. Transform every transformed dim that is whole on each rank, in one local torch.fft
   call (an ``rfft`` needs its halved dim among them: it runs first; an ``irfft`` runs it
   last).
2. Otherwise make the last split dim still to transform whole: move its mesh axes (those
   of more than one rank) to another dim, in one all_to_all over those axes. The dim that
   takes them is the one transformed last (whose work is done), else a whole dim still to
   transform, else the other split transformed dim (split over both axes' product for a
   while), else the largest dim not transformed (a 1-d transform: moved back at the end).

So a slab rfft2 with H split does rfft(W), one transpose (W' split, H whole), fft(H); a
pencil rfftn over three dims with two split does two transposes. The default output is
the layout the last transpose leaves (no transpose back); a requested one (``want``) is
reached by one more all_to_all where it differs.

The inverse (``inverse``) goes back the way it came. For each spatial layout it could
return to (the requested one, or every placement of the mesh axes over the transformed
dims), it takes the forward plan from there; where that plan ends in the layout given
(or one all_to_all away from it), it runs the plan backwards: each stage inverted, each
transpose the other way, back to the sizes the forward started from. The cheapest wins
(then: no extra all_to_all first, then the layout splitting the earlier dims); the rules
above with the halved dim last (``irfft``) where they are cheaper still.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from ..core.errors import SpecError
from ..core.layout import Layout, balanced_sizes
from ..core.spec import P

__all__ = ["Plan", "Stage", "Crop", "Transpose", "Reshard", "forward", "inverse", "whole",
           "split_dims", "cut"]

FORWARD = {"fft": "fft", "rfft": "rfft", "ifft": "fft", "irfft": "rfft"}
MIRROR = {"fft": "ifft", "rfft": "irfft"}


class _MeshShape(NamedTuple):
    """What ``Layout`` reads of a mesh: axis names and sizes."""
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Stage:
    """torch.fft's ``kind`` (``fft``, ``ifft``, ``rfft`` (n-d) or ``irfft``) over ``dims``,
    each whole on every rank, with signal sizes ``s``; ``layout``: after it."""
    kind: str
    dims: tuple[int, ...]
    s: tuple[int, ...]
    layout: Layout


@dataclass(frozen=True)
class Crop:
    """Keep the first ``layout.shape[d]`` elements of every dim (the ``s`` of a transform
    shorter than the input), before anything moves: fewer bytes to transpose."""
    src: Layout
    layout: Layout


@dataclass(frozen=True)
class Transpose:
    """One all_to_all over ``axes`` from ``src`` to ``layout`` (the two differ only in where
    those axes cut); ``a`` gave them up and ``b`` took them, where the planner moved them."""
    src: Layout
    layout: Layout
    axes: tuple[str, ...]
    a: int | None = None
    b: int | None = None


@dataclass(frozen=True)
class Reshard:
    """``spmd.redistribute`` to the requested output layout, where it uses other mesh axes
    than the plan's (replicates or splits over an axis more)."""
    src: Layout
    layout: Layout


@dataclass(frozen=True)
class Plan:
    """The steps from ``src`` to ``out``; ``lifted``: a 1-d tensor runs as ``[1, n]``
    (the leading unit dim takes the split while the dim is transformed)."""
    src: Layout
    out: Layout
    steps: tuple[Any, ...]
    lifted: bool = False

    @property
    def transposes(self) -> int:
        """The all_to_alls it runs (on the ranks whose group has more than one member)."""
        return _count(self.steps)


# -- layout arithmetic ---------------------------------------------------------------------

def _mesh(lay: Layout) -> _MeshShape:
    return _MeshShape(lay.axis_names, lay.mesh_shape)


def whole(lay: Layout, d: int) -> bool:
    """Whether every rank holds all of dim ``d`` (unsplit, or split over axes of size 1)."""
    s = lay.sizes[d]
    return s is None or len(s) == 1


def split_dims(lay: Layout, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of ``dims`` that are cut into more than one shard."""
    return tuple(d for d in dims if not whole(lay, d))


def cut(lay: Layout) -> tuple[tuple[str, ...], ...]:
    """Where the mesh axes cut, dim by dim (sizes and lengths aside)."""
    return tuple(lay.dim_axes(d) for d in range(lay.ndim))


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _layout(lay: Layout, shape, entries: list, sizes: dict[int, tuple[int, ...]]) -> Layout:
    last = max([i + 1 for i, e in enumerate(entries) if e], default=0)
    spec = P(*[_entry(e) for e in entries[:last]])
    return Layout(shape, spec, _mesh(lay), {d: s for d, s in sizes.items() if entries[d]} or None)


def _entries(lay: Layout) -> list[tuple[str, ...]]:
    return [lay.dim_axes(d) for d in range(lay.ndim)]


def _sizes(lay: Layout) -> dict[int, tuple[int, ...]]:
    return {d: s for d, s in enumerate(lay.sizes) if s is not None}


def _starts(sizes) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def resized(lay: Layout, lengths: dict[int, int]) -> Layout:
    """``lay`` with dims set to new lengths: a whole dim just changes length; a split one
    is cropped (each shard keeps its part of the first ``n`` elements)."""
    shape, sizes = list(lay.shape), _sizes(lay)
    for d, n in lengths.items():
        shape[d] = n
        if d in sizes and len(sizes[d]) == 1:
            sizes[d] = (n,)
        elif d in sizes:
            if n > lay.shape[d]:
                raise AssertionError("a split dim is only ever cropped")
            sizes[d] = tuple(max(0, min(o + k, n) - o) for o, k in zip(_starts(sizes[d]),
                                                                       sizes[d]))
    return _layout(lay, shape, _entries(lay), sizes)


def move(lay: Layout, a: int, b: int, axes: tuple[str, ...],
         b_sizes: tuple[int, ...] | None = None) -> Layout:
    """``lay`` with the mesh ``axes`` (the minor end of dim ``a``'s entry) moved to the minor
    end of dim ``b``'s: dim ``a`` merges their shards, each shard of ``b`` is cut into
    ``|axes|`` parts, balanced or ``b_sizes`` (ignored where they do not fit)."""
    entries, sizes = _entries(lay), _sizes(lay)
    ea, eb = entries[a], entries[b]
    k = len(axes)
    if ea[len(ea) - k:] != axes:
        raise AssertionError(f"axes {axes} are not the minor end of dim {a}'s {ea}")
    n = lay.axis_size(axes)
    entries[a], entries[b] = ea[:len(ea) - k], eb + axes
    if entries[a]:
        sizes[a] = tuple(sum(sizes[a][i * n:(i + 1) * n]) for i in range(len(sizes[a]) // n))
    else:
        sizes.pop(a, None)
    outer = sizes.get(b, (lay.shape[b],))
    fits = (b_sizes is not None and len(b_sizes) == len(outer) * n
            and all(sum(b_sizes[i * n:(i + 1) * n]) == m for i, m in enumerate(outer)))
    sizes[b] = tuple(b_sizes) if fits else tuple(v for m in outer for v in balanced_sizes(m, n))
    return _layout(lay, lay.shape, entries, sizes)


def _want_sizes(want: Layout | None, lay: Layout, b: int, axes: tuple[str, ...]):
    """The requested output's sizes for dim ``b`` once it takes ``axes``, where it splits
    ``b`` that way and ``b`` already has its output length."""
    if want is None or want.shape[b] != lay.shape[b]:
        return None
    if want.dim_axes(b) != lay.dim_axes(b) + axes:
        return None
    return want.sizes[b]


def transposable(src: Layout, dst: Layout) -> tuple[str, ...] | None:
    """The axes one all_to_all runs over to go from ``src`` to ``dst`` (same shape), where
    both use the same mesh axes: those of the dims cut differently. None otherwise."""
    if set(src.spec.axes) != set(dst.spec.axes):
        return None
    moved = set()
    for d in range(src.ndim):
        if src.dim_axes(d) != dst.dim_axes(d) or src.sizes[d] != dst.sizes[d]:
            moved |= set(src.dim_axes(d)) | set(dst.dim_axes(d))
    return tuple(a for a in src.axis_names if a in moved)


def _transpose_to(lay: Layout, want: Layout) -> list:
    """The step(s) from ``lay`` to ``want`` (same shape): none, a transpose, or a reshard."""
    if lay == want:
        return []
    axes = transposable(lay, want)
    if axes is not None and lay.axis_size(axes) > 1:
        return [Transpose(lay, want, axes)]
    if axes is not None:  # only axes of size 1 differ: nothing moves
        return [Transpose(lay, want, ())]
    return [Reshard(lay, want)]


# -- the forward rules ------------------------------------------------------------------------

def _stage_kind(kind: str, dims: tuple[int, ...], last: int) -> str:
    if kind in ("rfft", "irfft") and last not in dims:
        return "fft" if kind == "rfft" else "ifft"
    return kind


def _target(lay: Layout, a: int, dims: tuple[int, ...], pending: list[int],
            done: list[int]) -> int | None:
    """The dim that takes dim ``a``'s axes (the rules in the module docstring)."""
    for d in reversed(done):
        if d != a and whole(lay, d):
            return d
    for d in reversed(dims):
        if d != a and d in pending and whole(lay, d):
            return d
    for d in reversed(dims):
        if d != a:
            return d
    rest = [d for d in range(lay.ndim) if d not in dims]
    if rest:
        return max(rest, key=lambda d: (lay.shape[d], d))
    return None


def _moving(lay: Layout, a: int) -> tuple[str, ...]:
    """The axes that leave dim ``a`` to make it whole: the shortest minor end of its entry
    holding every axis of more than one rank (axes of size 1 may stay: they cut nothing)."""
    axes = lay.dim_axes(a)
    big = [i for i, ax in enumerate(axes) if lay.axis_size((ax,)) > 1]
    return axes[big[0]:] if big else ()


def _greedy(kind: str, lay: Layout, dims: tuple[int, ...], s: tuple[int, ...],
            want: Layout | None) -> tuple[list, Layout]:
    """Steps for ``kind`` from ``lay``: transform what is whole, transpose, repeat."""
    steps: list = []
    last = dims[-1]
    length = dict(zip(dims, s))
    pending, done, parked = list(dims), [], []
    while pending:
        ready = [d for d in pending if whole(lay, d)]
        if kind == "rfft" and last in pending and last not in ready:
            ready = []
        if kind == "irfft" and not all(whole(lay, d) for d in pending):
            ready = [d for d in ready if d != last]  # the c2r runs last, with all the rest
        if ready:
            order = tuple(sorted(ready, key=lambda d: (d == last, dims.index(d))))
            sk = _stage_kind(kind, order, last)
            out = {d: length[d] for d in order}
            if sk == "rfft":
                out[last] = length[last] // 2 + 1
            lay = resized(lay, out)
            steps.append(Stage(sk, order, tuple(length[d] for d in order), lay))
            pending = [d for d in pending if d not in ready]
            done += order
            continue
        split = [d for d in dims if d in pending and not whole(lay, d)]
        if kind == "rfft" and last in pending:
            a = last
        elif kind == "irfft":
            a = ([d for d in split if d != last] or [last])[-1]
        else:
            a = split[-1]
        b = _target(lay, a, dims, pending, done)
        if b is None:
            raise AssertionError("a 1-d tensor is lifted before planning")
        axes = _moving(lay, a)
        new = move(lay, a, b, axes, _want_sizes(want, lay, b, axes))
        steps.append(Transpose(lay, new, axes, a, b))
        if b not in dims:
            parked.append((a, b, axes))
        lay = new
    for a, b, axes in reversed(parked):  # a 1-d transform: the split goes back to its dim
        new = move(lay, b, a, axes, _want_sizes(want, lay, a, axes))
        steps.append(Transpose(lay, new, axes, b, a))
        lay = new
    return steps, lay


def _lift(lay: Layout) -> Layout:
    return Layout((1,) + lay.shape, P(None, *lay.spec), _mesh(lay),
                  {d + 1: s for d, s in _sizes(lay).items()} or None)


def _drop(lay: Layout) -> Layout:
    return Layout(lay.shape[1:], P(*lay.spec[1:]), _mesh(lay),
                  {d - 1: s for d, s in _sizes(lay).items() if d} or None)


def _lifted(fn, kind, lay, dims, s, want) -> Plan | None:
    """A 1-d tensor split along its one transformed dim plans as ``[1, n]``."""
    if lay.ndim != 1 or whole(lay, 0):
        return None
    p = fn(kind, _lift(lay), (1,), s, None if want is None else _lift(want))
    return Plan(lay, _drop(p.out), p.steps, lifted=True)


@lru_cache(maxsize=512)
def forward(kind: str, lay: Layout, dims: tuple[int, ...], s: tuple[int, ...],
            want: Layout | None = None) -> Plan:
    """The plan of a forward transform (``fft`` or ``rfft``, n-d) of ``lay`` over ``dims``
    with signal sizes ``s`` (one per dim, resolved), ending in ``want`` if given."""
    lifted = _lifted(forward, kind, lay, dims, s, want)
    if lifted is not None:
        return lifted
    steps: list = []
    crop = {d: n for d, n in zip(dims, s) if n < lay.shape[d]}
    if crop:
        new = resized(lay, crop)
        steps.append(Crop(lay, new))
        lay0 = new
    else:
        lay0 = lay
    more, out = _greedy(kind, lay0, dims, s, want)
    steps += more
    if want is not None:
        steps += _transpose_to(out, want)
        out = want
    return Plan(lay, out, tuple(steps))


# -- the inverse: the forward plan, backwards ------------------------------------------------------

def _candidates(lay: Layout, dims: tuple[int, ...], shape: tuple[int, ...]):
    """Spatial layouts of ``shape`` that place the axes on the transformed dims anywhere
    among them (the others stay where they are): the first is ``lay``'s own cut."""
    big = [a for d in dims for a in lay.dim_axes(d) if lay.axis_size((a,)) > 1]
    entries = _entries(lay)
    sizes = {d: v for d, v in _sizes(lay).items() if d not in dims}
    seen = set()
    own = [dims.index(d) for d in dims for a in lay.dim_axes(d) if a in big]
    for pick in itertools.chain([tuple(own)], itertools.product(range(len(dims)),
                                                                repeat=len(big))):
        if pick in seen:
            continue
        seen.add(pick)
        es = list(entries)
        for d in dims:  # axes of size 1 stay
            es[d] = tuple(a for a in entries[d] if a not in big)
        for a, i in zip(big, pick):
            es[dims[i]] = es[dims[i]] + (a,)
        yield _layout(lay, shape, es, sizes)


def _mirror(fwd: Plan, lay: Layout) -> tuple[list, Layout] | None:
    """``fwd`` run backwards from ``lay`` (cut as ``fwd.out``): each stage inverted with
    the sizes it started from, each transpose the other way, back to ``fwd.src``'s sizes."""
    steps = []
    try:
        for st in reversed(fwd.steps):
            if isinstance(st, Stage):
                if split_dims(lay, st.dims):
                    return None
                lay = resized(lay, dict(zip(st.dims, st.s)))
                steps.append(Stage(MIRROR[st.kind], st.dims, st.s, lay))
            elif isinstance(st, Transpose) and st.a is not None:
                new = move(lay, st.b, st.a, st.axes, st.src.sizes[st.a])
                steps.append(Transpose(lay, new, st.axes, st.b, st.a))
                lay = new
            else:
                return None
    except (AssertionError, SpecError):
        return None
    return steps, lay


@lru_cache(maxsize=512)
def inverse(kind: str, lay: Layout, dims: tuple[int, ...], s: tuple[int, ...],
            want: Layout | None = None) -> Plan:
    """The plan of an inverse transform (``ifft`` or ``irfft``, n-d) of ``lay`` over
    ``dims`` to output lengths ``s``: the forward plan that ends in ``lay``'s cut, run
    backwards (see the module docstring), ending in ``want`` if given."""
    lifted = _lifted(inverse, kind, lay, dims, s, want)
    if lifted is not None:
        return lifted
    steps: list = []
    need = {d: n for d, n in zip(dims, s)}
    if kind == "irfft":
        need[dims[-1]] = s[-1] // 2 + 1
    crop = {d: n for d, n in need.items() if n < lay.shape[d]}
    lay0 = resized(lay, crop) if crop else lay
    if crop:
        steps.append(Crop(lay, lay0))
    shape = list(lay.shape)
    for d, n in zip(dims, s):
        shape[d] = n
    shape = tuple(shape)
    fkind = FORWARD[kind]
    best: tuple[tuple[int, int], list, Layout] | None = None  # fewest transposes, then
    for cand in [want] if want is not None else _candidates(lay0, dims, shape):  # no pre
        if len(split_dims(cand, dims)) > 2:
            continue
        fwd = forward(fkind, cand, dims, tuple(cand.shape[d] for d in dims))
        # from a layout the forward plan does not end in, transpose there first
        pre = [] if cut(fwd.out) == cut(lay0) else _transpose_to(lay0, fwd.out) if (
            fwd.out.shape == lay0.shape) else None
        if pre is None or any(isinstance(p, Reshard) for p in pre):
            continue
        if best is not None and (fwd.transposes + len(pre), len(pre)) >= best[0]:
            continue
        got = _mirror(fwd, pre[-1].layout if pre else lay0)
        if got is not None:
            more, out = _ending(pre + got[0], got[1], want)
            if best is None or (_count(more), len(pre)) < best[0]:
                best = ((_count(more), len(pre)), more, out)
    more, out = _ending(*_greedy(kind, lay0, dims, s, want), want)
    if best is not None and best[0][0] <= _count(more):
        more, out = best[1], best[2]
    return Plan(lay, out, tuple(steps + more))


def _ending(steps: list, out: Layout, want: Layout | None) -> tuple[list, Layout]:
    """``steps`` and the step to ``want`` after them, if any."""
    if want is None:
        return steps, out
    return steps + _transpose_to(out, want), want


def _count(steps) -> int:
    return sum(isinstance(p, Reshard) or (isinstance(p, Transpose) and bool(p.axes))
               for p in steps)
