"""Pooling over inputs split along their spatial dims: ``max_pool1d/2d/3d`` and
``avg_pool1d/2d/3d`` (the adaptive pools, which share the fetch, are in
``adaptive_pool.py``).

As for the convolutions, the output is partitioned first (as the input for a stride-1
length-preserving pool, balanced otherwise) and each rank fetches exactly the input rows
its windows read: ``[s*o0 - p, s*(o1-1) + d*(k-1) - p + 1)`` for output rows ``[o0, o1)``.
Positions outside the global input hold -inf (max) or 0 (avg), so the local pool runs
without padding on the fetched window and gives exactly this rank's outputs; averages are
then divided by torch's divisor, computed per output row from the global geometry.
Pooling is per channel: the batch and channel dims may be split too, and nothing moves
along them.

``return_indices=True`` gives global indices: what the single-device pool returns, the
flat index into the global spatial dims.

Memory: a max pool keeps the shard and the halo rows that arrived, not the padded window
nor the indices; its backward rebuilds the window and runs the pool again under
autograd. An average pool is linear: it keeps nothing, and its backward is ATen's.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from ..core.layout import Layout
from ..core.mesh import Mesh
from ..transforms.halo import Fetch
from ._window import (
    check_ndim,
    input_layout,
    link,
    member_ranges,
    my_range,
    ntuple,
    out_layout,
    out_sizes,
    plan,
    windowed,
    with_layout,
)

__all__ = ["max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"]

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_NEG_INF = float("-inf")


# -- geometry: pure arithmetic on the global layout, the same on every rank --------------------

def _args(n: int, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
          what: str) -> tuple[tuple[int, ...], ...]:
    """kernel, stride, padding, dilation as n ints each, with torch's refusals (which need
    no shapes, so they come before anything moves)."""
    k = ntuple(kernel_size, n, "kernel_size", what)
    s = k if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else \
        ntuple(stride, n, "stride", what)
    p, d = ntuple(padding, n, "padding", what), ntuple(dilation, n, "dilation", what)
    for name, v in (("kernel_size", k), ("stride", s), ("dilation", d)):
        if any(e < 1 for e in v):
            raise RuntimeError(f"{what}: {name} must be greater than zero, got {v}")
    if any(e < 0 for e in p):
        raise RuntimeError(f"{what}: padding must be non-negative, got {p}")
    if any(pp > kk // 2 for pp, kk in zip(p, k)):
        raise RuntimeError(f"{what}: pad should be at most half of kernel size, but got "
                           f"padding={p} and kernel_size={k}")
    return k, s, p, d


def _n_out(L: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """torch's ``pooling_output_shape``: with ``ceil_mode`` the last window may run past
    the padded end, but must start inside the input or the left padding."""
    n = (L + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)) // s + 1
    if ceil and (n - 1) * s >= L + p:
        n -= 1
    return n


def _check_nonempty(layout: Layout, what: str, channels: bool = True) -> None:
    dims = range(1 if channels else 2, len(layout.shape))
    if any(layout.shape[d] == 0 for d in dims):
        raise RuntimeError(f"{what}: expected the global input's non-batch dims to be "
                           f"non-empty, got {list(layout.shape)}")


@lru_cache(maxsize=256)
def _pool_plan(layout: Layout, kernel: tuple[int, ...], stride: tuple[int, ...],
               pads: tuple[int, ...], dilation: tuple[int, ...], ceil: bool, what: str):
    """(output layout, {dim: input range of every member along dim})."""
    _check_nonempty(layout, what)
    shape, sizes, ranges = list(layout.shape), {}, {}
    for i, (k, s, p, d) in enumerate(zip(kernel, stride, pads, dilation)):
        dim, L = 2 + i, layout.shape[2 + i]
        if what == "avg_pool3d" and L < k:  # torch's avg_pool3d alone ignores the padding here
            raise RuntimeError(f"{what}: the global input {list(layout.shape)} is smaller than "
                               f"the kernel {kernel} along dim {dim}")
        n_out = _n_out(L, k, s, p, d, ceil)
        if n_out < 1:
            raise RuntimeError(
                f"{what}: given the global input size {list(layout.shape)}, the calculated "
                f"output size along dim {dim} is {n_out} (kernel_size {kernel}, stride "
                f"{stride}, padding {pads}, dilation {dilation}). Output size is too small")
        shape[dim] = n_out
        sizes[dim] = out_sizes(layout, dim, n_out, keep=s == 1)
        span = d * (k - 1) + 1
        window = lambda o0, o1, s=s, p=p, span=span: (s * o0 - p, s * (o1 - 1) + span - p)
        ranges[dim] = member_ranges(sizes[dim] or (n_out,), window)
    return out_layout(layout, shape, sizes), ranges


# -- the local part ------------------------------------------------------------------------------

def _window(x: torch.Tensor, rc, layout: Layout, ranges: dict, value: float,
            what: str) -> tuple[list[Fetch], list[int]]:
    """The fetches of this rank's input window (one per split dim, and per unsplit dim
    that needs padding or trimming) and the global start of the window along each
    spatial dim."""
    fetches, starts = [], []
    for dim in range(2, x.ndim):
        a, b = my_range(layout, rc.rank, dim, ranges[dim])
        if layout.sizes[dim] is not None or (a, b) != (0, layout.shape[dim]):
            fetches.append(plan(rc, layout, dim, ranges[dim], "constant", value, name=what))
        starts.append(a)
    return fetches, starts


def _ravel(coords: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    flat = coords[0]
    for c, size in zip(coords[1:], shape[1:]):
        flat = flat * size + c
    return flat


def _unravel(flat: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    coords = []
    for size in reversed(shape[1:]):
        coords.append(flat % size)
        flat = torch.div(flat, size, rounding_mode="floor")
    return [flat] + coords[::-1]


def _empty(x: torch.Tensor, shape: Sequence[int], return_indices: bool):
    """Zeros of the output ``shape`` that still lead back to ``x`` (``link``)."""
    return _zeros(link(x.new_zeros(shape), x), return_indices)


def _zeros(y: torch.Tensor, return_indices: bool):
    """``y`` (zeros: no output rows here), with zero indices if asked for."""
    return (y, torch.zeros(y.shape, dtype=torch.long, device=y.device)) if return_indices else y


def _check_dtype(x: torch.Tensor, what: str) -> None:
    if not x.dtype.is_floating_point:
        raise NotImplementedError(f"{what}: only floating-point inputs are supported yet, "
                                  f"got {x.dtype}")


# -- max_pool --------------------------------------------------------------------------------------

def _max_pool(n: int, x: torch.Tensor, kernel_size: Any, stride: Any, padding: Any,
              dilation: Any, ceil_mode: bool, return_indices: bool, mesh: Mesh, spec: Any):
    what = f"max_pool{n}d"
    check_ndim(x, n, what)
    _check_dtype(x, what)
    k, s, p, d = _args(n, kernel_size, stride, padding, dilation, what)
    rc, lay = input_layout(x, mesh, spec, what)
    out_lay, ranges = _pool_plan(lay, k, s, p, d, bool(ceil_mode), what)
    fetches, starts = _window(x, rc, lay, ranges, _NEG_INF, what)
    shape = out_lay.local_shape(rc.rank)
    glob = lay.shape[2:]

    def pool(xf: torch.Tensor):
        """(the output, the window-local pick of every output: what backward needs)."""
        if 0 in shape:
            return _zeros(xf.new_zeros(shape), return_indices), None
        win = xf.shape[2:]
        if all(a >= 0 for a in starts):  # no -inf before the data: the local pick is torch's
            y, li = _MAX[n](xf, k, s, 0, d, return_indices=True)
            if not return_indices:
                return y, li
            return (y, _ravel([c + a for c, a in zip(_unravel(li, win), starts)], glob)), li
        # A window whose real elements are all -inf: torch picks its first real element,
        # the local pool the first one of the window, which may be padding. Pick as
        # torch, and take the values by that pick so the gradient goes where torch sends it.
        with torch.no_grad():
            _, li = _MAX[n](xf, k, s, 0, d, return_indices=True)
        coords = [c + a for c, a in zip(_unravel(li, win), starts)]
        coords = [torch.where(c < 0, c + dd * torch.div(dd - 1 - c, dd, rounding_mode="floor"), c)
                  if a < 0 else c
                  for c, a, dd in zip(coords, starts, d)]
        local = _ravel([c - a for c, a in zip(coords, starts)], win)
        y = xf.flatten(2).gather(2, local.flatten(2)).view(shape)
        return ((y, _ravel(coords, glob)) if return_indices else y), local

    def pool_t(win: torch.Tensor, params: tuple, g: torch.Tensor, needs: tuple,
               pick: torch.Tensor) -> tuple:
        """Each output's cotangent added at its pick, as torch's max-pool backward."""
        gw = g.new_zeros(win.shape)
        gw.flatten(2).scatter_add_(2, pick.flatten(2), g.flatten(2))
        return (gw,)
    # The picks, not the window: no forward recomputed in backward (x is kept only for
    # a differentiable backward, which recomputes).
    return windowed(x, fetches, pool, backward=pool_t, saves=True)


def _max_layout(n: int):
    def output_layout(layout: Layout, kernel_size: Any, stride: Any = None, padding: Any = 0,
                      dilation: Any = 1, ceil_mode: bool = False,
                      return_indices: bool = False) -> Layout:
        what = f"max_pool{n}d"
        return _pool_plan(layout, *_args(n, kernel_size, stride, padding, dilation, what),
                          bool(ceil_mode), what)[0]
    output_layout.__doc__ = (f"The output layout of ``spmd.ops.max_pool{n}d`` (and of its "
                             f"indices) for an input of ``layout``, without running it.")
    return output_layout


_MAX_DOC = """``F.max_pool{n}d`` on this rank's shard of an input split along its spatial
    dims (and optionally N and C).

    Args:
        x: this rank's shard, ``(N, C, {dims})``, floating point.
        kernel_size, stride, padding, dilation, ceil_mode: as ``F.max_pool{n}d``
            (``stride`` defaults to ``kernel_size``).
        return_indices: also return the indices of the maxima: global ones, the flat
            index into the global spatial dims that ``F.max_pool{n}d`` returns.
        mesh: the mesh the code runs on.
        spec: ``x``'s spec (a ``P``; the ranks exchange their sizes, one small
            all_gather) or its ``Layout`` (no exchange). Any dim may be split.

    Returns:
        This rank's shard of the global output (and of the indices), whose layout
        ``max_pool{n}d.output_layout(layout, kernel_size, ...)`` gives: split as the
        input for a stride-1 pool that keeps the length, else balanced.

    Raises:
        RuntimeError: what ``F.max_pool{n}d`` refuses on one device (non-positive
            kernel, stride or dilation, padding above half the kernel, an output size
            below 1, an empty channel or spatial dim), on every rank before data moves.
        SpecError: a shard that does not fit the spec or layout.
        NotImplementedError: an integer input.

    Backward:
        The gradient goes to the maximum of each window (torch's pick: the first
        maximum, the last NaN), then the halo part travels back to its owner (the
        transpose of the fetch, one all_to_all per split dim).

    Ranks without data:
        A rank with no output rows returns an empty shard; it still sends the rows
        others need, and receives their gradients in backward.
