"""Partition specs: ``P('dp', None, ('x', 'y'))``, as in JAX."""
from __future__ import annotations

from collections.abc import Iterable

from .errors import SpecError

__all__ = ["P"]

class P(tuple):
    """A partition spec: one entry per tensor dim.

    Each entry is ``None`` (the dim is not split), a mesh axis name (split over that
    axis), or a tuple of axis names (split over their product, the first axis major).
    Trailing dims may be left out; they are not split. Mesh axes that appear nowhere in
    the spec are axes the tensor is replicated over.

    Example:
        >>> P("dp", None, ("x", "y"))
        P('dp', None, ('x', 'y'))
        >>> P("sp").axes
        ('sp',)

    Raises:
        SpecError: an entry is neither None, a string, nor a tuple of strings, or an
            axis is used twice.
    """

    def __new__(cls, *entries: object) -> P:
        norm = []
        for i, e in enumerate(entries):
            if e is None or isinstance(e, str):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                t = tuple(e)
                norm.append(None if not t else t)
            else:
                raise SpecError(
                    f"P entry {i} is {e!r}; each entry must be None, a mesh axis name, "
                    f"or a tuple of axis names")
        self = super().__new__(cls, norm)
        seen: set[str] = set()
        for i, e in enumerate(self):
            for a in entry_axes(e):
                if a in seen:
                    raise SpecError(
                        f"{self!r} uses mesh axis {a!r} twice (again at dim {i}); a mesh "
                        f"axis can split at most one tensor dim")
                seen.add(a)
        return self

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec splits over, in order of appearance."""
        return tuple(a for e in self for a in entry_axes(e))

    def entry(self, dim: int) -> None | str | tuple[str, ...]:
        """The entry for ``dim``; ``None`` for left-out trailing dims."""
        return self[dim] if dim < len(self) else None

    # tuple's + and * would return plain tuples; a spec stays a spec.
    def __add__(self, other: Iterable) -> P:  # type: ignore[override]
        return P(*tuple(self), *tuple(other))

    def __reduce__(self):
        return (P, tuple(self))


def entry_axes(e: object) -> tuple[str, ...]:
    """The axes of one spec entry, as a tuple (empty for None)."""
    if e is None:
        return ()
    if isinstance(e, str):
        return (e,)
    return tuple(e)  # type: ignore[arg-type]


def as_spec(spec: object, what: str = "spec") -> P:
    """Accept a P, None (fully replicated), or a plain tuple/list of entries."""
    if isinstance(spec, P):
        return spec
    if spec is None:
        return P()
    if isinstance(spec, (tuple, list)):
        return P(*spec)
    raise SpecError(f"{what} must be a spmd.P (or None for replicated), got {spec!r}")
