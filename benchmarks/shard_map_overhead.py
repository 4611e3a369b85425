"""Per-call overhead of shard_map on a threads mesh, for a trivial body.

    python benchmarks/shard_map_overhead.py [--ranks 1,2,4,8] [--calls 2000] [--repeats 7]

Reports the median over repeats of the mean time per call, for the body on one
device and through shard_map (forward only, and forward + backward). The overhead is
the difference. The issue's goal: <= 100 us per call for a trivial body on 8 ranks
(JAX's eager shard_map: ~120 ms for a 2-op body on 8 CPU devices; jitted ~100 us).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import spmd
from spmd import P


def per_call(fn, calls: int, repeats: int) -> float:
    for _ in range(max(50, calls // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()

    body = lambda x: x * 2  # noqa: E731 - the trivial body
    x = torch.randn(64, 16)
    xg = x.clone().requires_grad_()
    one = per_call(lambda: body(x), a.calls, a.repeats)
    one_bwd = per_call(lambda: body(xg).sum().backward(), a.calls, a.repeats)

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.python_version()}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"trivial body x * 2 on f32{list(x.shape)}; one device: {one:.1f} us forward, "
          f"{one_bwd:.1f} us forward+backward\n")
    print("| ranks | shard_map fwd (us) | overhead (us) | fwd+bwd (us) | overhead (us) | goal <= 100 us |")
    print("| ---: | ---: | ---: | ---: | ---: | :---: |")
    for n in [int(r) for r in a.ranks.split(",")]:
        mesh = spmd.Mesh((n,), ("sp",))
        f = spmd.shard_map(body, mesh, P("sp"), P("sp"))
        fwd = per_call(lambda f=f: f(x), a.calls, a.repeats)
        both = per_call(lambda f=f: f(xg).sum().backward(), max(1, a.calls // 2), a.repeats)
        print(f"| {n} | {fwd:.1f} | {fwd - one:.1f} | {both:.1f} | {both - one_bwd:.1f} | "
              f"{'yes' if fwd - one <= 100 else 'no'} |")


if __name__ == "__main__":
    main()
