"""``visualize``: a picture of how a tensor is split over a mesh, as text or a figure.

Like ``jax.debug.visualize_array_sharding``, but for uneven layouts (explicit sizes,
empty shards, which are listed, never dropped) and for the halos ``halo_pad`` adds.
The picture is computed once from the layout (pure arithmetic); ``str`` gives the text,
``plot`` draws it with matplotlib, imported only there.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core._format import shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import coords_of
from ..core.placeholder import Placeholder
from ..transforms.sharded import Sharded
from ._text import render

__all__ = ["visualize", "LayoutPicture", "Block"]


@dataclass(frozen=True)
class Block:
    """One shard as drawn: the ranks holding it and where it lies in the drawn dims.

    ``start``/``stop`` are global indices along each drawn dim; ``halo`` the ``(lo, hi)``
    elements it receives along each drawn dim from inside the domain (the halo clipped at
    the domain edge, where ``halo_pad``'s mode fills it instead).
    """

    ranks: tuple[int, ...]
    label: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    local_shape: tuple[int, ...]  # of its lowest rank, if split dims are not drawn
    halo: tuple[tuple[int, int], ...]

    @property
    def size(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def halo_start(self) -> tuple[int, ...]:
        return tuple(a - lo for a, (lo, _) in zip(self.start, self.halo))

    @property
    def halo_stop(self) -> tuple[int, ...]:
        return tuple(b + hi for b, (_, hi) in zip(self.stop, self.halo))


@dataclass(frozen=True)
class LayoutPicture:
    """What ``visualize`` returns: the blocks to draw, the empty shards, and the text.

    ``str(picture)`` and ``repr(picture)`` are ``picture.text``, so a notebook cell or a
    ``print`` shows the drawing; ``picture.plot()`` draws it with matplotlib.
    """

    title: str
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    blocks: tuple[Block, ...]
    empty: tuple[Block, ...]
    halo_dims: tuple[int, ...]
    text: str

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__

    def plot(self, ax: Any = None, *, cmap: str = "tab20", fontsize: float | None = None) -> Any:
        """Draw the picture on ``ax`` (a new figure if None) and return the Axes.

        One filled rectangle per block (colour per block: replicas share it), labelled
        with its ranks and size; ticks at shard boundaries in global indices; a dashed
        outline per block extended by its halo; empty shards in a note below.
        """
        from ._plot import plot
        return plot(self, ax, cmap=cmap, fontsize=fontsize)


def visualize(x: Layout | Sharded | Placeholder, *, dims: int | Sequence[int] | None = None,
              halo: int | tuple[int, int] | Mapping[int, int | tuple[int, int]] | None = None,
              max_width: int = 80) -> LayoutPicture:
    """Picture which rank holds which block of a tensor, with block sizes and halos.

    Args:
        x: a ``Layout``, a ``Sharded`` (its layout), or a ``Placeholder`` (its layout;
            without one, the whole tensor on its holding ranks).
        dims: the one or two tensor dims to draw (rows, then columns). Default: the split
            dims; with one split dim, it against the last other dim; with none, the last
            two dims. Other dims only appear in the title.
        halo: the halo every shard receives, as ``halo_pad``'s width: an int or ``(lo, hi)``
            for every drawn split dim, or ``{dim: width}``. Shown clipped at the domain
            edge (there the pad mode fills it, nothing is received).
        max_width: the text's width in characters; blocks are proportional to their sizes
            but at least as wide as their labels, which may make the text wider.

    Returns:
        A ``LayoutPicture``: printing it shows the text, ``.plot()`` draws a figure. Each
        block lists its ranks (with mesh coordinates on a 2-d mesh, ``*`` along axes its
        ranks differ on) and its size in the drawn dims; empty shards are listed below.

    Raises:
        TypeError: ``x`` is not a Layout or Placeholder, or an argument has the wrong type.
        SpecError: more than two split dims and no ``dims``; bad ``dims`` or ``halo``.

    Example:
        >>> lay = Layout((6, 8), P("sp"), Mesh(4, "sp"), sizes={0: [3, 2, 1, 0]})
        >>> spmd.visualize(lay, halo=1, max_width=30)
        [6, 8] P('sp') over Mesh(sp=4)
        rows: dim 0 over 'sp' [3, 2, 1, 0]
        cols: dim 1 (not split)
          0                          8
        0 +--------------------------+
          |            r0            |
          |           3x8            |
          |        halo +0/+1        |
        3 +--------------------------+
          |            r1            |
          |           2x8            |
          |        halo +1/+1        |
        5 +--------------------------+
          |            r2            |
          |           1x8            |
          |        halo +1/+0        |
        6 +--------------------------+
        empty shards:
          r3: 0 rows at row 6, halo +1/+0
        halo: elements received before/after along rows, clipped at the domain edge
    """
    shape, dtype, layout, holders = _source(x)
    dims = _pick_dims(shape, layout, dims)
    widths, halo_dims = _halo_widths(halo, dims, shape, layout)
    if not isinstance(max_width, int) or isinstance(max_width, bool) or max_width < 1:
        raise TypeError(f"visualize: max_width must be a positive int, got {max_width!r}")
    blocks, empty = _blocks(shape, layout, holders, dims, widths)
    title = shape_str(shape, dtype)
    if layout is not None:
        mesh = ", ".join(f"{a}={s}" for a, s in zip(layout.axis_names, layout.mesh_shape))
        title += f" {layout.spec!r} over Mesh({mesh})"
    else:
        title += (f" whole on rank {holders[0]}" if len(holders) == 1
                  else f" whole on ranks {list(holders)}")
    text = render(title, *_dim_notes(layout, dims), blocks, empty,
                  tuple(i for i, d in enumerate(dims) if d in halo_dims), max_width)
    return LayoutPicture(title, shape, dims, blocks, empty, halo_dims, text)


# -- what is drawn -----------------------------------------------------------------------

def _source(x: Any) -> tuple[tuple[int, ...], torch.dtype | None, Layout | None, tuple[int, ...]]:
    if isinstance(x, Layout):
        return x.shape, None, x, ()
    if isinstance(x, Placeholder):
        return tuple(x.shape), x.dtype, x.layout, x.holders
    if isinstance(x, Sharded):
        return tuple(x.shape), x.dtype, x.layout, ()
    what = shape_str(x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
    raise TypeError(
        f"visualize: expected a spmd.Layout, Sharded or Placeholder, got {what}; for a tensor, "
        f"pass its layout, e.g. spmd.visualize(Layout(x.shape, P(...), mesh))")


def _pick_dims(shape: tuple[int, ...], layout: Layout | None, dims: Any) -> tuple[int, ...]:
    nd = len(shape)
    if dims is None:
        split = layout.split_dims if layout is not None else ()
        if len(split) > 2:
            raise SpecError(
                f"visualize: {shape_str(shape)} is split along {len(split)} dims "
                f"{list(split)} ({layout.spec!r}) but a picture shows at most two; pass "
                f"dims=(a, b) with the two to draw")
        if len(split) == 1 and nd > 1:
            other = max(d for d in range(nd) if d != split[0])
            return tuple(sorted((split[0], other)))
        return split if split else tuple(range(max(nd - 2, 0), nd))
    seq = (dims,) if isinstance(dims, int) else dims
    if (not isinstance(seq, (tuple, list))
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in seq)):
        raise TypeError(f"visualize: dims must be an int or a sequence of ints, got {dims!r}")
    if not 1 <= len(seq) <= 2:
        raise SpecError(f"visualize: dims must name one or two dims, got {list(seq)}")
    for d in seq:
        if not -nd <= d < nd:
            raise SpecError(f"visualize: dim {d} is out of range for {shape_str(shape)}")
    out = tuple(d % nd for d in seq)
    if len(set(out)) != len(out):
        raise SpecError(f"visualize: dims {list(seq)} name the same dim twice")
    return out


def _halo_widths(halo: Any, dims: tuple[int, ...], shape: tuple[int, ...],
                 layout: Layout | None) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """``(lo, hi)`` per drawn dim, and the dims given a halo (those the text annotates)."""
    if halo is None:
        return ((0, 0),) * len(dims), ()
    if isinstance(halo, Mapping):
        given = {}
        for d, w in halo.items():
            if not isinstance(d, int) or not -len(shape) <= d < len(shape):
                raise SpecError(f"visualize: halo names dim {d!r}, which "
                                f"{shape_str(shape)} does not have")
            if d % len(shape) not in dims:
                raise SpecError(f"visualize: halo names dim {d}, which is not drawn (dims="
                                f"{dims}); pass dims=... to draw it")
            given[d % len(shape)] = _pair(w)
        return tuple(given.get(d, (0, 0)) for d in dims), tuple(d for d in dims if d in given)
    w = _pair(halo)
    split = layout.split_dims if layout is not None else ()
    return tuple(w if d in split else (0, 0) for d in dims), tuple(d for d in dims if d in split)


def _pair(w: Any) -> tuple[int, int]:
    def ok(v):
        return isinstance(v, int) and not isinstance(v, bool)
    if ok(w):
        lo = hi = w
    elif isinstance(w, (tuple, list)) and len(w) == 2 and all(ok(v) for v in w):
        lo, hi = w
    else:
        raise TypeError(f"visualize: a halo width must be an int or a pair (lo, hi) of "
                        f"ints, got {w!r}")
    if lo < 0 or hi < 0:
        raise SpecError(f"visualize: halo width ({lo}, {hi}) must be non-negative")
    return lo, hi


def _blocks(shape, layout, holders, dims, widths) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
    """The drawn blocks (shards merged by where they lie in the drawn dims, so a split dim
    that is not drawn adds ranks, not blocks) and the empty shards, each in rank order."""
    if layout is None:
        shards = {(): (list(holders), (0,) * len(shape), shape)}
    else:
        shards = {}
        for r in range(math.prod(layout.mesh_shape)):
            key = layout.shard_key(r)
            if key in shards:
                shards[key][0].append(r)
            else:
                shards[key] = ([r], layout.offsets(r), layout.local_shape(r))
    split = layout.split_dims if layout is not None else ()
    drawn: dict[tuple, tuple] = {}
    empty = []
    for ranks, off, loc in shards.values():
        start = tuple(off[d] for d in dims)
        stop = tuple(off[d] + loc[d] for d in dims)
        if any(loc[d] == 0 for d in split):
            empty.append(_block(ranks, layout, start, stop, loc, shape, dims, widths))
        elif (start, stop) in drawn:
            drawn[start, stop][0].extend(ranks)
        else:
            drawn[start, stop] = (list(ranks), loc)
    blocks = [_block(sorted(ranks), layout, start, stop, loc, shape, dims, widths)
              for (start, stop), (ranks, loc) in drawn.items()]
    return tuple(sorted(blocks, key=lambda b: b.ranks)), tuple(empty)


def _block(ranks, layout, start, stop, loc, shape, dims, widths) -> Block:
    halo = tuple((min(lo, a), min(hi, shape[d] - b))
                 for d, a, b, (lo, hi) in zip(dims, start, stop, widths))
    return Block(tuple(ranks), _label(ranks, layout), start, stop, tuple(loc), halo)


def _label(ranks: Sequence[int], layout: Layout | None) -> str:
    """``r1 (x=0,y=1)``; coordinates only on meshes of two or more axes, ``*`` where the
    ranks differ (the axes the block is replicated over, or split dims not drawn)."""
    out = _ranks_str(ranks)
    if layout is None or len(layout.mesh_shape) < 2:
        return out
    cs = [coords_of(layout.mesh_shape, r) for r in ranks]
    parts = [f"{a}={cs[0][i] if len({c[i] for c in cs}) == 1 else '*'}"
             for i, a in enumerate(layout.axis_names)]
    if all(p.endswith("*") for p in parts):
        return out
    return f"{out} ({','.join(parts)})"


def _ranks_str(ranks: Sequence[int]) -> str:
    """``r0,r4`` or, for runs of three or more, ``r0-r7``."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"r{ranks[i]}-r{ranks[j]}")
        else:
            out.extend(f"r{r}" for r in ranks[i:j + 1])
        i = j + 1
    return ",".join(out)


def _dim_notes(layout: Layout | None, dims: tuple[int, ...]) -> tuple[tuple[str, ...], str]:
    """What splits each drawn dim, and a line on split dims that are not drawn."""
    out = []
    for d in dims:
        axes = layout.dim_axes(d) if layout is not None else ()
        over = ""
        if axes:
            a = repr(axes[0]) if len(axes) == 1 else repr(axes)
            over = f" over {a} {list(layout.sizes[d])}"
        out.append(f"dim {d}{over or ' (not split)'}")
    hidden = [d for d in (layout.split_dims if layout is not None else ()) if d not in dims]
    extra = ""
    if hidden:
        extra = ("not drawn: " + ", ".join(f"dim {d} {list(layout.sizes[d])}" for d in hidden)
                 + "; each block lists every rank holding a part of it")
    return tuple(out), extra
