"""Neighbourhood attention (NATTEN's ``na1d/na2d/na3d``) on inputs split along their spatial
dims: ``neighborhood_attention1d/2d/3d``, and ``neighborhood_attention_reference``, the
same semantics written plainly for checking.

Tensors are NATTEN's "heads last" layout, ``[batch, *spatial, heads, head_dim]``. Each
query attends to the ``kernel_size`` window around it (per spatial dim), shifted inward
at the edges of the domain so every window is full; ``dilation`` makes the window take
every d-th position, inside the query's dilation group; ``is_causal`` (per dim) makes it
end at the query; ``rpb`` adds NATTEN's relative position bias, ``(heads, 2k - 1, ...)``.
The exact rules are in ``_neighborhood.py``.

Sharded: each rank computes the output of its own queries. Along every split spatial
dim it needs the keys and values its windows read: their rows are pure arithmetic on the
global sizes (the edge shift, the dilation), may lie several ranks away where shards are
narrower than the window, and are fetched with one all-to-all per split dim for each of
``k`` and ``v`` (exactly those rows: dilated windows skip rows, and so does the fetch).
Queries never move. Backward: the local kernel's VJP, then the halo's key and value
gradients go back to their owners (the fetch's transpose).

The halo is overlapped with compute: the queries whose windows lie inside the shard
(the interior) attend while the halo travels, the edge queries once it has arrived;
backward, the edges' gradients are computed first and travel while the interior's
backward runs. With several split dims the halo comes level by level (each later dim
fetches the rows of the window padded along the earlier ones, corners included), and
each level's queries attend while the next level's halo travels (``_Levels``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op
from ..collectives.vjp import custom_vjp
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..core.spec import as_spec
from ..transforms.halo import Fetch, assemble, exchange_async, fetch_window, transpose_async
from ._neighborhood import (
    attend,
    attend_backward,
    attend_forward,
    compute_dtype,
    dim_plan,
    dim_windows,
    local_index,
)
from ._window import _MeshOf, input_layout, narrowed, with_layout

__all__ = ["neighborhood_attention1d", "neighborhood_attention2d", "neighborhood_attention3d",
           "neighborhood_attention_reference"]


# -- arguments: checked from the arguments and shapes alone, before anything moves --------------

def _ints(v: Any, n: int, name: str, what: str, least: int) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v,) * n
    if not (isinstance(v, (tuple, list)) and len(v) == n
            and all(isinstance(e, int) and not isinstance(e, bool) for e in v)):
        raise SpecError(f"{what}: {name} must be an int or {n} ints (one per spatial dim), "
                        f"got {v!r}")
    if any(e < least for e in v):
        raise SpecError(f"{what}: {name} must be at least {least} along every spatial dim, "
                        f"got {tuple(v)}")
    return tuple(v)


def _bools(v: Any, n: int, what: str) -> tuple[bool, ...]:
    if isinstance(v, bool):
        return (v,) * n
    if isinstance(v, (tuple, list)) and len(v) == n and all(isinstance(e, bool) for e in v):
        return tuple(v)
    raise SpecError(f"{what}: is_causal must be a bool or {n} bools (one per spatial dim), "
                    f"got {v!r}")


def _check(n: int, q: Any, k: Any, v: Any, kernel_size: Any, dilation: Any, is_causal: Any,
           rpb: Any, scale: Any, what: str, enable_gqa: bool = False) -> tuple:
    """Validated ``(kernel, dilation, causal, scale)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if t.ndim != n + 3:
            raise SpecError(f"{what}: {name} must be [batch, {n} spatial dims, heads, head_dim] "
                            f"({n + 3} dims, NATTEN's heads-last layout), got {describe(t)}")
        if not t.is_floating_point():
            raise TypeError(f"{what}: {name} must be floating point, got {describe(t)}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"{what}: enable_gqa must be a bool, got {enable_gqa!r}")
    if enable_gqa:
        if (k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1] or k.shape[-2] < 1
                or q.shape[-2] % k.shape[-2]):
            raise SpecError(f"{what}: with enable_gqa, k ({describe(k)}) must have the shape of "
                            f"q ({describe(q)}) but for its heads, which must divide q's")
    elif k.shape != q.shape:
        raise SpecError(f"{what}: k ({describe(k)}) must have the shape of q ({describe(q)}); "
                        f"for fewer key/value heads (GQA) pass enable_gqa=True")
    if v.shape[:-1] != k.shape[:-1]:
        raise SpecError(f"{what}: v ({describe(v)}) must match k ({describe(k)}) in every dim "
                        f"but the last (its head_dim may differ)")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise TypeError(f"{what}: q, k, v must share a dtype and device, got {describe(q)} on "
                        f"{q.device}, {describe(k)} on {k.device}, {describe(v)} on {v.device}")
    ks = _ints(kernel_size, n, "kernel_size", what, 1)
    ds = _ints(dilation, n, "dilation", what, 1)
    cs = _bools(is_causal, n, what)
    if rpb is not None:
        want = (q.shape[-2], *(2 * kk - 1 for kk in ks))
        if not isinstance(rpb, torch.Tensor) or tuple(rpb.shape) != want:
            raise SpecError(f"{what}: rpb must be [heads, 2 * kernel_size - 1 per spatial dim] = "
                            f"{list(want)}, got {describe(rpb)}")
        if not rpb.is_floating_point() or rpb.device != q.device:
            raise TypeError(f"{what}: rpb must be floating point on q's device ({q.device}), "
                            f"got {describe(rpb)} on {rpb.device}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{what}: scale must be a number, got {scale!r}")
    return ks, ds, cs, float(scale)


