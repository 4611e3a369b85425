"""Hypothesis strategies for sharded cases: meshes, shapes, specs, uneven layouts.

Uneven and empty shards are the normal case here, not an afterthought: a dim of 5 over 3
ranks, a rank holding nothing, a dim split over the product of two axes. Every strategy
returns plain spmd objects (``Mesh`` on the threads backend, ``P``, ``Layout``), so a
failing example prints as something you can paste into a test.

Strategies whose arguments depend on an earlier draw (a layout of a drawn shape on a
drawn mesh) compose with ``st.data()`` or ``flatmap``::

    @given(mesh=sst.meshes(), shape=sst.shapes(ndim=2), data=st.data())
    def test_x(mesh, shape, data):
        layout = data.draw(sst.layouts(shape, mesh))

or draw a whole case at once with ``sharded_arrays``.

Decorate such tests with ``settings`` (hypothesis's, with no deadline): the first
example starts rank threads (or processes) and warms torch up, which takes longer than
hypothesis's default 200 ms deadline, so the test would fail on its first example with
``DeadlineExceeded``::

    @sst.settings(max_examples=50)
    @given(...)
    def test_x(...): ...

This is the only module of spmd that imports hypothesis; ``spmd.testing.strategies`` is
loaded on first use.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import hypothesis
import torch
from hypothesis import strategies as st

from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P

__all__ = ["meshes", "split_sizes", "shapes", "specs", "layouts", "sharded_arrays",
           "ShardedArray", "settings"]

_DEFAULT_NAMES = {1: ("sp",), 2: ("x", "y"), 3: ("x", "y", "z")}


def settings(**kwargs) -> hypothesis.settings:
    """``hypothesis.settings`` for tests of sharded code: no deadline (the first example
    starts rank threads or processes, well past hypothesis's default 200 ms) and the
    ``too_slow`` health check off; ``kwargs`` as hypothesis's (``max_examples=...``).

    Example:
        >>> from spmd.testing import strategies as sst
        >>> sst.settings(max_examples=10).deadline is None
        True
    """
    kwargs.setdefault("deadline", None)
    checks = set(kwargs.pop("suppress_health_check", ())) | {hypothesis.HealthCheck.too_slow}
    return hypothesis.settings(suppress_health_check=sorted(checks, key=str), **kwargs)


def meshes(max_ranks: int = 4, ndims: int | Sequence[int] = (1, 2),
           axis_names: Sequence[str] | Mapping[int, Sequence[str]] | None = None,
           ) -> st.SearchStrategy[Mesh]:
    """Threads meshes of at most ``max_ranks`` ranks with 1-d and 2-d shapes.

    Every axis has 1 to ``max_ranks`` ranks and the product stays within ``max_ranks``,
    so sizes such as 3 (uneven splits of most dims) and 1 (an axis that splits nothing)
    appear, and 2-d meshes include ``(1, 3)`` and ``(2, 2)``.

    Args:
        max_ranks: the largest number of ranks.
        ndims: the number of mesh axes, an int or a choice of ints.
        axis_names: names of the axes: a sequence (a k-d mesh takes its first k) or a
            mapping ``{k: names}``. Default ``("sp",)``, ``("x", "y")``, ``("x", "y", "z")``.

    Example:
        >>> from spmd.testing import strategies as sst
        >>> from hypothesis import given
        >>> @given(sst.meshes(max_ranks=4))
        ... def test(mesh):
        ...     assert 1 <= mesh.size <= 4 and mesh.backend == "threads"
        >>> test()
    """
    if not isinstance(max_ranks, int) or max_ranks < 1:
        raise ValueError(f"meshes: max_ranks must be a positive int, got {max_ranks!r}")
    dims = (ndims,) if isinstance(ndims, int) else tuple(ndims)
    if not dims or not all(isinstance(k, int) and k >= 1 for k in dims):
        raise ValueError(f"meshes: ndims must be positive ints, got {ndims!r}")
    names = {k: _names_for(k, axis_names) for k in dims}

    @st.composite
    def draw_mesh(draw) -> Mesh:
        k = draw(st.sampled_from(dims))
        shape, left = [], max_ranks
        for _ in range(k):
            shape.append(draw(st.integers(1, left)))
            left //= shape[-1]
        return Mesh(tuple(shape), names[k], backend="threads")

    return draw_mesh()


def _names_for(k: int, axis_names) -> tuple[str, ...]:
    if axis_names is None:
        if k not in _DEFAULT_NAMES:
            raise ValueError(f"meshes: no default axis names for a {k}-d mesh; pass "
                             f"axis_names=...")
        return _DEFAULT_NAMES[k]
    if isinstance(axis_names, Mapping):
        if k not in axis_names:
            raise ValueError(f"meshes: axis_names has no entry for a {k}-d mesh")
        got = tuple(axis_names[k])
    else:
        got = tuple(axis_names)[:k]
    if len(got) != k:
        raise ValueError(f"meshes: a {k}-d mesh needs {k} axis names, got {got!r}")
    return got


def split_sizes(n: int, parts: int, *, allow_empty: bool = True) -> st.SearchStrategy[list[int]]:
    """``parts`` non-negative sizes adding up to ``n``: uneven, zeros allowed.

    With ``allow_empty=False`` every size is at least 1 (so ``n >= parts`` is required);
    the sizes are still drawn unevenly, ``1 + `` a split of the remaining ``n - parts``.
    Shrinks towards one shard holding everything.

    Example:
        >>> from spmd.testing import strategies as sst
        >>> from hypothesis import given
        >>> @given(sst.split_sizes(5, 3, allow_empty=False))
        ... def test(sizes):
        ...     assert sum(sizes) == 5 and len(sizes) == 3 and min(sizes) >= 1
        >>> test()
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"split_sizes: n must be a non-negative int, got {n!r}")
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"split_sizes: parts must be a positive int, got {parts!r}")
    if not allow_empty:
        if n < parts:
            raise ValueError(f"split_sizes: {n} elements cannot fill {parts} shards of at "
                             f"least 1; pass allow_empty=True or a larger n")
        return split_sizes(n - parts, parts).map(lambda s: [v + 1 for v in s])
    if parts == 1:
        return st.just([n])
    cuts = st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)
    return cuts.map(lambda c: _sizes_from_cuts(sorted(c), n))


