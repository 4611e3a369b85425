"""``spmd.launch``: run one function on every rank of a mesh, threads or processes."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._context import RankContext
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
        return run_on_threads(mesh, lambda rank: fn(mesh, *args), timeout=timeout)
    if backend == "gloo":
        from ._procs import launch_processes
        return launch_processes(fn, mesh_shape, axis_names, args=args, timeout=timeout)
    raise SpecError(f"launch: backend must be one of {BACKENDS}, got {backend!r}")


def run_on_threads(mesh: Mesh, fn: Callable[[int], Any], *, timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank)`` on a thread per rank of a threads mesh, with the rank context set.

    The first failure aborts the mesh's pending collectives so no rank waits forever,
    and is re-raised here tagged with its rank.
    """
    return _pool(mesh).run(fn, mesh.timeout if timeout is None else timeout)


def tag_rank(exc: BaseException, rank: int) -> BaseException:
    """Put ``rank R: `` in front of an exception's message (type and attributes kept)."""
    prefix = f"rank {rank}: "
    if exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith(prefix):
            exc.args = (prefix + exc.args[0],) + exc.args[1:]
    elif hasattr(exc, "add_note"):
        exc.add_note(f"raised on rank {rank}")
    return exc


class _RankPool:
    """Persistent worker threads, one per rank, so a shard_map call costs no thread start."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.n = mesh.size
        self._task: Callable[[int], Any] | None = None
        self._go = [threading.Semaphore(0) for _ in range(self.n)]
        self._done = threading.Semaphore(0)
        self._results: list[Any] = [None] * self.n
        self._errors: list[tuple[float, int, BaseException]] = []
        self._elock = threading.Lock()
        self._busy = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, args=(r,), daemon=True,
                                          name=f"spmd-rank-{r}") for r in range(self.n)]
        for t in self._threads:
            t.start()

    def _worker(self, rank: int) -> None:
        import time
        ctx = RankContext(self.mesh, rank)
        while True:
            self._go[rank].acquire()
            task = self._task
            try:
                with ctx:
                    self._results[rank] = task(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                with self._elock:
                    self._errors.append((time.monotonic(), rank, e))
                self.mesh.comm.abort(e)
            finally:
                self._done.release()

    def run(self, fn: Callable[[int], Any], timeout: float) -> list[Any]:
        if not self._busy.acquire(blocking=False):
            raise SpecError(f"{self.mesh!r} is already running a per-rank program; nested "
                            f"calls from outside its rank threads are not supported")
        try:
            self._task, self._results, self._errors = fn, [None] * self.n, []
            for s in self._go:
                s.release()
            import time
            deadline = time.monotonic() + timeout + 5.0
            for _ in range(self.n):
                if not self._done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise CommTimeout(f"per-rank program on {self.mesh!r} did not finish in "
                                      f"{timeout:g} s", op="launch")
            if self._errors:
                self.mesh.comm.reset()
                # A rank cancelled because another failed is a symptom; report the cause.
                errs = sorted(self._errors, key=lambda e: (isinstance(e[2], CommAborted), e[0]))
                _, rank, exc = errs[0]
                raise tag_rank(exc, rank)
            return self._results
        finally:
            self._task = None
            self._busy.release()


def _pool(mesh: Mesh) -> _RankPool:
    pool = mesh.__dict__.get("_rank_pool")
    if pool is None:
        with mesh._lock:
            pool = mesh.__dict__.get("_rank_pool")
            if pool is None:
                pool = mesh.__dict__["_rank_pool"] = _RankPool(mesh)
    return pool
