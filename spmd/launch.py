"""``spmd.launch``: run one function on every rank of a mesh, threads or processes."""
from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._context import RankContext
from .comm import comm_of
from .errors import CommAborted, CommTimeout, SpecError
from .mesh import Mesh

__all__ = ["launch"]

BACKENDS = ("threads", "gloo")


def launch(fn: Callable[..., Any], mesh_shape: Sequence[int] | int,
           axis_names: Sequence[str] | str, *, backend: str = "threads",
           args: tuple = (), timeout: float = 120.0) -> list[Any]:
    """Run ``fn(mesh, *args)`` on every rank; return the results in rank order.

    Args:
        fn: the per-rank program. For ``backend="gloo"`` it must be picklable (a
            module-level function) and so must ``args`` and its results.
        mesh_shape, axis_names: the mesh to build on every rank.
        backend: ``"threads"`` (one thread per rank, this process) or ``"gloo"``
            (one process per rank on 127.0.0.1, a free port, torch.distributed/gloo).
        timeout: seconds for each collective wait and for the whole run to finish.

    Returns:
        ``[fn(mesh, *args) on rank 0, on rank 1, ...]``.

    Raises:
        The first exception raised on any rank (earliest in time), with
        ``"rank R: "`` put in front of its message; other ranks are cancelled and no
        thread or process is left running.

    Example:
        >>> def body(mesh):
        ...     return spmd.psum(torch.tensor(float(mesh.rank)), "sp").item()
        >>> spmd.launch(body, (4,), ("sp",))
        [6.0, 6.0, 6.0, 6.0]
    """
    if backend == "threads":
        mesh = Mesh(mesh_shape, axis_names, backend="threads", timeout=timeout)
        # Threads of their own that end with the run: launch leaves nothing behind.
        return run_on_threads(mesh, lambda rank: fn(mesh, *args), timeout=timeout,
                              own_threads=True)
    if backend == "gloo":
        from ._procs import launch_processes
        return launch_processes(fn, mesh_shape, axis_names, args=args, timeout=timeout)
    raise SpecError(f"launch: backend must be one of {BACKENDS}, got {backend!r}")


def run_on_threads(mesh: Mesh, fn: Callable[[int], Any], *, timeout: float | None = None,
                   own_threads: bool = False) -> list[Any]:
    """Run ``fn(rank)`` on a thread per rank of a threads mesh, with the rank context set.

    The calling thread runs rank 0; the other ranks run on worker threads from a
    shared pool of idle workers (no thread start per call), or on threads started for
    this run that end with it (``own_threads``). The first failure aborts the mesh's
    pending collectives so no rank waits forever, and is re-raised here tagged with
    its rank.
    """
    timeout = mesh.timeout if timeout is None else timeout
    batch = _Batch(mesh, fn, mesh.size - 1)
    workers = ([_Worker(persistent=False) for _ in range(mesh.size - 1)] if own_threads
               else _take_workers(mesh.size - 1))
    for rank, w in enumerate(workers, 1):
        w.start_task(batch, rank)
    batch.run(0)
    if batch.pending and not batch.done.acquire(timeout=timeout + 5.0):
        comm_of(mesh).abort(CommTimeout("per-rank program timed out"))
        raise CommTimeout(f"per-rank program on {mesh!r} did not finish in {timeout:g} s "
                          f"({batch.pending} ranks still running)", op="launch")
    if batch.errors:
        comm_of(mesh).reset()
        # A rank cancelled because another failed is a symptom; report the cause.
        errs = sorted(batch.errors, key=lambda e: (isinstance(e[2], CommAborted), e[0]))
        _, rank, exc = errs[0]
        raise tag_rank(exc, rank)
    return batch.results


def tag_rank(exc: BaseException, rank: int) -> BaseException:
    """Put ``rank R: `` in front of an exception's message (type and attributes kept)."""
    prefix = f"rank {rank}: "
    if exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith(prefix):
            exc.args = (prefix + exc.args[0],) + exc.args[1:]
    elif hasattr(exc, "add_note"):
        exc.add_note(f"raised on rank {rank}")
    return exc


class _Batch:
    """One per-rank program run: the task, and where results and failures go."""

    def __init__(self, mesh: Mesh, fn: Callable[[int], Any], workers: int):
        self.mesh, self.fn = mesh, fn
        # The ranks share this process's cores: each rank's torch ops get an equal share
        # of the intra-op threads, as processes on a node would. Without it every rank
        # thread starts a full OpenMP team and the teams spin against each other (the
        # demo's CNN step: 41 ms on 4 ranks and 2 cores, 14 ms with the share).
        self.threads = torch.get_num_threads()
        self.share = max(1, self.threads // mesh.size)
        self.results: list[Any] = [None] * mesh.size
        self.errors: list[tuple[float, int, BaseException]] = []
        self.pending = workers
        self._lock = _thread.allocate_lock()
        self.done = _thread.allocate_lock()  # released when the last worker finishes
        self.done.acquire()

    def run(self, rank: int) -> None:
        if self.share < self.threads:
            torch.set_num_threads(self.share)  # per thread with OpenMP; restored below
        try:
            with RankContext(self.mesh, rank):
                self.results[rank] = self.fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            self.errors.append((time.monotonic(), rank, e))
            comm_of(self.mesh).abort(e)
        finally:
            if self.share < self.threads:
                torch.set_num_threads(self.threads)

    def finished(self) -> None:
        with self._lock:
            self.pending -= 1
            if self.pending == 0:
                self.done.release()


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
            batch.finished()
            del batch
            if not self._persistent:
                return


_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _take_workers(n: int) -> list[_Worker]:
    with _idle_lock:
        got = [_idle.pop() for _ in range(min(n, len(_idle)))]
    return got + [_Worker() for _ in range(n - len(got))]
