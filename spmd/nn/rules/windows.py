"""Windowed layers with a domain-parallel twin in ``spmd.ops`` (convolutions, pools,
interpolation, padding; LPPool by its formula) and losses (their ``spmd.ops`` twins, or per
position then ``spmd.reduce``)."""
from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ... import ops
from ...transforms.reduction import reduce as _reduce
from .._tags import spec_of
from ._base import Call, _arg, _no_local_sizes, _where, broadcast, like_input


def _swap(c: Call, detail: str, make: Callable[[Any], Callable]) -> Any:
    """Run ``c`` as its twin where its input is split: ``make(spec)`` gives a function
    with the intercepted function's arguments (the plan runs the plain one on meta)."""
    x = c.args[0]
    e = c.ent(x)
    if not any(e):
        return c.call()
    c.record("swapped", detail)
    if c.planning:
        return c.out(c.call(), like_input(c, x))
    return c.out(c.call(make(spec_of(e))), like_input(c, x))


def _twin(real: Callable):
    def rule(c: Call) -> Any:
        # A size read from a shard is this rank's, where the twin means a global one
        # (output_padding excepted: a ConvTranspose layer's is made global beforehand).
        if any(c.ent(c.args[0])):
            _no_local_sizes(Call(c.run, c.func, c.name, c.args[:5] + c.args[6:] if
                                 real.__name__.startswith("conv_transpose") else c.args,
                                 {k: v for k, v in c.kwargs.items() if k != "output_padding"}))

        def make(spec):
            return lambda *args, **kwargs: real(*args, mesh=c.mesh, spec=spec, **kwargs)
        return _swap(c, f"-> spmd.ops.{real.__name__}", make)
    return rule


def _adaptive(n: int, is_max: bool):
    """``F.adaptive_{avg,max}_pool{n}d``: where the output has one element along every
    split dim (a classifier's ``AdaptiveAvgPool2d(1)``), the pool is a global mean (max)
    over those dims, then the same pool on each rank's replicated result: its output is
    whole on every rank, as a ``mean((2, 3))`` head's is, so a flatten and a Linear after
    it convert. Elsewhere ``spmd.ops``' twin, whose output stays split."""
    twin = _twin(getattr(ops, f"adaptive_{'max' if is_max else 'avg'}_pool{n}d"))
    plain = getattr(F, f"adaptive_{'max' if is_max else 'avg'}_pool{n}d")

    def rule(c: Call) -> Any:
        x = c.args[0]
        e = c.ent(x)
        size = _arg(c, "output_size", 1, None)
        sizes = (size,) * n if isinstance(size, int) else tuple(size or (None,) * n)
        first = x.ndim - n
        sp = [d for d in range(first, x.ndim) if e[d]]
        if (not sp or any(sizes[d - first] != 1 for d in sp)
                or _arg(c, "return_indices", 2, False)):
            return twin(c)
        _no_local_sizes(c)
        kept = tuple(None if d in sp else e[d] for d in range(x.ndim))
        op = "max" if is_max else "mean"
        c.record("swapped", f"output size 1 along split dim {sp[0]} -> spmd.reduce(op={op!r}), "
                            f"then {plain.__name__} on every rank")
        if c.planning:
            return c.out(c.call(), kept)

        def run(t, *_, **__):
            whole = _reduce(t, c.mesh, spec_of(e), op=op, dim=sp, keepdim=True)
            return plain(whole, size)
        return c.out(c.call(run, (x,), {}), kept)
    return rule


_INTERPOLATE_TWIN = _twin(ops.interpolate)
_RESAMPLING = {"nearest", "nearest-exact", "linear", "bilinear", "trilinear", "bicubic"}


def interpolate(c: Call) -> Any:
    """``F.interpolate``: per sample and channel, so a split batch or channel dim passes;
    along split spatial dims, ``spmd.ops.interpolate`` where it has the mode, and a
    refusal in the plan (before anything moves) where it has not."""
    x = c.args[0]
    e = c.ent(x)
    spatial = [d for d in range(2, x.ndim) if e[d]]
    if not spatial:
        return c.out(c.call(), like_input(c, x))
    d = spatial[0]
    mode = _arg(c, "mode", 3, "nearest")
    if mode == "area":
        n = x.ndim - 2
        c.refuse(f"averages areas (mode='area') along {_where(d, e[d])}, which "
                 f"spmd.ops.interpolate does not do",
                 f"call F.adaptive_avg_pool{n}d(x, output_size) with the global output size "
                 f"(what mode='area' computes; convert runs its spmd.ops twin)")
    if _arg(c, "antialias", 6, False):
        c.refuse(f"filters with antialias=True along {_where(d, e[d])}, whose support grows "
                 f"with the downsampling factor; spmd.ops.interpolate has no such filter",
                 "pass antialias=False")
    if mode not in _RESAMPLING:
        c.refuse(f"resamples with mode={mode!r} along {_where(d, e[d])}, which "
                 f"spmd.ops.interpolate does not do",
                 f"use one of {', '.join(sorted(_RESAMPLING))}")
    if not x.is_floating_point() and mode not in ("nearest", "nearest-exact"):
        c.refuse(f"resamples a {x.dtype} input with mode={mode!r} along {_where(d, e[d])}, "
                 f"which spmd.ops.interpolate does only for floating inputs",
                 "convert x to a floating dtype first")
    return _INTERPOLATE_TWIN(c)


