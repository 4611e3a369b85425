"""Distributed rfftn + irfftn (spmd.fft) on gloo processes against one process.

    python benchmarks/fft.py [--world 2] [--steps 10]

Every process uses one thread (torch.set_num_threads(1)). One call is ``rfftn`` then
``irfftn`` back (float32 in, complex64 spectrum) over the spatial dims of:

- f32[1, 16, 256, 256], 2 transformed dims, H split (a slab: one transpose each way);
- f32[1, 8, 64, 64, 64], 3 transformed dims, D split (a slab over the first dim).

``one process`` runs ``torch.fft.rfftn``/``irfftn`` on the whole tensor (T1); ``spmd.fft``
splits it over ``world`` processes, each rank transforming its shard with the default
layouts (the spectrum stays transposed; the inverse comes back). A call ends when the
slowest rank is done. ``fwd+bwd`` adds the backward of both (from a fixed cotangent).

Bytes are what each rank sent per call (spmd.comm_stats), against the least any
transpose can send: the elements of its shard that change owner, (P-1)/P of it per
transpose for even splits (computed from the plan's layouts, so exact for uneven ones).

The second table runs a spectral convolution (``spmd.nn.SpectralConv2d/3d``, FNO's layer,
as many channels out as in, ``--modes`` kept per dim) on the same inputs: its rfftn cuts
each dim to the kept modes before the next transpose, and its irfftn starts from them,
so it sends far less than the rfftn + irfftn pair above (the "all modes" column, which
is what the layer sent before it cut).
"""
from __future__ import annotations

import argparse
import math

import torch
from _timing import median_ms

import spmd
import spmd.fft
from spmd import Layout, P
from spmd.fft.call import _planned
from spmd.fft.plan import Transpose

CASES = [((1, 16, 256, 256), (2, 3)), ((1, 8, 64, 64, 64), (2, 3, 4))]




