"""Code a converted forward leaves to backward, run under the same conversion.

Two kinds of user code run in backward, after the converted forward has returned:

- activation checkpointing's recompute: ``torch.utils.checkpoint.checkpoint(fn, x,
  use_reentrant=False)`` keeps no activations of ``fn`` and runs ``fn`` again when
  backward first needs one of them;
- tensor hooks: ``h.register_hook(fn)`` runs ``fn`` on the gradient of ``h``.

Both must see what they saw in the forward: the same swaps (a ``sum`` over a split dim
is ``spmd.reduce``), the same splits of their inputs. The forward marks every autograd
node made inside a checkpoint region with a pre-hook that pushes the interpreter again
(a non-planning run of the same ``Config``, on whichever thread autograd runs the node)
and a post-hook that pops it; a tensor hook is wrapped so that its body runs inside one,
the gradient tagged like ``h`` (``hooks.py``). While such a run is pushed, a torch call is converted
only where it comes from the recompute or the hook body; spmd's own backward code (the
twins' autograd Functions, which communicate) runs as it is.

``use_reentrant=True`` recomputes in a nested ``torch.autograd.backward``, which torch
refuses under ``torch.autograd.grad`` (what shard_map runs on every rank): it is refused
in the plan, before anything runs.
"""
from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from ..core._local import RankLocal
from ..comm import rank_threads
from ..comm.threads import in_rank_greenlet
from ..core import _context
from ..core.errors import SpecError
from . import streams
from ._shared import _Entry, _flat
from ._shared import _local as run_local

if TYPE_CHECKING:
    from .interpreter import _Run

__all__ = ["Regions", "converts", "clean", "recomputed_state", "MARKERS", "backward_hooks_problem"]

_CHECKPOINT_FILE = torch.utils.checkpoint.detach_variable.__code__.co_filename
_HERE = os.path.abspath(__file__)
_SPMD_DIR = os.path.dirname(os.path.dirname(_HERE))
_INTERPRETER = os.path.join(os.path.dirname(_HERE), "interpreter.py")
_TORCH_DIR = os.path.dirname(torch.__file__)
_local = RankLocal()
#: Code objects whose frames run user code under a run pushed in backward (hooks.py adds
#: the tensor hook wrapper's).
MARKERS: set = set()

_NOOP = torch.utils.checkpoint.noop_context_fn
REENTRANT_FIX = ("pass use_reentrant=False (torch's recommended setting), which convert "
                 "recomputes under the same conversion")


def _checkpoint_frame(stop: Any, start: Any = None) -> Any:
    """The innermost ``torch.utils.checkpoint.checkpoint`` call on the stack (from
    ``start``), up to ``stop`` (the converted forward's call); None outside any."""
    f = inspect.currentframe() if start is None else start
    while f is not None and f is not stop:
        code = f.f_code
        if code.co_name == "checkpoint" and code.co_filename == _CHECKPOINT_FILE:
            return f
        f = f.f_back
    return None


def _user_caller(frame: Any) -> Any:
    """The first frame below ``frame`` that is neither torch's nor spmd's."""
    f = frame.f_back
    while f is not None and (f.f_code.co_filename.startswith(_SPMD_DIR) or
                             f.f_code.co_filename.startswith(_TORCH_DIR)):
        f = f.f_back
    return f


def converts() -> bool:
    """In a run pushed in backward: whether the torch call being dispatched comes from a
    checkpoint's recompute or a tensor hook's body (convert it), not from spmd's own
    backward code or from anything else autograd runs (leave it as it is)."""
    f = inspect.currentframe()
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if name == _CHECKPOINT_FILE or code in MARKERS:
            return True
        if name.startswith(_SPMD_DIR) and name not in (_HERE, _INTERPRETER):
            return False
        f = f.f_back
    return False


