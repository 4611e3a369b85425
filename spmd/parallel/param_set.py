"""The set of parameters a ``GradSync`` synchronises: fixed when it is built, checked at
every synchronised backward.

The buckets, their hooks and the plan are built from the module's parameters at that
moment. A parameter added afterwards (or switched to ``requires_grad=True``) has no hook:
its gradient would stay per rank, silently; one switched off, replaced or reshaped no
longer matches its bucket. So each synchronised backward compares the module's
parameters with the plan (names, tensors, shapes, dtypes, order: a walk over
``named_parameters()``, no communication), and whether any rank found a change rides in
the buckets' all-reduce (one element per bucket), so that every rank of a group raises,
the changed ones naming the parameter.

Example:
    >>> m = torch.nn.Linear(2, 1)
    >>> s = ParamSet(m, lambda n, p: p.requires_grad)
    >>> s.change() is None
    True
    >>> m.bias.requires_grad_(False) is m.bias, s.change()
    (True, "parameter 'bias' (f32[1]) no longer requires grad (or was removed)")
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..core._format import shape_str

__all__ = ["ParamSet"]


class ParamSet:
    """The parameters of ``module`` that ``select(name, p)`` keeps, as they are now."""

    def __init__(self, module: torch.nn.Module,
                 select: Callable[[str, torch.Tensor], bool]) -> None:
        self._module = weakref.ref(module)  # the GradSync must not keep the model alive
        self._select = select
        self.names, self.params = self._now()
        self._key = self._key_of(self.params)
        self._tree = self._tree_of(module)

    @staticmethod
    def _tree_of(module: torch.nn.Module) -> tuple[list, list]:
        """Every submodule with its own parameters and children, and every parameter's
        (tensor, requires_grad, shape, dtype): what ``_same`` compares by identity."""
        tree = [(m, dict(m._parameters), dict(m._modules)) for m in module.modules()]
        meta = [(p, p.requires_grad, p.shape, p.dtype) for _, ps, _ in tree
                for p in ps.values() if p is not None]
        return tree, meta

    def _same(self) -> bool:
        """Whether the module tree is the one taken (the same submodules, holding the
        same parameter objects, each with its requires_grad, shape and dtype): a loop of
        identity checks, several times cheaper than walking ``named_parameters()``."""
        tree, meta = self._tree
        for m, params, children in tree:
            mp, mm = m._parameters, m._modules
            if len(mp) != len(params) or len(mm) != len(children):
                return False
            for k, v in params.items():
                if mp.get(k) is not v:
                    return False
            for k, v in children.items():
                if mm.get(k) is not v:
                    return False
        for p, rg, shape, dtype in meta:
            if p.requires_grad is not rg or p.shape != shape or p.dtype is not dtype:
                return False
        return True

    def _now(self) -> tuple[list[str], list[torch.Tensor]]:
        module = self._module()
        if module is None:
            return [], []
        named = [(n, p) for n, p in module.named_parameters() if self._select(n, p)]
        return [n for n, _ in named], [p for _, p in named]

    @staticmethod
    def _key_of(params: list[torch.Tensor]) -> tuple:
        return tuple((id(p), tuple(p.shape), p.dtype) for p in params)

    def change(self) -> str | None:
        """What changed since the set was taken (the first difference), or None."""
        module = self._module()
        if module is None or self._same():
            return None
        names, params = self._now()
        if names == self.names and self._key_of(params) == self._key:
            self._tree = self._tree_of(module)  # another change (a buffer, a module
            return None  # without parameters to synchronise): the fast check again
        now = dict(zip(names, params))
        was = dict(zip(self.names, self.params))
        for n in names:
            if n not in was:
                return (f"parameter {n!r} ({shape_str(now[n].shape, now[n].dtype)}) was added "
                        f"to the module (or set to require grad)")
        for n in self.names:
            if n not in now:
                return (f"parameter {n!r} ({shape_str(was[n].shape, was[n].dtype)}) no longer "
                        f"requires grad (or was removed)")
        for n in self.names:
            a, b = was[n], now[n]
            if a is not b:
                return f"parameter {n!r} is another tensor than the one it was"
            if (a.shape, a.dtype) != self._meta(n):
                return (f"parameter {n!r} changed from {shape_str(*self._meta(n))} to "
                        f"{shape_str(a.shape, a.dtype)}")
        return f"the parameters' order changed (now {names}, was {self.names})"

    def _meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        _, shape, dtype = self._key[self.names.index(name)]
        return shape, dtype
