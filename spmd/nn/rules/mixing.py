"""Calls that mix positions along some dims: reductions (``spmd.reduce`` over split dims),
softmax and norms (their ``spmd.ops`` twins); scans, matmuls, rolls: refused where those
dims are split. Attention is in ``attn.py``, FFTs in ``fourier.py``."""
from __future__ import annotations

import math

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ... import ops
from ...transforms.reduction import reduce as _reduce
from .. import flow
from .._tags import axes_str, spec_of, split_dims
from ..modules import SHARDED, implicit_softmax_dim
from ._base import (
    Call,
    _arg,
    _dim,
    _dims,
    _no_local_sizes,
    _split,
    _where,
    broadcast,
    broadcast_shapes,
    like_input,
)
from .per_position import pointwise
from .windows import _swap

_REDUCE_OP = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min"}


def reduction(c: Call) -> Any:
    x = c.args[0]
    name = c.name
    pos = 2 if name in ("norm", "quantile", "nanquantile", "linalg_vector_norm") else 1
    if name in ("max", "min") and len(c.args) > 1 and isinstance(c.args[1], torch.Tensor):
        return pointwise(c)  # torch.max(a, b): elementwise
    if name in ("max", "min") and "other" in c.kwargs:
        return pointwise(c)
    dim = _arg(c, "dim", pos, -1 if name == "mode" else None)
    if name in ("max", "min") and dim is None:
        name = "amax" if name == "max" else "amin"
    keepdim = bool(_arg(c, "keepdim", pos + 1 if name not in ("var", "std") else 3, False))
    dims = _dims(dim, x.ndim)
    e = c.ent(x)
    sp = [d for d in dims if e[d]]
    kept = tuple(None if d in dims else e[d] for d in range(x.ndim)) if keepdim else \
        tuple(e[d] for d in range(x.ndim) if d not in dims)
    if not sp:
        res = c.call()
        return c.out(res, kept)
    op = _REDUCE_OP.get(name)
    if op is None:
        c.refuse(f"reduces over {_where(sp[0], e[sp[0]])} and has no domain-parallel twin "
                 f"(spmd.reduce does sum, mean, amax, amin)",
                 "reduce with those, or redistribute so the dim is whole")
    dtype = c.kwargs.get("dtype")
    c.record("swapped", f"over split dim {sp[0]} -> spmd.reduce(op={op!r})")
    if c.planning:
        return c.out(c.call(), kept)

    def twin(t, *_, **__):
        t = t if dtype is None else t.to(dtype)
        return _reduce(t, c.mesh, spec_of(e), op=op, dim=dims if dim is not None else None,
                       keepdim=keepdim)
    return c.out(c.call(twin, (x,), {}), kept)


def softmax(c: Call) -> Any:
    """softmax, log_softmax, softmin: over a split dim, spmd.ops' twin (softmin as the
    softmax of -x, as torch defines it)."""
    x = c.args[0]
    d = _arg(c, "dim", 1, None)
    if d is None:
        d = implicit_softmax_dim(x.ndim)
    k = _dim(d, x.ndim)
    e = c.ent(x)
    if not e[k]:
        return c.out(c.call(), e)
    if c.name == "_softmax":
        c.refuse(f"normalises along {_where(k, e[k])} (torch._softmax)",
                 "call torch.softmax, which has a domain-parallel twin")
    op = ops.log_softmax if c.name == "log_softmax" else ops.softmax
    sign = -1 if c.name == "softmin" else 1
    dtype = c.kwargs.get("dtype")

    def make(spec):
        def run(*_, **__):
            return op(x if sign == 1 else -x, k, mesh=c.mesh, spec=spec, dtype=dtype)
        return run
    return _swap(c, f"along split dim {k} -> spmd.ops.{op.__name__}", make)


def scan(c: Call) -> Any:
    """cumsum, sort, topk, ...: along one dim (argument ``dim``)."""
    x = c.args[0]
    pos = {"topk": 2, "kthvalue": 2, "diff": 2, "glu": 1, "normalize": 2,
           "unique_consecutive": 3, "renorm": 2}.get(c.name, 1)
    default = {"topk": -1, "kthvalue": -1, "diff": -1, "glu": -1, "normalize": 1,
               "sort": -1, "argsort": -1, "msort": 0, "unique_consecutive": None}.get(c.name, None)
    d = c.kwargs.get("dim", c.args[pos] if len(c.args) > pos and not
                     isinstance(c.args[pos], (bool, float)) else default)
    if c.name == "msort":
        d = 0
    e = c.ent(x)
    if d is None:
        if any(e):
            c.refuse(f"works over all elements, and {_where(_split(c, x)[0], e[_split(c, x)[0]])}")
        return c.call()
    k = _dim(d, x.ndim)
    if e[k]:
        hint = (" (a finite difference: spmd.halo_pad the dim first, then subtract "
                "neighbours within the padded shard)") if c.name == "diff" else ""
        c.refuse(f"mixes values along {_where(k, e[k])}{hint}",
                 "redistribute so the dim is whole, or allow=(...) if it is not split at "
                 "run time")
    res = c.call()
    return c.out(res, like_input(c, x))


