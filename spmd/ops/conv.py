"""Convolutions over inputs split along their spatial dims: ``conv1d/2d/3d`` and
``conv_transpose1d/2d/3d``.

The output is partitioned first (as the input for a stride-1 length-preserving conv,
balanced otherwise); each rank then fetches exactly the input rows its output rows
read: ``[s*o0 - lo, s*(o1-1) + d*(k-1) - lo]``. So every kernel, stride, padding,
dilation and uneven split is exact, halos may be asymmetric, zero or negative (a trim),
and only those rows move. Weight and bias are replicated: each rank's local conv gives
its partial weight gradient (docs/design.md: shard_map sums them).

Memory: autograd keeps the shard and the halo rows that arrived (``windowed``), and the
backward is ATen's convolution backward on the window rebuilt from them. A conv whose
window is, along each fetched dim, the shard padded alike on both sides as far as its
outputs read (a 'same' conv split one, two or three ways, or with a wrapped unsplit dim;
a strided one on even shards: the common cases) makes no padded copy at all: it is the
conv of the shard plus the conv of each halo on thin slabs (``framed_conv.py``), so a rank's
peak is one device's divided by P, and the halo travels while the shard's own conv
runs, forward and backward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P
from .framed_conv import conv_at, conv_bwd_at, frame_plan, framed
from ._window import (
    check_ndim,
    input_layout,
    member_ranges,
    mode_error,
    ntuple,
    out_layout,
    out_sizes,
    plan,
    refuse_split,
    windowed,
    with_layout,
)

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d"]

_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate",
          "circular": "circular"}


# -- geometry: pure arithmetic on the global layout, the same on every rank --------------------

def _pads(padding: Any, n: int, k: tuple[int, ...], dil: tuple[int, ...],
          stride: tuple[int, ...], what: str) -> tuple[tuple[int, int], ...]:
    if padding == "valid":
        return ((0, 0),) * n
    if padding == "same":
        if any(s != 1 for s in stride):
            raise RuntimeError(f"{what}: padding='same' is not supported for strided "
                               f"convolutions")
        return tuple((d * (kk - 1) // 2, d * (kk - 1) - d * (kk - 1) // 2)
                     for kk, d in zip(k, dil))
    if isinstance(padding, str):
        raise SpecError(f"{what}: padding must be 'same', 'valid', an int or a tuple, "
                        f"got {padding!r}")
    if (isinstance(padding, (tuple, list)) and len(padding) == n
            and all(isinstance(p, (tuple, list)) for p in padding)):
        out = tuple((int(p[0]), int(p[1])) for p in padding)  # (lo, hi) per dim
    else:
        out = tuple((p, p) for p in ntuple(padding, n, "padding", what))
    if any(p < 0 for pair in out for p in pair):
        raise RuntimeError(f"{what}: negative padding is not supported, got {padding!r}")
    return out


@lru_cache(maxsize=256)
def _conv_plan(layout: Layout, kernel: tuple[int, ...], stride: tuple[int, ...],
               pads: tuple[tuple[int, int], ...], dilation: tuple[int, ...], c_out: int,
               mode: str, what: str):
    """(output layout, {dim: input range of every member along dim})."""
    n = len(kernel)
    shape = list(layout.shape)
    shape[1] = c_out
    sizes, ranges = {}, {}
    for i in range(n):
        dim = 2 + i
        L, k, s, d, (lo, hi) = layout.shape[dim], kernel[i], stride[i], dilation[i], pads[i]
        if s < 1 or d < 1:
            raise RuntimeError(f"{what}: stride and dilation must be positive, got stride "
                               f"{stride}, dilation {dilation}")
        span = d * (k - 1) + 1
        if L + lo + hi < span:
            raise RuntimeError(
                f"{what}: calculated padded input size per channel: {L + lo + hi} along dim "
                f"{dim} (global size {L}, padding ({lo}, {hi})). Kernel size: {k} (dilated "
                f"{span}). Kernel size can't be greater than actual input size")
        if mode != "constant":
            mode_error(what, L, lo, hi, mode, dim, layout.shape)
        n_out = (L + lo + hi - span) // s + 1
        shape[dim] = n_out
        sizes[dim] = out_sizes(layout, dim, n_out, keep=s == 1)
        window = lambda o0, o1, s=s, lo=lo, span=span: (s * o0 - lo, s * (o1 - 1) + span - lo)
        ranges[dim] = member_ranges(sizes[dim] or (n_out,), window)
    return out_layout(layout, shape, sizes), ranges


def _conv_layout(n: int):
    def output_layout(layout: Layout, weight_shape: Sequence[int], stride: Any = 1,
                      padding: Any = 0, dilation: Any = 1, groups: int = 1, *,
                      padding_mode: str = "zeros") -> Layout:
        what = f"conv{n}d"
        k = tuple(int(v) for v in weight_shape[2:])
        st, dl = ntuple(stride, n, "stride", what), ntuple(dilation, n, "dilation", what)
        pads = _pads(padding, n, k, dl, st, what)
        return _conv_plan(layout, k, st, pads, dl, int(weight_shape[0]),
                          _mode(padding_mode, what), what)[0]
    output_layout.__doc__ = (f"The output layout of ``spmd.ops.conv{n}d`` for an input of "
                             f"``layout``, without running it.")
    return output_layout


def _mode(padding_mode: str, what: str) -> str:
    if padding_mode not in _MODES:
        raise SpecError(f"{what}: padding_mode must be one of {tuple(_MODES)}, got "
                        f"{padding_mode!r}")
    return _MODES[padding_mode]


def _check_weight(x: torch.Tensor, weight: torch.Tensor, bias, groups: int, n: int,
                  what: str, transposed: bool) -> None:
    """torch's own checks, run before anything moves so every rank raises the same."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != n + 2:
        raise RuntimeError(f"{what}: expected a {n + 2}-d weight, got {weight!r:.60}")
    if groups < 1:
        raise RuntimeError(f"{what}: non-positive groups is not supported")
    c_in = weight.shape[0] if transposed else weight.shape[1] * groups
    if not transposed and weight.shape[0] % groups:
        raise RuntimeError(f"{what}: given groups={groups}, expected weight to be divisible "
                           f"by {groups} at dimension 0, but got weight of size "
                           f"{list(weight.shape)} instead")
    if transposed and weight.shape[0] % groups:
        raise RuntimeError(f"{what}: given groups={groups}, expected the weight's dim 0 "
                           f"({weight.shape[0]}) to be divisible by {groups}")
    if x.shape[1] != c_in:
        raise RuntimeError(f"{what}: given groups={groups}, weight of size "
                           f"{list(weight.shape)}, expected input{list(x.shape)} to have "
                           f"{c_in} channels, but got {x.shape[1]} channels instead")
    c_out = weight.shape[1] * groups if transposed else weight.shape[0]
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise RuntimeError(f"{what}: expected bias of shape [{c_out}], got {list(bias.shape)}")


