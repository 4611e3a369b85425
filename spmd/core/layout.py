"""``Layout``: how a global tensor is cut into shards over a mesh. Pure arithmetic."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._format import shape_str
from .errors import SpecError
from .mesh import coords_of
from .spec import P, as_spec, entry_axes

__all__ = ["Layout", "balanced_sizes"]


def balanced_sizes(n: int, parts: int) -> tuple[int, ...]:
    """The ``numpy.array_split`` rule: the first ``n % parts`` shards get one more.

    >>> balanced_sizes(10, 4)
    (3, 3, 2, 2)
    """
    q, r = divmod(n, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


class Layout:
    """Global shape + spec + the size of every shard along every split dim.

    Args:
        shape: the global shape.
        spec: a ``P`` (or None for fully replicated).
        mesh: a ``Mesh`` (only its axis names and sizes are used).
        sizes: explicit shard sizes, as ``{dim: [s0, s1, ...]}`` or a sequence with one
            entry per dim (None for dims left balanced). Zero sizes are allowed.
            Default: balanced (``10`` over 4 shards -> ``[3, 3, 2, 2]``).

    A dim split over a tuple of axes has one shard per point of their product, the
    first axis major. Mesh axes absent from the spec replicate the tensor.

    Example:
        >>> mesh = Mesh((2, 2), ("dp", "sp"))
        >>> lay = Layout((10, 6), P("sp"), mesh)
        >>> lay.sizes[0], lay.local_shape(rank=1), lay.offsets(rank=1)
        ((5, 5), (5, 6), (5, 0))

    Raises:
        SpecError: the spec names unknown axes or has more entries than dims, or the
            sizes do not add up to the dim or have the wrong count.
    """

    __slots__ = ("shape", "spec", "axis_names", "mesh_shape", "sizes", "_starts", "_table",
                 "_hash")

    def __init__(self, shape: Sequence[int], spec: Any, mesh: Any,
                 sizes: Mapping[int, Sequence[int]] | Sequence[Sequence[int] | None] | None = None):
        self.shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in self.shape):
            raise SpecError(f"a global shape must be non-negative, got {list(self.shape)}")
        self.spec = as_spec(spec)
        self.axis_names = tuple(mesh.axis_names)
        self.mesh_shape = tuple(mesh.shape)
        nd = len(self.shape)
        if len(self.spec) > nd:
            raise SpecError(
                f"spec {self.spec!r} has {len(self.spec)} entries but the tensor "
                f"{shape_str(self.shape)} has {nd} dims; a spec may leave out trailing "
                f"dims but not add dims")
        for a in self.spec.axes:
            if a not in self.axis_names:
                raise SpecError(
                    f"spec {self.spec!r} names axis {a!r}, which the mesh "
                    f"({_mesh_str(self)}) does not have")
        given = _sizes_by_dim(sizes, nd)
        out: list[tuple[int, ...] | None] = []
        for d in range(nd):
            axes = entry_axes(self.spec.entry(d))
            s = given.get(d)
            if not axes:
                if s is not None and tuple(s) != (self.shape[d],):
                    raise SpecError(
                        f"sizes were given for dim {d}, which {self.spec!r} does not split")
                out.append(None)
                continue
            n = self.axis_size(axes)
            if s is None:
                out.append(balanced_sizes(self.shape[d], n))
                continue
            if isinstance(s, (str, bytes)) or not isinstance(s, Sequence):
                raise SpecError(
                    f"sizes for dim {d} must be a sequence of ints, got {s!r}; for one dim "
                    f"pass sizes={{{d}: [...]}}")
            s = tuple(s)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in s):
                raise SpecError(f"sizes for dim {d} must be non-negative ints, got {list(s)}")
            if len(s) != n:
                raise SpecError(
                    f"sizes for dim {d} has {len(s)} entries but {_axes_str(axes)} has "
                    f"{n} shards; give one size per shard")
            if sum(s) != self.shape[d]:
                raise SpecError(
                    f"dim {d} has size {self.shape[d]} but the sizes {list(s)} over "
                    f"{_axes_str(axes)} add up to {sum(s)}")
            out.append(s)
        self.sizes: tuple[tuple[int, ...] | None, ...] = tuple(out)
        self._starts = tuple(None if s is None else _cumsum(s) for s in self.sizes)
        self._table: list | None = None

    @classmethod
    def from_local_shapes(cls, shapes: Mapping[int, Sequence[int]], spec: Any, mesh: Any,
                          sizes: Mapping[int, Sequence[int]] | None = None) -> Layout:
        """The layout in which rank r holds a shard of shape ``shapes[r]``.

        Each shard's size is read from the lowest listed rank holding it, unsplit dims
        from the lowest listed rank; explicit ``sizes`` win. Other ranks are not checked:
        callers compare them with ``local_shape``/``size_check`` and say what is wrong
        in their own terms.

        Raises:
            SpecError: the spec does not fit, or no listed rank holds some shard.
        """
        r0 = min(shapes)
        nd = len(shapes[r0])
        probe = cls((0,) * nd, spec, mesh)
        given = _sizes_by_dim(sizes, nd)
        shape, inferred = list(shapes[r0]), {}
        for d in probe.split_dims:
            if isinstance(given.get(d), Sequence) and not isinstance(given[d], str):
                shape[d] = sum(int(v) for v in given[d])
                continue
            per: list[int | None] = [None] * len(probe.sizes[d])
            for r in sorted(shapes):
                i = probe.shard_index(r, d)
                if per[i] is None:
                    per[i] = int(shapes[r][d])
            if None in per:
                raise SpecError(f"no rank's shape was given for shard {per.index(None)} of dim "
                                f"{d} over {_axes_str(probe.dim_axes(d))}")
            inferred[d] = per
            shape[d] = sum(per)
        return cls(shape, spec, mesh, {**inferred, **given} or None)

    # -- queries -----------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        """The number of dims of the global tensor."""
        return len(self.shape)

    def axis_size(self, axes: Sequence[str]) -> int:
        """Ranks along ``axes`` of the layout's mesh (the product for several)."""
        return math.prod(self.mesh_shape[self.axis_names.index(a)] for a in axes)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split ``dim`` (empty if it is not split)."""
        return entry_axes(self.spec.entry(dim))

    @property
    def split_dims(self) -> tuple[int, ...]:
        """The dims the spec splits, in order."""
        return tuple(d for d, s in enumerate(self.sizes) if s is not None)

    def owners(self) -> dict[tuple[int, ...], int]:
        """``{shard key: the lowest rank holding that shard}``, one entry per shard."""
        out: dict[tuple[int, ...], int] = {}
        for r in range(math.prod(self.mesh_shape)):
            out.setdefault(self.shard_key(r), r)
        return out

    def shard_key(self, rank: int) -> tuple[int, ...]:
        """Which shard ``rank`` holds along each split dim (equal for replicas)."""
        return self._row(rank)[3]

    def is_for(self, mesh: Any) -> bool:
        """Whether this layout cuts over ``mesh``'s axes (same names and sizes)."""
        return self.axis_names == tuple(mesh.axis_names) and \
            self.mesh_shape == tuple(mesh.shape)

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Mesh axes the tensor is replicated over (absent from the spec)."""
        used = set(self.spec.axes)
        return tuple(a for a in self.axis_names if a not in used)

    @property
    def is_even(self) -> bool:
        """Whether every split dim's shards all have the same size."""
        return all(s is None or len(set(s)) == 1 for s in self.sizes)

    def shard_index(self, rank: int, dim: int) -> int:
        """Which shard of ``dim`` ``rank`` holds (0 for unsplit dims)."""
        if not 0 <= rank < math.prod(self.mesh_shape):
            raise SpecError(f"rank {rank} is outside the layout's mesh (ranks "
                            f"0..{math.prod(self.mesh_shape) - 1})")
        c = coords_of(self.mesh_shape, rank)
        idx = 0
        for a in self.dim_axes(dim):
            p = self.axis_names.index(a)
            idx = idx * self.mesh_shape[p] + c[p]
        return idx

    def _row(self, rank: int) -> tuple:
        """(offsets, local shape, slices, shard key) of ``rank``, computed once."""
        if self._table is None:
            n = math.prod(self.mesh_shape)
            self._table = [None] * n
        if not 0 <= rank < len(self._table):
            self.shard_index(rank, 0)  # raises the out-of-range error
        row = self._table[rank]
        if row is None:
            idx = [self.shard_index(rank, d) for d in range(self.ndim)]
            off = tuple(0 if st is None else st[i] for st, i in zip(self._starts, idx))
            shp = tuple(n if s is None else s[i] for n, s, i in zip(self.shape, self.sizes, idx))
            key = tuple(idx[d] for d in self.split_dims)
            row = self._table[rank] = (off, shp, tuple(slice(o, o + k) for o, k in zip(off, shp)),
                                       key)
        return row

    def offsets(self, rank: int) -> tuple[int, ...]:
        """Global index of the first element of ``rank``'s shard along every dim."""
        return self._row(rank)[0]

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s shard (zeros along a dim where it holds nothing)."""
        return self._row(rank)[1]

    def slices(self, rank: int) -> tuple[slice, ...]:
        """``rank``'s shard as slices of the global tensor."""
        return self._row(rank)[2]

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Cut ``rank``'s shard out of the global tensor ``x`` (a view, no copy)."""
        if tuple(x.shape) != self.shape:
            raise SpecError(
                f"the tensor is {shape_str(x.shape)} but the layout is for "
                f"{shape_str(self.shape)}")
        off, shp = self._row(rank)[:2]
        out = x
        for d in self.split_dims:
            out = out.narrow(d, off[d], shp[d])
        return out

    def size_check(self, x_shape: Sequence[int], rank: int, what: str = "x") -> None:
        """Raise a clear SpecError if ``x_shape`` is not ``rank``'s local shape."""
        want = self.local_shape(rank)
        if tuple(x_shape) == want:
            return
        if len(x_shape) != len(want):
            raise SpecError(f"{what} is {shape_str(x_shape)} on rank {rank} but the layout "
                            f"expects {len(want)} dims ({shape_str(want)})")
        for d, (g, w) in enumerate(zip(x_shape, want)):
            if g != w:
                axes = self.dim_axes(d)
                over = (f" over {_axes_str(axes)} (sizes {list(self.sizes[d])})"
                        if axes else "")
                raise SpecError(
                    f"dim {d} of {what} has size {g} on rank {rank} but the layout expects "
                    f"{w}{over}; pass sizes=... or reshard first")

    # -- value semantics ----------------------------------------------------------------

    def _key(self) -> tuple:
        # How the tensor is cut, not how the spec is spelled: P('sp') == P(('sp',), None).
        return (self.shape, tuple(self.dim_axes(d) for d in range(self.ndim)),
                self.axis_names, self.mesh_shape, self.sizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # computed once: a layout does not change
            self._hash = hash(self._key())
            return self._hash

    def __reduce__(self):
        return (_rebuild, (self.shape, tuple(self.spec), self.axis_names, self.mesh_shape, self.sizes))

    def __repr__(self) -> str:
        split = ", ".join(
            f"{_axes_str(self.dim_axes(d), quote=False)}={list(s)}"
            for d, s in enumerate(self.sizes) if s is not None)
        return f"Layout({shape_str(self.shape)}, {self.spec!r}" + (f", {split})" if split else ")")


class _MeshShape:
    def __init__(self, axis_names, shape):
        self.axis_names, self.shape = axis_names, shape


def _rebuild(shape, spec, axis_names, mesh_shape, sizes) -> Layout:
    return Layout(shape, P(*spec), _MeshShape(axis_names, mesh_shape), sizes)


def _sizes_by_dim(sizes: Any, nd: int) -> dict[int, Sequence[int]]:
    if sizes is None:
        return {}
    if isinstance(sizes, Mapping):
        items = dict(sizes)
    elif isinstance(sizes, Sequence) and not isinstance(sizes, str):
        if len(sizes) != nd:
            raise SpecError(
                f"sizes has {len(sizes)} entries for a {nd}-d tensor; give one entry per "
                f"dim (None for balanced) or a dict {{dim: sizes}}")
        items = {d: s for d, s in enumerate(sizes) if s is not None}
    else:
        raise SpecError(f"sizes must be a dict {{dim: [sizes]}} or a sequence, got {sizes!r}")
    out = {}
    for d, s in items.items():
        if not isinstance(d, int) or not -nd <= d < nd:
            raise SpecError(f"sizes names dim {d!r}, but the tensor has {nd} dims")
        out[d % nd] = s
    return out


def _cumsum(s: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 0
    for v in s:
        out.append(acc)
        acc += v
    return tuple(out)


def _axes_str(axes: Sequence[str], quote: bool = True) -> str:
    if len(axes) == 1:
        return f"axis {axes[0]!r}" if quote else axes[0]
    return f"axes {tuple(axes)!r}" if quote else "(" + ", ".join(axes) + ")"


def _mesh_str(lay: Layout) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(lay.axis_names, lay.mesh_shape))
