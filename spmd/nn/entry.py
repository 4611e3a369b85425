"""How a converted model enters the layout interpreter: hooks on every layer.

The first layer called from outside a converted forward (the model, or one of its layers
called on its own) tags its inputs with ``convert``'s spec, gets the plan for this input
signature (made once on meta tensors; a refusal there raises before anything runs) and
starts the interpreter; every layer pushes its path for messages; layers convert does not
look into (``allow=``, ``types=``, spmd.nn layers) suspend it, their outputs split like
their input.
"""
from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core import _context
from ..core.errors import SpecError
from ..core.mesh import Mesh
from ..core.spec import P
from ..ops._window import input_layout
from . import flow, state, steps
from .backward import clean, recomputed_state
from .hooks import backward_hooks_problem, late_hooks
from ._tags import entries_from_spec, entries_of, set_tag, spec_of, tag_of
from .interpreter import _CANONICAL, _SHIFT, Plan, _current, _Entry, _flat, _Run, _state
from .modules import _Sharded
from .sizes import Sizes

__all__ = ["Config", "install", "example_shapes"]


class Config:
    """What ``convert`` decided for one model: its mesh, input specs and exceptions; the
    plans made so far (one per input signature)."""

    def __init__(self, mesh: Mesh, spec: Any, name: str, allow_types: tuple,
                 allow_funcs: frozenset, opaque: tuple, strict: bool = False,
                 params: tuple[str, ...] = ()):
        self.mesh, self.spec, self.name = mesh, spec, name
        self.params = params  # the forward's positional parameter names (spec by name)
        self.allow_types, self.allow_funcs, self.opaque = allow_types, allow_funcs, opaque
        self.strict = strict
        self.plans: dict[tuple, Plan] = {}
        self._lock = threading.Lock()
        # rank threads' copies of the buffers a forward updates, by (call, rank)
        self.board: dict[tuple[int, int], dict] = {}
        self.calls = [0] * mesh.size

    def __deepcopy__(self, memo: dict) -> Config:
        new = Config(self.mesh, self.spec, self.name, self.allow_types, self.allow_funcs,
                     self.opaque, self.strict, self.params)
        new.plans = dict(self.plans)
        return new

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- specs of the inputs ----------------------------------------------------------------

    def spec_for(self, i: int | None, name: str | None = None) -> P | None:
        """The spec of positional input ``i`` or of keyword input ``name``."""
        if isinstance(self.spec, P):
            return self.spec
        if isinstance(self.spec, dict):
            if name is None and i is not None and i < len(self.params):
                name = self.params[i]
            return self.spec.get(name)
        if i is None or i >= len(self.spec):
            return None
        return self.spec[i]

    def tag_inputs(self, args: tuple, kwargs: dict, make: Callable | None = None):
        """The inputs with their tags (aliases, so the caller's tensors are untouched)."""
        def one(a: Any, i: int | None, name: str | None = None) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            tag = tag_of(a)
            sizes = None
            if tag is not None and tag.mesh is self.mesh and len(tag.entries) == a.ndim:
                entries, sizes = tag.entries, tag.sizes
            else:
                spec = self.spec_for(i, name)
                if spec is not None and len(spec) > a.ndim:
                    what = f"input {i}" if name is None else f"input {name!r}"
                    raise SpecError(f"convert: {what} ({tuple(a.shape)}) has {a.ndim} dims "
                                    f"but its spec {spec!r} has {len(spec)} entries")
                entries = entries_from_spec(spec, a.ndim) if spec is not None else \
                    (None,) * a.ndim
            t = make(a, entries) if make is not None else a.view_as(a)
            if sizes is None and make is not None:  # example=: balanced global shapes
                sizes = flow.example_sizes(a.shape, entries, self.mesh)
            set_tag(t, self.mesh, entries, sizes=sizes if any(entries) else None)
            if make is None:
                flow.input_sizes(self.mesh, a, t)
            return t
        return (tuple(one(a, i) for i, a in enumerate(args)),
                {k: one(v, None, k) for k, v in kwargs.items()})

    # -- plans ---------------------------------------------------------------------------------

    def is_opaque(self, m: torch.nn.Module) -> bool:
        """A layer convert does not look into: its state is its own business too."""
        return isinstance(m, self.allow_types + self.opaque + (_Sharded,))

    def shared_by_threads(self) -> bool:
        """Every rank of the mesh runs the model's one set of layers (rank threads)."""
        return self.mesh.backend == "threads" and self.mesh.size > 1

    def plan(self, module: torch.nn.Module, args: tuple, kwargs: dict,
             shapes: Callable[[torch.Tensor, tuple], list[int]], *,
             global_sizes: bool = False, name: str | None = None) -> Plan:
        """Run a planning copy of ``module`` (``state.planning_copy``: the forward's side
        effects land there) on meta stand-ins of tagged ``args`` (sizes from ``shapes``;
        the global ones with ``global_sizes``).

        It runs twice: first with every split dim longer (by ``_SHIFT`` times 1, 2, 4, ...
        for its mesh axes: a ratio of two split sizes changes too), recording the plain
        numbers each torch call is given, then as the plan, refusing a number that
        changed with the sizes (``sizes.py``). Python's ``random`` (and numpy's) draw the
        same numbers in both."""
        sizes = Sizes()
        rng = _random_state()
        names = self.mesh.axis_names
        # dims split over other axes shift by other amounts: h / w changes too
        self._forward(module, args, kwargs, lambda a, e: [
            s + _SHIFT * sum(2 ** names.index(n) for n in x) if x else s
            for x, s in zip(e, shapes(a, e))], False, name, sizes)
        _random_state(rng)
        sizes.compare()
        plan = self._forward(module, args, kwargs, shapes, global_sizes, name, sizes)

        def again() -> Sizes:  # the plan's own sizes once more, from the same random state
            after, other = _random_state(), Sizes()
            _random_state(rng)
            self._forward(module, args, kwargs, shapes, global_sizes, name, other)
            _random_state(after)
            return other
        sizes.confirm(plan.entries, again)
        return plan

    def _forward(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                 shapes: Callable, global_sizes: bool, name: str | None,
                 sizes: Sizes) -> Plan:
        name = name or self.name
        twin = state.planning_copy(module, keep=(self, self.mesh))
        before = state.snapshot(twin, self.is_opaque) if not sizes.recording else None

        def make(a, entries):
            m = torch.empty(shapes(a, entries), dtype=a.dtype, device="meta")
            return m.requires_grad_(a.requires_grad) if m.is_floating_point() else m
        margs, mkwargs = self.tag_inputs(args, kwargs, make)
        named = isinstance(self.spec, dict)
        ins = [f"input {self.params[i]!r}" if named and i < len(self.params) else f"input {i}"
               for i in range(len(margs))]
        ins = [f"{n}: {spec_of(entries_of(a, self.mesh))!r}" for n, a in zip(ins, margs)
               if isinstance(a, torch.Tensor)] + [
            f"input {k!r}: {spec_of(entries_of(a, self.mesh))!r}" for k, a in mkwargs.items()
            if isinstance(a, torch.Tensor)]
        plan = Plan(self.name, ins or ["no tensor inputs"], global_sizes=global_sizes)
        run = _Run(self, planning=True, plan=plan, sizes=sizes)
        plan.layouts = [(f"input {i}", flow.describe(flow.layout(run, a)))
                        for i, a in enumerate(margs)
                        if isinstance(a, torch.Tensor) and any(entries_of(a, self.mesh))]
        run.start()
        try:
            # an activation checkpoint's saved-tensor hooks (a plan made in its recompute)
            # must not see the plan's meta tensors
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                out = twin(*margs, **mkwargs)
            sizes.finished |= sizes.recording
            problem = sizes.end(run)
            if problem:
                plan.entries.append(_Entry("refused", f"in {plan.model}", "the forward",
                                           problem))
                sizes.found.append((len(sizes.mine), plan.entries[-1]))
        except SpecError as e:
            if not getattr(e, "plan_stop", False) and not sizes.recording:
                raise  # a convert error (an spmd call in the forward, a spec too long)
            plan.incomplete = (f"{run.where()}: a layer not looked into runs spmd's own "
                               f"functions, which a plan does not")
            out = None
        except Exception as e:  # noqa: BLE001 - data-dependent code cannot run on meta
            plan.incomplete = f"{type(e).__name__}: {e} ({run.where()})"
            out = None
        finally:
            run.stop()
        if sizes.recording:
            return plan
        for t in _flat((out,), {}):
            if isinstance(t, torch.Tensor):
                tag = tag_of(t)
                plan.outputs.append("refused" if tag is not None and tag.poisoned else
                                    repr(spec_of(entries_of(t, self.mesh))))
        plan.changes = state.changes(before, name)
        if self.shared_by_threads() and state.thread_local(plan.changes) and \
                not plan.incomplete:
            plan.thread_local = True  # each rank thread its own copies, committed once
            plan.entries += recomputed_state(run.regions, plan.changes)
        elif self.shared_by_threads():
            for c in plan.changes:
                plan.entries.append(_Entry("refused", f"in {c.path}", f"self.{c.attr}",
                                           state.shared_state_problem(c, self.mesh)))
            if plan.changes:
                plan.notes.append(state.SHARED_STATE_FIX)
        return plan

    def planned(self, module: torch.nn.Module, path: str, args: tuple, kwargs: dict) -> Plan:
        """The plan for this input signature (made once, the same on every rank: split
        dims take a stand-in size, the others their own)."""
        key = (path, module.training, tuple(
            (a.ndim, a.dtype, tuple(None if e else s for e, s in
                                    zip(entries_of(a, self.mesh), a.shape)),
             flow.sizes_of(a, self.mesh))
            if isinstance(a, torch.Tensor) else type(a) for a in _flat(args, kwargs)))
        with self._lock:
            plan = self.plans.get(key)
            if plan is None:
                plan = self.plan(module, args, kwargs,
                                 lambda a, e: [_CANONICAL if x else s for x, s in zip(e, a.shape)],
                                 name=path.strip("'"))
                self.plans[key] = plan
                if "spmd_plan" in vars(module):  # the model's own: its latest plan
                    module.spmd_plan = plan
        return plan