def _check_extent(shape: Sequence[int], n: int, ks, ds, what: str) -> None:
    """NATTEN's rule: a window (``k`` positions, ``d`` apart) must fit in every dim."""
    for i, (kk, dd) in enumerate(zip(ks, ds)):
        L = shape[1 + i]
        if kk * dd > L:
            raise SpecError(
                f"{what}: kernel_size {kk} x dilation {dd} = {kk * dd} positions do not fit in "
                f"spatial dim {i} (tensor dim {1 + i}) of the global q {list(shape)}, which "
                f"has {L}; NATTEN needs kernel_size * dilation <= the size of every spatial "
                f"dim: use a smaller kernel or dilation")


def _check_spec(spec: Any, n: int, what: str) -> None:
    """Heads and head_dim whole (every query needs all of its head's channels), before the
    layout exchange."""
    s = spec.spec if isinstance(spec, Layout) else as_spec(spec, f"{what}: spec")
    for d, name in ((n + 1, "heads"), (n + 2, "head_dim")):
        if s.entry(d) is not None:
            raise SpecError(f"{what}: the spec {s!r} splits dim {d} ({name}); split the batch "
                            f"or the spatial dims (1..{n}) and keep {name} whole (None)")


# -- the op -----------------------------------------------------------------------------------

def _na(n: int, q, k, v, kernel_size, dilation, is_causal, rpb, scale, mesh, spec, enable_gqa):
    what = f"neighborhood_attention{n}d"
    ks, ds, cs, scale = _check(n, q, k, v, kernel_size, dilation, is_causal, rpb, scale, what,
                               enable_gqa)
    if mesh is None:
        if spec is not None:
            raise TypeError(f"{what}: spec= describes a split over a mesh; pass mesh= too, or "
                            f"neither for one device")
        _check_extent(q.shape, n, ks, ds, what)
        dims = tuple((q.shape[1 + i], ks[i], ds[i], cs[i], 0, q.shape[1 + i], None,
                      q.shape[1 + i]) for i in range(n))
        return _local(q, k, v, rpb, dims, scale)
    check_mesh(mesh, what, optional=True)
    if spec is None:
        raise TypeError(f"{what}: pass spec= (q's P or Layout) with mesh=")
    _check_spec(spec, n, what)
    rc, lay = input_layout(q, mesh, spec, what)
    _check_extent(lay.shape, n, ks, ds, what)
    fetches, dims = [], []
    off = lay.offsets(rc.rank)
    for i in range(n):
        dim, L = 1 + i, lay.shape[1 + i]
        geo = (L, ks[i], ds[i], cs[i])
        if lay.sizes[dim] is None:
            dims.append((*geo, 0, L, None, L))
            continue
        axes = lay.dim_axes(dim)
        me = mesh.group(axes, rc.rank).index
        rows, plan = dim_plan(*geo, tuple(lay.sizes[dim]))
        fetches.append(Fetch(rc, axes, me, dim, plan, 0.0, what))
        dims.append((*geo, off[dim], q.shape[dim], rows[me], len(rows[me])))
    if not fetches:  # nothing split along a spatial dim: nothing moves
        return _local(q, k, v, rpb, tuple(dims), scale)
    sp = _levels_plan(tuple(fetches), tuple(dims), q, k, v, scale)
    return _overlapped(q, anchor(k), anchor(v), rpb, sp)


