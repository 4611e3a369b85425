"""What the windowed ops share: the input's layout, the output partition, and fetching
each rank's input window.

Every windowed op (convolution, pooling, interpolation, padding) is exact for the same
reason: the output is partitioned first (``out_sizes``), and each rank then asks for
exactly the global input range its outputs read (``fetch``). That range can be wider
than the shard (a halo, possibly from several ranks away), narrower (a trim), or
empty; positions outside the global input follow the op's padding mode.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

from ..comm import comm_of
from ..core._context import RankContext, on_mesh
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout, balanced_sizes
from ..core.mesh import Mesh
from ..core.provenance import marked
from ..core.spec import P, as_spec
from ..transforms.halo import check_mode, fetch_range

__all__ = ["input_layout", "out_sizes", "fetch", "member_ranges", "with_layout"]


def input_layout(x: torch.Tensor, mesh: Mesh, spec: Any, what: str) -> tuple[RankContext, Layout]:
    """This rank's context and ``x``'s global layout.

    ``spec`` is a ``Layout`` (checked against ``x``, no communication) or a ``P``: then
    the ranks of the spec's axes exchange their local shapes (one small int64
    all_gather), so uneven shards need no extra arguments.
    """
    rc = on_mesh(mesh, what, x)
    if isinstance(spec, Layout):
        if spec.axis_names != tuple(mesh.axis_names) or spec.mesh_shape != tuple(mesh.shape):
            raise SpecError(f"{what}: the layout is for a mesh "
                            f"{dict(zip(spec.axis_names, spec.mesh_shape))} but the call runs "
                            f"on {mesh!r}")
        spec.size_check(x.shape, rc.rank, "x")
        return rc, _agrees(x, spec, what)
    spec = as_spec(spec)
    Layout((0,) * x.ndim, spec, mesh)  # validates the spec before anything moves
    axes = spec.axes
    if not axes:
        return rc, _agrees(x, Layout(x.shape, spec, mesh), what)
    group = mesh.group(axes, rc.rank)
    mine = torch.tensor([list(x.shape)], dtype=torch.int64, device=x.device)
    got = comm_of(mesh).all_gather(mine, group, 0, name=f"{what} sizes", sizes=(1,) * group.size)
    shapes = tuple((r, tuple(int(v) for v in t[0].tolist())) for r, t in zip(group.ranks, got))
    return rc, _agrees(x, _from_shapes(shapes, spec, _MeshOf(mesh), what), what)


def _agrees(x: torch.Tensor, lay: Layout, what: str) -> Layout:
    """``lay``, checked against the layout shard_map split ``x`` by, where it marked it
    (under SPMD_VALIDATE=1; ``core/provenance.py``). Every rank holds the same mark and
    spec, so every rank raises alike."""
    real = marked(x)
    if real is not None and real != lay:
        raise SpecError(
            f"{what}: spec={lay.spec!r} describes x as a shard of {describe_layout(lay)}, but "
            f"x is a shard_map argument split as {describe_layout(real)}; pass "
            f"the split it has (spec={real.spec!r}, or its Layout, which holds the sizes)")
    return lay


def describe_layout(lay: Layout) -> str:
    cut = [f"dim {d} over {lay.dim_axes(d)} (sizes {list(lay.sizes[d])})"
           for d in range(lay.ndim) if lay.sizes[d] is not None]
    return f"{list(lay.shape)} cut along " + (", ".join(cut) if cut else "no dim (replicated)")


@lru_cache(maxsize=256)
def _from_shapes(shapes: tuple, spec: P, mesh: Any, what: str) -> Layout:
    """The layout the gathered local shapes imply (cached: a model calls its layers with
    the same shapes every step)."""
    lay = Layout.from_local_shapes(dict(shapes), spec, mesh)
    for r, shp in shapes:  # every rank sees the same shapes: the same error
        if shp != lay.local_shape(r):
            d = next(i for i, (a, b) in enumerate(zip(shp, lay.local_shape(r))) if a != b)
            raise SpecError(
                f"{what}: x is {list(shp)} on rank {r} but {list(lay.local_shape(r))} is "
                f"expected there (dim {d} is not split by {spec!r}, so every rank of "
                f"{spec.axes} must hold all of it)")
    return lay


def out_sizes(layout: Layout, dim: int, n_out: int, keep: bool) -> tuple[int, ...] | None:
    """How the output's ``dim`` (``n_out`` long) is split: as the input when ``keep``
    (a stride-1 op that preserves the length: pure halo exchange), else balanced."""
    sizes = layout.sizes[dim]
    if sizes is None:
        return None
    if keep and n_out == layout.shape[dim]:
        return sizes
    return balanced_sizes(n_out, len(sizes))


def member_ranges(o_sizes: Sequence[int],
                  window: Callable[[int, int], tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Each member's input range: ``window(o0, o1)`` for its output rows ``[o0, o1)``,
    an empty range where it has no output rows."""
    out, o0 = [], 0
    for k in o_sizes:
        if k == 0:
            out.append((0, 0))
        else:
            a, b = window(o0, o0 + k)
            out.append((a, max(a, b)))
        o0 += k
    return tuple(out)


