"""``redistribute``: any layout to any layout, moving only what must move.

From the source and destination layouts every rank computes the same plan: each box of
a destination shard comes from one rank holding it in the source layout, the rank
itself whenever it can (replicate -> shard moves nothing), else the replica that shares
its coordinates on the replicated axes. One all-to-all then moves exactly the missing
boxes; backward is its transpose (cotangent boxes go back and are added at the source).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from ..collectives._anchor import anchor
from ..collectives.vjp import custom_vjp
from ..comm import comm_of, gather_ints
from ..core._context import RankContext, in_rank_of, on_mesh, static_layout, static_mismatch
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, coords_of
from ..core.provenance import check_spec
from ..core.spec import as_spec
from .sharded import Sharded, assemble, check_source
from .spec_arg import layout_parts

__all__ = ["redistribute"]

Sizes = Mapping[int, Sequence[int]] | Sequence[Sequence[int] | None] | None


def redistribute(x: torch.Tensor | Sharded, mesh: Mesh, src_spec: Any = None,
                 dst_spec: Any = None, *, src_sizes: Sizes = None,
                 dst_sizes: Sizes = None) -> torch.Tensor | Sharded:
    """Re-lay this rank's shard ``x`` of a global tensor from ``src_spec`` to ``dst_spec``.

    Any layout to any layout on n-d meshes: shard dim a -> shard dim b, shard ->
    replicate, replicate -> shard (no communication), uneven <-> even, dims split over
    tuples of axes, (S1, S2) -> (S2, S1). Lossless.

    Args:
        x: this rank's shard under ``src_spec`` (per-rank code), or a ``spmd.Sharded``,
            which knows its source: ``redistribute(s, mesh, dst_spec)`` returns a Sharded
            (on a threads mesh outside its ranks, re-cut in place from its shards).
        mesh: the mesh the code runs on.
        src_spec, dst_spec: ``P`` specs of the two layouts.
        src_sizes: the source's shard sizes (``{dim: [...]}``) if uneven and known;
            otherwise every rank's shape is exchanged first (int64, one small all_gather)
            whenever the source is split.
        dst_sizes: the destination's sizes; default balanced.

    Returns:
        This rank's shard under ``dst_spec``.

    Backward:
        The transpose: each cotangent box goes back to the rank it came from and is added
        there. A destination replicated over some axes thus sums the copies' cotangents.

    Ranks without data:
        A rank whose destination shard is empty receives nothing; one whose source shard
        is empty sends nothing.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> f = lambda x: spmd.redistribute(x, mesh, P("sp"), P(None, "sp"))
        >>> spmd.shard_map(f, mesh, P("sp"), P(None, "sp"))(torch.arange(6.0).view(3, 2)).tolist()
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    if isinstance(x, Sharded):
        return _redistribute_sharded(x, mesh, src_spec, dst_spec, dst_sizes)
    if src_spec is None or dst_spec is None:
        raise TypeError("redistribute: src_spec and dst_spec are both needed for a tensor "
                        "(a spmd.Sharded knows its source: redistribute(s, mesh, dst_spec))")
    rc = on_mesh(mesh, "redistribute", x)
    src_spec, src_sizes = layout_parts(src_spec, src_sizes, mesh, "redistribute", "src_spec",
                                       "src_sizes")
    dst_spec, dst_sizes = layout_parts(dst_spec, dst_sizes, mesh, "redistribute", "dst_spec",
                                       "dst_sizes")
    src_spec, dst_spec = as_spec(src_spec, "src_spec"), as_spec(dst_spec, "dst_spec")
    for name, spec in (("src_spec", src_spec), ("dst_spec", dst_spec)):
        if len(spec) > x.ndim:
            raise SpecError(f"redistribute: {name} {spec!r} has more entries than x "
                            f"({describe(x)}) has dims")
        for a in spec.axes:
            mesh.check_axes(a, f"redistribute {name}")
    check_spec(x, src_spec, mesh, "redistribute: src_spec")
    src = _src_layout(x, mesh, rc, src_spec, src_sizes)
    src.size_check(x.shape, rc.rank, "x")
    dst = Layout(src.shape, dst_spec, mesh, dst_sizes)
    plan = _plan(src, dst)
    return _redist(anchor(x), rc, plan)


def _redistribute_sharded(x: Sharded, mesh: Mesh, src_spec: Any, dst_spec: Any,
                          dst_sizes: Sizes) -> Sharded:
    if dst_spec is None:  # redistribute(s, mesh, dst_spec): the source is the value's own
        src_spec, dst_spec = None, src_spec
    if dst_spec is None:
        raise TypeError(f"redistribute: give the destination spec for {x!r}: "
                        f"redistribute(s, mesh, dst_spec)")
    src = check_source(x, mesh, src_spec, "redistribute")
    dst_spec, dst_sizes = layout_parts(dst_spec, dst_sizes, mesh, "redistribute", "dst_spec",
                                       "dst_sizes")
    dst = Layout(src.shape, as_spec(dst_spec, "dst_spec"), mesh, dst_sizes)
    if not in_rank_of(mesh):  # every shard is here: cut the assembled tensor anew
        return Sharded.from_global(assemble(x), mesh, dst)
    sizes = {d: s for d, s in enumerate(src.sizes) if s is not None}
    local = redistribute(x.local, mesh, src.spec, dst.spec, src_sizes=sizes,
                         dst_sizes=dst_sizes)
    return Sharded({mesh.rank: local}, dst, mesh)


