"""Rank threads: run one function on every rank of a threads mesh.

The threads backend's counterpart of starting processes: ``shard_map`` and
``spmd.launch`` run the per-rank program through ``run_on_threads``, on a shared pool of
idle worker threads (no thread start per call).
"""
from __future__ import annotations

import _thread
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..core._local import RankLocal
from .. import random as _invariant
from ..core._context import RankContext
from ..core.errors import CommAborted, CommTimeout, SpecError, check_timeout, tag_rank
from ..core.mesh import Mesh
from . import comm_of
from .threads import _tls

__all__ = ["run_on_threads", "manual_seed"]


_GRACE = 1.0  # seconds the other ranks get to finish once one has failed


# Random functions: on rank threads each draws from its rank's own generator state.
_RANDOM = frozenset({
    "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
    "dropout3d", "rrelu", "rrelu_", "rand", "randn", "randint", "randperm", "rand_like",
    "randn_like", "randint_like", "bernoulli", "bernoulli_", "normal", "normal_", "uniform_",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "multinomial",
    "poisson", "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
    "native_dropout", "binomial", "_standard_gamma", "_sample_dirichlet",
    "scaled_dot_product_attention", "multi_head_attention_forward", "kaiming_uniform_"}) \
    | _invariant.RANDOM  # feature_dropout, nn.init's other functions, ...
_rng_lock = threading.Lock()
# The shared generator's state as the last rank draw left it (guarded by _rng_lock). A
# rank draw that finds it changed knows that code on some thread drew from or seeded
# the generator the rank threads share: seeds and draws would then depend on thread
# timing, so it raises instead.
_left: list[torch.Tensor | None] = [None]
_active = RankLocal()  # .mode: the _RankRandom of this rank thread, if any


class _RankRandom(TorchFunctionMode):
    """Random draws of one rank thread from its own generator state (CPU).

    Rank threads share torch's one default generator, so their draws would interleave in
    whatever order the threads run. Each rank gets a state seeded from one draw of the
    caller's generator, so a seeded program gives the same draws every run, and ranks
    draw independently, as processes with their own seeds do; ``spmd.manual_seed``
    seeds one rank's state, as ``torch.manual_seed`` seeds a process's.
    """

    #: A change of torch's shared generator between this mode's draws is refused (a seed
    #: set on a rank thread); off where the change is meant (``at_state``).
    watches_shared = True

    def __init__(self, seed: int):
        super().__init__()
        self.seed(seed)

    @classmethod
    def at_state(cls, state: torch.Tensor) -> _RankRandom:
        """Draws from ``state`` on, whatever torch's shared generator does meanwhile (a
        checkpoint's recompute, which sets it around the recompute)."""
        mode = cls.__new__(cls)
        TorchFunctionMode.__init__(mode)
        mode.state, mode.watches_shared = state, False
        return mode

    def seed(self, seed: int) -> None:
        g = torch.Generator()
        g.manual_seed(seed)
        self.state = g.get_state()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _RANDOM:
            return func(*args, **kwargs)
        with _rng_lock:
            saved = torch.get_rng_state()
            if self.watches_shared and _left[0] is not None and \
                    not torch.equal(saved, _left[0]):
                _left[0] = saved  # report once; the next draw starts afresh
                raise SpecError(
                    "torch's shared random generator changed while rank threads ran: "
                    "torch.manual_seed (or set_rng_state, or a draw spmd does not route "
                    "per rank) on a rank thread acts on the one generator every rank "
                    "thread shares, so its effect would depend on thread timing; seed "
                    "a rank with spmd.manual_seed(seed), which seeds its own generator "
                    "(on processes it is torch.manual_seed)")
            torch.set_rng_state(self.state)
            try:
                return func(*args, **kwargs)
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(saved)
                if self.watches_shared:
                    _left[0] = saved

    def __enter__(self):
        self._outer = getattr(_active, "mode", None)
        _active.mode = self
        return super().__enter__()

    def __exit__(self, *exc):
        _active.mode = self._outer
        return super().__exit__(*exc)