def pairwise(c: Call) -> Any:
    """cosine_similarity(x1, x2, dim), pairwise_distance(x1, x2): over one dim, removed."""
    c = flow.agreed(c, [c.args[0], c.args[1]])
    x1, x2 = c.args[0], c.args[1]
    entries = broadcast(c, [x1, x2])
    d = _arg(c, "dim", 2, 1 if c.name == "cosine_similarity" else -1)
    k = _dim(d, len(entries))
    if entries[k]:
        c.refuse(f"contracts along {_where(k, entries[k])}")
    keep = bool(_arg(c, "keepdim", 5, False)) if c.name == "pairwise_distance" else False
    out = tuple(None if i == k else v for i, v in enumerate(entries)) if keep else \
        tuple(v for i, v in enumerate(entries) if i != k)
    return c.out(c.call(), out)


def _ops_twin(c: Call, op: Callable) -> Any:
    """The call as ``spmd.ops``' twin, which takes the intercepted function's arguments."""
    def make(spec):
        return lambda *args, **kwargs: op(*args, mesh=c.mesh, spec=spec, **kwargs)
    return _swap(c, f"-> spmd.ops.{op.__name__}", make)


def _no_channel_split(c: Call, x: torch.Tensor, e) -> None:
    if x.ndim > 1 and e[1]:
        c.refuse(f"normalises per channel, and {_where(1, e[1])}", "keep the channels whole")


def _no_shared_buffers(c: Call, running: Any, what: str, var: Any = None) -> None:
    """A threads mesh runs every rank's forward on the one module: running statistics
    (and num_batches_tracked) updated on it would be updated once per rank. A layer's own
    buffers are fine: the plan notes their update (meta kernels bump no version
    counter), and each rank thread then updates its own copy of them, written back once
    where the ranks agree (``state.Views``). Other buffers are refused."""
    if running is None or c.mesh.backend != "threads" or c.mesh.size < 2:
        return
    layer = c.run.module_at()
    if c.planning and layer is not None and any(running is b for b in layer.buffers()):
        for t in (running, var):
            if t is not None:
                t.add_(0)  # on meta: no values, only the update noted
        return
    views = c.run.views
    if not c.planning and views is not None and views.holds(running):
        return
    cls = type(layer)
    twin = (f"types={{nn.{cls.__name__}: spmd.nn.{cls.__name__}}}" if cls in SHARDED
            else "its spmd.nn twin (spmd.nn.BatchNorm2d, ...) in place of the layer")
    c.refuse(f"updates {what}'s running statistics in training, which the rank threads "
             f"of a threads mesh share (each would update them)",
             f"keep them as buffers of the layer that calls it, or swap in the twin, which "
             f"updates them once: {twin}; or train on processes "
             f"(spmd.launch(..., backend='gloo') or torchrun), or track_running_stats=False")


def batch_norm(c: Call) -> Any:
    x = c.args[0]
    running = _arg(c, "running_mean", 1, None)
    training = bool(_arg(c, "training", 5, False))
    e = c.ent(x)
    _no_channel_split(c, x, e)
    if (training or running is None) and any(e[d] for d in range(x.ndim) if d != 1):
        if training:
            _no_shared_buffers(c, running, "batch norm", _arg(c, "running_var", 2, None))
        return _ops_twin(c, ops.batch_norm)
    return c.out(c.call(), e)


def instance_norm(c: Call) -> Any:
    x = c.args[0]
    use_input = bool(_arg(c, "use_input_stats", 5, True))
    e = c.ent(x)
    _no_channel_split(c, x, e)
    if use_input and any(e[d] for d in range(2, x.ndim)):
        _no_shared_buffers(c, _arg(c, "running_mean", 1, None), "instance norm",
                           _arg(c, "running_var", 2, None))
        return _ops_twin(c, ops.instance_norm)
    return c.out(c.call(), e)


