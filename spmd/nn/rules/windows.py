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
from ...core._context import current_rank
from ...transforms.reduction import reduce as _reduce
from .. import flow
from .._tags import spec_of
from ._base import Call, _arg, _no_local_sizes, _where, broadcast, like_input, op_name


def _swap(c: Call, detail: str, make: Callable[[Any], Callable],
          out_layout: Callable[[Any], Any] | None = None) -> Any:
    """Run ``c`` as its twin where its input is split: ``make(spec)`` gives a function
    with the intercepted function's arguments (the plan runs the plain one on meta).
    The twin is given the input's ``Layout`` where it is known (no size exchange), and
    ``out_layout(layout)`` says how its output is split."""
    x = c.args[0]
    e = c.ent(x)
    if not any(e):
        return c.call()
    # only the windowed ops take a Layout for spec= (and need the sizes)
    lay = flow.layout(c.run, x) if out_layout is not None else None
    out = None
    if lay is not None:
        try:
            out = out_layout(lay)
        except Exception:  # noqa: BLE001 - the twin raises the real error, on every rank
            out = None
    c.record("swapped", detail + (f" ({flow.describe(out)})" if out is not None else ""))
    if c.planning:
        return c.out(c.call(), like_input(c, x), out)
    return c.out(c.call(make(lay if lay is not None else spec_of(e))), like_input(c, x), out)


def _layout_args(real: Callable, c: Call) -> tuple[tuple, dict]:
    """``c``'s arguments after the input, as ``real.output_layout`` takes them (a
    convolution's weight shape for its weight, no bias; a pad without its value)."""
    args, kwargs = list(c.args[1:]), dict(c.kwargs)
    if real.__name__.startswith("conv"):
        w = kwargs.pop("weight", None)
        if w is None and args:
            w = args.pop(0)
        kwargs.pop("bias", None)
        if args:
            args.pop(0)  # the bias
        args.insert(0, tuple(w.shape))
    if real.__name__ == "pad":
        args, kwargs = args[:2], {k: v for k, v in kwargs.items() if k != "value"}
    return tuple(args), kwargs


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

        def out_layout(lay):
            args, kwargs = _layout_args(real, c)
            return real.output_layout(lay, *args, **kwargs)
        return _swap(c, f"-> spmd.ops.{real.__name__}", make, out_layout)
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
        def out_layout(lay):
            args, kwargs = _layout_args(real, c)
            kwargs.pop("return_indices", None)
            return real.output_layout(lay, *args[:1 if real.__name__.startswith("adaptive")
                                                  else 5], **kwargs)
        return _swap(c, f"-> spmd.ops.{real.__name__}(return_indices=True)", make, out_layout)
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
        def out_layout(lay):
            k = _arg(c, "kernel_size", 2, None)
            return avg.output_layout(lay, k, _arg(c, "stride", 3, None), 0,
                                     _arg(c, "ceil_mode", 4, False))
        return _swap(c, f"-> pow, spmd.ops.avg_pool{n}d, pow (lp_pool{n}d's formula)", make,
                     out_layout)
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
    if not classes and isinstance(tgt, torch.Tensor):  # input and target split alike
        moved = flow.agree(c, [inp, tgt])
        if moved:
            a["input"], a["target"] = inp, tgt = moved.get(id(inp), inp), moved.get(id(tgt), tgt)
            c = Call(c.run, c.func, c.name, ba.args, ba.kwargs)
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


# -- a padding mode other than zeros: F.pad, then a conv without padding, as one op -------------

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_PAD_TWIN = _twin(ops.pad)
_MODES = ("reflect", "replicate", "circular")


