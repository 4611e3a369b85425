"""Fourier neural operator layers on shards: ``SpectralConv1d/2d/3d`` and ``FNO``.

A spectral convolution (Li et al., FNO) takes ``rfftn`` over the spatial dims, keeps the
``modes`` lowest frequencies along each (on every dim but the last, the positive and the
negative ones: the corners of the spectrum), multiplies them by complex weights (mixing
channels), zeroes the rest and transforms back.

With ``mesh=`` the layer runs on this rank's shard: ``spmd.fft``'s rfftn plan, with each
dim cut to its kept modes as soon as it is transformed (``spmd/fft/modes.py``: the
dropped modes never move; 8x fewer bytes for 16 of 256 x 256 modes), leaves the kept
spectrum in its transposed layout; each rank mixes the modes its shard holds (found
from the layout's offsets: a rank holding none does no einsum and contributes zeros),
and the same plan run backwards brings the result to the input's layout. No rank ever
holds the whole spectrum. With ``mesh=None`` the same layer runs on
one device: the single-device reference, with the same parameters and ``state_dict``.

Weights are stored as real pairs (``[..., 2]``: real and imaginary parts) so that
``.double()``, ``.to(dtype)``, optimizers and gradient synchronisation treat them as any
real parameter; ``torch.view_as_real`` of a reference FNO's complex ``weights1`` loads.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..core.spec import as_spec
from ..fft import irfftn, rfftn
from ..fft.call import check, run
from ..fft.modes import spectral_plans
from ..ops._window import input_layout
from .modules import Conv1d, Conv2d, Conv3d

__all__ = ["SpectralConv1d", "SpectralConv2d", "SpectralConv3d", "FNO"]


def _modes(modes: Any, n: int, what: str) -> tuple[int, ...]:
    ms = (modes,) * n if isinstance(modes, int) and not isinstance(modes, bool) else modes
    if (not isinstance(ms, Sequence) or len(ms) != n
            or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in ms)):
        raise ValueError(f"{what}: modes must be a positive int or {n} positive ints (one per "
                         f"spatial dim), got {modes!r}")
    return tuple(ms)


def _with_channels(lay: Layout, c: int) -> Layout:
    """``lay`` for a tensor with ``c`` channels (dim 1, never split here)."""
    shape = list(lay.shape)
    shape[1] = c
    return Layout(shape, lay.spec, _MeshOf(lay),
                  {d: s for d, s in enumerate(lay.sizes) if s is not None} or None)


class _MeshOf:
    """What ``Layout`` reads of a mesh, taken from another layout."""

    def __init__(self, lay: Layout):
        self.axis_names, self.shape = lay.axis_names, lay.mesh_shape


def _tie(out: torch.Tensor, *ts: torch.Tensor) -> torch.Tensor:
    """``out`` made to depend on ``ts`` (adding zero): every rank's spectrum then needs a
    gradient alike, so every rank runs the inverse transform's all_to_alls in backward,
    those with no kept mode too (they would otherwise leave the others waiting). One
    element of each tensor is read, so it costs nothing."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in ts):
        return out
    z = sum(t.narrow(t.ndim - 1, 0, min(1, t.shape[-1])).sum() * 0 for t in ts)
    return out + z


