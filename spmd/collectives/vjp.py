"""``spmd.custom_vjp``: a function with a hand-written backward, as in JAX.

Built on ``torch.autograd.Function`` with ``setup_context``, so ``loss.backward()``,
``torch.autograd.grad`` and ``torch.func.grad`` all see the rule.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..core._local import RankLocal
from ..comm.stats import in_backward
from ..comm._torch_state import saved_tensor_hooks
from ..comm.threads import _tls as _comm_tls
from ..comm.threads import per_rank_backward
from .mesh_vjp import mesh_call

__all__ = ["custom_vjp", "needs_input_grad"]

_stash = RankLocal()


class custom_vjp:
    """Give ``fun`` a custom backward: ``fwd`` returns ``(out, residuals)``, ``bwd``
    maps ``(*nondiff_args, residuals, cotangent)`` to one gradient per differentiable
    argument (``None`` for non-tensors or no gradient).

    ``out`` is a tensor or a tuple of tensors; ``residuals`` any pytree (its tensors
    are saved with ``save_for_backward``). Arguments that are not tensors get no
    gradient; list them in ``nondiff_argnums`` to have them passed to ``bwd`` first.

    Example:
        >>> @spmd.custom_vjp
        ... def clip_grad(x):
        ...     return x.clone()
        >>> clip_grad.defvjp(lambda x: (x.clone(), None),
        ...                  lambda res, g: (g.clamp(-1, 1),))
        >>> x = torch.tensor([1.0], requires_grad=True)
        >>> (clip_grad(x) * 5).sum().backward(); x.grad
        tensor([1.])
    """

    def __init__(self, fun: Callable, nondiff_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.nondiff_argnums = tuple(nondiff_argnums)
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None
        self._fn: type[torch.autograd.Function] | None = None
        self._fast: type[torch.autograd.Function] | None = None

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        """Set the rule: ``fwd(*args) -> (out, residuals)`` and ``bwd(*nondiff,
        residuals, g) -> grads`` (one per differentiable argument), as JAX's."""
        self.fwd, self.bwd = fwd, bwd
        self._fn = _make_function(self.fun.__name__, fwd, bwd, self.nondiff_argnums)
        self._fast = _make_fast_function(self.fun.__name__, fwd, bwd, self.nondiff_argnums)

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            raise TypeError(f"custom_vjp function {self.fun.__name__!r} has no rule yet; "
                            f"call .defvjp(fwd, bwd) first")
        if not torch.is_grad_enabled():
            return self.fun(*args)
        run = _comm_tls.get("green")
        if run is not None and not run.per_rank_backward:
            needs = _needs_grad(args)
            if needs and _checkpointing():
                # torch.utils.checkpoint recomputes in backward, on each rank: per-rank
                # nodes from here on
                per_rank_backward()
            elif not torch._C._are_functorch_transforms_active():
                # A rank greenlet of the simulated mesh: one node for every rank's call,
                # made if any rank's arguments need a gradient. So a rank whose own need
                # none (an empty shard, a constant) meets the others too, unless no
                # argument is one that can (no floating or complex tensor).
                if needs or self._could_need(args):
                    return mesh_call(self, run, args, _stash)
                return self.fun(*args)
        if not _needs_grad(args):
            return self.fun(*args)
        try:
            # The ctx-style Function skips the per-call signature binding that torch does
            # for setup_context-style ones (~10 us); torch refuses it under torch.func.
            return self._fast.apply(*args)
        except RuntimeError as e:
            if "functorch" not in str(e) and "setup_context" not in str(e):
                raise
        try:
            return self._fn.apply(*args)
        finally:
            _stash.res = None  # drop the residuals' reference once ctx holds them

    def _could_need(self, args: tuple) -> bool:
        """Whether some rank's call could need a gradient (a differentiable argument is
        a floating or complex tensor)."""
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) \
                    and i not in self.nondiff_argnums:
                return True
        return False

    def __get__(self, obj, objtype=None):  # so it can decorate methods too
        return self if obj is None else functools.partial(self.__call__, obj)


def needs_input_grad() -> tuple[bool, ...]:
    """Inside a ``custom_vjp`` bwd: which of the call's arguments need a gradient.

    Read it here, not as ``requires_grad`` in fwd: under ``torch.func`` fwd sees the
    arguments one level down, where a tensor the transform differentiates (a weight
    passed to ``torch.func.grad``) does not require grad.
    """
    needs = _stash.get("needs")
    if needs is None:
        raise RuntimeError("needs_input_grad() is only defined inside a custom_vjp bwd")
    return needs