def _windowed(q, k, v, rpb, fetches, dims, scale):
    """The whole window fetched first, then attended (the differentiable form, for a
    backward with grad mode on)."""
    kw, vw = k, v
    for f in fetches:  # one after the other: the later dims fetch the corners too
        kw, vw = fetch_window(anchor(kw), f), fetch_window(anchor(vw), f)
    return _local(q, kw, vw, rpb, dims, scale)


def _heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """Key/value heads repeated for their ``group`` query heads each (GQA): after the
    fetch, so only the key/value heads travel."""
    return t if group == 1 else t.repeat_interleave(group, dim=-2)


def _summed(g: torch.Tensor, group: int) -> torch.Tensor:
    """The transpose of ``_heads``: each key/value head's gradient over its group."""
    return g if group == 1 else g.unflatten(-2, (-1, group)).sum(-2)


def _local(q, kw, vw, rpb, dims, scale):
    """The kernel on flattened tokens: queries ``q``, windows ``kw``/``vw``."""
    group = q.shape[-2] // kw.shape[-2]
    kw, vw = _heads(kw, group), _heads(vw, group)
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    ix = local_index(dims, q.device, B * H * max(D, vw.shape[-1]))
    out = attend(q.flatten(1, -3), kw.flatten(1, -3), vw.flatten(1, -3), rpb, ix, scale)
    return out.view(*q.shape[:-1], vw.shape[-1])


# -- the halo travels while the queries that do not need it attend -----------------------------

@dataclass(frozen=True, eq=False)
class _Levels:
    """Attention over the split spatial dims, level by level, in blocks of this rank's
    queries.

    Level 0 is the shard's own keys and values; level ``j`` the window fetched along the
    first ``j`` split dims (``fetches[j - 1]`` fetches the rows of level ``j - 1``'s
    window, corners included). Along each split dim the interior (``_interior``) is the
    run of query rows whose windows stay in the shard. A query belongs to level ``j``,
    the last split dim along which it is not interior (0: interior along all), so level
    ``j``'s queries are a block per edge of dim ``j``: every row along the earlier split
    dims, the edge's rows along dim ``j``, the interior's along the later ones. Each
    block attends from its level's window as soon as it is there: level 0 while the
    first halo travels, level ``j`` while the next one does. Backward runs the levels
    the other way: level ``j``'s halo gradients travel while level ``j - 1``'s backward
    runs. One split dim: the interior, then its two edges.

    ``parts``: ``(level, cuts, dims)`` per block, level by level: ``cuts`` narrows the
    queries (``(dim, start, length)`` per split dim), ``dims`` is ``_local``'s for the
    block on its level's window. ``pos``: where level ``j - 1``'s window (all of its
    rows along ``fetches[j - 1].dim``) starts in level ``j``'s."""
    fetches: tuple[Fetch, ...]
    pos: tuple[int, ...]
    parts: tuple
    whole: tuple  # ``_local``'s dims for all of this rank's queries on the whole window
    scale: float
    row_elems: int
    group: int  # query heads per key/value head (GQA)