class _Frame:
    __slots__ = ("module", "run", "path", "suspended", "entries", "watch")

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.run: _Run | None = None  # set where this call entered the interpreter
        self.path = False
        self.suspended = False
        self.entries: tuple | None = None
        self.watch: tuple | None = None  # (name, snapshot, why) of layers rank threads share


def _refuse_compile() -> None:
    raise SpecError(
        "convert: torch.compile cannot trace a model made by spmd.nn.convert (its forward "
        "follows torch calls with a TorchFunctionMode): compile a body built from spmd.nn "
        "layers or spmd.ops instead, or call the converted model outside the compiled "
        "function")


class Enter:
    """Forward pre-hook of every module of a converted model."""

    def __init__(self, cfg: Config, path: str, opaque: bool):
        self.cfg, self.path, self.opaque = cfg, path, opaque

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling():
            torch.compiler.disable(_refuse_compile)()  # raised at run time, on every rank
        frames = _state()
        frame = _Frame(module)
        frames.append(frame)  # first: the exit hook pops it even if what follows raises
        run = _current()
        if run is not None and run.in_backward:
            clean()  # a run left by a node that failed in backward is no longer current
            run = _current()
        if run is not None:
            run.internal += 1
            try:
                return self._inside(run, frame, module, args, kwargs)
            finally:
                run.internal -= 1
        return self._enter(frame, module, args, kwargs)

    def _enter(self, frame: _Frame, module: torch.nn.Module, args: tuple, kwargs: dict):
        """A call from outside any converted forward: tag the inputs, check the plan, run."""
        args, kwargs = self.cfg.tag_inputs(args, kwargs)
        plan = self.cfg.planned(module, self.path, args, kwargs)
        if plan.refused:
            raise plan.error()
        late_hooks(module, self.path)  # registered after the plan was made
        if self.cfg.strict and plan.incomplete:
            raise SpecError(f"convert(strict=True): the plan of {plan.model}'s forward stops "
                            f"short: {plan.incomplete}")
        for a in _flat(args, kwargs):  # sizes no mark gave: one exchange, after the plan
            if isinstance(a, torch.Tensor):
                flow.input_sizes(self.cfg.mesh, a, a, exchange=True)
        if plan.incomplete and self.cfg.shared_by_threads():
            # what the plan did not see of the forward may change the shared layers: look
            name = self.path.strip("'")
            frame.watch = (name, state.snapshot(module, self.cfg.is_opaque), plan.incomplete)
        run = _Run(self.cfg, planning=False)
        # a forward that changes its own state (a step counter, a first-call set-up) may
        # take another path on a later call than in its plan: its steps are not checked
        run.expected = None if plan.changes else plan
        if plan.thread_local:
            run.views = state.Views(module, plan.changes)
        run.start()
        frame.run = run
        run.internal += 1
        try:
            return self._inside(run, frame, module, args, kwargs)
        finally:
            run.internal -= 1

    def _inside(self, run: _Run, frame: _Frame, module: torch.nn.Module, args: tuple,
                kwargs: dict):
        if run.suspended:
            return args, kwargs
        run.paths.append(self.path)
        frame.path = True
        if run.plan is not None and backward_hooks_problem(module):
            run.plan.entries.append(_Entry("refused", f"in {self.path}", type(module).__name__,
                                           backward_hooks_problem(module)))
        if isinstance(module, _CONV_TRANSPOSE):
            args, kwargs = _global_output_size(run, module, args, kwargs)
        if isinstance(module, _Sharded) and not run.planning:
            _check_twin_spec(run, module, args, kwargs)
        if self.opaque:
            first = next((a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)), None)
            frame.entries = None if first is None else (first.ndim, run.entries(first))
            frame.suspended = True
            run.suspend()
            if run.plan is not None:
                run.plan.entries.append(_Entry("allowed", run.where(), type(module).__name__,
                                               "(not looked into)"))
            steps.step(run, "allowed", type(module).__name__)
        return args, kwargs


