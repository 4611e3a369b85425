"""``spmd.launch``: run one function on every rank of a mesh, threads or processes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..comm.rank_threads import run_on_threads
from ..core.errors import SpecError, check_timeout
from ..core.mesh import Mesh
from .processes import exit_error

__all__ = ["launch"]

BACKENDS = ("threads", "gloo")


def launch(fn: Callable[..., Any], mesh_shape: Sequence[int] | int,
           axis_names: Sequence[str] | str, *, backend: str = "threads",
           args: tuple = (), timeout: float = 120.0) -> list[Any]:
    """Run ``fn(mesh, *args)`` on every rank; return the results in rank order.

    Args:
        fn: the per-rank program. For ``backend="gloo"`` it must be picklable (a
            module-level function) and so must ``args`` and its results; the processes
            start with "spawn", which runs your script again in each, so a script calls
            ``launch`` under ``if __name__ == "__main__":``, alone or in an ``and``
            (it refuses otherwise).
        mesh_shape, axis_names: the mesh to build on every rank.
        backend: ``"threads"`` (one thread per rank, this process) or ``"gloo"``
            (one process per rank on 127.0.0.1, a free port, torch.distributed/gloo).
        timeout: seconds for each collective wait and for the whole run to finish.

    On threads every rank draws random numbers from a generator of its own (seeded from
    one draw of the caller's), as a process would; seed a rank with
    ``spmd.manual_seed``: ``torch.manual_seed`` on a rank thread would seed the
    generator all ranks share, and the next draw raises.

    Returns:
        ``[fn(mesh, *args) on rank 0, on rank 1, ...]``.

    Raises:
        The first exception raised on any rank (earliest in time), with
        ``"rank R: "`` put in front of its message; other ranks are cancelled and no
        thread or process is left running. A rank that calls ``sys.exit`` raises a
        RuntimeError naming it (a SystemExit would end the caller's program); on gloo, a
        rank whose process stays stopped (SIGSTOP) for ``timeout`` is named as the cause
        of its peers' timeouts.

    Example:
        >>> def body(mesh):
        ...     return spmd.psum(torch.tensor(float(mesh.rank)), "sp").item()
        >>> spmd.launch(body, (4,), ("sp",))
        [6.0, 6.0, 6.0, 6.0]
    """
    timeout = check_timeout(timeout, "launch")
    if backend == "threads":
        mesh = Mesh(mesh_shape, axis_names, backend="threads", timeout=timeout)
        # Threads of their own that end with the run: launch leaves nothing behind.
        return run_on_threads(mesh, lambda rank: _no_exit(fn, mesh, args), timeout=timeout,
                              own_threads=True, rank_rng=True)
    if backend == "gloo":
        from .processes import launch_processes
        return launch_processes(fn, mesh_shape, axis_names, args=args, timeout=timeout)
    raise SpecError(f"launch: backend must be one of {BACKENDS}, got {backend!r}")


def _no_exit(fn: Callable[..., Any], mesh: Mesh, args: tuple) -> Any:
    try:
        return fn(mesh, *args)
    except SystemExit as e:  # on the caller's thread (rank 0) it would end its program
        raise exit_error(e) from None
