"""Peak memory and time of ``spmd.scatter`` on gloo: the source rank against the tensor.

For world sizes 2 and 4 (processes on 127.0.0.1, one thread each) and a float32 tensor
of ``--mib`` MiB split along dim 0 (contiguous shards) and dim 1 (strided shards), rank
0 scatters the tensor to every rank. The table gives, as multiples of the tensor's size:

    src peak   the source rank's peak resident memory during a scatter, measured from
               before the tensor was made (so the tensor itself counts 1.0, and the
               shard the source keeps counts 1/P: 1 + 1/P is the floor for a result
               that does not alias the tensor)
    dst peak   the largest peak of the other ranks (their shard: 1/P)

and the median time of one scatter over ``--reps`` calls (the slowest rank's, each call
after a barrier).

    python benchmarks/scatter_memory.py [--mib 64] [--reps 5] [--worlds 2,4]

Peaks are Linux's VmHWM (``/proc/self/status``), reset by writing 5 to
``/proc/self/clear_refs`` after ``malloc_trim(0)`` has returned freed heap memory, so
they count every allocation (torch's, gloo's), not only tensors'. Elsewhere the columns
say n/a.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# Runnable from a checkout without installing (and measuring that checkout, not an
# installed spmd elsewhere).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import spmd  # noqa: E402
from spmd.testing.memory import peak, reset_peak  # noqa: E402


def _body(mesh, nbytes: int, reps: int) -> list[tuple]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    src = 0
    me = mesh.rank
    cols = 4096
    rows = max(nbytes // (4 * cols), 1)
    out = []
    for dim in (0, 1):
        spec = spmd.P("sp") if dim == 0 else spmd.P(None, "sp")
        # Warm up the process group and the first messages with a small scatter.
        spmd.scatter(torch.ones(8, 8) if me == src else None, mesh, spec, src=src)
        dist.barrier()
        base = reset_peak()
        x = torch.randn(rows, cols) if me == src else None
        dist.barrier()
        y = spmd.scatter(x, mesh, spec, src=src)
        hwm = peak()
        top = None if base is None or hwm is None else hwm - base
        del y
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            y = spmd.scatter(x, mesh, spec, src=src)
            times.append(time.perf_counter() - t0)
            del y
        out.append((dim, rows * cols * 4, top, times))
        del x
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=64.0, help="tensor size in MiB")
    ap.add_argument("--reps", type=int, default=5, help="timed scatters per row")
    ap.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    args = ap.parse_args()
    nbytes = int(args.mib * 2 ** 20)
    print(f"spmd.scatter on gloo, float32, src = rank 0; {platform.node()}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}\n")
    print("| world | split dim | tensor MiB | src peak / tensor | dst peak / tensor "
          "| floor 1 + 1/P | time per scatter ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for world in (int(w) for w in args.worlds.split(",")):
        res = spmd.launch(_body, (world,), ("sp",), backend="gloo",
                          args=(nbytes, args.reps), timeout=300)
        for j, (dim, size, _, _) in enumerate(res[0]):
            peaks = [r[j][2] for r in res]
            times = sorted(max(r[j][3][k] for r in res) for k in range(args.reps))
            med = times[len(times) // 2] * 1e3
            src = "n/a" if peaks[0] is None else f"{peaks[0] / size:.2f}"
            dst = ("n/a" if any(p is None for p in peaks[1:])
                   else f"{max(peaks[1:]) / size:.2f}")
            print(f"| {world} | {dim} | {size / 2 ** 20:g} | {src} | {dst} | "
                  f"{1 + 1 / world:.2f} | {med:.1f} |")


if __name__ == "__main__":
    main()