class Exit:
    """Forward hook (always called) of every module of a converted model."""

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any):
        frames = _state()
        if not frames or frames[-1].module is not module:
            return None
        frame = frames.pop()
        run = _current()
        if run is not None:
            run.internal += 1
            try:
                self._leave(run, frame, output)
            finally:
                run.internal -= 1
        if frame.run is not None:
            failed = sys.exc_info()[1] if output is None else None
            try:
                if failed is None:
                    steps.finished(frame.run)
            except SpecError as e:
                failed = e
                raise
            finally:
                frame.run.stop()
                if failed is not None:
                    steps.leave(frame.run, failed)
            if frame.run.views is not None and not (output is None and sys.exc_info()[0]):
                state.commit(frame.run)
        if frame.watch is not None:
            state.check_unplanned(frame.watch, frame.run.mesh)
        return None

    def _leave(self, run: _Run, frame: _Frame, output: Any) -> None:
        if frame.suspended:  # a layer not looked into: its outputs are split like its input
            run.resume()
            if frame.entries is not None and output is not None:
                ndim, e = frame.entries
                for t in _flat((output,), {}):
                    if isinstance(t, torch.Tensor):
                        set_tag(t, run.mesh, e if t.ndim == ndim else (None,) * t.ndim)
        if frame.path:
            if run.plan is not None and output is not None:
                for t in _flat((output,), {}):
                    if isinstance(t, torch.Tensor) and any(run.entries(t)):
                        run.plan.layouts.append((run.where().split(" (")[0][3:],
                                                 flow.describe(flow.layout(run, t))))
            run.paths.pop()


