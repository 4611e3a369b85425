"""spmd: JAX-style functional SPMD on PyTorch, for domain-parallel scientific ML.

Importing spmd changes nothing global.
"""
from . import nn, ops, parallel
from .collectives.primitives import (
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
from .collectives.vjp import custom_vjp
from .comm.stats import CommStats, comm_stats
from .core.errors import CommAborted, CommError, CommTimeout, SpecError
from .core.layout import Layout
from .core.mesh import Mesh
from .core.placeholder import Placeholder
from .core.spec import P
from .mapping import shard_map
from .run.launcher import launch
from .transforms.halo import halo_pad, halo_trim
from .transforms.redistribution import redistribute
from .transforms.reduction import reduce
from .transforms.scatter_gather import backward, gather, scatter
from .viz.picture import visualize

__version__ = "0.1.0"

__all__ = [
    "Mesh", "P", "Layout", "Placeholder",
    "shard_map", "launch", "visualize", "custom_vjp", "comm_stats", "CommStats",
    "halo_pad", "halo_trim", "reduce", "redistribute", "scatter", "gather", "backward",
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
    "all_to_all", "broadcast", "axis_index", "axis_size",
    "SpecError", "CommError", "CommTimeout", "CommAborted", "ops", "nn", "parallel",
]
