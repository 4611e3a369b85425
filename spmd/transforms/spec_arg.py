"""The ``spec=`` argument: one reading and one set of checks for every function taking it.

Every function of ``spmd.ops`` and ``spmd.reduce`` reads ``spec=`` here, so every one
accepts the same three things and raises the same words:

- a ``P``: the split dims' shard sizes are not known; a function that needs them learns
  them from the ranks' local shapes (one small int64 all_gather, once per call site);
- a ``Layout``: its sizes are used as given, checked against this rank's shard, and no
  size is exchanged;
- ``x`` given as a ``spmd.Sharded`` (``Sharded.from_local`` in per-rank code): its layout
  is used as a ``Layout`` would be, ``spec=`` may be left out (and must agree if given),
  and the result comes back as a ``Sharded`` where it is a tensor with split dims.

All checks use only the arguments, which every rank holds alike, so every rank raises
the same ``SpecError`` before any communication (a shard of the wrong size raises on its
own rank, and ``launch``/``shard_map`` cancel the others).

Example:
    >>> mesh = spmd.Mesh((2,), ("sp",))
    >>> lay = spmd.Layout((5, 3), P("sp"), mesh, sizes={0: [5, 0]})
    >>> f = lambda x: spmd.reduce(x, mesh, lay, op="mean", dim=0)
    >>> spmd.shard_map(f, mesh, lay, P())(torch.ones(5, 3)).tolist()
    [1.0, 1.0, 1.0]
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core._context import RankContext, in_rank_of, on_mesh
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.provenance import check_spec
from ..core.spec import P, as_spec
from .sharded import Sharded, check_source

__all__ = ["SpecArg", "spec_arg", "layout_parts", "unwrap", "takes_sharded", "same_layout",
           "reduced_layout", "sequence_split", "last_dim_of_v"]


@dataclass(frozen=True)
class SpecArg:
    """``spec=`` read against ``x``: its ``P``, and its ``Layout`` where the sizes are
    known without communication (a ``Layout`` or a ``Sharded`` was given; else None)."""
    rc: RankContext
    spec: P
    layout: Layout | None


def spec_arg(x: torch.Tensor, mesh: Mesh, spec: Any, what: str, *,
             name: str = "x") -> SpecArg:
    """Check ``spec`` (a ``P``, a ``Layout``, or None/a tuple for a ``P``) for ``x``, this
    rank's shard, on ``mesh``; no communication.

    Raises:
        SpecError: ``what: ...``, one wording for every function: an axis the mesh does
            not have, more entries than ``x`` has dims, a Layout for another mesh or of
            another rank than ``x``'s, a spec that contradicts the split shard_map gave
            ``x``.
    """
    rc = on_mesh(mesh, what, x)
    if isinstance(spec, Layout):
        _for_mesh(spec, mesh, what)
        try:
            spec.size_check(x.shape, rc.rank, name)
        except SpecError as e:
            raise SpecError(f"{what}: {e}") from None
        check_spec(x, spec, mesh, what, name=name)
        return SpecArg(rc, spec.spec, spec)
    if isinstance(spec, Sharded):
        raise SpecError(f"{what}: spec= is a spmd.Sharded; pass it as {name} (its layout is "
                        f"then the spec), or pass its .layout as spec=")
    p = as_spec(spec, f"{what}: spec")
    if len(p) > x.ndim:
        raise SpecError(f"{what}: spec {p!r} has {len(p)} entries but {name} ({describe(x)}) "
                        f"has {x.ndim} dims; a spec may leave out trailing dims but not add dims")
    for a in p.axes:
        mesh.check_axes(a, f"{what}: spec")
    check_spec(x, p, mesh, what, name=name)
    return SpecArg(rc, p, None)


def _for_mesh(lay: Layout, mesh: Mesh, what: str) -> None:
    if not lay.is_for(mesh):
        raise SpecError(f"{what}: the layout is for a mesh "
                        f"{dict(zip(lay.axis_names, lay.mesh_shape))} but the call runs "
                        f"on {mesh!r}")


def layout_parts(spec: Any, sizes: Any, mesh: Mesh, what: str, name: str = "spec",
                 sizes_name: str = "sizes") -> tuple[Any, Any]:
    """``(spec, sizes)`` for a function taking both: a ``Layout`` given as ``spec`` gives
    its ``P`` and its sizes (then ``sizes`` must be left out); anything else as given."""
    if not isinstance(spec, Layout):
        return spec, sizes
    _for_mesh(spec, mesh, what)
    if sizes is not None:
        raise SpecError(f"{what}: {name} is a Layout, which holds the sizes; leave "
                        f"{sizes_name}= out")
    return spec.spec, {d: s for d, s in enumerate(spec.sizes) if s is not None} or None


def unwrap(x: Any, mesh: Mesh, spec: Any, what: str) -> tuple[Any, Any]:
    """``(this rank's shard, spec)`` for an argument that may be a ``Sharded``: its local
    shard and its layout (``spec``, if given, must describe it)."""
    if not isinstance(x, Sharded):
        return x, spec
    lay = check_source(x, mesh, spec, what)
    if not in_rank_of(mesh):
        raise SpecError(f"{what}: {x!r} is seen from outside the ranks of its threads mesh; "
                        f"call {what} in per-rank code (a spmd.shard_map body, which gets "
                        f"the shard, or a spmd.launch function, with Sharded.from_local)")
    return x.local, lay


def reduced_layout(lay: Layout, dims: Sequence[int], keepdim: bool) -> Layout:
    """The layout of a reduction of ``lay`` over ``dims``: those dims become unsplit
    (size 1 with ``keepdim``) or disappear; the other dims keep their split sizes."""
    dims = {d % max(lay.ndim, 1) for d in dims}
    keep = [d for d in range(lay.ndim) if keepdim or d not in dims]
    shape = [1 if d in dims else lay.shape[d] for d in keep]
    spec = P(*(None if d in dims else lay.spec.entry(d) for d in keep))
    sizes = {i: lay.sizes[d] for i, d in enumerate(keep)
             if d not in dims and lay.sizes[d] is not None}
    return Layout(shape, spec, _MeshShape(lay), sizes or None)


class _MeshShape:
    def __init__(self, lay: Layout):
        self.axis_names, self.shape = lay.axis_names, lay.mesh_shape


def takes_sharded(out_layout: Callable[[Layout, dict, Any], Layout | None] | None = None, *,
                  renames: dict[str, Callable[[dict], Any]] | None = None,
                  also: Sequence[str] = (),
                  check: Callable[[Layout, dict, str], None] | None = None
                  ) -> Callable[[Callable], Callable]:
    """Decorator: let the function's first argument (and the arguments named in ``also``)
    be a ``spmd.Sharded``. It runs on the local shards with the Sharded's layout as
    ``spec=``, and wraps each tensor result with split dims as a ``Sharded`` of
    ``out_layout(layout, arguments, result)`` (None: a plain tensor, replicated). Without
    ``out_layout``, the function's own ``output_layout(layout, ...)`` (attached by
    ``spmd.ops``) is fed the function's arguments of the same names (``renames``: an
    ``output_layout`` argument -> how to get it from the arguments). A function without
    ``spec=`` names its split otherwise: ``check(layout, arguments, name)`` raises where
    the Sharded's layout is not that split."""
    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        first = next(iter(sig.parameters))
        get = out_layout or _attached(fn.output_layout, renames or {})

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not any(isinstance(v, Sharded) for v in (*args, *kwargs.values())):
                return fn(*args, **kwargs)  # the common case: no binding, nothing to trace
            # partial: with x a Sharded, spec= (and mesh=) may be left out
            bound = sig.bind_partial(*args, **kwargs)
            x = bound.arguments.get(first)
            if not isinstance(x, Sharded):
                for n in also:  # x a tensor: a Sharded elsewhere gives its shard
                    v = bound.arguments.get(n)
                    if isinstance(v, Sharded):
                        bound.arguments[n] = v.local
                return fn(*bound.args, **bound.kwargs)
            what = fn.__name__
            mesh = bound.arguments.get("mesh", x.mesh)
            local, lay = unwrap(x, mesh, bound.arguments.get("spec"), what)
            bound.arguments[first] = local
            for n in also:
                v = bound.arguments.get(n)
                if isinstance(v, Sharded):
                    bound.arguments[n] = unwrap(v, mesh, None, what)[0]
            if "mesh" in sig.parameters:
                bound.arguments["mesh"] = mesh
            if check is not None:
                check(lay, bound.arguments, what)
            if "spec" in sig.parameters:
                bound.arguments["spec"] = lay
            y = fn(*bound.args, **bound.kwargs)
            return _wrap(y, get(lay, bound.arguments, y), mesh)
        return run
    return deco


