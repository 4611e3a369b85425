"""What every rule shares: the ``Call`` a rule sees, ``Refused``, dims and broadcasting."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...core.errors import SpecError
from .. import flow
from ..flow import _tensors
from .._tags import Entries, LocalFloat, LocalSize, axes_str, local_sizes, split_dims


class Refused(Exception):
    """A call that would be wrong on shards (caught by the interpreter)."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


class Call:
    """One torch call of a converted forward, as a rule sees it."""

    __slots__ = ("run", "func", "name", "args", "kwargs")

    def __init__(self, run: Any, func: Callable, name: str, args: tuple, kwargs: dict):
        self.run, self.func, self.name = run, func, name
        self.args, self.kwargs = args, kwargs

    @property
    def mesh(self):
        return self.run.mesh

    @property
    def planning(self) -> bool:
        return self.run.planning

    def ent(self, t: torch.Tensor) -> Entries:
        return self.run.entries(t)

    def call(self, fn: Callable | None = None, args: tuple | None = None,
             kwargs: dict | None = None) -> Any:
        """Run ``fn`` (the intercepted function by default) on plain arguments (on meta
        tensors while planning)."""
        return self.run.execute(self.func if fn is None else fn,
                                self.args if args is None else args,
                                self.kwargs if kwargs is None else kwargs)

    def out(self, result: Any, entries: Entries | Sequence[Entries | None] | None,
            sizes: Any = None) -> Any:
        """Tag ``result`` (a tensor, or a tuple/list of them) with ``entries`` (one for
        all, or one per element; None: whole) and return it. Its split dims' shard
        sizes are ``sizes`` (a ``Layout``, or a list of them per element), else those
        of the arguments' dims split over the same axes (``flow.assign``)."""
        found = flow.candidates(self)  # before tagging: an in-place result is an argument
        self.run.tag(result, entries)
        flow.assign(self, result, sizes, found)
        return result

    def record(self, kind: str, detail: str = "", step: bool = True) -> None:
        self.run.record(kind, self, detail, step)

    def refuse(self, problem: str, fix: str = "") -> None:
        raise Refused(problem, fix)



def _split(c: Call, t: torch.Tensor) -> list[int]:
    return split_dims(c.ent(t))


def _dim(d: Any, ndim: int) -> int:
    d = int(d)
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise IndexError(f"dim {d} out of range for {ndim} dims")
    return d % max(ndim, 1)


def _dims(d: Any, ndim: int) -> list[int]:
    """A dim argument (int, tuple, list, None or ()) as sorted dims; None/() is all."""
    if d is None or (isinstance(d, (tuple, list)) and len(d) == 0):
        return list(range(ndim))
    if isinstance(d, (tuple, list, torch.Size)):
        return sorted({_dim(v, ndim) for v in d})
    return [_dim(d, ndim)]


def _where(d: int, e: tuple[str, ...]) -> str:
    return f"dim {d}, which is split over {axes_str(e)}"


