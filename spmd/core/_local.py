"""Rank-local storage: ``threading.local``, but one per rank of the simulated mesh too.

The simulated mesh runs its ranks as greenlets in one OS thread (``comm/rank_greenlets``),
so per-thread state would be shared by every rank there. ``RankLocal`` keeps its
attributes in a ``contextvars`` variable instead: every OS thread and every greenlet has
a context of its own (a new one starts empty, as a new thread does), so each rank sees
only what it set.
"""
from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["RankLocal"]


class RankLocal:
    """Attributes private to the running thread or rank greenlet.

    Example:
        >>> loc = RankLocal()
        >>> loc.depth = 1
        >>> getattr(loc, "depth", 0), getattr(loc, "other", None)
        (1, None)
    """

    __slots__ = ("_var",)

    def __init__(self) -> None:
        object.__setattr__(self, "_var", contextvars.ContextVar(f"spmd_local_{id(self):x}"))

    def _values(self) -> dict[str, Any]:
        d = self._var.get(None)
        if d is None:
            d = {}
            self._var.set(d)
        return d

    def __getattr__(self, name: str) -> Any:
        d = self._var.get(None)
        if d is not None:
            try:
                return d[name]
            except KeyError:
                pass
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._values()[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self._values()[name]
        except KeyError:
            raise AttributeError(name) from None
