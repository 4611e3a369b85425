"""What the layout interpreter knows of each tensor of a converted forward: which of its
dims are split over which mesh axes (its *entries*), and which sizes are this rank's.

A tensor produced inside a converted forward carries a ``Tag`` (an attribute); one that
carries none (a parameter, a constant made in forward) is whole: the same on every rank.
Reading the size of a split dim gives a ``LocalSize``: an int that remembers it is this
rank's share, so that using it where a global size is meant (``torch.linspace(0, 1,
h)``, ``F.interpolate(x, size=(2 * h, w))``) is refused instead of silently wrong.
"""
from __future__ import annotations

import inspect
import math
import operator
import os
from typing import Any, NamedTuple

import torch

from ..core.mesh import Mesh
from ..core.spec import P

_HERE = os.path.abspath(__file__)
_SPMD = os.path.dirname(os.path.dirname(_HERE))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))

#: One entry per dim: None (not split) or the tuple of mesh axes it is split over.
Entries = tuple


class Tag(NamedTuple):
    mesh: Mesh
    entries: Entries
    poisoned: bool = False  # the output of a refused call (plan mode): nothing to report
    #: The shard sizes of every split dim (one tuple per split dim, None at whole dims),
    #: or None where they are not known: the global ``Layout`` of the tensor together with
    #: its entries (``flow.py``). Worked out from rank-independent facts only.
    sizes: tuple | None = None


_ATTR = "_spmd_layout"


def tag_of(t: torch.Tensor) -> Tag | None:
    return getattr(t, _ATTR, None)


def entries_of(t: torch.Tensor, mesh: Mesh) -> Entries:
    """``t``'s entries on ``mesh``: its tag's, or all None (whole) without one."""
    tag = getattr(t, _ATTR, None)
    if tag is not None and tag.mesh is mesh and len(tag.entries) == t.ndim:
        return tag.entries
    return (None,) * t.ndim


def set_tag(t: Any, mesh: Mesh, entries: Entries, poisoned: bool = False,
            sizes: tuple | None = None) -> None:
    if isinstance(t, torch.Tensor):
        if len(entries) != t.ndim:  # a rule's mistake must not pass silently
            raise AssertionError(f"entries {entries} for a tensor of {t.ndim} dims")
        setattr(t, _ATTR, Tag(mesh, tuple(entries), poisoned, sizes))


def entries_from_spec(spec: P, ndim: int) -> Entries:
    out = []
    for e in tuple(spec) + (None,) * (ndim - len(spec)):
        out.append(None if e is None else ((e,) if isinstance(e, str) else tuple(e)))
    return tuple(out)


def spec_of(entries: Entries) -> P:
    """The ``P`` of entries, trailing unsplit dims left out."""
    es = [None if e is None else (e[0] if len(e) == 1 else e) for e in entries]
    while es and es[-1] is None:
        es.pop()
    return P(*es)


def split_dims(entries: Entries) -> list[int]:
    return [d for d, e in enumerate(entries) if e]


def axes_str(e: tuple[str, ...]) -> str:
    return repr(e[0]) if len(e) == 1 else repr(e)


