"""``pad``: ``F.pad`` on a sharded tensor.

The padding goes to the edge shards: the cuts between ranks stay at the same input
elements, the first rank grows by the left pad and the last by the right one (a
negative pad crops, into the next rank if the edge shard is too small). So a constant
pad moves nothing, a reflect, replicate or circular pad moves only the rows its edge
ranks read, and a chain of pads keeps every interior shard where it was.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ._window import fetch, input_layout, mode_error, out_layout, with_layout

__all__ = ["pad"]

_MODES = ("constant", "reflect", "replicate", "circular")


def _pairs(pad: Sequence[int], ndim: int) -> dict[int, tuple[int, int]]:
    """F.pad's flat tuple (last dim first) as {dim: (lo, hi)}."""
    if (not isinstance(pad, (tuple, list)) or len(pad) % 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in pad)):
        raise SpecError(f"pad: pad must be a tuple of an even number of ints (last dim "
                        f"first, as F.pad), got {pad!r}")
    if len(pad) // 2 > ndim:
        raise SpecError(f"pad: {len(pad) // 2} dims to pad but the input has {ndim}")
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


@lru_cache(maxsize=256)
def _pad_plan(layout: Layout, pads: tuple[tuple[int, int, int], ...], mode: str):
    """(output layout, {dim: every member's input range along dim})."""
    shape, sizes, ranges = list(layout.shape), {}, {}
    for dim, lo, hi in pads:
        L = layout.shape[dim]
        n_out = L + lo + hi
        if L + min(lo, 0) + min(hi, 0) < 0:  # F.pad crops before it pads
            raise RuntimeError(f"pad: padding ({lo}, {hi}) at dim {dim} crops more than the "
                               f"global size {L}")
        if mode != "constant":
            mode_error("pad", L, max(lo, 0), max(hi, 0), mode, dim, layout.shape)
        shape[dim] = n_out
        in_sizes = layout.sizes[dim]
        if in_sizes is None:
            ranges[dim] = ((-lo, L + hi),)
            continue
        cuts, start = [0], 0
        for s in in_sizes[:-1]:
            start += s
            cuts.append(min(max(start + lo, 0), n_out))  # the cut stays at the same element
        cuts.append(n_out)
        sizes[dim] = tuple(b - a for a, b in zip(cuts, cuts[1:]))
        ranges[dim] = tuple((a - lo, max(a, b) - lo) for a, b in zip(cuts, cuts[1:]))
    return out_layout(layout, shape, sizes), ranges


def _steps(pairs: dict[int, tuple[int, int]], mode: str) -> list[tuple[tuple, str]]:
    """F.pad crops before it reflects or wraps (a circular pad wraps the cropped tensor),
    so a pad mixing crops with a non-constant mode is two steps."""
    key = tuple((d, lo, hi) for d, (lo, hi) in sorted(pairs.items()))
    if mode == "constant" or all(lo >= 0 and hi >= 0 for _, lo, hi in key):
        return [(key, mode)]
    return [(tuple((d, min(lo, 0), min(hi, 0)) for d, lo, hi in key), "constant"),
            (tuple((d, max(lo, 0), max(hi, 0)) for d, lo, hi in key), mode)]


def _output_layout(layout: Layout, pad: Sequence[int], mode: str = "constant") -> Layout:
    """The output layout of ``spmd.ops.pad`` for an input of ``layout``."""
    for key, m in _steps(_pairs(pad, layout.ndim), mode):
        layout = _pad_plan(layout, key, m)[0]
    return layout


@with_layout(_output_layout)
def pad(x: torch.Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None,
        *, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.pad`` of the global tensor, on this rank's shard.

    Args:
        x: this rank's shard.
        pad, mode, value: as ``F.pad`` (``pad`` lists the last dim first; negative
            entries crop). Every mode works on any dim of any tensor.
        mesh: the mesh the code runs on.
        spec: ``x``'s spec (``P``; shard sizes are exchanged) or ``Layout``.

    Returns:
        This rank's shard of the padded tensor; the edge ranks hold the padding (see
        ``pad.output_layout``).

    Raises:
        RuntimeError: a reflect or circular pad the global size cannot provide, or a
            crop below zero (as ``F.pad`` on one device), on every rank.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> f = lambda x: spmd.ops.pad(x, (2, 1), mode="reflect", mesh=mesh, spec=P("sp"))
        >>> spmd.shard_map(f, mesh, P("sp"), P("sp"))(torch.arange(5.0)).tolist()
        [2.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 3.0]
    """
    if mode not in _MODES:
        raise SpecError(f"pad: mode must be one of {_MODES}, got {mode!r}")
    if value is not None and mode != "constant":
        raise SpecError(f"pad: value is only for mode='constant', got mode={mode!r}")
    pairs = _pairs(pad, x.ndim)
    rc, lay = input_layout(x, mesh, spec, "pad")
    for key, m in _steps(pairs, mode):
        out, ranges = _pad_plan(lay, key, m)
        for dim, lo, hi in key:
            if lo or hi:
                x = fetch(x, rc, lay, dim, ranges[dim], m, 0.0 if value is None else value,
                          name="pad")
        lay = out
    return x
