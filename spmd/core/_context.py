"""Which mesh and rank the calling code runs as.

A thread-local stack: shard_map and spmd.launch push (mesh, rank) on each rank thread;
``with mesh:`` pushes a torch mesh in a process. Backward rules capture the context at
forward time, because autograd may run backward on another thread (e.g. CUDA's).
Bookkeeping only: nothing here communicates.
"""
from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, NamedTuple

import torch

from ._bodies import NO_TRACE, bodies
from ._local import RankLocal
from .errors import SpecError

if TYPE_CHECKING:
    from .mesh import Mesh

_local = RankLocal()
# the rank stack, read at every collective: a context variable of its own (as RankLocal
# keeps its attributes), read in one call
_stack: contextvars.ContextVar[list] = contextvars.ContextVar("spmd_rank_stack")


class RankContext(NamedTuple):
    mesh: Mesh
    rank: int

    def __enter__(self) -> RankContext:
        push(self.mesh, self.rank)
        return self

    def __exit__(self, *exc) -> None:
        pop()


def rank_stack() -> list:
    """The (mesh, rank) contexts this thread (or rank greenlet) runs in, innermost last."""
    s = _stack.get(None)
    if s is None:
        s = []
        _stack.set(s)
    return s


def push(mesh: Mesh, rank: int | None) -> None:
    rank_stack().append((mesh, rank))


def pop() -> None:
    rank_stack().pop()


def _torch_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def converting() -> bool | str:
    """Whether this thread runs the forward of a model made by ``spmd.nn.convert``
    (``"plan"``: its plan, on meta tensors, inside a layer convert does not look into)."""
    return _local.get("converting", False)


def set_converting(flag: bool | str) -> bool | str:
    """Set ``converting()`` (the layout interpreter does, around a converted forward);
    returns the previous value."""
    prev = _local.get("converting", False)
    _local.converting = flag
    return prev


def current(what: str = "this call") -> RankContext:
    """The innermost (mesh, rank); raises a clear error outside any rank context.

    Under ``torch.compile`` it is a graph break: the rank is this thread's, so dynamo
    must not bake the one of the thread that traced into a graph other ranks reuse; the
    resumed code guards on it instead. (spmd's own functions never get here under
    compile: ``collectives.compiled`` makes them opaque ops.)
    """
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_current)(what)
    return _current(what)


def _current(what: str) -> RankContext:
    flag = _local.get("converting", False)
    if flag:
        # convert follows the torch calls of the forward; an spmd function inside it
        # moves data convert cannot see (a psum of a value convert already reduced).
        err = SpecError(
            f"convert: {what} is called inside the forward of a model made by "
            f"spmd.nn.convert, which follows torch calls only; call spmd functions outside "
            f"the converted model (in the shard_map body around it), or leave the layer "
            f"that calls them out with allow=(ThatLayer,)")
        err.plan_stop = flag == "plan"  # a plan reached a layer it does not look into
        raise err
    s = rank_stack()
    if not s:
        if _local.get("one_pass", False):
            raise one_pass_error(what)
        raise SpecError(
            f"{what} needs a mesh: call it inside spmd.shard_map, inside a function run by "
            f"spmd.launch, or in a torch process within `with mesh:`")
    mesh, rank = s[-1]
    if rank is None:
        rank = _torch_rank() if mesh.backend == "torch" else _no_rank(mesh, what)
    return RankContext(mesh, rank)


class one_pass:
    """Around a shard_map backward that runs as one pass over every rank (the forward
    ran on rank greenlets): spmd code called there outside a custom_vjp rule gets
    ``one_pass_error``."""

    def __enter__(self) -> None:
        self._prev = _local.get("one_pass", False)
        _local.one_pass = True

    def __exit__(self, *exc) -> None:
        _local.one_pass = self._prev


def one_pass_error(what: str) -> SpecError:
    return SpecError(
        f"{what}: called in the backward of a shard_map that ran on rank greenlets, outside "
        f"a spmd.custom_vjp rule (by a torch.autograd.Function or a hook that communicates); "
        f"that backward is one pass over all ranks, where only custom_vjp rules meet the "
        f"other ranks: write the rule with spmd.custom_vjp, or run this shard_map on "
        f"Mesh(..., schedule='threads')")


def _no_rank(mesh: Mesh, what: str) -> int:
    raise SpecError(
        f"{what}: {mesh!r} is a threads mesh, and this code is not running on one of its "
        f"rank threads; use spmd.shard_map(...) or spmd.launch(...) to run per-rank code")