def _levels_plan(fetches: tuple[Fetch, ...], dims: tuple, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scale: float) -> _Levels:
    split = [f.dim - 1 for f in fetches]
    inner = [_interior(*dims[i][:6]) for i in split]

    def part(level: int, runs: list[tuple[int, int]]):
        dm, cuts = list(dims), []
        for j, (i, (r0, r1)) in enumerate(zip(split, runs)):
            L, kk, d, causal, q0, n, rows, w = dims[i]
            home = j >= level  # not fetched along this dim yet: the shard is the window
            dm[i] = (L, kk, d, causal, q0 + r0, r1 - r0,
                     tuple(range(q0, q0 + n)) if home else rows, n if home else w)
            cuts.append((1 + i, r0, r1 - r0))
        return (level, tuple(cuts), tuple(dm))

    parts = [part(0, inner)]
    for j, i in enumerate(split):
        n, (a, b) = dims[i][5], inner[j]
        for edge in ((0, a), (b, n)):
            parts.append(part(j + 1, [(0, dims[s][5]) for s in split[:j]] + [edge] + inner[j + 1:]))
    parts = tuple(p for p in parts if all(c[2] for c in p[1]))
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    return _Levels(fetches, tuple(f.plan[2][f.me][0] for f in fetches), parts, dims, scale,
                   B * H * max(D, v.shape[-1]), H // k.shape[-2])


@lru_cache(maxsize=256)
def _interior(L: int, k: int, d: int, causal: bool, q0: int, n: int) -> tuple[int, int]:
    """The longest run ``[a, b)`` of local query rows whose windows lie in the shard
    ``[q0, q0 + n)`` (``a == b``: none)."""
    if n == 0:
        return 0, 0
    keys, valid, _ = dim_windows(L, k, d, causal)
    keys = keys[q0:q0 + n]
    inside = (keys >= q0) & (keys < q0 + n)
    if valid is not None:
        inside |= ~valid[q0:q0 + n]
    best, run_start = (0, 0), None
    for t, ok in enumerate(inside.all(1).tolist() + [False]):
        if ok and run_start is None:
            run_start = t
        elif not ok and run_start is not None:
            if t - run_start > best[1] - best[0]:
                best = (run_start, t)
            run_start = None
    return best


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1, -3)


def _attend_part(q, kw, vw, rpb, sp: _Levels, part) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's (output in the compute dtype, shaped as its queries; log-sum-exp)."""
    _, cuts, dims = part
    qp = narrowed(q, cuts)
    ix = local_index(dims, q.device, sp.row_elems)
    out, lse = attend_forward(_flat(qp), _flat(kw), _flat(vw), rpb, ix, sp.scale)
    return out.view(*qp.shape[:-1], vw.shape[-1]), lse


def _overlapped_value(q, k, v, rpb, sp: _Levels):
    """(output in the compute dtype, what arrived for k and v at each level, the
    blocks' log-sum-exps)."""
    pend = exchange_async(k, sp.fetches[0]), exchange_async(v, sp.fetches[0])
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=compute_dtype(q))
    lses: list = [None] * len(sp.parts)
    kw, vw, recvs = k, v, []
    for level in range(len(sp.fetches) + 1):
        if level:
            f = sp.fetches[level - 1]
            rk, rv = pend[0].wait(), pend[1].wait()
            recvs.append((rk, rv))
            kw, vw = assemble(kw, rk, f), assemble(vw, rv, f)
            if level < len(sp.fetches):  # the next halo travels while this level attends
                nxt = sp.fetches[level]
                pend = exchange_async(kw, nxt), exchange_async(vw, nxt)
        kh, vh = _heads(kw, sp.group), _heads(vw, sp.group)
        for j, part in enumerate(sp.parts):
            if part[0] == level:
                o, lses[j] = _attend_part(q, kh, vh, rpb, sp, part)
                narrowed(out, part[1]).copy_(o)
    return out, recvs, lses


