"""Where a local tensor came from: the layout ``shard_map`` split it by.

``shard_map`` marks every local input with its argument's global ``Layout`` (with default
settings: a mark is one attribute), and the ops that take a ``spec=`` (``reduce``,
softmax and its kin, the normalisations, and the layout-taking ops of ``spmd.ops``:
convolution, pooling, interpolation, padding) compare the spec they are given with the
mark: a spec that disagrees with the real split (the wrong dim, a missing axis, a
replicated claim for a split tensor, other sizes) merges statistics or computes halos
over the wrong ranks, silently. Marks and specs are the same on every rank, so every rank
raises alike, before any message. A mark is a plain attribute, so any new tensor made
from the input (``x * 2``, a view) has none and is not checked; a mark whose shape no
longer matches (an in-place reshape) is ignored.

Example:
    >>> from spmd.core.provenance import mark, marked
    >>> lay = Layout((4, 6), P("sp"), Mesh((2,), ("sp",)))
    >>> t = mark(torch.zeros(2, 6), lay)
    >>> marked(t) == lay, marked(t * 2)
    (True, None)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import SpecError
from .layout import Layout
from .spec import P, entry_axes

__all__ = ["mark", "marked", "check_spec", "describe_layout", "MARK", "mark_value"]

MARK = "_spmd_origin"  # not nn._tags' "_spmd_layout": that one is per converted forward


def mark_value(layout: Layout, shape: tuple[int, ...]) -> tuple:
    """What ``mark`` sets on a shard of ``layout`` with ``shape``: shard_map makes it once
    per layout and rank and sets it itself (``setattr(t, MARK, value)``)."""
    return (layout, tuple(shape))


def mark(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Record that ``t`` is a shard of ``layout`` (returns ``t``)."""
    setattr(t, MARK, mark_value(layout, t.shape))
    return t


def marked(t: torch.Tensor) -> Layout | None:
    """The layout ``t`` was marked with, if it still has its marked shape."""
    got = getattr(t, MARK, None)
    if got is None or got[1] != tuple(t.shape):
        return None
    return got[0]


def describe_layout(lay: Layout) -> str:
    """``[8, 6] cut along dim 0 over ('sp',) (sizes [4, 4])``."""
    cut = [f"dim {d} over {lay.dim_axes(d)} (sizes {list(lay.sizes[d])})"
           for d in range(lay.ndim) if lay.sizes[d] is not None]
    return f"{list(lay.shape)} cut along " + (", ".join(cut) if cut else "no dim (replicated)")


def _describe_spec(spec: P, ndim: int) -> str:
    cut = [f"dim {d} over {entry_axes(spec.entry(d))}" for d in range(ndim)
           if entry_axes(spec.entry(d))]
    return "splits " + (", ".join(cut) if cut else "no dim (replicated)")


def check_spec(x: torch.Tensor, spec: P | Layout, mesh: Any, what: str, *,
               sizes: Mapping[int, Sequence[int]] | None = None, name: str = "x") -> None:
    """Raise where ``spec`` (and ``sizes``, the shard sizes of some split dims, if given)
    contradicts the layout shard_map split ``x`` by; nothing where ``x`` has no mark (or
    a mark for a mesh of another shape than ``mesh``; None: any).

    Raises:
        SpecError: naming ``what``, the spec, the real split and the spec to pass.
    """
    real = marked(x)
    if real is None or (mesh is not None and not real.is_for(mesh)):
        return
    fix = f"pass the split it has (spec={real.spec!r}, or its Layout, which holds the sizes)"
    if isinstance(spec, Layout):
        if not _same_cut(spec, real):
            raise SpecError(f"{what}: spec={spec.spec!r} describes {name} as a shard of "
                            f"{describe_layout(spec)}, but {name} is a shard_map argument split "
                            f"as {describe_layout(real)}; {fix}")
        return
    if any(_cut(real, entry_axes(spec.entry(d))) != _cut(real, real.dim_axes(d))
           for d in range(x.ndim)):
        raise SpecError(f"{what}: spec={spec!r} {_describe_spec(spec, x.ndim)}, but {name} is a "
                        f"shard_map argument split as {describe_layout(real)}; {fix}")
    for d, got in (sizes or {}).items():
        want = real.sizes[d]  # a wrong count is the caller's own (global) error
        if want is not None and len(got) == len(want) and tuple(got) != tuple(want):
            shown = {k: list(v) for k, v in sizes.items()}
            raise SpecError(f"{what}: sizes {shown} give dim {d} the shard sizes {list(got)}, "
                            f"but {name} is a shard_map argument split as "
                            f"{describe_layout(real)}; {fix}")


def _cut(lay: Layout, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes that really cut: an axis of one rank cuts nothing."""
    return tuple(a for a in axes if lay.axis_size((a,)) > 1)


def _same_cut(a: Layout, b: Layout) -> bool:
    """Whether two layouts of one mesh give every rank the same block (a spec naming an
    axis of one rank, or not, is the same layout)."""
    if a == b:
        return True
    if (a.shape, a.axis_names, a.mesh_shape) != (b.shape, b.axis_names, b.mesh_shape):
        return False
    for d in range(a.ndim):
        cut = _cut(a, a.dim_axes(d))
        if cut != _cut(b, b.dim_axes(d)) or (cut and a.sizes[d] != b.sizes[d]):
            return False
    return True
