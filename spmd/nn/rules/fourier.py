"""torch.fft's transforms over split dims, run as ``spmd.fft``'s: each rank transforms the
dims it holds whole and one all_to_all moves the split to a transformed dim, so the
spectrum comes out split along another dim (``rfft2`` of H-split ``(N, C, H, W)`` is split
along its last frequency dim); the tag says so, and the inverse goes back."""
from __future__ import annotations

from typing import Any

import torch

from ... import fft as _fft
from .. import flow
from .._tags import LocalSize, _Tracked, entries_from_spec, spec_of
from ._base import Call, _arg, _dims, _where, share

#: torch.fft's functions spmd.fft has, by family (how their length argument is named).
ROUTED = {"fft": "1d", "ifft": "1d", "rfft": "1d", "irfft": "1d", "fft2": "2d", "ifft2": "2d",
          "rfft2": "2d", "irfft2": "2d", "fftn": "nd", "ifftn": "nd", "rfftn": "nd",
          "irfftn": "nd"}
_DIM = {"1d": -1, "2d": (-2, -1), "nd": None}


def _global(c: Call, v: Any) -> Any:
    """A length argument with sizes read from split dims made global (``s=x.shape[-2:]``
    means the global sizes on one device)."""
    if isinstance(v, (tuple, list, torch.Size)):
        return tuple(_global(c, u) for u in v)
    if isinstance(v, _Tracked):
        g = getattr(v, "glob", None)
        if not isinstance(v, LocalSize) or v.derived or g is None:
            c.refuse(f"is given {share(c, v)}, where the global size is meant",
                     "pass the global size (or x.shape[d] itself, which convert follows)")
        return int(g)
    return v


def _routed(c: Call, dims: list[int], refuse: Any) -> Any:
    """``c`` (torch.fft's ``base``) on ``x`` split along some of ``dims``: spmd.fft's
    transform of the same name, its output tagged with that transform's layout."""
    x = c.args[0]
    e = c.ent(x)
    base = c.name[4:]
    family = ROUTED.get(base)
    if family is None:
        refuse()
    length = _global(c, _arg(c, "n" if family == "1d" else "s", 1, None))
    dim = _arg(c, "dim", 2, _DIM[family])
    norm = _arg(c, "norm", 3, None)
    real = getattr(_fft, base)
    lay = flow.layout(c.run, x)
    if lay is None:  # a plan that does not know the sizes: balanced stand-ins
        from ...core.layout import Layout
        n = [int(s) * (c.mesh.axis_size(a) if a else 1) for s, a in zip(x.shape, e)]
        lay = Layout(tuple(n), spec_of(e), c.mesh)
    out = real.output_layout(lay, length, dim)
    # The inverse of a spectrum this forward made goes back to the layout the forward
    # started from (a pencil's two axes, uneven sizes), not to spmd.fft's default.
    spectra = c.run.spectra
    key = tuple(d % x.ndim for d in dims)
    if base.startswith("i"):
        back = spectra.get((lay, key))
        if back is not None and back.shape == out.shape and back != out:
            out = real.output_layout(lay, length, dim, out_spec=back)
    else:
        spectra[(out, key)] = lay
    oe = entries_from_spec(out.spec, x.ndim)
    split = [d for d in dims if e[d]]
    c.record("swapped", f"over split dim {split[0]} -> spmd.fft.{base} ({flow.describe(out)})")
    if c.planning:
        y = c.call()  # on meta: the dtype, and a result that depends on x
        shape = [out.shape[d] if not oe[d] else (x.shape[d] if e[d] == oe[d] and
                                                 lay.shape[d] == out.shape[d] else
                                                 out.local_shape(0)[d]) for d in range(x.ndim)]
        y = torch.zeros(shape, dtype=y.dtype, device="meta") + y.sum() * 0
        return c.out(y, oe, None if flow.sizes_of(x, c.mesh) is None else out)

    def twin(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return real(t, length, dim, norm, mesh=c.mesh, spec=lay, out_spec=out)
    return c.out(c.call(twin), oe, out)


_FFT_FIX = ("write it with fft, rfft, fft2, rfft2, fftn, rfftn or their inverses (convert "
            "runs them as spmd.fft's, which transpose split dims), or keep the dim whole "
            "(redistribute first); spmd.nn.SpectralConv1d/2d/3d for an FNO layer: "
            "convert(..., types={YourLayer: spmd.nn.SpectralConv2d}) swaps it in when it "
            "computes FNO's spectral convolution and holds its weights as weights1, "
            "weights2 (complex (in, out, modes1, modes2))")


def fft(c: Call) -> Any:
    """torch.fft's functions: over whole dims as they are, over split ones as spmd.fft's
    (refused where spmd.fft has no such transform: Hermitian ones, shifts)."""
    x = c.args[0]
    base = c.name[4:]
    nd = x.ndim
    if base in ("fftshift", "ifftshift"):
        dims = _dims(_arg(c, "dim", 1, None), nd)
    elif base.endswith("2"):
        dims = _dims(_arg(c, "dim", 2, (-2, -1)), nd)
    elif base.endswith("n"):
        d = _arg(c, "dim", 2, None)
        s = _arg(c, "s", 1, None)
        dims = _dims(d, nd) if d is not None else (list(range(nd - len(s), nd)) if s else
                                                   list(range(nd)))
    else:
        dims = _dims(_arg(c, "dim", 2, -1), nd)
    e = c.ent(x)
    split = [d for d in dims if e[d]]
    if not split:
        return c.out(c.call(), e)
    return _routed(c, dims, lambda: c.refuse(f"transforms {_where(split[0], e[split[0]])}",
                                             _FFT_FIX))