def manual_seed(seed: int) -> None:
    """Seed the calling rank's random generator: ``torch.manual_seed`` for one rank.

    On a rank thread of a threads mesh (``spmd.launch``, a ``shard_map`` body, with the
    mesh's default ``rng="per_rank"``) each rank draws from a generator of its own, and
    this seeds it; ``torch.manual_seed`` there would seed the one generator all rank
    threads share (spmd raises at the next draw rather than let thread timing decide).
    Elsewhere (processes, ordinary code) it is ``torch.manual_seed(seed)``.

    Args:
        seed: the seed, an int.

    Example:
        >>> def per_rank(mesh):
        ...     spmd.manual_seed(0)                     # every rank: the same draws
        ...     return torch.randn(2)
        >>> a, b = spmd.launch(per_rank, (2,), ("sp",))
        >>> one_device = torch.randn(2, generator=torch.Generator().manual_seed(0))
        >>> torch.equal(a, b) and torch.equal(a, one_device)
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__}")
    mode = getattr(_active, "mode", None)
    if mode is None:
        torch.manual_seed(seed)
    else:
        mode.seed(seed)


def run_on_threads(mesh: Mesh, fn: Callable[[int], Any], *, timeout: float | None = None,
                   own_threads: bool = False, rank_rng: bool = False) -> list[Any]:
    """Run ``fn(rank)`` on a thread per rank of a threads mesh, with the rank context set.

    The calling thread runs rank 0; the other ranks run on worker threads from a
    shared pool of idle workers (no thread start per call), or on threads started for
    this run that end with it (``own_threads``). Calls on one mesh from several Python
    threads take turns. The first failure cancels the mesh's pending collectives and is
    re-raised here, tagged with its rank, once the other ranks have finished or after
    a short grace; a rank still running then (stuck outside any collective) is
    abandoned: its collectives are refused from then on, and the mesh is ready for the
    next call at once.

    ``rank_rng`` (shard_map's bodies, where ``mesh.rng == "per_rank"``): each rank's random
    draws come from a generator of its own, seeded by one draw of the caller's, so that
    a seeded program is reproducible whatever order the threads run in.
    """
    timeout = mesh.timeout if timeout is None else check_timeout(timeout, "run_on_threads")
    comm = comm_of(mesh)
    take_turn(comm, mesh, timeout, "run_on_threads")
    try:
        batch = _Batch(mesh, fn, comm, comm.begin())
        if rank_rng and mesh.size > 1:
            batch.seed = caller_seed()
            with _rng_lock:
                _left[0] = torch.get_rng_state()
        workers = ([_Worker(persistent=False) for _ in range(mesh.size - 1)] if own_threads
                   else _take_workers(mesh.size - 1))
        for rank, w in enumerate(workers, 1):
            w.start_task(batch, rank)
        batch.run(0)
        batch.wait(timeout)
        if batch.running:  # abandoned: the next begin() fences them out
            comm.abort(CommAborted("per-rank program abandoned"), batch.generation)
            if not batch.errors:
                late = sorted(batch.running)
                raise CommTimeout(f"per-rank program on {mesh!r}: ranks {late} did not "
                                  f"finish within {timeout:g} s", op="run_on_threads",
                                  missing=tuple(late))
        if batch.errors:
            raise_first(batch.errors)
        return batch.results
    finally:
        comm.run_lock.release()


class _Batch:
    """One per-rank program run: the task, and where results and failures go."""

    def __init__(self, mesh: Mesh, fn: Callable[[int], Any], comm: Any, generation: int):
        self.mesh, self.fn = mesh, fn
        self.comm, self.generation = comm, generation
        # The ranks share this process's cores: each rank's torch ops get an equal share
        # of the intra-op threads, as processes on a node would. Without it every rank
        # thread starts a full OpenMP team and the teams spin against each other (the
        # demo's CNN step: 41 ms on 4 ranks and 2 cores, 14 ms with the share).
        self.threads = torch.get_num_threads()
        self.share = max(1, self.threads // mesh.size)
        self.results: list[Any] = [None] * mesh.size
        self.errors: list[tuple[float, int, BaseException]] = []
        self.running = set(range(1, mesh.size))  # worker ranks not finished yet
        self.seed: int | None = None
        self.stream = _invariant.fork()  # the caller's spmd.random.invariant, if any
        # Raw locks, not a Condition: a hand-off costs microseconds, not tens of them.
        self._lock = _thread.allocate_lock()
        self._wake = _thread.allocate_lock()  # released when a worker finishes or fails
        self._wake.acquire()

    def run(self, rank: int) -> None:
        if self.share < self.threads:
            torch.set_num_threads(self.share)  # per thread with OpenMP; restored below
        prev = _tls.get("run")
        _tls.run = (self.comm, self.generation)
        try:
            with RankContext(self.mesh, rank), _rank_random(self.seed, rank), \
                    _invariant.on_rank_thread(self.stream, rank):
                self.results[rank] = self.fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            with self._lock:
                self.errors.append((time.monotonic(), rank, e))
                self._signal()
            self.comm.abort(e, self.generation, rank)
        finally:
            _tls.run = prev
            if self.share < self.threads:
                torch.set_num_threads(self.threads)

    def _signal(self) -> None:
        if self._wake.locked():
            self._wake.release()

    def finished(self, rank: int) -> None:
        with self._lock:
            self.running.discard(rank)
            self._signal()

    def wait(self, timeout: float) -> None:
        """Until every worker rank finished, or a grace after the first failure, or the
        run's timeout (plus the slack collectives need to time out themselves)."""
        deadline = time.monotonic() + timeout + 5.0
        while True:
            with self._lock:
                if not self.running:
                    return
                if self.errors:
                    deadline = min(deadline, min(t for t, _, _ in self.errors) + _GRACE)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.acquire(timeout=left)


def _rank_random(seed: int | None, rank: int):
    return contextlib.nullcontext() if seed is None else _RankRandom(rank_seed(seed, rank))


# -- what rank threads and rank greenlets (rank_greenlets.py) share -----------------------

def take_turn(comm: Any, mesh: Mesh, timeout: float, op: str, what: str = "") -> None:
    """Hold ``comm.run_lock`` for one per-rank program (calls on one threads mesh from
    several Python threads take turns); the caller releases it."""
    if not comm.run_lock.acquire(timeout=timeout):
        raise CommTimeout(f"{what}a per-rank program has been running on {mesh!r} for more "
                          f"than {timeout:g} s in another thread; calls on one threads mesh "
                          f"take turns", op=op)


def caller_seed() -> int:
    """One draw of the caller's generator, which seeds every rank's own (so a seeded
    program is reproducible); not one of the program's draws under spmd.random."""
    with _invariant.paused():
        return int(torch.randint(0, 2 ** 62, (1,)).item())


def rank_seed(seed: int, rank: int) -> int:
    """Rank ``rank``'s generator seed, from ``caller_seed()``'s ``seed``."""
    return (seed * 1_000_003 + rank) % (2 ** 63 - 1)


def raise_first(errors: list[tuple[float, int, BaseException]]) -> None:
    """Raise the first failure of a run, tagged with its rank: a rank cancelled because
    another failed is a symptom, so the cause comes first, then the earliest."""
    _, rank, exc = min(errors, key=lambda e: (isinstance(e[2], CommAborted), e[0]))
    raise tag_rank(exc, rank)


class _Worker:
    """A persistent thread that runs one rank of one batch at a time.

    Workers are shared by every threads mesh, so a shard_map call starts no thread
    and meshes that are dropped leave no threads behind. Raw locks, not
    threading.Semaphore: a hand-off costs a few microseconds instead of tens.
    """

    def __init__(self, persistent: bool = True):
        self._go = _thread.allocate_lock()
        self._go.acquire()
        self._job: tuple[_Batch, int] | None = None
        self._persistent = persistent
        self.thread = threading.Thread(target=self._loop, daemon=True, name="spmd-rank")
        self.thread.start()

    def start_task(self, batch: _Batch, rank: int) -> None:
        self._job = (batch, rank)
        self._go.release()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            batch, rank = self._job
            self._job = None
            batch.run(rank)
            if self._persistent:
                # Back to the idle list before signalling, so the caller's next run reuses us.
                with _idle_lock:
                    _idle.append(self)
            batch.finished(rank)
            del batch
            if not self._persistent:
                return


_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _take_workers(n: int) -> list[_Worker]:
    with _idle_lock:
        got = [_idle.pop() for _ in range(min(n, len(_idle)))]
    return got + [_Worker() for _ in range(n - len(got))]