class _Pushed:
    """A non-planning run of ``cfg`` pushed on the thread autograd runs a node on (the
    rank context of the forward pushed too: autograd may use another thread)."""

    __slots__ = ("cfg", "make", "rank", "path", "rng", "streams")

    def __init__(self, run: _Run, rng: bool = False):
        self.cfg, self.make = run.cfg, type(run)
        stack = _context.rank_stack()
        self.rank = stack[-1] if stack else None
        self.path = run.paths[-1] if run.paths else run.cfg.name
        # A rank thread draws from its own generator state, which checkpoint's restore
        # of torch's generator does not reach: the recompute starts from the state the
        # region's forward started from (processes: checkpoint restores it itself).
        mode = _rank_random() if rng else None
        self.rng = mode.state.clone() if mode is not None else None
        if rng and mode is None and in_rank_greenlet() and run.mesh.rng == "per_rank":
            # a rank greenlet draws from torch's generator, which holds its own state
            self.rng = torch.get_rng_state()
        # the streams the ranks share for replicated draws, likewise
        self.streams = streams.snapshot(run) if rng and not run.planning else None

    def enter(self, *_: Any) -> None:
        clean()
        run = self.make(self.cfg, planning=False)
        run.in_backward = True
        run.mode = _Probed(run)
        run.paths.append(self.path)
        run.base = None
        stack = _context.rank_stack()
        pushed_rank = self.rank is not None and (not stack or stack[-1] != self.rank)
        if pushed_rank:  # autograd may run the node on a thread of its own
            _context.push(*self.rank)
        saved = (getattr(run_local, "run", None), _context.set_converting(False), pushed_rank)
        run_local.run = run
        # autograd runs the node without the rank thread's random mode: pushed again,
        # under the interpreter's, at the region's starting state (checkpoint sets and
        # restores torch's shared generator around the recompute: not a rank's seed)
        mode = rank_threads._RankRandom.at_state(self.rng) if self.rng is not None else None
        if mode is not None:
            mode.__enter__()
        replay = streams.replaying(self.streams) if self.streams is not None else None
        if replay is not None:
            replay.__enter__()
        run.mode.__enter__()
        _pushed().append((run, saved, mode, replay))

    def leave(self, *_: Any) -> None:
        stack = _pushed()
        if not stack:
            return
        run, saved, mode, replay = stack.pop()
        try:
            run.mode.__exit__(None, None, None)
            if replay is not None:
                replay.__exit__(None, None, None)
            if mode is not None:
                mode.__exit__(None, None, None)
        finally:
            _restore(saved)


def _restore(saved: tuple) -> None:
    prev, converting, pushed_rank = saved
    _context.set_converting(converting)
    run_local.run = prev
    if pushed_rank:
        _context.pop()


class _Probed(TorchFunctionMode):
    """The mode of a run pushed in backward; it answers a probe, so that a run whose node
    failed (autograd then drops the node's modes, and its post-hook never comes) is told
    from one at work."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run
        self.probed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and args[0] is _PROBE:
            self.probed = True
        return self.run.call(func, args, kwargs or {})


_PROBE = torch.empty(0)


def clean() -> None:
    """Drop what runs pushed in backward left on this thread where their node failed:
    the interpreter's current run, the rank context, the converting flag."""
    stack = _pushed()
    while stack:
        run = stack[-1][0]
        run.mode.probed = False
        _PROBE.dim()  # every mode on torch's stack sees it
        if run.mode.probed:
            return
        _, saved, _, replay = stack.pop()
        if replay is not None:
            replay.__exit__(None, None, None)
        _restore(saved)


def _rank_random() -> Any:
    """The per-rank random generator mode of this rank thread (threads mesh), if any."""
    return getattr(rank_threads._active, "mode", None)


def _pushed() -> list:
    s = _local.get("pushed")
    if s is None:
        s = _local.pushed = []
    return s


