"""Tools to prove sharded ops correct: the ones spmd's own tests use.

- ``check_adjoint``: the float64 dot-product test ``<T x, y> == <x, T* y>``.
"""
from .adjoint import check_adjoint

__all__ = ["check_adjoint"]