def _src_layout(x: torch.Tensor, mesh: Mesh, rc: RankContext, spec, sizes) -> Layout:
    probe = Layout((0,) * x.ndim, spec, mesh)
    if sizes is not None or not probe.split_dims:
        shape = list(x.shape)
        given = _as_dict(sizes, x.ndim)
        for d in probe.split_dims:
            if d not in given:
                raise SpecError(f"redistribute: src_sizes gives no sizes for dim {d}, which "
                                f"{spec!r} splits; give every split dim or none")
            shape[d] = sum(given[d])
        return Layout(shape, spec, mesh, given or None)
    # Every rank's shape (int64), to learn the uneven sizes of the split dims.

    def exchange() -> Layout:
        group = mesh.group(mesh.axis_names, rc.rank)
        got = gather_ints(mesh, group, x.shape, name="redistribute sizes", device=x.device)
        return Layout.from_local_shapes(dict(zip(group.ranks, got)), spec, mesh)

    def check(lay: Layout) -> None:
        if lay.local_shape(rc.rank) != tuple(x.shape):
            raise static_mismatch("redistribute", list(x.shape),
                                  list(lay.local_shape(rc.rank)), rc.rank)

    return static_layout(mesh, ("redistribute", spec, x.ndim), exchange, check)


def _as_dict(sizes, ndim: int) -> dict[int, list[int]]:
    if sizes is None:
        return {}
    if isinstance(sizes, Layout):
        return {d: list(s) for d, s in enumerate(sizes.sizes) if s is not None}
    if isinstance(sizes, Mapping):
        return {d % ndim: list(s) for d, s in sizes.items()}
    return {d: list(s) for d, s in enumerate(sizes) if s is not None}


@lru_cache(maxsize=256)
def _plan(src: Layout, dst: Layout):
    """For every receiving rank r: ``pieces[r]`` = [(source rank s, box in s's shard,
    box in r's shard, box shape)]; ``moves``: whether any box crosses ranks."""
    n = math.prod(src.mesh_shape)
    holders: dict[tuple, list[int]] = {}
    for s in range(n):
        holders.setdefault(src.shard_key(s), []).append(s)
    rep_axes = [src.axis_names.index(a) for a in src.replicated_axes]
    pieces, moves = [], False
    for r in range(n):
        r_off, r_shape = dst.offsets(r), dst.local_shape(r)
        rc = coords_of(src.mesh_shape, r)
        mine = []
        for ranks in holders.values():
            s0 = ranks[0]
            s_off, s_shape = src.offsets(s0), src.local_shape(s0)
            lo = [max(a, b) for a, b in zip(r_off, s_off)]
            hi = [min(a + m, b + k) for a, m, b, k in zip(r_off, r_shape, s_off, s_shape)]
            if any(b <= a for a, b in zip(lo, hi)):  # no overlap (or nothing to hold)
                continue
            if r in ranks:
                s = r
            else:  # the replica sharing r's coordinates on the replicated axes, if any
                match = [q for q in ranks
                         if all(coords_of(src.mesh_shape, q)[p] == rc[p] for p in rep_axes)]
                s = (match or ranks)[0]
            shape = tuple(b - a for a, b in zip(lo, hi))
            mine.append((s, tuple(a - o for a, o in zip(lo, s_off)),
                         tuple(a - o for a, o in zip(lo, r_off)), shape))
            moves |= s != r
        pieces.append(tuple(mine))
    return tuple(pieces), moves, tuple(dst.local_shape(r) for r in range(n))


def _box(t: torch.Tensor, off: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    for d, (o, k) in enumerate(zip(off, shape)):
        t = t.narrow(d, o, k)
    return t


def _exchange(chunks, rc: RankContext, shapes):
    """One all-to-all over the whole mesh; ``shapes``: what arrives from each rank (the
    plan knows, so no shape exchange is needed; (0,) where nothing comes)."""
    mesh = rc.mesh
    return comm_of(mesh).all_to_all(chunks, mesh.group(mesh.axis_names, rc.rank),
                                name="redistribute", shapes=shapes)


@custom_vjp
def _redist(x, rc, plan):
    pieces, moves, dst_shapes = plan
    me, n = rc.rank, len(pieces)
    out = x.new_empty(dst_shapes[me])
    if not moves:
        for _, s_box, r_box, shape in pieces[me]:
            _box(out, r_box, shape).copy_(_box(x, s_box, shape))
        return out
    chunks = [x.new_empty(0)] * n
    for r in range(n):
        for s, s_box, _, shape in pieces[r]:
            if s == me:
                chunks[r] = _box(x, s_box, shape).contiguous()
    shapes = [(0,)] * n
    for s, _, _, shape in pieces[me]:
        shapes[s] = shape
    recv = _exchange(chunks, rc, shapes)
    for s, _, r_box, shape in pieces[me]:
        _box(out, r_box, shape).copy_(recv[s].view(shape))
    return out


def _redist_fwd(x, rc, plan):
    return _redist(x, rc, plan), (rc, plan, tuple(x.shape))


def _redist_bwd(res, g):
    rc, plan, x_shape = res
    pieces, moves, _ = plan
    me, n = rc.rank, len(pieces)
    gx = g.new_zeros(x_shape)
    if not moves:
        for _, s_box, r_box, shape in pieces[me]:
            _box(gx, s_box, shape).add_(_box(g, r_box, shape))
        return gx, None, None
    back = [g.new_empty(0)] * n
    for s, _, r_box, shape in pieces[me]:
        back[s] = _box(g, r_box, shape).contiguous()
    shapes = [(0,)] * n
    for r in range(n):
        for s, _, _, shape in pieces[r]:
            if s == me:
                shapes[r] = shape
    with rc:
        got = _exchange(back, rc, shapes)
    for r in range(n):
        for s, s_box, _, shape in pieces[r]:
            if s == me:
                _box(gx, s_box, shape).add_(got[r].view(shape))
    return gx, None, None


_redist.defvjp(_redist_fwd, _redist_bwd)
