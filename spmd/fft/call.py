"""One call of a transform: torch.fft's arguments read and checked, the plan made
(``plan.py``), and run on this rank's shard (local torch.fft stages, ``transpose``s).

Every check runs before anything moves and reads only what every rank shares (the
global layout, the dtype), so a bad call raises the same SpecError on every rank.

Backward is exact by construction: torch.fft's own backward for each local stage (the
adjoint of an ``rfft`` is not an ``irfft``: torch weights the bins that stand for two,
and we use its rule rather than a copy of it) and, for each transpose, the transpose the
other way. Nothing else is in the graph (the plan is bookkeeping, outside autograd), so
double backward works wherever torch.fft's does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

from ..core._context import RankContext, in_rank_of
from ..core._format import describe, dtype_str, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import as_spec
from ..mapping import shard_map
from ..ops._window import input_layout
from ..transforms.redistribution import redistribute
from ..transforms.sharded import Sharded, check_source
from . import modes as _modes
from . import plan as _plan
from .transpose import transpose

__all__ = ["transform", "with_layout", "run", "check"]

_TORCH: dict[str, Callable] = {"fft": torch.fft.fftn, "ifft": torch.fft.ifftn,
                               "rfft": torch.fft.rfftn, "irfft": torch.fft.irfftn}
_NORMS = (None, "backward", "forward", "ortho")


# -- arguments, as torch.fft reads them ---------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: Any, name: str, what: str) -> tuple[int, ...]:
    if _is_int(v):
        return (v,)
    if isinstance(v, Sequence) and not isinstance(v, str) and all(_is_int(e) for e in v):
        return tuple(v)
    raise SpecError(f"{what}: {name} must be an int or a sequence of ints, got {v!r}")


def _args(what: str, family: str, n_or_s: Any, dim: Any, ndim: int, kind: str,
          ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(dims in torch's order, non-negative; the signal sizes given, -1 for 'as is')."""
    if family == "1d":
        if not _is_int(dim):
            raise SpecError(f"{what}: dim must be an int, got {dim!r}")
        dims = (dim,)
        if n_or_s is not None and (not _is_int(n_or_s) or n_or_s < 1):
            raise SpecError(f"{what}: n must be a positive int (or None for the dim's "
                            f"length), got {n_or_s!r}")
        s = None if n_or_s is None else (n_or_s,)
    else:
        s = None if n_or_s is None else _ints(n_or_s, "s", what)
        if dim is None:
            dims = tuple(range(ndim)) if s is None else tuple(range(ndim - len(s), ndim))
            if s is not None and len(s) > ndim:
                raise SpecError(f"{what}: s has {len(s)} entries but x has {ndim} dims")
        else:
            dims = _ints(dim, "dim", what)
        if s is not None and len(s) != len(dims):
            raise SpecError(f"{what}: s has {len(s)} entries ({list(s)}) but dim has "
                            f"{len(dims)} ({list(dims)}); give one signal size per "
                            f"transformed dim")
        if s is not None and any(v < 1 and v != -1 for v in s):
            raise SpecError(f"{what}: every entry of s must be positive (or -1 for the dim's "
                            f"length), got {list(s)}")
    for d in dims:
        if not -ndim <= d < ndim:
            raise SpecError(f"{what}: dim {d} is out of range for a {ndim}-d input (dims "
                            f"{-ndim} to {ndim - 1})")
    dims = tuple(d % ndim for d in dims)
    if len(set(dims)) != len(dims):
        raise SpecError(f"{what}: dim {list(dims)} names a dim twice; each dim is "
                        f"transformed once")
    if not dims and kind in ("rfft", "irfft"):
        raise SpecError(f"{what} must transform at least one dim")
    return dims, s


def _lengths(what: str, kind: str, shape: tuple[int, ...], dims: tuple[int, ...],
             s: tuple[int, ...] | None) -> tuple[int, ...]:
    """The signal size of every transformed dim (an irfft's: of its output)."""
    out = []
    for i, d in enumerate(dims):
        n = s[i] if s is not None and s[i] != -1 else None
        if n is None:
            n = 2 * (shape[d] - 1) if kind == "irfft" and i == len(dims) - 1 else shape[d]
        if n < 1:
            raise SpecError(
                f"{what}: dim {d} of the global input {shape_str(shape)} would be transformed "
                f"over {n} points; pass s (or n) with a positive size")
        out.append(n)
    return tuple(out)


def _check_dtype(what: str, kind: str, x: torch.Tensor | Sharded) -> None:
    """torch.fft's dtype rules, checked here so that a rank with an empty shard (which
    calls no torch.fft) raises as the others do."""
    # dtype only: the shards' shapes differ from rank to rank, the words must not
    if kind == "rfft" and x.dtype.is_complex:
        raise SpecError(f"{what} expects a real input, got a {dtype_str(x.dtype)} tensor; use "
                        f"spmd.fft.{what.replace('rfft', 'fft')} for a complex one")
    why = _unsupported(kind, x.dtype, x.device)
    if why:
        raise SpecError(f"{what}: torch.fft cannot transform {dtype_str(x.dtype)} tensors on "
                        f"{x.device.type} ({why}); cast it first")