def _needs_grad(args: tuple) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:
        # torch.func.grad's wrapped inputs report requires_grad too.
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


def _save(ctx, leaves: list, spec, nondiff_vals: list, n_in: int, tuple_out: bool) -> None:
    is_t = [isinstance(v, torch.Tensor) for v in leaves]
    ctx.save_for_backward(*[v for v, t in zip(leaves, is_t) if t])
    ctx.res_other = [None if t else v for v, t in zip(leaves, is_t)]
    ctx.res_is_t, ctx.res_spec = is_t, spec
    ctx.nondiff_vals = nondiff_vals
    ctx.n_in = n_in
    ctx.tuple_out = tuple_out


def _run_bwd(ctx, grads: tuple, name: str, bwd: Callable, nondiff: tuple[int, ...]) -> tuple:
    saved = iter(ctx.saved_tensors)
    leaves = [next(saved) if t else v for v, t in zip(ctx.res_other, ctx.res_is_t)]
    res = optree.tree_unflatten(ctx.res_spec, leaves)
    g = grads if ctx.tuple_out else grads[0]
    prev = _stash.get("needs")
    _stash.needs = tuple(ctx.needs_input_grad)
    try:
        with in_backward():  # communication accounting: what bwd sends is backward traffic
            out = bwd(*ctx.nondiff_vals, res, g)
    finally:
        _stash.needs = prev
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"custom_vjp {name!r}: bwd must return a tuple, got {type(out).__name__}")
    n_diff = ctx.n_in - len(nondiff)
    if len(out) != n_diff:
        raise TypeError(f"custom_vjp {name!r}: bwd returned {len(out)} gradients for "
                        f"{n_diff} differentiable arguments")
    it = iter(out)
    return tuple(None if i in nondiff else next(it) for i in range(ctx.n_in))


def _make_fast_function(name: str, fwd: Callable, bwd: Callable,
                        nondiff: tuple[int, ...]) -> type[torch.autograd.Function]:
    """The rule as a ctx-style Function: plain autograd only."""

    def forward(ctx, *args):
        out, res = fwd(*args)
        leaves, spec = optree.tree_flatten(res, none_is_leaf=True)
        _save(ctx, leaves, spec, [args[i] for i in nondiff], len(args), isinstance(out, tuple))
        return out

    def backward(ctx, *grads):
        return _run_bwd(ctx, grads, name, bwd, nondiff)

    return type(f"custom_vjp_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })


def _make_function(name: str, fwd: Callable, bwd: Callable,
                   nondiff: tuple[int, ...]) -> type[torch.autograd.Function]:

    def forward(*args):
        out, res = fwd(*args)
        # setup_context follows this forward before any other forward on this thread
        # (torch.func calls it twice), so a per-thread "last residuals" is enough.
        # Residuals that ARE an input or output are saved as setup_context's own
        # tensors of that level, so torch.func can differentiate the rule again.
        outs = out if isinstance(out, tuple) else (out,)
        leaves, spec = optree.tree_flatten(res, none_is_leaf=True)
        where = []
        for v in leaves:
            w = None
            if isinstance(v, torch.Tensor):
                w = next((("in", i) for i, a in enumerate(args) if a is v), None) or \
                    next((("out", j) for j, o in enumerate(outs) if o is v), None)
            where.append(w)
        _stash.res = (leaves, spec, where)
        return out

    def setup_context(ctx, inputs, output):
        leaves, spec, where = _stash.res
        outs = output if isinstance(output, tuple) else (output,)
        leaves = [v if w is None else (inputs[w[1]] if w[0] == "in" else outs[w[1]])
                  for v, w in zip(leaves, where)]
        _save(ctx, leaves, spec, [inputs[i] for i in nondiff], len(inputs),
              isinstance(output, tuple))

    def backward(ctx, *grads):
        return _run_bwd(ctx, grads, name, bwd, nondiff)

    return type(f"custom_vjp_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
    })



def _checkpointing() -> bool:
    """Whether the innermost saved-tensor hooks are torch.utils.checkpoint's (its region
    is recomputed in backward, where the recompute's collectives run per rank)."""
    hooks = saved_tensor_hooks()
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")
