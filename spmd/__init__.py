"""spmd: JAX-style functional SPMD on PyTorch, for domain-parallel scientific ML.

Importing spmd changes nothing global.
"""
from . import nn, ops, parallel
from .collectives import (
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
from .comm.stats import CommStats, comm_stats
from .custom_vjp import custom_vjp
from .errors import CommAborted, CommError, CommTimeout, SpecError
from .halo import halo_pad, halo_trim
from .launch import launch
from .layout import Layout
from .mesh import Mesh
from .placeholder import Placeholder
from .redistribute import redistribute
from .reduction import reduce
from .scatter_gather import backward, gather, scatter
from .shard_map import shard_map
from .spec import P
from .visualize import visualize

__version__ = "0.1.0"

__all__ = [
    "Mesh", "P", "Layout", "Placeholder",
    "shard_map", "launch", "visualize", "custom_vjp", "comm_stats", "CommStats",
    "halo_pad", "halo_trim", "reduce", "redistribute", "scatter", "gather", "backward",
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
    "all_to_all", "broadcast", "axis_index", "axis_size",
    "SpecError", "CommError", "CommTimeout", "CommAborted", "ops", "nn", "parallel",
]