def _conv_meta(n: int):
    """convNd's local output under torch.compile, where this rank's shapes alone give
    it: a split dim must keep its length (stride 1, padding = dilated kernel - 1), so
    each rank keeps its own rows; else None (the call runs eagerly)."""
    def meta(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, mesh,
             spec, padding_mode="zeros"):
        if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
                and isinstance(spec, P) and x.ndim == n + 2 and weight.ndim == n + 2):
            return None
        try:
            what = f"conv{n}d"
            k = tuple(weight.shape[2:])
            st, dl = ntuple(stride, n, "stride", what), ntuple(dilation, n, "dilation", what)
            pads = _pads(padding, n, k, dl, st, what)
        except Exception:  # noqa: BLE001 - the eager call raises the real error
            return None
        shape = [x.shape[0], weight.shape[0]]
        for i in range(n):
            (lo, hi), span = pads[i], dl[i] * (k[i] - 1) + 1
            if 2 + i < len(spec) and spec[2 + i] is not None:
                if st[i] != 1 or lo + hi != span - 1:
                    return None
                shape.append(x.shape[2 + i])
            else:
                shape.append((x.shape[2 + i] + lo + hi - span) // st[i] + 1)
        return [(tuple(shape), x.dtype)]
    return meta


# -- convolution -------------------------------------------------------------------------------

def _conv(n: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          stride: Any, padding: Any, dilation: Any, groups: int, mesh: Mesh, spec: Any,
          padding_mode: str) -> torch.Tensor:
    what = f"conv{n}d"
    check_ndim(x, n, what)
    refuse_split(spec, (1,), what, "the channels, which every output reads")
    _check_weight(x, weight, bias, groups, n, what, transposed=False)
    mode = _mode(padding_mode, what)
    k = tuple(weight.shape[2:])
    st, dl = ntuple(stride, n, "stride", what), ntuple(dilation, n, "dilation", what)
    pads = _pads(padding, n, k, dl, st, what)
    rc, lay = input_layout(x, mesh, spec, what)
    out_lay, ranges = _conv_plan(lay, k, st, pads, dl, weight.shape[0], mode, what)
    native, fetches = [0] * n, []
    for i in range(n):
        dim, (lo, hi) = 2 + i, pads[i]
        if lay.sizes[dim] is None and mode == "constant" and lo == hi:
            native[i] = lo  # whole on every rank: the conv pads it, no copy
        elif lay.sizes[dim] is None:
            fetches.append(plan(rc, lay, dim, ((-lo, lay.shape[dim] + hi),), mode, name=what))
        else:
            fetches.append(plan(rc, lay, dim, ranges[dim], mode, name=what))
    shape = out_lay.local_shape(rc.rank)
    args = (st, tuple(native), dl, False, groups)
    fwd, bwd = _local_conv(args, shape if 0 in shape[2:] else None)
    fr = frame_plan(x.shape, fetches, args, k, shape, fwd)
    if fr is not None:
        return framed(anchor(x), fr, weight, bias)
    return windowed(x, fetches, fwd, weight, bias, backward=bwd)






def _local_conv(args: tuple, zeros_of: Sequence[int] | None) -> tuple[Callable, Callable]:
    """The local convolution of ``windowed`` (``args``: see ``conv_at``) and its
    backward, ATen's own: no forward recomputed. ``zeros_of``: the output's shape where
    no input reaches this rank's outputs (then they are zeros)."""
    def forward(xw: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        return xw.new_zeros(zeros_of) if zeros_of is not None else conv_at(xw, weight, bias, args)

    def backward(xw: torch.Tensor, params: tuple, g: torch.Tensor, needs: tuple) -> tuple:
        if zeros_of is not None:
            return (torch.zeros_like(xw), *(torch.zeros_like(p) if n else None
                                            for p, n in zip(params, needs)))
        return conv_bwd_at(g, xw, *params, args, [True, *needs])
    return forward, backward


@with_layout(_conv_layout(1))
@graph_op(_conv_meta(1))
def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1, *,
           mesh: Mesh, spec: Any, padding_mode: str = "zeros") -> torch.Tensor:
    """``F.conv1d`` on this rank's shard of an input split along its length.

    Args:
        x: this rank's shard, ``(N, C_in, L_local)``.
        weight, bias, stride, padding, dilation, groups: as ``F.conv1d`` (replicated
            weight and bias). ``padding`` also takes ``'same'``, ``'valid'`` and
            ``((lo, hi),)`` for asymmetric padding.
        mesh: the mesh the code runs on.
        spec: ``x``'s spec (a ``P``; the ranks exchange their sizes, one small
            all_gather) or its ``Layout`` (no exchange). The batch dim may be split
            too; the channel dim may not.
        padding_mode: ``'zeros'``, ``'reflect'``, ``'replicate'`` or ``'circular'``, as
            ``nn.Conv1d`` (applied at the global boundary).

    Returns:
        This rank's shard of the global output, whose layout
        ``conv1d.output_layout(layout, weight.shape, ...)`` gives: the length is split
        as the input's for a stride-1 length-preserving conv, else balanced.

    Raises:
        RuntimeError: what ``F.conv1d`` refuses on one device (channels, groups, a
            kernel larger than the padded input), on every rank before data moves.
        SpecError: a spec that splits the channel dim, a shard that does not fit.

    Example:
        >>> mesh = spmd.Mesh((4,), ("sp",))
        >>> x, w = torch.randn(2, 3, 27), torch.randn(5, 3, 3)
        >>> f = lambda x: spmd.ops.conv1d(x, w, stride=2, padding=1, mesh=mesh,
        ...                               spec=P(None, None, "sp"))
        >>> y = spmd.shard_map(f, mesh, P(None, None, "sp"), P(None, None, "sp"))(x)
        >>> y.shape, torch.allclose(y, F.conv1d(x, w, stride=2, padding=1), atol=1e-6)
        (torch.Size([2, 5, 14]), True)
    """
    return _conv(1, x, weight, bias, stride, padding, dilation, groups, mesh, spec, padding_mode)


@with_layout(_conv_layout(2))
@graph_op(_conv_meta(2))
def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1, *,
           mesh: Mesh, spec: Any, padding_mode: str = "zeros") -> torch.Tensor:
    """``F.conv2d`` on this rank's shard of an input split along H, W or both (and
    optionally N); see ``conv1d`` for the arguments.

    Example:
        >>> mesh = spmd.Mesh((2, 2), ("x", "y"))
        >>> x, w = torch.randn(1, 2, 9, 7), torch.randn(4, 2, 3, 3)
        >>> s = P(None, None, "x", "y")
        >>> f = lambda x: spmd.ops.conv2d(x, w, padding=1, mesh=mesh, spec=s,
        ...                               padding_mode="circular")
        >>> y = spmd.shard_map(f, mesh, s, s)(x)
        >>> ref = torch.nn.functional.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), w)
        >>> torch.allclose(y, ref, atol=1e-6)
        True
    """
    return _conv(2, x, weight, bias, stride, padding, dilation, groups, mesh, spec, padding_mode)