"""


def _max_op(n: int, example: str):
    def op(x: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
           dilation: Any = 1, ceil_mode: bool = False, return_indices: bool = False, *,
           mesh: Mesh, spec: Any):
        return _max_pool(n, x, kernel_size, stride, padding, dilation, ceil_mode,
                         return_indices, mesh, spec)
    op.__name__ = op.__qualname__ = f"max_pool{n}d"
    op.__doc__ = _MAX_DOC.format(n=n, dims=", ".join("DHW"[3 - n:])) + example
    return with_layout(_max_layout(n))(op)


max_pool1d = _max_op(1, """
    Example:
        >>> mesh = spmd.Mesh((4,), ("sp",))
        >>> x = torch.randn(2, 3, 27)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.max_pool1d(x, 3, stride=2, padding=1, ceil_mode=True,
        ...                                   return_indices=True, mesh=mesh, spec=s)
        >>> y, i = spmd.shard_map(f, mesh, s, (s, s))(x)
        >>> ry, ri = F.max_pool1d(x, 3, 2, 1, ceil_mode=True, return_indices=True)
        >>> y.shape, torch.equal(y, ry), torch.equal(i, ri)
        (torch.Size([2, 3, 14]), True, True)
""")
max_pool2d = _max_op(2, """
    Example:
        >>> mesh = spmd.Mesh((2, 2), ("x", "y"))
        >>> x = torch.randn(1, 2, 9, 7)
        >>> s = P(None, None, "x", "y")
        >>> f = lambda x: spmd.ops.max_pool2d(x, 3, stride=1, padding=1, mesh=mesh, spec=s)
        >>> torch.equal(spmd.shard_map(f, mesh, s, s)(x), F.max_pool2d(x, 3, 1, 1))
        True
