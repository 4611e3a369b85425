"""Adaptive pooling over inputs split along their spatial dims:
``adaptive_max_pool1d/2d/3d`` and ``adaptive_avg_pool1d/2d/3d``.

Output element ``i`` of a dim of global length ``L`` pooled to ``M`` reads ``[floor(i*L/M),
ceil((i+1)*L/M))``. The output is split balanced (as the input where ``M == L``: then
nothing moves), each rank fetches ``[floor(o0*L/M), ceil(o1*L/M))`` for its rows ``[o0,
o1)`` (see ``pool.py`` for the fetch), and pools it dim by dim from the innermost: the
windows of a dim gathered into ``(rows, widest window)`` with a fill (-inf or 0) for the
shorter ones, then reduced. Separable is exact: an average of averages weighted by the
window sizes, and for max, torch's row-major pick (the first maximum, the last NaN) is
the same pick made dim by dim.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401 - the doctests compare with F

from ..core.layout import Layout
from ..core.mesh import Mesh
from ._window import (
    check_ndim,
    input_layout,
    member_ranges,
    out_layout,
    out_sizes,
    windowed,
    with_layout,
)
from .pool import _NEG_INF, _check_dtype, _check_nonempty, _empty, _ravel, _window, _zeros

__all__ = ["adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
           "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"]


# -- geometry: pure arithmetic on the global layout, the same on every rank --------------------

def _adaptive_size(output_size: Any, n: int, layout_or_shape: Sequence[int],
                   what: str) -> tuple[int, ...]:
    if isinstance(output_size, int) and not isinstance(output_size, bool):
        out = (output_size,) * n
    elif isinstance(output_size, (tuple, list)) and len(output_size) == n and all(
            e is None or (isinstance(e, int) and not isinstance(e, bool)) for e in output_size):
        if n == 1 and output_size[0] is None:
            raise TypeError(f"{what}: output_size must be an int or a tuple of one int, got "
                            f"{output_size!r}")
        out = tuple(layout_or_shape[2 + i] if e is None else e for i, e in enumerate(output_size))
    else:
        raise RuntimeError(f"{what}: output_size must be an int or {n} ints (None keeps the "
                           f"input size), got {output_size!r}")
    if any(e < 0 for e in out):
        raise RuntimeError(f"{what}: elements of output_size must be greater than or equal "
                           f"to 0, got {output_size!r}")
    return out


@lru_cache(maxsize=256)
def _adaptive_plan(layout: Layout, out_size: tuple[int, ...], channels: bool, what: str):
    """(output layout, {dim: input range of every member along dim}); output row ``i``
    of a dim of length ``L`` pooled to ``M`` reads ``[floor(i*L/M), ceil((i+1)*L/M))``."""
    _check_nonempty(layout, what, channels)
    shape, sizes, ranges = list(layout.shape), {}, {}
    for i, M in enumerate(out_size):
        dim, L = 2 + i, layout.shape[2 + i]
        shape[dim] = M
        sizes[dim] = out_sizes(layout, dim, M, keep=True)  # M == L: nothing moves
        window = lambda o0, o1, L=L, M=M: (o0 * L // M, -(-o1 * L // M))
        ranges[dim] = member_ranges(sizes[dim] or (M,), window)
    return out_layout(layout, shape, sizes), ranges


# -- the local part: separable, innermost dim first ------------------------------------------------

def _pick(g: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's pick along ``dim`` (keepdim): the last NaN if there is one, else the first
    maximum. Applied dim by dim from the innermost, it is torch's row-major pick."""
    arg = g.argmax(dim, keepdim=True)
    nan = g.isnan()
    last_nan = (g.shape[dim] - 1) - nan.flip(dim).to(torch.uint8).argmax(dim, keepdim=True)
    return torch.where(nan.any(dim, keepdim=True), last_nan, arg)


