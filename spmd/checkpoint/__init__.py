"""Checkpoints that survive a change of mesh, on torch.distributed.checkpoint (DCP).

Save a training state on one mesh, load it on another: more ranks, fewer, a 2-d mesh to
a 1-d one, gloo processes to a threads mesh, or one process with no process group.

    save(state, path, mesh)        every element written once, by one rank; crash-safe
    load(template, path, mesh)     a new state shaped like the template; each rank reads
                                   only the bytes of its own shard
    PerRank, AS_SAVED              per-rank values (RNG states); "as it was saved"
    read_stats()                   the bytes load read in this process
    to_dtensor, from_dtensor       exchange with torch's DTensor where the layout allows

The state's leaves: ``spmd.Sharded`` (any layout: uneven, empty shards, replicated axes),
tensors (replicated: a converted model's parameters, Adam's moments), ``PerRank``
values, Python values (the step, ``param_groups``). The files are DCP's own format, so
``torch.distributed.checkpoint.load`` reads them too (keys such as ``model.conv1.weight``).

Checkpoints are data, never code: ``.metadata`` is read with an allowlist unpickler and
checked, values with ``torch.load(weights_only=True)``, files only inside the version
``LATEST`` names, every stored block against the crc32 ``save`` recorded; damage raises
``CorruptCheckpointError`` (a ``SpecError``) naming the file (``docs/checkpoints.md``).

A training state, saved on one mesh and resumed on another::

    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
             "field": u}                                # u: a spmd.Sharded on mesh
    spmd.checkpoint.save(state, "ckpt", mesh)
    # ... later, on another mesh (other ranks, other shard sizes):
    tmpl = {"model": model.state_dict(), "optim": spmd.checkpoint.AS_SAVED,
            "step": 0, "field": spmd.Layout(u.shape, P("sp"), new_mesh)}
    state = spmd.checkpoint.load(tmpl, "ckpt", new_mesh)
"""
from ._metadata import CorruptCheckpointError
from .dtensor import from_dtensor, to_dtensor
from .entries import AS_SAVED, PerRank
from .store import ReadStats, latest, load, read_stats, save

__all__ = ["AS_SAVED", "PerRank", "ReadStats", "latest", "load", "read_stats", "save",
           "to_dtensor", "from_dtensor", "CorruptCheckpointError"]
