"""Rank threads: run one function on every rank of a threads mesh.

The threads backend's counterpart of starting processes: ``shard_map`` and
``spmd.launch`` run the per-rank program through ``run_on_threads``, on a shared pool of
idle worker threads (no thread start per call).
"""
from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..core._context import RankContext
from ..core.errors import CommAborted, CommTimeout, check_timeout, tag_rank
from ..core.mesh import Mesh
from . import comm_of

__all__ = ["run_on_threads"]


def run_on_threads(mesh: Mesh, fn: Callable[[int], Any], *, timeout: float | None = None,
                   own_threads: bool = False) -> list[Any]:
    """Run ``fn(rank)`` on a thread per rank of a threads mesh, with the rank context set.

    The calling thread runs rank 0; the other ranks run on worker threads from a
    shared pool of idle workers (no thread start per call), or on threads started for
    this run that end with it (``own_threads``). The first failure aborts the mesh's
    pending collectives so no rank waits forever, and is re-raised here tagged with
    its rank.
    """
    timeout = mesh.timeout if timeout is None else check_timeout(timeout, "run_on_threads")
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
