"""The shard_map bodies a rank runs, innermost last: one record per body, read by
nesting checks (``_nesting``), collectives' anchors (``collectives._anchor``) and
static layouts (``_context.current_trace``)."""
from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["Body", "NO_TRACE", "bodies"]

# Each rank thread (or greenlet) runs its own bodies: a context variable, as
# ``RankLocal`` keeps its attributes (``_local.py``), read in one call.
_var: contextvars.ContextVar[list] = contextvars.ContextVar("spmd_bodies")


class Body:
    """One shard_map body a rank (thread or greenlet) runs: the ``mesh`` and the
    ``axes`` it is mapped over (nesting), the ``anchors`` its collectives make (None:
    kept by an enclosing body; see ``collectives._anchor``), and for static layouts the
    sizes the previous call's exchanges learnt (``cached``; ``NO_TRACE``: not traced)
    with this call's ``trace``, made at its first exchange (``core._context``). One
    object per body, pushed once: a rank's bookkeeping per call is one append."""

    __slots__ = ("mesh", "axes", "anchors", "cached", "trace")

    def __init__(self, mesh: Any, axes: tuple[str, ...], anchors: list | None,
                 cached: Any):
        self.mesh, self.axes, self.anchors, self.cached = mesh, axes, anchors, cached
        self.trace: Any = None


NO_TRACE = object()  # a Body whose size exchanges are not traced (static_layouts=False)


def bodies() -> list[Body]:
    """The shard_map bodies this thread (or rank greenlet) runs, innermost last:
    shard_map pushes and pops its own."""
    st = _var.get(None)
    if st is None:
        st = []
        _var.set(st)
    return st