def _wrap(y: Any, lay: Layout | None, mesh: Mesh) -> Any:
    if isinstance(y, tuple):
        return type(y)(_wrap(t, lay, mesh) for t in y)
    if lay is None or not isinstance(y, torch.Tensor) or not lay.split_dims:
        return y
    return Sharded({mesh.rank: y}, lay, mesh)


def sequence_split(lay: Layout, args: dict, what: str) -> None:
    """``check`` of the sequence-parallel attentions: the Sharded splits its ``seq_dim``
    over ``axis`` and nothing else."""
    axis, nd = args["axis"], lay.ndim
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    seq = args["seq_dim"] % nd if isinstance(args.get("seq_dim"), int) and nd else None
    if any(lay.dim_axes(d) != (axes if d == seq else ()) for d in range(nd)):
        raise SpecError(f"{what}: the Sharded is split as {lay.spec!r}, but axis={axis!r} and "
                        f"seq_dim={args.get('seq_dim')!r} split dim {seq} only; redistribute "
                        f"it first")


def last_dim_of_v(lay: Layout, args: dict, y: Any) -> Layout:
    """``out_layout`` of attention: q's layout with v's feature dim last (unsplit)."""
    return Layout((*lay.shape[:-1], args["v"].shape[-1]), lay.spec, _MeshShape(lay),
                  {d: lay.sizes[d] for d in lay.split_dims} or None)


def same_layout(lay: Layout, args: dict, y: Any) -> Layout:
    """``out_layout`` of a function whose result has its input's shape: the input's."""
    return lay


def _attached(ol: Callable[..., Layout], renames: dict[str, Callable[[dict], Any]]
              ) -> Callable[[Layout, dict, Any], Layout]:
    names = list(inspect.signature(ol).parameters)[1:]

    def get(lay: Layout, args: dict, y: Any) -> Layout:
        kw = {n: renames[n](args) if n in renames else args[n]
              for n in names if n in renames or n in args}
        return ol(lay, **kw)
    return get
