"""A converted model's state (Python attributes, parameters, buffers) and its forward.

A forward is user code with side effects: a step counter, a running mean, a first-call
initialisation. Three rules keep them right:

- the plan runs on a *planning copy* of the layers (``planning_copy``): their Python state
  copied, every tensor a meta stand-in; whatever the forward changes there is thrown
  away, so one call of a converted model leaves the state one call on one device leaves;
- what the planned forward changed (``changes``) is what the real one will change. On a
  threads mesh every rank thread runs the same layers: buffers updated in place are
  updated by each rank thread on its own copy (``Views``), and written back once with
  the value the ranks agree on (they raise, naming the buffer, where they do not);
- other changes (an attribute, a parameter, a buffer replaced) are Python-level and
  cannot be kept apart per rank thread: the plan refuses them before anything runs,
  naming the layer path and the attribute.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import comm_of
from ..core._context import current_rank
from ..core.errors import SpecError
from ..core.mesh import Mesh
from .modules import SHARDED

if TYPE_CHECKING:
    from .interpreter import _Run

__all__ = ["planning_copy", "snapshot", "changes", "Change", "Views", "thread_local",
           "shared_state_problem", "SHARED_STATE_FIX", "commit", "check_unplanned"]

# What nn.Module.__init__ puts in every layer's __dict__ (hooks, registries), less
# ``training``, which a forward that calls ``self.train()`` changes like any attribute.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_SPMD = frozenset({"spmd_plan"})
_IN_PLACE_BUFFER = "updates the buffer in place"


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(m, requires_grad=t.requires_grad)
    return m.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else m


def _tensors_in(v: Any, depth: int = 3):
    """The tensors in ``v`` and in the lists, tuples and dicts it holds (a few levels)."""
    if isinstance(v, torch.Tensor):
        yield v
    elif depth and isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors_in(x, depth - 1)
    elif depth and isinstance(v, dict):
        for x in v.values():
            yield from _tensors_in(x, depth - 1)


def planning_copy(module: nn.Module, keep: Iterable[Any] = ()) -> nn.Module:
    """A copy of ``module`` to plan on: its Python state deep-copied, its parameters,
    buffers and tensor attributes meta tensors (no memory); ``keep`` (the convert config,
    the mesh) shared, not copied.

    Raises:
        SpecError: the layers hold something ``copy.deepcopy`` cannot copy.
    """
    memo: dict[int, Any] = {id(k): k for k in keep}
    for m in module.modules():
        tensors = list(m._parameters.values()) + list(m._buffers.values()) + list(
            _tensors_in(list(vars(m).values())))
        for t in tensors:
            if t is not None and id(t) not in memo:
                memo[id(t)] = _stand_in(t)
    try:
        return copy.deepcopy(module, memo)
    except Exception as e:  # noqa: BLE001 - any attribute of a user's layer
        raise SpecError(
            f"convert: the forward is planned on a copy of {type(module).__name__} (so that "
            f"planning leaves the model as it was), and copy.deepcopy failed: "
            f"{type(e).__name__}: {e}; make the layers' attributes copyable (a __deepcopy__) "
            f"or keep the uncopyable object outside the model") from e


class Change:
    """One piece of a layer's state that a forward changed."""

    __slots__ = ("cls", "path", "rel", "attr", "what")

    def __init__(self, cls: type, path: str, rel: str, attr: str, what: str):
        self.cls, self.path, self.rel, self.attr, self.what = cls, path, rel, attr, what

    @property
    def layer(self) -> str:
        return self.cls.__name__

    @property
    def name(self) -> str:
        return f"{self.path}.{self.attr}" if self.path else self.attr

    def __repr__(self) -> str:
        return f"Change({self.name!r}: {self.what})"


def _layers(module: nn.Module, skip: Callable[[nn.Module], bool]):
    """``(path, layer)`` of ``module``'s tree, without the layers ``skip`` names (their
    state is their own business) and what is below them."""
    out, cut = [], []
    for path, m in module.named_modules():
        if any(path == c or path.startswith(c + ".") for c in cut):
            continue
        if m is not module and skip(m):
            cut.append(path)
            continue
        out.append((path, m))
    return out


