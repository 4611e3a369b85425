"""Which mesh and rank the calling code runs as.

A thread-local stack: shard_map and spmd.launch push (mesh, rank) on each rank thread;
``with mesh:`` pushes a torch mesh in a process. Backward rules capture the context at
forward time, because autograd may run backward on another thread (e.g. CUDA's).
Bookkeeping only: nothing here communicates.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from .errors import SpecError

if TYPE_CHECKING:
    from .mesh import Mesh

_local = threading.local()


class RankContext(NamedTuple):
    mesh: Mesh
    rank: int

    def __enter__(self) -> RankContext:
        push(self.mesh, self.rank)
        return self

    def __exit__(self, *exc) -> None:
        pop()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def push(mesh: Mesh, rank: int | None) -> None:
    _stack().append((mesh, rank))


def pop() -> None:
    _stack().pop()


def _torch_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def converting() -> bool | str:
    """Whether this thread runs the forward of a model made by ``spmd.nn.convert``
    (``"plan"``: its plan, on meta tensors, inside a layer convert does not look into)."""
    return getattr(_local, "converting", False)


def set_converting(flag: bool | str) -> bool | str:
    """Set ``converting()`` (the layout interpreter does, around a converted forward);
    returns the previous value."""
    prev = getattr(_local, "converting", False)
    _local.converting = flag
    return prev


def current(what: str = "this call") -> RankContext:
    """The innermost (mesh, rank); raises a clear error outside any rank context."""
    flag = getattr(_local, "converting", False)
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
    s = _stack()
    if not s:
        raise SpecError(
            f"{what} needs a mesh: call it inside spmd.shard_map, inside a function run by "
            f"spmd.launch, or in a torch process within `with mesh:`")
    mesh, rank = s[-1]
    if rank is None:
        rank = _torch_rank() if mesh.backend == "torch" else _no_rank(mesh, what)
    return RankContext(mesh, rank)


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
    rc = current(what)
    if rc.mesh is not mesh:
        hint = ("; they are different Mesh objects of the same shape: pass the mesh this "
                "code runs on (the one shard_map's body closes over, or the one spmd.launch "
                "passes to fn)") if repr(mesh) == repr(rc.mesh) else ""
        raise SpecError(f"{what}: called with {mesh!r} but this code runs on {rc.mesh!r}{hint}")
    return rc


def current_rank(mesh: Mesh) -> int:
    for m, r in reversed(_stack()):
        if m is mesh and r is not None:
            return r
    if mesh.backend == "torch":
        return _torch_rank()
    return _no_rank(mesh, "mesh.rank")


def in_rank_of(mesh: Mesh) -> bool:
    """Whether the calling thread is a rank of ``mesh`` (per-rank code)."""
    if mesh.backend == "torch":
        return True
    return any(m is mesh and r is not None for m, r in _stack())
