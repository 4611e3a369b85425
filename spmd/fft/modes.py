"""An ``rfftn`` that keeps only the low modes, and its inverse: the spectral layers' plans.

A spectral convolution multiplies ``modes`` frequencies per dim by its weights and zeroes
the rest. Transforming everything and dropping most of it afterwards moves the dropped
modes through every transpose. Here the plan of ``spmd.fft.rfftn`` is rewritten so that
each dim is cut to its kept modes right after the stage that transforms it, while it is
whole on every rank: every later transpose, and every later stage, handles only kept
modes. The inverse is that plan run backwards, each cut replaced by zeros put back.

Kept modes, as FNO's: on the halved (last) dim the first ``m``; on the others the first
``m`` and the last ``m`` (positive and negative frequencies), stored as those ``2 m``
rows in that order. A dim with ``2 m >= n`` (or ``m >= n`` on the halved dim) is kept
whole. Exact: a cut commutes with transforms along the other dims, and the zeros put
back are the zeros the weights would have made.

The bytes: a slab ``rfft2`` over ``[H, W]`` transposes ``H x (W/2 + 1)`` per channel; cut
first, ``H x m``; the inverse likewise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..core.layout import Layout
from .plan import (
    MIRROR,
    Crop,
    Plan,
    Reshard,
    Stage,
    Transpose,
    cut,
    forward,
    move,
    resized,
    split_dims,
)

__all__ = ["Keep", "Pad", "spectral_plans", "keep", "pad"]


@dataclass(frozen=True)
class Keep:
    """Cut whole dim ``dim`` of ``src`` (length ``n``) to its kept modes: the first ``m``,
    and with ``two_sided`` the last ``m`` after them."""
    src: Layout
    layout: Layout
    dim: int
    m: int
    two_sided: bool


@dataclass(frozen=True)
class Pad:
    """``Keep``'s inverse: the kept rows back in place in a dim of ``layout.shape[dim]``,
    zeros elsewhere."""
    src: Layout
    layout: Layout
    dim: int
    m: int
    two_sided: bool


def keep(x: torch.Tensor, st: Keep) -> torch.Tensor:
    """This rank's shard cut as ``st`` says (the dim is whole: local shape = global)."""
    n, m, d = st.src.shape[st.dim], st.m, st.dim
    if not st.two_sided:
        return x.narrow(d, 0, m)
    return torch.cat([x.narrow(d, 0, m), x.narrow(d, n - m, m)], d)


def pad(x: torch.Tensor, st: Pad) -> torch.Tensor:
    """This rank's shard with the zeros ``st`` puts back."""
    n, m, d = st.layout.shape[st.dim], st.m, st.dim
    shape = list(x.shape)
    shape[d] = n - (2 * m if st.two_sided else m)
    zeros = x.new_zeros(shape)
    if not st.two_sided:
        return torch.cat([x, zeros], d)
    return torch.cat([x.narrow(d, 0, m), zeros, x.narrow(d, m, m)], d)


def _kept(n: int, m: int, two_sided: bool) -> int:
    return min(n, 2 * m if two_sided else m)


def _prune(p: Plan, keeps: dict[int, tuple[int, bool]]) -> Plan | None:
    """``p`` (a forward plan from ``p.src``) with each dim of ``keeps`` cut right after its
    stage and every later layout resized to match; None where ``p`` has steps this
    rewrite does not cover (a crop by ``s``, a reshard)."""
    if p.lifted:
        return None
    lay, steps = p.src, []
    for st in p.steps:
        if isinstance(st, Stage):
            lay = resized(lay, {d: st.layout.shape[d] for d in st.dims})
            steps.append(Stage(st.kind, st.dims, st.s, lay))
            for d in st.dims:
                if d not in keeps:
                    continue
                m, two = keeps[d]
                n = _kept(lay.shape[d], m, two)
                if n < lay.shape[d]:
                    new = resized(lay, {d: n})
                    steps.append(Keep(lay, new, d, m, two))
                    lay = new
        elif isinstance(st, Transpose) and st.a is not None:
            new = move(lay, st.a, st.b, st.axes)
            steps.append(Transpose(lay, new, st.axes, st.a, st.b))
            lay = new
        elif isinstance(st, (Transpose, Crop, Reshard)):
            return None
    return Plan(p.src, lay, tuple(steps))


def _backwards(p: Plan) -> Plan:
    """The pruned forward plan ``p`` run backwards: from its output to its input."""
    before, lay = [], p.src
    for st in p.steps:
        before.append(lay)
        lay = st.layout
    steps: list = []
    for st, src in zip(reversed(p.steps), reversed(before)):
        if isinstance(st, Stage):
            steps.append(Stage(MIRROR[st.kind], st.dims, st.s, src))
        elif isinstance(st, Transpose):
            steps.append(Transpose(st.layout, st.src, st.axes, st.b, st.a))
        else:
            steps.append(Pad(st.layout, st.src, st.dim, st.m, st.two_sided))
    return Plan(p.out, p.src, tuple(steps))


@lru_cache(maxsize=256)
def spectral_plans(lay: Layout, out: Layout, dims: tuple[int, ...],
                   modes: Sequence[int]) -> tuple[Plan, Plan] | None:
    """The pruned ``rfftn`` of ``lay`` over ``dims`` and the pruned ``irfftn`` back to
    ``out`` (``lay`` but for the channel count: the weights change it in between), keeping
    ``modes[i]`` on ``dims[i]``; None where the two do not meet in one spectral layout
    (then the caller transforms everything)."""
    if len(split_dims(lay, dims)) > 2:  # spmd.fft's own refusal says why
        return None
    s = tuple(lay.shape[d] for d in dims)
    keeps = {d: (m, i < len(dims) - 1) for i, (d, m) in enumerate(zip(dims, modes))}
    fwd = _prune(forward("rfft", lay, dims, s), keeps)
    back = _prune(forward("rfft", out, dims, s), keeps)
    if fwd is None or back is None or cut(fwd.out) != cut(back.out):
        return None
    if any(a != b for d, (a, b) in enumerate(zip(fwd.out.sizes, back.out.sizes)) if d != 1):
        return None
    return fwd, _backwards(back)
