"""Tools to prove sharded ops correct: the ones spmd's own tests use.

- ``check_adjoint``: the float64 dot-product test ``<T x, y> == <x, T* y>``.
- ``on_mesh``: a pytest decorator that runs one test body on every rank, on threads
  and on gloo processes; ``run_on_mesh`` runs a function there and returns the results.
"""
from .adjoint import check_adjoint
from .runner import on_mesh, run_on_mesh

__all__ = ["check_adjoint", "on_mesh", "run_on_mesh"]