class _Is:
    """An object compared by identity (what ``_freeze`` cannot look into)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Is) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _freeze(v: Any) -> Any:
    """``v`` as a value to compare later: plain data (numbers, strings, and lists, tuples
    and dicts of them) by value, so that ``self.steps += 1`` and ``self.seen.append(n)``
    show; anything else (tensors, layers, other objects) by identity."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return (type(v), v)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_freeze(x) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((_freeze(k), _freeze(x)) for k, x in v.items()))
    return _Is(v)


def _attrs(m: nn.Module) -> dict:
    return {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS and k not in _SPMD}


def snapshot(module: nn.Module, skip: Callable[[nn.Module], bool]) -> dict:
    """The state of ``module``'s layers, to compare with ``changes`` after a forward."""
    out = {}
    for path, m in _layers(module, skip):
        attrs = {k: _freeze(v) for k, v in _attrs(m).items()}
        tensors = {k: (t, None if t is None else t._version)
                   for k, t in list(m._parameters.items()) + list(m._buffers.items())}
        out[path] = (m, attrs, tensors)
    return out


def changes(before: dict, name: str) -> list[Change]:
    """What changed in the layers of ``before`` (a ``snapshot``) since it was taken;
    ``name`` names the top layer in messages."""
    out = []
    for path, (m, attrs, tensors) in before.items():
        layer = type(m)
        where = f"{name}.{path}" if path else name
        now = _attrs(m)
        for k, val in attrs.items():
            if k not in now:
                out.append(Change(layer, where, path, k, "deletes the attribute"))
            elif _freeze(now[k]) != val:
                out.append(Change(layer, where, path, k,
                                  f"changes the attribute ({_kind(now[k])})"))
        for k in now.keys() - attrs.keys():
            out.append(Change(layer, where, path, k, f"sets a new attribute ({_kind(now[k])})"))
        cur = dict(list(m._parameters.items()) + list(m._buffers.items()))
        for k, (t, version) in tensors.items():
            kind = "parameter" if k in m._parameters else "buffer"
            if cur.get(k) is not t:
                out.append(Change(layer, where, path, k, f"replaces the {kind}"))
            elif t is not None and t._version != version:
                what = _IN_PLACE_BUFFER if kind == "buffer" else "updates the parameter in place"
                out.append(Change(layer, where, path, k, what))
        for k in cur.keys() - tensors.keys():
            out.append(Change(layer, where, path, k, "registers a new parameter or buffer"))
    return out


def shared_state_problem(c: Change, mesh: Mesh) -> str:
    """Why a change of a layer's state in forward is refused on rank threads (and the
    twin that makes it once, where there is one; ``SHARED_STATE_FIX`` says the rest)."""
    twin = SHARDED.get(c.cls)
    return (f"{c.what} in forward, which each of the {mesh.size} rank threads would do to "
            f"the one {c.layer} they share" +
            (f"; swap in the twin, which does it once: types={{nn.{c.layer}: "
             f"spmd.nn.{twin.__name__}}}" if twin is not None else ""))


SHARED_STATE_FIX = ("(a threads mesh runs every rank's forward on the one model: run on "
                    "processes, each rank with its own copy (spmd.launch(..., backend='gloo') "
                    "or torchrun), or make these updates outside forward, once per call)")


