"""The layout interpreter: runs a converted model's forward and decides, for every torch
call in it, whether it passes, is swapped for its domain-parallel twin, or is refused.

A ``TorchFunctionMode`` (torch's public extension point, pushed only for the duration of
the converted forward, on the calling thread) sees every torch call the forward makes,
in ``nn.Module`` layers, in functional calls, in helpers, in any Python control flow.
Each call goes to its rule (``rules.py``), which reads the split of its inputs from their
tags and tags its outputs. Nothing global is patched: other threads and code outside
the converted forward are untouched. Code the forward leaves to backward (an activation
checkpoint's recompute, a tensor hook) runs under it again (``backward.py``).

Before the first real call with a given input signature, the forward runs on meta tensors
(no memory, no communication), every split dim given a stand-in size: this is the *plan*
(made twice, the split dims' sizes changed, to find numbers computed from them:
``sizes.py``). A call the plan refuses raises, on every rank alike, before anything runs;
``convert(..., example=...)`` makes the plan at once, from the global shape.
"""
from __future__ import annotations

import functools
import inspect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from ..comm.threads import per_rank_backward
from ..core import _context
from ..core.errors import SpecError
from . import rules, steps
from ._shared import _Entry, _flat, _local
from .backward import Regions, converts
from .rules import draws
from ._tags import (
    LocalFloat,
    LocalSize,
    entries_of,
    plain,
    set_tag,
    split_dims,
    tag_of,
)

if TYPE_CHECKING:
    from .entry import Config
    from .sizes import Sizes

__all__ = ["Plan"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CANONICAL = 896  # a split dim's stand-in size in the plan (divisible by 2 ** 7)
#: The second plan's split dims are the first's plus a multiple of this (896 = 7 * 2 ** 7):
#: sizes mod 2 ** 7 and mod 7 stay, so pools and patches divide as before and branches on
#: them agree.
_SHIFT = _CANONICAL
_REGISTER_HOOK = torch.Tensor.register_hook
_CREATION = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
             "linspace", "logspace", "eye", "randperm", "tensor", "as_tensor"}


def _state() -> list:
    s = _local.get("frames")
    if s is None:
        s = _local.frames = []
    return s


def _current() -> _Run | None:
    return _local.get("run")


@dataclass
class Plan:
    """What a converted forward does with each call, found by running it on meta tensors.

    ``str(plan)`` is a table; ``refused`` lists the calls that would be wrong on shards
    (with where they are and how to fix them); ``outputs`` the specs of the forward's
    tensor outputs.
    """

    model: str
    inputs: list[str]
    entries: list[_Entry] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    incomplete: str = ""
    #: The plan ran on the global shapes (``example=``), not on stand-in sizes of split dims.
    global_sizes: bool = False
    #: What the forward changes in its layers' state (``state.Change``s).
    changes: list = field(default_factory=list)
    #: Lines said once after the refusals (a fix they share).
    notes: list[str] = field(default_factory=list)
    #: Rank threads run the forward on their own copies of the buffers it updates in
    #: place, and write back the value they agree on (``state.Views``).
    thread_local: bool = False
    #: (where, layout): the inputs' and every layer's split outputs' global layouts.
    layouts: list[tuple[str, str]] = field(default_factory=list)
    #: (kind, call, where) of every step a real call must run in this order (``steps.py``).
    steps: list[tuple[str, str, str]] = field(default_factory=list)
    #: The forward leaves code to backward that runs under the conversion (a checkpoint
    #: region's recompute, a tensor hook), which communicates outside custom_vjp rules.
    backward_code: bool = False

    @property
    def refused(self) -> list[_Entry]:
        return [e for e in self.entries if e.kind == "refused"]

    @property
    def swapped(self) -> list[_Entry]:
        return [e for e in self.entries if e.kind == "swapped"]

    def error(self) -> SpecError:
        """The refusals, one line per call site (a loop's repeats folded into one), the
        message kept under 2,000 characters."""
        sites = _sites(self.refused)
        lines = [f"convert: {len(sites)} call(s) in {self.model}'s forward would be "
                 f"wrong on shards ({', '.join(self.inputs)}); nothing has run:"]
        tail = "\n".join(self.notes + [
            "(allow=(...) takes layer types and functions you know are right here)"])
        size = len(lines[0]) + len(tail) + 120
        for k, (e, n) in enumerate(sites):
            line = f"  - {e.where}: {e.call} {e.detail}{_again(n)}"
            if size + len(line) > _MAX_MESSAGE and k:
                lines.append(f"  ... and {len(sites) - k} more call site(s): print the plan "
                             f"(convert(..., example=..., report=True)) to see them all")
                break
            lines.append(line[:_MAX_MESSAGE - size] if not k else line)
            size += len(line) + 1
        lines.append(tail)
        return SpecError("\n".join(lines))

    def __str__(self) -> str:
        lines = [f"convert plan for {self.model} ({', '.join(self.inputs)}):"]
        passed: Counter = Counter()
        for e in self.entries:
            if e.kind == "passed":
                passed[e.call] += 1
        for e, n in _sites([e for e in self.entries if e.kind != "passed"]):
            lines.append(f"  {e.kind:8} {e.where}: {e.call} {e.detail}".rstrip() + _again(n))
        if passed:
            ops = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in sorted(passed.items()))
            lines.append(f"  passed   {sum(passed.values())} calls on split tensors that act "
                         f"per position or along whole dims: {ops}")
        seen = set()
        for where, lay in self.layouts:
            if (where, lay) not in seen:
                seen.add((where, lay))
                lines.append(f"  layout   {where}: {lay}")
        if self.incomplete:
            lines.append(f"  plan incomplete: {self.incomplete}; later calls are checked as "
                         f"they run")
        if self.outputs:
            lines.append(f"  output: {', '.join(self.outputs)}")
        return "\n".join(lines)

    __repr__ = __str__


