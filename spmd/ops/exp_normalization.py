"""``softmax``, ``log_softmax`` and ``logsumexp`` over a dim that may be split across ranks.

When ``dim`` is not split the op is torch's, run locally: nothing moves. When it is split
over mesh axes A, each rank reduces its shard to the pair ``(m_r, s_r)``: its local max
over ``dim`` and ``s_r = sum exp(x - m_r)``, both in float32 or better. ONE all-gather of
the pairs over A (2 x output size per rank) lets every rank merge them the same way, in
rank order, with the max-shifted formula ``M = max m_r``, ``S = sum s_r exp(m_r - M)``:
as accurate as one device, and bitwise the same on every rank of A. The backward is ONE
psum over A (output size): of ``(g * y).sum(dim)`` for softmax, ``g.sum(dim)`` for
log_softmax and of the cotangent for logsumexp.

Non-finite values follow torch: a row (the elements that share every index but ``dim``)
whose max is -inf or +inf has a NaN softmax and log_softmax, and a logsumexp of -inf or
+inf; a NaN anywhere in a row makes the row NaN.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op
from ..collectives.primitives import _psum
from ..collectives.vjp import custom_vjp
from ..comm import comm_of
from ..core._context import RankContext
from ..core._format import describe
from ..core.mesh import Mesh
from ..core.spec import entry_axes
from ..transforms.reduction import _dims
from ..transforms.spec_arg import reduced_layout, same_layout, spec_arg, takes_sharded

__all__ = ["softmax", "log_softmax", "logsumexp"]

_HALF = (torch.float16, torch.bfloat16)



def _like_x(x, dim, *, mesh=None, spec=None, dtype=None):
    """softmax's output under torch.compile: x's shape, in ``dtype`` if given."""
    return [(x.shape, dtype or x.dtype)] if isinstance(x, torch.Tensor) else None

@takes_sharded(same_layout)
@graph_op(_like_x)
def softmax(x: torch.Tensor, dim: int, *, mesh: Mesh, spec: Any,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.softmax`` of the global tensor whose shard ``x`` is, over ``dim``.

    Args:
        x: this rank's shard (per-rank code: a shard_map body or a launched function).
        dim: the tensor dim to normalise over (negative allowed); split or not.
        mesh: the mesh the code runs on.
        spec: how the global tensor is laid out over ``mesh``: a ``P``, or a ``Layout``
            (its sizes used, none exchanged); left out when ``x`` is a ``spmd.Sharded``
            (the result is then a Sharded). One convention for every op:
            docs/mesh-and-specs.md.
        dtype: as torch's: ``x`` is cast to it first.

    Returns:
        This rank's shard of the result, laid out by ``spec`` like ``x``, in ``x``'s
        dtype (or ``dtype``). float16/bfloat16 are computed in float32.

    Communication:
        None if ``dim`` is not split. Otherwise one all-gather named ``"softmax"`` over
        the axes that split ``dim``, of the local (max, sum of exp) pairs: 2 x output
        size, float32 or better, per rank.

    Backward:
        ``y * (g - psum((g * y).sum(dim)))``: one psum of output size over those axes.

    Ranks without data:
        A zero-size shard contributes (-inf, 0) to the merge, gets an empty result and a
        zero-size gradient, and takes part in both collectives.

    Raises:
        SpecError: dim out of range; a spec with an unknown axis or more entries than x
            has dims; a mesh other than the one this code runs on. All before any
            communication, on every rank alike.
        TypeError: x (or ``dtype``) is not a real floating dtype.

    Example:
        >>> from spmd.ops import softmax
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> f = lambda x: softmax(x, 0, mesh=mesh, spec=P("sp"))
        >>> y = spmd.shard_map(f, mesh, P("sp"), P("sp"))(torch.tensor([0.0, 1.0, 2.0]))
        >>> torch.allclose(y, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0))
        True
    """
    x, dims, axes, rc = _prepare(x, dim, mesh, spec, dtype, "softmax", many=False)
    if not axes:
        return torch.softmax(x, dims[0])
    return _softmax(anchor(x), dims, axes, rc)