_CONV_TRANSPOSE = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def _global_output_size(run: _Run, m: torch.nn.Module, args: tuple, kwargs: dict):
    """``ConvTranspose(x, output_size)``: torch derives ``output_padding`` from the input's
    size, which on a shard is this rank's. Give the layer the ``output_size`` that makes
    it derive, from its shard, the ``output_padding`` of the global input."""
    size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
    x = args[0] if args else kwargs.get("input")
    n = len(m.kernel_size)
    if size is None or not isinstance(x, torch.Tensor):
        return args, kwargs
    e = run.entries(x)
    if not any(e[x.ndim - n:]):
        return args, kwargs
    if run.planning:
        shape = tuple(x.shape)
    else:  # the global input size: one small exchange, made by every rank of the layer
        prev = _context.set_converting(False)
        try:
            shape = input_layout(x, run.mesh, spec_of(e), f"ConvTranspose{n}d")[1].shape
        finally:
            _context.set_converting(prev)
    whole = torch.empty(shape, device="meta")
    pad = m._output_padding(whole, [int(v) for v in size], m.stride, m.padding, m.kernel_size,
                            n, m.dilation)
    local = [(int(x.shape[x.ndim - n + d]) - 1) * m.stride[d] - 2 * m.padding[d] +
             m.dilation[d] * (m.kernel_size[d] - 1) + 1 + int(pad[d]) for d in range(n)]
    if "output_size" in kwargs:
        return args, {**kwargs, "output_size": local}
    return (args[0], local) + tuple(args[2:]), kwargs


