"""Where a local tensor came from: the layout ``shard_map`` split it by.

Under validation (``SPMD_VALIDATE=1``) ``shard_map`` marks every local input with its
argument's global ``Layout``, and the layout-taking ops (``spmd.ops``: convolution,
pooling, interpolation, padding) compare the ``spec=`` they are given with the mark:
a spec that disagrees with the real split (the wrong dim, a missing axis, a replicated
claim for a split tensor) computes halos from the wrong neighbours, silently. A mark
is a plain attribute, so any new tensor made from the input (``x * 2``, a view) has
none and is not checked; a mark whose shape no longer matches (an in-place reshape)
is ignored.

Example:
    >>> from spmd.core.provenance import mark, marked
    >>> lay = Layout((4, 6), P("sp"), Mesh((2,), ("sp",)))
    >>> t = mark(torch.zeros(2, 6), lay)
    >>> marked(t) == lay, marked(t * 2)
    (True, None)
"""
from __future__ import annotations

import torch

from .layout import Layout

__all__ = ["mark", "marked"]

_ATTR = "_spmd_origin"  # not nn._tags' "_spmd_layout": that one is per converted forward


def mark(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Record that ``t`` is a shard of ``layout`` (returns ``t``)."""
    setattr(t, _ATTR, (layout, tuple(t.shape)))
    return t


def marked(t: torch.Tensor) -> Layout | None:
    """The layout ``t`` was marked with, if it still has its marked shape."""
    got = getattr(t, _ATTR, None)
    if got is None or got[1] != tuple(t.shape):
        return None
    return got[0]