def _overlapped_primal(q, k, v, rpb, sp):
    return _overlapped_value(q, k, v, rpb, sp)[0].to(q.dtype)


_overlapped = custom_vjp(_overlapped_primal, nondiff_argnums=(4,))


def _overlapped_fwd(q, k, v, rpb, sp):
    with torch.no_grad():
        out, recvs, lses = _overlapped_value(q, k, v, rpb, sp)
    # k and v themselves and the halo rows, not the windows: a double backward must
    # reach k and v, and the windows' shard blocks would be copies of them
    return out.to(q.dtype), (q, k, v, rpb, recvs, out, lses)


def _overlapped_bwd(sp, res, g):
    q, k, v, rpb, recvs, out, lses = res
    if torch.is_grad_enabled():  # create_graph or torch.func: differentiable all the way
        return _plain_vjp(q, k, v, rpb, sp, g)
    # Gradients of k and v summed in the compute dtype (float32 for half inputs: the
    # levels' parts meet in the shard), sent in the inputs' dtype.
    cd, G, dt = out.dtype, sp.group, q.dtype
    kws, vws = [k.to(cd)], [v.to(cd)]
    for f, (rk, rv) in zip(sp.fetches, recvs):  # the windows, rebuilt level by level
        kws.append(assemble(kws[-1], [r.to(cd) for r in rk], f))
        vws.append(assemble(vws[-1], [r.to(cd) for r in rv], f))
    dks, dvs = [torch.zeros_like(kws[-1])], [torch.zeros_like(vws[-1])]
    for f, pos in zip(reversed(sp.fetches), reversed(sp.pos)):  # each level's: a view of the next's
        n = f.plan[0][f.me]
        dks.insert(0, dks[0].narrow(f.dim, pos, n))
        dvs.insert(0, dvs[0].narrow(f.dim, pos, n))
    dq = torch.zeros_like(q)
    drpb = None if rpb is None else torch.zeros_like(rpb, dtype=cd)
    back = None
    for level in reversed(range(len(sp.fetches) + 1)):
        kh, vh = _heads(kws.pop(), G), _heads(vws.pop(), G)  # the larger windows go first
        for part, lse in zip(sp.parts, lses):
            if part[0] != level:
                continue
            cuts, dims = part[1], part[2]
            qp = narrowed(q, cuts)
            got = attend_backward(_flat(qp), _flat(kh), _flat(vh), rpb, _flat(narrowed(out, cuts)),
                                  lse, _flat(narrowed(g, cuts)), local_index(dims, q.device, sp.row_elems),
                                  sp.scale)
            narrowed(dq, cuts).copy_(got[0].view(qp.shape))
            dks[level] += _summed(got[1].view(kh.shape), G)
            dvs[level] += _summed(got[2].view(vh.shape), G)
            if drpb is not None:
                drpb.add_(got[3])
        if back is not None:  # the level above's halo gradients, home: into this level's
            back[0].wait(owned=True, own_grad=dks[level])
            back[1].wait(owned=True, own_grad=dvs[level])
        if level:  # this level's halo gradients travel while the level below's backward runs
            f = sp.fetches[level - 1]
            back = (transpose_async(dks[level].to(dt), f, apart=False),
                    transpose_async(dvs[level].to(dt), f, apart=False))
    return (dq, dks[0].to(dt), dvs[0].to(dt), None if drpb is None else drpb.to(rpb.dtype))


def _plain_vjp(q, k, v, rpb, sp, g):
    """The backward as differentiable torch code (double backward, torch.func): the
    window fetched whole again, attended, differentiated."""
    args = [a for a in (q, k, v, rpb) if a is not None]

    def f(q, k, v, *r):
        return _windowed(q, k, v, r[0] if r else None, sp.fetches, sp.whole, sp.scale)

    _, vjp = torch.func.vjp(f, *args)
    got = vjp(g)
    return (*got, *([None] if rpb is None else []))


_overlapped.defvjp(_overlapped_fwd, _overlapped_bwd)


