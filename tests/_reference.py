"""Single-device references shared by the test modules (no spmd.Mesh involved)."""
from __future__ import annotations

import math

import numpy as np
import torch

import spmd


def groups_of(shape, names, axes):
    """The groups of global ranks meeting in a collective over ``axes``, each in the order
    of the linearised index over ``axes`` (first axis major). Independent of spmd.Mesh."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    pos = [names.index(a) for a in axes]
    rest = [p for p in range(len(shape)) if p not in pos]
    grid = np.arange(math.prod(shape)).reshape(shape).transpose(rest + pos)
    n = math.prod(shape[p] for p in pos)
    return [tuple(int(v) for v in row) for row in grid.reshape(-1, n)]


def shard_map_vs_single_device(f_local, f_global, mesh, in_specs, out_specs, args, **kw):
    """One shard_map call and the same computation on one device, both differentiated
    from the same random linear functional of the outputs, for the gloo tests, which
    compare what every process holds in the main process (threads tests use
    spmd.testing.assert_matches_single_device).

    Returns ``(got, want)``: the outputs followed by the gradients of every argument
    (None where an argument gets none), sharded and single-device.
    """
    args_a = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    args_b = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = spmd.shard_map(f_local, mesh, in_specs, out_specs, **kw)(*args_a)
    ref = f_global(*args_b)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(r.shape, generator=g, dtype=r.dtype) for r in refs]
    sum((o * w).sum() for o, w in zip(outs, ws)).backward()
    sum((r * w).sum() for r, w in zip(refs, ws)).backward()
    return ([o.detach() for o in outs] + [a.grad for a in args_a],
            [r.detach() for r in refs] + [b.grad for b in args_b])
