"""Rank greenlets: run one function on every rank of a threads mesh, in the calling
thread.

Each rank is a greenlet; a rank runs until it waits in a collective, finishes or
raises, and then the next rank runs. A collective completes when its last member
arrives (``ThreadComm``'s rendezvous, unchanged), and its waiting members run again. A
switch costs well under a microsecond, against tens of microseconds for a hand-off
between OS threads (which also wait for an idle core), and nothing runs in parallel, so
each rank's torch ops get every intra-op thread.

Torch's per-thread state moves with each rank (``_torch_state``): grad and inference
mode, autocast, saved-tensor hooks, mode stacks and, with ``rng="per_rank"``, the CPU
generator. spmd's own per-rank state is in ``RankLocal`` storage, which is per greenlet.

A rank that never reaches a collective the others wait in is known at once: when no
rank can run, every waiting rank gets ``CommTimeout`` naming the ranks that did not
arrive and what they did instead (returned, failed, or wait in another collective),
without waiting for the mesh's timeout. What greenlets cannot do: run a rank while
another blocks its OS thread (a body that waits on a queue another rank fills, or on a
lock another rank holds, hangs): ``Mesh(..., schedule="threads")`` runs those ranks as
threads.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from greenlet import getcurrent, greenlet

from .. import random as _invariant
from ..core._context import rank_stack
from ..core.errors import CommAborted, CommTimeout, SpecError
from ..core.mesh import Group, Mesh
from . import comm_of
from ._torch_state import CLEAN, fresh, guards, inside_guard, put, take
from .rank_threads import caller_seed, raise_first, rank_seed, take_turn
from .threads import _axes, _tls

__all__ = ["run_on_greenlets"]

_generator = torch.default_generator


def run_on_greenlets(mesh: Mesh, fn: Callable[[int], Any], *, rank_rng: bool = False,
                     report: dict | None = None) -> list[Any]:
    """Run ``fn(rank)`` for every rank of a threads mesh as greenlets of the calling
    thread, with the rank context set; return the results in rank order.

    The first failure (a rank that raised; ranks cancelled because of it come after) is
    re-raised tagged with its rank once every rank has finished. ``rank_rng``: each
    rank draws from a generator of its own, seeded by one draw of the caller's.
    ``report``: gets ``"per_rank_backward"``, whether some rank asked for its backward
    to run on its own thread (``threads.per_rank_backward``).

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> run_on_greenlets(mesh, lambda r: r * 10)
        [0, 10, 20]
    """
    comm = comm_of(mesh)
    take_turn(comm, mesh, mesh.timeout, "run_on_greenlets")
    try:
        seed = caller_seed() if rank_rng and mesh.size > 1 else None
        run = _Run(mesh, fn, comm, range(mesh.size), seed)
        try:
            return run.run()
        finally:
            if report is not None:
                report["per_rank_backward"] = run.per_rank_backward
    finally:
        comm.run_lock.release()


def run_ranks(mesh: Mesh, ranks: Sequence[int], fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for ``ranks`` of a threads mesh as greenlets (no lock taken, no
    per-rank generators): the backward of a mesh-wide autograd node, inside a backward
    that holds the mesh (``shard_map``'s). Results in the order of ``ranks``."""
    # grad mode: off in a backward, unless it makes a graph
    return _Run(mesh, fn, comm_of(mesh), ranks, None, torch.is_grad_enabled(),
                pool="nodes").run()