def _input(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def single(mesh, shape, dims, steps):
    torch.set_num_threads(1)
    x = _input(shape).requires_grad_()
    s = tuple(shape[d] for d in dims)
    g = torch.randn(shape)

    def call():
        with torch.no_grad():
            torch.fft.irfftn(torch.fft.rfftn(x, dim=dims), s=s, dim=dims)

    def fwd_bwd():
        y = torch.fft.irfftn(torch.fft.rfftn(x, dim=dims), s=s, dim=dims)
        torch.autograd.grad(y, x, g)

    return median_ms(call, steps), median_ms(fwd_bwd, steps)


def least_bytes(lay: Layout, dims, rank: int, itemsize: int = 8) -> int:
    """What ``rank`` must send over the transposes of rfftn and irfftn's plans."""
    s = tuple(lay.shape[d] for d in dims)
    plans = [_planned("rfft", "rfftn", lay, dims, None, None)]
    plans.append(_planned("irfft", "irfftn", plans[0].out, dims, s, None))
    total = 0
    for p in plans:
        for st in p.steps:
            if isinstance(st, Transpose):
                a, b = st.src, st.layout
                kept = math.prod(max(0, min(o + m, q + k) - max(o, q)) for o, m, q, k in zip(
                    a.offsets(rank), a.local_shape(rank), b.offsets(rank), b.local_shape(rank)))
                total += (math.prod(a.local_shape(rank)) - kept) * itemsize
    return total


def per_rank(mesh, shape, dims, steps):
    torch.set_num_threads(1)
    lay = Layout(shape, P(None, None, "sp"), mesh)
    x = lay.shard(_input(shape), mesh.rank).clone().requires_grad_()
    freq = spmd.fft.rfftn.output_layout(lay, dim=dims)
    s = tuple(shape[d] for d in dims)
    g = torch.randn(x.shape)

    def both():
        y = spmd.fft.rfftn(x, dim=dims, mesh=mesh, spec=lay)
        return spmd.fft.irfftn(y, s=s, dim=dims, mesh=mesh, spec=freq)

    def call():
        with mesh, torch.no_grad():
            both()

    def fwd_bwd():
        with mesh:
            torch.autograd.grad(both(), x, g)

    t_call, t_fb = median_ms(call, steps), median_ms(fwd_bwd, steps)
    with spmd.comm_stats() as st:
        call()
    return t_call, t_fb, st.bytes(rank=mesh.rank), least_bytes(lay, dims, mesh.rank)


def _layer(shape, modes, mesh=None, spec=None):
    torch.manual_seed(0)
    cls = spmd.nn.SpectralConv2d if len(shape) == 4 else spmd.nn.SpectralConv3d
    return cls(shape[1], shape[1], modes, mesh=mesh, spec=spec)


def layer_single(mesh, shape, modes, steps):
    torch.set_num_threads(1)
    conv, x = _layer(shape, modes), _input(shape).requires_grad_()
    g = torch.randn(shape)

    def call():
        with torch.no_grad():
            conv(x)

    return median_ms(call, steps), median_ms(lambda: torch.autograd.grad(conv(x), x, g), steps)


def layer_per_rank(mesh, shape, modes, steps):
    torch.set_num_threads(1)
    lay = Layout(shape, P(None, None, "sp"), mesh)
    conv = _layer(shape, modes, mesh, lay)
    x = lay.shard(_input(shape), mesh.rank).clone().requires_grad_()
    g = torch.randn(x.shape)

    def call():
        with mesh, torch.no_grad():
            conv(x)

    def fwd_bwd():
        with mesh:
            torch.autograd.grad(conv(x), x, g)

    t_call, t_fb = median_ms(call, steps), median_ms(fwd_bwd, steps)
    with spmd.comm_stats() as st:
        call()
    return t_call, t_fb, st.bytes(rank=mesh.rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", type=int, default=16)
    a = ap.parse_args()
    print(f"spmd.fft rfftn + irfftn, float32, gloo world {a.world} (slab over the first "
          f"transformed dim), 1 thread per process, median of {a.steps}\n")
    print("| input | transformed dims | variant | ms per call | ms fwd+bwd | "
          "bytes sent per rank | least possible | sent / least |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    pair = {}
    for shape, dims in CASES:
        t1, t1b = spmd.launch(single, (1,), ("sp",), args=(shape, dims, a.steps))[0]
        got = spmd.launch(per_rank, (a.world,), ("sp",), backend="gloo",
                          args=(shape, dims, a.steps), timeout=600)
        pair[shape] = [g[2] for g in got]
        name = f"f32{list(shape)}"
        print(f"| {name} | {len(dims)} | one process | {t1:.1f} | {t1b:.1f} | 0 | 0 | |")
        sent = ", ".join(f"{g[2]:,}" for g in got)
        least = ", ".join(f"{g[3]:,}" for g in got)
        ratio = max(g[2] / g[3] for g in got)
        print(f"| {name} | {len(dims)} | spmd.fft, world {a.world} | "
              f"{max(g[0] for g in got):.1f} | {max(g[1] for g in got):.1f} | {sent} | "
              f"{least} | {ratio:.2f} |")
    print(f"\nSpectralConv (FNO layer), {a.modes} modes per dim, channels in = out\n")
    print("| input | variant | ms per call | ms fwd+bwd | bytes sent per rank | "
          "all modes (rfftn + irfftn above) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for shape, dims in CASES:
        modes = (a.modes,) * len(dims)
        t1, t1b = spmd.launch(layer_single, (1,), ("sp",), args=(shape, modes, a.steps))[0]
        got = spmd.launch(layer_per_rank, (a.world,), ("sp",), backend="gloo",
                          args=(shape, modes, a.steps), timeout=600)
        name = f"f32{list(shape)}"
        print(f"| {name} | one process | {t1:.1f} | {t1b:.1f} | 0 | |")
        sent = ", ".join(f"{g[2]:,}" for g in got)
        print(f"| {name} | world {a.world} | {max(g[0] for g in got):.1f} | "
              f"{max(g[1] for g in got):.1f} | {sent} | "
              f"{', '.join(f'{b:,}' for b in pair[shape])} |")


if __name__ == "__main__":
    main()
