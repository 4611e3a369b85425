"""The twelve transforms: torch.fft's functions on this rank's shard of a tensor split
along its dims, each the shard of torch.fft's result on the global tensor.

Each call reads and checks its arguments, plans (``plan.py``: pure arithmetic, the same
on every rank) and runs the plan (``call.py``): local torch.fft calls on the dims each
rank holds whole, a ``transpose`` (one all_to_all) between them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core.mesh import Mesh
from ..transforms.sharded import Sharded
from .call import transform as _transform
from .call import with_layout as _with_layout

__all__ = ["fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn",
           "ifftn", "rfftn", "irfftn"]


# -- the public functions -----------------------------------------------------------------------

@_with_layout("fft", "nd")
def fftn(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
         dim: Sequence[int] | None = None, norm: str | None = None, *,
         mesh: Mesh | None = None, spec: Any = None,
         out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.fftn`` of a tensor split along its dims: this rank's shard of the result.

    The dims each rank holds whole are transformed locally; a split transformed dim is
    made whole by moving its mesh axes to a dim already transformed (one all_to_all), and
    so on: a slab (one split transformed dim) takes one transpose, a pencil (two) two.
    Dims split but not transformed stay split. The default output is the layout the last
    transpose leaves (no transpose back); ``ifftn`` returns from it to the input's.

    Args:
        x: this rank's shard, or a ``spmd.Sharded`` (which knows its mesh and layout; the
            result is then a Sharded too).
        s, dim, norm: as ``torch.fft.fftn`` (signal sizes, pad or crop; -1 keeps a dim).
        mesh: the mesh this code runs on.
        spec: ``x``'s layout: a ``P`` (the ranks exchange their shapes once) or a
            ``Layout`` (no exchange).
        out_spec: the output's layout, a ``P`` or a ``Layout``; default: as the plan
            leaves it (``fftn.output_layout`` tells which, without running anything).

    Returns:
        This rank's shard of ``torch.fft.fftn(x_global, s, dim, norm)``, laid out by
        ``fftn.output_layout(layout, s, dim, out_spec=out_spec)``.

    Raises:
        SpecError: on every rank before anything moves: a dim out of range or named
            twice, ``s`` of another length than ``dim``, a size below 1, a bad ``norm``,
            a layout splitting more than two transformed dims, an ``out_spec`` that does
            not fit.

    Backward:
        The adjoint: torch.fft's backward of each local stage and each transpose run the
        other way (one all_to_all each, as in forward).

    Ranks without data:
        A rank whose shard is empty sends nothing, receives its part at each transpose
        and returns its (possibly empty) part of the result.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(6, 5, dtype=torch.complex128)
        >>> lay = Layout(x.shape, P("sp"), mesh)
        >>> out = spmd.fft.fftn.output_layout(lay)
        >>> out
        Layout([6, 5], P(None, 'sp'), sp=[3, 2])
        >>> y = spmd.shard_map(lambda t: spmd.fft.fftn(t, mesh=mesh, spec=lay), mesh,
        ...                    lay, out)(x)
        >>> torch.allclose(y, torch.fft.fftn(x))
        True
    """
    return _transform("fft", "fftn", "nd", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("ifft", "nd")
def ifftn(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
          dim: Sequence[int] | None = None, norm: str | None = None, *,
          mesh: Mesh | None = None, spec: Any = None,
          out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.ifftn`` of a split tensor; arguments as ``fftn``.

    The default output is the layout ``fftn`` would have turned into ``x``'s, reached by
    ``fftn``'s plan run backwards (as many transposes). Where several lead there, the one
    with the fewest transposes, then the one splitting the earlier dims, is chosen: so a
    slab or pencil over the first transformed dims comes back as it was (with balanced
    sizes). Pass ``out_spec=`` the input's Layout to come back to any other layout or
    uneven sizes; that costs no more transposes than ``fftn`` took.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(6, 5, dtype=torch.complex128)
        >>> lay = Layout(x.shape, P("sp"), mesh)
        >>> freq = spmd.fft.fftn.output_layout(lay)
        >>> spmd.fft.ifftn.output_layout(freq) == lay
        True
        >>> f = lambda t: spmd.fft.ifftn(spmd.fft.fftn(t, mesh=mesh, spec=lay), mesh=mesh,
        ...                              spec=freq)
        >>> torch.allclose(spmd.shard_map(f, mesh, lay, lay)(x), x)
        True
    """
    return _transform("ifft", "ifftn", "nd", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("rfft", "nd")
def rfftn(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
          dim: Sequence[int] | None = None, norm: str | None = None, *,
          mesh: Mesh | None = None, spec: Any = None,
          out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.rfftn`` of a real tensor split along its dims; arguments as ``fftn``.

    The last transformed dim is halved (``s[-1] // 2 + 1`` bins) and transformed first,
    locally: with H split, a 2-d ``rfftn`` over (H, W) runs rfft(W), one transpose (W'
    split, H whole), fft(H). Splitting the last transformed dim costs one transpose more
    (its real values move first); split another dim where you can.

    Raises:
        SpecError: as ``fftn``, and for a complex ``x``.

    Backward:
        torch's own backward of each local stage (an rfft's adjoint is not an irfft: the
        bins that stand for two are weighted, and torch's rule does it), and each
        transpose the other way.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(1, 2, 8, 6)
        >>> lay = Layout(x.shape, P(None, None, "sp"), mesh)
        >>> out = spmd.fft.rfftn.output_layout(lay, dim=(2, 3))
        >>> out
        Layout([1, 2, 8, 4], P(None, None, None, 'sp'), sp=[2, 2])
        >>> y = spmd.shard_map(lambda t: spmd.fft.rfftn(t, dim=(2, 3), mesh=mesh, spec=lay),
        ...                    mesh, lay, out)(x)
        >>> torch.allclose(y, torch.fft.rfftn(x, dim=(2, 3)), atol=1e-5)
        True
    """
    return _transform("rfft", "rfftn", "nd", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("irfft", "nd")
def irfftn(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
           dim: Sequence[int] | None = None, norm: str | None = None, *,
           mesh: Mesh | None = None, spec: Any = None,
           out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.irfftn`` of a tensor split along its dims; arguments as ``fftn``.

    ``s`` gives the output's sizes as in torch (pass it when the last one is odd: the
    default is ``2 * (n - 1)``). The default output is the layout ``rfftn`` would have
    turned into ``x``'s, by its plan run backwards, as ``ifftn`` does for ``fftn``: a slab
    or pencil over the first transformed dims comes back as it was (balanced sizes), with
    as many transposes as ``rfftn`` took. ``out_spec=`` the input's Layout brings back
    uneven sizes or any other layout (one that split the last dim, say), at no more
    transposes than ``rfftn`` took.

    Backward:
        As ``rfftn``'s: torch's backward of each stage, each transpose the other way.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(1, 2, 7, 5, dtype=torch.float64)
        >>> lay = Layout(x.shape, P(None, None, "sp"), mesh)
        >>> freq = spmd.fft.rfftn.output_layout(lay, dim=(2, 3))
        >>> def f(t):
        ...     y = spmd.fft.rfftn(t, dim=(2, 3), mesh=mesh, spec=lay)
        ...     return spmd.fft.irfftn(y, s=(7, 5), dim=(2, 3), mesh=mesh, spec=freq)
        >>> torch.allclose(spmd.shard_map(f, mesh, lay, lay)(x), x)
        True
    """
    return _transform("irfft", "irfftn", "nd", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("fft", "2d")
def fft2(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
         dim: Sequence[int] = (-2, -1), norm: str | None = None, *, mesh: Mesh | None = None,
         spec: Any = None, out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.fft2``: ``fftn`` over ``dim`` (the last two by default).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(5, 4, dtype=torch.complex128)
        >>> f = lambda t: spmd.fft.fft2(t, mesh=mesh, spec=P("sp"))
        >>> y = spmd.shard_map(f, mesh, P("sp"), P(None, "sp"))(x)
        >>> torch.allclose(y, torch.fft.fft2(x))
        True
    """
    return _transform("fft", "fft2", "2d", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("ifft", "2d")
def ifft2(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
          dim: Sequence[int] = (-2, -1), norm: str | None = None, *, mesh: Mesh | None = None,
          spec: Any = None, out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.ifft2``: ``ifftn`` over ``dim`` (the last two by default).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(5, 4, dtype=torch.complex128)
        >>> f = lambda t: spmd.fft.ifft2(t, mesh=mesh, spec=P(None, "sp"))
        >>> y = spmd.shard_map(f, mesh, P(None, "sp"), P("sp"))(x)
        >>> torch.allclose(y, torch.fft.ifft2(x))
        True
    """
    return _transform("ifft", "ifft2", "2d", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("rfft", "2d")
def rfft2(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
          dim: Sequence[int] = (-2, -1), norm: str | None = None, *, mesh: Mesh | None = None,
          spec: Any = None, out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.rfft2``: ``rfftn`` over ``dim`` (the last two by default).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = spmd.Sharded.from_global(torch.randn(6, 8), mesh, P("sp"))
        >>> y = spmd.fft.rfft2(x)                    # a Sharded knows its mesh and layout
        >>> y
        Sharded(c64[6, 5], P(None, 'sp'), sp=[3, 2], shards on ranks [0, 1])
        >>> torch.allclose(spmd.gather(y, mesh), torch.fft.rfft2(spmd.gather(x, mesh)))
        True
    """
    return _transform("rfft", "rfft2", "2d", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("irfft", "2d")
def irfft2(x: torch.Tensor | Sharded, s: Sequence[int] | None = None,
           dim: Sequence[int] = (-2, -1), norm: str | None = None, *,
           mesh: Mesh | None = None, spec: Any = None,
           out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.irfft2``: ``irfftn`` over ``dim`` (the last two by default).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = spmd.Sharded.from_global(torch.randn(6, 7), mesh, P("sp"))
        >>> y = spmd.fft.irfft2(spmd.fft.rfft2(x), s=(6, 7))
        >>> y.layout == x.layout and torch.allclose(spmd.gather(y, mesh),
        ...                                         spmd.gather(x, mesh), atol=1e-6)
        True
    """
    return _transform("irfft", "irfft2", "2d", x, s, dim, norm, mesh, spec, out_spec)


@_with_layout("fft", "1d")
def fft(x: torch.Tensor | Sharded, n: int | None = None, dim: int = -1,
        norm: str | None = None, *, mesh: Mesh | None = None, spec: Any = None,
        out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.fft`` along one dim of a split tensor; arguments as ``fftn``.

    A whole ``dim`` is transformed locally. A split one takes a transpose to the largest
    dim not transformed and one back, so the output is split as the input was (a 1-d
    tensor borrows a unit dim: one rank does the work).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(3, 10, dtype=torch.complex128)
        >>> f = lambda t: spmd.fft.fft(t, mesh=mesh, spec=P(None, "sp"))
        >>> y = spmd.shard_map(f, mesh, P(None, "sp"), P(None, "sp"))(x)
        >>> torch.allclose(y, torch.fft.fft(x))
        True
    """
    return _transform("fft", "fft", "1d", x, n, dim, norm, mesh, spec, out_spec)


@_with_layout("ifft", "1d")
def ifft(x: torch.Tensor | Sharded, n: int | None = None, dim: int = -1,
         norm: str | None = None, *, mesh: Mesh | None = None, spec: Any = None,
         out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.ifft`` along one dim of a split tensor; see ``fft``.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(3, 10, dtype=torch.complex128)
        >>> f = lambda t: spmd.fft.ifft(t, dim=0, mesh=mesh, spec=P("sp"))
        >>> y = spmd.shard_map(f, mesh, P("sp"), P("sp"))(x)
        >>> torch.allclose(y, torch.fft.ifft(x, dim=0))
        True
    """
    return _transform("ifft", "ifft", "1d", x, n, dim, norm, mesh, spec, out_spec)


@_with_layout("rfft", "1d")
def rfft(x: torch.Tensor | Sharded, n: int | None = None, dim: int = -1,
         norm: str | None = None, *, mesh: Mesh | None = None, spec: Any = None,
         out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.rfft`` along one dim of a split real tensor; see ``fft``.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(4, 9)
        >>> f = lambda t: spmd.fft.rfft(t, mesh=mesh, spec=P("sp"))
        >>> y = spmd.shard_map(f, mesh, P("sp"), P("sp"))(x)
        >>> torch.allclose(y, torch.fft.rfft(x), atol=1e-5)
        True
    """
    return _transform("rfft", "rfft", "1d", x, n, dim, norm, mesh, spec, out_spec)


@_with_layout("irfft", "1d")
def irfft(x: torch.Tensor | Sharded, n: int | None = None, dim: int = -1,
          norm: str | None = None, *, mesh: Mesh | None = None, spec: Any = None,
          out_spec: Any = None) -> torch.Tensor | Sharded:
    """``torch.fft.irfft`` along one dim of a split tensor; see ``fft`` (pass ``n`` for an
    odd output length, as in torch).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> x = torch.randn(4, 9, dtype=torch.float64)
        >>> f = lambda t: spmd.fft.irfft(spmd.fft.rfft(t, mesh=mesh, spec=P(None, "sp")),
        ...                              n=9, mesh=mesh, spec=P(None, "sp"))
        >>> torch.allclose(spmd.shard_map(f, mesh, P(None, "sp"), P(None, "sp"))(x), x)
        True
    """
    return _transform("irfft", "irfft", "1d", x, n, dim, norm, mesh, spec, out_spec)