class _Run:
    """One per-rank program run: the greenlets, their torch states, and the waits."""

    def __init__(self, mesh: Mesh, fn: Callable[[int], Any], comm: Any,
                 ranks: Sequence[int], seed: int | None, grad: bool = True,
                 pool: str = "runs"):
        self.mesh, self.fn, self.comm = mesh, fn, comm
        self.pool = pool
        self.ranks = list(ranks)
        self.results: dict[int, Any] = {}
        self.errors: list[tuple[float, int, BaseException]] = []
        self.per_rank_rng = seed is not None
        # A rank's state before its first turn: CLEAN, or (rank_rng) the seed of its
        # generator, an int, which the turn hands to the generator directly.
        self.states = dict.fromkeys(self.ranks, fresh(grad)) if seed is None else \
            {r: rank_seed(seed, r) for r in self.ranks} if grad else \
            {r: fresh(grad, rank_seed(seed, r)) for r in self.ranks}
        self.stream = _invariant.fork()  # the caller's spmd.random.invariant, if any
        self.main = getcurrent()
        self.lets: dict[int, greenlet] = {}
        self.done: set[int] = set()
        # rank -> (group, slot, name) of the collective it waits in
        self.waiting: dict[int, tuple[Group, Any, str]] = {}
        # rank -> the meeting point (``meet``) it waits at
        self.meeting: dict[int, _Point] = {}
        self.points: dict[tuple, _Point] = {}
        self.counts: dict[tuple, int] = {}
        self.throw: dict[int, BaseException] = {}
        self.per_rank_backward = False  # custom_vjp calls make per-rank nodes
        self.nodes = 0  # custom_vjp calls made one node over the ranks

    def run(self) -> list[Any]:
        self.generation = self.comm.begin()
        caller = take(self.per_rank_rng)
        self.baseline = guards()
        workers = _take_workers(len(self.ranks), self.pool)
        for r, w in zip(self.ranks, workers):
            if w is not None:
                w.parent = self.main
            self.lets[r] = w
        try:
            self.loop()
        finally:
            put(caller)
            _give_back([w for r, w in self.lets.items() if r in self.done], self.pool)
        if self.errors:
            raise_first(self.errors)
        return [self.results[r] for r in self.ranks]

    def _body(self, rank: int, mine: dict, ctx: list) -> None:
        """Rank ``rank``'s program, on a worker whose comm locals are ``mine`` and rank
        contexts ``ctx`` (its own for its life)."""
        # (No ``_tls.run``: a greenlet run is never abandoned, so never stale.)
        mine["green"], mine["green_rank"] = self, rank
        ctx.append((self.mesh, rank))
        try:
            if self.stream is None:
                self.results[rank] = self.fn(rank)
            else:
                with _invariant.on_rank_thread(self.stream, rank):
                    self.results[rank] = self.fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            self.errors.append((time.monotonic(), rank, e))
            self.comm.abort(e, self.generation, rank)
        finally:
            ctx.pop()
            mine["green"] = None  # an idle worker holds no run

    def meet(self, key: Any, item: Any, build: Callable[[dict[int, Any]], dict[int, Any]]
             ) -> Any:
        """Wait until every rank of the run called ``meet`` with ``key`` as often as this
        one, then ``build`` (run once, by the last to arrive) maps every rank's ``item``
        to its result; return this rank's. Ranks that never arrive (a call made on some
        ranks only) are left out once no rank can run: ``build`` then gets the others."""
        rank = _tls.get("green_rank")
        n = self.counts.get((rank, key), 0)
        self.counts[(rank, key)] = n + 1
        pt = self.points.get((key, n))
        if pt is None:
            pt = self.points[(key, n)] = _Point((key, n), build)
        pt.items[rank] = item
        if len(pt.items) == len(self.ranks):
            self._form(pt)
        while not pt.done:
            if self.comm._aborted is not None:
                raise CommAborted(f"rank {rank}: cancelled because another rank failed "
                                  f"({self.comm._aborted!r})")
            self.meeting[rank] = pt
            self.main.switch()
        if pt.error is not None:
            raise pt.error
        return pt.results[rank]

    def _form(self, pt: _Point) -> None:
        self.points.pop(pt.key, None)
        self.nodes += 1
        try:
            pt.results = pt.build(pt.items)
        except BaseException as e:  # noqa: BLE001 - raised on every rank that met
            pt.error = e
        pt.items, pt.done = None, True

    def block(self, rank: int, group: Group, slot: Any, name: str) -> None:
        """Called by a rank waiting in a collective: run the other ranks until this one
        can go on (its slot is done, failed, or the run aborted)."""
        self.waiting[rank] = (group, slot, name)
        self.main.switch()

    def _ready(self, rank: int) -> bool:
        if rank in self.throw:
            return True
        pt = self.meeting.get(rank)
        if pt is not None:
            return pt.done or self.comm._aborted is not None
        w = self.waiting.get(rank)
        if w is None:
            return True
        slot = w[1]
        return slot.done or slot.error is not None or self.comm._aborted is not None

    def loop(self) -> None:
        live = list(self.ranks)
        waiting, meeting, throw = self.waiting, self.meeting, self.throw
        while live:
            ran = False
            for r in list(live):
                if r in waiting or r in meeting or r in throw:
                    if not self._ready(r):
                        continue
                    waiting.pop(r, None)
                    meeting.pop(r, None)
                self._turn(r)
                ran = True
                if r in self.done:
                    live.remove(r)
            if not ran:
                self._stuck(live)

    def _turn(self, r: int) -> None:
        """Run rank ``r`` until it waits, finishes or fails; then lift its torch state."""
        s = self.states[r]
        if s is not CLEAN:
            if s.__class__ is int:
                _generator.manual_seed(s)
            else:
                put(s)
        exc = self.throw.pop(r, None) if self.throw else None
        got = None
        try:
            if exc is None:
                # A worker waiting for a job takes (run, rank); one waiting in a
                # collective ignores it. Workers are started and switched to only here,
                # so their start and their jobs come from one stack depth.
                w = self.lets[r]
                got = _MOVED if w is None else w.switch((self, r))
                if got is _MOVED:  # none yet, or one made where the stack was otherwise
                    if w is not None:
                        w.throw()  # ends it
                    w = self.lets[r] = _new_worker(self.main)
                    w.switch(None)  # started here, where its jobs come from
                    got = w.switch((self, r))
            else:
                got = self.lets[r].throw(exc)
        finally:
            if got is _DONE:
                self.done.add(r)
            # a rank that finished draws no more: its generator state is not kept
            self.states[r] = take(self.per_rank_rng and got is not _DONE)
        while r not in self.done:
            # A rank may wait (and let another run) only where torch's per-thread state
            # is what ``take`` lifts: inside a C++ guard it is not, and the next rank
            # would run under this one's guard. Nor inside C++ code that called back
            # into Python (``_in_callback``). It gets the error where it waits, with
            # its state back, so the guard unwinds on it.
            inside = inside_guard(self.baseline) or _in_callback(self.lets[r])
            if inside is None:
                return
            w = self.waiting.pop(r, None)
            pt = self.meeting.pop(r, None)
            what = w[2] if w is not None else "a custom_vjp rule" if pt is not None else "it"
            put(self.states[r])
            got = None
            try:
                got = self.lets[r].throw(SpecError(
                    f"{what} on rank {r}: the simulated mesh switches to another rank at "
                    f"each collective, which it cannot do inside {inside}; run this "
                    f"shard_map with Mesh(..., schedule='threads') (a thread per rank), or "
                    f"call the collective outside it"))
            finally:
                if got is _DONE:
                    self.done.add(r)
                self.states[r] = take(self.per_rank_rng and got is not _DONE)

    def _stuck(self, live: list[int]) -> None:
        """No rank can run: every live one waits in a collective some member of its group
        never reaches. Each gets CommTimeout naming them and what they did instead."""
        pending = {id(pt): pt for pt in self.meeting.values() if not pt.done}
        if pending:  # a meeting some ranks never come to: the others go on without them
            self._form(next(iter(pending.values())))
            return
        failed = {r for _, r, _ in self.errors}
        for r in live:
            group, slot, name = self.waiting[r]
            missing = tuple(m for m, a in zip(group.ranks, slot.arrived) if not a)
            why = []
            for m in missing:
                if m in failed:
                    why.append(f"rank {m} failed")
                elif m in self.waiting:
                    g2, _, n2 = self.waiting[m]
                    why.append(f"rank {m} waits in {n2} over {_axes(g2)}")
                else:
                    why.append(f"rank {m} returned without calling it")
            self.throw[r] = CommTimeout(
                f"{name} over {_axes(group)} on rank {group.rank}: ranks {list(missing)} of "
                f"the group {list(group.ranks)} did not arrive ({'; '.join(why)}); every "
                f"rank must run the same collectives in the same order",
                op=name, axes=group.axes, missing=missing)


