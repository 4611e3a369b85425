"""Differentiable collectives with JAX's names, each with its vjp right below it.

The one autograd convention (docs/design.md): inside per-rank code every tensor is
device-varying, so each transpose is another public collective:

    psum -> psum          all_gather -> psum_scatter     psum_scatter -> all_gather
    pmean -> pmean        ppermute(perm) -> ppermute(inverse perm)
    all_to_all(split a, concat b) -> all_to_all(split b, concat a)
    broadcast(src) -> psum, kept on src          pmax/pmin -> psum, kept where the extremum is

Under grad mode every collective is an autograd node on every rank, even where its
input needs no gradient (see ``_anchor.anchor``): otherwise one rank would skip the
collective's backward and the others would wait for it.

Backward rules capture the (mesh, rank) of their forward and run the dual collective
under it, because autograd may run backward on another thread.

Collectives run in per-rank code: inside a ``shard_map`` body, in a function run by
``spmd.launch``, or in a torch process inside ``with mesh:``. ``axis_name`` is a mesh
axis or a tuple of axes (their product, the first axis major).
"""
from __future__ import annotations

from collections.abc import Sequence

import optree
import torch

from ..comm import comm_of
from ..core._context import RankContext, current, refuse_sparse
from ..core._format import axis_phrase, describe
from ..core.errors import CommAborted, CommError, CommTimeout, SpecError
from ..core.layout import balanced_sizes
from ._anchor import anchor
from .compiled import graph_op, like_input
from .group_node import (node_all_gather, node_ppermute, node_psum, node_psum_scatter,
                         wants_node)
from .vjp import custom_vjp

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
           "all_to_all", "broadcast", "axis_index", "axis_size"]

AxisName = str | tuple[str, ...]  # a mesh axis, or several (their product, first major)


def _setup(x: object, axis_name: object, what: str) -> tuple[tuple[str, ...], RankContext]:
    rc = current(what)
    axes = rc.mesh.check_axes(axis_name, what)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {describe(x)}")
    refuse_sparse(x, what)
    return axes, rc


def _dim(d: int, ndim: int, what: str, name: str) -> int:
    if not isinstance(d, int) or not -ndim <= d < ndim:
        raise SpecError(f"{what}: {name}={d!r} is out of range for a {ndim}-d tensor")
    return d % ndim


def _tree(fn, x, axis_name):
    if optree.tree_is_leaf(x, namespace="spmd"):
        raise TypeError(f"{fn.__name__}: expected a tensor, got {describe(x)} (a pytree of "
                        f"tensors works too)")
    # Mapped here, not by optree.tree_map: that calls fn from C++ (pybind11), where a
    # rank greenlet that waits in the collective lets another rank into the same C++
    # code, and pybind11 aborts the process when the first returns.
    leaves, treedef = optree.tree_flatten(x, namespace="spmd")
    return optree.tree_unflatten(treedef, [fn(t, axis_name) for t in leaves])


# -- psum ----------------------------------------------------------------------------

def _counts(x: torch.Tensor) -> torch.Tensor:
    """Bools are summed as counts: int64, as ``torch.sum`` of bools gives (JAX's psum
    counts too, in int32). The comm layer's bool sum is logical or."""
    return x.to(torch.int64) if x.dtype == torch.bool else x


def _sum_meta(x: object, *args: object, **kwargs: object) -> list | None:
    return [(x.shape, torch.int64 if x.dtype == torch.bool else x.dtype)] \
        if isinstance(x, torch.Tensor) else None


def _mean_dtype(dtype: torch.dtype) -> torch.dtype:
    """pmean's result dtype: a float or complex input keeps its dtype; bools and integers
    give the default float dtype (the mean of counts is a fraction)."""
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()


def _mean_meta(x: object, *args: object, **kwargs: object) -> list | None:
    return [(x.shape, _mean_dtype(x.dtype))] if isinstance(x, torch.Tensor) else None