@with_layout(_conv_layout(3))
@graph_op(_conv_meta(3))
def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1, *,
           mesh: Mesh, spec: Any, padding_mode: str = "zeros") -> torch.Tensor:
    """``F.conv3d`` on this rank's shard of an input split along D, H, W (and
    optionally N); see ``conv1d`` for the arguments.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x, w = torch.randn(1, 2, 8, 4, 4), torch.randn(2, 2, 3, 3, 3)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.conv3d(x, w, padding="same", mesh=mesh, spec=s)
        >>> y = spmd.shard_map(f, mesh, s, s)(x)
        >>> torch.allclose(y, F.conv3d(x, w, padding="same"), atol=1e-5)
        True
    """
    return _conv(3, x, weight, bias, stride, padding, dilation, groups, mesh, spec, padding_mode)


# -- transposed convolution --------------------------------------------------------------------

@lru_cache(maxsize=256)
def _convt_plan(layout: Layout, kernel: tuple[int, ...], stride: tuple[int, ...],
                pads: tuple[int, ...], out_pad: tuple[int, ...], dilation: tuple[int, ...],
                c_out: int, what: str):
    """(output layout, {dim: (input range, (crop lo, crop hi)) per member along dim}).

    Output position ``o`` takes input ``i`` through tap ``j`` where
    ``o = s*i - p + d*j``; the rows ``[o0, o1)`` need inputs
    ``[ceil((o0 + p - d(k-1)) / s), floor((o1 - 1 + p) / s)]``.
    """
    n = len(kernel)
    shape = list(layout.shape)
    shape[1] = c_out
    sizes, plans = {}, {}
    for i in range(n):
        dim = 2 + i
        L, k, s, d, p, op = (layout.shape[dim], kernel[i], stride[i], dilation[i], pads[i],
                             out_pad[i])
        if s < 1 or d < 1:
            raise RuntimeError(f"{what}: stride and dilation must be positive, got stride "
                               f"{stride}, dilation {dilation}")
        if op >= s and op >= d:
            raise RuntimeError(f"{what}: output padding must be smaller than either stride "
                               f"or dilation, got output_padding {out_pad}, stride {stride}, "
                               f"dilation {dilation}")
        n_out = (L - 1) * s - 2 * p + d * (k - 1) + op + 1
        if n_out < 1 or L < 1:
            raise RuntimeError(f"{what}: the output size along dim {dim} would be {n_out} "
                               f"(global input size {L}); it must be positive")
        shape[dim] = n_out
        sizes[dim] = out_sizes(layout, dim, n_out, keep=s == 1)
        per, o0 = [], 0
        for m in sizes[dim] or (n_out,):
            o1 = o0 + m
            ia = max(0, -((d * (k - 1) - o0 - p) // s))  # ceil((o0 + p - d(k-1)) / s)
            ib = min(L - 1, (o1 - 1 + p) // s)
            if m == 0 or ib < ia:
                per.append(((0, 0), None))
            else:  # the local output covers s*ia .. s*ib + d(k-1); keep o0+p .. o1+p
                per.append(((ia, ib + 1), (s * ia - (o0 + p), (o1 + p) - (s * ib + d * (k - 1) + 1))))
            o0 = o1
        plans[dim] = tuple(per)
    return out_layout(layout, shape, sizes), plans


def _convt_layout(n: int):
    def output_layout(layout: Layout, weight_shape: Sequence[int], stride: Any = 1,
                      padding: Any = 0, output_padding: Any = 0, groups: int = 1,
                      dilation: Any = 1) -> Layout:
        what = f"conv_transpose{n}d"
        return _convt_plan(layout, tuple(int(v) for v in weight_shape[2:]),
                           ntuple(stride, n, "stride", what), ntuple(padding, n, "padding", what),
                           ntuple(output_padding, n, "output_padding", what),
                           ntuple(dilation, n, "dilation", what),
                           int(weight_shape[1]) * groups, what)[0]
    output_layout.__doc__ = (f"The output layout of ``spmd.ops.conv_transpose{n}d`` for an "
                             f"input of ``layout``, without running it.")
    return output_layout


def _conv_transpose(n: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    stride: Any, padding: Any, output_padding: Any, groups: int, dilation: Any,
                    mesh: Mesh, spec: Any) -> torch.Tensor:
    what = f"conv_transpose{n}d"
    check_ndim(x, n, what)
    refuse_split(spec, (1,), what, "the channels, which every output reads")
    _check_weight(x, weight, bias, groups, n, what, transposed=True)
    st, dl = ntuple(stride, n, "stride", what), ntuple(dilation, n, "dilation", what)
    pd = ntuple(padding, n, "padding", what)
    if any(p < 0 for p in pd):
        raise RuntimeError(f"{what}: negative padding is not supported, got {padding!r}")
    opd = ntuple(output_padding, n, "output_padding", what)
    rc, lay = input_layout(x, mesh, spec, what)
    out_lay, plans = _convt_plan(lay, tuple(weight.shape[2:]), st, pd, opd, dl,
                                 weight.shape[1] * groups, what)
    fetches, crops, empty = [], [], False
    for i in range(n):
        dim = 2 + i
        if lay.sizes[dim] is None:
            (a, b), crop = plans[dim][0]
            if crop is not None and (a, b) != (0, lay.shape[dim]):
                x = x.narrow(dim, a, b - a)
        else:
            _, crop = plans[dim][lay.shard_index(rc.rank, dim)]
            fetches.append(plan(rc, lay, dim, tuple(r for r, _ in plans[dim]), name=what))
        empty |= crop is None
        crops.append(crop)
    shape = out_lay.local_shape(rc.rank)
    empty = empty or 0 in shape[2:]
    fwd, bwd = _local_conv((st, (0,) * n, dl, True, groups), shape if empty else None)
    y = windowed(x, fetches, fwd, weight, None, backward=bwd)
    if not empty:
        y = F.pad(y, [c for crop in reversed(crops) for c in crop])  # negative pads crop
    if bias is not None:
        y = y + bias.view(1, -1, *([1] * n))
    return y


@with_layout(_convt_layout(1))
def conv_transpose1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     stride: Any = 1, padding: Any = 0, output_padding: Any = 0,
                     groups: int = 1, dilation: Any = 1, *, mesh: Mesh,
                     spec: Any) -> torch.Tensor:
    """``F.conv_transpose1d`` on this rank's shard of an input split along its length.

    Arguments as ``F.conv_transpose1d`` plus ``mesh`` and ``spec`` (see ``conv1d``).
    The output length is split as the input's for stride 1 when the length is kept,
    else balanced; each output rank fetches the input rows that reach it.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x, w = torch.randn(1, 4, 10), torch.randn(4, 2, 3)
        >>> s = P(None, None, "sp")
        >>> f = lambda x: spmd.ops.conv_transpose1d(x, w, stride=2, padding=1,
        ...                                         output_padding=1, mesh=mesh, spec=s)
        >>> y = spmd.shard_map(f, mesh, s, s)(x)
        >>> ref = F.conv_transpose1d(x, w, stride=2, padding=1, output_padding=1)
        >>> y.shape, torch.allclose(y, ref, atol=1e-6)
        (torch.Size([1, 2, 20]), True)
    """
    return _conv_transpose(1, x, weight, bias, stride, padding, output_padding, groups,
                           dilation, mesh, spec)


@with_layout(_convt_layout(2))
def conv_transpose2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     stride: Any = 1, padding: Any = 0, output_padding: Any = 0,
                     groups: int = 1, dilation: Any = 1, *, mesh: Mesh,
                     spec: Any) -> torch.Tensor:
    """``F.conv_transpose2d`` on a shard split along H, W or both; see
    ``conv_transpose1d``."""
    return _conv_transpose(2, x, weight, bias, stride, padding, output_padding, groups,
                           dilation, mesh, spec)


@with_layout(_convt_layout(3))
def conv_transpose3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     stride: Any = 1, padding: Any = 0, output_padding: Any = 0,
                     groups: int = 1, dilation: Any = 1, *, mesh: Mesh,
                     spec: Any) -> torch.Tensor:
    """``F.conv_transpose3d`` on a shard split along D, H, W; see ``conv_transpose1d``."""
    return _conv_transpose(3, x, weight, bias, stride, padding, output_padding, groups,
                           dilation, mesh, spec)
