"""Per-call cost of shard_map on a threads mesh, for trivial bodies.

    python benchmarks/shard_map_overhead.py [--ranks 1,2,4,8] [--calls 2000] [--repeats 7]
                                            [--schedule greenlets,threads]
                                            [--rng per_rank,shared]

Three bodies on f32[64, 16] split over the ranks: ``x * 2``; ``psum((x * 2).sum())``;
and the gradient of the latter (``f(x).backward()`` with ``x.requires_grad``). Each row
is the median over repeats of the mean time per call (microseconds), for each mesh
``schedule`` (``"greenlets"``: ranks switch in the calling thread at collectives;
``"threads"``: a thread per rank) and ``rng`` (``"per_rank"``: each rank draws from its
own generator). The row "bare threads" is the floor of any design with a thread per
rank: ``x * 2`` on n threads, released and joined with raw locks, nothing else.

The project's targets, 8 ranks on a 2-core CPU machine: x * 2 <= 150 us, psum <= 250
us, its gradient <= 400 us (JAX 0.10.2's jit-compiled shard_map on 8 fake CPU devices,
same kind of machine: 275 / 345 / 100 us).
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
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--schedule", default="greenlets,threads",
                    help="Mesh(schedule=...) settings to time, comma-separated")
    ap.add_argument("--rng", default="per_rank,shared",
                    help="Mesh(rng=...) settings to time, comma-separated")
    a = ap.parse_args()

    body = lambda x: x * 2  # noqa: E731 - the trivial body
    x = torch.randn(64, 16)
    xg = x.clone().requires_grad_()
    one = per_call(lambda: body(x), a.calls, a.repeats)
    one_bwd = per_call(lambda: body(xg).sum().backward(), a.calls, a.repeats)

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.python_version()}, "
          f"torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"bodies on f32{list(x.shape)}; one device: x * 2 {one:.1f} us, its "
          f"forward+backward {one_bwd:.1f} us\n")
    print("| ranks | schedule | rng | x * 2 (us) | psum (us) | grad psum (us) |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for n in [int(r) for r in a.ranks.split(",")]:
        bare = bare_handoff(n, body, x, a.calls, a.repeats)
        print(f"| {n} | bare threads, no spmd | | {bare:.1f} | | |")
        for schedule in a.schedule.split(","):
            for rng in a.rng.split(","):
                mesh = spmd.Mesh((n,), ("sp",), rng=rng, schedule=schedule)
                f = spmd.shard_map(body, mesh, P("sp"), P("sp"))
                s = spmd.shard_map(lambda x: spmd.psum((x * 2).sum(), "sp"), mesh, P("sp"),
                                   P())
                fwd = per_call(lambda f=f: f(x), a.calls, a.repeats)
                red = per_call(lambda s=s: s(x), a.calls, a.repeats)
                grad = per_call(lambda s=s: s(xg).backward(), max(1, a.calls // 2),
                                a.repeats)
                print(f"| {n} | {schedule} | {rng} | {fwd:.1f} | {red:.1f} | {grad:.1f} |")


if __name__ == "__main__":
    main()