class _Tracked:
    """Arithmetic that remembers it started from a split dim's size (``LocalSize`` and
    ``LocalFloat``): the result of ``+ - * / // % **`` with a number is tracked too, an int
    as a ``LocalSize``, a float as a ``LocalFloat``. ``math.floor``/``ceil``/``trunc`` and
    ``round`` keep the tracking. Not followed: ``int(...)``, ``float(...)``, ``math.sqrt``
    (Python makes them plain numbers) and a float on the left of an int size (``0.5 * h``:
    Python asks the float first); the plan finds those by planning twice (``sizes.py``).

    Each also carries ``glob``: the value the same expression has on one device (computed
    from the global length of the dim, which the tag's sizes give), or None where that
    length is not known. Comparing two tracked values (``==``, ``<``, ``min``, ...)
    decides on ``glob``, so that every rank takes the branch one device takes
    (``if a.shape[2] != b.shape[2]: pad``); where either ``glob`` is unknown the
    comparison is refused (``_undecided``). A comparison with a plain number and ``bool``
    (``if h > 64:``, ``if h % 2:``) decide on ``glob`` too (refused where it is not
    known). Only the model's code decides so: spmd's own rules compare this rank's share."""

    origin: tuple[int, tuple[str, ...]]  # (dim, axes) it was read from
    expr: str
    glob: int | float | None

    def _number(self) -> int | float:
        return int(self) if isinstance(self, int) else float(self)

    def _op(self, o: Any, sym: str, fn, right: bool = False) -> Any:
        if not isinstance(o, (int, float)) or isinstance(o, bool):
            return NotImplemented  # Python then computes a plain number
        other = o._number() if isinstance(o, _Tracked) else o
        a, b = (_operand(o), _operand(self)) if right else (_operand(self), _operand(o))
        value = fn(other, self._number()) if right else fn(self._number(), other)
        og = o.glob if isinstance(o, _Tracked) else o
        f = (lambda u, v: fn(v, u)) if right else fn
        out = _tracked(value, self.origin, f"{a} {sym} {b}", _safe(f, self.glob, og))
        scale = getattr(self, "scale", None)
        if sym == "*" and scale is not None and isinstance(out, LocalSize) and \
                not isinstance(o, _Tracked) and isinstance(o, int):
            out.scale = scale * o  # still a whole multiple of the size read
        return out

    def _cmp(self, o: Any, sym: str, fn) -> Any:
        if not isinstance(o, (int, float)) or isinstance(o, bool):
            return NotImplemented
        tracked = isinstance(o, _Tracked)
        mine = fn(self._number(), o._number() if tracked else o)
        if not _from_model():
            return mine  # spmd's own code compares this rank's share
        og = o.glob if tracked else o
        if self.glob is not None and og is not None:
            return fn(self.glob, og)  # what one device decides, on every rank
        return _undecided(f"{_operand(self)} {sym} {_operand(o)}", mine)

    def __bool__(self) -> bool:
        mine = self._number() != 0
        if not _from_model():
            return mine
        if self.glob is not None:
            return self.glob != 0
        return _undecided(f"bool({self.expr})", mine)

    def __eq__(self, o): return self._cmp(o, "==", operator.eq)
    def __ne__(self, o): return self._cmp(o, "!=", operator.ne)
    def __lt__(self, o): return self._cmp(o, "<", operator.lt)
    def __le__(self, o): return self._cmp(o, "<=", operator.le)
    def __gt__(self, o): return self._cmp(o, ">", operator.gt)
    def __ge__(self, o): return self._cmp(o, ">=", operator.ge)

    def __add__(self, o): return self._op(o, "+", operator.add)
    def __radd__(self, o): return self._op(o, "+", operator.add, True)
    def __sub__(self, o): return self._op(o, "-", operator.sub)
    def __rsub__(self, o): return self._op(o, "-", operator.sub, True)
    def __mul__(self, o): return self._op(o, "*", operator.mul)
    def __rmul__(self, o): return self._op(o, "*", operator.mul, True)
    def __truediv__(self, o): return self._op(o, "/", operator.truediv)
    def __rtruediv__(self, o): return self._op(o, "/", operator.truediv, True)
    def __floordiv__(self, o): return self._op(o, "//", operator.floordiv)
    def __rfloordiv__(self, o): return self._op(o, "//", operator.floordiv, True)
    def __mod__(self, o): return self._op(o, "%", operator.mod)
    def __pow__(self, o): return self._op(o, "**", operator.pow)
    def __neg__(self): return _tracked(-self._number(), self.origin, f"-{_operand(self)}",
                                       _safe(operator.neg, self.glob))
    def __floor__(self): return self._call(math.floor, "floor")
    def __ceil__(self): return self._call(math.ceil, "ceil")
    def __trunc__(self): return self._call(math.trunc, "trunc")
    def __round__(self, n=None): return self._call(lambda v: round(v, n), "round")

    def _call(self, fn, name: str) -> Any:
        return _tracked(fn(self._number()), self.origin, f"{name}({self.expr})",
                        _safe(fn, self.glob))


