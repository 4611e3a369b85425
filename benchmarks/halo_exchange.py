"""Time of one halo_pad on real processes (gloo), against the local F.pad of the shard.

    python benchmarks/halo_exchange.py [--world 2] [--shape 32,512,512] [--width 1] [--calls 40]

The global tensor is split over dim 1; each rank pads its shard by ``width`` rows from
its neighbours. The table gives the median time per call on each rank, next to the
plain F.pad of the same shard (the copy both have to make), and the halo bytes each
rank sent (spmd.comm_stats).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import median_ms

import spmd


def per_rank(mesh, shape, width, calls):
    torch.set_num_threads(1)
    lay = spmd.Layout(shape, spmd.P(None, "sp"), mesh)
    sizes = list(lay.sizes[1])
    x = torch.randn(lay.local_shape(mesh.rank))
    halo = median_ms(lambda: spmd.halo_pad(x, mesh, "sp", 1, (width, width), sizes=sizes),
                     calls, warmup=5)
    local = median_ms(lambda: F.pad(x, (0, 0, width, width)), calls, warmup=5)
    with spmd.comm_stats() as s:
        spmd.halo_pad(x, mesh, "sp", 1, (width, width), sizes=sizes)
    return halo, local, s.bytes("halo_pad")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", default="32,512,512")
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    out = spmd.launch(per_rank, (a.world,), ("sp",), backend="gloo",
                      args=(shape, a.width, a.calls))
    print(f"halo_pad of f32{list(shape)} split over dim 1, width {a.width}, gloo world {a.world}\n")
    print("| rank | halo_pad (ms) | local F.pad (ms) | halo bytes sent |")
    print("| ---: | ---: | ---: | ---: |")
    for r, (h, lp, b) in enumerate(out):
        print(f"| {r} | {h:.2f} | {lp:.2f} | {b} |")


if __name__ == "__main__":
    main()
