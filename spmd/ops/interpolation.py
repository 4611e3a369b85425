"""``interpolate``: ``F.interpolate`` on inputs split along their spatial dims.

Every supported mode (nearest, nearest-exact, linear, bilinear, trilinear, bicubic) is
separable: along each spatial dim, output row ``o`` is a weighted sum of at most four
input rows whose indices and weights depend only on ``o``. ``_taps`` reproduces ATen's
rules for them (``area_pixel_compute_scale``, ``area_pixel_compute_source_index``,
``guard_index_and_lambda``, the cubic coefficients with ``A = -0.75``, the float32
``floorf`` of the source index, the copy for an unchanged size in linear modes), so the
taps are the ones torch's CPU kernel uses for a contiguous input.

The output is partitioned first (as the input along a dim whose size is unchanged,
balanced otherwise); each rank then fetches the global input range its output rows read
(only taps with a non-zero weight count; where every rank reads only its own rows, as
nearest x2 on aligned shards does, there is no exchange at all) and applies the taps
with ``index_select`` and a weighted sum, one dim at a time. Backward is the transpose
of those taps (``_apply_t``: the cotangent rows added, weighted, into the rows they came
from), then the halo's part goes home; nothing of the input is kept, as on one device.

Precision: the weighted sums run in a different order from ATen's fused kernels, so a
float64 result agrees with ``F.interpolate`` to a few ulps, not bit for bit (the tests
use rtol = atol = 1e-10). The weights are computed in float64 and cast to the input's
dtype (float16/bfloat16 inputs are summed in float32).

Where torch's own kernels disagree, the forward wins. For ``'nearest'`` and
``'nearest-exact'`` torch's forward computes the source index with a float32 scale (and
copies for an output of ``L`` or ``2L`` rows) on 4-d inputs but with a double scale on
3-d and 5-d inputs, while its backward always uses the float32 rule; and its
``bicubic`` backward copies when both sizes are unchanged, even when a ``scale_factor``
made the forward interpolate. These differ for some scale factors (e.g. 1.1 on 5 rows);
ours follows torch's forward for each input rank, and its gradient is the transpose of
that forward (torch's is not, there).
"""
from __future__ import annotations

import math
from functools import lru_cache, partial
from typing import Any

import numpy as np
import torch

from ..core.layout import Layout
from ..core.mesh import Mesh
from ._window import (
    input_layout,
    member_ranges,
    out_layout,
    out_sizes,
    plan,
    windowed,
    with_layout,
)

__all__ = ["interpolate"]

_WHAT = "interpolate"
_LINEAR = {"linear": 3, "bilinear": 4, "trilinear": 5, "bicubic": 4}
_CUBIC_A = -0.75


# -- arguments: torch's checks, in torch's order, before anything moves ------------------------

