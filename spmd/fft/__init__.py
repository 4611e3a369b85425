"""``spmd.fft``: torch.fft's transforms on a tensor split along its dims, differentiable.

``fft ifft rfft irfft fft2 ifft2 rfft2 irfft2 fftn ifftn rfftn irfftn`` take torch.fft's
arguments (``n``/``s``, ``dim``, ``norm``) plus the ``mesh`` and this rank's shard's
layout (``spec=``, a ``P`` or a ``Layout``; or pass a ``spmd.Sharded``), and return this
rank's shard of torch.fft's result on the global tensor. Uneven and empty shards, prime
lengths, padding and cropping by ``s`` are all exact.

    transforms.py  the twelve functions; each has ``.output_layout(layout, ...)``, the
                   output's layout without running anything
    call.py        one call: arguments read and checked, the plan made and run
    plan.py        which dims each rank transforms, in which order, with which transposes
                   (a slab: one all_to_all, a pencil: two; the inverse runs it backwards)
    transpose.py   one all_to_all between two layouts over the same axes; its backward
                   is the transpose the other way
    modes.py       the spectral layers' rfftn that keeps only the low modes (each dim cut
                   before the next transpose) and its inverse

The forward transforms leave the frequency domain in the layout their last transpose
made (no transpose back: a spectral layer works there), and the inverse transforms go
back to the spatial layout by the same route. Pass ``out_spec=`` for another layout.

Example:
    >>> mesh = spmd.Mesh((2,), ("sp",))
    >>> x = spmd.Sharded.from_global(torch.randn(1, 3, 8, 8), mesh, P(None, None, "sp"))
    >>> y = spmd.fft.rfft2(x)
    >>> y.layout
    Layout([1, 3, 8, 5], P(None, None, None, 'sp'), sp=[3, 2])
    >>> spmd.fft.irfft2(y, s=(8, 8)).layout == x.layout
    True
"""
from .transforms import (
    fft,
    fft2,
    fftn,
    ifft,
    ifft2,
    ifftn,
    irfft,
    irfft2,
    irfftn,
    rfft,
    rfft2,
    rfftn,
)

__all__ = ["fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn",
           "ifftn", "rfftn", "irfftn"]