def _output_layout(layout: Layout, head_dim_v: int | None = None) -> Layout:
    """The output's layout: q's, with v's head_dim (``head_dim_v``) last."""
    if head_dim_v is None:
        return layout
    shape = (*layout.shape[:-1], head_dim_v)
    given = {d: s for d, s in enumerate(layout.sizes) if s is not None}
    return Layout(shape, layout.spec, _MeshOf(layout), given or None)


_DOC_COMMON = """
    Args:
        q, k, v: this rank's shards (per-rank code: a shard_map body or a launched
            function), ``[batch, {dims}, heads, head_dim]`` (NATTEN's heads-last layout);
            ``k`` shaped as ``q`` (but for its heads with ``enable_gqa``), ``v`` as
            ``k`` but for its head_dim. With ``mesh=None``, the whole tensors on one
            device.
        kernel_size: the window, an int or one per spatial dim (at least 1; NATTEN
            needs ``kernel_size * dilation <=`` the global size of every spatial dim).
            Even sizes put one more position before the query than after.
        dilation: an int or one per spatial dim (at least 1).
        is_causal: a bool or one per spatial dim: the window ends at the query.
        rpb: NATTEN's relative position bias, ``[heads, {rpb}]`` (replicated), or None.
            Along a causal dim the offsets are ``-(k - 1)..0`` (NATTEN refuses rpb with
            causal masking; here it follows the same indexing).
        scale: the score scale, default ``head_dim ** -0.5``.
        mesh: the mesh the code runs on, or None (one device: ``spec`` None too).
        spec: q's ``P`` (its ranks exchange their sizes, one small all_gather) or its
            ``Layout`` (no exchange); the same split holds for k and v. Batch and spatial
            dims may be split (several spatial dims at once); heads and head_dim not.
        enable_gqa: as SDPA's: k and v may have fewer heads, dividing q's; query head
            ``h`` reads key/value head ``h // (heads / kv_heads)``. Only the key/value
            heads travel; they are repeated for their query heads after the fetch.

    Returns:
        This rank's shard of the output, ``[batch, {dims}, heads, head_dim of v]``,
        split as q (``output_layout(layout, head_dim_v)``).

    Communication:
        Per split spatial dim, one all-to-all named ``"{what}"`` for ``k`` and one for
        ``v``: exactly the key/value rows outside the shard that this rank's windows
        read (from several ranks away where shards are narrow; later dims bring the
        corners). Queries never move. With a ``P`` spec, one small size exchange first.

    Backward:
        The local kernel's VJP (scores recomputed in chunks: it keeps q, k, v, the
        key/value rows that arrived, the output and the log-sum-exp), then the halo's
        key/value gradients go back to their owners and are added into their shards
        (the fetch's transpose). The transfers overlap the attention of the queries
        that do not need them (the interior, then level by level along several split
        dims), forward and backward. ``rpb``'s gradient is this rank's
        part; shard_map's parameter rule (or ``spmd.parallel``) sums it over ranks.
        Double backward is exact too.

    Ranks without data:
        A rank without query rows fetches nothing, returns an empty output, still sends
        its rows to the ranks that read them, and gets them back in backward.

    Raises:
        SpecError: wrong ranks of q/k/v, mismatched shapes, a bad kernel_size, dilation,
            is_causal or rpb shape, a kernel that does not fit the global size, a spec
            splitting heads or head_dim, an unknown axis. All before any data moves,
            on every rank alike.
        TypeError: non-tensors, non-floating dtypes, mixed dtypes or devices, a mesh
            that is not a ``spmd.Mesh``, a spec without a mesh.
"""


def _doc(n: int, example: str) -> str:
    dims = {1: "L", 2: "X, Y", 3: "X, Y, Z"}[n]
    rpb = ", ".join(["2k - 1"] * n)
    return (f"NATTEN's ``na{n}d`` on this rank's shard of inputs split along their spatial "
            f"dims.\n" + _DOC_COMMON.format(dims=dims, rpb=rpb, what=f"neighborhood_attention{n}d")
            + "\n    Example:\n" + example)


