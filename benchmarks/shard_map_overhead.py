"""Per-call overhead of shard_map on a threads mesh, for a trivial body.

    python benchmarks/shard_map_overhead.py [--ranks 1,2,4,8] [--calls 2000] [--repeats 7]

Reports the median over repeats of the mean time per call, for the body on one
device and through shard_map (forward only, and forward + backward). The overhead is
the difference. The project's target: <= 100 us per call for a trivial body on 8 ranks and
<= 50 us on 4 (JAX's eager shard_map: ~120 ms for a 2-op body on 8 CPU devices; jitted
~100 us). The row "bare threads" is the floor of any design with a thread per rank:
the body on n threads, released and joined with raw locks, nothing else. Each mesh runs with ``rng="per_rank"`` (the default: every torch call on a rank
thread goes through a TorchFunctionMode, so that random draws come from the rank's own
generator) and ``rng="shared"`` (no mode): the difference is that mode's cost.
"""
from __future__ import annotations

import _thread
import argparse
import os
import platform
import statistics
import threading
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


def bare_handoff(n: int, body, x, calls: int, repeats: int) -> float:
    """The floor of any thread-per-rank design: the body on n threads (n - 1 persistent
    workers released and joined with raw locks per call), nothing else of spmd."""
    go = [_thread.allocate_lock() for _ in range(n - 1)]
    done = [_thread.allocate_lock() for _ in range(n - 1)]
    for lock in go + done:
        lock.acquire()
    stop = []

    def worker(i: int) -> None:
        while True:
            go[i].acquire()
            if stop:
                return
            body(x)
            done[i].release()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n - 1)]
    for t in threads:
        t.start()

    def call() -> None:
        for lock in go:
            lock.release()
        body(x)
        for lock in done:
            lock.acquire()

    us = per_call(call, calls, repeats)
    stop.append(True)
    for lock in go:
        lock.release()
    for t in threads:
        t.join()
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rng", default="per_rank,shared",
                    help="Mesh(rng=...) settings to time, comma-separated")
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
    print("| ranks | rng | shard_map fwd (us) | overhead (us) | fwd+bwd (us) | overhead (us) "
          "| goal |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | :---: |")
    goal = {4: 50, 8: 100}
    for n in [int(r) for r in a.ranks.split(",")]:
        bare = bare_handoff(n, body, x, a.calls, a.repeats)
        print(f"| {n} | bare threads, no spmd | {bare:.1f} | {bare - one:.1f} | | | |")
        for rng in a.rng.split(","):
            mesh = spmd.Mesh((n,), ("sp",), rng=rng)
            f = spmd.shard_map(body, mesh, P("sp"), P("sp"))
            fwd = per_call(lambda f=f: f(x), a.calls, a.repeats)
            both = per_call(lambda f=f: f(xg).sum().backward(), max(1, a.calls // 2), a.repeats)
            met = "" if n not in goal else f"{'yes' if fwd - one <= goal[n] else 'no'} (<= {goal[n]})"
            print(f"| {n} | {rng} | {fwd:.1f} | {fwd - one:.1f} | {both:.1f} | "
                  f"{both - one_bwd:.1f} | {met} |")


if __name__ == "__main__":
    main()
