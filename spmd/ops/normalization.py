"""Normalisation over sharded dims, as accurate as one device.

Every op here rests on ``moments``: each rank computes its shard's (count, mean, M2) in
float32 (float64 for float64 inputs) with a two-pass sum, the ranks of the axes that
split the reduced dims exchange them in ONE all_gather (float64, so counts are exact
to 2**53), and every rank merges them the same way, in group order:

    N = sum n_r,   mean = sum n_r * mean_r / N,   M2 = sum M2_r + sum n_r (mean_r - mean)**2

(Chan et al.'s parallel variance, all shards at once). The usual shortcut, one
all-reduce of [sum x, sum x**2] and var = E[x**2] - E[x]**2, cancels catastrophically:
on x ~ N(1000, 1) it is off by 0.16 in float32 where one device is off by 1e-4.

The norms differentiate in closed form (``_standardize``: torch's formula, whose two
sums over the normalised elements are one psum of O(statistics) in backward), saving
only the input and the statistics; ``moments`` itself, whose outputs are the
statistics, differentiates through the merge and the all_gather (its transpose, one
psum_scatter of O(statistics)). Empty shards contribute count 0 and still take part in
every collective.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op, like_input
from ..collectives.primitives import _all_gather, _psum
from ..collectives.vjp import custom_vjp
from ..comm import comm_of
from ..core._context import RankContext, on_mesh
from ..core._format import describe
from ..core.errors import SpecError
from ..core.mesh import Mesh
from ..core.spec import P, entry_axes
from ..transforms.reduction import _dims
from ..transforms.spec_arg import reduced_layout, same_layout, spec_arg, takes_sharded
from ._window import input_layout, refuse_split

__all__ = ["moments", "group_norm", "layer_norm", "instance_norm", "batch_norm", "rms_norm"]


def _acc(x: torch.Tensor, what: str) -> torch.dtype:
    """The dtype statistics accumulate in: float32, or float64 for float64 (as torch)."""
    if not x.is_floating_point():
        raise SpecError(f"{what}: expected a floating-point x, got {describe(x)}")
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _spec_axes(x: torch.Tensor, mesh: Mesh, spec: Any, dims: Sequence[int], what: str,
               axes: Any) -> tuple[P, tuple[str, ...]]:
    """``spec`` checked against ``x``, and the mesh axes whose ranks' statistics merge:
    those that split a reduced dim (``axes`` narrows them: per-replica statistics)."""
    spec = spec_arg(x, mesh, spec, what).spec
    used = {a for d in dims for a in entry_axes(spec.entry(d))}
    if axes is not None:
        keep = set(mesh.check_axes(axes, f"{what}: axes"))
        if not keep <= used:
            raise SpecError(f"{what}: axes={tuple(keep)} names axes that split none of the "
                            f"normalised dims {list(dims)} under spec {spec!r} (they split "
                            f"{sorted(used) or 'nothing'})")
        used = keep
    return spec, tuple(a for a in mesh.axis_names if a in used)


def _merge(n: int, mean: torch.Tensor, m2: torch.Tensor, axes: tuple[str, ...],
           rc: RankContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (count, mean, M2) from every rank's, in one all_gather (see the module);
    the mean in float64, M2 in m2's dtype."""
    if not axes:
        return torch.tensor(float(n), dtype=torch.float64), mean, m2
    count = torch.full_like(mean, float(n), dtype=torch.float64)
    local = torch.stack([count, mean.to(torch.float64), m2.to(torch.float64)])
    got = _all_gather(anchor(local), axes, rc, 0, False, None)  # (P, 3, ...)
    ns, means, m2s = got[:, 0], got[:, 1], got[:, 2]
    total = ns.sum(0)
    # An all-empty group has no mean (torch: NaN); n_r = 0 shards weigh nothing.
    gmean = (ns * means).sum(0) / total
    gm2 = m2s.sum(0) + (ns * (means - gmean) ** 2).sum(0)
    return total, gmean, gm2.to(m2.dtype)