@takes_sharded(same_layout)
@graph_op(_like_x)
def log_softmax(x: torch.Tensor, dim: int, *, mesh: Mesh, spec: Any,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.log_softmax`` of the global tensor whose shard ``x`` is, over ``dim``.

    Args, Returns, Raises: as ``softmax``.

    Communication:
        None if ``dim`` is not split; otherwise one all-gather named ``"log_softmax"``
        (2 x output size per rank), as ``softmax``.

    Backward:
        ``g - exp(y) * psum(g.sum(dim))``: one psum of output size.

    Ranks without data:
        As ``softmax``.

    Example:
        >>> from spmd.ops import log_softmax
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
        >>> f = lambda x: log_softmax(x, 1, mesh=mesh, spec=P(None, "sp"))
        >>> y = spmd.shard_map(f, mesh, P(None, "sp"), P(None, "sp"))(x)
        >>> torch.allclose(y, torch.log_softmax(x, 1))
        True
    """
    x, dims, axes, rc = _prepare(x, dim, mesh, spec, dtype, "log_softmax", many=False)
    if not axes:
        return torch.log_softmax(x, dims[0])
    return _log_softmax(anchor(x), dims, axes, rc)


@takes_sharded(lambda lay, a, y: reduced_layout(
    lay, _dims(a["dim"], lay.ndim, "", "logsumexp"), a.get("keepdim", False)))
def logsumexp(x: torch.Tensor, dim: int | Sequence[int], keepdim: bool = False, *,
              mesh: Mesh, spec: Any) -> torch.Tensor:
    """``torch.logsumexp`` of the global tensor whose shard ``x`` is, over ``dim``.

    Args:
        x: this rank's shard (per-rank code). Integer tensors are promoted to the
            default float dtype, as torch does.
        dim: an int or a non-empty tuple of ints (negative allowed); split or not.
        keepdim: keep the reduced dims with size 1.
        mesh, spec: as ``softmax``.

    Returns:
        The logsumexp of the global tensor restricted to this rank's part of the dims
        that are not reduced: replicated over the axes that split the reduced dims, laid
        out by ``spec`` with the reduced dims' entries set to None (``keepdim=True``) or
        dropped. An empty reduction gives -inf, as torch.

    Communication:
        None if no reduced dim is split. Otherwise one all-gather named ``"logsumexp"``
        of the local (max, sum of exp) pairs, 2 x output size per rank.

    Backward:
        ``psum(g) * exp(x - y)``: one psum of output size (every rank's output is its own
        variable, so the cotangents of the ranks that reduced together add up).

    Ranks without data:
        As ``softmax``.

    Raises:
        SpecError: dim out of range, repeated or empty; spec or mesh as ``softmax``.
        TypeError: a complex x.

    Example:
        >>> from spmd.ops import logsumexp
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> f = lambda x: logsumexp(x, 0, mesh=mesh, spec=P("sp"))
        >>> x = torch.tensor([0.0, 1.0, 2.0])
        >>> y = spmd.shard_map(f, mesh, P("sp"), P())(x)
        >>> torch.allclose(y, torch.logsumexp(x, 0))
        True
    """
    if isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
        x = x.to(torch.get_default_dtype())  # torch.logsumexp promotes integers too
    x, dims, axes, rc = _prepare(x, dim, mesh, spec, None, "logsumexp", many=True)
    if not axes:
        return torch.logsumexp(x, dims, keepdim=keepdim)
    out = _logsumexp(anchor(x), dims, axes, rc)
    return out if keepdim else out.squeeze(dims)


# -- checks: from the spec and the arguments only, the same on every rank ----------------------

def _prepare(x: Any, dim: Any, mesh: Mesh, spec: Any, dtype: torch.dtype | None, what: str,
             many: bool) -> tuple[torch.Tensor, tuple[int, ...], tuple[str, ...], RankContext]:
    """Validate; return x (cast to ``dtype``), the reduced dims, the mesh axes that split
    them (in mesh order; empty: no communication) and the rank context."""
    arg = spec_arg(x, mesh, spec, what)
    rc, spec = arg.rc, arg.spec
    # A 0-d x is never split: its one "dim" makes torch run locally.
    dims = _dims(dim, x.ndim, describe(x), what, many=many, every=False) or (0,)
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{what}: dtype must be a floating torch.dtype, got {dtype!r}")
        x = x.to(dtype)
    if not x.is_floating_point():
        raise TypeError(f"{what}: needs a real floating-point x, got {describe(x)}; pass "
                        f"dtype=torch.float32 (or convert x) first")
    used = {a for d in dims for a in entry_axes(spec.entry(d))}
    return x, dims, tuple(a for a in mesh.axis_names if a in used), rc


# -- the merge: one all-gather of (local max, local sum of exp) -------------------------------

def _stats(x: torch.Tensor, dims: tuple[int, ...], axes: tuple[str, ...], rc: RankContext,
           name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x32, M, S)`` with keepdim shapes: x in the compute dtype, the global max ``M``
    over ``dims`` and ``S = sum exp(x - C)``, where ``C`` is ``M`` where finite, else 0
    (torch's logsumexp shift: the sum then gives -inf or +inf, not NaN)."""
    x32 = _up(x)
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    if any(x.shape[d] == 0 for d in dims):  # an empty shard: the merge's identity
        m = x32.new_full(shape, -math.inf)
        s = x32.new_zeros(shape)
    else:
        m = torch.amax(x32, dims, keepdim=True)
        s = torch.exp(x32 - _shift(m)).sum(dims, keepdim=True)
    group = rc.mesh.group(axes, rc.rank)
    parts = comm_of(rc.mesh).all_gather(torch.stack([m, s]).unsqueeze(0), group, 0, name=name,
                                        sizes=(1,) * group.size)
    got = torch.cat(parts)  # (group size, 2, *shape), in group order on every rank
    ms, ss = got[:, 0], got[:, 1]
    M = torch.amax(ms, 0)  # NaN propagates, as in torch
    # s_r == 0 only where m_r == -inf (a shard with no data or only -inf); its term is 0
    # even where exp(c_r - C) overflows, which would otherwise give 0 * inf = NaN.
    terms = torch.where(ss == 0, 0.0, ss * torch.exp(_shift(ms) - _shift(M)))
    return x32, M, terms.sum(0)


def _up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the compute dtype: float32 for float16/bfloat16 (sums and exponentials
    are never taken in half precision), else its own."""
    return t.float() if t.dtype in _HALF else t


def _shift(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(m), m, 0.0)


def _nan_unless_finite(M: torch.Tensor) -> torch.Tensor:
    """The shift for softmax/log_softmax: ``M``, or NaN where the max is not finite, as
    torch's ``x - max`` gives for a row of -inf or one holding +inf."""
    return torch.where(torch.isfinite(M), M, math.nan)


@custom_vjp
def _softmax(x, dims, axes, rc):
    return _softmax_fwd(x, dims, axes, rc)[0]


def _softmax_fwd(x, dims, axes, rc):
    x32, M, S = _stats(x, dims, axes, rc, "softmax")
    y = (torch.exp(x32 - _nan_unless_finite(M)) / S).to(x.dtype)
    return y, (y, dims, axes, rc)  # keeps y only, as torch.softmax does


def _softmax_bwd(res, g):
    y, dims, axes, rc = res
    y32, g32 = _up(y), _up(g)
    with rc:
        dot = _psum(anchor((g32 * y32).sum(dims, keepdim=True)), axes, rc, "softmax")
    return (y32 * (g32 - dot)).to(y.dtype), None, None, None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@custom_vjp
def _log_softmax(x, dims, axes, rc):
    return _log_softmax_fwd(x, dims, axes, rc)[0]


def _log_softmax_fwd(x, dims, axes, rc):
    x32, M, S = _stats(x, dims, axes, rc, "log_softmax")
    y = (x32 - _nan_unless_finite(M) - torch.log(S)).to(x.dtype)
    return y, (y, dims, axes, rc)


def _log_softmax_bwd(res, g):
    y, dims, axes, rc = res
    g32 = _up(g)
    with rc:
        gs = _psum(anchor(g32.sum(dims, keepdim=True)), axes, rc, "log_softmax")
    return (g32 - torch.exp(_up(y)) * gs).to(y.dtype), None, None, None


_log_softmax.defvjp(_log_softmax_fwd, _log_softmax_bwd)


@custom_vjp
def _logsumexp(x, dims, axes, rc):
    return _logsumexp_fwd(x, dims, axes, rc)[0]


def _logsumexp_fwd(x, dims, axes, rc):
    _, M, S = _stats(x, dims, axes, rc, "logsumexp")
    lse = _shift(M) + torch.log(S)  # keepdim; stays in the compute dtype for backward
    return lse.to(x.dtype), (x, lse, dims, axes, rc)


def _logsumexp_bwd(res, g):
    x, lse, dims, axes, rc = res
    with rc:  # every rank's output is its own variable: the group's cotangents add up
        gs = _psum(anchor(g.to(lse.dtype)), axes, rc, "logsumexp")
    return (gs * torch.exp(_up(x) - lse)).to(x.dtype), None, None, None


_logsumexp.defvjp(_logsumexp_fwd, _logsumexp_bwd)