""")
max_pool3d = _max_op(3, """
    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(1, 2, 8, 5, 4)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.max_pool3d(x, 2, dilation=(2, 1, 1), mesh=mesh, spec=s)
        >>> torch.equal(spmd.shard_map(f, mesh, s, s)(x), F.max_pool3d(x, 2, dilation=(2, 1, 1)))
        True
""")


# -- avg_pool --------------------------------------------------------------------------------------

def _divisors(L: int, k: int, s: int, p: int, o0: int, m: int, count_include_pad: bool) -> list[int]:
    """torch's divisor of output rows ``o0 .. o0+m`` along one dim: the window clipped
    to the padded input (with padding) or to the input (without)."""
    out = []
    for o in range(o0, o0 + m):
        start = o * s - p
        end = min(start + k, L + p)
        out.append(end - start if count_include_pad else min(end, L) - max(start, 0))
    return out


def _sum_pool(xf: torch.Tensor, n: int, k: tuple[int, ...], s: tuple[int, ...]) -> torch.Tensor:
    if n == 1:
        return F.avg_pool2d(xf.unsqueeze(2), (1, k[0]), (1, s[0]), 0, False, True, 1).squeeze(2)
    return (F.avg_pool2d if n == 2 else F.avg_pool3d)(xf, k, s, 0, False, True, 1)


def _sum_pool_t(g: torch.Tensor, win_shape: Sequence[int], n: int, k: tuple[int, ...],
                s: tuple[int, ...]) -> torch.Tensor:
    """The transpose of ``_sum_pool``: ATen's pooling backward, which reads only its
    input's shape (so it gets a broadcast zero, not the window)."""
    like = g.new_zeros(()).expand(win_shape)
    if n == 1:
        return torch.ops.aten.avg_pool2d_backward(g.unsqueeze(2), like.unsqueeze(2), (1, k[0]),
                                                  (1, s[0]), (0, 0), False, True, 1).squeeze(2)
    op = torch.ops.aten.avg_pool2d_backward if n == 2 else torch.ops.aten.avg_pool3d_backward
    return op(g, like, k, s, (0,) * n, False, True, 1)