def on_mesh(mesh: Mesh, what: str, x: object = None, *, tensor: bool = True) -> RankContext:
    """The rank context of a transform called as ``what(x, mesh, ...)`` in per-rank code:
    checks that ``x`` is a tensor (when ``tensor``) and that ``mesh`` is the one running."""
    if tensor and not isinstance(x, torch.Tensor):
        from ._format import describe
        raise TypeError(f"{what}: expected a tensor, got {describe(x)}")
    if isinstance(x, torch.Tensor):
        refuse_sparse(x, what)
    rc = current(what)
    if rc.mesh is not mesh:
        hint = ("; they are different Mesh objects of the same shape: pass the mesh this "
                "code runs on (the one shard_map's body closes over, or the one spmd.launch "
                "passes to fn)") if repr(mesh) == repr(rc.mesh) else ""
        raise SpecError(f"{what}: called with {mesh!r} but this code runs on {rc.mesh!r}{hint}")
    return rc


def refuse_sparse(x: torch.Tensor, what: str) -> None:
    """A sparse (or otherwise non-strided) tensor fails deep inside aten in slicing and
    communication; say so at the door."""
    if x.layout != torch.strided:
        raise TypeError(f"{what}: x is a sparse tensor ({x.layout}); collectives and spmd ops "
                        f"take dense tensors: pass x.to_dense()")


def current_rank(mesh: Mesh) -> int:
    for m, r in reversed(rank_stack()):
        if m is mesh and r is not None:
            return r
    if mesh.backend == "torch":
        return _torch_rank()
    return _no_rank(mesh, "mesh.rank")


def in_rank_of(mesh: Mesh) -> bool:
    """Whether the calling thread is a rank of ``mesh`` (per-rank code)."""
    if mesh.backend == "torch":
        return True
    return any(m is mesh and r is not None for m, r in rank_stack())


# -- static layouts: size exchanges a shard_map body already made ----------------------

class LayoutTrace:
    """What the size exchanges of one call of a shard_map body learnt, in call order.

    A layer given a ``P`` learns its input's uneven sizes from every rank's local shape
    (an int64 all_gather: on NCCL, a host synchronisation per layer per step). Every rank
    runs the same body on the same global input layouts, so the n-th exchange of a call
    learns the same value on every rank as the n-th exchange of the previous call with
    those input layouts. shard_map keeps each call's list and hands it to the next: an
    exchange whose ``key`` (what it is and its spec, rank-independent) matches the entry
    at its position takes the value without communicating. Every rank decides alike
    from rank-independent facts; a key that differs (control flow changed) ends the
    reuse for the rest of the call on every rank alike. The caller checks the value
    against its own local shape and raises where it disagrees (the body's shapes
    depend on something the input layouts do not show).
    """

    __slots__ = ("mesh", "cached", "recorded", "pos", "broken")

    def __init__(self, mesh: Mesh, cached: list | None):
        self.mesh, self.cached = mesh, cached
        self.recorded: list = []
        self.pos, self.broken = 0, False

    def take(self, key: object) -> object | None:
        """The value the exchange at this position learnt last time, or None."""
        i = self.pos
        self.pos += 1
        if self.broken or self.cached is None or i >= len(self.cached):
            return None
        k, v = self.cached[i]
        if k != key:
            self.broken = True
            return None
        return v

    def put(self, key: object, value: object) -> None:
        """Record this position's value (taken or exchanged)."""
        self.recorded.append((key, value))


def current_trace(mesh: Mesh) -> LayoutTrace | None:
    """The innermost traced shard_map body's trace on ``mesh`` running on this thread,
    if any (made at the body's first size exchange)."""
    for b in reversed(bodies()):
        if b.mesh is mesh and b.cached is not NO_TRACE:
            if b.trace is None:
                b.trace = LayoutTrace(mesh, b.cached)
            return b.trace
    return None


def static_mismatch(what: str, got: object, want: object, rank: int) -> SpecError:
    """The error of a rank whose shape differs from what the previous call learnt."""
    return SpecError(
        f"{what}: x is {got} on rank {rank}, but the previous call of this shard_map body "
        f"with the same input layouts had {want} there; the body's shapes depend on "
        f"something its inputs do not show (data, a changed closure): pass spec= a Layout "
        f"there, or shard_map(..., static_layouts=False)")


def static_layout(mesh: Mesh, key: object, exchange, check) -> object:
    """``exchange()``'s value, or the one the same exchange learnt in the previous call
    of this shard_map body (``check(value)`` raises if this rank's shape disagrees)."""
    tr = current_trace(mesh)
    if tr is None:
        return exchange()
    value = tr.take(key)
    if value is None:
        value = exchange()
    else:
        check(value)
    tr.put(key, value)
    return value
