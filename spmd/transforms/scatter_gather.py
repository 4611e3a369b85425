"""``scatter`` and ``gather``: a whole tensor on one rank <-> its shards on every rank.

Each is one exchange over all mesh axes in which only the ranks that hold data send,
and each rank receives only what it keeps: ``scatter`` sends every rank exactly its
shard of ``Layout(shape, spec, mesh, sizes)`` from ``src`` (the comm's ``scatter``,
which reads the shards as views of ``x``: ``src`` holds ``x`` plus its own shard, not
copies of every shard); ``gather`` sends one copy of every shard to ``dst`` (an
``all_to_all``). Metadata travels first as fixed-length int64 tensors
(a dtype code table, never pickles), so ranks without data need not know the shape,
and shape errors are raised on every rank before any data moves.

Every tensor in per-rank code is device-varying (docs/design.md), so the backward rules are
exact transposes: ``scatter``'s backward sums the shard cotangents of every rank
(replicas included) into ``src``'s gradient; ``gather``'s backward sends each part of
``dst``'s cotangent to the copy that the forward read, and zeros to the other replicas
(their partial gradients, summed by ``spmd.parallel`` like any replicated parameter's).

Ranks without data still take part in backward: ``scatter`` anchors a dummy leaf on
them; ``gather`` gives their Placeholder a private handle to its autograd node, which
``backward(outputs)`` (or ``Placeholder.backward()``) runs.
"""
from __future__ import annotations

import math
from typing import Any

import optree
import torch

from ..collectives._anchor import anchor
from ..collectives.vjp import custom_vjp
from ..comm import comm_of
from ..core._context import in_rank_of, on_mesh
from ..core._format import describe, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.placeholder import Placeholder
from ..core.provenance import check_spec
from ..core.spec import P
from .sharded import Sharded, assemble, check_source
from .spec_arg import layout_parts

__all__ = ["scatter", "gather", "backward"]

# Fixed dtype code table for the metadata exchanges (never pickled).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.bool)
MAX_NDIM = 16
_OK, _MISSING, _BAD_DTYPE, _TOO_MANY_DIMS = 0, 1, 2, 3
_HDR = 4  # scatter meta: [status, dtype code, requires_grad, ndim, *shape (MAX_NDIM)]


def _check_rank(r: Any, n: int, what: str, name: str) -> int:
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
        raise SpecError(f"{what}: {name}={r!r} is not a global rank of the mesh "
                        f"(0..{n - 1})")
    return r


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


# -- scatter ------------------------------------------------------------------------------------

