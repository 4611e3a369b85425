"""``reduce``: sum, mean, max or min of a sharded tensor over some of its dims.

Each rank reduces its own shard first, then ONE all-reduce of output size (named
``"reduce"`` in ``spmd.comm_stats()``) runs over the mesh axes that split the reduced
dims; none runs if no reduced dim is split. The mean is the global one, weighted by shard
sizes (never a mean of means) and the input is never gathered. ``max``/``min`` have
``torch.amax``/``torch.amin``'s gradient, ties across ranks included.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..collectives._anchor import anchor
from ..collectives.primitives import _psum
from ..collectives.vjp import custom_vjp
from ..comm import comm_of
from ..core._context import RankContext, on_mesh
from ..core._format import axis_phrase, describe, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.provenance import check_spec
from ..core.spec import entry_axes
from .spec_arg import reduced_layout, spec_arg, takes_sharded

__all__ = ["reduce"]

OPS = ("sum", "mean", "max", "min")
_HALF_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
             torch.complex32: torch.complex64}


@takes_sharded(lambda lay, a, y: reduced_layout(
    lay, _dims(a.get("dim"), lay.ndim, ""), a.get("keepdim", False)))
def reduce(x: torch.Tensor, mesh: Mesh, spec: Any, *, op: str = "sum",
           dim: int | Sequence[int] | None = None, keepdim: bool = False,
           sizes: Mapping[int, Sequence[int]] | Layout | None = None) -> torch.Tensor:
    """Reduce the global tensor whose shard ``x`` is over ``dim``, like
    ``torch.sum/mean/amax/amin(global_x, dim, keepdim)``.

    Args:
        x: this rank's shard (per-rank code: a shard_map body or a launched function).
        mesh: the mesh the code runs on.
        spec: how the global tensor is laid out over ``mesh``: a ``P``, or a ``Layout``
            (its sizes used, as ``sizes=``); left out when ``x`` is a ``spmd.Sharded``
            (the result is then a Sharded where it keeps split dims). One convention
            for every op: docs/mesh-and-specs.md.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        dim: an int, a tuple of ints (negative allowed), or None (or ``()``) for all dims.
        keepdim: keep the reduced dims with size 1.
        sizes: the global shard sizes along the split reduced dims, as ``{dim: [s0, s1,
            ...]}`` (one size per shard, in the order of the dim's axes, first major) or a
            ``spmd.Layout`` of the global tensor. Only ``mean`` and the empty-input check
            of ``max``/``min`` need them; see Communication.

    Returns:
        The reduction of the global tensor restricted to this rank's part of the dims
        that are not reduced: replicated over the axes of the reduced dims, and laid out
        by ``spec`` with the reduced dims' entries set to None (``keepdim=True``) or
        dropped. Integer ``sum`` is int64, as torch's.

    Communication:
        One all-reduce, named ``"reduce"``, over the axes that split the reduced dims
        (none if no reduced dim is split):

        - ``sum``: a psum of the local sums (output size).
        - ``mean`` with ``sizes``: the global count is known, so only the psum of the
          local sums moves (output size), then it is divided by the count.
        - ``mean`` without ``sizes``: the local element count rides in the same psum,
          one extra element (output size + 1), in x's dtype (float32 for float16
          and bfloat16 inputs, whose mean is summed in float32 as torch's is; counts
          exact up to 2**24 elements in float32, 2**53 in float64). The backward
          moves output size only.
        - ``max``/``min``: a pmax/pmin of the local amax/amin (output size). Without
          ``sizes`` one extra element says whether any rank holds data, so that an
          empty global reduction raises as torch does (after the exchange, on every
          rank alike); with ``sizes`` it raises before.

    Backward:
        ``sum``/``mean``: a psum of the cotangent (output size), scaled by ``1/count`` for
        the mean. ``max``/``min``: the gradient is split equally among ALL elements of
        the global tensor equal to the result, as ``torch.amax`` does: one psum of the
        local tie counts stacked with the cotangent (2 x output size), then
        ``grad = g / count * (x == y)``.

    Ranks without data:
        A zero-size shard contributes 0 to ``sum``/``mean``, -inf/+inf (the dtype's
        min/max for integers) to ``max``/``min``, gets a zero gradient, and still takes
        part in the one all-reduce.

    Raises:
        SpecError: unknown op; dim out of range or repeated; a spec with an unknown axis
            or more entries than x has dims; a mesh other than the one this code runs
            on; sizes inconsistent with the local shape; ``mean`` of an integer tensor,
            ``max``/``min`` of a complex one;
            ``max``/``min`` over no elements (as torch). All before any communication,
            except the empty max/min check without ``sizes``.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> f = lambda x: spmd.reduce(x, mesh, P("sp"), op="mean", dim=0)
        >>> spmd.shard_map(f, mesh, P("sp"), P())(torch.arange(6.0).reshape(3, 2)).tolist()
        [2.0, 3.0]
    """
    rc = on_mesh(mesh, "reduce", x)
    if op not in OPS:
        raise SpecError(f"reduce: op must be one of {OPS}, got {op!r}")
    arg = spec_arg(x, mesh, spec, "reduce")
    spec = arg.spec
    if arg.layout is not None:
        if sizes is not None and not isinstance(sizes, Layout):
            raise SpecError("reduce: spec is a Layout, which holds the sizes; leave sizes= out")
        if sizes is not None and sizes != arg.layout:
            raise SpecError(f"reduce: sizes={sizes!r} and spec={arg.layout!r} are different "
                            f"layouts; pass one")
        sizes = arg.layout
    dims = _dims(dim, x.ndim, describe(x))
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        raise SpecError(f"reduce: op='mean' needs a floating-point or complex x, got "
                        f"{describe(x)} (as torch.mean); convert it first")
    if op in ("max", "min") and x.is_complex():
        raise SpecError(f"reduce: op={op!r} needs a real x, got {describe(x)} (complex numbers "
                        f"have no order)")
    split = {d: entry_axes(spec.entry(d)) for d in range(x.ndim) if entry_axes(spec.entry(d))}
    # Before _sizes: a rank's own-shape check there could pass on one rank only.
    check_spec(x, spec, mesh, "reduce", sizes=_given_sizes(sizes, x.ndim))
    if isinstance(sizes, Layout):
        check_spec(x, sizes, mesh, "reduce", name="x (its sizes Layout)")
    gsizes = _sizes(sizes, x, spec, split, rc, mesh)
    red_split = [d for d in dims if d in split]
    used = {a for d in red_split for a in split[d]}
    axes = tuple(a for a in mesh.axis_names if a in used)

    # The global number of reduced elements, where it is known without communication.
    known = None
    if all(d in gsizes for d in red_split):
        known = math.prod(sum(gsizes[d]) if d in split else x.shape[d] for d in dims)
    if op in ("max", "min"):
        if known == 0 or any(x.shape[d] == 0 for d in dims if d not in split):
            raise SpecError(
                f"reduce: op={op!r} over dims {list(dims)} of an empty global tensor "
                f"(local {describe(x)}); torch.a{op} cannot reduce zero elements either")

    out = _local(x, op, dims, keepdim=True) if not axes else None
    if axes:
        if op in ("sum", "mean"):
            # torch.mean of half precision sums in float32 and rounds once: so do we, so
            # that neither the sum nor the count (2**8 exact in bfloat16) rounds or overflows
            acc = _HALF_ACC.get(x.dtype) if op == "mean" else None
            loc = x.sum(dim=dims, keepdim=True, dtype=acc)
            if op == "sum" or known is not None:
                out = _psum(anchor(loc), axes, rc, "reduce")
                if op == "mean":
                    out = out / known
            else:
                out = _mean_counted(anchor(loc), axes, rc, math.prod(x.shape[d] for d in dims))
            if acc is not None:
                out = out.to(x.dtype)
        else:
            out = _ext(anchor(x), op, dims, axes, rc, known is None)
    if not keepdim:
        for d in sorted(dims, reverse=True):
            out = out.squeeze(d)
    return out


def _local(x: torch.Tensor, op: str, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[op]
    return fn(x, dim=dims, keepdim=keepdim)


def _dims(dim, ndim: int, xs: str, what: str = "reduce", *, many: bool = True,
          every: bool = True) -> tuple[int, ...]:
    """``dim`` as sorted non-negative dims of an ``ndim``-d x (described by ``xs``), as
    torch reads it, or the SpecError ``what`` raises. ``many``: a tuple of dims is
    allowed; ``every``: None and ``()`` mean all dims (a 0-d x has none: ``()``)."""
    one = isinstance(dim, int) and not isinstance(dim, bool)
    if dim is None and every:
        return tuple(range(ndim))
    if not one and not (many and isinstance(dim, (tuple, list)) and (dim or every) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in dim)):
        kind = ("an int, a tuple of ints or None" if every else
                "an int or a non-empty tuple of ints") if many else "an int"
        raise SpecError(f"{what}: dim must be {kind}, got {dim!r}")
    ds = (dim,) if one else tuple(dim)
    if not ds:
        return tuple(range(ndim))  # torch reads an empty dim list as "all dims"
    span = max(ndim, 1)  # torch accepts dim 0 / -1 for a 0-d tensor
    for d in ds:
        if not -span <= d < span:
            raise SpecError(f"{what}: dim={dim!r} is out of range for x ({xs}), which has "
                            f"{ndim} dims (use -{span} <= dim < {span})")
    if ndim == 0:
        return ()
    norm = tuple(d % ndim for d in ds)
    if len(set(norm)) != len(norm):
        raise SpecError(f"{what}: dim={dim!r} repeats a dim (dims {list(norm)} of x, {xs})")
    return tuple(sorted(norm))


def _given_sizes(sizes: Any, ndim: int) -> dict[int, tuple] | None:
    """``sizes`` as ``{dim: sizes}`` where it is a well-formed mapping (else None: ``_sizes``
    explains what is wrong with it)."""
    if not isinstance(sizes, Mapping):
        return None
    try:
        return {d % ndim: tuple(int(v) for v in s) for d, s in sizes.items()
                if isinstance(d, int) and -ndim <= d < ndim}
    except (TypeError, ValueError):
        return None


def _sizes(sizes, x: torch.Tensor, spec, split: dict, rc: RankContext,
           mesh: Mesh) -> dict[int, tuple[int, ...]]:
    """The global shard sizes per split dim that ``sizes`` gives, checked against x."""
    if sizes is None:
        return {}
    if isinstance(sizes, Layout):
        lay = sizes
        if not lay.is_for(mesh):
            raise SpecError(f"reduce: sizes is a Layout for another mesh ({lay!r}); this code "
                            f"runs on {mesh!r}")
        if lay.ndim != x.ndim or any(lay.dim_axes(d) != split.get(d, ()) for d in range(x.ndim)):
            raise SpecError(f"reduce: sizes is {lay!r}, which does not cut x ({describe(x)}) "
                            f"as spec {spec!r} does")
        want = lay.local_shape(rc.rank)
        if tuple(x.shape) != want:
            raise SpecError(f"reduce: x is {describe(x)} on rank {rc.rank} but sizes ({lay!r}) "
                            f"says its shard is {shape_str(want)}")
        return {d: lay.sizes[d] for d in split}
    if not isinstance(sizes, Mapping):
        raise SpecError(f"reduce: sizes must be a dict {{dim: [sizes]}} or a spmd.Layout, got "
                        f"{sizes!r}")
    out = {}
    for d, s in sizes.items():
        if not isinstance(d, int) or isinstance(d, bool) or not -x.ndim <= d < x.ndim:
            raise SpecError(f"reduce: sizes names dim {d!r}, but x ({describe(x)}) has "
                            f"{x.ndim} dims")
        d %= x.ndim
        if d not in split:
            raise SpecError(f"reduce: sizes gives sizes for dim {d}, which spec {spec!r} does "
                            f"not split")
        if isinstance(s, (str, bytes)) or not isinstance(s, Sequence) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in s):
            raise SpecError(f"reduce: sizes for dim {d} must be a sequence of non-negative "
                            f"ints, got {s!r}")
        axes = split[d]
        n = mesh.axis_size(axes)
        if len(s) != n:
            raise SpecError(f"reduce: sizes for dim {d} has {len(s)} entries but {_ax(axes)} "
                            f"has {n} shards; give one size per shard")
        idx = mesh.axis_index(axes, rc.rank)
        if s[idx] != x.shape[d]:
            raise SpecError(f"reduce: dim {d} of x has size {x.shape[d]} on rank {rc.rank} but "
                            f"sizes={list(s)} says {s[idx]} for its index {idx} of {_ax(axes)}")
        out[d] = tuple(s)
    return out


_ax = axis_phrase


# -- the collectives --------------------------------------------------------------------------



@custom_vjp
def _mean_counted(loc, axes, rc, n_local):
    return _mean_counted_fwd(loc, axes, rc, n_local)[0]


def _mean_counted_fwd(loc, axes, rc, n_local):
    """The local sums and the local count in one psum (output size + 1 elements)."""
    buf = torch.cat([loc.reshape(-1), loc.new_full((1,), n_local)])
    got = comm_of(rc.mesh).all_reduce(buf, "sum", rc.mesh.group(axes, rc.rank), name="reduce")
    count = got[-1]
    return got[:-1].reshape(loc.shape) / count, (axes, rc, count)


def _mean_counted_bwd(res, g):
    """The count is known by now: only the cotangent moves (output size)."""
    axes, rc, count = res
    with rc:
        return _psum(g, axes, rc, "reduce") / count, None, None, None


_mean_counted.defvjp(_mean_counted_fwd, _mean_counted_bwd)


def _identity(x: torch.Tensor, op: str):
    if x.dtype == torch.bool:
        return op == "min"
    if x.is_floating_point():
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(x.dtype)
    return info.min if op == "max" else info.max


@custom_vjp
def _ext(x, op, dims, axes, rc, carry):
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    have = all(x.shape[d] > 0 for d in dims)
    loc = _local(x, op, dims, True) if have else x.new_full(shape, _identity(x, op))
    group = rc.mesh.group(axes, rc.rank)
    if not carry:
        return comm_of(rc.mesh).all_reduce(loc, op, group, name="reduce")
    # max: 1 where a rank holds data; min: 0 where it does. The reduced flag says
    # whether any rank of the group held an element.
    flag = loc.new_full((1,), int(have) if op == "max" else int(not have))
    got = comm_of(rc.mesh).all_reduce(torch.cat([loc.reshape(-1), flag]), op, group, name="reduce")
    if bool(got[-1] != (1 if op == "max" else 0)):
        raise SpecError(
            f"reduce: op={op!r} over dims {list(dims)} of an empty global tensor (no rank of "
            f"{_ax(axes)} holds an element); torch.a{op} cannot reduce zero elements either")
    return got[:-1].reshape(shape)


def _ext_fwd(x, op, dims, axes, rc, carry):
    y = _ext(x, op, dims, axes, rc, carry)
    return y, (x, y, dims, axes, rc)


def _ext_bwd(res, g):
    """torch.amax's rule over the global tensor: (g / global tie count) * (x == y),
    the cotangents of the group's ranks (each rank's output is its own variable) summed."""
    x, y, dims, axes, rc = res
    mask = (x == y).to(g.dtype)
    cnt = mask.sum(dim=dims, keepdim=True) if dims else mask
    with rc:
        both = _psum(torch.stack([cnt, g]), axes, rc, "reduce")
    return both[1] / both[0] * mask, None, None, None, None, None


_ext.defvjp(_ext_fwd, _ext_bwd)