def _shard_moments(x: torch.Tensor, dims: tuple[int, ...], axes: tuple[str, ...],
                   acc: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor]:
    """This shard's (count, mean, M2) over ``dims`` (kept as size-1 dims): the mean in
    float64, M2 in ``acc``; differentiable.

    Two passes in ``acc`` (float32 for half precision): mean = sum(x) / n, then
    M2 = ||x - mean||^2, corrected by the residuals' sum r (mean += r / n,
    M2 -= r^2 / n: the corrected two-pass algorithm), so the mean is as exact as the
    merge's float64. The shortcut sum(x^2) - n mean^2 is off by 19% in float32 on
    N(1000, 1), and accumulating it in float64 costs a float64 copy of x."""
    n = math.prod(x.shape[d] for d in dims)
    if not x.numel():  # an empty shard: weighted by its count, 0
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        mean, m2 = x.new_zeros(shape, dtype=torch.float64), x.new_zeros(shape, dtype=acc)
        return n, (mean if axes or n else mean + math.nan), m2
    mean = x.sum(dims, keepdim=True, dtype=acc) / n
    d = x - mean
    r = d.sum(dims, keepdim=True)
    # squared in place where no graph needs d (the norms' statistics): no second copy
    sq = d * d if d.requires_grad else d.square_()
    m2 = sq.sum(dims, keepdim=True) - r * r / n
    return n, mean.to(torch.float64) + r.to(torch.float64) / n, m2.to(acc)


def _moments(x: torch.Tensor, dims: tuple[int, ...], axes: tuple[str, ...], rc: RankContext,
             acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global count, mean, M2) over ``dims`` (kept as size-1 dims), in ``acc``, with
    autograd's gradient through the shard moments, the all_gather and the merge."""
    total, mean, m2 = _merge(*_shard_moments(x, dims, axes, acc), axes, rc)
    return total, mean.to(acc), m2


@takes_sharded(lambda lay, a, y: reduced_layout(
    lay, _dims(a.get("dim"), lay.ndim, "", "moments"), a.get("keepdim", False)))