def _avg_pool(n: int, x: torch.Tensor, kernel_size: Any, stride: Any, padding: Any,
              ceil_mode: bool, count_include_pad: bool, divisor_override: int | None,
              mesh: Mesh, spec: Any) -> torch.Tensor:
    what = f"avg_pool{n}d"
    check_ndim(x, n, what)
    _check_dtype(x, what)
    k, s, p, _ = _args(n, kernel_size, stride, padding, 1, what)
    if divisor_override is not None and divisor_override == 0:
        raise RuntimeError(f"{what}: divisor must be not zero")
    rc, lay = input_layout(x, mesh, spec, what)
    out_lay, ranges = _pool_plan(lay, k, s, p, (1,) * n, bool(ceil_mode), what)
    fetches, _ = _window(x, rc, lay, ranges, 0.0, what)
    shape = out_lay.local_shape(rc.rank)
    div = divisor_override
    if div is None and 0 not in shape:
        offsets = out_lay.offsets(rc.rank)
        for i in range(n):
            v = _divisors(lay.shape[2 + i], k[i], s[i], p[i], offsets[2 + i], shape[2 + i],
                          bool(count_include_pad))
            v = torch.tensor(v, dtype=x.dtype, device=x.device).view(-1, *[1] * (n - 1 - i))
            div = v if div is None else div * v

    def pool(xf: torch.Tensor) -> torch.Tensor:
        if 0 in shape:
            return xf.new_zeros(shape)
        return _sum_pool(xf, n, k, s) / div

    def pool_t(win: torch.Tensor, params: tuple, g: torch.Tensor, needs: tuple) -> tuple:
        return (_sum_pool_t(g / div, win.shape, n, k, s),)  # linear: x is not read
    return windowed(x, fetches, pool, backward=pool_t, reads_input=False)