def _na_meta(q, k, v, *args, **kwargs):
    """The output under torch.compile: q's shape ([B, *spatial, heads, head_dim]) with
    v's head size (k and v share q's spatial dims: checked at run time)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.ndim != v.ndim:
        return None
    return [((*q.shape[:-1], v.shape[-1]), q.dtype)]


@with_layout(_output_layout)
@graph_op(_na_meta)
def neighborhood_attention1d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             kernel_size: int | Sequence[int], dilation: int | Sequence[int] = 1,
                             is_causal: bool | Sequence[bool] = False, *,
                             rpb: torch.Tensor | None = None, scale: float | None = None,
                             mesh: Mesh | None = None, spec: Any = None,
                             enable_gqa: bool = False) -> torch.Tensor:
    return _na(1, q, k, v, kernel_size, dilation, is_causal, rpb, scale, mesh, spec,
               enable_gqa)


@with_layout(_output_layout)
@graph_op(_na_meta)
def neighborhood_attention2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             kernel_size: int | Sequence[int], dilation: int | Sequence[int] = 1,
                             is_causal: bool | Sequence[bool] = False, *,
                             rpb: torch.Tensor | None = None, scale: float | None = None,
                             mesh: Mesh | None = None, spec: Any = None,
                             enable_gqa: bool = False) -> torch.Tensor:
    return _na(2, q, k, v, kernel_size, dilation, is_causal, rpb, scale, mesh, spec,
               enable_gqa)


@with_layout(_output_layout)
@graph_op(_na_meta)
def neighborhood_attention3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             kernel_size: int | Sequence[int], dilation: int | Sequence[int] = 1,
                             is_causal: bool | Sequence[bool] = False, *,
                             rpb: torch.Tensor | None = None, scale: float | None = None,
                             mesh: Mesh | None = None, spec: Any = None,
                             enable_gqa: bool = False) -> torch.Tensor:
    return _na(3, q, k, v, kernel_size, dilation, is_causal, rpb, scale, mesh, spec,
               enable_gqa)


neighborhood_attention1d.__doc__ = _doc(1, """\
        >>> from spmd.ops import neighborhood_attention1d, neighborhood_attention_reference
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> q, k, v = torch.randn(3, 2, 10, 2, 4).unbind(0)  # [batch, L, heads, head_dim]
        >>> f = lambda q, k, v: neighborhood_attention1d(q, k, v, 3, dilation=2, mesh=mesh,
        ...                                              spec=P(None, "sp"))
        >>> y = spmd.shard_map(f, mesh, (P(None, "sp"),) * 3, P(None, "sp"))(q, k, v)
        >>> torch.allclose(y, neighborhood_attention_reference(q, k, v, 3, 2), atol=1e-6)
        True
""")
neighborhood_attention2d.__doc__ = _doc(2, """\
        >>> from spmd.ops import neighborhood_attention2d, neighborhood_attention_reference
        >>> mesh = spmd.Mesh((2, 2), ("x", "y"))
        >>> spec = P(None, "x", "y")
        >>> q, k, v = torch.randn(3, 1, 7, 6, 2, 4).unbind(0)  # [batch, X, Y, heads, dim]
        >>> rpb = torch.randn(2, 5, 5)  # [heads, 2 * 3 - 1, 2 * 3 - 1]
        >>> f = lambda q, k, v: neighborhood_attention2d(q, k, v, 3, rpb=rpb, mesh=mesh,
        ...                                              spec=spec)
        >>> y = spmd.shard_map(f, mesh, (spec,) * 3, spec)(q, k, v)
        >>> torch.allclose(y, neighborhood_attention_reference(q, k, v, 3, rpb=rpb), atol=1e-6)
        True