@graph_op(_sum_meta)
def psum(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``axis_name``; the same on each of them.

    ``x`` may be a pytree of tensors. Bools are counted: the result is int64, as
    ``torch.stack(xs).sum(0)`` (JAX's psum counts too, in int32).

    Backward: ``psum`` of the cotangent (every rank's output is its own variable).

    Example:
        >>> spmd.launch(lambda m: spmd.psum(torch.tensor(1.0), "sp").item(), (4,), "sp")
        [4.0, 4.0, 4.0, 4.0]
    """
    if not isinstance(x, torch.Tensor):
        return _tree(psum, x, axis_name)
    axes, rc = _setup(x, axis_name, "psum")
    x = _counts(x)
    if wants_node(x):  # (where anchor would leave x as it is)
        return node_psum(x, axes, rc, "psum")
    return _psum_rule(anchor(x), axes, rc, "psum")


def _psum(x: torch.Tensor, axes: tuple[str, ...], rc: RankContext, name: str
          ) -> torch.Tensor:
    """psum's core; ``name`` is what communication accounting records (transforms built
    on it, such as ``reduce``, record their own). On rank greenlets, one autograd node
    over the group made in the sum's own rendezvous (``group_node``)."""
    if wants_node(x):
        return node_psum(x, axes, rc, name)
    return _psum_rule(x, axes, rc, name)


@custom_vjp
def _psum_rule(x, axes, rc, name):
    return comm_of(rc.mesh).all_reduce(x, "sum", rc.mesh.group(axes, rc.rank), name=name)


def _psum_bwd(res, g):
    axes, rc, name = res
    with rc:  # psum's transpose is psum
        return _psum(anchor(g), axes, rc, name), None, None, None


_psum_rule.defvjp(lambda x, axes, rc, name: (_psum(x, axes, rc, name), (axes, rc, name)),
                  _psum_bwd)


@graph_op(_mean_meta)
def pmean(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Mean of ``x`` over the ranks of ``axis_name`` (``psum / axis_size``).

    Bools and integers give the mean in the default float dtype (for bools: the fraction
    of ranks holding True), as ``torch.stack(xs).to(float).mean(0)``.

    Backward: ``pmean`` of the cotangent (autograd through psum and the division).
    """
    if not isinstance(x, torch.Tensor):
        return _tree(pmean, x, axis_name)
    axes, rc = _setup(x, axis_name, "pmean")
    s = _psum(anchor(_counts(x)), axes, rc, "pmean")
    return s.to(_mean_dtype(x.dtype)) / rc.mesh.axis_size(axes)


# -- pmax / pmin -------------------------------------------------------------------------

@graph_op(like_input)
def pmax(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Elementwise maximum over the ranks of ``axis_name``, with a gradient; for bools,
    any (logical or).

    Backward: the summed cotangent goes to the rank holding the maximum. Ties share it
    equally, as ``torch.amax`` does, so a sharded ``amax`` has the single-device gradient.
    """
    if not isinstance(x, torch.Tensor):
        return _tree(pmax, x, axis_name)
    axes, rc = _setup(x, axis_name, "pmax")
    return _pext(anchor(x), "max", axes, rc)


@graph_op(like_input)
def pmin(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Elementwise minimum over the ranks of ``axis_name`` (for bools, all); gradient as
    ``pmax``."""
    if not isinstance(x, torch.Tensor):
        return _tree(pmin, x, axis_name)
    axes, rc = _setup(x, axis_name, "pmin")
    return _pext(anchor(x), "min", axes, rc)


@custom_vjp
def _pext(x, op, axes, rc):
    return comm_of(rc.mesh).all_reduce(x, op, rc.mesh.group(axes, rc.rank), name="p" + op)


def _pext_fwd(x, op, axes, rc):
    y = _pext(x, op, axes, rc)
    return y, (x, y, axes, rc)


def _pext_bwd(res, g):
    x, y, axes, rc = res
    mask = (x == y).to(g.dtype)
    with rc:
        # One psum carries both the tie count and the summed cotangent.
        both = psum(torch.stack([mask, g]), axes)
    return mask * both[1] / both[0], None, None, None


_pext.defvjp(_pext_fwd, _pext_bwd)


# -- all_gather / psum_scatter ----------------------------------------------------------

def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank's ``x``, stacked along a new dim ``axis`` (or concatenated along
    ``axis`` with ``tiled=True``, where sizes along ``axis`` may differ per rank).

    Args:
        sizes: with ``tiled=True``, each rank's size along ``axis`` if known (skips a
            metadata exchange on the torch backend).

    Backward: ``psum_scatter`` of the cotangent over the same axis and sizes.

    Example:
        >>> f = lambda m: spmd.all_gather(torch.ones(m.rank + 1), "sp", tiled=True).shape
        >>> spmd.launch(f, (3,), "sp")[0]
        torch.Size([6])
    """
    axes, rc = _setup(x, axis_name, "all_gather")
    axis = _dim(axis, x.ndim + (0 if tiled else 1), "all_gather", "axis")
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if not tiled or len(sizes) != rc.mesh.axis_size(axes):
            raise SpecError(f"all_gather: sizes={list(sizes)} needs tiled=True and one size "
                            f"per rank of {axes} ({rc.mesh.axis_size(axes)})")
    return _all_gather(anchor(x), axes, rc, axis, tiled, sizes)


def _all_gather(x: torch.Tensor, axes: tuple[str, ...], rc: RankContext, axis: int,
                tiled: bool, sizes: tuple[int, ...] | None) -> torch.Tensor:
    """all_gather's core; on rank greenlets, one autograd node over the group made in
    the gather's own rendezvous (``group_node``)."""
    if wants_node(x):
        return _gather(x, axes, rc, axis, tiled, sizes, True)
    return _all_gather_rule(x, axes, rc, axis, tiled, sizes)


@custom_vjp
def _all_gather_rule(x, axes, rc, axis, tiled, sizes):
    return _all_gather_fwd(x, axes, rc, axis, tiled, sizes)[0]


def _all_gather_fwd(x, axes, rc, axis, tiled, sizes):
    parts = _gather(x, axes, rc, axis, tiled, sizes, False)
    got = tuple(p.shape[axis] for p in parts)
    return torch.cat(parts, axis), (axes, rc, axis, tiled, got)


def _gather(x, axes, rc, axis, tiled, sizes, node):
    """Every member's ``x`` (as a list; ``node``: this rank's gathered tensor, one node
    over the group), with the hint for untiled shards of other sizes."""
    group = rc.mesh.group(axes, rc.rank)
    if not tiled:
        sizes = (1,) * group.size  # known: no metadata exchange needed
    xt = x if tiled else x.unsqueeze(axis)
    try:
        if node:
            return node_all_gather(xt, axes, rc, axis, sizes, "all_gather")
        return comm_of(rc.mesh).all_gather(xt, group, axis, name="all_gather", sizes=sizes)
    except CommError as e:
        # the hint is for shards that differ in shape, not for ranks in other collectives
        if tiled or isinstance(e, (CommTimeout, CommAborted)) or "collective mismatch" in str(e):
            raise
        raise CommError(f"{e}. all_gather(tiled=False) stacks one x of the same shape per "
                        f"rank: if the shards differ in size along dim {axis}, pass "
                        f"tiled=True to concatenate them", op=e.op, axes=e.axes,
                        missing=e.missing) from e


def _all_gather_bwd(res, g):
    axes, rc, axis, tiled, got = res
    with rc:
        gx = psum_scatter(g, axes, scatter_dimension=axis, tiled=tiled,
                          sizes=got if tiled else None)
    return gx, None, None, None, None, None


_all_gather_rule.defvjp(_all_gather_fwd, _all_gather_bwd)


def psum_scatter(x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0,
                 tiled: bool = False, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum over the ranks of ``axis_name``, scattered: rank i keeps block i of the sum.

    With ``tiled=False`` dim ``scatter_dimension`` must have one entry per rank and is
    removed; with ``tiled=True`` it is split into blocks of ``sizes`` (default balanced,
    the ``numpy.array_split`` rule, so uneven sizes are fine). Bools are counted
    (int64), as in ``psum``.

    Backward: ``all_gather`` of the cotangent (tiled alike).

    Example:
        >>> f = lambda m: spmd.psum_scatter(torch.ones(5), "sp", tiled=True).tolist()
        >>> spmd.launch(f, (2,), "sp")
        [[2.0, 2.0, 2.0], [2.0, 2.0]]
    """
    axes, rc = _setup(x, axis_name, "psum_scatter")
    d = _dim(scatter_dimension, x.ndim, "psum_scatter", "scatter_dimension")
    n = rc.mesh.axis_size(axes)
    if not tiled:
        if sizes is not None:
            raise SpecError("psum_scatter: sizes needs tiled=True")
        if x.shape[d] != n:
            raise SpecError(
                f"psum_scatter: dim {d} of x ({describe(x)}) has size {x.shape[d]} but "
                f"{_ax(axes)} has {n} ranks; with tiled=False the scatter dim must have one "
                f"entry per rank (or pass tiled=True)")
        sizes = None
    elif sizes is None:
        sizes = balanced_sizes(x.shape[d], n)
    else:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != n or sum(sizes) != x.shape[d] or min(sizes) < 0:
            raise SpecError(
                f"psum_scatter: sizes={list(sizes)} must be {n} non-negative sizes adding up "
                f"to dim {d} of x ({describe(x)})")
    x = _counts(x)
    if wants_node(x):  # on rank greenlets: one node over the group (group_node)
        return node_psum_scatter(_blocks(x, d, sizes), axes, rc, d, sizes is not None)
    return _psum_scatter(anchor(x), axes, rc, d, sizes)


def _blocks(x: torch.Tensor, d: int, sizes: tuple[int, ...] | None) -> list[torch.Tensor]:
    """psum_scatter's blocks of ``x``: split along ``d`` into ``sizes``, or unbound."""
    return list(x.split(sizes, d)) if sizes is not None else list(x.unbind(d))


@custom_vjp
def _psum_scatter(x, axes, rc, d, sizes):
    chunks = _blocks(x, d, sizes)
    return comm_of(rc.mesh).reduce_scatter(chunks, "sum", rc.mesh.group(axes, rc.rank),
                                       name="psum_scatter")


def _psum_scatter_bwd(res, g):
    axes, rc, d, sizes = res
    with rc:
        gx = all_gather(g, axes, axis=d, tiled=sizes is not None, sizes=sizes)
    return gx, None, None, None, None


_psum_scatter.defvjp(lambda x, axes, rc, d, sizes: (_psum_scatter(x, axes, rc, d, sizes),
                                                    (axes, rc, d, sizes)), _psum_scatter_bwd)


# -- ppermute -------------------------------------------------------------------------------

@graph_op(like_input)
def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send ``x`` along ``perm``, pairs ``(source index, destination index)`` of the axis.

    A rank that is no destination receives zeros. Sources and destinations must each
    be distinct. ``x`` must have the same shape and dtype on every rank.

    Backward: ``ppermute`` of the cotangent with every pair reversed.

    Example:
        >>> shift = lambda m: spmd.ppermute(torch.tensor([m.rank]), "sp", [(0, 1), (1, 2)]).item()
        >>> spmd.launch(shift, (3,), "sp")
        [0, 0, 1]
    """
    axes, rc = _setup(x, axis_name, "ppermute")
    n = rc.mesh.axis_size(axes)
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"ppermute: perm must be a sequence of (source, destination) index "
                        f"pairs, got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise SpecError(f"ppermute: pair ({s}, {d}) is outside {_ax(axes)}, whose indices "
                            f"are 0..{n - 1}")
    for k, name in ((0, "sources"), (1, "destinations")):
        vals = [p[k] for p in pairs]
        if len(set(vals)) != len(vals):
            raise SpecError(f"ppermute: perm {list(pairs)} repeats {name}; a permutation sends "
                            f"from and to each index at most once")
    if wants_node(x):  # on rank greenlets: one node over the group (group_node)
        return node_ppermute(x, axes, rc, pairs)
    return _ppermute(anchor(x), axes, rc, pairs)


@custom_vjp
def _ppermute(x, axes, rc, pairs):
    y = comm_of(rc.mesh).permute(x, rc.mesh.group(axes, rc.rank), pairs, name="ppermute")
    return torch.zeros_like(x) if y is None else y


def _ppermute_bwd(res, g):
    axes, rc, pairs = res
    with rc:
        return ppermute(g, axes, [(d, s) for s, d in pairs]), None, None, None


_ppermute.defvjp(lambda x, axes, rc, pairs: (_ppermute(x, axes, rc, pairs), (axes, rc, pairs)),
                 _ppermute_bwd)


# -- all_to_all ---------------------------------------------------------------------------

def all_to_all(x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *,
               tiled: bool = False, split_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Split ``x`` along ``split_axis``, send block i to rank i, concatenate what arrives
    along ``concat_axis`` in rank order.

    With ``tiled=False`` (JAX's default) ``split_axis`` must have one entry per rank; it
    is removed and a new dim of that size appears at ``concat_axis``. With ``tiled=True``
    no dim is added or removed, and the blocks have ``split_sizes`` (default balanced,
    so uneven sizes are fine).

    Backward: ``all_to_all`` of the cotangent with split and concat swapped, and the
    block sizes that arrived.

    Example:
        >>> f = lambda m: spmd.all_to_all(torch.arange(2) + 10 * m.rank, "sp", 0, 0).tolist()
        >>> spmd.launch(f, (2,), "sp")
        [[0, 10], [1, 11]]
    """
    axes, rc = _setup(x, axis_name, "all_to_all")
    n = rc.mesh.axis_size(axes)
    sa = _dim(split_axis, x.ndim, "all_to_all", "split_axis")
    if tiled:
        ca = _dim(concat_axis, x.ndim, "all_to_all", "concat_axis")
        if split_sizes is None:
            split_sizes = balanced_sizes(x.shape[sa], n)
        split_sizes = tuple(int(s) for s in split_sizes)
        if len(split_sizes) != n or sum(split_sizes) != x.shape[sa] or min(split_sizes) < 0:
            raise SpecError(f"all_to_all: split_sizes={list(split_sizes)} must be {n} "
                            f"non-negative sizes adding up to dim {sa} of x ({describe(x)})")
        return _all_to_all(anchor(x), axes, rc, sa, ca, split_sizes)
    if split_sizes is not None:
        raise SpecError("all_to_all: split_sizes needs tiled=True")
    ca = _dim(concat_axis, x.ndim, "all_to_all", "concat_axis")
    if x.shape[sa] != n:
        raise SpecError(
            f"all_to_all: split_axis {sa} of x ({describe(x)}) has size {x.shape[sa]} but "
            f"{_ax(axes)} has {n} ranks; with tiled=False it must have one entry per rank "
            f"(or pass tiled=True)")
    # As JAX: add a unit dim where the ranks' blocks will stack, exchange, drop split_axis.
    if sa < ca:
        ca += 1
        x = x.unsqueeze(ca)
    elif ca < sa:
        x = x.unsqueeze(ca)
        sa += 1
    y = _all_to_all(anchor(x), axes, rc, sa, ca, (1,) * n)
    return y if sa == ca else y.squeeze(sa)


@custom_vjp
def _all_to_all(x, axes, rc, sa, ca, sizes):
    return _all_to_all_fwd(x, axes, rc, sa, ca, sizes)[0]


def _all_to_all_fwd(x, axes, rc, sa, ca, sizes):
    parts = comm_of(rc.mesh).all_to_all(list(x.split(sizes, sa)), rc.mesh.group(axes, rc.rank),
                                    name="all_to_all")
    got = tuple(p.shape[ca] for p in parts)
    _check_concat(parts, ca, rc, axes)
    return torch.cat(parts, ca), (axes, rc, sa, ca, got)


def _check_concat(parts: list[torch.Tensor], ca: int, rc: RankContext, axes) -> None:
    ref = list(parts[0].shape)
    ref[ca] = -1
    for j, p in enumerate(parts):
        s = list(p.shape)
        s[ca] = -1
        if s != ref or p.dtype != parts[0].dtype:
            raise CommError(
                f"all_to_all over {_ax(axes)}: rank {rc.rank} received {describe(p)} from index "
                f"{j} and {describe(parts[0])} from index 0; blocks must agree in dtype and "
                f"in every dim but concat_axis {ca}")


def _all_to_all_bwd(res, g):
    axes, rc, sa, ca, got = res
    with rc:
        gx = all_to_all(g, axes, ca, sa, tiled=True, split_sizes=got)
    return gx, None, None, None, None, None


_all_to_all.defvjp(_all_to_all_fwd, _all_to_all_bwd)


# -- broadcast ------------------------------------------------------------------------------

@graph_op(like_input)
def broadcast(x: torch.Tensor, axis_name: AxisName, src: int = 0) -> torch.Tensor:
    """Index ``src``'s ``x`` on every rank of ``axis_name`` (same shape everywhere).

    Backward: the cotangents are summed (``psum``) and kept on ``src``; other ranks
    get zeros.
    """
    axes, rc = _setup(x, axis_name, "broadcast")
    n = rc.mesh.axis_size(axes)
    if not isinstance(src, int) or not 0 <= src < n:
        raise SpecError(f"broadcast: src={src!r} is outside {_ax(axes)}, whose indices are "
                        f"0..{n - 1}")
    return _broadcast(anchor(x), axes, rc, src)


@custom_vjp
def _broadcast(x, axes, rc, src):
    return comm_of(rc.mesh).broadcast(x, src, rc.mesh.group(axes, rc.rank), name="broadcast")


def _broadcast_bwd(res, g):
    axes, rc, src = res
    with rc:
        gs = psum(g, axes)
        keep = rc.mesh.axis_index(axes, rc.rank) == src
    return (gs if keep else torch.zeros_like(gs)), None, None, None


_broadcast.defvjp(lambda x, axes, rc, src: (_broadcast(x, axes, rc, src), (axes, rc, src)),
                  _broadcast_bwd)


# -- indices --------------------------------------------------------------------------------

def axis_index(axis_name: AxisName) -> int:
    """The calling rank's index along ``axis_name`` (linearised for a tuple, first major)."""
    rc = current("axis_index")
    axes = rc.mesh.check_axes(axis_name, "axis_index")
    return rc.mesh.axis_index(axes, rc.rank)


def axis_size(axis_name: AxisName) -> int:
    """Ranks along ``axis_name`` (the product for a tuple)."""
    rc = current("axis_size")
    return rc.mesh.axis_size(rc.mesh.check_axes(axis_name, "axis_size"))


_ax = axis_phrase