def _avg_layout(n: int):
    def output_layout(layout: Layout, kernel_size: Any, stride: Any = None, padding: Any = 0,
                      ceil_mode: bool = False, count_include_pad: bool = True,
                      divisor_override: int | None = None) -> Layout:
        what = f"avg_pool{n}d"
        k, s, p, d = _args(n, kernel_size, stride, padding, 1, what)
        return _pool_plan(layout, k, s, p, d, bool(ceil_mode), what)[0]
    output_layout.__doc__ = (f"The output layout of ``spmd.ops.avg_pool{n}d`` for an input "
                             f"of ``layout``, without running it.")
    return output_layout


@with_layout(_avg_layout(1))
def avg_pool1d(x: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True, *, mesh: Mesh,
               spec: Any) -> torch.Tensor:
    """``F.avg_pool1d`` on this rank's shard of an input split along its length (and
    optionally N and C).

    Args:
        x: this rank's shard, ``(N, C, L)``, floating point.
        kernel_size, stride, padding, ceil_mode, count_include_pad: as ``F.avg_pool1d``.
        mesh: the mesh the code runs on.
        spec: ``x``'s spec (a ``P``; the ranks exchange their sizes, one small
            all_gather) or its ``Layout`` (no exchange). Any dim may be split.

    Returns:
        This rank's shard of the global output; ``avg_pool1d.output_layout(layout,
        kernel_size, ...)`` gives its layout (split as the input for a stride-1 pool
        that keeps the length, else balanced). Each window's sum is divided by torch's
        divisor for that output element (windows at the global edge count the padding
        or not, as ``count_include_pad`` says; a ``ceil_mode`` window past the padded
        end counts only what lies inside it).

    Raises:
        RuntimeError: what ``F.avg_pool1d`` refuses on one device, on every rank before
            data moves.
        SpecError: a shard that does not fit the spec or layout.
        NotImplementedError: an integer input.

    Backward:
        Each output's gradient is spread over its window, then the halo part travels
        back to its owner (the transpose of the fetch).

    Ranks without data:
        A rank with no output rows returns an empty shard; it still sends the rows
        others need, and receives their gradients in backward.

    Example:
        >>> mesh = spmd.Mesh((4,), ("sp",))
        >>> x = torch.randn(2, 3, 27)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.avg_pool1d(x, 4, stride=3, padding=2, ceil_mode=True,
        ...                                   count_include_pad=False, mesh=mesh, spec=s)
        >>> y = spmd.shard_map(f, mesh, s, s)(x)
        >>> ref = F.avg_pool1d(x, 4, 3, 2, ceil_mode=True, count_include_pad=False)
        >>> y.shape, torch.allclose(y, ref, atol=1e-6)
        (torch.Size([2, 3, 10]), True)
    """
    return _avg_pool(1, x, kernel_size, stride, padding, ceil_mode, count_include_pad, None,
                     mesh, spec)


@with_layout(_avg_layout(2))
def avg_pool2d(x: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None, *, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.avg_pool2d`` on this rank's shard of an input split along H, W or both (and
    optionally N and C); see ``avg_pool1d``. ``divisor_override``, as torch's, replaces
    every divisor.

    Example:
        >>> mesh = spmd.Mesh((2, 2), ("x", "y"))
        >>> x = torch.randn(1, 2, 9, 7)
        >>> s = P(None, None, "x", "y")
        >>> f = lambda x: spmd.ops.avg_pool2d(x, 3, stride=2, padding=1, mesh=mesh, spec=s)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), F.avg_pool2d(x, 3, 2, 1), atol=1e-6)
        True
    """
    return _avg_pool(2, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override, mesh, spec)


@with_layout(_avg_layout(3))
def avg_pool3d(x: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None, *, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.avg_pool3d`` on this rank's shard of an input split along D, H, W (and
    optionally N and C); see ``avg_pool1d`` and ``avg_pool2d``.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(1, 2, 8, 5, 4)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.avg_pool3d(x, 2, divisor_override=3, mesh=mesh, spec=s)
        >>> ref = F.avg_pool3d(x, 2, divisor_override=3)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-6)
        True
    """
    return _avg_pool(3, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override, mesh, spec)