def _adaptive(n: int, x: torch.Tensor, output_size: Any, is_max: bool, return_indices: bool,
              mesh: Mesh, spec: Any):
    what = f"adaptive_{'max' if is_max else 'avg'}_pool{n}d"
    check_ndim(x, n, what)
    _check_dtype(x, what)
    rc, lay = input_layout(x, mesh, spec, what)
    out_size = _adaptive_size(output_size, n, lay.shape, what)
    out_lay, ranges = _adaptive_plan(lay, out_size, is_max, what)
    shape = out_lay.local_shape(rc.rank)
    if 0 in out_lay.shape:  # nothing to compute anywhere: no rank fetches
        return _empty(x, shape, return_indices)
    fetches, starts = _window(x, rc, lay, ranges, _NEG_INF if is_max else 0.0, what)
    if 0 in shape:
        return windowed(x, fetches, lambda xf: _zeros(xf.new_zeros(shape), return_indices))
    offsets = out_lay.offsets(rc.rank)

    def pool(xf: torch.Tensor):
        v, idx = xf, None
        if return_indices:  # the global flat index of every element of the window
            grids = [(a + torch.arange(m, device=x.device)) for a, m in zip(starts, xf.shape[2:])]
            idx = _ravel(torch.meshgrid(*grids, indexing="ij"), lay.shape[2:]).expand(xf.shape)
        for i in reversed(range(n)):  # separable: innermost dim first
            v, idx = _pool_dim(v, idx, 2 + i, lay.shape[2 + i], out_size[i], starts[i],
                               offsets[2 + i], shape[2 + i], is_max)
        return (v, idx) if return_indices else v
    return windowed(x, fetches, pool)


def _pool_dim(v: torch.Tensor, idx: torch.Tensor | None, dim: int, L: int, M: int, a: int,
              o0: int, m: int, is_max: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pool ``dim`` (global length ``L`` to ``M``; the window starts at ``a``) for this
    rank's output rows ``[o0, o0 + m)``: gather the windows into (rows, widest window)
    with a fill for the shorter ones, then reduce."""
    n_after = v.ndim - 1 - dim
    lo = [o * L // M - a for o in range(o0, o0 + m)]
    hi = [-(-(o + 1) * L // M) - a for o in range(o0, o0 + m)]
    K, length = max(h - b for b, h in zip(lo, hi)), v.shape[dim]
    pos = [b + j if b + j < h else length for b, h in zip(lo, hi) for j in range(K)]
    if any(h - b < K for b, h in zip(lo, hi)):  # ragged windows: short ones read a fill slot
        v = torch.cat([v, v.new_full((*v.shape[:dim], 1, *v.shape[dim + 1:]),
                                     _NEG_INF if is_max else 0.0)], dim)
        if idx is not None:
            idx = torch.cat([idx, idx.new_zeros((*idx.shape[:dim], 1, *idx.shape[dim + 1:]))], dim)
    pos = torch.tensor(pos, device=v.device)
    g = v.index_select(dim, pos).unflatten(dim, (len(lo), K))
    if not is_max:
        count = torch.tensor([h - b for b, h in zip(lo, hi)], dtype=v.dtype, device=v.device)
        return g.sum(dim + 1) / count.view(-1, *[1] * n_after), idx
    arg = _pick(g, dim + 1)
    v = g.gather(dim + 1, arg).squeeze(dim + 1)
    if idx is not None:
        gi = idx.index_select(dim, pos).unflatten(dim, (len(lo), K))
        idx = gi.gather(dim + 1, arg).squeeze(dim + 1)
    return v, idx


def _adaptive_layout(n: int, is_max: bool):
    def output_layout(layout: Layout, output_size: Any, return_indices: bool = False) -> Layout:
        what = f"adaptive_{'max' if is_max else 'avg'}_pool{n}d"
        return _adaptive_plan(layout, _adaptive_size(output_size, n, layout.shape, what),
                              is_max, what)[0]
    output_layout.__doc__ = (f"The output layout of ``spmd.ops.adaptive_"
                             f"{'max' if is_max else 'avg'}_pool{n}d`` for an input of "
                             f"``layout``, without running it.")
    return output_layout


_ADAPTIVE_DOC = """``F.adaptive_{kind}_pool{n}d`` on this rank's shard of an input split
    along its spatial dims (and optionally N and C).

    Output element ``i`` of a dim of global length ``L`` pooled to ``M`` reads
    ``[floor(i*L/M), ceil((i+1)*L/M))``, as torch's: the output is split balanced (as
    the input where ``M == L``, and then nothing moves) and each rank fetches the input
    its windows read.

    Args:
        x: this rank's shard, ``(N, C, {dims})``, floating point.
        output_size: as ``F.adaptive_{kind}_pool{n}d``: an int or {n} ints{none}.{ri}
        mesh: the mesh the code runs on.
        spec: ``x``'s spec (a ``P``; the ranks exchange their sizes) or its ``Layout``.

    Returns:
        This rank's shard of the global output{ri_ret}, whose layout
        ``adaptive_{kind}_pool{n}d.output_layout(layout, output_size)`` gives.

    Raises:
        RuntimeError: what torch refuses on one device (a negative output size, an
            empty spatial{ch} dim), on every rank before data moves.
        SpecError: a shard that does not fit the spec or layout.
        NotImplementedError: an integer input.

    Backward:
        {backward}
        Then the halo part travels back to its owner (the transpose of the fetch).

    Ranks without data:
        A rank with no output rows returns an empty shard; it still sends the rows
        others need, and receives their gradients in backward.
