"""Layer 4, transforms: whole-tensor moves between layouts, each with its adjoint.

``scatter``/``gather`` (one rank <-> shards), ``halo_pad``/``halo_trim`` (neighbours'
rows), ``reduce`` (over sharded dims) and ``redistribute`` (any layout to any layout); and
``Sharded``, a global tensor held as its shards, which they (and shard_map) accept.
"""
from .halo import halo_pad, halo_trim
from .redistribution import redistribute
from .reduction import reduce
from .scatter_gather import backward, gather, scatter
from .sharded import Sharded

__all__ = ["scatter", "gather", "backward", "halo_pad", "halo_trim", "reduce",
           "redistribute", "Sharded"]