def _check_twin_spec(run: _Run, m: Any, args: tuple, kwargs: dict) -> None:
    """An ``spmd.nn`` layer in a converted model runs with its own spec: it must be how
    its input is split."""
    x = next((a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)), None)
    if x is None or not isinstance(m.spec, P):
        return
    have = spec_of(run.entries(x))
    want = spec_of(entries_from_spec(m.spec, x.ndim))
    if have != want:
        raise SpecError(f"convert: {run.where()}: the spmd.nn layer {type(m).__name__} has "
                        f"spec={m.spec!r}, but its input is split as {have!r} here; build it "
                        f"with that spec, or use the torch layer and let convert follow it")


def install(model: torch.nn.Module, cfg: Config,
            opaque: Callable[[torch.nn.Module], bool]) -> None:
    """Put the hooks on every module of ``model`` (a module reached twice, once)."""
    seen: set[int] = set()
    for path, m in model.named_modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        m.register_forward_pre_hook(Enter(cfg, f"'{path}'" if path else cfg.name, opaque(m)),
                                    with_kwargs=True)
        m.register_forward_hook(Exit(), always_call=True)


def example_shapes(example: Any) -> list[Sequence[int]]:
    """``example`` (a tensor, a shape, or a tuple of them) as a list of global shapes."""
    if isinstance(example, torch.Tensor) or is_shape(example):
        example = (example,)
    out = []
    for ex in example:
        if isinstance(ex, torch.Tensor):
            out.append(tuple(ex.shape))
        elif is_shape(ex):
            out.append(tuple(int(v) for v in ex))
        else:
            raise TypeError(f"convert: example must be a tensor, a shape (tuple of ints) or a "
                            f"tuple of them, got {type(ex).__name__}")
    return out


def is_shape(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in x)



def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _random_state(state: tuple | None = None) -> tuple | None:
    """Python's (and numpy's, where loaded) random state; with ``state``, set it back."""
    np = sys.modules.get("numpy")
    if state is None:
        return random.getstate(), np.random.get_state() if np is not None else None
    random.setstate(state[0])
    if state[1] is not None:
        np.random.set_state(state[1])
    return None