"""


def _adaptive_op(n: int, is_max: bool, example: str):
    kind = "max" if is_max else "avg"
    if is_max:
        def op(x: torch.Tensor, output_size: Any, return_indices: bool = False, *,
               mesh: Mesh, spec: Any):
            return _adaptive(n, x, output_size, True, return_indices, mesh, spec)
    else:
        def op(x: torch.Tensor, output_size: Any, *, mesh: Mesh, spec: Any) -> torch.Tensor:
            return _adaptive(n, x, output_size, False, False, mesh, spec)
    op.__name__ = op.__qualname__ = f"adaptive_{kind}_pool{n}d"
    op.__doc__ = _ADAPTIVE_DOC.format(
        kind=kind, n=n, dims=", ".join("DHW"[3 - n:]),
        none="\n            (None keeps the input size)" if n > 1 else "",
        ri=("\n        return_indices: also return global indices: the flat index into the "
            "global\n            spatial dims that torch returns.") if is_max else "",
        ri_ret=" (and of the indices)" if is_max else "",
        ch="" if not is_max else " or channel",
        backward=("The gradient goes to each window's maximum (torch's pick: the first\n"
                  "        maximum in row-major order, the last NaN).") if is_max else
                 "Each output's gradient is spread evenly over its window.") + example
    return with_layout(_adaptive_layout(n, is_max))(op)


adaptive_max_pool1d = _adaptive_op(1, True, """
    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(2, 3, 10)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.adaptive_max_pool1d(x, 4, True, mesh=mesh, spec=s)
        >>> y, i = spmd.shard_map(f, mesh, s, (s, s))(x)
        >>> ry, ri = F.adaptive_max_pool1d(x, 4, return_indices=True)
        >>> torch.equal(y, ry), torch.equal(i, ri)
        (True, True)
""")
adaptive_max_pool2d = _adaptive_op(2, True, """
    Example:
        >>> mesh = spmd.Mesh((2, 2), ("x", "y"))
        >>> x = torch.randn(1, 2, 9, 7)
        >>> s = P(None, None, "x", "y")
        >>> f = lambda x: spmd.ops.adaptive_max_pool2d(x, (4, None), mesh=mesh, spec=s)
        >>> torch.equal(spmd.shard_map(f, mesh, s, s)(x), F.adaptive_max_pool2d(x, (4, None)))
        True
""")
adaptive_max_pool3d = _adaptive_op(3, True, """
    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(1, 2, 8, 5, 4)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.adaptive_max_pool3d(x, (3, 2, 3), mesh=mesh, spec=s)
        >>> torch.equal(spmd.shard_map(f, mesh, s, s)(x), F.adaptive_max_pool3d(x, (3, 2, 3)))
        True
""")
adaptive_avg_pool1d = _adaptive_op(1, False, """
    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(2, 3, 10)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.adaptive_avg_pool1d(x, 4, mesh=mesh, spec=s)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), F.adaptive_avg_pool1d(x, 4), atol=1e-6)
        True
""")
adaptive_avg_pool2d = _adaptive_op(2, False, """
    Example:
        >>> mesh = spmd.Mesh((2, 2), ("x", "y"))
        >>> x = torch.randn(1, 2, 9, 7)
        >>> s = P(None, None, "x", "y")
        >>> f = lambda x: spmd.ops.adaptive_avg_pool2d(x, (4, 3), mesh=mesh, spec=s)
        >>> ref = F.adaptive_avg_pool2d(x, (4, 3))
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-6)
        True
""")
adaptive_avg_pool3d = _adaptive_op(3, False, """
    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(1, 2, 8, 5, 4)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.adaptive_avg_pool3d(x, 1, mesh=mesh, spec=s)
        >>> ref = F.adaptive_avg_pool3d(x, 1)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-6)
        True
""")