def _sources(pkg: Any) -> frozenset[str]:
    """The file names of a package's Python modules, as its code objects name them."""
    root = os.path.dirname(pkg.__file__)
    return frozenset(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                     if f.endswith(".py"))


_CALLBACKS = _sources(optree)  # a set: one lookup a frame (a waiting rank walks its own)


def _in_callback(g: greenlet) -> str | None:
    """What C++ code a waiting rank is inside of, where that code called back into Python
    (optree's ``tree_map`` calls its function from C++ through pybind11, which keeps a
    per-thread stack of its calls: another rank entering it while this one waits, and
    this one then leaving it, makes pybind11 abort the process). None when there is none."""
    f = g.gr_frame
    while f is not None:
        if f.f_code.co_filename in _CALLBACKS:
            return ("a function that optree calls from C++ (optree.tree_map and its kin: "
                    "map over the leaves in a Python loop, or pass the whole pytree to the "
                    "collective, which takes pytrees)")
        f = f.f_back
    return None


class _Point:
    """A meeting of the ranks (``_Run.meet``): their items, and once built, results."""

    __slots__ = ("key", "build", "items", "results", "error", "done")

    def __init__(self, key: tuple, build: Callable[[dict[int, Any]], dict[int, Any]]):
        self.key, self.build = key, build
        self.items: dict[int, Any] | None = {}
        self.results: dict[int, Any] = {}
        self.error: BaseException | None = None
        self.done = False


