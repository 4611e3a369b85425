"""Hooks in a converted model: tensor hooks run under the conversion, layers' backward
hooks are refused.

A tensor hook registered in the forward (``h.register_hook(fn)``) runs in backward, after
the converted forward has returned: it is wrapped so that ``fn`` runs inside a run of the
interpreter pushed again (``backward.py``), on the gradient tagged like ``h``. A layer's
backward hooks (``register_full_backward_hook`` and its pre-hook, and the global ones)
get this rank's part of the gradients from torch, outside any conversion: refused.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import SpecError
from ._tags import entries_of, set_tag, spec_of, tag_of
from ._shared import _Entry
from .backward import MARKERS, _Pushed, backward_hooks_problem

if TYPE_CHECKING:
    from .interpreter import _Run

__all__ = ["tensor_hook", "backward_hooks_problem", "late_hooks"]


class _Hook:
    """A tensor hook of a converted forward: its body runs under the conversion, on the
    gradient tagged like the hooked tensor.

    Over the mesh axes the tensor is not split on (a mean over the split dims, whole on
    every rank), each rank holds a part of its gradient, the parts adding up to it
    (shard_map's convention): the body gets their sum (``spmd.psum``, every rank of
    those axes alike, in the graph's order) and its result goes on divided by their
    number, the parts that the backward's own sums add up again."""

    def __init__(self, run: _Run, fn: Callable, entries: tuple, where: str):
        self.fn, self.entries, self.where = fn, entries, where
        self.mesh = mesh = run.mesh
        used = {a for e in entries if e for a in e}
        self.axes = tuple(a for a in mesh.axis_names
                          if a not in used and mesh.axis_size(a) > 1)
        self.pushed = _Pushed(run)

    def __call__(self, g: torch.Tensor) -> Any:
        self.pushed.enter()
        try:
            if self.axes:
                from ..collectives import psum
                g = psum(g, self.axes)
            if len(self.entries) == g.ndim:
                g = g.view_as(g)  # an alias to tag: the engine's tensor is left alone
                set_tag(g, self.mesh, self.entries)
            out = self.fn(g)
            _check_hook_result(self, out)
            if self.axes and isinstance(out, torch.Tensor):
                out = out / self.mesh.axis_size(self.axes)
            return out
        finally:
            self.pushed.leave()


MARKERS.add(_Hook.__call__.__code__)


def _check_hook_result(hook: Any, out: Any) -> None:
    problem = _hook_problem(hook, out)
    if problem:
        raise SpecError(f"convert: {hook.where}: the tensor hook {problem}")


def _hook_problem(hook: Any, out: Any) -> str:
    """What is wrong with a tensor hook's result ('' if nothing)."""
    if out is None or not isinstance(out, torch.Tensor):
        return ""
    tag = tag_of(out)
    if tag is not None and tag.poisoned:
        return ""  # the plan already refused the call that made it
    got = entries_of(out, hook.mesh)
    if out.ndim == len(hook.entries) and got == tuple(hook.entries):
        return ""
    return (f"returns a gradient split as {spec_of(got)!r}, but the hooked tensor's gradient "
            f"is split as {spec_of(tuple(hook.entries))!r}; return a tensor computed from the "
            f"gradient position by position (g * s, g / g.abs().amax(), g.clamp(...))")


def tensor_hook(c: Any) -> Any:
    """``h.register_hook(fn)`` in a converted forward: ``fn`` runs in backward under the
    conversion, its gradient tagged like ``h``. In the plan it runs once on a meta
    stand-in of the gradient, so that its calls are checked before anything runs."""
    h = c.args[0]
    fn = c.args[1] if len(c.args) > 1 else c.kwargs.get("hook")
    run = c.run
    if not isinstance(h, torch.Tensor) or not callable(fn):
        return c.call()
    entries = c.ent(h)
    where = run.where()
    hook = _Hook(run, fn, entries, where)
    run.leaves_backward_code()
    if run.planning:
        g = torch.empty(h.shape, dtype=h.dtype, device="meta")
        set_tag(g, run.mesh, entries)
        run.aside += 1
        try:
            with run.mode:
                out = fn(g)
        except SpecError:
            raise
        except Exception as e:  # noqa: BLE001 - a hook that reads values cannot run on meta
            run.plan.notes.append(f"the tensor hook {where} could not be checked in the "
                                  f"plan ({type(e).__name__}); it is checked as it runs")
        else:
            problem = _hook_problem(hook, out)
            if problem:
                run.plan.entries.append(_Entry("refused", where, "x.register_hook(fn):",
                                               "fn " + problem))
        finally:
            run.aside -= 1
    args = (c.args[0], hook) + tuple(c.args[2:])
    kwargs = {k: v for k, v in c.kwargs.items() if k != "hook"}
    return c.call(args=args, kwargs=kwargs)


def late_hooks(module: torch.nn.Module, path: str) -> None:
    """Raise, before the forward runs, where a layer got backward hooks after its plan
    was made (``convert(..., example=...)``, then ``register_full_backward_hook``)."""
    for name, m in module.named_modules():
        problem = backward_hooks_problem(m)
        if problem:
            where = f"'{name}'" if name else path
            raise SpecError(f"convert: in {where}: {type(m).__name__} {problem}; nothing has "
                            f"run")
