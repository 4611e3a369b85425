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
        >>> loc.get("depth", 0), loc.get("other"), getattr(loc, "other", None)
        (1, None, None)
    """

    __slots__ = ("_var",)

    def __init__(self) -> None:
        object.__setattr__(self, "_var", contextvars.ContextVar(f"spmd_local_{id(self):x}"))

    def values(self) -> dict[str, Any]:
        """The running thread's or greenlet's attributes, as a dict to read and set."""
        d = self._var.get(None)
        if d is None:
            d = {}
            self._var.set(d)
        return d

    def get(self, name: str, default: Any = None) -> Any:
        """``getattr(self, name, default)``, without the cost of a failed lookup."""
        d = self._var.get(None)
        return default if d is None else d.get(name, default)

    def __getattr__(self, name: str) -> Any:
        d = self._var.get(None)
        if d is not None:
            try:
                return d[name]
            except KeyError:
                pass
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.values()[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self.values()[name]
        except KeyError:
            raise AttributeError(name) from None