""")
neighborhood_attention3d.__doc__ = _doc(3, """\
        >>> from spmd.ops import neighborhood_attention3d, neighborhood_attention_reference
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> q, k, v = torch.randn(3, 1, 4, 3, 3, 1, 2).unbind(0)
        >>> f = lambda q, k, v: neighborhood_attention3d(q, k, v, (2, 3, 3), is_causal=(True,
        ...                                              False, False), mesh=mesh, spec=P(None, "sp"))
        >>> y = spmd.shard_map(f, mesh, (P(None, "sp"),) * 3, P(None, "sp"))(q, k, v)
        >>> want = neighborhood_attention_reference(q, k, v, (2, 3, 3), is_causal=(True, False, False))
        >>> torch.allclose(y, want, atol=1e-6)
        True
""")


# -- the reference: the same semantics, written plainly ------------------------------------------

def neighborhood_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     kernel_size: int | Sequence[int],
                                     dilation: int | Sequence[int] = 1,
                                     is_causal: bool | Sequence[bool] = False, *,
                                     rpb: torch.Tensor | None = None,
                                     scale: float | None = None,
                                     enable_gqa: bool = False) -> torch.Tensor:
    """Neighbourhood attention on one device, written plainly: every query's window keys
    and values gathered (``K = prod(kernel_size)`` copies of k and v), scores, bias, mask,
    softmax. For checking (against NATTEN, or the sharded ops), not for speed.

    Args:
        q, k, v: ``[batch, *spatial (1 to 3 dims), heads, head_dim]``; ``v``'s head_dim
            may differ.
        kernel_size, dilation, is_causal, rpb, scale, enable_gqa: as
            ``neighborhood_attention2d``.

    Returns:
        ``[batch, *spatial, heads, head_dim of v]``, in q's dtype (computed in float32
        for float16/bfloat16).

    Raises:
        SpecError, TypeError: as ``neighborhood_attention2d``.

    Example:
        >>> from spmd.ops import neighborhood_attention_reference
        >>> q, k, v = torch.randn(3, 1, 5, 1, 2).unbind(0)
        >>> y = neighborhood_attention_reference(q, k, v, 5)  # the window is the whole dim
        >>> full = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        >>> torch.allclose(y, full, atol=1e-6)
        True
    """
    n = q.ndim - 3 if isinstance(q, torch.Tensor) else 0
    what = "neighborhood_attention_reference"
    if n not in (1, 2, 3):
        raise SpecError(f"{what}: q must be [batch, 1 to 3 spatial dims, heads, head_dim], "
                        f"got {describe(q)}")
    ks, ds, cs, scale = _check(n, q, k, v, kernel_size, dilation, is_causal, rpb, scale, what,
                               enable_gqa)
    _check_extent(q.shape, n, ks, ds, what)
    group = q.shape[-2] // k.shape[-2]
    k, v = _heads(k, group), _heads(v, group)
    cd = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    # index arrays [L_i, k_i] per dim, shaped to broadcast over (L_0.., k_0..)
    keys, masks, rels = [], [], []
    for i in range(n):
        key, valid, rel = dim_windows(q.shape[1 + i], ks[i], ds[i], cs[i])
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = key.shape
        keys.append(key.to(q.device).view(shape))
        rels.append(rel.to(q.device).view(shape))
        if valid is not None:
            masks.append(valid.to(q.device).view(shape))
    kg = k.to(cd)[(slice(None), *keys)]  # [B, L.., k.., H, D]
    vg = v.to(cd)[(slice(None), *keys)]
    s = (q.to(cd)[(slice(None),) + (slice(None),) * n + (None,) * n] * kg).sum(-1) * scale
    if rpb is not None:
        bias = rpb.to(cd)[(slice(None), *rels)]  # [H, L.., k..]
        s = s + bias.movedim(0, -1)
    for m in masks:
        s = s.masked_fill(~m[..., None], float("-inf"))
    flat = s.flatten(1 + n, 2 * n)  # [B, L.., K, H]
    p = torch.softmax(flat, dim=1 + n).view(s.shape)
    out = (p[..., None] * vg).sum(tuple(range(1 + n, 1 + 2 * n)))
    return out.to(q.dtype)
