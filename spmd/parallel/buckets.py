"""Buckets: flat buffers that carry many gradients in one all-reduce.

A bucket holds parameters of one dtype and one device (never mixed: a bf16 gradient
summed in an fp32 buffer would not be what one device computes), reduced over one set
of mesh axes. ``assign`` packs parameters into buckets in a given order (the order
their gradients become ready in backward), and orders the buckets by when their last
member becomes ready, so that launching strictly in plan order never waits on a bucket
that could not have started.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core._format import dtype_str

__all__ = ["BucketInfo", "assign", "Bucket"]

MiB = 1 << 20


@dataclass(frozen=True)
class BucketInfo:
    """One bucket of a ``GradSync`` plan, in launch order (what ``sync.buckets`` lists).

    Attributes:
        dtype, device: of every gradient in the bucket.
        names: the parameters, in the order their gradients are expected to be ready.
        numel: gradient elements in the bucket.
        axes: the mesh axes its all-reduce runs over (fewer than the synchronised ones
            for parameters declared ``varying`` over some of them).
    """

    dtype: torch.dtype
    device: torch.device
    names: tuple[str, ...]
    numel: int
    axes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """The gradients' bytes (without the few flag elements that ride along)."""
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        size = (f"{self.nbytes / MiB:.2f} MiB" if self.nbytes >= MiB // 8
                else f"{self.nbytes} B")
        over = f" over {', '.join(self.axes)}" if self.axes else ""
        return (f"Bucket({dtype_str(self.dtype)} on {self.device}{over}, {size}: "
                f"{', '.join(self.names)})")


def assign(order: Sequence[int], params: Sequence[torch.Tensor], cap_bytes: int,
           first_cap_bytes: int, groups: Sequence[object] | None = None) -> list[list[int]]:
    """Pack parameter indices, taken in ``order``, into buckets; return them in launch order.

    One open bucket per (dtype, device, ``groups[i]``: what the bucket reduces over); a
    bucket closes once it holds at least its cap (the first bucket of each key
    ``first_cap_bytes``, so communication starts early in backward; later ones
    ``cap_bytes``), as PyTorch's DDP does: no bucket exceeds its cap by more than its
    last parameter. Buckets are sorted by the position of their last member in
    ``order``: the moment they become ready.
    """
    pos = {i: k for k, i in enumerate(order)}
    open_: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    out: list[list[int]] = []
    for i in order:
        p = params[i]
        key = (p.dtype, p.device, None if groups is None else groups[i])
        b = open_.setdefault(key, [])
        b.append(i)
        size[key] = size.get(key, 0) + p.numel() * p.element_size()
        cap = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if size[key] >= cap:
            out.append(open_.pop(key))
            size[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    out.extend(b for b in open_.values() if b)
    out.sort(key=lambda b: pos[b[-1]])
    return out


class Bucket:
    """A flat buffer for some gradients of one dtype and device, and its state.

    Layout: the gradients back to back, then one element per parameter: the *used*
    flags, 1 where this rank produced a gradient for it since the last sync. They ride
    in the same all-reduce, so every rank learns which parameters no rank used (their
    ``.grad`` is left alone, as on one device) at the cost of a few elements. Then one
    *alarm* element: 1 where this rank's synchronised parameters changed since the
    GradSync was built (``param_set.py``); summed, how many ranks of the group changed.
    """

    __slots__ = ("index", "params", "names", "numel", "buffer", "grads", "flags", "alarm",
                 "views", "viewable", "offsets", "ready", "pending", "work", "axes")

    def __init__(self, index: list[int], params: Sequence[torch.Tensor],
                 names: Sequence[str], grad_as_view: bool, axes: tuple[str, ...] = ()):
        self.index = index
        self.axes = axes
        self.params = [params[i] for i in index]
        self.names = tuple(names[i] for i in index)
        sizes = [p.numel() for p in self.params]
        self.numel = sum(sizes)
        p0 = self.params[0]
        self.buffer = torch.zeros(self.numel + len(index) + 1, dtype=p0.dtype,
                                  device=p0.device)
        self.grads = self.buffer[:self.numel]
        self.flags = self.buffer[self.numel:-1]
        self.alarm = self.buffer[-1:]
        self.offsets = []
        off = 0
        for n in sizes:
            self.offsets.append(off)
            off += n
        self.views = [self.grads[o:o + n].view(p.shape)
                      for o, n, p in zip(self.offsets, sizes, self.params)]
        # A gradient can live in the bucket when its layout is the flat buffer's:
        # dense and contiguous, as the parameter is (autograd keeps the grad's strides
        # like the parameter's).
        self.viewable = [grad_as_view and p.layout == torch.strided and p.is_contiguous()
                         for p in self.params]
        self.ready = [False] * len(index)
        self.pending = len(index)
        self.work = None

    def info(self) -> BucketInfo:
        p0 = self.params[0]
        return BucketInfo(p0.dtype, p0.device, self.names, self.numel, self.axes)

    def reset(self) -> None:
        self.ready = [False] * len(self.index)
        self.pending = len(self.index)
        self.work = None
