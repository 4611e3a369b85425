"""``Sharded``: a global tensor held as shards, each beside the ``Layout`` it belongs to.

The value a sample too large for one device travels as, from the data file to the
loss: no process ever holds the global tensor. ``shard_map`` takes it and returns it
(outputs whose spec splits a dim), so the wrapped forward works on processes at 1/P of
the memory; ``gather``, ``redistribute`` and ``visualize`` accept it.

Which shards a process holds: in per-rank code (a torch process, a ``shard_map`` body, a
function run by ``launch``) the shard of its own rank; on a threads mesh called from
ordinary code (the global view, where one process simulates every rank) the shards of
every rank.

Gradients follow per-rank code: a shard's ``.grad`` is its rank's gradient. Where the
layout splits every mesh axis that is the gradient of the global value's block; where
it replicates over axes A, each copy gets its rank's part and their sum over A is the
global gradient (as for a replicated value in per-rank code).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from ..comm import comm_of
from ..core._context import in_rank_of
from ..core._format import describe, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..core.spec import as_spec

__all__ = ["Sharded", "assemble", "cat_plan", "check_source", "run_cat_plan",
           "same_cut"]


class Sharded:
    """A global tensor as this process's shard(s), its ``Layout`` and its mesh.

    Build one with ``Sharded.from_local`` (this rank's shard), ``Sharded.from_global``
    (cut from a global tensor) or ``Sharded.load`` (a loader reads each rank's block), or
    get one from ``spmd.shard_map``. It is a pytree leaf.

    Attributes:
        layout: the global shape, spec and every shard's size.
        mesh: the mesh the shards live on.
        shards: ``{rank: local tensor}`` for the ranks this process holds (read-only).
        local: the shard of the calling rank (per-rank code), or the only one held.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = spmd.Sharded.from_global(torch.arange(10.0), mesh, P("sp"))
        >>> x
        Sharded(f32[10], P('sp'), sp=[5, 5], shards on ranks [0, 1])
        >>> y = spmd.shard_map(lambda t: t * 2, mesh, P("sp"), P("sp"))(x)
        >>> y.shards[1].tolist(), spmd.gather(y, mesh).tolist()[:3]
        ([10.0, 12.0, 14.0, 16.0, 18.0], [0.0, 2.0, 4.0])
    """

    __slots__ = ("layout", "mesh", "_shards")

    def __init__(self, shards: Mapping[int, torch.Tensor], layout: Layout, mesh: Mesh):
        check_mesh(mesh, "Sharded")
        if not isinstance(layout, Layout):
            raise TypeError(f"Sharded: layout must be a spmd.Layout, got {describe(layout)}; "
                            f"build one with Layout(shape, spec, mesh) or use "
                            f"Sharded.from_local(x, mesh, spec)")
        _same_mesh(layout, mesh, "Sharded")
        if not isinstance(shards, Mapping) or not shards:
            raise TypeError(f"Sharded: shards must be a non-empty {{rank: tensor}} mapping, "
                            f"got {describe(shards)}")
        out, dtype = {}, None
        for r, t in sorted(shards.items()):
            if not isinstance(r, int) or not 0 <= r < mesh.size:
                raise SpecError(f"Sharded: rank {r!r} is not a rank of {mesh!r}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Sharded: the shard of rank {r} is {describe(t)}, not a tensor")
            layout.size_check(t.shape, r, "the shard")
            if dtype is None:
                dtype = t.dtype
            elif t.dtype != dtype:
                raise SpecError(f"Sharded: the shards have different dtypes ({dtype} and "
                                f"{t.dtype} on rank {r})")
            out[r] = t
        self.layout, self.mesh = layout, mesh
        self._shards = MappingProxyType(out)

    # -- constructors -----------------------------------------------------------------------

    @classmethod
    def from_local(cls, local: torch.Tensor, mesh: Mesh, spec: Any) -> Sharded:
        """This rank's shard ``local`` of a tensor laid out by ``spec`` (per-rank code).

        ``spec`` is a ``Layout`` (checked against ``local``, no communication) or a ``P``:
        then every rank of the mesh must call this together, and one small int64
        all_gather of the local shapes gives the uneven sizes.

        Example:
            >>> def per_rank(mesh):
            ...     s = spmd.Sharded.from_local(torch.ones(mesh.rank + 1, 2), mesh, P("sp"))
            ...     return s.layout.sizes[0]
            >>> spmd.launch(per_rank, (2,), ("sp",), backend="threads")
            [(1, 2), (1, 2)]
        """
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"Sharded.from_local: expected this rank's shard as a tensor, got "
                            f"{describe(local)}")
        rank = _own_rank(mesh, "Sharded.from_local")
        if isinstance(spec, Layout):
            return cls({rank: local}, spec, mesh)
        spec = as_spec(spec)
        Layout((0,) * local.ndim, spec, mesh)  # a bad spec raises before anything moves
        return cls({rank: local}, _exchanged_layout(local, mesh, rank, spec), mesh)

    @classmethod
    def from_global(cls, x: torch.Tensor, mesh: Mesh, spec: Any) -> Sharded:
        """The shards of the global tensor ``x`` that this process holds (views of ``x``,
        no copy); ``spec`` is a ``P`` (balanced sizes) or a ``Layout``.

        Example:
            >>> mesh = spmd.Mesh((4,), ("sp",))
            >>> s = spmd.Sharded.from_global(torch.zeros(10, 3), mesh, P("sp"))
            >>> {r: tuple(t.shape) for r, t in s.shards.items()}
            {0: (3, 3), 1: (3, 3), 2: (2, 3), 3: (2, 3)}
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Sharded.from_global: expected a tensor, got {describe(x)}")
        lay = _layout_of(spec, x.shape, mesh, "Sharded.from_global")
        return cls({r: lay.shard(x, r) for r in held_ranks(mesh)}, lay, mesh)

    @classmethod
    def load(cls, loader: Callable[[tuple[slice, ...]], Any], mesh: Mesh, layout: Layout,
             *, device: torch.device | str | None = None) -> Sharded:
        """Read each held rank's block with ``loader(slices)``: ``slices`` index the global
        array (``layout.slices(rank)``), so a rank reads only its block of a file.

        ``loader`` returns a tensor or anything ``torch.as_tensor`` takes (a
        ``numpy.memmap`` slice); it is checked against the block's shape. ``device``:
        where the shard goes (default: the mesh's device).

        Example:
            >>> import numpy as np, tempfile, os
            >>> path = os.path.join(tempfile.mkdtemp(), "field.npy")
            >>> np.save(path, np.arange(12.0, dtype=np.float32).reshape(6, 2))
            >>> field = np.load(path, mmap_mode="r")                # nothing read yet
            >>> mesh = spmd.Mesh((2,), ("sp",))
            >>> s = spmd.Sharded.load(lambda sl: field[sl], mesh,
            ...                       Layout(field.shape, P("sp"), mesh))
            >>> s.shards[1].tolist()
            [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
        """
        if not isinstance(layout, Layout):
            raise TypeError(f"Sharded.load: layout must be a spmd.Layout (the global shape "
                            f"is needed before reading), got {describe(layout)}")
        _same_mesh(layout, mesh, "Sharded.load")
        dev = torch.device(device) if device is not None else mesh.device
        shards = {}
        for r in held_ranks(mesh):
            block = loader(layout.slices(r))
            t = block if isinstance(block, torch.Tensor) else torch.as_tensor(_writable(block))
            if tuple(t.shape) != layout.local_shape(r):
                raise SpecError(
                    f"Sharded.load: the loader returned {describe(t)} for rank {r}'s block "
                    f"{_slices_str(layout.slices(r))}, whose shape is "
                    f"{shape_str(layout.local_shape(r))}")
            shards[r] = t.to(dev)
        return cls(shards, layout, mesh)

    # -- what it is ---------------------------------------------------------------------------

    @property
    def shards(self) -> Mapping[int, torch.Tensor]:
        """``{rank: local tensor}`` for the ranks this process holds."""
        return self._shards

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks whose shards this process holds."""
        return tuple(self._shards)

    @property
    def local(self) -> torch.Tensor:
        """The calling rank's shard (per-rank code), or the only shard held."""
        if in_rank_of(self.mesh):
            rank = self.mesh.rank
            t = self._shards.get(rank)
            if t is None:
                raise SpecError(f"Sharded.local: rank {rank} holds no shard of {self!r}")
            return t
        if len(self._shards) == 1:
            return next(iter(self._shards.values()))
        raise SpecError(f"Sharded.local: {self!r} holds the shards of ranks "
                        f"{list(self._shards)} (a threads mesh seen from outside its ranks); "
                        f"use .shards[rank]")

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return torch.Size(self.layout.shape)

    @property
    def spec(self):
        """The partition spec (``self.layout.spec``)."""
        return self.layout.spec

    @property
    def ndim(self) -> int:
        """The number of dims of the global tensor."""
        return self.layout.ndim

    @property
    def dtype(self) -> torch.dtype:
        """The shards' dtype."""
        return self._first.dtype

    @property
    def device(self) -> torch.device:
        """The device of the first shard held."""
        return self._first.device

    @property
    def requires_grad(self) -> bool:
        """Whether any held shard requires grad."""
        return any(t.requires_grad for t in self._shards.values())

    @property
    def grad(self) -> Sharded | None:
        """The shards' ``.grad`` as a Sharded (None until every held shard has one)."""
        grads = {r: t.grad for r, t in self._shards.items()}
        if any(g is None for g in grads.values()):
            return None
        return Sharded(grads, self.layout, self.mesh)

    def size(self, dim: int | None = None):
        """The global shape, or its size along ``dim``, as ``Tensor.size()``."""
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        """The number of elements of the global tensor."""
        return self.shape.numel()

    def detach(self) -> Sharded:
        """The same shards, detached from their graphs."""
        return Sharded({r: t.detach() for r, t in self._shards.items()}, self.layout, self.mesh)

    def requires_grad_(self, flag: bool = True) -> Sharded:
        """Set ``requires_grad`` on every held shard (in place); returns self."""
        for t in self._shards.values():
            t.requires_grad_(flag)
        return self

    def __reduce__(self):
        """copy.deepcopy and pickle: the shards, layout and mesh (a threads mesh is not
        copied; a torch mesh's process groups cannot leave their process)."""
        if self.mesh.backend == "torch":
            raise TypeError(f"{self!r} lives on {self.mesh!r}, whose process groups cannot "
                            f"be pickled: send its .local and .layout instead, or gather "
                            f"it first (spmd.gather(s, mesh, dst=...))")
        return (Sharded, (dict(self._shards), self.layout, self.mesh))

    @property
    def _first(self) -> torch.Tensor:
        return next(iter(self._shards.values()))

    def __repr__(self) -> str:
        split = ", ".join(f"{'/'.join(self.layout.dim_axes(d))}={list(s)}"
                          for d, s in enumerate(self.layout.sizes) if s is not None)
        held = (f"shard of rank {self.ranks[0]}" if len(self.ranks) == 1
                else f"shards on ranks {list(self.ranks)}")
        grad = ", requires_grad" if self.requires_grad else ""
        return (f"Sharded({shape_str(self.shape, self.dtype)}, {self.spec!r}"
                + (f", {split}" if split else "") + f", {held}{grad})")


# -- helpers shared with shard_map, gather and redistribute ----------------------------------------

def held_ranks(mesh: Mesh) -> tuple[int, ...]:
    """The ranks whose shards this process holds: its own in per-rank code, every rank on
    a threads mesh seen from outside its ranks."""
    if in_rank_of(mesh):
        return (mesh.rank,)
    return tuple(range(mesh.size))


def _own_rank(mesh: Mesh, what: str) -> int:
    check_mesh(mesh, what)
    if not in_rank_of(mesh):
        raise SpecError(f"{what} builds this rank's shard: call it in per-rank code (a torch "
                        f"process, a shard_map body, a function run by spmd.launch); on a "
                        f"threads mesh from outside its ranks use Sharded.from_global, "
                        f"Sharded.load or Sharded({{rank: shard}}, layout, mesh)")
    return mesh.rank


def _same_mesh(layout: Layout, mesh: Mesh, what: str) -> None:
    if not layout.is_for(mesh):
        raise SpecError(f"{what}: the layout {layout!r} is for a mesh "
                        f"{dict(zip(layout.axis_names, layout.mesh_shape))}, not {mesh!r}")


def _layout_of(spec: Any, shape, mesh: Mesh, what: str) -> Layout:
    check_mesh(mesh, what)
    if isinstance(spec, Layout):
        _same_mesh(spec, mesh, what)
        if spec.shape != tuple(shape):
            raise SpecError(f"{what}: the tensor is {shape_str(shape)} but the layout is for "
                            f"{shape_str(spec.shape)}")
        return spec
    return Layout(shape, spec, mesh)


def _exchanged_layout(local: torch.Tensor, mesh: Mesh, rank: int, spec) -> Layout:
    """The layout every rank's local shape implies: one int64 all_gather over the mesh
    (lengths may differ: a rank with another ndim gets the same error as the others)."""
    group = mesh.group(mesh.axis_names, rank)
    mine = torch.tensor(list(local.shape), dtype=torch.int64, device=local.device)
    rows = comm_of(mesh).all_gather(mine, group, 0, name="Sharded sizes")
    shapes = {r: tuple(int(v) for v in t.tolist()) for r, t in zip(group.ranks, rows)}
    nds = {len(s) for s in shapes.values()}
    if len(nds) > 1:
        raise SpecError(f"Sharded.from_local: the ranks' shards have different numbers of "
                        f"dims: { {r: len(s) for r, s in shapes.items()} }")
    lay = Layout.from_local_shapes(shapes, spec, mesh)
    for r in sorted(shapes):
        lay.size_check(shapes[r], r, "the shard")
    return lay


def check_source(x: Sharded, mesh: Mesh, spec: Any, what: str) -> Layout:
    """``x``'s layout, for a transform called with it on ``mesh`` and, if given, ``spec``."""
    if x.mesh is not mesh:
        raise SpecError(f"{what}: {x!r} lives on {x.mesh!r}, another Mesh object than "
                        f"{mesh!r}")
    lay = x.layout
    if spec is not None and not same_cut(lay, spec, mesh):
        raise SpecError(f"{what}: spec {spec!r} does not describe {x!r}; omit it (a "
                        f"Sharded knows its layout)")
    return lay


def same_cut(lay: Layout, spec: Any, mesh: Mesh) -> bool:
    """Whether ``spec`` (a P, None for replicated, or a Layout) cuts as ``lay`` does; a
    Layout must also have its sizes."""
    if isinstance(spec, Layout):
        return spec == lay
    spec = as_spec(spec)
    if len(spec) > lay.ndim:
        return False
    probe = Layout((0,) * lay.ndim, spec, mesh)
    return all(probe.dim_axes(d) == lay.dim_axes(d) for d in range(lay.ndim))


def assemble(x: Sharded) -> torch.Tensor:
    """The global tensor from a Sharded holding every rank's shard (differentiable)."""
    lack = [r for r in range(x.mesh.size) if r not in x.shards]
    if lack:
        raise SpecError(f"{x!r} lacks the shards of ranks {lack} to assemble the global tensor")
    return run_cat_plan(cat_plan(x.layout, x.layout.owners()), list(x.shards.values()))


def cat_plan(lay: Layout, owners: dict[tuple, int]) -> Any:
    """Nested (dim, [children]) concatenations, leaves the ranks owning each shard."""
    dims = lay.split_dims

    def build(prefix: tuple, k: int) -> Any:
        if k == len(dims):
            return owners[prefix]
        nxt = sorted({key[k] for key in owners if key[:k] == prefix})
        return (dims[k], [build(prefix + (c,), k + 1) for c in nxt])

    return build((), 0)


def run_cat_plan(plan: Any, vals: list[torch.Tensor]) -> torch.Tensor:
    """The tensor ``plan`` assembles from ``vals`` (indexed by rank): a new tensor."""
    if isinstance(plan, int):
        return vals[plan].clone()
    d, kids = plan
    if len(kids) == 1:
        return run_cat_plan(kids[0], vals)
    return torch.cat([vals[k] if isinstance(k, int) else run_cat_plan(k, vals)
                      for k in kids], d)


def _writable(block: Any) -> Any:
    """numpy memmaps opened read-only make torch warn on every shard; a copy of just
    this block is what the rank keeps anyway."""
    flags = getattr(block, "flags", None)
    if flags is not None and type(block).__module__.startswith("numpy") and not flags.writeable:
        return block.copy()
    return block


def _slices_str(sl: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in sl) + "]"