def moments(x: torch.Tensor, dim: int | Sequence[int] | None = None, *, mesh: Mesh,
            spec: Any, correction: int = 0, keepdim: bool = False,
            axes: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of the global tensor whose shard is ``x``, over ``dim``, like
    ``torch.var_mean(global_x, dim, correction=correction, keepdim=keepdim)`` (the
    other way round: ``(mean, var)``).

    Args:
        x: this rank's shard (per-rank code: a shard_map body or a launched function).
        dim: an int, a tuple of ints, or None for all dims; split dims are fine.
        mesh, spec: the mesh, and how the global tensor is laid out over it: a ``P`` or a
            ``Layout``; ``x`` may be a ``spmd.Sharded`` (docs/mesh-and-specs.md).
        correction: subtracted from the count in the variance's divisor (1: unbiased).
        keepdim: keep the reduced dims with size 1.
        axes: merge only over these mesh axes (default: every axis that splits a
            reduced dim); e.g. per-replica batch statistics on a (dp, sp) mesh.

    Returns:
        ``(mean, var)`` in float32 (float64 for float64 x), replicated over the merged
        axes. Half-precision inputs accumulate in float32, as torch's kernels do.

    Communication: one all_gather of (count, mean, M2) per statistic, in float64, over
    the merged axes (none if no reduced dim is split); its backward is one psum_scatter.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> f = lambda x: spmd.ops.moments(x, 0, mesh=mesh, spec=P("sp"))
        >>> m, v = spmd.shard_map(f, mesh, P("sp"), (P(), P()))(torch.tensor([1., 2., 3., 6.]))
        >>> m.item(), v.item()
        (3.0, 3.5)
    """
    rc = on_mesh(mesh, "moments", x)
    acc = _acc(x, "moments")
    dims = _dims(dim, x.ndim, describe(x), "moments")
    _, ax = _spec_axes(x, mesh, spec, dims, "moments", axes)
    total, mean, m2 = _moments(x, dims, ax, rc, acc)
    var = m2 / (total - correction).clamp_min(0).to(m2.dtype)
    if not keepdim:
        for d in sorted(dims, reverse=True):
            mean, var = mean.squeeze(d), var.squeeze(d)
    return mean, var


def _stats(x: torch.Tensor, dims: tuple[int, ...], axes: tuple[str, ...], rc: RankContext,
           acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (count, mean, M2) over ``dims`` (kept as size-1 dims; the mean in float64),
    without a graph: the norms differentiate through them in closed form
    (``_standardize``)."""
    with torch.no_grad():
        return _merge(*_shard_moments(x.detach(), dims, axes, acc), axes, rc)


@custom_vjp
def _standardize(x, mean, lo, rstd, total, w, b, dims, axes, rc):
    # x - mean first (no cancellation when |mean| >> std, unlike x * scale + shift), the
    # mean in two parts (mean + lo: its float64 value), then in place: one new tensor
    y = _centered(x, mean, lo).mul_(rstd if w is None else rstd * w.to(rstd.dtype))
    return y if b is None else y.add_(b.to(rstd.dtype))


def _centered(x: torch.Tensor, mean: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """x - (mean + lo) in mean's dtype: exact where x and mean are close (|mean| >> std)."""
    return torch.sub(x.to(mean.dtype), mean).sub_(lo)


def _standardize_fwd(x, mean, lo, rstd, total, w, b, dims, axes, rc):
    return _standardize(x, mean, lo, rstd, total, w, b, dims, axes, rc), (
        x, mean, lo, rstd, total, w, b, dims, axes, rc)


def _to_shape(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` summed over the dims where ``shape`` is 1 (a broadcast's transpose)."""
    red = tuple(d for d, (a, s) in enumerate(zip(t.shape, shape)) if s == 1 and a != 1)
    return t.sum(red, keepdim=True) if red else t


def _standardize_bwd(res, g):
    """y = (x - mean) * rstd * w + b with mean and rstd the global statistics of x over
    ``dims``: torch's closed form, dx = rstd * (gw - (sum gw + xhat * sum(gw * xhat)) / N)
    with gw = g * w, whose two sums over the normalised elements are ONE psum of
    O(statistics) across the shards. x - mean is formed once (never x * a + b, which
    cancels when |mean| >> std) and becomes dx in place, so x's size is allocated twice
    (it and one product); the rest works on per-cell sums, a cell being where
    statistics and affine parameters are both constant. Weight and bias get this
    rank's part of their gradient (shard_map or GradSync sums the parts)."""
    x, mean, lo, rstd, total, w, b, dims, axes, rc = res
    dt = rstd.dtype
    gf = g.to(dt)
    t = _centered(x, mean, lo)
    cell = torch.broadcast_shapes(mean.shape, w.shape if w is not None else mean.shape)
    red = tuple(d for d in range(x.ndim) if cell[d] == 1 and x.shape[d] != 1)
    sg = gf.sum(red, keepdim=True) if red else gf
    gxhat = rstd * ((gf * t).sum(red, keepdim=True) if red else gf * t)  # sum of g * xhat
    wf = w.to(dt) if w is not None else None
    s1, s2 = (sg, gxhat) if wf is None else (sg * wf, gxhat * wf)
    sums = torch.stack([_to_shape(s1, mean.shape), _to_shape(s2, mean.shape)])
    if axes:
        with rc:
            sums = _psum(sums, axes, rc, "psum")
    k = rstd / total.to(dt)
    scale = rstd if wf is None else rstd * wf
    dx = t.mul_(-k * rstd * sums[1]).sub_(k * sums[0]).addcmul_(gf, scale)
    gw = None if w is None else _to_shape(gxhat, w.shape).to(w.dtype)
    gb = None if b is None else _to_shape(sg, b.shape).to(b.dtype)
    return dx.to(x.dtype), None, None, None, None, gw, gb, None, None, None


_standardize.defvjp(_standardize_fwd, _standardize_bwd)


def _normalize(x: torch.Tensor, dims: tuple[int, ...], eps: float, axes: tuple[str, ...],
               rc: RankContext, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """(x - mean) / sqrt(var + eps) * weight + bias in the accumulation dtype (biased
    var; weight and bias broadcast against x, constant along ``dims`` or not), and the
    global (count, mean, M2)."""
    acc = _acc(x, "normalisation")
    total, mean, m2 = _stats(x, dims, axes, rc, acc)
    rstd = torch.rsqrt(m2 / total.clamp_min(1).to(m2.dtype) + eps)
    hi = mean.to(acc)
    return _standardize(anchor(x) if axes else x, hi, (mean - hi).to(acc), rstd, total,
                        weight, bias, dims, axes, rc), (total, mean, m2)


def _affine(y: torch.Tensor, weight, bias, shape: tuple[int, ...]) -> torch.Tensor:
    if weight is not None and bias is not None:  # one pass
        return torch.addcmul(bias.to(y.dtype).reshape(shape), y,
                             weight.to(y.dtype).reshape(shape))
    if weight is not None:
        y = y * weight.to(y.dtype).reshape(shape)
    if bias is not None:
        y = y + bias.to(y.dtype).reshape(shape)
    return y


def _channel_split(spec: Any, what: str) -> None:
    refuse_split(spec, (1,), what, "the channels, whose statistics are separate")


@takes_sharded(same_layout)
@graph_op(like_input)
def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, mesh: Mesh,
               spec: Any) -> torch.Tensor:
    """``F.group_norm`` on this rank's shard of (N, C, *spatial) split along N and/or
    spatial dims; statistics per sample and group over the whole global sample.

    Communication: one all_gather of (count, mean, M2) per (sample, group) over the axes
    that split spatial dims, and in backward one psum of two sums per (sample, group);
    none if only N (or nothing) is split.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, s = torch.randn(2, 4, 5, 3), P(None, None, "sp")
        >>> f = lambda x: spmd.ops.group_norm(x, 2, mesh=mesh, spec=s)
        >>> ref = torch.nn.functional.group_norm(x, 2)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-5)
        True
    """
    what = "group_norm"
    rc = on_mesh(mesh, what, x)
    if x.ndim < 2:
        raise SpecError(f"{what}: expected (N, C, ...), got {describe(x)}")
    _channel_split(spec, what)
    n, c = x.shape[0], x.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise RuntimeError(f"{what}: expected the number of channels ({c}) to be divisible "
                           f"by num_groups ({num_groups})")
    spec = spec_arg(x, mesh, spec, what).spec
    xg = x.reshape(n, num_groups, c // num_groups, *x.shape[2:])
    gspec = P(spec.entry(0), None, None, *(spec.entry(d) for d in range(2, x.ndim)))
    dims = tuple(range(2, xg.ndim))
    _, axes = _spec_axes(xg, mesh, gspec, dims, what, None)
    wshape = (1, num_groups, c // num_groups) + (1,) * (x.ndim - 2)
    y, _ = _normalize(xg, dims, eps, axes, rc, None if weight is None else
                      weight.reshape(wshape), None if bias is None else bias.reshape(wshape))
    return y.reshape(x.shape).to(x.dtype)


def _trailing(x: torch.Tensor, normalized_shape: Sequence[int], mesh: Mesh, spec: Any,
              rc: RankContext, what: str, affine: tuple) -> tuple[tuple[int, ...],
                                                                 tuple[str, ...], list]:
    """layer_norm's and rms_norm's last dims, the axes that split them, and each global
    affine tensor cut to this rank's slice of those dims (a shape exchange when they are
    split and ``spec`` is a P: the slice's offset depends on the other ranks' sizes)."""
    shape = tuple(int(s) for s in normalized_shape)
    k = len(shape)
    if not 0 < k <= x.ndim:
        raise SpecError(f"{what}: normalized_shape {list(shape)} does not fit {describe(x)}")
    dims = tuple(range(x.ndim - k, x.ndim))
    pspec, axes = _spec_axes(x, mesh, spec, dims, what, None)
    if not any(entry_axes(pspec.entry(d)) for d in dims):
        if tuple(x.shape[-k:]) != shape:
            raise RuntimeError(f"{what}: normalized_shape {list(shape)} but x is {describe(x)}")
        return dims, axes, list(affine)
    if all(t is None for t in affine):
        return dims, axes, list(affine)
    _, layout = input_layout(x, mesh, spec, what)
    if layout.shape[-k:] != shape:
        raise SpecError(f"{what}: normalized_shape {list(shape)} but the global tensor is "
                        f"{list(layout.shape)}")
    sl = layout.slices(rc.rank)[-k:]
    return dims, axes, [None if t is None else t[sl] for t in affine]


@takes_sharded(same_layout)
@graph_op(like_input)
def layer_norm(x: torch.Tensor, normalized_shape: Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, *, mesh: Mesh, spec: Any) -> torch.Tensor:
    """``F.layer_norm`` over the last ``len(normalized_shape)`` dims of the global
    tensor, split dims among them or not. ``normalized_shape``, ``weight`` and
    ``bias`` are global; each rank applies its slice of them.

    Communication: one all_gather of (count, mean, M2) per normalised row over the axes
    that split normalised dims, and in backward one psum of two sums per row (none if
    they are whole: no bytes); with an affine over a
    split dim given a ``P``, also the small exchange of shard shapes that tells each
    rank its slice (a ``Layout`` as ``spec`` saves it).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, s = torch.randn(3, 8), P(None, "sp")
        >>> f = lambda x: spmd.ops.layer_norm(x, (8,), mesh=mesh, spec=s)
        >>> ref = torch.nn.functional.layer_norm(x, (8,))
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-5)
        True
    """
    what = "layer_norm"
    rc = on_mesh(mesh, what, x)
    dims, axes, (weight, bias) = _trailing(x, normalized_shape, mesh, spec, rc, what,
                                           (weight, bias))
    k = len(dims)
    y, _ = _normalize(x, dims, eps, axes, rc)
    lead = (1,) * (x.ndim - k)
    y = _affine(y, weight, bias, lead + tuple(x.shape[-k:]))
    return y.to(x.dtype)


@takes_sharded(same_layout)
@graph_op(like_input)
def rms_norm(x: torch.Tensor, normalized_shape: Sequence[int],
             weight: torch.Tensor | None = None, eps: float | None = None, *, mesh: Mesh,
             spec: Any) -> torch.Tensor:
    """``F.rms_norm``: x / sqrt(mean(x**2) + eps) over the last dims of the global
    tensor (``eps`` None: the dtype's machine epsilon, as torch), times ``weight``.

    Communication: one all_gather of (count, mean of squares) per row, as layer_norm.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, s = torch.randn(3, 8), P(None, "sp")
        >>> f = lambda x: spmd.ops.rms_norm(x, (8,), mesh=mesh, spec=s)
        >>> ref = torch.nn.functional.rms_norm(x, (8,))
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-5)
        True
    """
    what = "rms_norm"
    rc = on_mesh(mesh, what, x)
    acc = _acc(x, what)
    dims, axes, (weight,) = _trailing(x, normalized_shape, mesh, spec, rc, what, (weight,))
    k = len(dims)
    xf = x.to(acc)
    n = math.prod(x.shape[d] for d in dims)
    ms = (xf * xf).sum(dims, keepdim=True) / max(n, 1)
    # The mean of squares merges as a mean: (count, mean) with a zero M2.
    total, ms, _ = _merge(n, ms, torch.zeros_like(ms), axes, rc)
    e = torch.finfo(x.dtype).eps if eps is None else eps
    y = xf * torch.rsqrt(ms + e)
    y = _affine(y, weight, None, (1,) * (x.ndim - k) + tuple(x.shape[-k:]))
    return y.to(x.dtype)


# A custom op may not mutate its inputs: a call that updates running statistics in
# place runs eagerly under torch.compile (meta None).

def _instance_meta(x, running_mean=None, running_var=None, weight=None, bias=None,
                   use_input_stats=True, *args, **kwargs):
    updates = use_input_stats and (running_mean is not None or running_var is not None)
    return None if updates else like_input(x)


def _batch_meta(x, running_mean=None, running_var=None, weight=None, bias=None,
                training=False, *args, **kwargs):
    updates = training and (running_mean is not None or running_var is not None)
    return None if updates else like_input(x)


@takes_sharded(same_layout)
@graph_op(_instance_meta)
def instance_norm(x: torch.Tensor, running_mean: torch.Tensor | None = None,
                  running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5, *, mesh: Mesh,
                  spec: Any) -> torch.Tensor:
    """``F.instance_norm``: statistics per sample and channel over the spatial dims of
    the global tensor. Running statistics (if given) are updated as torch does: the
    batch's per-instance statistics averaged over samples, the variance unbiased.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, s = torch.randn(2, 3, 6, 5), P(None, None, "sp")
        >>> f = lambda x: spmd.ops.instance_norm(x, mesh=mesh, spec=s)
        >>> ref = torch.nn.functional.instance_norm(x)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-5)
        True
    """
    what = "instance_norm"
    if x.ndim < 3:
        raise SpecError(f"{what}: expected (N, C, *spatial), got {describe(x)}")
    _channel_split(spec, what)
    spec = spec_arg(x, mesh, spec, what).spec
    if spec.entry(0) is not None and (running_mean is not None or not use_input_stats):
        raise SpecError(f"{what}: running statistics average over the batch, which {spec!r} "
                        f"splits; keep N whole (or use batch_norm with the batch split)")
    n, c = x.shape[0], x.shape[1]
    # torch's own route: batch_norm of (1, N*C, *spatial), running stats repeated N times.
    xr = x.reshape(1, n * c, *x.shape[2:])
    rspec = P(None, None, *(spec.entry(d) for d in range(2, x.ndim)))
    rm = None if running_mean is None else running_mean.repeat(n)
    rv = None if running_var is None else running_var.repeat(n)
    w = None if weight is None else weight.repeat(n)
    b = None if bias is None else bias.repeat(n)
    y = batch_norm(xr, rm, rv, w, b, use_input_stats, momentum, eps, mesh=mesh, spec=rspec)
    if running_mean is not None and use_input_stats:
        with torch.no_grad():
            running_mean.copy_(rm.view(n, c).mean(0))
            running_var.copy_(rv.view(n, c).mean(0))
    return y.view(x.shape)


def _updates_buffers(running_mean: torch.Tensor, running_var: torch.Tensor | None,
                     mesh: Mesh, rc: RankContext, axes: tuple[str, ...],
                     split: tuple[str, ...], what: str) -> bool:
    """Whether this rank updates the running statistics. On processes, and for rank
    threads that each pass their own buffers: yes. Rank threads of a shard_map body share
    the caller's buffers, so one rank updates them, once, and only where every rank's
    statistics are the same (merged over every axis in ``split``, those that split the
    input); shared buffers with per-replica statistics have no one right update: refused
    on every rank."""
    if mesh.backend != "threads":
        return True
    group = mesh.group(mesh.axis_names, rc.rank)
    mine = (id(running_mean), id(running_var))
    every = comm_of(mesh).exchange(group, what, mine, name=what)
    if all(e == mine for e in every) and group.size > 1:
        if set(split) - set(axes):
            raise SpecError(
                f"{what}: the rank threads share one running_mean/running_var, but their "
                f"batch statistics are merged over {axes or 'no axes'} only, so they differ "
                f"between ranks; give each replica its own buffers (per-rank code), or merge "
                f"over every axis (axes=None)")
        return group.index == 0
    if len(set(every)) != len(every):
        raise SpecError(f"{what}: some rank threads share running statistics buffers and "
                        f"others do not; pass each rank its own, or all the same ones")
    return True


@takes_sharded(same_layout)
@graph_op(_batch_meta)
def batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None,
               running_var: torch.Tensor | None, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5, *, mesh: Mesh, spec: Any,
               axes: Any = None) -> torch.Tensor:
    """``F.batch_norm``: in training, statistics per channel over the batch and spatial
    dims of the global tensor (SyncBatchNorm when the batch is split too), and the
    running statistics updated in place exactly as torch does (unbiased variance).
    In eval, the running statistics: no communication.

    Args:
        axes: merge the statistics only over these mesh axes; e.g. ``axes="sp"`` on a
            (dp, sp) mesh with the batch split over dp gives per-replica batch norm
            (each dp replica normalises with its own batch), as DDP without SyncBN.

    Communication (training): one all_gather of (count, mean, M2) per channel over the
    merged axes; its backward one psum of two sums per channel.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x, s = torch.randn(4, 3, 5), P(None, None, "sp")
        >>> f = lambda x: spmd.ops.batch_norm(x, None, None, training=True, mesh=mesh, spec=s)
        >>> ref = torch.nn.functional.batch_norm(x, None, None, training=True)
        >>> torch.allclose(spmd.shard_map(f, mesh, s, s)(x), ref, atol=1e-5)
        True
    """
    return _batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps,
                       mesh, spec, axes)


def _batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, training: bool, momentum: float | None, eps: float,
                mesh: Mesh, spec: Any, axes: Any,
                tracked: torch.Tensor | None = None) -> torch.Tensor:
    """``batch_norm``, plus what ``nn.BatchNorm*`` does around it: the rank that updates
    the running statistics also counts the batch in ``tracked`` (num_batches_tracked),
    and ``momentum=None`` averages cumulatively, 1 / num_batches_tracked, as torch."""
    what = "batch_norm"
    rc = on_mesh(mesh, what, x)
    if x.ndim < 2:
        raise SpecError(f"{what}: expected (N, C, ...), got {describe(x)}")
    _channel_split(spec, what)
    c = x.shape[1]
    shape = (1, c) + (1,) * (x.ndim - 2)
    if not training:
        if running_mean is None or running_var is None:
            raise RuntimeError(f"{what}: running_mean and running_var are needed in eval mode")
        acc = _acc(x, what)
        y = (x.to(acc) - running_mean.to(acc).reshape(shape)) * torch.rsqrt(
            running_var.to(acc).reshape(shape) + eps)
        return _affine(y, weight, bias, shape).to(x.dtype)
    dims = (0,) + tuple(range(2, x.ndim))
    _, ax = _spec_axes(x, mesh, spec, dims, what, axes)
    y, (total, mean, m2) = _normalize(
        x, dims, eps, ax, rc, None if weight is None else weight.reshape(shape),
        None if bias is None else bias.reshape(shape))
    if int(total.max()) <= 1:
        raise ValueError(f"{what}: expected more than 1 value per channel when training, got "
                         f"{int(total.max())} over the global batch and spatial dims")
    if running_mean is not None and _updates_buffers(
            running_mean, running_var, mesh, rc, ax,
            _spec_axes(x, mesh, spec, dims, what, None)[1], what):
        with torch.no_grad():
            if tracked is not None:
                tracked.add_(1)
            if momentum is None:
                momentum = 1.0 / float(tracked) if tracked is not None else 0.0
            unbiased = m2 / (total - 1).to(m2.dtype)
            running_mean.mul_(1 - momentum).add_(mean.reshape(c).to(running_mean.dtype),
                                                 alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.reshape(c).to(running_var.dtype),
                                                alpha=momentum)
    return y.to(x.dtype)
