"""The threads backend: every rank is a thread of this process.

All collectives rest on one rendezvous, ``exchange``: each member deposits a payload
for the k-th collective of its group and waits (with a timeout) until all have; then
each computes its own result from all payloads. Since every rank sees every payload,
mismatched ops, shapes and dtypes are caught exactly and reported on every rank, and a
timeout names exactly the ranks that did not arrive. Results never alias another rank's
tensors (a real transport copies too).

``exchange`` is two halves, ``_arrive`` (deposit; the last member computes) and
``_collect`` (wait for the result): ``all_reduce_async`` deposits and returns, and its
``wait()`` collects.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..core._local import RankLocal
from ..core._context import one_pass_error
from ..core._format import describe, shape_str
from ..core.errors import CommAborted, CommError, CommTimeout, SpecError
from ..core.mesh import Group, Mesh
from .base import REDUCE_OPS, Pending, check_scatter
from .stats import count

__all__ = ["ThreadComm"]


class _Slot:
    __slots__ = ("op", "data", "arrived", "reads", "error", "cond", "result", "done", "nodes")

    def __init__(self, n: int, op: str, lock: threading.Lock | None):
        self.op = op
        self.data: list[Any] = [None] * n
        self.arrived = [False] * n
        self.reads = 0
        self.error: BaseException | None = None
        # rank greenlets wait in the scheduler, never on a condition
        self.cond = None if lock is None else threading.Condition(lock)
        self.result: Any = None
        self.done = False
        self.nodes: dict[int, Callable] | None = None  # member index -> node builder

    def notify(self) -> None:
        if self.cond is not None:
            self.cond.notify_all()


class Outputs:
    """Every member's result of one collective, made once by the last to arrive (the
    outputs of a mesh-wide autograd node, ``exchange(node=...)``): a member that asked
    for the node gets its output, any other ``rest(index, device)`` (a private copy)."""

    __slots__ = ("mine", "rest")

    def __init__(self, mine: dict[int, torch.Tensor],
                 rest: Callable[[int, torch.device], Any]):
        self.mine, self.rest = mine, rest

    def take(self, index: int, device: torch.device) -> Any:
        t = self.mine.get(index)
        return self.rest(index, device) if t is None else t


# Which run of which comm the calling rank thread belongs to (set by rank_threads), and
# on rank greenlets (rank_greenlets) ``.green``, their run.
_tls = RankLocal()


def per_rank_backward() -> None:
    """Called on a rank greenlet whose forward installs backward code that communicates
    outside ``spmd.custom_vjp`` rules (a converted model's checkpoint recomputes and
    tensor hooks): the shard_map's backward then runs each rank's on its own thread
    instead of one pass over all ranks."""
    run = _tls.get("green")
    if run is None or run.per_rank_backward:
        return
    if run.nodes:
        raise SpecError(
            "a model made by spmd.nn.convert whose forward leaves code to backward (an "
            "activation checkpoint's recompute, a tensor hook) runs in a shard_map body on "
            "rank greenlets after spmd collectives that need gradients: its backward runs "
            "per rank, theirs as one pass over all ranks, and one call cannot do both; run "
            "this shard_map on Mesh(..., schedule='threads'), or call the converted model "
            "first")
    run.per_rank_backward = True


def in_rank_greenlet() -> bool:
    """Whether the calling code runs as a rank greenlet of the simulated mesh, where
    ``spmd.custom_vjp`` rules are one autograd node over every rank."""
    return _tls.get("green") is not None


class ThreadComm:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._lock = threading.Lock()
        self._slots: dict[tuple, _Slot] = {}
        self._seq: dict[tuple, int] = {}
        self._aborted: BaseException | None = None
        self._aborted_rank: int | None = None
        # One per-rank program runs at a time (calls from several threads take turns);
        # each run has a generation, and a rank thread left over from an earlier run
        # (abandoned after a timeout) is refused before it touches the current run.
        self.run_lock = threading.Lock()
        self.generation = 0
        self.one_pass = False  # a shard_map backward runs as one pass over all ranks

    def begin(self) -> int:
        """Start a run (holding ``run_lock``): fresh rendezvous state, a new generation.
        Ranks of an abandoned run still waiting in a collective are cancelled."""
        with self._lock:
            for slot in self._slots.values():
                if not slot.done and slot.error is None:
                    slot.error = CommAborted(f"{slot.op}: cancelled, its per-rank program "
                                             f"on {self.mesh!r} was abandoned")
                slot.notify()
            self._slots.clear()
            self._seq.clear()
            self._aborted, self._aborted_rank = None, None
            self.generation += 1
            return self.generation

    def _stale(self, name: str, group: Group) -> None:
        if self.one_pass and _tls.get("green") is None:
            raise one_pass_error(f"{name} on rank {group.rank}")
        run = _tls.get("run")
        if run is not None and run[0] is self and run[1] != self.generation:
            raise CommAborted(f"{name} on rank {group.rank}: this rank belongs to a per-rank "
                              f"program on {self.mesh!r} that was abandoned (it ran past "
                              f"its timeout or another rank failed)")

    # -- the rendezvous -------------------------------------------------------------

    def exchange(self, group: Group, op: str, payload: Any, *, name: str,
                 combine: Callable[[list[Any]], Any] | None = None,
                 node: Callable | None = None) -> Any:
        """Deposit ``payload``; return ``combine(payloads)`` (default: the list of every
        member's payload, in group order).

        ``combine`` runs once, on the last rank to arrive, outside the lock; what it
        raises is raised on every member. ``node`` (rank greenlets only): this member
        asks for one autograd node over the members that ask; the last to arrive calls
        ``node(payloads, combined, asking member indices)``, and every member gets what
        it returns (an ``Outputs``) instead of the combined value.
        """
        self._stale(name, group)
        if group.size == 1:
            self._next_seq(group)
            got = combine([payload]) if combine is not None else [payload]
            return got if node is None else node([payload], got, [0])
        return self._collect(group, self._arrive(group, op, payload, name, combine, node),
                             name)

    def _next_seq(self, group: Group) -> int:
        sk = ((group.axes, group.ranks, group.channel), group.rank)
        seq = self._seq.get(sk, 0)
        self._seq[sk] = seq + 1  # only this rank's thread touches its own counter
        return seq

    def _arrive(self, group: Group, op: str, payload: Any, name: str,
                combine: Callable[[list[Any]], Any] | None,
                node: Callable | None = None) -> tuple[tuple, _Slot]:
        """Deposit this member's payload without waiting (the first half of exchange)."""
        key = (group.axes, group.ranks, group.channel)
        seq = self._next_seq(group)
        n = group.size
        with self._lock:
            if self._aborted is not None:
                raise self._cancelled(name, group)
            slot = self._slots.get((key, seq))
            if slot is None:
                slot = self._slots[(key, seq)] = _Slot(
                    n, op, None if _tls.get("green") is not None else self._lock)
            elif slot.op != op and slot.error is None:
                first = next(group.ranks[i] for i, a in enumerate(slot.arrived) if a)
                slot.error = CommError(
                    f"{name}: collective mismatch over {_axes(group)}: rank {group.rank} "
                    f"called {op} while rank {first} called {slot.op} (call #{seq} on this "
                    f"group); every rank must run the same collectives in the same order")
                slot.notify()
            slot.data[group.index] = payload
            slot.arrived[group.index] = True
            if node is not None:
                if slot.nodes is None:
                    slot.nodes = {}
                slot.nodes[group.index] = node
            last = all(slot.arrived) and slot.error is None
        if last:
            try:
                result = combine(slot.data) if combine is not None else slot.data
                if slot.nodes:
                    result = next(iter(slot.nodes.values()))(slot.data, result,
                                                             sorted(slot.nodes))
            except Exception as e:  # noqa: BLE001 - raised on every member below
                slot.error = e
                result = None
            with self._lock:
                slot.result, slot.done = result, True
                slot.notify()
        return (key, seq), slot

    def _collect(self, group: Group, arrival: tuple[tuple, _Slot], name: str) -> Any:
        """Wait (bounded by the timeout) until every member arrived; the result."""
        slot_key, slot = arrival
        n = group.size
        green = _tls.get("green")
        if green is not None:  # a rank greenlet: the others run while this one waits
            while not (slot.done or slot.error is not None or self._aborted is not None):
                green.block(group.rank, group, slot, name)
        with self._lock:
            if not slot.done and slot.error is None and green is None:
                if slot.cond is None:  # made by a rank greenlet (never both in one run)
                    slot.cond = threading.Condition(self._lock)
                deadline = time.monotonic() + self.mesh.timeout
                while not (slot.done or slot.error or self._aborted):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    slot.cond.wait(left)
            slot.reads += 1
            if slot.reads == n:
                self._slots.pop(slot_key, None)
            if slot.error is not None:
                e = slot.error
                raise type(e)(*e.args) if isinstance(e, CommError) else e
            if not slot.done:
                if self._aborted is not None:
                    raise self._cancelled(name, group)
                missing = tuple(r for r, a in zip(group.ranks, slot.arrived) if not a)
                raise CommTimeout(
                    f"{name} over {_axes(group)} timed out after {self.mesh.timeout:g} s on "
                    f"rank {group.rank}: ranks {list(missing)} of the group "
                    f"{list(group.ranks)} did not arrive",
                    op=name, axes=group.axes, missing=missing)
            return slot.result

    def _cancelled(self, name: str, group: Group) -> CommAborted:
        who = "another rank" if self._aborted_rank is None else f"rank {self._aborted_rank}"
        return CommAborted(f"{name} on rank {group.rank}: cancelled because {who} failed "
                           f"({self._aborted!r})", op=name, axes=group.axes,
                           missing=() if self._aborted_rank is None else (self._aborted_rank,))

    def abort(self, exc: BaseException, generation: int | None = None,
              rank: int | None = None) -> None:
        """Wake every waiting rank with ``CommAborted`` (a rank failed); only if the run
        of ``generation`` (default: any) is the current one."""
        with self._lock:
            if generation is not None and generation != self.generation:
                return  # a rank of an abandoned run failed: nothing of it is left here
            if self._aborted is None:
                self._aborted, self._aborted_rank = exc, rank
            for slot in self._slots.values():
                slot.notify()

    def leave(self, rank: int, step: int, exc: BaseException) -> None:
        """Rank ``rank`` stops (a converted model's run left its plan at ``step``): the
        run's pending and later collectives raise ``CommAborted`` naming it."""
        run = _tls.get("run")
        if run is not None and run[0] is self:
            self.abort(exc, run[1], rank)

    # -- the protocol -------------------------------------------------------------------
    # Validation and reductions run once per collective (in ``combine``); each rank
    # then takes a private copy, so no result aliases another rank's tensors.

    def all_reduce(self, x, op, group, *, name, node=None):
        # node: see exchange (a sum that is one autograd node over the group's greenlets)
        count("all_reduce", name, group, x=x)
        def combine(xs):
            _same_meta(xs, group, name)
            return _reduce(xs, op)
        got = self.exchange(group, f"all_reduce({op})", x, name=name, combine=combine,
                            node=node)
        return got.take(group.index, x.device) if isinstance(got, Outputs) else \
            _copy(got, x.device)

    def all_reduce_async(self, x, op, group, *, name):
        # Deposits and returns: only wait() blocks. The sum is computed once, in rank
        # order, by the last member to deposit, so every member gets the same bits.
        count("all_reduce_async", name, group, x=x)
        if op not in REDUCE_OPS:
            raise SpecError(f"{name}: reduction op must be one of {REDUCE_OPS}, got {op!r}")
        if not x.is_contiguous():
            raise SpecError(f"{name}: all_reduce_async reduces in place and needs a "
                            f"contiguous tensor, got {describe(x)} with strides {x.stride()}")
        def combine(xs):
            _same_meta(xs, group, name)
            return _reduce(xs, op)
        self._stale(name, group)
        if group.size == 1:
            self._next_seq(group)
            return _ThreadWork(self, group, name, x, None)
        arrival = self._arrive(group, f"all_reduce({op})", x.detach(), name, combine)
        return _ThreadWork(self, group, name, x, arrival)

    def all_gather(self, x, group, dim, *, name, sizes=None, node=None):
        # node: see exchange (the gathered tensor is one autograd node over the group)
        count("all_gather", name, group, x=x)
        def combine(xs):
            _same_meta(xs, group, name, skip_dim=dim)
            if sizes is not None:
                got = tuple(t.shape[dim] for t in xs)
                if got != tuple(sizes):
                    raise CommError(f"{name}: expected sizes {list(sizes)} along dim {dim}, "
                                    f"got {list(got)}")
            return xs
        got = self.exchange(group, f"all_gather(dim={dim}, sizes={sizes})", x, name=name,
                            combine=combine, node=node)
        if isinstance(got, Outputs):
            return got.take(group.index, x.device)
        return [_copy(t, x.device) for t in got]

    def reduce_scatter(self, chunks, op, group, *, name, node=None):
        # node: see exchange (this member's block is one autograd node over the group)
        count("reduce_scatter", name, group, chunks=chunks)
        def combine(cs):
            _same_len(cs, group, name)
            for i in range(group.size):
                _same_meta([c[i] for c in cs], group, name)
            return cs
        cs = self.exchange(group, f"reduce_scatter({op})", chunks, name=name, combine=combine,
                           node=node)
        if isinstance(cs, Outputs):
            return cs.take(group.index, chunks[group.index].device)
        return _copy(_reduce([c[group.index] for c in cs], op), chunks[group.index].device)

    def all_to_all(self, chunks, group, *, name, shapes=None):
        return self.all_to_all_async(chunks, group, name=name, shapes=shapes).wait()

    def all_to_all_async(self, chunks, group, *, name, shapes=None):
        # Deposits and returns: only wait() blocks (bounded by the timeout).
        token = count("all_to_all", name, group, chunks=chunks)

        def combine(cs):
            _same_len(cs, group, name)
            dts = {c.dtype for chunk_list in cs for c in chunk_list}
            if len(dts) > 1:
                raise CommError(f"{name} over {_axes(group)}: ranks passed blocks of dtypes "
                                f"{sorted(map(str, dts))}; every rank must pass one dtype")
            return cs
        dev = chunks[group.index].device
        self._stale(name, group)
        if group.size == 1:
            self._next_seq(group)
            combine([chunks])
            arrival = None
        else:
            arrival = self._arrive(group, "all_to_all", [c.detach() for c in chunks], name,
                                   combine)

        def finish() -> list[torch.Tensor]:
            cs = [chunks] if arrival is None else self._collect(group, arrival, name)
            got = [_copy(c[group.index], dev) for c in cs]
            if shapes is not None and [tuple(t.shape) for t in got] != \
                    [tuple(s) for s in shapes]:
                raise CommError(f"{name}: rank {group.rank} expected blocks of shapes "
                                f"{[list(s) for s in shapes]} but got "
                                f"{[list(t.shape) for t in got]}")
            return got
        return Pending(finish, token)

    def scatter(self, chunks, src, group, *, name, shape, dtype, device):
        n, me = group.size, group.index
        check_scatter(chunks, src, group, name)
        count("all_to_all", name, group, chunks=chunks if me == src else [])

        def combine(ps):
            cs = ps[src][0]
            for i, (_, shp, dt, _) in enumerate(ps):
                if tuple(cs[i].shape) != shp or cs[i].dtype != dt:
                    raise CommError(
                        f"{name} over {_axes(group)}: rank {group.ranks[i]} expected "
                        f"{shape_str(shp, dt)} from rank {group.ranks[src]} but it sends "
                        f"{describe(cs[i])}; the ranks' plans disagree (an argument that "
                        f"differs from rank to rank, e.g. sizes or spec)")
            # Copied here, before any member returns: the source may write to its tensor
            # as soon as its call returns.
            return [cs[i].detach().to(ps[i][3], copy=True, memory_format=torch.contiguous_format)
                    for i in range(n)]
        payload = (chunks if me == src else None, tuple(shape), dtype, torch.device(device))
        return self.exchange(group, f"scatter(src={src})", payload, name=name,
                             combine=combine)[me]

    def permute(self, x, group, pairs, *, name, node=None):
        # node: see exchange (the received tensor is one autograd node over the group)
        count("permute", name, group, x=x, pairs=pairs)
        def combine(xs):
            _same_meta(xs, group, name)
            return xs
        xs = self.exchange(group, f"permute({sorted(pairs)})", x, name=name, combine=combine,
                           node=node)
        if isinstance(xs, Outputs):
            return xs.take(group.index, x.device)
        src = [s for s, d in pairs if d == group.index]
        return _copy(xs[src[0]], x.device) if src else None

    def broadcast(self, x, src, group, *, name):
        count("broadcast", name, group, x=x, src=src)
        def combine(xs):
            _same_meta(xs, group, name)
            return xs[src]
        return _copy(self.exchange(group, f"broadcast(src={src})", x, name=name, combine=combine),
                     x.device)

    def barrier(self, group, *, name="barrier"):
        count("barrier", name, group)
        self.exchange(group, "barrier", None, name=name)

    def open(self, group):
        pass  # a channel is a key of the rendezvous: nothing to set up


class _ThreadWork:
    """An all_reduce_async in flight on the threads backend."""

    __slots__ = ("comm", "group", "name", "x", "arrival")

    def __init__(self, comm: ThreadComm, group: Group, name: str, x: torch.Tensor,
                 arrival: tuple | None):
        self.comm, self.group, self.name, self.x = comm, group, name, x
        self.arrival = arrival

    def wait(self) -> torch.Tensor:
        if self.arrival is not None:
            arrival, self.arrival = self.arrival, None
            result = self.comm._collect(self.group, arrival, self.name)
            with torch.no_grad():
                self.x.copy_(result)
        return self.x


def _copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.detach()
    if t.device != device:
        return t.to(device, copy=True)
    # An empty block (an all_to_all's chunk for a member that gets nothing, as most of
    # a halo exchange's are) has no data to share: a new alias is enough.
    return t if t.numel() == 0 else t.clone()


_REDUCE_INTO = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    # In rank order, once: every rank gets a bit-identical result. Accumulated in place
    # into one new tensor (a sum over 8 ranks: 2 allocations, not 8).
    fn: Callable = _REDUCE_INTO[op]
    with torch.no_grad():
        acc = xs[0].clone()
        dev = acc.device
        for t in xs[1:]:
            fn(acc, t if t.device == dev else t.to(dev), out=acc)
    return acc


def _axes(group: Group) -> str:
    return f"axis {group.axes[0]!r}" if len(group.axes) == 1 else f"axes {group.axes}"


def _same_meta(xs: list, group: Group, name: str, skip_dim: int | None = None) -> None:
    t0 = xs[0]
    for i, t in enumerate(xs[1:], 1):
        if not isinstance(t, torch.Tensor) or not isinstance(t0, torch.Tensor):
            raise CommError(f"{name}: rank {group.ranks[i]} passed {describe(t)}, rank "
                            f"{group.ranks[0]} passed {describe(t0)}; expected tensors")
        s0, s = list(t0.shape), list(t.shape)
        if skip_dim is not None and len(s0) == len(s):
            s0[skip_dim] = s[skip_dim] = -1
        if s0 != s or t.dtype != t0.dtype:
            raise CommError(
                f"{name} over {_axes(group)}: rank {group.ranks[0]} passed {describe(t0)} but "
                f"rank {group.ranks[i]} passed {describe(t)}; every rank must pass the same "
                f"dtype and shape" + (f" (except along dim {skip_dim})" if skip_dim is not None else ""))


def _same_len(cs: list, group: Group, name: str) -> None:
    for i, c in enumerate(cs):
        if len(c) != group.size:
            raise CommError(f"{name}: rank {group.ranks[i]} passed {len(c)} chunks for a "
                            f"group of {group.size}")