def _sizes_from_cuts(cuts: list[int], n: int) -> list[int]:
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


def shapes(ndim: int | range | Sequence[int] | None = None, min_side: int = 0,
           max_side: int = 12) -> st.SearchStrategy[tuple[int, ...]]:
    """Global shapes with ``ndim`` dims (an int, a range or a choice; default 1 to 3)
    of ``min_side`` to ``max_side`` elements each; zero-sized dims appear by default.

    Example:
        >>> from spmd.testing import strategies as sst
        >>> from hypothesis import given
        >>> @given(sst.shapes(ndim=range(1, 4), max_side=5))
        ... def test(shape):
        ...     assert 1 <= len(shape) <= 3 and all(0 <= s <= 5 for s in shape)
        >>> test()
    """
    if ndim is None:
        ndim = range(1, 4)
    choices = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if not choices or not all(isinstance(k, int) and k >= 0 for k in choices):
        raise ValueError(f"shapes: ndim must be non-negative ints, got {ndim!r}")
    if not 0 <= min_side <= max_side:
        raise ValueError(f"shapes: need 0 <= min_side <= max_side, got {min_side}, {max_side}")
    side = st.integers(min_side, max_side)
    return st.sampled_from(choices).flatmap(
        lambda k: st.tuples(*[side] * k) if k else st.just(()))


def specs(mesh: Mesh, ndim: int, *, min_split: int = 0) -> st.SearchStrategy[P]:
    """Specs of an ``ndim``-d tensor over ``mesh``: each mesh axis used at most once.

    Each axis splits a dim or none (replicated); a dim split by several axes gets a
    tuple entry in drawn order, a dim split by one axis ``"x"`` or ``("x",)``. Trailing
    ``None`` entries are sometimes left out, as specs allow.

    Args:
        mesh: the mesh whose axes the spec may name.
        ndim: the number of tensor dims.
        min_split: at least this many dims are split.

    Example:
        >>> from spmd.testing import strategies as sst
        >>> from hypothesis import given
        >>> mesh = Mesh((2, 2), ("x", "y"))
        >>> @given(sst.specs(mesh, 3, min_split=1))
        ... def test(spec):
        ...     assert len(spec) <= 3 and len(set(spec.axes)) == len(spec.axes) >= 1
        >>> test()
    """
    if not 0 <= min_split <= min(ndim, len(mesh.axis_names)):
        raise ValueError(f"specs: min_split={min_split} needs 0 <= min_split <= "
                         f"min(ndim, mesh axes) = {min(ndim, len(mesh.axis_names))}")
    return st.composite(lambda draw: _draw_spec(draw, mesh, ndim, min_split))()


