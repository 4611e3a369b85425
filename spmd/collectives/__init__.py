"""Layer 3, collectives: JAX-named differentiable collectives and ``custom_vjp``.

``primitives`` holds each collective with its transpose right below it; ``vjp`` lets
users write their own backward rules the same way.
"""
from .primitives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    broadcast,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from .vjp import custom_vjp

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
           "all_to_all", "broadcast", "axis_index", "axis_size", "custom_vjp"]
