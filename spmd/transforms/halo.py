"""``halo_pad`` and ``halo_trim``: halos from neighbours along sharded dims.

The plan is the same on every rank: from the shard sizes along the axis, each padded
position of each rank gets its source, a global index (the neighbour's data inside the
domain; at the global boundary, what ``F.pad``'s mode says: reflect, replicate,
circular) or the constant. So halos wider than the neighbour's shard come from ranks
further away, zero-size shards simply hold nothing, and one exchange moves exactly the
halo elements. Backward is the transpose: cotangents of the halo go back to their
owners and are added into their edges.

The pieces are public to the windowed ops (``spmd/ops/_window.py``): ``exchange`` (the
communication: what arrives), ``assemble`` (the window from the shard and what arrived,
local, so a backward can rebuild it instead of keeping it), ``transpose`` (the backward,
which adds into a buffer of the caller's in place), ``frame`` (the halo alone, for ops
that are linear in their input). ``fetch_window`` and ``unfetch`` are the fetch and its
transpose as differentiable functions, each the other's backward: double backward is
exact.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op
from ..collectives.vjp import custom_vjp
from ..comm import comm_of, gather_ints
from ..comm.base import Pending
from ..core._context import RankContext, on_mesh, static_layout, static_mismatch
from ..core._format import axis_phrase, describe
from ..core.errors import SpecError
from ..core.mesh import Mesh

__all__ = ["halo_pad", "halo_trim"]

MODES = ("constant", "reflect", "replicate", "circular")


def _halo_meta(x, mesh, axis, dim, width, **kwargs):
    """halo_pad's local output under torch.compile: ``lo + size + hi`` along each dim."""
    if not isinstance(x, torch.Tensor):
        return None
    dims, widths = (dim, width) if isinstance(dim, (tuple, list)) else ((dim,), (width,))
    shape = list(x.shape)
    try:
        for d, w in zip(dims, widths):
            lo, hi = _width(w)
            shape[d % x.ndim] += lo + hi
    except Exception:  # noqa: BLE001 - the eager call raises the real error
        return None
    return [(tuple(shape), x.dtype)]