class LocalSize(_Tracked, int):
    """This rank's size along a split dim (or a value computed from one by arithmetic).

    Passed to a torch call inside a converted forward, it is refused unless it stands
    where the local size is what is meant (``x.view(n, c, h, w)`` with ``h`` read from
    the same dim). Python's own uses of it (``range(h)``) cannot be seen: such code
    runs with this rank's count. ``expr`` says how it was computed (``shape[2] * 8``),
    for messages.
    """

    derived: bool
    #: ``self == scale * x.shape[d]`` as read, where arithmetic kept that (multiplying by
    #: plain ints: ``h * w``, ``b * n``); None after any other arithmetic.
    scale: int | None
    __hash__ = int.__hash__  # defining __eq__ would otherwise make it unhashable

    def __new__(cls, value: int, origin: tuple[int, tuple[str, ...]], derived: bool = False,
                expr: str | None = None, glob: int | None = None):
        self = int.__new__(cls, value)
        self.origin, self.derived, self.glob = origin, derived, glob
        self.scale = None if derived else 1
        self.expr = expr if expr is not None else f"shape[{origin[0]}]"
        return self

    def __repr__(self) -> str:
        return int.__repr__(self)


class LocalFloat(_Tracked, float):
    """A float computed from a ``LocalSize`` (``h * 0.5``, ``1 / h``): refused where a
    torch call is given it, like the size it came from."""

    derived = True
    __hash__ = float.__hash__

    def __new__(cls, value: float, origin: tuple[int, tuple[str, ...]], expr: str,
                glob: float | None = None):
        self = float.__new__(cls, value)
        self.origin, self.expr, self.glob = origin, expr, glob
        return self

    def __repr__(self) -> str:
        return float.__repr__(self)


def _tracked(value: Any, origin: tuple[int, tuple[str, ...]], expr: str,
             glob: Any = None) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return LocalSize(value, origin, True, expr, glob if isinstance(glob, int) else None)
    if isinstance(value, float):
        return LocalFloat(value, origin, expr, glob if isinstance(glob, (int, float)) else None)
    return value


def _from_model() -> bool:
    """Whether the code deciding is the model's (not spmd's or torch's own, which compare
    this rank's share on purpose)."""
    f = inspect.currentframe()
    while f is not None and os.path.abspath(f.f_code.co_filename) == _HERE:
        f = f.f_back
    return f is not None and not os.path.abspath(f.f_code.co_filename).startswith(
        (_SPMD, _TORCH))


def _safe(fn, *args: Any) -> Any:
    """``fn(*args)`` on the one-device values, or None where one is unknown (or it fails:
    a division by a global zero is the one device's own error, raised when it runs)."""
    if any(a is None for a in args):
        return None
    try:
        return fn(*args)
    except (ArithmeticError, ValueError):
        return None


def _undecided(what: str, local: bool) -> bool:
    """A decision on a split dim's size whose global length is not known here: each rank
    would decide on its own share (and ranks could take different paths). Refused: in a
    plan it is listed with its source line; at run time it raises (the same on every
    rank: whether a length is known does not depend on the rank)."""
    from ._shared import _Entry, _local
    run = _local.get("run")  # the converted forward running on this thread
    if run is None:
        return local
    problem = (f"{what}: a split dim's size whose global length is not known here (a "
               f"tensor made in the forward, or a layer not looked into): each rank would "
               f"decide on its own share and the ranks could take different paths; decide "
               f"on global sizes (constants, or arguments of the model)")
    if run.plan is not None:
        run.plan.entries.append(_Entry("refused", run.where(), "deciding", problem))
        return local
    from ..core.errors import SpecError
    raise SpecError(f"convert: {run.where()}: deciding {problem}")


def _operand(v: Any) -> str:
    if isinstance(v, _Tracked):
        return f"({v.expr})" if " " in v.expr else v.expr
    return repr(v)


def local_sizes(obj: Any) -> list[LocalSize | LocalFloat]:
    """The LocalSizes (and LocalFloats) in an argument (one level of nesting)."""
    if isinstance(obj, _Tracked):
        return [obj]
    if isinstance(obj, (tuple, list, torch.Size)):
        return [v for v in obj if isinstance(v, _Tracked)]
    return []


def plain(obj: Any) -> Any:
    """``obj`` with every LocalSize (LocalFloat) turned into a plain int (float), before
    calling torch."""
    if isinstance(obj, _Tracked):
        return obj._number()
    if isinstance(obj, torch.Size):
        return torch.Size(int(v) for v in obj)
    if isinstance(obj, (tuple, list)) and any(isinstance(v, _Tracked) for v in obj):
        return type(obj)(v._number() if isinstance(v, _Tracked) else v for v in obj)
    return obj