def _draw_spec(draw, mesh: Mesh, ndim: int, min_split: int = 0,
               shape: Sequence[int] | None = None) -> P:
    """A spec as in ``specs``; with ``shape``, only splits that leave every shard at
    least one element (for ``allow_empty=False``)."""
    order = draw(st.permutations(mesh.axis_names))
    per_dim: list[list[str]] = [[] for _ in range(ndim)]

    def fits(d: int, a: str) -> bool:
        parts = math.prod(mesh.axis_size(b) for b in per_dim[d]) * mesh.axis_size(a)
        return shape is None or shape[d] >= parts

    forced = draw(st.lists(st.integers(0, ndim - 1), unique=True, min_size=min_split,
                           max_size=min_split)) if min_split else []
    for i, a in enumerate(order):
        if i < len(forced):
            d = forced[i]
        else:
            ok = [d for d in range(ndim) if fits(d, a)]
            d = draw(st.sampled_from([-1] + ok))
        if d >= 0:
            per_dim[d].append(a)
    entries: list = []
    for axes in per_dim:
        if not axes:
            entries.append(None)
        elif len(axes) == 1 and draw(st.booleans()):
            entries.append(axes[0])
        else:
            entries.append(tuple(axes))
    last = max([i + 1 for i, e in enumerate(entries) if e is not None], default=0)
    return P(*entries[:draw(st.integers(last, ndim))])


def layouts(shape: Sequence[int], mesh: Mesh, spec: P | None = None, *, uneven: bool = True,
            allow_empty: bool = True) -> st.SearchStrategy[Layout]:
    """Layouts of a global ``shape`` over ``mesh``, with explicit sizes on every split dim.

    Args:
        shape: the global shape (a plain value; see the module docstring for drawn ones).
        mesh: the mesh.
        spec: the spec; default drawn by ``specs`` (only splits that fit, with
            ``allow_empty=False``).
        uneven: draw the shard sizes with ``split_sizes``; False gives the balanced ones.
        allow_empty: whether a shard may hold no element of a split dim.

    Raises:
        ValueError: with ``allow_empty=False``, a given spec splits a dim into more
            shards than it has elements.

    Example:
        >>> from spmd.testing import strategies as sst
        >>> from hypothesis import given
        >>> mesh = Mesh((3,), ("sp",))
        >>> @given(sst.layouts((5, 4), mesh, P("sp")))
        ... def test(layout):
        ...     assert sum(layout.sizes[0]) == 5 and len(layout.sizes[0]) == 3
        >>> test()
    """
    shape = tuple(int(s) for s in shape)
    if spec is not None:
        probe = Layout(shape, spec, mesh)
        if not allow_empty:
            for d in probe.split_dims:
                if shape[d] < len(probe.sizes[d]):
                    raise ValueError(
                        f"layouts: {spec!r} splits dim {d} of size {shape[d]} into "
                        f"{len(probe.sizes[d])} shards, so some must be empty; pass "
                        f"allow_empty=True or a larger shape")

    @st.composite
    def draw_layout(draw) -> Layout:
        s = spec if spec is not None else _draw_spec(
            draw, mesh, len(shape), shape=None if allow_empty else shape)
        lay = Layout(shape, s, mesh)
        if not uneven:
            return lay
        return Layout(shape, s, mesh, {
            d: draw(split_sizes(shape[d], len(lay.sizes[d]), allow_empty=allow_empty))
            for d in lay.split_dims} or None)

    return draw_layout()


class ShardedArray(NamedTuple):
    """A drawn case: a mesh, a layout on it and a global float tensor of its shape."""

    mesh: Mesh
    layout: Layout
    x: torch.Tensor

    @property
    def spec(self) -> P:
        """The layout's partition spec."""
        return self.layout.spec

    def shard(self, rank: int) -> torch.Tensor:
        """``rank``'s shard of ``x``."""
        return self.layout.shard(self.x, rank)


def sharded_arrays(ndim: int | range | Sequence[int] | None = None, *,
                   mesh: Mesh | None = None, max_ranks: int = 4, min_side: int = 0,
                   max_side: int = 8, dtype: torch.dtype = torch.float64,
                   uneven: bool = True, allow_empty: bool = True,
                   ) -> st.SearchStrategy[ShardedArray]:
    """A mesh, a layout and a global random tensor drawn together: one sharded case.

    The mesh comes from ``meshes(max_ranks)`` (or is ``mesh``), the shape from
    ``shapes(ndim, min_side, max_side)``, the layout from ``layouts``; the tensor is
    standard normal from a drawn seed (no global RNG is touched).

    Example:
        >>> from spmd.testing import strategies as sst
        >>> from hypothesis import given
        >>> @given(case=sst.sharded_arrays(ndim=2))
        ... def test(case):
        ...     parts = [case.shard(r) for r in range(case.mesh.size)]
        ...     assert all(p.shape == case.layout.local_shape(r) for r, p in enumerate(parts))
        >>> test()
    """
    mesh_st = st.just(mesh) if mesh is not None else meshes(max_ranks)
    shape_st = shapes(ndim, min_side, max_side)

    @st.composite
    def draw_case(draw) -> ShardedArray:
        m, shape = draw(mesh_st), draw(shape_st)
        lay = draw(layouts(shape, m, uneven=uneven, allow_empty=allow_empty))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        return ShardedArray(m, lay, torch.randn(shape, generator=g, dtype=dtype))

    return draw_case()