@graph_op(_halo_meta)
def halo_pad(x: torch.Tensor, mesh: Mesh, axis: str | tuple[str, ...] | None | Sequence,
             dim: int | Sequence[int], width: int | tuple[int, int] | Sequence, *,
             mode: str = "constant", value: float = 0.0,
             sizes: Sequence[int] | Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
    """Pad this rank's shard with ``width`` elements from its neighbours along ``dim``.

    The result is this rank's slice of ``F.pad(global_x, ..., mode, value)``: interior
    halos come from the ranks holding those elements (several ranks away if a
    neighbour's shard is narrower than the halo); at the global boundary ``mode``
    applies (``"constant"`` with ``value``, ``"reflect"``, ``"replicate"``,
    ``"circular"``, which wraps from the last rank to the first).

    Args:
        x: this rank's shard (per-rank code: a shard_map body or a launched function).
        mesh: the mesh the code runs on.
        axis: the mesh axis (or tuple of axes) that splits ``dim``; None for a dim that
            is not split (a plain local pad).
        dim: the tensor dim to pad.
        width: ``(lo, hi)`` elements before and after (or one int for both).
        mode, value: as ``F.pad``.
        sizes: every rank's size along ``dim`` (in axis order), if known; otherwise they
            are exchanged first (one small int64 all_gather).

    Several dims at once: pass one entry per dim in ``axis``, ``dim``, ``width`` (and
    ``sizes``), e.g. ``halo_pad(x, mesh, ("x", "y"), (2, 3), ((1, 1), (2, 0)))``. They
    are padded one after the other, so corners come from the diagonal neighbours, as
    ``F.pad`` fills them.

    Returns:
        The padded shard: ``lo + local size + hi`` along ``dim``.

    Raises:
        SpecError: bad axis, dim, width or mode; a reflect or circular halo the global size
            cannot provide (raised on every rank, before the data moves).

    Backward:
        The halo's cotangents travel back to the ranks that own those elements and are
        added into their edges (the transpose of the exchange).

    Ranks without data:
        A rank with an empty shard gets its halos from the nearest ranks that hold data,
        and sends nothing.

    Example:
        >>> mesh = spmd.Mesh((4,), ("sp",))
        >>> f = lambda x: spmd.halo_pad(x, mesh, "sp", 0, (1, 1))
        >>> spmd.shard_map(f, mesh, P("sp"), P("sp"))(torch.arange(8.0)).tolist()
        [0.0, 0.0, 1.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0, 5.0, 6.0, 5.0, 6.0, 7.0, 0.0]
    """
    if isinstance(dim, (tuple, list)):
        per = {"axis": axis, "width": width, "sizes": [None] * len(dim) if sizes is None else sizes}
        for name, v in per.items():
            if not isinstance(v, (tuple, list)) or len(v) != len(dim):
                raise SpecError(f"halo_pad: with dims {tuple(dim)}, {name} must have one entry "
                                f"per dim, got {v!r}")
        for a, d, w, s in zip(axis, dim, width, per["sizes"]):
            x = halo_pad(x, mesh, a, d, w, mode=mode, value=value, sizes=s)
        return x
    rc = on_mesh(mesh, "halo_pad", x)
    if mode not in MODES:
        raise SpecError(f"halo_pad: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise SpecError(f"halo_pad: dim={dim!r} is out of range for x ({describe(x)})")
    dim %= x.ndim
    lo, hi = _width(width)
    axes = None if axis is None else mesh.check_axes(axis, "halo_pad")
    group = None if axes is None else mesh.group(axes, rc.rank)
    if group is None or group.size == 1:
        all_sizes = (x.shape[dim],)
        me = 0
    else:
        all_sizes = _sizes(x, dim, group, rc, sizes)
        me = group.index
    why = check_mode(sum(all_sizes), lo, hi, mode)
    if why is not None:
        raise SpecError(f"halo_pad: width ({lo}, {hi}) on dim {dim} along "
                        f"{_axes_str(axes)} (sizes {list(all_sizes)}): {why}")
    if lo == hi == 0:
        return x
    f = Fetch(rc, axes, me, dim, _plan(all_sizes, halo_ranges(all_sizes, lo, hi), mode),
              float(value), "halo_pad")
    return fetch_window(anchor(x), f)


def fetch_range(x: torch.Tensor, rc: RankContext, axes: tuple[str, ...] | None, dim: int,
                sizes: tuple[int, ...], ranges: tuple[tuple[int, int], ...], *,
                mode: str = "constant", value: float = 0.0,
                name: str = "halo_pad") -> torch.Tensor:
    """Rank ``r`` of the group over ``axes`` gets the global range ``ranges[r]`` of dim
    ``dim`` (shards of ``sizes``); positions outside ``[0, sum(sizes))`` follow ``mode``.

    The building block of ``halo_pad`` and of the windowed ops: a range may reach past a
    neighbour (a wide halo) or stop inside the own shard (a negative halo, a trim). The
    caller checks the mode can fill the range (``check_mode``). One all-to-all moves
    exactly the elements a rank lacks (``name`` in ``comm_stats``); backward is its
    transpose.
    """
    return fetch_window(anchor(x), plan_fetch(rc, axes, dim, sizes, ranges, mode=mode,
                                              value=value, name=name))


def halo_trim(x: torch.Tensor, dim: int, width: int | tuple[int, int]) -> torch.Tensor:
    """Remove ``width = (lo, hi)`` halo elements from ``dim`` (the inverse slice of
    ``halo_pad``; its gradient pads with zeros).

    Example:
        >>> spmd.halo_trim(torch.arange(6.0), 0, (1, 2)).tolist()
        [1.0, 2.0, 3.0]
    """
    if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise SpecError(f"halo_trim: dim={dim!r} is out of range for x ({describe(x)})")
    lo, hi = _width(width, "halo_trim")
    if lo + hi > x.shape[dim]:
        raise SpecError(f"halo_trim: width ({lo}, {hi}) is more than dim {dim % x.ndim} of x "
                        f"({describe(x)}) holds")
    return x.narrow(dim, lo, x.shape[dim] - lo - hi)


# -- the plan: pure arithmetic, the same on every rank ------------------------------------------

def check_mode(n_glob: int, lo: int, hi: int, mode: str) -> str | None:
    """Why ``mode`` cannot fill ``lo``/``hi`` positions beyond a global size ``n_glob``
    (None if it can); the caller words the error."""
    for w in (lo, hi):
        if mode == "reflect" and w > max(n_glob - 1, 0):
            return (f"mode='reflect' needs at most {max(n_glob - 1, 0)} elements per side, "
                    f"the global size minus one")
        if mode in ("circular", "replicate") and w > 0 and n_glob == 0:
            return f"mode={mode!r} cannot pad an empty dim"
        if mode == "circular" and w > n_glob:
            return (f"mode='circular' would wrap more than once around the global size "
                    f"{n_glob}; use at most {n_glob} per side")
    return None


def halo_ranges(sizes: Sequence[int], lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """Every rank's global range after padding its shard with ``(lo, hi)``."""
    out, start = [], 0
    for s in sizes:
        out.append((start - lo, start + s + hi))
        start += s
    return tuple(out)


@lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], ranges: tuple[tuple[int, int], ...], mode: str):
    """Rank r receives the global range ``ranges[r] = (a, b)`` (``a`` may be negative and
    ``b`` past the end: ``mode`` says what lies there).

    Returns ``(sizes, ranges, own, need, const)``: ``own[r] = (pos, local, n)``, the
    positions of r's result copied from its own shard; ``need[r][s]`` = (positions in
    r's result, local indices in s's shard) of what r gets from s; ``const[r]`` =
    positions filled with the value.
    """
    n_glob = sum(sizes)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    owners = [r for r, s in enumerate(sizes) if s > 0]
    owner_starts = [starts[r] for r in owners]
    own, need, const = [], [], []
    for r, (a, b) in enumerate(ranges):
        lo_own, hi_own = max(a, starts[r]), min(b, starts[r + 1])
        if hi_own <= lo_own:
            lo_own = hi_own = a
            own.append((0, 0, 0))
        else:
            own.append((lo_own - a, lo_own - starts[r], hi_own - lo_own))
        by_src: dict[int, tuple[list[int], list[int]]] = {}
        cpos: list[int] = []
        for g0 in list(range(a, lo_own)) + list(range(hi_own, b)):
            g = g0
            if not 0 <= g < n_glob:
                if mode == "constant":
                    cpos.append(g0 - a)
                    continue
                if mode == "reflect":
                    g = -g if g < 0 else 2 * (n_glob - 1) - g
                elif mode == "replicate":
                    g = min(max(g, 0), n_glob - 1)
                else:  # circular
                    g %= n_glob
                if not 0 <= g < n_glob:
                    raise AssertionError(f"{mode} fill of {g0} outside [0, {n_glob})")
            s = owners[bisect.bisect_right(owner_starts, g) - 1]
            pos, idx = by_src.setdefault(s, ([], []))
            pos.append(g0 - a)
            idx.append(g - starts[s])
        need.append({s: (tuple(p), tuple(i)) for s, (p, i) in by_src.items()})
        const.append(tuple(cpos))
    return tuple(sizes), tuple(ranges), tuple(own), tuple(need), tuple(const)


def _width(width, what: str = "halo_pad") -> tuple[int, int]:
    if isinstance(width, int) and not isinstance(width, bool):
        lo = hi = width
    elif isinstance(width, (tuple, list)) and len(width) == 2 and all(
            isinstance(w, int) and not isinstance(w, bool) for w in width):
        lo, hi = width
    else:
        raise SpecError(f"{what}: width must be an int or a pair (lo, hi) of ints, got {width!r}")
    if lo < 0 or hi < 0:
        raise SpecError(f"{what}: width ({lo}, {hi}) must be non-negative; use halo_trim to "
                        f"remove elements")
    return lo, hi


def _axes_str(axes) -> str:
    if axes is None:
        return "an unsplit dim"
    return axis_phrase(axes)


def _sizes(x: torch.Tensor, dim: int, group, rc: RankContext, sizes) -> tuple[int, ...]:
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != group.size:
            raise SpecError(f"halo_pad: sizes={list(sizes)} needs one size per rank of "
                            f"{_axes_str(group.axes)} ({group.size})")
        if sizes[group.index] != x.shape[dim]:
            raise SpecError(
                f"halo_pad: dim {dim} of x has size {x.shape[dim]} on rank {rc.rank} but "
                f"sizes={list(sizes)} says {sizes[group.index]} for its index "
                f"{group.index} of {_axes_str(group.axes)}")
        return sizes

    def exchange() -> tuple[int, ...]:
        rows = gather_ints(rc.mesh, group, (x.shape[dim],), name="halo_pad sizes",
                           device=x.device)
        return tuple(r[0] for r in rows)

    def check(sizes: tuple[int, ...]) -> None:
        if sizes[group.index] != x.shape[dim]:
            raise static_mismatch(f"halo_pad (dim {dim})", x.shape[dim], sizes[group.index],
                                  rc.rank)

    return static_layout(rc.mesh, ("halo_pad", dim, group.axes, x.ndim), exchange, check)


# -- the exchange, the local assembly, and their transpose -------------------------------------

@dataclass(frozen=True)
class Fetch:
    """One planned fetch along one dim: everything but the tensor (see ``plan_fetch``).
    A plain class, not a pytree: custom_vjp keeps it whole among the residuals."""
    rc: RankContext
    axes: tuple[str, ...] | None
    me: int
    dim: int
    plan: tuple
    value: float
    name: str


def plan_fetch(rc: RankContext, axes: tuple[str, ...] | None, dim: int,
               sizes: tuple[int, ...], ranges: tuple[tuple[int, int], ...], *,
               mode: str = "constant", value: float = 0.0, name: str = "halo_pad") -> Fetch:
    """The fetch of ``fetch_range`` as data: ``exchange`` runs its communication,
    ``assemble`` builds the window from the shard and what arrived (no communication,
    so a backward can rebuild it), ``transpose`` is its backward."""
    me = 0 if axes is None else rc.mesh.group(axes, rc.rank).index
    return Fetch(rc, axes, me, dim, _plan(tuple(sizes), tuple(ranges), mode), float(value), name)


def exchange(x: torch.Tensor, f: Fetch) -> list[torch.Tensor]:
    """Send every rank the elements of ``x`` it lacks; return what arrived from each
    member (empty where nothing does): exactly the halo, nothing of the own shard."""
    return exchange_async(x, f).wait()


def exchange_async(x: torch.Tensor, f: Fetch,
                   take: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> Pending:
    """``exchange`` started: ``.wait()`` returns what arrived. Compute that needs no
    halo (a convolution of the shard itself) runs while the halo travels.

    ``take(idx)``: ``x`` at the local positions ``idx`` along the fetch's dim, for an
    ``x`` that is not built (a window padded along other dims: only its sent rows are)."""
    sizes, _, _, need, _ = f.plan
    n = len(sizes)
    take = take or (lambda idx: take_rows(x, f.dim, idx))
    # What each rank r needs from me, gathered in the order r placed it.
    chunks = _chunks(n, lambda r: need[r][f.me][1] if f.me in need[r] else None, take,
                     lambda: take(()))
    counts = [len(need[f.me][s][0]) if s in need[f.me] else 0 for s in range(n)]
    return _exchange_async(chunks, f, counts)


def assemble(x: torch.Tensor, recv: Sequence[torch.Tensor], f: Fetch) -> torch.Tensor:
    """This rank's window from its shard ``x`` and the chunks ``exchange`` received:
    local only. A window inside the shard is a view of it."""
    _, ranges, own, need, const = f.plan
    a, b = ranges[f.me]
    pos, loc, k = own[f.me]
    if is_slice(f):
        return x.narrow(f.dim, loc, k)
    shape = list(x.shape)
    shape[f.dim] = b - a
    out = x.new_full(shape, f.value) if const[f.me] else x.new_empty(shape)
    out.narrow(f.dim, pos, k).copy_(x.narrow(f.dim, loc, k))
    for s, (p, _) in need[f.me].items():
        put_rows(out, f.dim, p, recv[s])
    return out


def is_slice(f: Fetch) -> bool:
    """Whether this rank's window is all from its own shard (a trim or no halo at all)."""
    _, ranges, own, _, _ = f.plan
    a, b = ranges[f.me]
    return own[f.me][2] == b - a


def frame(x: torch.Tensor, recv: Sequence[torch.Tensor], f: Fetch, rows: tuple[int, int],
          keep: tuple[int, int], shape: Sequence[int] | None = None) -> torch.Tensor | None:
    """Window positions ``rows = (lo, hi)`` along the fetch's dim holding only what the
    halo puts at positions ``keep = (k0, k1)`` (outside the shard), zeros elsewhere;
    None if that is all zeros. A linear op's window is the shard, zero-padded, plus such
    slabs: each slab's part can be computed apart, with no padded copy of the shard.
    ``shape``: that of the tensor the fetch pads, where it is not ``x`` (``x`` then only
    gives the dtype and device)."""
    _, _, _, need, const = f.plan
    lo, hi = max(rows[0], keep[0]), min(rows[1], keep[1])
    pick = lambda ps: [(i, p - rows[0]) for i, p in enumerate(ps) if lo <= p < hi]
    fill = [q for _, q in pick(const[f.me])] if f.value != 0 else []
    got = {s: pick(p) for s, (p, _) in need[f.me].items()}
    if not fill and not any(got.values()):
        return None
    shape = list(x.shape if shape is None else shape)
    shape[f.dim] = rows[1] - rows[0]
    out = x.new_zeros(shape)
    if fill:
        fill_rows(out, f.dim, tuple(fill), f.value)
    for s, sel in got.items():
        if sel:
            put_rows(out, f.dim, tuple(q for _, q in sel),
                     rows_of(recv[s], f.dim, tuple(i for i, _ in sel)))
    return out


def transpose(g: torch.Tensor, f: Fetch, *, owned: bool,
              own_grad: torch.Tensor | None = None) -> torch.Tensor:
    """The fetch's backward (see ``transpose_async``, which this waits for)."""
    return transpose_async(g, f, own_grad is not None).wait(owned=owned, own_grad=own_grad)


class _Transposing:
    """A ``transpose`` whose halo cotangents are on their way to their owners."""

    __slots__ = ("g", "f", "pending")

    def __init__(self, g: torch.Tensor, f: Fetch, pending: Pending):
        self.g, self.f, self.pending = g, f, pending

    def wait(self, *, owned: bool, own_grad: torch.Tensor | None = None) -> torch.Tensor:
        return _transposed(self.g, self.f, self.pending.wait(), owned, own_grad)


def transpose_async(g: torch.Tensor, f: Fetch, apart: bool) -> _Transposing:
    """Start the fetch's backward: the halo's cotangents leave now; ``.wait(owned=,
    own_grad=)`` adds what comes back into the shard's cotangent. ``apart``: ``g`` holds
    the window without the shard's block, whose cotangent ``wait`` is given (it may be
    computed meanwhile)."""
    sizes, _, own, need, _ = f.plan
    n, me, dim = len(sizes), f.me, f.dim
    pos, _, k = own[me]
    at = (lambda ps: ps) if not apart else (
        lambda ps: tuple(p if p < pos else p - k for p in ps))  # the shard's block cut out
    back = _chunks(n, lambda s: at(need[me][s][0]) if s in need[me] else None,
                   lambda ps: take_rows(g, dim, ps),  # copies, before anything is added
                   lambda: _empty_like_along(g, dim))
    counts = [len(need[r][me][1]) if me in need[r] else 0 for r in range(n)]
    return _Transposing(g, f, _exchange_async(back, f, counts))


def _transposed(g: torch.Tensor, f: Fetch, got: list[torch.Tensor], owned: bool,
                own_grad: torch.Tensor | None) -> torch.Tensor:
    """The fetch's backward: the window's cotangent ``g`` -> the shard's. Cotangents of
    the halo go back to their owners, who add them into their shards.

    ``owned``: ``g`` is a buffer the caller made and will not read again, so the shard's
    part of it becomes the result in place (a view), with no shard-sized copy.
    ``own_grad``: the shard's cotangent, computed apart (a buffer of the caller's, for a
    window that holds the whole shard); ``g`` then holds the window's other positions
    only, in order, and the halo's cotangents are added into ``own_grad``."""
    sizes, _, own, need, _ = f.plan
    n, me, dim = len(sizes), f.me, f.dim
    pos, loc, k = own[me]
    adds = [r for r in range(n) if me in need[r]]
    if own_grad is not None:
        gx = own_grad
    elif k == sizes[me]:
        gx = g.narrow(dim, pos, k)
        if adds and not owned:
            gx = gx.clone()
    else:
        shape = list(g.shape)
        shape[dim] = sizes[me]
        gx = g.new_zeros(shape)
        gx.narrow(dim, loc, k).copy_(g.narrow(dim, pos, k))
    for r in adds:
        add_rows(gx, dim, need[r][me][1], got[r].to(gx.dtype))  # a caller may sum wider
    return gx


def _chunks(n: int, positions: Callable[[int], tuple[int, ...] | None],
            take: Callable[[tuple[int, ...]], torch.Tensor],
            empty: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """An exchange's chunk for each of ``n`` members: ``take`` of its ``positions``; the
    members given None (all but the neighbours) share one ``empty`` chunk."""
    none = None
    out = []
    for r in range(n):
        ps = positions(r)
        if ps is None:
            if none is None:
                none = empty()
            out.append(none)
        else:
            out.append(take(ps))
    return out


def _exchange_async(chunks: list[torch.Tensor], f: Fetch, counts: list[int]) -> Pending:
    """All-to-all of the planned chunks, started; ``counts[s]``: how many elements along
    the dim arrive from member s (known from the plan, so no shape exchange is needed)."""
    if f.axes is None:  # an unsplit dim: this rank holds it all
        return Pending.done([c.clone() for c in chunks])
    like = chunks[0].shape
    shapes = [tuple(k if d == f.dim else v for d, v in enumerate(like)) for k in counts]
    with f.rc:  # a backward may run it on another thread
        group = f.rc.mesh.group(f.axes, f.rc.rank)
        return comm_of(f.rc.mesh).all_to_all_async(chunks, group, name=f.name, shapes=shapes)


# -- rows at planned positions: a run of consecutive positions (every fetch of a halo
# with zeros, constant or circular padding) is a narrow; others (reflect) an index. An
# index tensor costs a host-to-device copy (on CPU still ~5 us) per call.

@lru_cache(maxsize=4096)
def _run_of(idx: tuple[int, ...]) -> tuple[int, int] | None:
    """``(start, length)`` where ``idx`` are consecutive increasing positions."""
    n = len(idx)
    if n and idx[-1] - idx[0] == n - 1 and all(b == a + 1 for a, b in zip(idx, idx[1:])):
        return idx[0], n
    return None


def _at(idx: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(idx, dtype=torch.long, device=device)


def rows_of(t: torch.Tensor, dim: int, idx: tuple[int, ...]) -> torch.Tensor:
    """``t`` at positions ``idx`` along ``dim``: a view where they are a run."""
    run = _run_of(idx)
    if run is not None:
        return t.narrow(dim, run[0], run[1])
    return t.index_select(dim, _at(idx, t.device))


def take_rows(t: torch.Tensor, dim: int, idx: tuple[int, ...]) -> torch.Tensor:
    """A contiguous copy of ``t`` at positions ``idx`` along ``dim`` (as
    ``index_select``)."""
    run = _run_of(idx)
    if run is not None:
        return t.narrow(dim, run[0], run[1]).clone(memory_format=torch.contiguous_format)
    if not idx:
        return _empty_like_along(t, dim)
    return t.index_select(dim, _at(idx, t.device))


def put_rows(out: torch.Tensor, dim: int, idx: tuple[int, ...], src: torch.Tensor) -> None:
    """``out`` at positions ``idx`` along ``dim`` = ``src`` (as ``index_copy_``)."""
    run = _run_of(idx)
    if run is not None:
        out.narrow(dim, run[0], run[1]).copy_(src)
    elif idx:
        out.index_copy_(dim, _at(idx, out.device), src)


def add_rows(out: torch.Tensor, dim: int, idx: tuple[int, ...], src: torch.Tensor) -> None:
    """``out`` at positions ``idx`` along ``dim`` += ``src`` (as ``index_add_``)."""
    run = _run_of(idx)
    if run is not None:
        out.narrow(dim, run[0], run[1]).add_(src)
    elif idx:
        out.index_add_(dim, _at(idx, out.device), src)


def fill_rows(out: torch.Tensor, dim: int, idx: tuple[int, ...], value: float) -> None:
    """``out`` at positions ``idx`` along ``dim`` = ``value`` (as ``index_fill_``)."""
    run = _run_of(idx)
    if run is not None:
        out.narrow(dim, run[0], run[1]).fill_(value)
    elif idx:
        out.index_fill_(dim, _at(idx, out.device), value)


def _empty_like_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = 0
    return t.new_empty(shape)


# -- as differentiable functions: each one's backward is the other -----------------------------

@custom_vjp
def fetch_window(x: torch.Tensor, f: Fetch) -> torch.Tensor:
    """``assemble(x, exchange(x, f), f)``, differentiable (a copy: never a view of
    ``x``); its backward is ``unfetch``, so double backward is exact too."""
    out = assemble(x, exchange(x, f), f)
    return out.clone() if is_slice(f) else out


def _fetch_fwd(x, f):
    return fetch_window(x, f), f


def _fetch_bwd(f, g):
    return unfetch(g, f), None


fetch_window.defvjp(_fetch_fwd, _fetch_bwd)


@custom_vjp
def unfetch(g: torch.Tensor, f: Fetch) -> torch.Tensor:
    """``transpose`` of an incoming cotangent (copied where it would be changed),
    differentiable: its backward is ``fetch_window``."""
    return transpose(g, f, owned=False)


def _unfetch_fwd(g, f):
    return unfetch(g, f), f


def _unfetch_bwd(f, gg):
    return fetch_window(gg, f), None


unfetch.defvjp(_unfetch_fwd, _unfetch_bwd)