def fetch(x: torch.Tensor, rc: RankContext, layout: Layout, dim: int,
          ranges: tuple[tuple[int, int], ...], mode: str = "constant",
          value: float = 0.0, *, name: str) -> torch.Tensor:
    """This rank's input window along ``dim``: ``ranges`` has one global range per
    member of the axes splitting ``dim`` (one entry for an unsplit dim)."""
    axes = layout.dim_axes(dim) or None
    sizes = layout.sizes[dim] or (layout.shape[dim],)
    return fetch_range(x, rc, axes, dim, sizes, ranges, mode=mode, value=value, name=name)


def my_range(layout: Layout, rank: int, dim: int,
             ranges: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    return ranges[layout.shard_index(rank, dim) if layout.sizes[dim] is not None else 0]


def mode_error(what: str, n: int, lo: int, hi: int, mode: str, dim: int,
               shape: Sequence[int]) -> None:
    """Raise torch's error type where ``F.pad`` would refuse ``mode`` on one device."""
    why = check_mode(n, lo, hi, mode)
    if why is not None:
        raise RuntimeError(f"{what}: padding ({lo}, {hi}) at dim {dim} of the global input "
                           f"{list(shape)}: {why}")


def out_layout(layout: Layout, shape: Sequence[int], sizes: dict[int, tuple[int, ...] | None]) -> Layout:
    """The output layout: same spec, new global shape; split dims as ``sizes`` says,
    the others split as the input."""
    given = {d: s for d, s in enumerate(layout.sizes) if s is not None}
    given.update({d: s for d, s in sizes.items() if s is not None})
    return Layout(shape, layout.spec, _MeshOf(layout), given or None)


class _MeshOf:
    """Axis names and shape of a mesh or layout: all a Layout needs, hashable."""

    def __init__(self, of: Any):
        self.axis_names = tuple(of.axis_names)
        self.shape = tuple(of.mesh_shape if isinstance(of, Layout) else of.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MeshOf) and (self.axis_names, self.shape) == (
            other.axis_names, other.shape)

    def __hash__(self) -> int:
        return hash((self.axis_names, self.shape))


def refuse_split(layout: Layout | Any, dims: Sequence[int], what: str, why: str) -> None:
    """A SpecError, before any communication, if ``layout`` (a Layout or a spec) splits
    one of ``dims``."""
    spec = layout.spec if isinstance(layout, Layout) else as_spec(layout)
    for d in dims:
        if spec.entry(d) is not None:
            raise SpecError(f"{what}: the spec {spec!r} splits dim {d} ({why}); keep it whole "
                            f"(None in the spec) and split a spatial or batch dim instead")


def link(out: torch.Tensor, *tensors: torch.Tensor | None) -> torch.Tensor:
    """``out`` made to depend (with zero gradient) on ``tensors``.

    A rank whose output window is empty still ran the input fetch, whose backward is a
    collective the other ranks wait for; its output must reach that node (and the
    weights, so every rank's gradients have the same structure)."""
    for t in tensors:
        if t is not None and t.requires_grad:
            out = out + t.sum() * 0
    return out


def check_ndim(x: torch.Tensor, n: int, what: str) -> None:
    if x.ndim != n + 2:
        raise SpecError(f"{what}: expected a batched input (N, C, {n} spatial dims), got "
                        f"{describe(x)}; add the batch dim with x[None] (and None in the spec)")


def with_layout(fn: Callable) -> Callable[[Callable], Callable]:
    """Decorator: attach ``fn`` as the ``output_layout`` of the op it decorates, so users
    can ask for the output layout before running the op."""
    def attach(op: Callable) -> Callable:
        op.output_layout = fn
        return op
    return attach


def ntuple(v: Any, n: int, name: str, what: str) -> tuple[int, ...]:
    """``v`` as ``n`` ints (one int repeats), as torch accepts it."""
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    if isinstance(v, (tuple, list)) and len(v) == 1 and n > 1:
        v = tuple(v) * n
    if (isinstance(v, (tuple, list)) and len(v) == n
            and all(isinstance(e, int) and not isinstance(e, bool) for e in v)):
        return tuple(v)
    raise SpecError(f"{what}: {name} must be an int or {n} ints, got {v!r}")