def share(c: Call, s: LocalSize | LocalFloat) -> str:
    """``s`` in a message: how it was computed from which split dim, and its value where
    that is a real one (at run time; the global size where the plan ran on the global
    shapes; a plan on stand-in sizes has none to give)."""
    d, e = s.origin
    text = (f"{s.expr}, computed from this rank's share of {_where(d, e)}" if s.derived else
            f"{s.expr}, this rank's share of {_where(d, e)}")
    if not c.planning:
        return f"{text} (here {s!r})"
    plan = c.run.plan
    if plan is not None and plan.global_sizes and not s.derived:
        n, g = c.mesh.axis_size(e), int(s)
        shares = [g // n + (1 if r < g % n else 0) for r in range(n)]
        return f"{text} ({g} in all: {', '.join(map(str, shares))} on its {n} ranks if balanced)"
    return text


def _no_local_sizes(c: Call) -> None:
    """Refuse a LocalSize given where a global size is meant."""
    for a in list(c.args) + list(c.kwargs.values()):
        for s in local_sizes(a):
            c.refuse(f"is given {share(c, s)}, where the global size is meant",
                     "use the global size (or a scale factor) instead of the shard's")


def broadcast(c: Call, ts: Sequence[torch.Tensor]) -> Entries:
    """The entries of the broadcast of ``ts``, or a refusal where a split dim meets a
    whole one of size > 1 or a dim split otherwise."""
    return broadcast_shapes(c, [(c.ent(t), tuple(t.shape)) for t in ts])


def broadcast_shapes(c: Call, parts: Sequence[tuple[Entries, tuple[int, ...]]]) -> Entries:
    """``broadcast`` of (entries, shape) pairs."""
    nd = max((len(s) for _, s in parts), default=0)
    out: list = [None] * nd
    for d in range(nd):
        split, whole, sizes = set(), None, set()
        for ents, shp in parts:
            k = d - (nd - len(shp))
            if k < 0:
                continue
            e = ents[k]
            if e:
                split.add(e)
                sizes.add(shp[k])
            elif shp[k] != 1:
                whole = shp[k]
        if not split:
            continue
        e = next(iter(split))
        if len(split) > 1:
            c.refuse(f"combines tensors whose dim {d} is split over different axes "
                     f"({', '.join(sorted(axes_str(s) for s in split))})",
                     "redistribute one of them first")
        if whole is not None:
            c.refuse(f"combines a tensor split along {_where(d, e)} with one that is whole "
                     f"along it (size {whole}): each rank would use all of it against its "
                     f"shard", "split the whole one the same way (spmd.scatter, or build it "
                     "from the shard), or make it size 1 along that dim")
        if len(sizes) > 1:
            c.refuse(f"combines shards of different sizes along {_where(d, e)} "
                     f"({sorted(sizes)} on this rank)",
                     "redistribute one of them to the other's layout first")
        out[d] = e
    return tuple(out)


def _arg(c: Call, name: str, pos: int, default: Any) -> Any:
    if name in c.kwargs:
        return c.kwargs[name]
    return c.args[pos] if len(c.args) > pos else default


def like_input(c: Call, x: torch.Tensor):
    """Entries for results shaped like ``x`` (same number of dims); whole otherwise."""
    e = c.ent(x)

    def entries_for(r):
        return e if isinstance(r, torch.Tensor) and r.ndim == x.ndim else None
    return PerOutput(entries_for)


class PerOutput:
    """Entries computed per output (``Run.tag`` calls it with each result)."""

    def __init__(self, fn):
        self.fn = fn


def refuse_if_split(what: str, fix: str = "redistribute so nothing is split first") -> Callable:
    def rule(c: Call) -> Any:
        for t in _tensors(c):
            sp = _split(c, t)
            if sp:
                c.refuse(f"{what}, and {_where(sp[0], c.ent(t)[sp[0]])}", fix)
        _no_local_sizes(c)
        return c.call()
    return rule


def passthrough(c: Call) -> Any:
    return c.call()


def unknown(c: Call) -> Any:
    """A function no rule covers: fine where nothing is split, refused otherwise."""
    for t in _tensors(c):
        sp = _split(c, t)
        if sp:
            c.refuse(f"is not known to spmd, and its argument is split along "
                     f"{_where(sp[0], c.ent(t)[sp[0]])}",
                     "if it acts per position, pass it in allow=(...)")
    _no_local_sizes(c)
    return c.call()


def raise_refusal(where: str, call: str, r: Refused) -> SpecError:
    fix = f"; {r.fix}" if r.fix else ""
    return SpecError(f"convert: {where}: {call} {r.problem}{fix}")


_DUNDER = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub",
    "__rsub__": "sub", "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul",
    "__imul__": "mul_", "__truediv__": "div", "__rtruediv__": "div", "__itruediv__": "div_",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide",
    "__ifloordiv__": "floor_divide_", "__mod__": "remainder", "__rmod__": "remainder",
    "__imod__": "remainder_", "__pow__": "pow", "__rpow__": "pow", "__ipow__": "pow_",
    "__neg__": "neg", "__pos__": "positive", "__abs__": "abs", "__invert__": "bitwise_not",
    "__and__": "bitwise_and", "__rand__": "bitwise_and", "__iand__": "bitwise_and_",
    "__or__": "bitwise_or", "__ror__": "bitwise_or", "__ior__": "bitwise_or_",
    "__xor__": "bitwise_xor", "__rxor__": "bitwise_xor", "__ixor__": "bitwise_xor_",
    "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift",
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
    "__ge__": "ge", "__matmul__": "matmul", "__rmatmul__": "rmatmul",
    "__bool__": "item", "__float__": "item", "__int__": "item", "__index__": "item",
    "__complex__": "item", "__array__": "item", "__len__": "len",
}


def op_name(func: Callable) -> str:
    """The name rules are keyed by: ``add`` for ``torch.add``, ``Tensor.add`` and ``+``;
    ``get:shape`` for the ``shape`` property; ``max_pool2d`` for F's dispatchers."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return "get:" + getattr(getattr(func, "__self__", None), "__name__", "?")
    return _DUNDER.get(name, name)