class Regions:
    """The checkpoint regions of one converted forward (or its plan)."""

    def __init__(self, run: _Run):
        self.run = run
        # by the checkpoint frame, which the tuple keeps alive: ids stay unique
        self.regions: dict[int, tuple[Any, _Pushed | None]] = {}
        self.current: tuple | None = None
        # The call of the layer this forward entered by: a checkpoint around it is the
        # caller's (the layer converts itself again in the recompute), not the forward's.
        self.top = _entry_call()
        self.seen: dict[int, Any] = {}  # autograd nodes walked (kept alive: ids stay unique)
        self.layers: set[str] = set()  # paths (relative) of layers run inside a region (plan)
        self.hooked = False  # a layer's backward hook was refused (plan)

    def before(self, args: tuple, kwargs: dict) -> None:
        """Before a torch call of the forward: the checkpoint region it runs in, if any
        (opened at its first call: the rank's random state is taken there)."""
        run = self.run
        self.current = None
        if run.plan is not None and not self.hooked:
            self._global_hooks(args, kwargs)
        if not (run.planning or torch.is_grad_enabled()):
            return  # nothing to recompute; a plan is made whatever the grad mode
        frame = _checkpoint_frame(self.top)
        if frame is None:
            return
        self.current = self.regions.get(id(frame)) or self._open(frame)
        if run.planning:
            path = run.paths[-1] if run.paths else run.cfg.name
            self.layers.add("" if path == run.cfg.name else path.strip("'"))

    def after(self, res: Any) -> None:
        """After it: mark the autograd nodes it made inside a region."""
        region = self.current
        if region is not None and region[1] is not None and not self.run.planning:
            self._mark(res, region[1])

    def _open(self, frame: Any) -> tuple:
        run = self.run
        local = frame.f_locals
        reentrant = local.get("use_reentrant")
        pushed = None if reentrant or not torch.is_grad_enabled() else _Pushed(run, rng=True)
        if pushed is not None or (run.planning and not reentrant):
            run.leaves_backward_code()  # a plan made without grad: a later call has it
        region = (frame, pushed)
        self.regions[id(frame)] = region
        if run.plan is not None and reentrant:
            self._refuse(frame, "torch.utils.checkpoint(use_reentrant=True, torch's default "
                         "where not given)",
                         "recomputes in a nested torch.autograd.backward, which torch refuses "
                         "under torch.autograd.grad (shard_map's backward on every rank); "
                         + REENTRANT_FIX)
        elif run.plan is not None and \
                local.get("context_fn", _NOOP) is not _NOOP:
            self._refuse(frame, "torch.utils.checkpoint(context_fn=...)",
                         "gives the recompute contexts of its own (selective activation "
                         "checkpointing caches the outputs of the ops it saves by their order "
                         "at the ATen level, which convert's swaps change): drop context_fn; "
                         "plain checkpointing of the block is exact")
        elif _checkpoint_frame(None, frame.f_back) is not None:
            # also one around the converted model's call, in the caller
            detail = ("inside the function of another checkpoint: the two recomputes are "
                      "not followed together (torch raises a CheckpointError in backward); "
                      "checkpoint the blocks one after the other, or only the outer one")
            if run.plan is None:  # a plan made outside that checkpoint: raised as it runs
                raise SpecError(f"convert: {run.where()}: torch.utils.checkpoint {detail}")
            self._refuse(frame, "torch.utils.checkpoint", detail)
        if pushed is not None:  # the region's inputs: where its graph starts
            for a in local.get("args", ()):
                if isinstance(a, torch.Tensor) and a.grad_fn is not None:
                    self.seen[id(a.grad_fn)] = a.grad_fn
        return region

    def _global_hooks(self, args: tuple, kwargs: dict) -> None:
        """A tensor that a layer's backward hook watches (torch wraps it in its backward
        hook function): refused once, unless the layer's own hooks already were."""
        for a in _flat(args, kwargs):
            if isinstance(a, torch.Tensor) and a.grad_fn is not None and \
                    a.grad_fn.name() == "BackwardHookFunctionBackward":
                self.hooked = True
                plan = self.run.plan
                if not any(e.detail.startswith("has a backward hook") for e in plan.entries):
                    plan.entries.append(_Entry(
                        "refused", self.run.where(), "a layer's backward hook",
                        "(register_module_full_backward_hook, register_full_backward_hook "
                        "or their pre-hooks) watches this tensor; torch runs it " +
                        backward_hooks_problem(None).split(", which torch runs ", 1)[1]))
                return

    def _refuse(self, frame: Any, call: str, detail: str) -> None:
        run = self.run
        caller = _user_caller(frame)
        line = f" ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})" \
            if caller is not None and caller is not run.base else ""
        path = run.paths[-1] if run.paths else run.cfg.name
        run.plan.entries.append(_Entry("refused", f"in {path}{line}", call, detail))

    def _mark(self, res: Any, pushed: _Pushed) -> None:
        todo = [t.grad_fn for t in _tensors(res) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or id(node) in self.seen:
                continue
            self.seen[id(node)] = node
            if not node.next_functions and "AccumulateGrad" in node.name():
                continue  # a leaf's: saves nothing
            node.register_prehook(pushed.enter)
            node.register_hook(pushed.leave)
            todo.extend(n for n, _ in node.next_functions)

    def close(self) -> None:
        self.regions.clear()
        self.seen.clear()
        self.top = None


_MODULE_CALL = torch.nn.Module.__call__.__code__


def _entry_call() -> Any:
    """The innermost ``nn.Module.__call__`` frame on the stack (None outside any)."""
    f = inspect.currentframe()
    while f is not None and f.f_code is not _MODULE_CALL:
        f = f.f_back
    return f


def _tensors(res: Any):
    if isinstance(res, torch.Tensor):
        yield res
    elif isinstance(res, (tuple, list)):
        for r in res:
            yield from _tensors(r)


def recomputed_state(regions: Regions, changes: list) -> list:
    """The changes (``state.Change``) a checkpoint's recompute makes again, as plan
    refusals for rank threads that share the layers."""
    return [_Entry("refused", f"in {c.path}", f"self.{c.attr}",
                   f"{c.what} inside torch.utils.checkpoint, whose recompute in backward "
                   f"updates it again; the rank threads of a threads mesh share the layer and "
                   f"would each apply that second update: move the layer out of the "
                   f"checkpointed function, or train on processes (spmd.launch(..., "
                   f"backend='gloo') or torchrun), where each rank updates its own copy as "
                   f"one device does") for c in changes if c.rel in regions.layers]


def backward_hooks_problem(module: torch.nn.Module | None) -> str:
    """Why a layer's backward hooks (``register_full_backward_hook``,
    ``register_full_backward_pre_hook``) would be wrong on shards ('' without any): torch
    hands them this rank's part of the gradients, outside the conversion."""
    if module is not None and not (getattr(module, "_backward_hooks", None) or
                                   getattr(module, "_backward_pre_hooks", None)):
        return ""
    return ("has a backward hook (register_full_backward_hook or "
            "register_full_backward_pre_hook), which torch runs on this rank's part of the "
            "gradients, outside the conversion: a hook that reduces or clips them would give "
            "other numbers than on one device; register a tensor hook in the layer's forward "
            "instead (output.register_hook(fn): convert runs it under the conversion), or "
            "apply it to the gradients after backward, outside the converted model")