def group_norm(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    _no_channel_split(c, x, e)
    if any(e[d] for d in range(2, x.ndim)):
        return _ops_twin(c, ops.group_norm)
    return c.out(c.call(), e)


def layer_norm(c: Call) -> Any:
    """layer_norm, rms_norm: over split normalised dims, the twin; over whole ones,
    torch's (no bytes)."""
    x = c.args[0]
    shape = _arg(c, "normalized_shape", 1, ())
    n = 1 if isinstance(shape, int) else len(shape)
    e = c.ent(x)
    if any(e[d] for d in range(x.ndim - n, x.ndim)):
        _no_local_sizes(c)  # normalized_shape is global: a size read from a shard is not
        return _ops_twin(c, ops.rms_norm if c.name == "rms_norm" else ops.layer_norm)
    return c.out(c.call(), e)


def per_channel(c: Call) -> Any:
    """local_response_norm, channel_shuffle, prelu: along the channel dim (1)."""
    x = c.args[0]
    e = c.ent(x)
    if x.ndim > 1 and e[1]:
        c.refuse(f"mixes channels, and {_where(1, e[1])}")
    return c.out(c.call(), e)


def linear(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    if e and e[-1]:
        c.refuse(f"contracts the last dim, and {_where(x.ndim - 1, e[-1])}",
                 "keep the feature dim whole (split another dim)")
    return c.out(c.call(), e[:-1] + (None,) if e else ())


def bilinear(c: Call) -> Any:
    x1, x2 = c.args[0], c.args[1]
    for x in (x1, x2):
        e = c.ent(x)
        if e and e[-1]:
            c.refuse(f"contracts the last dim, and {_where(x.ndim - 1, e[-1])}")
    lead = broadcast_shapes(c, [(c.ent(x)[:-1], tuple(x.shape[:-1])) for x in (x1, x2)])
    return c.out(c.call(), tuple(lead) + (None,))


def matmul(c: Call) -> Any:
    a, b = c.args[0], c.args[1]
    ea, eb = c.ent(a), c.ent(b)
    if a.ndim == 0 or b.ndim == 0:
        return pointwise(c)
    ka = a.ndim - 1
    kb = 0 if b.ndim == 1 else b.ndim - 2
    for k, e in ((ka, ea), (kb, eb)):
        if e[k]:
            c.refuse(f"contracts {_where(k, e[k])}", "keep the contracted dim whole")
    rows = ea[-2] if a.ndim >= 2 else None
    cols = eb[-1] if b.ndim >= 2 else None
    ba = ea[:-2] if a.ndim > 2 else ()
    bb = eb[:-2] if b.ndim > 2 else ()
    nd = max(len(ba), len(bb))
    batch = []
    for d in range(nd):
        va = ba[d - (nd - len(ba))] if d >= nd - len(ba) else None
        vb = bb[d - (nd - len(bb))] if d >= nd - len(bb) else None
        if va and vb and va != vb:
            c.refuse("combines batch dims split over different axes")
        if (va or vb) and not (va and vb):
            t, k = (a, d - (nd - len(ba))) if vb else (b, d - (nd - len(bb)))
            if k >= 0 and t.shape[k] != 1:
                c.refuse(f"broadcasts a whole batch dim against one split over "
                         f"{axes_str(va or vb)}")
        batch.append(va or vb)
    out = list(batch)
    if a.ndim >= 2:
        out.append(rows)
    if b.ndim >= 2:
        out.append(cols)
    res = c.call()
    return c.out(res, tuple(out) if res.ndim == len(out) else None)


def einsum(c: Call) -> Any:
    eq = c.args[0]
    ts = list(c.args[1:])
    if len(ts) == 1 and isinstance(ts[0], (list, tuple)):
        ts = list(ts[0])
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        if any(split_dims(c.ent(t)) for t in ts):
            c.refuse("uses an implicit output or '...' with split operands",
                     "write the equation with an explicit '->' and no '...'")
        return c.call()
    lhs, rhs = eq.replace(" ", "").split("->")
    subs = dict(zip((id(t) for t in ts), lhs.split(",")))
    c = flow.agreed(c, ts, align=lambda t, k: subs[id(t)][k] if id(t) in subs else k)
    ts = list(c.args[1:])
    if len(ts) == 1 and isinstance(ts[0], (list, tuple)):
        ts = list(ts[0])
    labels: dict[str, tuple] = {}
    for sub, t in zip(lhs.split(","), ts):
        e = c.ent(t)
        for k, ch in enumerate(sub):
            v = e[k]
            if v:
                if ch not in rhs:
                    c.refuse(f"sums over {_where(k, v)} (label {ch!r})",
                             "keep contracted dims whole")
                if labels.get(ch, v) != v:
                    c.refuse(f"label {ch!r} is split over different axes")
                labels[ch] = v
            elif ch in labels and t.shape[k] != 1:
                c.refuse(f"label {ch!r} is split in one operand and whole in another")
    for sub, t in zip(lhs.split(","), ts):  # whole operands met later than the split one
        for k, ch in enumerate(sub):
            if ch in labels and not c.ent(t)[k] and t.shape[k] != 1:
                c.refuse(f"label {ch!r} is split in one operand and whole in another")
    return c.out(c.call(), tuple(labels.get(ch) for ch in rhs))


def roll(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    dims = _arg(c, "dims", 2, None)
    if dims is None:
        if any(e):
            c.refuse("rolls the flattened tensor, and some dims are split")
        return c.call()
    for d in _dims(dims, x.ndim):
        if e[d]:
            c.refuse(f"shifts values along {_where(d, e[d])} (a periodic shift across "
                     f"shards)", "there is no domain-parallel roll yet: redistribute so the "
                     "dim is whole, or use a circular spmd.halo_pad in a shard_map body")
    return c.out(c.call(), e)


def flip(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    if c.name == "fliplr":
        dims = [1]
    elif c.name == "flipud":
        dims = [0]
    elif c.name == "rot90":
        dims = _dims(_arg(c, "dims", 2, (0, 1)), x.ndim)
    else:
        dims = _dims(_arg(c, "dims", 1, ()), x.ndim) if _arg(c, "dims", 1, ()) != () else []
    for d in dims:
        if e[d]:
            c.refuse(f"reverses the order along {_where(d, e[d])}",
                     "redistribute so the dim is whole first")
    return c.out(c.call(), e)


def last_two(what: str):
    def rule(c: Call) -> Any:
        x = c.args[0]
        e = c.ent(x)
        for d in range(max(x.ndim - 2, 0), x.ndim):
            if e[d]:
                c.refuse(f"{what}, and {_where(d, e[d])}")
        return c.out(c.call(), like_input(c, x))
    return rule


def unfold(c: Call) -> Any:
    """``Tensor.unfold(dimension, size, step)``: sliding windows along one dim; and
    ``F.unfold`` (same name), whose rule is ``im2col``."""
    if c.func is F.unfold:
        return im2col(c)
    x = c.args[0]
    e = c.ent(x)
    d = _dim(_arg(c, "dimension", 1, 0), x.ndim)
    if e[d]:
        c.refuse(f"makes sliding windows along {_where(d, e[d])}",
                 "spmd.halo_pad the shard first, in a shard_map body")
    return c.out(c.call(), e + (None,))


def im2col(c: Call) -> Any:
    """``F.unfold`` ((N, C, H, W) or (C, H, W) to (N, C * k, L)): patches across a split
    spatial dim are refused; a split batch keeps its split, split channels become a
    split run of rows (each rank's channels' rows, in the global order). ``F.fold``:
    refused where a patch or position dim is split."""
    x = c.args[0]
    e = c.ent(x)
    if c.name == "fold":
        if any(e[-2:]):
            c.refuse("folds patches back into an image along split dims",
                     "keep the patch and position dims whole")
        res = c.call()
        return c.out(res, e[:-2] + (None,) * (res.ndim - len(e) + 2))
    for d in range(max(x.ndim - 2, 0), x.ndim):
        if e[d]:
            c.refuse(f"extracts patches across {_where(d, e[d])}",
                     "use a convolution (spmd.ops' twin runs it with a halo exchange), or "
                     "spmd.halo_pad the shard and F.unfold it in a shard_map body")
    res = c.call()
    k = _arg(c, "kernel_size", 1, 1)
    factor = math.prod(k) if isinstance(k, (tuple, list)) else k * k
    ch = x.ndim - 3  # split channels become runs of kernel-size rows
    return c.out(res, tuple(e[:-2]) + (None,) if res.ndim == x.ndim - 1 else None,
                 flow.scaled(c, x, list(range(x.ndim - 2)) + [x.ndim - 1], ch, factor)
                 if res.ndim == x.ndim - 1 else None)


def pixel_shuffle(c: Call) -> Any:
    x = c.args[0]
    e = c.ent(x)
    for d in range(max(x.ndim - 3, 0), x.ndim):
        if e[d]:
            c.refuse(f"moves values between channels and positions, and {_where(d, e[d])}",
                     "there is no domain-parallel pixel shuffle yet")
    return c.out(c.call(), e)
