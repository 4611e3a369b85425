"""Exchange with PyTorch's ``DTensor``, where the spmd layout can be expressed as one.

The mapping, on a torch-backend mesh (one process per rank):

- ``Mesh(shape, axis_names)`` <-> a ``DeviceMesh`` of the same shape with
  ``mesh_dim_names = axis_names``, ranks in row-major order.
- A spec entry naming axis ``a`` for dim ``d`` <-> ``Shard(d)`` on mesh dim ``a``; mesh
  axes the spec leaves out <-> ``Replicate()``.
- A dim split over a tuple of axes <-> ``Shard(d)`` on each of their mesh dims. DTensor
  applies them in mesh-dim order (``torch.chunk`` of ``torch.chunk``), so the tuple must
  list its axes in the mesh's order (axes of size 1 aside); spmd's first-axis-major
  order is then the same.
- Shard sizes: DTensor cuts ``n`` over ``k`` the ``torch.chunk`` way (``ceil(n/k)``
  each, trailing shards smaller or empty: 10 over 4 is ``[3, 3, 3, 1]``), spmd's
  default the ``numpy.array_split`` way (``[3, 3, 2, 2]``). A layout converts when its
  sizes are DTensor's; otherwise ``to_dtensor`` says which sizes to re-cut to.

Neither direction communicates: both sides know every shard's size from the global shape.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..comm import comm_of
from ..core._context import current
from ..core._format import axis_phrase, describe
from ..core.errors import SpecError
from ..core.layout import Layout, balanced_sizes
from ..core.mesh import Mesh, check_mesh
from ..core.spec import P
from ..transforms.sharded import Sharded

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["to_dtensor", "from_dtensor"]

# torch.distributed.tensor is imported where it is used: importing spmd stays as cheap as
# it was for code that never meets a DTensor.

# Which Mesh goes with which DeviceMesh, both ways, so that from_dtensor(dt) without a
# mesh puts values converted one after another on one Mesh (spmd's transforms require
# the same Mesh object), the one to_dtensor took them from where it is alive; and
# to_dtensor on a Mesh made by from_dtensor reuses the DeviceMesh instead of building
# process groups of its own. Weak both ways: a mesh's comm holds its DeviceMesh, and a
# strong value would keep an entry alive forever.
_mesh_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DeviceMesh -> ref(Mesh)
_device_mesh_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Mesh -> ref(DM)


def to_dtensor(x: Sharded | torch.Tensor, layout: Layout | None = None, *,
               mesh: Mesh | None = None) -> DTensor:
    """The ``DTensor`` holding ``x``'s shards (no communication, differentiable).

    Per-rank code on a torch-backend mesh; every rank calls it (the first call on a mesh
    may build its ``DeviceMesh``, which is collective).

    Args:
        x: a ``spmd.Sharded`` (its layout is used), or this rank's shard as a tensor.
        layout: the ``Layout`` of a tensor ``x`` (must equal ``x.layout`` if given with a
            Sharded).
        mesh: the mesh of a tensor ``x`` (default: the mesh this code runs on, as in
            ``spmd.launch`` or ``with mesh:``).

    Returns:
        ``DTensor.from_local(shard, device_mesh, placements, shape=..., stride=...)`` on
        the mesh's ``DeviceMesh`` (dim names = axis names): ``Shard(d)`` on the mesh dims
        splitting dim ``d``, ``Replicate()`` on the others. Backward is DTensor's
        (``from_local``'s): the shard gets the gradient DTensor gives its local tensor.

    Example:
        >>> def per_rank(mesh):
        ...     s = spmd.Sharded.from_global(torch.arange(10.0), mesh, P("sp"))
        ...     dt = spmd.to_dtensor(s)
        ...     return dt.placements, dt.to_local().tolist()
        >>> spmd.launch(per_rank, (2,), ("sp",), backend="gloo")  # doctest: +SKIP
        [((Shard(dim=0),), [0.0, 1.0, 2.0, 3.0, 4.0]), ((Shard(dim=0),), [5.0, ...])]

    Raises:
        SpecError: a threads mesh (DTensor needs a process group); a dim split over axes
            in another order than the mesh's; shard sizes DTensor would not compute for
            this global shape (the message gives the sizes to re-cut to). Every rank
            raises the same error, before anything is built.
    """
    s = _as_sharded(x, layout, mesh)
    lay = s.layout
    placements = _placements(lay)
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(s.local, _device_mesh(s.mesh), placements, run_check=False,
                              shape=torch.Size(lay.shape), stride=_contiguous(lay.shape))


def from_dtensor(dt: DTensor, mesh: Mesh | None = None) -> Sharded:
    """``dt`` as a ``spmd.Sharded`` of this rank's shard (no communication, differentiable).

    Args:
        dt: a DTensor whose placements are ``Shard`` and ``Replicate``.
        mesh: the spmd mesh to put it on: its shape and axis names must be the
            ``DeviceMesh``'s. Default: the mesh ``to_dtensor`` made the DeviceMesh for,
            else a torch-backend ``Mesh`` made from it (the same one for every DTensor on
            that DeviceMesh while it lives). Pass the mesh your other values live on to
            use them together: code run by ``spmd.launch`` or under ``with mesh:`` runs
            spmd's collectives on that mesh (another one needs its own ``with``).

    Returns:
        ``Sharded.from_local(dt.to_local(), mesh, layout)``, the layout's sizes those of
        DTensor's ``torch.chunk`` rule: ``Shard(d)`` on mesh dims ``a, b`` gives
        ``P(..., ("a", "b"), ...)`` at dim ``d``.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard, distribute_tensor
        >>> def per_rank(mesh):
        ...     dm = init_device_mesh(mesh.device.type, (2,), mesh_dim_names=("sp",))
        ...     dt = distribute_tensor(torch.arange(5.0), dm, [Shard(0)])
        ...     s = spmd.from_dtensor(dt, mesh)
        ...     return s.layout, s.local.tolist()
        >>> spmd.launch(per_rank, (2,), ("sp",), backend="gloo")  # doctest: +SKIP
        [(Layout(f32[5], P('sp'), sp=[3, 2]), [0.0, 1.0, 2.0]), (..., [3.0, 4.0])]

    Raises:
        SpecError: a ``Partial`` placement (reduce it first), a ``_StridedShard`` or other
            placement spmd has no spec for, a DeviceMesh that does not cover the world
            in row-major order, or a ``mesh`` of another shape or other axis names.
    """
    from torch.distributed.tensor import DTensor
    if not isinstance(dt, DTensor):
        raise TypeError(f"from_dtensor: expected a DTensor, got {describe(dt)}; for this "
                        f"rank's shard as a plain tensor use "
                        f"spmd.Sharded.from_local(t, mesh, layout)")
    mesh_dims = _split_mesh_dims(dt)  # raises on placements spmd has no spec for
    mesh = _mesh_for(dt.device_mesh, mesh, dt)
    shape, names, counts = tuple(dt.shape), mesh.axis_names, mesh.shape
    entries: list[Any] = [None] * len(shape)
    sizes = {}
    for d, ps in mesh_dims.items():
        # Mesh order is DTensor's order of cutting and, as a tuple, spmd's major-first.
        entries[d] = names[ps[0]] if len(ps) == 1 else tuple(names[p] for p in ps)
        sizes[d] = _dtensor_sizes(shape[d], [counts[p] for p in ps])
    lay = Layout(shape, P(*entries), mesh, sizes or None)
    return Sharded.from_local(dt.to_local(), mesh, lay)


# -- spmd -> DTensor ---------------------------------------------------------------------------

def _as_sharded(x: Any, layout: Layout | None, mesh: Mesh | None) -> Sharded:
    if isinstance(x, Sharded):
        if mesh is not None and mesh is not x.mesh:
            raise SpecError(f"to_dtensor: {x!r} lives on {x.mesh!r}, not on the mesh given "
                            f"({mesh!r}); omit mesh= (a Sharded knows its mesh)")
        if layout is not None and layout != x.layout:
            raise SpecError(f"to_dtensor: layout {layout!r} does not describe {x!r}; omit it "
                            f"(a Sharded knows its layout)")
        _need_processes(x.mesh)
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_dtensor: expected a spmd.Sharded or this rank's shard as a "
                        f"tensor, got {describe(x)}")
    if not isinstance(layout, Layout):
        raise TypeError(f"to_dtensor: a tensor needs its layout: to_dtensor(shard, "
                        f"Layout(global_shape, spec, mesh)), got layout={describe(layout)}")
    if mesh is None:
        mesh = current("to_dtensor").mesh
    check_mesh(mesh, "to_dtensor")
    _need_processes(mesh)
    return Sharded.from_local(x, mesh, layout)


def _need_processes(mesh: Mesh) -> None:
    if mesh.backend != "torch":
        raise SpecError(
            f"to_dtensor: {mesh!r} simulates its ranks as threads of one process, but a "
            f"DTensor needs a torch.distributed process group (one process per rank); run "
            f"the code in processes (torchrun, or spmd.launch(fn, shape, axis_names, "
            f"backend='gloo')), or take the global tensor with spmd.gather(x, mesh)")


def _placements(lay: Layout) -> list:
    """DTensor's placements for ``lay``; raises before anything is built where there are
    none, with the layout to re-cut to."""
    from torch.distributed.tensor import Replicate, Shard
    names, counts = lay.axis_names, lay.mesh_shape
    placements: list = [Replicate() for _ in names]
    misordered, missized = [], []
    for d in lay.split_dims:
        pos = [names.index(a) for a in lay.dim_axes(d)]
        # Axes of size 1 cut nothing: only the order of the others matters.
        moving = [p for p in pos if counts[p] > 1]
        if moving != sorted(moving):
            misordered.append(d)
            continue
        for p in pos:
            placements[p] = Shard(d)
        want = _dtensor_sizes(lay.shape[d], [counts[p] for p in sorted(pos)])
        if want != lay.sizes[d]:
            missized.append(d)
    if misordered:
        d = misordered[0]
        axes = lay.dim_axes(d)
        raise SpecError(
            f"to_dtensor: dim {d} is split over axes {axes}, {axes[0]!r} major, but DTensor "
            f"splits a dim over several mesh dims in the mesh's order ({_mesh_str(lay)}), "
            f"so {_mesh_order(axes, names)!r} major; re-lay it first: "
            f"{_fix(lay, 'redistribute')}")
    if missized:
        which = "; ".join(
            f"dim {d} over {_axes_str(lay.dim_axes(d))}: spmd has "
            f"{list(lay.sizes[d])}, DTensor needs "
            f"{list(_dtensor_sizes(lay.shape[d], _counts_in_mesh_order(lay, d)))}"
            for d in missized)
        raise SpecError(
            f"to_dtensor: DTensor cuts a dim of size n over k shards the torch.chunk way "
            f"(ceil(n/k) each, the last ones smaller or empty; over several mesh dims, "
            f"each cut in turn), and this layout's shards have other sizes: {which}; "
            f"re-cut it first with {_fix(lay, 'redistribute')}, or build it with "
            f"{_fix(lay, 'layout')}")
    return placements


def _device_mesh(mesh: Mesh) -> DeviceMesh:
    dm = _alive(_device_mesh_of.get(mesh))
    if dm is None:
        # The comm layer's DeviceMesh is the one its single-axis process groups come
        # from: converting builds no new groups once the mesh has communicated.
        dm = comm_of(mesh).device_mesh
        if _alive(_mesh_of.get(dm)) is None:
            _mesh_of[dm] = weakref.ref(mesh)
    return dm


def _alive(ref: weakref.ref | None) -> Any:
    return None if ref is None else ref()


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of the global shape: the same on every rank (strides derived
    from a local shard could differ between ranks, and uneven shards give wrong ones)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)  # torch's strides for a dim of size 0
    return tuple(reversed(out))


# -- DTensor -> spmd ---------------------------------------------------------------------------

def _split_mesh_dims(dt: DTensor) -> dict[int, list[int]]:
    """``{tensor dim: the mesh dims sharding it, in mesh order}`` of ``dt``'s placements;
    raises for placements other than Shard and Replicate."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    dm, nd = dt.device_mesh, dt.ndim
    names = _names(dm)
    mesh_dims: dict[int, list[int]] = {}
    for p, pl in enumerate(dt.placements):
        where = f"mesh dim {p}" + (f" ({names[p]!r})" if names else "")
        if isinstance(pl, Shard):  # _StridedShard is no Shard: it falls to the end
            if not -nd <= pl.dim < nd:
                raise SpecError(f"from_dtensor: {pl!r} on {where} names no dim of the "
                                f"{nd}-d DTensor")
            mesh_dims.setdefault(pl.dim % nd, []).append(p)
        elif isinstance(pl, Replicate):
            continue
        elif isinstance(pl, Partial):
            fix = [Replicate() if isinstance(q, Partial) else q for q in dt.placements]
            raise SpecError(
                f"from_dtensor: the DTensor is {pl!r} on {where}: its ranks hold partial "
                f"values of a reduction that spmd has no layout for; reduce it first with "
                f"dt.redistribute(dt.device_mesh, {fix!r}) (or Shard(d) in place of "
                f"Replicate() to keep it split), or take dt.full_tensor()")
        else:
            raise SpecError(
                f"from_dtensor: the DTensor is {pl!r} on {where}, a placement spmd has no "
                f"spec for (spmd takes Shard(d) and Replicate()); redistribute it first, "
                f"e.g. dt.redistribute(dt.device_mesh, [Shard(d) or Replicate() for each "
                f"mesh dim])")
    return mesh_dims


def _mesh_for(dm: DeviceMesh, mesh: Mesh | None, dt: DTensor) -> Mesh:
    import torch.distributed as dist
    names, shape = _names(dm), tuple(dm.shape)
    ranks = dm.mesh.flatten().tolist()
    world = dist.get_world_size()
    if ranks != list(range(world)):
        raise SpecError(
            f"from_dtensor: the DTensor's DeviceMesh {shape} holds ranks {ranks}, but a spmd "
            f"mesh covers every one of the {world} processes in row-major order (rank r at "
            f"the r-th point); put the DTensor on such a DeviceMesh first "
            f"(init_device_mesh(device_type, shape, mesh_dim_names=...))")
    if mesh is None:
        if names is None:
            raise SpecError(
                f"from_dtensor: the DTensor's DeviceMesh {shape} has no mesh_dim_names, and "
                f"spmd names its axes: pass mesh=spmd.Mesh({shape}, (names...)) or build the "
                f"DeviceMesh with init_device_mesh(..., mesh_dim_names=...)")
        mesh = _alive(_mesh_of.get(dm))
        if mesh is None:
            mesh = Mesh(shape, names, backend="torch", device=dt.to_local().device)
            _mesh_of[dm] = weakref.ref(mesh)
            _device_mesh_of[mesh] = weakref.ref(dm)
        return mesh
    check_mesh(mesh, "from_dtensor")
    if mesh.backend != "torch":
        raise SpecError(f"from_dtensor: {mesh!r} simulates its ranks as threads of one "
                        f"process; a DTensor's shards live in processes: pass the "
                        f"torch-backend mesh of this process group (or none)")
    if tuple(mesh.shape) != shape or (names is not None and tuple(mesh.axis_names) != names):
        dims = ", ".join(f"{n}={s}" for n, s in zip(names, shape)) if names else \
            f"shape {shape}, no dim names"
        raise SpecError(f"from_dtensor: the DTensor's DeviceMesh is ({dims}) but the mesh "
                        f"given is {mesh!r}; the shape and the axis names must be the same")
    return mesh


def _names(dm: DeviceMesh) -> tuple[str, ...] | None:
    n = dm.mesh_dim_names
    return tuple(n) if n else None


# -- sizes --------------------------------------------------------------------------------------

def _chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """``torch.chunk``'s sizes for ``n`` in ``k`` parts, padded with empty parts to ``k``
    (as DTensor's ``Shard`` pads): ``ceil(n/k)`` each, the last ones smaller or empty."""
    c = -(-n // k)
    return tuple(max(0, min(c, n - i * c)) for i in range(k))


def _dtensor_sizes(n: int, counts: Sequence[int]) -> tuple[int, ...]:
    """DTensor's shard sizes for a dim of size ``n`` cut over mesh dims of ``counts``
    ranks, in mesh order: each cut chunks every piece of the one before, so the shards
    are listed first mesh dim major, as spmd lists a tuple split's."""
    sizes = (n,)
    for k in counts:
        sizes = tuple(s for m in sizes for s in _chunk_sizes(m, k))
    return sizes


def _counts_in_mesh_order(lay: Layout, d: int) -> list[int]:
    pos = sorted(lay.axis_names.index(a) for a in lay.dim_axes(d))
    return [lay.mesh_shape[p] for p in pos]


def _mesh_order(axes: Sequence[str], names: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(axes, key=names.index))


def _fix(lay: Layout, how: str) -> str:
    """The call that makes ``lay`` expressible: every tuple split in mesh order, every
    split dim at DTensor's sizes (listed where they are not the balanced default)."""
    entries = []
    for d in range(lay.ndim):
        axes = _mesh_order(lay.dim_axes(d), lay.axis_names)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    spec = P(*entries)
    sizes = {}
    for d in lay.split_dims:
        counts = _counts_in_mesh_order(lay, d)
        want = _dtensor_sizes(lay.shape[d], counts)
        if want != balanced_sizes(lay.shape[d], math.prod(counts)):
            sizes[d] = list(want)
    if how == "redistribute":
        return (f"spmd.redistribute(x, mesh, {spec!r}"
                + (f", dst_sizes={sizes}" if sizes else "") + ")")
    return (f"Layout({lay.shape}, {spec!r}, mesh"
            + (f", sizes={sizes}" if sizes else "") + ")")


_axes_str = axis_phrase


def _mesh_str(lay: Layout) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(lay.axis_names, lay.mesh_shape))