# -- worker greenlets -----------------------------------------------------------------------
#
# Starting and ending a greenlet costs ~10 us (and a torch op in a new one ~3x its
# time); switching to a waiting one, under 1. So workers are kept between runs, with one
# condition. A greenlet's C stack continues, past its first frame, into the frames of
# whoever started it, as they were then; C++ code that walks the whole stack (torch
# records a backtrace in every error it raises) reads those frames. Where a worker runs
# again with the stack at another depth (made in a backward's node, run in a forward;
# or a call through C code), that memory holds other frames, and the walk crashes the
# process. So a worker is started where its jobs come from (``_Run._turn``), and only
# reused from the same depth: at each job it compares what the switch in saved of its
# parent's stack with what the switch of its first job saved (greenlet's
# ``_stack_saved``; equal only at the same depth), and answers ``_MOVED`` where they
# differ: the run ends it and starts a new one.

_DONE = object()  # what a worker greenlet says when its rank's program has finished
_MOVED = object()  # what a pooled worker says when switched to from another stack depth


def _saved(g: greenlet) -> int | None:
    return getattr(g, "_stack_saved", None)


def _work(_: Any) -> None:
    """A worker greenlet's life: run rank programs, each switched in from where the
    first one was."""
    me = getcurrent()
    job = me.parent.switch(None)  # started: wait for the first job
    home = _saved(me.parent)
    mine, ctx = _tls.values(), rank_stack()  # this greenlet's, for its life
    while True:
        run, rank = job
        run._body(rank, mine, ctx)
        del run
        job = me.parent.switch(_DONE)
        while not home or _saved(me.parent) != home:  # 0: no way to tell a shallower depth
            job = me.parent.switch(_MOVED)


def _new_worker(parent: greenlet) -> greenlet:
    return greenlet(_work, parent)


_pool = threading.local()  # idle workers of this OS thread (a greenlet stays on its own)


def _take_workers(n: int, pool: str) -> list[greenlet | None]:
    """``n`` workers: pooled ones (checked at their next job), None for the rest. Runs made
    inside a backward (``run_ranks``) keep a pool of their own: their stack depth is
    another than the forward's."""
    pools = getattr(_pool, "idle", None)
    if pools is None:
        pools = _pool.idle = {}
    idle = pools.setdefault(pool, [])
    got: list[greenlet | None] = [idle.pop() for _ in range(min(n, len(idle)))]
    return got + [None] * (n - len(got))  # None: the run starts a new one


def _give_back(workers: list[greenlet], pool: str) -> None:
    """Workers whose rank finished go back to the pool (one still inside a rank's
    program, abandoned by a failure, is dropped)."""
    if _saved(getcurrent()) is not None:  # else: no way to check a worker's depth
        _pool.idle[pool].extend(workers)