class _SpectralConv(nn.Module):
    """The layer for ``_n`` spatial dims; see ``SpectralConv2d``."""

    _n: int

    def __init__(self, in_channels: int, out_channels: int, modes: int | Sequence[int], *,
                 mesh: Mesh | None = None, spec: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        name = type(self).__name__
        for arg, v in (("in_channels", in_channels), ("out_channels", out_channels)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {v!r}")
        check_mesh(mesh, name, optional=True)
        if mesh is not None and spec is None:
            raise TypeError(f"{name}: pass spec= (the input's P or Layout) with mesh=")
        spec = _check_spec(name, spec)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.modes = _modes(modes, self._n, name)
        self.mesh, self.spec = mesh, spec
        # FNO's initialisation: real and imaginary parts uniform in [0, 1/(in * out))
        scale = 1 / (in_channels * out_channels)
        for c in range(2 ** (self._n - 1)):
            w = torch.rand(in_channels, out_channels, *self.modes, 2, device=device, dtype=dtype)
            self.register_parameter(f"weights{c + 1}", nn.Parameter(scale * w))

    @classmethod
    def from_torch(cls, module: nn.Module, mesh: Mesh, spec: Any) -> _SpectralConv:
        """A copy of ``module`` that runs on shards, for ``spmd.nn.convert(model, mesh,
        spec, types={LayerType: SpectralConv2d})``.

        ``module`` is a ``SpectralConv2d`` (its parameters shared, no copy) or a layer of
        your own that computes FNO's spectral convolution and holds its weights as
        ``weights1``, ``weights2``, ... (one per corner of the spectrum, as in the
        reference FNO): complex ``(in, out, *modes)`` or real pairs ``(in, out, *modes,
        2)``; channels and modes are read from their shape. Complex weights become real
        pairs (``torch.view_as_real``, the same storage) under the same names.

        Raises:
            TypeError: ``module`` holds no such weights (which one is missing or wrong).
        """
        if isinstance(module, _SpectralConv):
            if module._n != cls._n:
                raise TypeError(f"{cls.__name__}.from_torch expects a {cls.__name__}, got "
                                f"{type(module).__name__}")
            spec = _check_spec(cls.__name__, spec)
            new = cls.__new__(cls)
            new.__dict__.update(module.__dict__)
            new.mesh, new.spec = mesh, spec
            return new
        ws = _fno_weights(cls, module)
        w = ws[0]
        modes = tuple(w.shape[2:2 + cls._n])
        real = torch.view_as_real(w).dtype if w.is_complex() else w.dtype
        new = cls(int(w.shape[0]), int(w.shape[1]), modes, mesh=mesh, spec=spec,
                  device=w.device, dtype=real)
        for c, w in enumerate(ws):
            pair = w if not w.is_complex() else torch.view_as_real(w.detach())
            setattr(new, f"weights{c + 1}", w if isinstance(w, nn.Parameter) and pair is w
                    else nn.Parameter(pair, requires_grad=w.requires_grad))
        new.train(module.training)
        return new

    def weights(self) -> list[torch.Tensor]:
        """The complex weights, corner by corner (views of the real pairs)."""
        return [torch.view_as_complex(getattr(self, f"weights{c + 1}"))
                for c in range(2 ** (self._n - 1))]

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, modes={self.modes}"
        return s if self.mesh is None else f"{s}, mesh={self.mesh!r}, spec={self.spec!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or x.ndim != self._n + 2:
            raise SpecError(f"{name}: expected a {self._n + 2}-d tensor (batch, channels, "
                            f"{self._n} spatial dims), got "
                            f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[1] != self.in_channels:
            raise SpecError(f"{name}: expected {self.in_channels} input channels (dim 1 of x), "
                            f"got {x.shape[1]}")
        dims = tuple(range(2, 2 + self._n))
        if self.mesh is None:
            self._check_modes(x.shape)
            xf = torch.fft.rfftn(x, dim=dims)
            out = self._mix(xf, xf.shape, (0,) * xf.ndim)
            return torch.fft.irfftn(out, s=x.shape[2:], dim=dims)
        rc, lay = input_layout(x, self.mesh, self.spec, name)
        self._check_modes(lay.shape)
        c = self.out_channels
        plans = spectral_plans(lay, _with_channels(lay, c), dims, self.modes)
        if plans is not None:  # the dropped modes never move
            fwd, back = plans
            check(name, "rfft", x, fwd)
            xf = run(x, rc, fwd, None)
            return run(self._mix(xf, fwd.out.shape, fwd.out.offsets(rc.rank)), rc, back, None)
        freq = rfftn.output_layout(lay, dim=dims)
        xf = rfftn(x, dim=dims, mesh=self.mesh, spec=lay)
        # this rank's block of the global spectrum: where it sits, how large it is
        out = self._mix(xf, freq.shape, freq.offsets(rc.rank))
        return irfftn(out, s=lay.shape[2:], dim=dims, mesh=self.mesh,
                      spec=_with_channels(freq, c), out_spec=_with_channels(lay, c))

    def _check_modes(self, shape: Sequence[int]) -> None:
        """FNO's bounds (its slices would not fit its weights otherwise): ``modes <= n``
        on every spatial dim, ``modes <= n // 2 + 1`` (the half spectrum) on the last."""
        for i, (m, n) in enumerate(zip(self.modes, shape[2:])):
            last = i == self._n - 1
            top = n // 2 + 1 if last else n
            if m > top:
                raise SpecError(
                    f"{type(self).__name__}: modes {m} on spatial dim {i} (dim {i + 2}, global "
                    f"extent {n}) exceeds the {top} frequencies "
                    f"{'rfft keeps on the last dim (n // 2 + 1)' if last else 'the dim has'}; "
                    f"use modes <= {top} or a larger input")

    def _mix(self, xf: torch.Tensor, gshape: Sequence[int],
             offs: Sequence[int]) -> torch.Tensor:
        """The spectrum ``xf`` (a block at ``offs`` of a global spectrum of ``gshape``) with
        every kept mode it holds multiplied by the weights, the rest zero.

        Corner ``c`` keeps, on spatial dim ``i`` but the last, the low ``m_i`` rows if bit
        ``i`` of ``c`` is 0, the high (negative) ones if 1; the last dim's low ``m``. As in
        FNO, corners are written in order, so where they overlap (``2 m > n``) the later
        one wins."""
        shape = list(xf.shape)
        shape[1] = self.out_channels
        out = xf.new_zeros(shape)
        ws = self.weights()
        for c, w in enumerate(ws):
            at, take = [slice(None)] * 2, [slice(None)] * 2
            for i, m in enumerate(self.modes):
                d, n = i + 2, gshape[i + 2]
                lo = n - m if i < self._n - 1 and (c >> i) & 1 else 0
                a, b = max(lo, offs[d]), min(lo + m, offs[d] + xf.shape[d])
                if a >= b:  # this rank holds none of the corner's modes
                    break
                at.append(slice(a - offs[d], b - offs[d]))
                take.append(slice(a - lo, b - lo))
            else:
                out[tuple(at)] = torch.einsum("bi...,io...->bo...", xf[tuple(at)],
                                              w[tuple(take)])
        return _tie(out, xf, *ws)


def _fno_weights(cls: type, module: nn.Module) -> list[torch.Tensor]:
    """The reference FNO layer's corner weights ``weights1``... of ``module``, checked."""
    n, k = cls._n, 2 ** (cls._n - 1)
    names = ", ".join(f"weights{c + 1}" for c in range(k))
    want = (f"{cls.__name__}.from_torch expects a {cls.__name__}, or a layer computing FNO's "
            f"spectral convolution with its weights {names} (complex (in, out, "
            f"{', '.join(f'modes{i + 1}' for i in range(n))}), or those as real pairs with a "
            f"last dim of 2)")
    ws = []
    for c in range(k):
        w = getattr(module, f"weights{c + 1}", None)
        shape = None if not isinstance(w, torch.Tensor) else tuple(w.shape)
        ok = shape is not None and (len(shape) == n + 2 if w.is_complex() else
                                    len(shape) == n + 3 and shape[-1] == 2 and
                                    w.is_floating_point())
        if not ok or (ws and shape != tuple(ws[0].shape)):
            got = ("no such tensor" if shape is None else
                   f"{list(shape)} {str(w.dtype).replace('torch.', '')}")
            raise TypeError(f"{want}; got {type(module).__name__} whose weights{c + 1} is "
                            f"{got}" + (f" (weights1 is {list(ws[0].shape)})" if ws else ""))
        ws.append(w)
    return ws


def _check_spec(name: str, spec: Any) -> Any:
    """``spec`` (a P or a Layout, or None), refused where it splits the channels."""
    if spec is None:
        return None
    if not isinstance(spec, Layout):
        spec = as_spec(spec)
    cut = spec.dim_axes(1) if isinstance(spec, Layout) else spec.entry(1)
    if cut:
        raise SpecError(f"{name}: spec {spec!r} splits the channels (dim 1); the weights mix "
                        f"all channels at every mode, so split the batch or spatial dims only")
    return spec


class SpectralConv1d(_SpectralConv):
    """FNO's 1-d spectral convolution; see ``SpectralConv2d``. One weight, ``weights1``
    ``[in, out, modes, 2]``.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> conv = spmd.nn.spectral.SpectralConv1d(2, 3, 4, mesh=mesh, spec=P(None, None, "sp"))
        >>> x = torch.randn(1, 2, 16)
        >>> y = spmd.shard_map(conv, mesh, P(None, None, "sp"), P(None, None, "sp"))(x)
        >>> one = spmd.nn.spectral.SpectralConv1d(2, 3, 4)
        >>> _ = one.load_state_dict(conv.state_dict())
        >>> torch.allclose(y, one(x), atol=1e-6)
        True
    """
    _n = 1


class SpectralConv2d(_SpectralConv):
    """FNO's spectral convolution over the last two dims of ``(N, C, H, W)``, on this rank's
    shard (``mesh=``) or on one device (``mesh=None``).

    ``rfft2``, keep the corners ``[:m1, :m2]`` (``weights1``) and ``[-m1:, :m2]``
    (``weights2``), each mixed over channels by its weights ``[in, out, m1, m2, 2]`` (real
    pairs), zero the rest, ``irfft2`` back to ``(H, W)``.

    Args:
        in_channels, out_channels: channels of the input and output.
        modes: kept frequencies per spatial dim (an int for all). FNO's bounds: at most
            ``n`` on each dim, at most ``n // 2 + 1`` on the last.
        mesh: the mesh the layer runs on; None: one device (the reference).
        spec: the input's ``P`` or ``Layout``; any split of the batch and spatial dims
            (a slab: one spatial dim split; a pencil: two), not of the channels.

    Raises:
        SpecError: the channels differ from ``in_channels``, the spec splits them, modes
            exceed the bounds above, or ``spmd.fft`` refuses the layout (more than two
            split spatial dims); on every rank before anything moves.

    Backward:
        ``spmd.fft``'s (its transposes run the other way); the weights get the partial
        gradient of the modes each rank holds, which ``shard_map`` adds up.

    Ranks without data:
        A rank holding no kept mode of the spectrum does no einsum; its zeros still pass
        through the inverse transform's all_to_alls, forward and backward.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> s = P(None, None, "sp")
        >>> conv = spmd.nn.spectral.SpectralConv2d(2, 2, (3, 4), mesh=mesh, spec=s)
        >>> x = torch.randn(2, 2, 10, 8)
        >>> y = spmd.shard_map(conv, mesh, s, s)(x)
        >>> one = spmd.nn.spectral.SpectralConv2d(2, 2, (3, 4))
        >>> _ = one.load_state_dict(conv.state_dict())
        >>> torch.allclose(y, one(x), atol=1e-6)
        True
    """
    _n = 2


class SpectralConv3d(_SpectralConv):
    """FNO's 3-d spectral convolution; see ``SpectralConv2d``. Four corners,
    ``weights1..4`` ``[in, out, m1, m2, m3, 2]``: bit 0 of ``c - 1`` picks the negative
    rows of the first dim, bit 1 of the second (FNO's order).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> s = P(None, None, "sp")
        >>> conv = spmd.nn.spectral.SpectralConv3d(1, 1, 2, mesh=mesh, spec=s)
        >>> x = torch.randn(1, 1, 6, 4, 4)
        >>> one = spmd.nn.spectral.SpectralConv3d(1, 1, 2)
        >>> _ = one.load_state_dict(conv.state_dict())
        >>> torch.allclose(spmd.shard_map(conv, mesh, s, s)(x), one(x), atol=1e-6)
        True
    """
    _n = 3


_SPECTRAL = {1: SpectralConv1d, 2: SpectralConv2d, 3: SpectralConv3d}
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_SHARDED_CONV = {1: Conv1d, 2: Conv2d, 3: Conv3d}


def _spec_for(spec: Any, channels: int) -> Any:
    """The spec of an activation with ``channels`` channels: a P as is, a Layout restated."""
    return _with_channels(spec, channels) if isinstance(spec, Layout) else spec


class FNO(nn.Module):
    """A Fourier neural operator: lifting (a 1x1 conv), ``blocks`` spectral blocks (a
    ``SpectralConv`` plus a 1x1 conv skip, GELU between blocks), projection (1x1 conv,
    GELU, 1x1 conv). As FNO's reference, without its grid channels (pass coordinates as
    input channels) or domain padding.

    With ``mesh=`` and ``spec=`` (the input's; a ``P`` or a ``Layout``) it runs on this
    rank's shard (inside ``shard_map``): the 1x1 convs and GELU act per position, the
    spectral convolutions transform across ranks. Same parameters and ``state_dict`` as
    with ``mesh=None`` (one device).

    Args:
        in_channels, out_channels: of the input and output fields.
        modes: kept frequencies per spatial dim (an int for all).
        width: channels inside the blocks.
        dim: spatial dims (1, 2 or 3).
        blocks: spectral blocks.
        hidden: channels of the projection's hidden layer.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> s = P(None, None, "sp")
        >>> fno = spmd.nn.spectral.FNO(1, 1, modes=4, width=8, mesh=mesh, spec=s)
        >>> x = torch.randn(2, 1, 12, 12)
        >>> one = spmd.nn.spectral.FNO(1, 1, modes=4, width=8)
        >>> _ = one.load_state_dict(fno.state_dict())
        >>> torch.allclose(spmd.shard_map(fno, mesh, s, s)(x), one(x), atol=1e-5)
        True
    """

    def __init__(self, in_channels: int, out_channels: int, modes: int | Sequence[int],
                 width: int = 32, *, dim: int = 2, blocks: int = 4, hidden: int = 128,
                 mesh: Mesh | None = None, spec: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if dim not in _SPECTRAL:
            raise ValueError(f"FNO: dim must be 1, 2 or 3 (spatial dims), got {dim!r}")
        kw = {"device": device, "dtype": dtype}

        def conv(cin: int, cout: int) -> nn.Module:
            # 1x1 convs act per position; on shards spmd's twin (same parameters) also
            # takes the empty shards torch's conv refuses
            if mesh is None:
                return _CONV[dim](cin, cout, 1, **kw)
            return _SHARDED_CONV[dim](cin, cout, 1, mesh=mesh, spec=_spec_for(spec, cin), **kw)

        self.lift = conv(in_channels, width)
        self.spectral = nn.ModuleList(
            _SPECTRAL[dim](width, width, modes, mesh=mesh, spec=_spec_for(spec, width), **kw)
            for _ in range(blocks))
        self.skip = nn.ModuleList(conv(width, width) for _ in range(blocks))
        self.project = nn.Sequential(conv(width, hidden), nn.GELU(), conv(hidden, out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(x)
        for i, (spectral, skip) in enumerate(zip(self.spectral, self.skip)):
            x = spectral(x) + skip(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        return self.project(x)