_MAX_MESSAGE = 2000


def _sites(entries: list[_Entry]) -> list[tuple[_Entry, int]]:
    """``entries`` folded by call site (where, kind and call): the first of each, and how
    many there were (a Python loop repeats one line)."""
    first: dict[tuple, list] = {}
    for e in entries:
        key = (e.kind, e.where, e.call)
        if key in first:
            first[key][1] += 1
        else:
            first[key] = [e, 1]
    return [(e, n) for e, n in first.values()]


def _again(n: int) -> str:
    # The count is not shown: in a plan on stand-in sizes, a loop over a split dim's
    # size runs the stand-in's count, not any rank's.
    return (" (reached more than once from this line; if that is a Python loop over a split "
            "dim's size, range(x.shape[d]) counts this rank's share only)" if n > 1 else "")


class _Mode(TorchFunctionMode):
    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.run.call(func, args, kwargs or {})


class _Run:
    """One forward of a converted model on this thread (or its plan on meta tensors)."""

    def __init__(self, cfg: Config, planning: bool, plan: Plan | None = None,
                 sizes: Sizes | None = None):
        self.cfg, self.mesh, self.planning = cfg, cfg.mesh, planning
        self.plan = plan
        self.sizes = sizes  # the two plans' numbers, call by call (planning only)
        self.paths: list[str] = []
        self.suspended = 0
        self.internal = 0  # spmd's own hooks at work: their torch calls are not the model's
        #: (spectrum layout, dims) -> the layout its forward FFT started from (rules/fourier)
        self.spectra: dict = {}
        self.mode = _Mode(self)
        self._prev_converting = False
        self.views: Any = None  # state.Views: rank threads' own copies of updated buffers
        # pushed again in backward (backward.py): converts a recompute or a tensor hook
        self.in_backward = False
        self.regions = Regions(self)  # the forward's activation-checkpoint regions
        self.deferred: dict = {}  # pads joined with the conv that follows (rules.windows)
        self.expected: Plan | None = None  # a real call: the plan whose steps it runs
        self.step = 0  # the next of them
        self.aside = 0  # a plan runs a tensor hook's calls: not steps of the forward

    # -- entering and leaving -------------------------------------------------------------

    def start(self) -> None:
        self.base = _user_frame()  # the model's caller: lines there are not the forward's
        _local.run = self
        plan = self.expected
        if not self.planning and torch.is_grad_enabled() and (
                plan is None or plan.backward_code or plan.incomplete):
            # Its backward may push this conversion again on each rank (checkpoint
            # recomputes, tensor hooks: backward.py), whose calls communicate outside
            # custom_vjp rules: on rank greenlets, the ranks' backwards run per rank.
            # Decided here, before any node over the ranks is made; where the plan saw
            # none and followed the whole forward, the backward is one pass.
            per_rank_backward()
        self._prev_converting = _context.set_converting(True)
        self.mode.__enter__()

    def stop(self) -> None:
        try:
            self.mode.__exit__(None, None, None)
        finally:
            _context.set_converting(self._prev_converting)
            _local.run = None
            self.regions.close()

    def leaves_backward_code(self) -> None:
        """The forward leaves code to backward that runs under this conversion: the
        plan says so; a real call's ranks run their backwards per rank (``start``
        decided so from the plan; where the plan did not see it, this call refuses
        once nodes over the ranks exist rather than run a wrong backward)."""
        if self.plan is not None:
            self.plan.backward_code = True
        if not self.planning and torch.is_grad_enabled():
            per_rank_backward()

    def suspend(self) -> None:
        self.suspended += 1
        # A plan never communicates: spmd calls inside the layer stop it there.
        _context.set_converting("plan" if self.planning else False)

    def resume(self) -> None:
        self.suspended -= 1
        if not self.suspended:  # in backward spmd's own autograd Functions communicate
            _context.set_converting(not self.in_backward)

    # -- what rules use ------------------------------------------------------------------------

    def entries(self, t: torch.Tensor) -> tuple:
        return entries_of(t, self.mesh)

    def tag(self, result: Any, entries: Any) -> None:
        if isinstance(result, torch.Tensor):
            e = entries.fn(result) if isinstance(entries, rules.PerOutput) else entries
            if e is None:
                e = (None,) * result.ndim
            if len(e) != result.ndim:
                raise SpecError(f"convert: spmd bug, please report: entries {e} for "
                                f"{result.ndim} dims")
            set_tag(result, self.mesh, e)
        elif isinstance(result, (tuple, list)):
            per = isinstance(entries, list)
            for k, r in enumerate(result):
                self.tag(r, entries[k] if per else entries)

    def _meta(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.device.type != "meta":
            return torch.empty_like(a, device="meta").requires_grad_(a.requires_grad) \
                if a.is_floating_point() or a.is_complex() else torch.empty_like(a, device="meta")
        if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            return type(a)(self._meta(v) for v in a)
        return a

    def execute(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        args = tuple(plain(a) for a in args)
        kwargs = {k: plain(v) for k, v in kwargs.items()}
        if self.planning:  # on meta tensors, without spmd's functions
            args = tuple(self._meta(a) for a in args)
            kwargs = {k: self._meta(v) for k, v in kwargs.items()}
            name = rules.op_name(fn)
            if name in _CREATION:
                kwargs["device"] = "meta"
            elif name == "get:data" and len(args) == 1:
                # ``p.data`` shares no version counter with ``p``; ``detach`` does, so
                # that ``p.data.copy_(...)`` shows in the plan as a change of ``p``
                return args[0].detach()
            return fn(*args, **kwargs)
        prev = _context.set_converting(False)  # twins call spmd's own functions
        try:
            return fn(*args, **kwargs)
        finally:
            _context.set_converting(prev)

    def execute_plain(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def record(self, kind: str, c: rules.Call, detail: str = "", step: bool = True) -> None:
        """An entry of the plan; ``step``: a step a real call checks (``steps.py``)."""
        if self.plan is not None:
            self.plan.entries.append(_Entry(kind, self.where(), _describe(c), detail))
        if step and kind in steps.STEP_KINDS:
            steps.step(self, kind, _describe(c))

    def module_at(self) -> torch.nn.Module | None:
        """The innermost layer whose forward is running (None outside any)."""
        frames = _state()
        return frames[-1].module if frames else None

    def where(self) -> str:
        path = self.paths[-1] if self.paths else self.cfg.name
        f = _user_frame()
        line = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" \
            if f is not None and f is not self.base else ""
        return f"in {path}" + (f" ({line})" if line else "")

    # -- the dispatch --------------------------------------------------------------------------

    def call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if self.internal or (self.in_backward and not converts()):
            return func(*args, **kwargs)
        if not self.in_backward:
            self.regions.before(args, kwargs)
        if self.views is not None:  # this rank thread's copies of the updated buffers
            args = self.views.swap(args)
            kwargs = {k: self.views.swap(v) for k, v in kwargs.items()}
            res = self.views.unswap(self._call(func, args, kwargs))
        else:
            res = self._call(func, args, kwargs)
        if not self.in_backward:
            self.regions.after(res)
        return res

    def _call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        name = rules.op_name(func)
        random = draws.is_random(name)
        if self.suspended:
            return draws.opaque(self, func, args, kwargs) if random else \
                self.execute(func, args, kwargs)
        if self.deferred:
            rules.materialize(self, func, args, kwargs)
        split, poisoned = self._inspect(args, kwargs)
        if self.sizes is not None:
            problem = self.sizes.see(self, func, args, kwargs, poisoned)
            if problem and self.plan is not None:  # kept if a rerun confirms it
                self.record("refused", rules.Call(self, func, name, args, kwargs), problem)
                self.sizes.found.append((len(self.sizes.mine) - 1, self.plan.entries[-1]))
        if poisoned:
            res = self.execute(func, args, kwargs)
            self._poison(res)
            return res
        if not split and func is not _REGISTER_HOOK:  # a hook on a whole tensor: its rule
            # a random draw here is the same on every rank: a shared stream
            return draws.replicated(self, func, args, kwargs) if random else \
                self.execute(func, args, kwargs)
        if not args and "input" in kwargs:  # F.conv2d(input=x, ...): rules read args[0]
            kwargs = dict(kwargs)
            args = (kwargs.pop("input"),)
        c = rules.Call(self, func, name, args, kwargs)
        if func in self.cfg.allow_funcs:
            self.record("allowed", c, "(allow=)")
            res = self.execute(func, args, kwargs)
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.tag(res, rules.like_input(c, first) if first is not None else None)
            return res
        rule = rules.rule_for(name) or rules.unknown
        if random:  # its stream: the rank's own, or one the ranks holding it alike share
            rule = draws.rule_for(name, rule)
        n = len(self.plan.entries) if self.plan is not None else 0
        try:
            res = rule(c)
        except rules.Refused as r:
            if not self.planning:
                raise rules.raise_refusal(self.where(), _describe(c), r) from None
            self.record("refused", c, r.problem + (f"; {r.fix}" if r.fix else ""))
            res = self.execute(func, args, kwargs)
            self._poison(res)
            return res
        if self.plan is not None and len(self.plan.entries) == n and _has_split_tensor(
                self, args, kwargs):
            self.record("passed", c)
        return res

    def _inspect(self, args: tuple, kwargs: dict) -> tuple[bool, bool]:
        """Whether any argument is split (or a LocalSize), and whether any is poisoned."""
        split = poisoned = False
        for a in _flat(args, kwargs):
            if isinstance(a, torch.Tensor):
                tag = tag_of(a)
                if tag is not None and tag.mesh is self.mesh:
                    poisoned |= tag.poisoned
                    split |= any(tag.entries)
            elif isinstance(a, (LocalSize, LocalFloat)):
                split = True
        return split, poisoned

    def _poison(self, res: Any) -> None:
        for t in _flat((res,), {}):
            if isinstance(t, torch.Tensor):
                set_tag(t, self.mesh, (None,) * t.ndim, poisoned=True)


def _has_split_tensor(run: _Run, args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and split_dims(run.entries(a))
               for a in _flat(args, kwargs))


def _describe(c: rules.Call) -> str:
    special = {"__getitem__": "indexing x[...]", "__setitem__": "x[...] = ...",
               "len": "len(x)", "item": "reading values"}
    if c.name in special:
        return special[c.name]
    if c.name.startswith("fft_"):
        return f"torch.fft.{c.name[4:]}"
    name = c.name if not c.name.startswith("get:") else c.name[4:]
    mod = getattr(c.func, "__module__", "") or ""
    prefix = "F." if mod.endswith("functional") and "torch.nn" in mod else \
        ("torch." if mod.startswith("torch") and "Tensor" not in str(c.func) else "")
    return f"{prefix}{name}"


def _user_frame():
    """The innermost frame of code that is neither torch's nor spmd's."""
    f = inspect.currentframe()
    while f is not None:
        if not _library_file(f.f_code.co_filename):
            return f
        f = f.f_back
    return None


@functools.lru_cache(maxsize=4096)
def _library_file(name: str) -> bool:
    """Whether code from file ``name`` is torch's or spmd's (asked for every frame of
    every call a converted forward makes: cached)."""
    fn = os.path.abspath(name)
    return fn.startswith(_TORCH_DIR) or fn.startswith(_SPMD_DIR)