def _indices_twin(real: Callable):
    """F.max_pool2d_with_indices & co: the twin with return_indices=True."""
    def rule(c: Call) -> Any:
        def make(spec):
            def run(*args, **kwargs):
                kwargs = dict(kwargs)
                kwargs.pop("return_indices", None)
                if real.__name__.startswith("adaptive"):
                    size = args[1] if len(args) > 1 else kwargs.pop("output_size")
                    return real(args[0], size, True, mesh=c.mesh, spec=spec)
                a = _signature(F.max_pool2d_with_indices).bind(*args, **kwargs).arguments
                return real(a["input"], a["kernel_size"], a.get("stride"), a.get("padding", 0),
                            a.get("dilation", 1), a.get("ceil_mode", False), True,
                            mesh=c.mesh, spec=spec)
            return run
        return _swap(c, f"-> spmd.ops.{real.__name__}(return_indices=True)", make)
    return rule


def _lp_pool(n: int):
    avg = {1: ops.avg_pool1d, 2: ops.avg_pool2d, 3: ops.avg_pool3d}[n]

    def rule(c: Call) -> Any:
        def make(spec):
            def run(x, norm_type, kernel_size, stride=None, ceil_mode=False):
                k = (kernel_size,) * n if isinstance(kernel_size, int) else tuple(kernel_size)
                out = avg(x.pow(norm_type), kernel_size, stride, 0, ceil_mode, mesh=c.mesh,
                          spec=spec)
                return (torch.sign(out) * torch.relu(torch.abs(out))).mul(math.prod(k)).pow(
                    1.0 / norm_type)
            return run
        return _swap(c, f"-> pow, spmd.ops.avg_pool{n}d, pow (lp_pool{n}d's formula)", make)
    return rule


_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div", "cross_entropy", "nll_loss"}
#: those with an ``spmd.ops`` twin (one psum for sum and divisor); the rest reduce locally
#: then run ``spmd.reduce``
_OPS_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy",
               "nll_loss"}


@functools.cache
def _signature(func: Callable) -> inspect.Signature:
    return inspect.signature(func)


def loss(c: Call) -> Any:
    ba = _signature(c.func).bind(*c.args, **c.kwargs)
    a = ba.arguments
    inp, tgt = a["input"], a["target"]
    classes = c.name in ("cross_entropy", "nll_loss") and tgt.ndim == inp.ndim - 1
    ei, et = c.ent(inp), c.ent(tgt)
    if classes:
        if inp.ndim > 1 and ei[1]:
            c.refuse(f"reads the class scores along {_where(1, ei[1])}",
                     "keep the class dim whole")
        body = ei[:1] + ei[2:] if inp.ndim > 1 else ei
        if et != body and (any(et) or any(body)):
            c.refuse("the target is not split like the input's positions",
                     "split input and target the same way")
        per = body
    else:
        if c.name in ("cross_entropy", "nll_loss") and inp.ndim > 1 and ei[1]:
            c.refuse(f"reads the class scores along {_where(1, ei[1])}",
                     "keep the class dim whole")
        per = broadcast(c, [inp, tgt])
    if a.get("size_average") is not None or a.get("reduce") is not None:
        if any(per):
            c.refuse("uses the legacy size_average/reduce arguments", "pass reduction=")
    reduction = a.get("reduction", "mean")
    if reduction == "none" or not any(per):
        return c.out(c.call(), per if reduction == "none" else None)
    if c.name == "kl_div" and reduction == "batchmean" and per and per[0]:
        c.refuse(f"divides by the batch size, and {_where(0, per[0])}",
                 "use reduction='sum' and divide by the global batch size")
    twin_op = getattr(ops, c.name, None) if c.name in _OPS_LOSSES else None
    if twin_op is not None and (classes or tuple(inp.shape) == tuple(tgt.shape)):
        c.record("swapped", f"-> spmd.ops.{c.name}")
        if c.planning:
            return c.out(c.call(), None)
        spec = spec_of(ei)
        kw = {k: v for k, v in a.items() if k not in ("input", "target", "size_average",
                                                        "reduce") and v is not None}

        def ops_twin(*_, **__):
            return twin_op(inp, tgt, mesh=c.mesh, spec=spec, **kw)
        return c.out(c.call(ops_twin), None)
    c.record("swapped", f"-> {c.name}(reduction='none') and spmd.reduce")
    if c.planning:
        return c.out(c.call(), None)
    spec = spec_of(per)
    ba.arguments["reduction"] = "none"
    args, kwargs = ba.args, ba.kwargs

    def twin(*_, **__):
        local = c.func(*args, **kwargs)
        if reduction == "sum":
            return _reduce(local, c.mesh, spec, op="sum")
        if reduction == "batchmean":
            return _reduce(local, c.mesh, spec, op="sum") / inp.shape[0]
        return _reduce(local, c.mesh, spec, op="mean")
    return c.out(c.call(twin), None)