def _kind(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return "a tensor"
    return f"{type(v).__name__}"


# -- rank threads: each its own copy of the buffers a forward updates in place --------------


def thread_local(changes: list[Change]) -> bool:
    """Whether rank threads can make these changes exactly: each updates its own copy of
    the buffers, and one agreed value is written back (``Views``). Attributes, parameters
    and replaced buffers are Python-level and shared: not these."""
    return bool(changes) and all(c.what == _IN_PLACE_BUFFER for c in changes)


class Views:
    """This rank thread's copies of the buffers its forward updates in place.

    Every torch call of the forward gets the copy where it names the buffer (and an
    in-place call on the copy returns the buffer, so that ``self.n += 1`` rebinds
    nothing); after the forward the ranks compare their copies and the buffers take
    the value they agree on, once (``commit``).
    """

    def __init__(self, module: nn.Module, changes: list[Change]):
        self.labels: dict[int, str] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.copies: dict[int, torch.Tensor] = {}
        self.back: dict[int, torch.Tensor] = {}
        for c in changes:
            t = module.get_submodule(c.rel)._buffers[c.attr]
            if t is None or id(t) in self.buffers:
                continue
            copy_ = t.detach().clone()
            self.labels[id(t)] = f"{c.path}.{c.attr}"
            self.buffers[id(t)], self.copies[id(t)], self.back[id(copy_)] = t, copy_, t

    def swap(self, a: Any) -> Any:
        """``a`` (an argument of a torch call) with the buffers replaced by the copies."""
        if isinstance(a, torch.Tensor):
            return self.copies.get(id(a), a)
        if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            return type(a)(self.swap(v) for v in a)
        return a

    def holds(self, t: Any) -> bool:
        """Whether ``t`` is one of this rank thread's copies."""
        return isinstance(t, torch.Tensor) and id(t) in self.back

    def unswap(self, res: Any) -> Any:
        """A call's result with the copies given back as their buffers."""
        return self.back.get(id(res), res) if isinstance(res, torch.Tensor) else res

    def commit(self, mesh: Mesh, rank: int, board: dict, call: int,
               barrier: Callable[[], None]) -> None:
        """After every rank's forward: the same copies everywhere, written back once
        (by rank 0, between two barriers), or a SpecError on every rank naming the
        buffers where the ranks differ."""
        key = (call, rank)
        board[key] = self.copies
        try:
            barrier()
            copies = [board.get((call, r)) for r in range(mesh.size)]
            differ = [self.labels[k] for k in self.copies
                      if any(c is None or k not in c or not _same(c[k], copies[0][k])
                             for c in copies)]
            if not differ and rank == 0:
                with torch.no_grad():
                    for k, t in self.buffers.items():
                        t.copy_(copies[0][k])
            barrier()
        finally:
            board.pop(key, None)
        if differ:
            raise SpecError(
                f"convert: after the forward, the rank threads' copies of "
                f"{', '.join(differ)} differ (the forward updates the buffer in place with "
                f"values of the rank's own shard); one model shared by the rank threads "
                f"can hold one value: update it from values every rank agrees on (a mean "
                f"over the split dims), or run on processes (spmd.launch(..., "
                f"backend='gloo') or torchrun), each rank with its own copy")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN where the other has NaN too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def commit(run: _Run) -> None:
    """Rank threads after a forward that updates buffers in place: the buffers take the
    value of the ranks' copies once, where they agree (``Views.commit``)."""
    cfg, mesh = run.cfg, run.mesh
    rank = current_rank(mesh)
    call = cfg.calls[rank] = cfg.calls[rank] + 1  # each rank thread counts its own calls
    comm, group = comm_of(mesh), mesh.group(mesh.axis_names)
    run.views.commit(mesh, rank, cfg.board, call,
                     lambda: comm.barrier(group, name="convert: buffers updated in forward"))


def check_unplanned(watch: tuple, mesh: Mesh) -> None:
    """After a forward whose plan stopped short on rank threads: raise if it changed the
    layers' state (after the fact, but not silently)."""
    name, before, why = watch
    found = changes(before, name)
    if found:
        lines = [f"convert: {name}'s forward changed the state of layers that the rank "
                 f"threads share, where its plan (made before the first call) could not see "
                 f"it ({why}); the state is now wrong:"]
        lines += [f"  - in {c.path}: self.{c.attr} {shared_state_problem(c, mesh)}"
                  for c in found[:8]]
        if len(found) > 8:
            lines.append(f"  ... and {len(found) - 8} more: "
                         f"{', '.join(c.path + '.' + c.attr for c in found[8:])}"[:300])
        lines.append(SHARED_STATE_FIX)
        raise SpecError("\n".join(lines))
