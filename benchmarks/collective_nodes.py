"""Per-call cost of differentiable collectives inside a shard_map body on a threads mesh.

    python benchmarks/collective_nodes.py [--ranks 4,8] [--calls 100] [--repeats 5]
                                          [--schedule greenlets,threads]

Each body chains ``--calls`` calls of one collective on f32[8, 16] per rank (``psum``
of the block, a tiled ``all_gather`` followed by taking the rank's own block back, a
tiled ``psum_scatter`` of the block repeated once per rank, a cyclic ``ppermute``),
with ``x.requires_grad``; a row is the best over ``--repeats``
of the body's forward and of its backward, divided by ``--calls`` (microseconds per
collective over all ranks). Greenlets run each of them in grad mode as one autograd node made in the collective's own rendezvous
(``spmd/collectives/group_node.py``); the threads schedule runs each rank's
``custom_vjp``.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import spmd
from spmd import P


def body(kind: str, calls: int):
    def f(a):
        n = spmd.axis_size("sp")
        for _ in range(calls):
            if kind == "psum":
                a = spmd.psum(a, "sp") * (1.0 / n)
            elif kind == "psum_scatter":
                a = spmd.psum_scatter(a.repeat(n, 1), "sp", tiled=True) * (1.0 / n)
            elif kind == "all_gather":
                me = spmd.axis_index("sp")
                a = spmd.all_gather(a, "sp", tiled=True).narrow(0, a.shape[0] * me,
                                                                  a.shape[0]) * 1.0
            else:
                a = spmd.ppermute(a, "sp", [(i, (i + 1) % n) for i in range(n)]) * 1.0
        return a
    return f


def time_kind(mesh: spmd.Mesh, kind: str, calls: int, repeats: int) -> tuple[float, float]:
    n = mesh.size
    x = torch.randn(8 * n, 16, requires_grad=True)
    f = spmd.shard_map(body(kind, calls), mesh, P("sp"), P("sp"))
    f(x).sum().backward()  # warm-up
    fwd = bwd = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = f(x)
        t1 = time.perf_counter()
        y.sum().backward()
        t2 = time.perf_counter()
        fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
    return fwd / calls * 1e6, bwd / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--schedule", default="greenlets,threads")
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.python_version()}, "
          f"load average {load:.2f}")
    print("\n| ranks | schedule | collective | forward (us) | backward (us) |")
    print("| ---: | --- | --- | ---: | ---: |")
    for n in [int(r) for r in args.ranks.split(",")]:
        for schedule in args.schedule.split(","):
            mesh = spmd.Mesh((n,), ("sp",), schedule=schedule)
            for kind in ("psum", "all_gather", "psum_scatter", "ppermute"):
                fwd, bwd = time_kind(mesh, kind, args.calls, args.repeats)
                print(f"| {n} | {schedule} | {kind} | {fwd:.0f} | {bwd:.0f} |")


if __name__ == "__main__":
    main()
