"""Losses whose reduction crosses shards: torch's value and gradient on the global tensors.

Each rank computes torch's per-position loss on its shard (``reduction="none"``), then
``"sum"`` and ``"mean"`` run ONE psum of at most three float64 numbers over the axes that
split the positions: the local sum, what the mean divides by (the local count, or the
local sum of weights: ``weight[target]`` for the class losses, ``weight`` for the
elementwise ones, as torch divides) and, for class indices, how many are out of range
(so that every rank raises, not one). Every rank then holds the global loss. The
backward is autograd's through that psum (its transpose: a psum of the cotangent), so
each position's gradient is torch's ``dloss/dx`` on one device.

Counts and sums of weights travel in float64, so they are exact (to 2**53) whatever
the input's dtype; the per-position losses are torch's, in the input's dtype, summed in
float64 and returned in the input's dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..collectives._anchor import anchor
from ..collectives.primitives import _psum
from ..core._context import RankContext, on_mesh
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P, entry_axes
from ..transforms.spec_arg import reduced_layout, takes_sharded
from .normalization import _spec_axes

__all__ = ["mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss", "cross_entropy"]

_REDUCTIONS = ("none", "mean", "sum")


def _axes(x: torch.Tensor, mesh: Mesh, spec: Any, what: str) -> tuple[P, tuple[str, ...]]:
    """``spec`` checked against ``x``, and the mesh axes that split some dim of it."""
    return _spec_axes(x, mesh, spec, range(x.ndim), what, None)


def _elementwise_layout(lay: Layout, args: dict, y: Any) -> Layout | None:
    """A Sharded input's result: split as the input for ``reduction="none"``, else
    replicated."""
    return lay if args.get("reduction", "mean") == "none" else None


def _class_layout(lay: Layout, args: dict, y: Any) -> Layout | None:
    """As ``_elementwise_layout``, without the class dim."""
    if args.get("reduction", "mean") != "none":
        return None
    return reduced_layout(lay, (1 if lay.ndim >= 2 else 0,), False)


def _reduction(reduction: str, what: str) -> None:
    if reduction not in _REDUCTIONS:
        raise SpecError(f"{what}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _total(local: torch.Tensor, den: torch.Tensor | float | None, reduction: str,
           axes: tuple[str, ...], rc: RankContext, what: str = "",
           bad: torch.Tensor | None = None) -> torch.Tensor:
    """The global sum (or the global mean, ``sum / den`` summed over ranks) of the local
    per-position losses, from ONE psum of [local sum, local den] in float64. ``bad``
    (this rank's count of out-of-range targets) rides in the same psum, so that every
    rank raises together instead of one raising and the others waiting."""
    if reduction == "none":
        return local
    parts = [local.sum(dtype=torch.float64)]
    if reduction == "mean":
        parts.append(torch.as_tensor(den, dtype=torch.float64, device=local.device).reshape(()))
    if bad is not None:
        parts.append(bad.to(torch.float64).reshape(()))
    buf = torch.stack(parts)
    if axes:
        buf = _psum(anchor(buf), axes, rc, "loss")
    if bad is not None and int(buf[-1]) > 0:
        raise IndexError(f"{what}: {int(buf[-1])} target(s) over the ranks are outside "
                         f"[0, classes) and are not ignore_index (raised on every rank)")
    out = buf[0] if reduction == "sum" else buf[0] / buf[1]
    return out.to(local.dtype)


def _elementwise(fn, input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                 reduction: str, mesh: Mesh, spec: Any, what: str, **kw: Any) -> torch.Tensor:
    rc = on_mesh(mesh, what, input)
    _reduction(reduction, what)
    _, axes = _axes(input, mesh, spec, what)
    if target.shape != input.shape:
        raise SpecError(f"{what}: target ({describe(target)}) must have the shape of input "
                        f"({describe(input)}) on every rank: split them the same way "
                        f"(broadcasting a target across shards is ambiguous)")
    if weight is not None:
        if weight.shape != input.shape:
            raise SpecError(f"{what}: weight ({describe(weight)}) must have the shape of input "
                            f"({describe(input)}): pass this rank's shard of it")
        local = fn(input, target, reduction="none", **kw) * weight
        return _total(local, weight.sum(dtype=torch.float64), reduction, axes, rc)
    local = fn(input, target, reduction="none", **kw)
    return _total(local, local.numel(), reduction, axes, rc)


@takes_sharded(_elementwise_layout, also=("target", "weight"))
def mse_loss(input: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean",
             weight: torch.Tensor | None = None, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.mse_loss`` of the global tensors, given this rank's shards of ``input`` and
    ``target`` (and ``weight``, elementwise), all laid out by ``spec``.

    Returns the global loss on every rank (``"mean"``, ``"sum"``), or this rank's shard
    of the per-position losses (``"none"``). The mean divides by the global element
    count, or by the global sum of ``weight``, as torch does.

    Communication: one psum of 2 float64 (``"mean"``) or 1 (``"sum"``) over the axes in
    ``spec`` (none if nothing is split, or for ``"none"``); its backward one psum of as
    many.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, t, s = torch.randn(2, 5), torch.randn(2, 5), P(None, "sp")
        >>> f = lambda x, t: spmd.ops.mse_loss(x, t, mesh=mesh, spec=s)
        >>> y = spmd.shard_map(f, mesh, (s, s), P())(x, t)
        >>> torch.allclose(y, torch.nn.functional.mse_loss(x, t))
        True
    """
    return _elementwise(F.mse_loss, input, target, weight, reduction, mesh, spec, "mse_loss")


@takes_sharded(_elementwise_layout, also=("target", "weight"))
def l1_loss(input: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean",
            weight: torch.Tensor | None = None, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.l1_loss`` of the global tensors; see ``mse_loss``."""
    return _elementwise(F.l1_loss, input, target, weight, reduction, mesh, spec, "l1_loss")


@takes_sharded(_elementwise_layout, also=("target", "weight"))
def smooth_l1_loss(input: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean",
                   beta: float = 1.0, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.smooth_l1_loss`` of the global tensors; see ``mse_loss``."""
    return _elementwise(F.smooth_l1_loss, input, target, None, reduction, mesh, spec,
                        "smooth_l1_loss", beta=beta)


@takes_sharded(_elementwise_layout, also=("target", "weight"))
def huber_loss(input: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean",
               delta: float = 1.0, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.huber_loss`` of the global tensors; see ``mse_loss``."""
    return _elementwise(F.huber_loss, input, target, None, reduction, mesh, spec,
                        "huber_loss", delta=delta)


def _classes(input: torch.Tensor, target: torch.Tensor, mesh: Mesh, spec: Any, what: str,
             soft: bool) -> tuple[RankContext, tuple[str, ...]]:
    """Checks for the class losses: the class dim (1, or 0 for a 1-d input) whole, the
    target shaped like the input's positions (or like the input, for probabilities)."""
    rc = on_mesh(mesh, what, input)
    spec, axes = _axes(input, mesh, spec, what)
    cdim = 1 if input.ndim >= 2 else 0
    if entry_axes(spec.entry(cdim)):
        raise SpecError(f"{what}: the class dim {cdim} of input ({describe(input)}) is split "
                        f"over {entry_axes(spec.entry(cdim))} by spec {spec!r}; keep the classes "
                        f"whole (split the batch or spatial dims), or reshard first")
    want = tuple(input.shape) if soft else tuple(input.shape[:cdim] + input.shape[cdim + 1:])
    if tuple(target.shape) != want:
        kind = "class probabilities shaped like input" if soft else \
            "class indices shaped like input without its class dim"
        raise SpecError(f"{what}: target ({describe(target)}) must be {kind}, {list(want)} "
                        f"here; split input and target the same way")
    return rc, axes


def _class_losses(fn, input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                  ignore_index: int, reduction: str, mesh: Mesh, spec: Any, what: str,
                  soft: bool, **kw: Any) -> torch.Tensor:
    """nll_loss and cross_entropy: torch's per-position losses, and the mean over the
    targets that count, weighted as torch weighs them."""
    _reduction(reduction, what)
    rc, axes = _classes(input, target, mesh, spec, what, soft=soft)
    if soft:
        local = fn(input, target, weight, reduction="none", **kw)
        return _total(local, local.numel(), reduction, axes, rc)
    valid = target != ignore_index
    c = input.shape[1 if input.ndim >= 2 else 0]
    bad = None
    if reduction != "none":
        # torch would raise on this rank alone and leave the others in the psum: count
        # the bad targets into the psum instead, and raise on every rank after it
        out_of_range = valid & ((target < 0) | (target >= c))
        bad = out_of_range.sum()
        target = torch.where(out_of_range, ignore_index, target)
        valid = valid & ~out_of_range
    local = fn(input, target, weight, ignore_index=ignore_index, reduction="none", **kw)
    if weight is None:
        den = valid.sum(dtype=torch.float64)
    else:
        w = weight.detach().to(torch.float64)[target.clamp(min=0, max=c - 1)]
        den = (w * valid).sum()
    return _total(local, den, reduction, axes, rc, what, bad)


@takes_sharded(_class_layout, also=("target",))
def nll_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
             *, ignore_index: int = -100, reduction: str = "mean", mesh: Mesh,
             spec: Any) -> torch.Tensor:
    """``F.nll_loss`` of the global tensors: ``input`` (N, C, d1, ...) of log-probabilities
    laid out by ``spec`` (C whole), ``target`` (N, d1, ...) of class indices split like
    input's positions. ``weight`` (C,) is whole on every rank.

    ``"mean"`` divides by the global sum of ``weight[target]`` over the targets that are
    not ``ignore_index`` (their count without ``weight``), as torch does.

    Communication: ``"mean"``/``"sum"``: one psum of 3 float64; its backward one
    psum of as many.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(2, 3, 5).log_softmax(1)
        >>> t = torch.tensor([[0, 2, 1, -100, 2], [1, 1, 0, 2, -100]])
        >>> f = lambda x, t: spmd.ops.nll_loss(x, t, mesh=mesh, spec=P(None, None, "sp"))
        >>> y = spmd.shard_map(f, mesh, (P(None, None, "sp"), P(None, "sp")), P())(x, t)
        >>> torch.allclose(y, torch.nn.functional.nll_loss(x, t))
        True
    """
    return _class_losses(F.nll_loss, input, target, weight, ignore_index, reduction, mesh,
                         spec, "nll_loss", soft=False)


@takes_sharded(_class_layout, also=("target",))
def cross_entropy(input: torch.Tensor, target: torch.Tensor,
                  weight: torch.Tensor | None = None, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, mesh: Mesh,
                  spec: Any) -> torch.Tensor:
    """``F.cross_entropy`` of the global tensors: ``input`` (N, C, d1, ...) of logits laid
    out by ``spec`` (C whole), ``target`` either class indices (N, d1, ...) split like
    input's positions, or class probabilities shaped and split like input. ``weight``
    (C,) is whole on every rank.

    ``"mean"`` divides as torch does: by the global sum of ``weight[target]`` over the
    targets that are not ``ignore_index`` (class indices), or by the global number of
    positions (probabilities).

    Communication: ``"mean"``/``"sum"``: one psum of 3 float64 (2 for probability
    targets); its backward one psum of as many.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, t = torch.randn(2, 3, 5), torch.randint(0, 3, (2, 5))
        >>> w = torch.tensor([1.0, 2.0, 0.5])
        >>> f = lambda x, t: spmd.ops.cross_entropy(x, t, w, mesh=mesh, spec=P(None, None, "sp"))
        >>> y = spmd.shard_map(f, mesh, (P(None, None, "sp"), P(None, "sp")), P())(x, t)
        >>> torch.allclose(y, torch.nn.functional.cross_entropy(x, t, w))
        True
    """
    return _class_losses(F.cross_entropy, input, target, weight, ignore_index, reduction,
                         mesh, spec, "cross_entropy", soft=target.is_floating_point(),
                         label_smoothing=label_smoothing)
