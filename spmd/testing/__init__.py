"""Tools to prove sharded ops correct: the ones spmd's own tests use.

- ``assert_matches_single_device``: a ``shard_map`` of a per-shard function against the
  same computation on one device in float64, in values and gradients, with messages that
  name the output, the global index, and the rank and local index holding it.
- ``check_adjoint``: the float64 dot-product test ``<T x, y> == <x, T* y>``.
- ``strategies`` (needs hypothesis, imported on first use): meshes, split sizes,
  shapes, specs, uneven layouts and whole sharded cases.
- ``on_mesh``: a pytest decorator that runs one test body on every rank, on threads
  and on gloo processes; ``run_on_mesh`` runs a function there and returns the results.
"""
from __future__ import annotations

import importlib
from typing import Any

from .adjoint import check_adjoint
from .runner import on_mesh, run_on_mesh
from .single_device import assert_matches_single_device

__all__ = ["assert_matches_single_device", "check_adjoint", "on_mesh", "run_on_mesh",
           "strategies"]


def __getattr__(name: str) -> Any:
    # hypothesis is a test dependency: spmd.testing works without it until strategies is used
    if name == "strategies":
        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