def _args(ndim: int, size: Any, scale_factor: Any, mode: str, align_corners: Any,
          recompute_scale_factor: Any, antialias: bool):
    """``(sizes, scales, align_corners, recompute)`` as ``F.interpolate`` resolves them;
    raises what it raises for a ``ndim``-d input (and NotImplementedError for what
    torch supports but this op does not)."""
    what = _WHAT
    if mode in ("nearest", "area", "nearest-exact"):
        if align_corners is not None:
            raise ValueError(f"{what}: align_corners option can only be set with the "
                             f"interpolating modes: linear | bilinear | bicubic | trilinear")
    elif align_corners is None:
        align_corners = False
    n = ndim - 2
    sizes = scales = None
    if size is not None and scale_factor is not None:
        raise ValueError(f"{what}: only one of size or scale_factor should be defined")
    if size is not None:
        if isinstance(size, (list, tuple)):
            if len(size) != n:
                raise ValueError(
                    f"{what}: Input and output must have the same number of spatial "
                    f"dimensions, but got an input with {n} spatial dimensions and output "
                    f"size of {size}. Please provide the output size as (o1, ..., o{n}).")
            sizes = tuple(size)
        else:
            sizes = (size,) * max(n, 0)
        if not all(_is_int(s) for s in sizes):
            raise TypeError(f"{what}: expected size to be an int or a tuple of ints, but got "
                            f"size with types {[type(s) for s in sizes]}")
        sizes = tuple(int(s) for s in sizes)
    elif scale_factor is not None:
        if isinstance(scale_factor, (list, tuple)):
            if len(scale_factor) != n:
                raise ValueError(
                    f"{what}: Input and scale_factor must have the same number of spatial "
                    f"dimensions, but got an input with {n} spatial dimensions and "
                    f"scale_factor of shape {scale_factor}. Please provide scale_factor as "
                    f"(s1, ..., s{n}).")
            scales = tuple(scale_factor)
        else:
            scales = (scale_factor,) * max(n, 0)
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scales):
            raise TypeError(f"{what}: expected scale_factor to be a float or a tuple of "
                            f"floats, got {scale_factor!r}")
        scales = tuple(float(s) for s in scales)
    else:
        raise ValueError(f"{what}: either size or scale_factor should be defined")
    if recompute_scale_factor and size is not None:
        raise ValueError(f"{what}: recompute_scale_factor is not meaningful with an explicit "
                         f"size.")
    if antialias:
        if not (mode in ("bilinear", "bicubic", "lanczos") and ndim == 4):
            raise ValueError(f"{what}: Anti-alias option is restricted to bilinear, bicubic, "
                             f"and lanczos modes and requires a 4-D tensor as input")
        raise NotImplementedError(f"{what}: antialias=True is not supported yet (its filter "
                                  f"support grows with the downsampling factor); "
                                  f"use antialias=False")
    if mode == "lanczos" and ndim == 4:
        raise ValueError(f"{what}: Lanczos mode requires antialias=True" if not align_corners
                         else f"{what}: Lanczos mode does not support align_corners=True")
    if mode in ("nearest", "nearest-exact") and ndim in (3, 4, 5):
        return sizes, scales, None, bool(recompute_scale_factor)
    if mode == "area" and ndim in (3, 4, 5):
        raise NotImplementedError(f"{what}: mode='area' is not supported yet (it is an "
                                  f"adaptive average pool, not a separable interpolation)")
    if _LINEAR.get(mode) == ndim:
        return sizes, scales, bool(align_corners), bool(recompute_scale_factor)
    if mode in ("linear", "bilinear", "trilinear") and ndim in (3, 4, 5):
        raise NotImplementedError(f"{what}: Got {ndim}D input, but {mode} mode needs "
                                  f"{_LINEAR[mode]}D input")
    raise NotImplementedError(
        f"{what}: Input Error: Only 3D, 4D and 5D input Tensors supported (got {ndim}D) for "
        f"the modes: nearest | linear | bilinear | bicubic | trilinear | nearest-exact (got "
        f"{mode})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- geometry: pure arithmetic on the global layout, the same on every rank --------------------

def _floorf(v: np.ndarray) -> np.ndarray:
    """ATen's ``floorf`` of a double: rounded to float32 first."""
    return np.floor(v.astype(np.float32)).astype(np.int64)


def _taps(mode: str, L: int, M: int, scale: float | None, align_corners: bool | None,
          ndim: int):
    """``(idx, w)``, each ``(taps, M)`` for an output of ``M`` rows: output row ``o`` is
    ``sum_k w[k, o] * x[idx[k, o]]`` (``w`` is None for the nearest modes: one tap of
    weight 1). ATen's rules (UpSample.h, UpSampleKernel.cpp) for an ``ndim``-d input:
    ``scale`` is the ``scale_factor`` torch passes to its kernel (None when it passes a
    size)."""
    d = np.arange(M, dtype=np.float64)
    ratio = 1.0 / scale if scale is not None and scale > 0 else L / M
    if mode in ("nearest", "nearest-exact"):
        if ndim == 4:  # nearest_idx: a float32 scale, and copies for M == L and 2L
            if mode == "nearest" and M in (L, 2 * L):
                return (np.arange(M) // (M // L))[None], None
            r32 = np.float32(ratio) if scale is not None and scale > 0 else \
                np.float32(L) / np.float32(M)
            src = (d.astype(np.float32) * r32 if mode == "nearest"
                   else (d + 0.5) * np.float64(r32))
        elif mode == "nearest":  # the separable kernel: a double scale
            src = ratio * d
        else:
            src = np.maximum(ratio * (d + 0.5) - 0.5, 0.0) + 0.5
        return np.minimum(_floorf(src), L - 1)[None], None
    cubic = mode == "bicubic"
    if not cubic and M == L:  # torch copies
        return np.arange(M)[None], np.ones((1, M))
    if align_corners:
        src = (L - 1) / (M - 1) * d if M > 1 else 0.0 * d
    else:
        src = ratio * (d + 0.5) - 0.5
        if not cubic:
            src = np.maximum(src, 0.0)
    i0 = np.minimum(_floorf(src), L - 1)
    lam = np.clip(src - i0, 0.0, 1.0)
    if not cubic:
        return np.stack([i0, i0 + (i0 < L - 1)]), np.stack([1.0 - lam, lam])
    A = _CUBIC_A
    c1 = lambda t: ((A + 2) * t - (A + 3)) * t * t + 1
    c2 = lambda t: ((A * t - 5 * A) * t + 8 * A) * t - 4 * A
    w = np.stack([c2(lam + 1), c1(lam), c1(1 - lam), c2(2 - lam)])
    return np.stack([np.clip(i0 - 1 + j, 0, L - 1) for j in range(4)]), w


def _prune(idx: np.ndarray, w: np.ndarray | None, L: int):
    """Point taps of weight exactly 0 at the row's main tap, so they widen no window;
    and say whether the taps are the identity (each of the ``L`` output rows is its own
    input row, weight 1)."""
    rows = np.arange(idx.shape[1])
    if w is None:
        return idx, w, bool(len(rows) == L and (idx[0] == rows).all())
    main = idx[np.abs(w).argmax(0), rows]
    idx = np.where(w == 0, main[None], idx)
    ident = bool(len(rows) == L and (idx == rows).all() and ((w == 0) | (w == 1)).all()
                 and ((w == 1).sum(0) == 1).all())
    return idx, w, ident


def _out_len(L: int, s: float, recompute: bool) -> int:
    if recompute:
        return int(L * s)  # F.interpolate's own rounding (Python floats)
    v = float(L) * s
    if not math.isfinite(v):
        raise RuntimeError(f"{_WHAT}: the output size {L} * {s} = {v} cannot be converted to "
                           f"type int64_t without overflow")
    return int(v)  # ATen truncates


@lru_cache(maxsize=256)
def _plan(layout: Layout, mode: str, sizes: tuple[int, ...] | None,
          scales: tuple[float, ...] | None, align_corners: bool | None, recompute: bool):
    """(output layout, per spatial dim: (dim, idx, w, identity, member ranges, local)),
    ``local`` where every member's range lies in its own shard: nothing to fetch."""
    n = len(layout.shape) - 2
    L = layout.shape[2:]
    if sizes is not None:
        M, kernel_scales = sizes, (None,) * n
    else:
        M = tuple(_out_len(li, s, recompute) for li, s in zip(L, scales))
        kernel_scales = (None,) * n if recompute else scales
    if min(L) <= 0 or min(M) <= 0:
        names = "DHW"[3 - n:]
        fmt = lambda v: ", ".join(f"{c}: {s}" for c, s in zip(names, v))
        raise RuntimeError(f"{_WHAT}: Input and output sizes should be greater than 0, but got "
                           f"input ({fmt(L)}) and output ({fmt(M)})")
    if layout.shape[1] == 0:
        raise RuntimeError(f"{_WHAT}: Non-empty {n + 2}D data tensor expected but got a tensor "
                           f"with sizes {list(layout.shape)}")
    shape, out_split, dims = list(layout.shape), {}, []
    for i in range(n):
        dim = 2 + i
        shape[dim] = M[i]
        out_split[dim] = out_sizes(layout, dim, M[i], keep=True)
        taps = _taps(mode, L[i], M[i], kernel_scales[i], align_corners, n + 2)
        idx, w, ident = _prune(*taps, L[i])
        window = lambda o0, o1, idx=idx: (int(idx[:, o0:o1].min()), int(idx[:, o0:o1].max()) + 1)
        ranges = member_ranges(out_split[dim] or (M[i],), window)
        starts = np.cumsum((0,) + (layout.sizes[dim] or (L[i],)))
        local = all(a == b or s0 <= a and b <= s1
                    for (a, b), s0, s1 in zip(ranges, starts[:-1], starts[1:]))
        dims.append((dim, idx, w, ident, ranges, local))
    return out_layout(layout, shape, out_split), tuple(dims)


def _output_layout(layout: Layout, size: Any = None, scale_factor: Any = None,
                   mode: str = "nearest", align_corners: bool | None = None,
                   recompute_scale_factor: bool | None = None,
                   antialias: bool = False) -> Layout:
    """The output layout of ``spmd.ops.interpolate`` for an input of ``layout``, without
    running it: each spatial dim split as the input's where its size is unchanged,
    balanced otherwise; batch and channel dims as the input's.

    Example:
        >>> mesh = spmd.Mesh((4,), ("sp",))
        >>> lay = Layout((1, 3, 9, 8), P(None, None, "sp"), mesh)
        >>> spmd.ops.interpolate.output_layout(lay, scale_factor=2, mode="bilinear").sizes
        (None, None, (5, 5, 4, 4), None)
    """
    sizes, scales, ac, rec = _args(len(layout.shape), size, scale_factor, mode, align_corners,
                                   recompute_scale_factor, antialias)
    return _plan(layout, mode, sizes, scales, ac, rec)[0]


# -- the local computation ---------------------------------------------------------------------

def _apply(x: torch.Tensor, dim: int, idx: np.ndarray, w: np.ndarray | None) -> torch.Tensor:
    """Row ``o`` of ``dim`` becomes ``sum_k w[k, o] * x[idx[k, o]]`` (local indices)."""
    ii = torch.as_tensor(idx, dtype=torch.long, device=x.device)
    if w is None:
        return x.index_select(dim, ii[0])
    xs, wts = _weighted(x, w, dim)
    y = xs.index_select(dim, ii[0]) * wts[0]
    for k in range(1, len(wts)):
        y = y + xs.index_select(dim, ii[k]) * wts[k]
    return y.to(x.dtype)


def _weighted(x: torch.Tensor, w: np.ndarray, dim: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``x`` in the dtype the weighted sums run in (float32 for float16 and bfloat16), and
    each tap's weights shaped to broadcast along ``dim``."""
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    view = [1] * x.ndim
    view[dim] = -1
    return xs, [t.view(view) for t in torch.as_tensor(w, dtype=xs.dtype, device=x.device)]


@with_layout(_output_layout)
def interpolate(x: torch.Tensor, size: Any = None, scale_factor: Any = None,
                mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False, *,
                mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.interpolate`` on this rank's shard of an input split along its spatial dims.

    Args:
        x: this rank's shard, ``(N, C, *spatial)`` with 1, 2 or 3 spatial dims.
        size, scale_factor, mode, align_corners, recompute_scale_factor: as
            ``F.interpolate`` on the global input. ``mode`` is ``'nearest'``,
            ``'nearest-exact'``, ``'linear'`` (3-d input), ``'bilinear'`` (4-d),
            ``'trilinear'`` (5-d) or ``'bicubic'`` (4-d). ``size`` and ``scale_factor``
            take one value for all spatial dims or one per dim; fractional scale
            factors are fine (the output size is ``floor(L * scale_factor)``).
        antialias: not supported (raises NotImplementedError where torch would accept it).
        mesh: the mesh the code runs on.
        spec: ``x``'s spec (a ``P``; the ranks exchange their sizes, one small
            all_gather) or its ``Layout`` (no exchange). Any dim may be split: batch and
            channels need nothing (interpolation is per sample and channel), spatial
            dims over one axis or several, evenly or not, with empty shards.

    Returns:
        This rank's shard of the global output, whose layout
        ``interpolate.output_layout(layout, size=..., scale_factor=..., mode=...)``
        gives: a spatial dim whose size is unchanged keeps the input's split, the others
        are balanced.

    Raises:
        ValueError, TypeError, NotImplementedError, RuntimeError: what ``F.interpolate``
            raises for the global input (both ``size`` and ``scale_factor``,
            ``align_corners`` with a nearest mode, a mode that does not fit the input's
            rank, an empty output), on every rank before data moves.
        NotImplementedError: ``antialias=True``, ``mode='area'``, ``'lanczos'``, and
            integer inputs with a non-nearest mode.
        SpecError: a spec or layout that does not fit the mesh or the shard.

    Backward:
        The transpose of the local taps (nothing of ``x`` is kept for it); the
        gradients of rows fetched from other ranks go home through the fetch's
        transpose, one all_to_all per split dim, and are added into their owners' shards.

    Ranks without data:
        A rank with an empty output shard returns an empty tensor of its local output
        shape; it still takes part in every fetch (sending the rows others need), in
        forward and backward. A rank with an empty input shard receives the rows its
        output reads.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.randn(1, 2, 7, 5)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.interpolate(x, scale_factor=1.5, mode="bilinear",
        ...                                    mesh=mesh, spec=s)
        >>> y = spmd.shard_map(f, mesh, s, s)(x)
        >>> ref = torch.nn.functional.interpolate(x, scale_factor=1.5, mode="bilinear")
        >>> y.shape, torch.allclose(y, ref, atol=1e-6)
        (torch.Size([1, 2, 10, 7]), True)
    """
    sizes, scales, ac, rec = _args(x.ndim, size, scale_factor, mode, align_corners,
                                   recompute_scale_factor, antialias)
    if mode not in ("nearest", "nearest-exact") and not x.is_floating_point():
        raise NotImplementedError(f"{_WHAT}: mode={mode!r} on a {x.dtype} input is not "
                                  f"supported; convert x to a floating dtype")
    rc, lay = input_layout(x, mesh, spec, _WHAT)
    out_lay, dims = _plan(lay, mode, sizes, scales, ac, rec)
    # Fetch where the tensor is smallest: dims that shrink are applied first (those that
    # need no fetch before the others), then the other split dims are all fetched before
    # any of them grows the tensor.
    todo = sorted((d for d in dims if not d[3]),
                  key=lambda d: out_lay.shape[d[0]] / lay.shape[d[0]])
    shrink = [d for d in todo if out_lay.shape[d[0]] < lay.shape[d[0]]]
    shrink.sort(key=lambda d: lay.sizes[d[0]] is not None)  # stable: unsplit dims first
    grow = [d for d in todo if out_lay.shape[d[0]] >= lay.shape[d[0]]]
    y = x
    for group in [[d] for d in shrink] + [grow]:
        fetches, local = [], {}
        for dim, idx, w, _, ranges, in_shard in group:
            if lay.sizes[dim] is None:
                local[dim] = (idx, w)
                continue
            k = lay.shard_index(rc.rank, dim)
            o0 = sum(out_lay.sizes[dim][:k])
            o1 = o0 + out_lay.sizes[dim][k]
            if in_shard:  # every rank reads only its own rows: no exchange at all
                start = sum(lay.sizes[dim][:k])
            else:
                fetches.append(plan(rc, lay, dim, ranges, name=_WHAT))
                start = ranges[k][0]
            local[dim] = (idx[:, o0:o1] - start, w if w is None else w[:, o0:o1])
        if local:
            y = windowed(y, fetches, partial(_apply_all, local), backward=partial(_apply_t, local),
                         reads_input=False)
    return y.clone() if y is x else y


def _apply_all(local: dict, x: torch.Tensor) -> torch.Tensor:
    """The taps of every dim of ``local`` ({dim: (local idx, w)}), one dim after the other."""
    for dim, (idx, w) in local.items():
        x = _apply(x, dim, idx, w)
    return x


def _apply_t(local: dict, win: torch.Tensor, params: tuple, g: torch.Tensor,
             needs: tuple) -> tuple[torch.Tensor]:
    """The transpose of ``_apply_all`` (a backward for ``windowed``: the taps are linear,
    so only the window's shape is read): each dim's cotangent rows are added, weighted,
    into the input rows they came from, the last dim applied first."""
    for dim, (idx, w) in reversed(local.items()):
        ii = torch.as_tensor(idx, dtype=torch.long, device=g.device)
        shape = list(g.shape)
        shape[dim] = win.shape[dim]
        if w is None:
            g = g.new_zeros(shape).index_add_(dim, ii[0], g)
            continue
        gs, wts = _weighted(g, w, dim)
        out = gs.new_zeros(shape)
        for k, wt in enumerate(wts):
            out.index_add_(dim, ii[k], gs * wt)
        g = out.to(g.dtype)
    return (g,)