@lru_cache(maxsize=64)
def _unsupported(kind: str, dtype: torch.dtype, device: torch.device) -> str | None:
    try:
        _TORCH[kind](torch.zeros(2, dtype=dtype, device=device))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def check(what: str, kind: str, x: torch.Tensor, p: _plan.Plan) -> None:
    """torch.fft's dtype rules for ``x`` running plan ``p`` as ``kind``, on every rank alike."""
    _check_dtype(what, kind, x)
    _check_half(what, x, p)


def _check_half(what: str, x: torch.Tensor, p: _plan.Plan) -> None:
    """Half precision transforms (cuFFT) take powers of two only."""
    if x.dtype not in (torch.float16, torch.complex32):
        return
    bad = [n for st in p.steps if isinstance(st, _plan.Stage) for n in st.s if n & (n - 1)]
    if bad:
        raise SpecError(f"{what}: in half precision torch.fft transforms lengths that are "
                        f"powers of two only, got {bad}; pad with s= or cast to float32")


@lru_cache(maxsize=512)
def _planned(kind: str, what: str, lay: Layout, dims: tuple[int, ...],
             s: tuple[int, ...] | None, out_spec: Any) -> _plan.Plan:
    """The checked plan of one call (the same on every rank, so is any error)."""
    lengths = _lengths(what, kind, lay.shape, dims, s)
    split = _plan.split_dims(lay, dims)
    if len(split) > 2:
        raise SpecError(
            f"{what}: the input's layout {lay!r} splits {len(split)} of the transformed dims "
            f"{list(dims)} (dims {list(split)}); a slab (one) or a pencil (two) is "
            f"supported: keep one of them whole (redistribute first)")
    make = _plan.forward if kind in ("fft", "rfft") else _plan.inverse
    default = make(kind, lay, dims, lengths)
    want = _want(what, out_spec, default.out)
    return default if want is None or want == default.out else make(kind, lay, dims, lengths,
                                                                     want)


def _want(what: str, out_spec: Any, default: Layout) -> Layout | None:
    """The requested output layout: a Layout as given, a P with the default's sizes on the
    dims it cuts the same way (balanced elsewhere)."""
    if out_spec is None:
        return None
    mesh = _plan._MeshShape(default.axis_names, default.mesh_shape)
    if isinstance(out_spec, Layout):
        if (out_spec.axis_names, out_spec.mesh_shape) != mesh:
            raise SpecError(f"{what}: out_spec {out_spec!r} is for a mesh "
                            f"{dict(zip(out_spec.axis_names, out_spec.mesh_shape))}, not the "
                            f"input's {dict(zip(*mesh))}")
        if out_spec.shape != default.shape:
            raise SpecError(f"{what}: out_spec {out_spec!r} is for a tensor of "
                            f"{shape_str(out_spec.shape)}, but the output is "
                            f"{shape_str(default.shape)}")
        return out_spec
    try:
        spec = as_spec(out_spec, "out_spec")
        probe = Layout(default.shape, spec, mesh)
        return Layout(default.shape, spec, mesh, {
            d: default.sizes[d] for d in probe.split_dims
            if probe.dim_axes(d) == default.dim_axes(d)} or None)
    except SpecError as e:
        raise SpecError(f"{what}: out_spec: {e}") from None


# -- running a plan -----------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _out_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    return _TORCH[kind](torch.empty(2, dtype=dtype, device="meta")).dtype


def _stage(x: torch.Tensor, st: _plan.Stage, norm: str | None, rank: int) -> torch.Tensor:
    if x.numel():
        return _TORCH[st.kind](x, s=st.s, dim=st.dims, norm=norm)
    # No data here (an empty shard): torch.fft refuses empty batches on some devices. The
    # result is zeros of the right shape (zeros also where s pads an empty dim), still
    # tied to x so this rank's transposes run in backward like everyone else's.
    out = x.new_zeros(st.layout.local_shape(rank), dtype=_out_dtype(st.kind, x.dtype))
    if x.requires_grad:
        z = x.sum() * 0
        out = out + (z.real if z.is_complex() and not out.is_complex() else z)
    return out


def run(x: torch.Tensor, rc: RankContext, p: _plan.Plan, norm: str | None) -> torch.Tensor:
    """This rank's shard through the steps of ``p`` (a plan of ``plan.py`` or ``modes.py``)."""
    if p.lifted:
        x = x.unsqueeze(0)
    for st in p.steps:
        if isinstance(st, _plan.Stage):
            x = _stage(x, st, norm, rc.rank)
        elif isinstance(st, _plan.Transpose):
            x = transpose(x, rc, st.src, st.layout, st.axes)
        elif isinstance(st, _modes.Keep):
            x = _modes.keep(x, st)
        elif isinstance(st, _modes.Pad):
            x = _modes.pad(x, st)
        elif isinstance(st, _plan.Crop):
            want = st.layout.local_shape(rc.rank)
            for d, (have, keep) in enumerate(zip(x.shape, want)):
                if have != keep:
                    x = x.narrow(d, 0, keep)
        else:
            x = redistribute(x, rc.mesh, st.src.spec, st.layout.spec, src_sizes=st.src,
                             dst_sizes={d: v for d, v in enumerate(st.layout.sizes)
                                        if v is not None})
    return x.squeeze(0) if p.lifted else x


