"""Random calls in a converted forward: which stream each draw comes from.

- A draw whose result is the same on several ranks (replicated: ``nn.Dropout`` after a
  mean over a split dim, a diffusion timestep ``torch.randint(0, 1000, (b,))``; or split
  over some mesh axes only) comes from a stream those ranks share (``streams.py``), so
  they draw the same numbers and the gradient is the gradient of the output.
- A draw on a tensor split over every mesh axis stays on the rank's own stream: each rank
  its own block, right in distribution and exact for its own gradient.
- A channel dropout (``nn.Dropout2d``) on split spatial dims draws its (sample, channel)
  mask from the shared stream: every rank drops the same channels.
- Under ``spmd.random.invariant(seed)`` every draw is a function of the seed, the draw's
  number and the global index of each element (this rank's offsets from the tensor's
  layout): the same on any mesh as on one device.

The plan (meta tensors) draws nothing: it sees the calls, and the threads mesh's
``rng="shared"`` is refused there, whose one generator the rank threads could not share
in step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import random as invariant
from ...random import calls, hashing
from .._tags import LocalSize, entries_of, plain, spec_of
from .. import streams
from ._base import Call, _arg, _tensors, broadcast, share
from .per_position import _size_args, pointwise, same

__all__ = ["is_random", "replicated", "rule_for", "opaque"]

_FEATURE = {"dropout1d": 1, "dropout2d": 2, "dropout3d": 3, "feature_alpha_dropout": -1,
            "feature_dropout": -1}
_SIZED = {"rand", "randn", "randint", "normal"}


def is_random(name: str) -> bool:
    return name in invariant.RANDOM


def _device(c: Call) -> torch.device:
    d = c.kwargs.get("device")
    if d is not None:
        return torch.device(d)
    t = next(iter(_tensors(c)), None)
    return t.device if t is not None else torch.get_default_device()


def _sizes(c: Call) -> list:
    if c.name == "randint":
        s = c.kwargs.get("size", next((a for a in c.args if isinstance(
            a, (tuple, list, torch.Size))), ()))
        return list(s)
    if c.name == "normal":
        s = _arg(c, "size", 2, ())
        return list(s) if isinstance(s, (tuple, list, torch.Size)) else [s]
    return _size_args(c)


def _entries(c: Call) -> tuple[tuple, int]:
    """The split of the draw's result, and how many leading dims its random numbers span
    (a channel dropout's mask: the sample and channel dims)."""
    ts = _tensors(c)
    if c.name in _SIZED and not ts:
        out = []
        for v in _sizes(c):
            if isinstance(v, LocalSize) and v.derived:
                c.refuse(f"draws a dim of size {share(c, v)}",
                         "make it from the shard's own size, or globally")
            out.append(v.origin[1] if isinstance(v, LocalSize) else None)
        e = tuple(out)
    elif c.name in ("bernoulli", "normal") and len(ts) > 1:
        e = broadcast(c, ts)
    else:
        e = c.ent(ts[0]) if ts else ()
    feature = _FEATURE.get(c.name)
    return e, calls.feature_dims(len(e), feature) if feature else len(e)


def _key(c: Call, entries: tuple) -> tuple | None:
    """The group key of this rank for a draw split like ``entries`` (its coordinates
    along the split axes), or None where every rank holds its own block."""
    if not _shares(c, entries):
        return None
    mesh = c.mesh
    axes = {a for e in entries if e for a in e}
    coords = mesh.coords(streams.rank_of(c.run)) if axes else ()
    return tuple((n, coords[k]) for k, n in enumerate(mesh.axis_names) if n in axes)


def _shares(c: Call, entries: tuple) -> bool:
    """Whether several ranks hold the same block of a draw split like ``entries``."""
    axes = {a for e in entries if e for a in e}
    return not all(n in axes or s == 1 for n, s in zip(c.mesh.axis_names, c.mesh.shape))


def _shared_refused(c: Call, entries: tuple) -> str:
    """Why a shared draw cannot run here (planning), or ''."""
    mesh = c.mesh
    if _shares(c, entries) and c.kwargs.get("generator") is not None:
        return ("draws a value several ranks hold alike from the generator= it is given, "
                "which each rank advances on its own")
    if _shares(c, entries) and mesh.backend == "threads" and mesh.size > 1 and mesh.rng == "shared":
        return ("draws a value several ranks hold alike, and the threads mesh has "
                "rng='shared': its rank threads draw from torch's one generator in "
                "whatever order they run, so they would draw different numbers")
    return ""


_SHARED_FIX = ("leave generator= out, and use Mesh(..., rng='per_rank') (the default): "
               "convert draws it from a stream the ranks share")


def replicated(run: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A random call none of whose arguments is split: every rank draws the same."""
    name = getattr(func, "__name__", "")
    if calls.draws_nothing(name, args, kwargs) or run.mesh.size == 1:
        return run.execute(func, args, kwargs)
    c = Call(run, func, name, args, kwargs)
    if run.planning:
        problem = _shared_refused(c, ())
        if invariant.active() is not None and invariant.in_checkpoint():
            problem = invariant.IN_CHECKPOINT
        run.record("refused" if problem else "swapped", c,
                   f"{problem}; {_SHARED_FIX}" if problem else
                   "replicated draw -> the stream the ranks share", step=False)  # plan only
        return run.execute(func, args, kwargs)
    if invariant.active() is not None:  # global index = local index: the context does it
        return run.execute(func, args, kwargs)
    with streams.use(run, (), _device(c)):
        return run.execute(func, args, kwargs)


def opaque(run: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A random call inside a layer convert does not look into."""
    if not run.planning and invariant.active() is not None:
        from ...core.errors import SpecError
        raise SpecError(f"convert: {run.where()}: {getattr(func, '__name__', func)} is drawn "
                        f"inside a layer convert does not look into (allow=, types=), "
                        f"whose split it does not follow: under spmd.random.invariant it "
                        f"would draw by this rank's local indices; let convert look into "
                        f"the layer, or draw outside the invariant context")
    return run.execute(func, args, kwargs)


def rule_for(name: str, base: Callable) -> Callable:
    """The rule of a random call with split arguments: ``base`` (the call's own rule),
    run with the stream its draw comes from."""
    base = _BASES.get(name, base)

    def rule(c: Call) -> Any:
        if calls.draws_nothing(name, c.args, c.kwargs):
            return base(c)
        entries, lead = _entries(c)
        if c.planning:
            if invariant.active() is not None and invariant.in_checkpoint():
                c.refuse(invariant.IN_CHECKPOINT)
            problem = _shared_refused(c, entries[:lead])
            if problem:
                c.refuse(problem, _SHARED_FIX)
            if _shares(c, entries[:lead]):
                c.record("swapped", "(sample, channel) mask -> the stream the ranks share"
                         if name in _FEATURE else "drawn alike by the ranks holding the same "
                         "block -> the stream they share", step=False)  # in the plan only
            return base(c)
        inv = invariant.active()
        if inv is not None:
            return _invariant(c, inv, entries)
        key = _key(c, entries[:lead])
        if key is None:
            return base(c)
        with streams.use(c.run, key, _device(c)):
            return base(c)
    return rule


def _invariant(c: Call, inv: invariant.Stream, entries: tuple) -> Any:
    """The draw as a function of (seed, draw, global index): indices from the layout of
    the drawn tensor (one small size exchange, cached in shard_map)."""
    def index_of(shape, device, lead):
        e = tuple(entries[:lead]) + (None,) * (len(shape) - lead)
        if not any(e):
            return hashing.local_index(shape, device)
        from ...ops._window import input_layout
        probe = torch.empty((), device=device).expand(tuple(shape))
        rc, lay = c.call(lambda t: input_layout(t, c.mesh, spec_of(e), "convert"),
                         (probe,), {})
        return hashing.global_index(shape, lay.shape, lay.offsets(rc.rank), device)
    args = tuple(plain(a) for a in c.args)
    kwargs = {k: plain(v) for k, v in c.kwargs.items()}
    res = inv.apply(c.func, c.name, args, kwargs, index_of)
    return c.out(res, entries if isinstance(res, torch.Tensor) and res.ndim == len(entries)
                 else None)


def _sized(c: Call) -> Any:
    """rand, randn, randint, normal with a size: split like the sizes it is given."""
    entries, _ = _entries(c)
    res = c.call()
    if isinstance(res, torch.Tensor) and len(entries) == res.ndim and any(entries):
        return c.out(res, entries)
    return res


def _feature_dropout(c: Call) -> Any:
    """Dropout of whole channels on split dims: the (sample, channel) mask drawn on every
    rank, an empty shard too (torch's kernel skips an empty input, which would leave the
    stream behind on that rank)."""
    x = c.args[0]
    e = entries_of(x, c.mesh)
    p = float(_arg(c, "p", 1, 0.5))
    if not _arg(c, "training", 2, True) or p == 0:
        return same(c)
    lead = calls.feature_dims(x.ndim, _FEATURE[c.name])
    if not any(e[lead:]):
        return same(c)
    inplace = bool(_arg(c, "inplace", 3, False))
    alpha = "alpha" in c.name

    def drop(t: torch.Tensor) -> torch.Tensor:
        shape = tuple(t.shape[:lead]) + (1,) * (t.ndim - lead)
        keep = torch.empty(shape, dtype=torch.float32, device=t.device).bernoulli_(1 - p)
        return calls.apply_mask(t, keep.bool(), p, alpha, inplace)
    return c.out(c.call(drop, (x,), {}), e)


def _normal(c: Call) -> Any:
    return pointwise(c) if _tensors(c) else _sized(c)


_BASES: dict[str, Callable] = {
    "rand": _sized, "randn": _sized, "randint": _sized, "normal": _normal,
    **{n: _feature_dropout for n in _FEATURE},
}
