"""spmd: JAX-style functional SPMD on PyTorch, for domain-parallel scientific ML.

Split the domain of one sample (a 3-D volume, a global weather field) over ranks, write
the per-shard program in ordinary PyTorch, name every byte that moves, and get the
single-device values and gradients back. Uneven shards are normal. Importing spmd
changes nothing global.

Start with five names:

    Mesh        ranks in an n-d grid with named axes: Mesh((2, 4), ("dp", "sp"))
    P           a partition spec, one entry per dim: P(None, "sp") splits dim 1 over "sp"
    shard_map   shard_map(f, mesh, in_specs, out_specs)(x): f runs on every rank's shard
    psum        the JAX-named collectives (psum, all_gather, ppermute, ...), differentiable
    halo_pad    a shard plus its neighbours' rows, F.pad's modes at the domain's edge

    >>> mesh = Mesh((4,), ("sp",))
    >>> x = torch.arange(10.0)
    >>> shard_map(lambda s: psum(s.sum(), "sp"), mesh, P("sp"), P())(x)
    tensor(45.)

The layers, each importing only the ones listed before it:

    core/         Mesh, P, Layout, Placeholder, errors: pure data and arithmetic
    random        invariant(seed): random draws that are the same on one device and on
                  any mesh (a function of the seed, the draw and the global index)
    comm/         the communication protocol, its threads and torch.distributed backends,
                  comm_stats
    collectives/  psum, all_gather, ppermute, ... with their transposes; custom_vjp
    transforms/   scatter, gather, halo_pad, reduce, redistribute, each with its adjoint;
                  Sharded, a global tensor held as its shards
    mapping/      shard_map: a per-shard function as one differentiable global call
    ops/, nn/     domain-parallel layers (convolutions, pooling, ...) and nn.convert
    fft/          torch.fft's transforms on split tensors (slab, pencil), differentiable
    parallel/     GradSync: bucketed, overlapped gradient sync of replicated parameters
    checkpoint/   save and load a training state across meshes (torch's DCP format);
                  to_dtensor / from_dtensor
    run/          launch: one function on every rank, as threads or gloo processes
    testing/      prove your own ops: assert_matches_single_device, check_adjoint, on_mesh
    perf/         estimate: a step's collectives, memory and compute per rank, predicted
                  to thousands of ranks with a network model; plan: which decomposition
    viz/, demo/   visualize a layout; the heat-diffusion demo (python -m spmd demo)

Read next: the README's tour; ``help(spmd.shard_map)``; ``spmd.ops`` and
``spmd.nn.convert`` to make a model domain-parallel; ``spmd.parallel.GradSync`` for
per-rank training; ``spmd.testing`` to prove an op; the notebooks in ``notebooks/``.
"""
from . import fft, nn, ops, parallel, random
from .collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    broadcast,
    custom_vjp,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from .comm.rank_threads import manual_seed
from .comm.stats import CommStats, comm_stats
from .core import CommAborted, CommError, CommTimeout, Layout, Mesh, P, Placeholder, SpecError
from .mapping import shard_map
from .run import launch
from .transforms import (
    Sharded,
    backward,
    gather,
    halo_pad,
    halo_trim,
    redistribute,
    reduce,
    scatter,
)
from .viz import visualize

__version__ = "0.1.0"


def __getattr__(name: str):
    # Checkpoints import torch.distributed.checkpoint and DTensor (0.8 s): only on use.
    if name == "checkpoint":
        import importlib
        return importlib.import_module(".checkpoint", __name__)
    if name in ("to_dtensor", "from_dtensor"):
        from .checkpoint import dtensor
        return getattr(dtensor, name)
    if name in ("perf", "estimate", "plan"):  # measures and predicts: only on use
        import importlib
        perf = importlib.import_module(".perf", __name__)
        return perf if name == "perf" else getattr(perf, name)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")


__all__ = [
    "Mesh", "P", "Layout", "Placeholder", "Sharded",
    "shard_map", "launch", "manual_seed", "visualize", "custom_vjp", "comm_stats", "CommStats",
    "halo_pad", "halo_trim", "reduce", "redistribute", "scatter", "gather", "backward",
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
    "all_to_all", "broadcast", "axis_index", "axis_size",
    "SpecError", "CommError", "CommTimeout", "CommAborted", "ops", "nn", "parallel", "fft",
    "checkpoint", "to_dtensor", "from_dtensor", "perf", "estimate", "plan", "random",
]