def transform(kind: str, what: str, family: str, x: Any, n_or_s: Any, dim: Any,
              norm: str | None, mesh: Mesh | None, spec: Any, out_spec: Any) -> Any:
    """torch.fft's ``kind`` (n-d) as the public function ``what`` of ``family`` (1d: ``n``
    and an int ``dim``; 2d and nd: ``s`` and dims) on ``x``: this rank's shard of the
    result, or a Sharded for a Sharded."""
    if norm not in _NORMS:
        raise SpecError(f"{what}: norm must be None, 'backward', 'forward' or 'ortho', got "
                        f"{norm!r}")
    if isinstance(x, Sharded):
        return _sharded(kind, what, family, x, n_or_s, dim, norm, mesh, spec, out_spec)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected this rank's shard as a tensor (or a "
                        f"spmd.Sharded), got {describe(x)}")
    if mesh is None or spec is None:
        raise TypeError(f"{what}: pass mesh= and spec= (a P or the Layout of the global "
                        f"tensor x is a shard of); a spmd.Sharded knows both")
    dims, s = _args(what, family, n_or_s, dim, x.ndim, kind)
    _check_dtype(what, kind, x)
    rc, lay = input_layout(x, mesh, spec, what)
    p = _planned(kind, what, lay, dims, s, _hashable(out_spec))
    _check_half(what, x, p)
    return run(x, rc, p, norm)


def _hashable(out_spec: Any) -> Any:
    """``out_spec`` as a key of the plan cache (a list spec becomes a tuple)."""
    if isinstance(out_spec, list):
        out_spec = tuple(tuple(e) if isinstance(e, list) else e for e in out_spec)
    try:
        hash(out_spec)
    except TypeError:
        raise SpecError(f"out_spec must be a spmd.P or a Layout (or None), got "
                        f"{describe(out_spec)}") from None
    return out_spec


def _sharded(kind, what, family, x: Sharded, n_or_s, dim, norm, mesh, spec, out_spec) -> Sharded:
    mesh = x.mesh if mesh is None else mesh
    lay = check_source(x, mesh, spec, what)
    dims, s = _args(what, family, n_or_s, dim, x.ndim, kind)
    _check_dtype(what, kind, x)
    out = _planned(kind, what, lay, dims, s, _hashable(out_spec)).out

    def local(t: torch.Tensor) -> torch.Tensor:
        return transform(kind, what, family, t, n_or_s, dim, norm, mesh, lay, out)

    if in_rank_of(mesh):
        return Sharded({mesh.rank: local(x.local)}, out, mesh)
    if x.requires_grad:
        y = shard_map(local, mesh, lay, out)(x)
    else:  # nothing to differentiate: no autograd nodes for the transposes either
        with torch.no_grad():
            y = shard_map(local, mesh, lay, out)(x)
    return y if isinstance(y, Sharded) else Sharded.from_global(y, mesh, out)


def _output_layout(kind: str, what: str, family: str) -> Callable[..., Layout]:
    def layout_of(layout: Layout, n_or_s: Any, dim: Any, out_spec: Any) -> Layout:
        if not isinstance(layout, Layout):
            raise TypeError(f"{what}.output_layout: expected the input's Layout, got "
                            f"{describe(layout)}")
        dims, s = _args(what, family, n_or_s, dim, layout.ndim, kind)
        return _planned(kind, what, layout, dims, s, _hashable(out_spec)).out

    if family == "1d":
        def output_layout(layout: Layout, n: int | None = None, dim: int = -1, *,
                          out_spec: Any = None) -> Layout:
            return layout_of(layout, n, dim, out_spec)
    elif family == "2d":
        def output_layout(layout: Layout, s: Sequence[int] | None = None,
                          dim: Sequence[int] = (-2, -1), *, out_spec: Any = None) -> Layout:
            return layout_of(layout, s, dim, out_spec)
    else:
        def output_layout(layout: Layout, s: Sequence[int] | None = None,
                          dim: Sequence[int] | None = None, *, out_spec: Any = None) -> Layout:
            return layout_of(layout, s, dim, out_spec)
    output_layout.__doc__ = (
        f"The layout of ``spmd.fft.{what}``'s output for an input laid out by ``layout`` "
        f"(the other arguments as for {what}), without running anything.")
    return output_layout


def with_layout(kind: str, family: str) -> Callable[[Callable], Callable]:
    """Decorator: give a public transform its ``output_layout``."""
    def attach(fn: Callable) -> Callable:
        fn.output_layout = _output_layout(kind, fn.__name__, family)
        return fn
    return attach