def pad(c: Call) -> Any:
    """``F.pad``: its ``spmd.ops`` twin, whose edge ranks hold the padding. Inside a
    ``Conv1d/2d/3d`` layer with ``padding_mode`` reflect, replicate or circular (torch pads,
    then convolves without padding), the pad is deferred and joined with the conv that
    follows into ``spmd.ops.convNd(padding_mode=...)``: one length-keeping op, whose output
    keeps the input's shard sizes, with no padded copy. Any other use of the padded tensor
    makes it first."""
    x = c.args[0]
    e = c.ent(x)
    mode = _arg(c, "mode", 2, "constant")
    m = c.run.module_at()
    if not (any(e) and mode in _MODES and isinstance(m, _CONVS) and m.padding_mode == mode
            and _arg(c, "value", 3, None) is None):
        return _PAD_TWIN(c)
    p = tuple(int(v) for v in _arg(c, "pad", 1, ()))
    lay = flow.layout(c.run, x)
    padded = ops.pad.output_layout(lay, p, mode) if lay is not None else None
    if c.planning:
        ph = c.call()
    else:
        shape = padded.local_shape(current_rank(c.mesh))
        ph = c.call(lambda t: t.new_empty(shape), (x,), {})
    c.run.deferred[id(ph)] = (ph, x, p, mode)
    c.record("swapped", f"-> spmd.ops.conv{len(m.kernel_size)}d(padding_mode={mode!r}): "
                        f"joined with the {type(m).__name__}'s conv that follows")
    return c.out(ph, e, padded)


def materialize(run: Any, func: Callable, args: tuple, kwargs: dict) -> None:
    """Make the deferred pads that ``func``'s arguments hold, unless ``func`` is the conv
    that takes one in (``pad``)."""
    name = op_name(func)
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if not isinstance(t, torch.Tensor) or id(t) not in run.deferred:
                continue
            if name in ("conv1d", "conv2d", "conv3d") and args and t is args[0]:
                continue
            ph, x, p, mode = run.deferred.pop(id(t))
            if run.planning:
                continue  # the stand-in is the pad's shape already
            lay = flow.layout(run, x)
            padded = run.execute(lambda v: ops.pad(v, p, mode, mesh=run.mesh, spec=lay),
                                 (x,), {})
            run.internal += 1
            try:
                ph.copy_(padded)
            finally:
                run.internal -= 1


def conv(n: int):
    real = getattr(ops, f"conv{n}d")
    twin = _twin(real)

    def rule(c: Call) -> Any:
        x = c.args[0]
        got = c.run.deferred.pop(id(x), None) if isinstance(x, torch.Tensor) else None
        padding = _arg(c, "padding", 4, 0)
        if got is None:
            return twin(c)
        if not (padding == "valid" or all(v == 0 for v in ntuple_of(padding, n))):
            c.run.deferred[id(x)] = got
            materialize(c.run, lambda: None, (x,), {})
            return twin(c)
        _, src, p, mode = got
        pairs = tuple((p[2 * (n - 1 - i)], p[2 * (n - 1 - i) + 1]) if 2 * (n - i) <= len(p)
                      else (0, 0) for i in range(n))
        a = list(c.args) + [None] * (7 - len(c.args))
        weight = c.kwargs.get("weight", a[1])
        bias = c.kwargs.get("bias", a[2])
        stride = c.kwargs.get("stride", a[3] if a[3] is not None else 1)
        dilation = c.kwargs.get("dilation", a[5] if a[5] is not None else 1)
        groups = c.kwargs.get("groups", a[6] if a[6] is not None else 1)
        joined = Call(c.run, c.func, c.name, (src, weight, bias, stride, pairs, dilation, groups),
                      {})

        def make(spec):
            return lambda *_, **__: real(src, weight, bias, stride, pairs, dilation, groups,
                                         mesh=c.mesh, spec=spec, padding_mode=mode)

        def out_layout(lay):
            return real.output_layout(lay, tuple(weight.shape), stride, pairs, dilation, groups,
                                      padding_mode=mode)
        if c.planning:  # the plain conv of the padded stand-in
            joined = Call(c.run, c.func, c.name, c.args, c.kwargs)
            lay = flow.layout(c.run, src)
            out = out_layout(lay) if lay is not None else None
            c.record("swapped", f"-> spmd.ops.conv{n}d(padding_mode={mode!r})" +
                     (f" ({flow.describe(out)})" if out is not None else ""))
            return c.out(c.call(), like_input(c, x), out)
        return _swap(joined, f"-> spmd.ops.conv{n}d(padding_mode={mode!r})", make, out_layout)
    return rule


def ntuple_of(v: Any, n: int) -> tuple:
    if isinstance(v, (tuple, list)):
        return tuple(v)
    return (v,) * n