def scatter(x: torch.Tensor | Placeholder | None, mesh: Mesh, spec: Any, *, src: int = 0,
            sizes: Any = None) -> torch.Tensor:
    """Cut the whole tensor ``x`` held by rank ``src`` into shards; every rank gets its own.

    Each rank returns its shard of ``Layout(x.shape, spec, mesh, sizes)`` (uneven and
    zero-size shards allowed). ``src`` sends each rank exactly its shard, over all mesh
    axes (ranks replicated over mesh axes absent from ``spec`` each receive a copy);
    no other rank sends data. It sends the shards as views of ``x`` (strided ones
    through staging buffers of a few MiB) and copies its own last, so its peak is ``x``
    plus its shard (1 + 1/P times ``x`` for even shards); the result never aliases
    ``x``. Shape, dtype and requires_grad come from ``src`` first as one fixed-length
    int64 broadcast (counted by ``comm_stats`` as ``"scatter meta"``; the data as
    ``"scatter"``).

    Args:
        x: on ``src``, the full tensor; elsewhere a Placeholder, None, or anything
            (ignored, a Placeholder is checked against ``src``'s shape and dtype).
        mesh: the mesh the code runs on (per-rank code: a shard_map body or a function
            run by ``spmd.launch``).
        spec: how to cut, as a ``P`` over the mesh axes, or a ``Layout`` (its sizes:
            leave ``sizes`` out).
        src: the global rank holding ``x``.
        sizes: explicit shard sizes, as ``Layout`` takes them (default: balanced).

    Returns:
        This rank's shard, on every rank.

    Raises:
        SpecError: ``src`` out of range, ``x`` missing on ``src``, a spec or sizes that do
            not fit ``x``'s shape, the wrong mesh (all raised on every rank, before the
            data moves, except the mesh, src and Placeholder checks, which are local).

    Backward:
        The transpose: every rank's shard cotangent goes back to ``src``, where they are
        added into ``x.grad`` at their slices (replicas' cotangents summed).

    Ranks without data:
        Their shard requires grad iff ``src``'s ``x`` does (under grad mode); they anchor
        a dummy leaf so that the scatter's autograd node exists on every rank and they
        send their cotangents back in the backward exchange.

    Example:
        >>> from spmd.transforms.scatter_gather import scatter
        >>> def body(mesh):
        ...     x = torch.arange(5.0, requires_grad=True) if mesh.rank == 0 else None
        ...     y = scatter(x, mesh, P("sp"), src=0)
        ...     (y * 10).sum().backward()
        ...     return y.tolist(), None if x is None else x.grad.tolist()
        >>> spmd.launch(body, (3,), ("sp",), backend="threads")
        [([0.0, 1.0], [10.0, 10.0, 10.0, 10.0, 10.0]), ([2.0, 3.0], None), ([4.0], None)]
    """
    rc = on_mesh(mesh, "scatter", tensor=False)
    spec, sizes = layout_parts(spec, sizes, mesh, "scatter")
    n = math.prod(mesh.shape)
    _check_rank(src, n, "scatter", "src")
    group = mesh.group(mesh.axis_names, rc.rank)
    si = group.ranks.index(src)
    me_src = rc.rank == src
    device = x.device if isinstance(x, torch.Tensor) else mesh.device

    meta = torch.zeros(_HDR + MAX_NDIM, dtype=torch.int64)
    if me_src:
        if not isinstance(x, torch.Tensor):
            meta[0] = _MISSING
        elif x.dtype not in DTYPES:
            meta[0] = _BAD_DTYPE
        elif x.ndim > MAX_NDIM:
            meta[0] = _TOO_MANY_DIMS
        else:
            meta[1] = DTYPES.index(x.dtype)
            meta[2] = int(x.requires_grad and torch.is_grad_enabled())
            meta[3] = x.ndim
            meta[_HDR:_HDR + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    if group.size > 1:
        meta = comm_of(rc.mesh).broadcast(meta.to(device), si, group, name="scatter meta").cpu()
    status, code, rg, nd = (int(v) for v in meta[:_HDR].tolist())
    if status == _MISSING:
        raise SpecError(f"scatter: x is missing on src rank {src} (got "
                        f"{describe(x) if me_src else 'no tensor'}); rank {src} must pass "
                        f"the full tensor")
    if status == _BAD_DTYPE:
        raise SpecError(f"scatter: src rank {src} passed a tensor of unsupported dtype "
                        f"{x.dtype if me_src else '(unknown)'}")
    if status == _TOO_MANY_DIMS:
        raise SpecError(f"scatter: src rank {src} passed a tensor with more than {MAX_NDIM} dims")
    shape = tuple(meta[_HDR:_HDR + nd].tolist())
    dtype = DTYPES[code]
    lay = Layout(shape, spec, mesh, sizes)  # spec/sizes errors: the same on every rank
    if not me_src and isinstance(x, Placeholder) and (
            tuple(x.shape) != shape or x.dtype != dtype):
        raise SpecError(f"scatter: the Placeholder on rank {rc.rank} is "
                        f"{shape_str(x.shape, x.dtype)} but src rank {src} holds "
                        f"{shape_str(shape, dtype)}")
    if me_src:
        xin = x
    else:
        xin = _empty(dtype, device)
        if rg and torch.is_grad_enabled():
            xin = anchor(xin)
    return _scatter(xin, rc, group, lay, si)


@custom_vjp
def _scatter(x, rc, group, lay, si):
    # Views, not copies: the comm reads each shard in place (Comm.scatter).
    chunks = [lay.shard(x, r) for r in group.ranks] if group.index == si else None
    return comm_of(rc.mesh).scatter(chunks, si, group, name="scatter",
                                    shape=lay.local_shape(rc.rank), dtype=x.dtype,
                                    device=x.device)


def _scatter_fwd(x, rc, group, lay, si):
    return _scatter(x, rc, group, lay, si), (rc, group, lay, si, tuple(x.shape))


def _scatter_bwd(res, g):
    """The transpose: every rank's cotangent goes to src, added at its slice."""
    rc, group, lay, si, x_shape = res
    empty = g.new_empty(0)
    chunks = [g.contiguous() if i == si else empty for i in range(group.size)]
    with rc:
        got = comm_of(rc.mesh).all_to_all(chunks, group, name="scatter")
    if group.index != si:
        return (g.new_zeros(x_shape), None, None, None, None)
    gx = g.new_zeros(lay.shape)
    for i, r in enumerate(group.ranks):
        if got[i].numel():
            gx[lay.slices(r)] += got[i]
    return gx, None, None, None, None


_scatter.defvjp(_scatter_fwd, _scatter_bwd)


# -- gather -------------------------------------------------------------------------------------

def gather(x: torch.Tensor | Sharded, mesh: Mesh, spec: Any = None, *, dst: int | None = 0,
           sizes: Any = None) -> torch.Tensor | Placeholder:
    """Assemble the global tensor from every rank's shard on rank ``dst`` (or everywhere).

    ``x`` is this rank's shard of ``Layout(shape, spec, mesh, sizes)``. The shards'
    shapes, dtypes and requires_grad flags are exchanged first (one fixed-length int64
    all_gather, counted as ``"gather meta"``), so the global shape and uneven sizes are
    found without ``sizes=``; given ``sizes`` are checked. Then each shard is sent once
    to ``dst`` (one ``all_to_all`` over all mesh axes, counted as ``"gather"``).

    Which copy is read: ranks replicated over mesh axes absent from ``spec`` hold copies
    of the same shard; a receiver uses its own copy where it holds one, otherwise the
    copy on the lowest global rank holding that shard. No other copy is sent.

    Args:
        x: this rank's shard (per-rank code: a shard_map body or a launched function),
            or a ``spmd.Sharded`` (its layout gives ``spec`` and ``sizes``; on a threads
            mesh outside its ranks, where it holds every shard, the global tensor is
            assembled in place and returned, with no ``dst``).
        mesh: the mesh the code runs on.
        spec: how the tensor is cut, as a ``P`` or a ``Layout`` (its sizes: leave
            ``sizes`` out; for a Sharded: omit it).
        dst: the global rank that receives the whole tensor; None for every rank.
        sizes: the shard sizes, as ``Layout`` takes them (default: the shards' own).

    Returns:
        The global tensor on ``dst``; elsewhere a ``Placeholder`` with its global shape,
        dtype, device, requires_grad, layout, and ``holders=(dst,)``.

    Raises:
        SpecError: ``dst`` out of range, the wrong mesh, shards whose shapes do not fit
            ``spec``/``sizes`` or whose dtypes or ranks differ (raised on every rank,
            before the data moves).

    Backward:
        A scatter of ``dst``'s cotangent: each part goes back to the copy the forward
        read (other replicas get zeros).

    Ranks without data:
        Their Placeholder holds a private handle to the gather's autograd node: calling
        ``backward(out)`` (or ``out.backward()``) on every rank, where ``out`` is the loss
        on ``dst`` and the Placeholder elsewhere, makes them receive their cotangents.

    Example:
        >>> from spmd.transforms.scatter_gather import backward, gather
        >>> def body(mesh):
        ...     x = torch.full((mesh.rank + 1,), float(mesh.rank), requires_grad=True)
        ...     y = gather(x, mesh, P("sp"), dst=0)
        ...     out = (y * torch.arange(6.0)).sum() if mesh.rank == 0 else y
        ...     backward(out)
        ...     return (y.tolist() if mesh.rank == 0 else y), x.grad.tolist()
        >>> for r in spmd.launch(body, (3,), ("sp",), backend="threads"): print(r)
        ([0.0, 1.0, 1.0, 2.0, 2.0, 2.0], [0.0])
        (Placeholder(f32[6], on rank 0, requires_grad), [1.0, 2.0])
        (Placeholder(f32[6], on rank 0, requires_grad), [3.0, 4.0, 5.0])
    """
    if isinstance(x, Sharded):
        lay = check_source(x, mesh, spec, "gather")
        if not in_rank_of(mesh):
            return assemble(x)
        x, spec, sizes = x.local, lay, None
    spec, sizes = layout_parts(spec, sizes, mesh, "gather")
    rc = on_mesh(mesh, "gather", tensor=False)
    n = math.prod(mesh.shape)
    if dst is not None:
        _check_rank(dst, n, "gather", "dst")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gather: expected this rank's shard as a tensor, got {describe(x)}")
    if x.ndim > MAX_NDIM or x.dtype not in DTYPES:
        raise SpecError(f"gather: x ({describe(x)}) has more than {MAX_NDIM} dims or an "
                        f"unsupported dtype")
    if isinstance(spec, P) and len(spec) <= x.ndim:  # (else _gather_layout says what is wrong)
        check_spec(x, spec, mesh, "gather")
    group = mesh.group(mesh.axis_names, rc.rank)
    meta = torch.zeros(3 + MAX_NDIM, dtype=torch.int64)
    meta[0] = DTYPES.index(x.dtype)
    meta[1] = int(x.requires_grad and torch.is_grad_enabled())
    meta[2] = x.ndim
    meta[3:3 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    if group.size > 1:
        rows = comm_of(rc.mesh).all_gather(meta.to(x.device), group, 0, name="gather meta",
                                       sizes=(meta.numel(),) * group.size)
        rows = {r: t.cpu().tolist() for r, t in zip(group.ranks, rows)}
    else:
        rows = {rc.rank: meta.tolist()}
    lay = _gather_layout(rows, spec, mesh, sizes)
    rg = any(row[1] for row in rows.values())
    receivers = tuple(range(n)) if dst is None else (dst,)
    plan = _plan(lay, receivers)
    xin = anchor(x) if rg and torch.is_grad_enabled() else x
    out = _gather(xin, rc, group, lay, plan)
    if rc.rank in receivers:
        return out
    return Placeholder(torch.Size(lay.shape), x.dtype, x.device, bool(rg), lay, (dst,),
                       out if out.requires_grad else None)


def _gather_layout(rows: dict[int, list[int]], spec: Any, mesh: Mesh, sizes: Any) -> Layout:
    """The global layout from every rank's (dtype, rg, ndim, shape) row; errors on every rank."""
    codes = {row[0] for row in rows.values()}
    if len(codes) > 1:
        got = {r: str(DTYPES[row[0]]) for r, row in rows.items()}
        raise SpecError(f"gather: the shards have different dtypes: {got}")
    nds = {row[2] for row in rows.values()}
    if len(nds) > 1:
        got = {r: row[2] for r, row in rows.items()}
        raise SpecError(f"gather: the shards have different numbers of dims: {got}")
    nd = nds.pop()
    shapes = {r: tuple(row[3:3 + nd]) for r, row in rows.items()}
    lay = Layout.from_local_shapes(shapes, spec, mesh, sizes)
    for r in sorted(shapes):
        lay.size_check(shapes[r], r, "x")
    return lay


def _plan(lay: Layout, receivers: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """For every receiver: the global ranks whose copies it reads (one per shard)."""
    lowest = lay.owners()
    plan = {}
    for r in receivers:
        mine = lay.shard_key(r)
        plan[r] = tuple(sorted(r if k == mine else s for k, s in lowest.items()))
    return plan


@custom_vjp
def _gather(x, rc, group, lay, plan):
    me = rc.rank
    empty = x.new_empty(0)
    chunks = [x if (r != me and r in plan and me in plan[r]) else empty for r in group.ranks]
    got = comm_of(rc.mesh).all_to_all(chunks, group, name="gather")
    if me not in plan:
        return empty
    out = x.new_empty(lay.shape)
    for s in plan[me]:
        out[lay.slices(s)] = x if s == me else got[group.ranks.index(s)]
    return out


def _gather_fwd(x, rc, group, lay, plan):
    return _gather(x, rc, group, lay, plan), (rc, group, lay, plan, tuple(x.shape))


def _gather_bwd(res, g):
    """The transpose: each receiver sends the copies it read their parts of its cotangent."""
    rc, group, lay, plan, x_shape = res
    me = rc.rank
    empty = g.new_empty(0)
    chunks = [g[lay.slices(s)].contiguous() if (me in plan and s != me and s in plan[me])
              else empty for s in group.ranks]
    with rc:
        got = comm_of(rc.mesh).all_to_all(chunks, group, name="gather")
    gx = g.new_zeros(x_shape)
    if me in plan:
        gx += g[lay.slices(me)]
    for i, r in enumerate(group.ranks):
        if r != me and r in plan and me in plan[r]:
            gx += got[i]
    return gx, None, None, None, None


_gather.defvjp(_gather_fwd, _gather_bwd)


# -- backward -----------------------------------------------------------------------------------

def backward(outputs: Any, grads: Any = None) -> None:
    """``torch.autograd.backward`` that also accepts ``gather``'s Placeholders.

    ``outputs`` is a tensor, a Placeholder, or a pytree of them; ``grads`` (optional) the
    cotangents of its tensors, in the same structure (entries for Placeholders are
    ignored; None for a scalar means 1). Tensors are backpropagated as usual; a
    Placeholder runs the backward of the gather that made it, so this rank receives its
    shard's cotangent from the rank holding the data. All roots go to one
    ``torch.autograd.backward`` call; tensors and Placeholders that need no gradient are
    skipped.

    Every rank must call it in the same order relative to other collectives' backward:
    e.g. ``backward(out)`` where ``out`` is the loss on ``dst`` and the Placeholder
    elsewhere. With several gathers, the backward exchanges must meet in the same order
    on every rank (one gather per backward call is the safe pattern).

    Example:
        >>> from spmd.transforms.scatter_gather import backward
        >>> x = torch.ones(2, requires_grad=True)
        >>> backward([x * 3], [torch.tensor([1.0, 2.0])]); x.grad
        tensor([3., 6.])
    """
    outs = optree.tree_leaves(outputs, namespace="spmd")
    if grads is None:
        gs = [None] * len(outs)
    else:
        gs = optree.tree_leaves(grads, namespace="spmd", none_is_leaf=True)
        if len(gs) != len(outs):
            raise SpecError(f"backward: {len(outs)} outputs but {len(gs)} grads")
    roots, cots = [], []
    for o, g in zip(outs, gs):
        if isinstance(o, Placeholder):
            root = o._backward_root()
            if root is not None:
                roots.append(root[0])
                cots.append(root[1])
        elif isinstance(o, torch.Tensor):
            if o.requires_grad:
                roots.append(o)
                cots.append(g)
        elif o is not None:
            raise TypeError(f"backward: expected tensors or Placeholders, got {describe(o)}")
    if roots:
        torch.autograd.backward(roots, cots)
