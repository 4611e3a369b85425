"""Run one test body on every rank of a mesh: threads, and gloo processes where asked.

``on_mesh`` turns per-rank code into a pytest test parametrized over backends;
``run_on_mesh`` is the plain function under it: ``spmd.launch``, except that gloo runs go
to a persistent process pool per world size (starting processes costs seconds; a test
suite pays it once per size, and again only after a failing run, which ends the pool's
processes because a gloo process group cannot be used after a failure).
"""
from __future__ import annotations

import atexit
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from ..run.launcher import BACKENDS, launch
from ..run.processes import ProcessPool

__all__ = ["on_mesh", "run_on_mesh"]

BACKEND_ARG = "spmd_backend"  # the argument pytest parametrizes; ids are the backend names

_pools: dict[int, ProcessPool] = {}


def pool(world: int) -> ProcessPool:
    """The shared gloo pool of ``world`` processes (made on first use, closed at exit).

    tests/conftest.py's ``gloo2``/``gloo4`` fixtures hand out these same pools, so a
    session never holds two pools of one size.
    """
    if world not in _pools:
        if not _pools:
            atexit.register(close_pools)
        _pools[world] = ProcessPool(world, timeout=60)
    return _pools[world]


def close_pools() -> None:
    """End the processes of every shared pool (each restarts on its next run)."""
    for p in _pools.values():
        p.close()


def run_on_mesh(fn: Callable[..., Any], shape: Sequence[int] | int,
                axis_names: Sequence[str] | str, *, backend: str = "threads",
                args: tuple = (), timeout: float = 60.0) -> list[Any]:
    """``spmd.launch(fn, shape, axis_names, backend=..., args=...)``, gloo on a shared pool.

    Use it inside a test that wants the ranks' results back; ``fn``, ``args`` and the
    results must be picklable for ``backend="gloo"`` (``fn`` a module-level function).

    Example:
        >>> def body(mesh):
        ...     return spmd.psum(torch.tensor(float(mesh.rank)), "sp").item()
        >>> spmd.testing.run_on_mesh(body, 3, "sp")
        [3.0, 3.0, 3.0]
    """
    if backend == "gloo":
        sizes = (shape,) if isinstance(shape, int) else tuple(shape)
        return pool(math.prod(sizes)).run(fn, sizes, axis_names, args=args, timeout=timeout)
    return launch(fn, shape, axis_names, backend=backend, args=args, timeout=timeout)


def on_mesh(shape: Sequence[int] | int, axis_names: Sequence[str] | str, *,
            backends: Sequence[str] = ("threads",),
            timeout: float = 60.0) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make ``body(mesh, ...)`` a pytest test that runs on every rank, once per backend.

    The test is parametrized over ``backends`` (ids ``threads``, ``gloo``; gloo runs are
    marked ``pytest.mark.gloo``, a marker spmd's pytest plugin registers: deselect them
    with ``-m "not gloo"``).
    ``mesh`` is the rank's mesh (``mesh.rank`` its rank); the body's other parameters are
    pytest's as usual (``@pytest.mark.parametrize`` arguments, fixtures) and go to every
    rank, pickled for gloo; one named ``spmd_backend`` gets the backend. A failure on any
    rank fails the test, its message starting with ``rank R:``.

    For gloo the body must be a module-level function of an importable module (a test
    module is: the processes get pytest's ``sys.path``). ``@hypothesis.given`` goes above
    ``on_mesh`` and draws once per example for all ranks; use threads there (each example
    would be a gloo run).

    Args:
        shape, axis_names: the mesh every rank gets.
        backends: any of ``"threads"`` (a thread per rank) and ``"gloo"`` (a process per
            rank; torch.distributed with gloo on 127.0.0.1).
        timeout: seconds for each collective wait and, plus a few, for the whole run.

    Raises:
        ValueError: for unknown, repeated or no backends.
        TypeError: when ``body`` takes no ``mesh`` parameter or is already a hypothesis test.

    Example:
        >>> @spmd.testing.on_mesh((2, 2), ("dp", "sp"))
        ... def test_psum_counts_ranks(mesh):
        ...     assert spmd.psum(torch.ones(()), ("dp", "sp")).item() == 4
        >>> test_psum_counts_ranks(spmd_backend="threads")  # what pytest does
    """
    import pytest  # only when decorating: importing spmd.testing needs no pytest

    backends = (backends,) if isinstance(backends, str) else tuple(backends)
    if not backends or len(set(backends)) != len(backends) or not set(backends) <= set(BACKENDS):
        raise ValueError(f"on_mesh: backends must be distinct names from {BACKENDS}, got "
                         f"{backends!r}")

    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        if getattr(body, "is_hypothesis_test", False):
            raise TypeError(f"on_mesh: {body.__name__} is already a hypothesis test; put "
                            f"@given above @on_mesh so that all ranks run the same example")
        params = list(inspect.signature(body).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                                params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"on_mesh: {body.__name__} must take the mesh as its first "
                            f"positional parameter, as in def {body.__name__}(mesh, ...)")

        wants_backend = any(p.name == BACKEND_ARG for p in params[1:])

        @functools.wraps(body)
        def test(*args: Any, **kwargs: Any) -> None:
            # pytest passes keywords; hypothesis passes what it draws by position.
            kwargs = dict(test.__signature__.bind(*args, **kwargs).arguments)
            backend = kwargs[BACKEND_ARG] if wants_backend else kwargs.pop(BACKEND_ARG)
            run_on_mesh(_call, shape, axis_names, backend=backend, args=(body, kwargs),
                        timeout=timeout)

        # What pytest sees: the body's parameters without the mesh, plus the backend
        # (which the body gets too if it has a parameter of that name).
        seen = [p for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not wants_backend:
            seen.append(inspect.Parameter(BACKEND_ARG, inspect.Parameter.KEYWORD_ONLY))
        test.__signature__ = inspect.Signature(seen)
        # Pickle finds the body by reference through the test in its module: functools.wraps
        # gave the test the body's name, and copies this attribute to any outer wrapper.
        test._spmd_body = body
        body.__qualname__ = f"{body.__qualname__}._spmd_body"
        runs = [pytest.param(b, id=b, marks=[pytest.mark.gloo] if b == "gloo" else [])
                for b in backends]
        return pytest.mark.parametrize(BACKEND_ARG, runs)(test)

    return decorate


def _call(mesh, body: Callable[..., None], kwargs: dict) -> None:
    body(mesh, **kwargs)
