"""Per-call cost of shard_map on a threads mesh, for trivial bodies.

    python benchmarks/shard_map_overhead.py [--ranks 1,2,4,8] [--calls 2000] [--repeats 7]
                                            [--schedule greenlets,threads]
                                            [--rng per_rank,shared]

Three bodies on f32[64, 16] split over the ranks: ``x * 2``; ``psum((x * 2).sum())``;
and the gradient of the latter (``f(x).backward()`` with ``x.requires_grad``). Each row
is the median over repeats of the mean time per call (microseconds), for each mesh
``schedule`` (``"greenlets"``: ranks switch in the calling thread at collectives;
``"threads"``: a thread per rank) and ``rng`` (``"per_rank"``: each rank draws from its
own generator). Three rows are floors, with none of spmd: "bare threads" (any design
with a thread per rank: ``x * 2`` on n threads, released and joined with raw locks),
"bare greenlets" (a greenlet per rank: each rank's narrow and body on a persistent
greenlet, the psum a switch to the caller, which adds the ranks' values, or in grad
mode applies one autograd Function over every rank's value) and "one loop" (no rank
switches at all: the ranks' bodies one after the other in one loop, so it cannot wait
in a collective; the psum as above). Whatever runs each rank's torch ops eagerly, with
an autograd graph per rank, pays at least the "one loop" row. The row "ranks batched" is
another kind of program: one torch op for all ranks, on the ranks' shards stacked along
a new leading dim (the psum a sum over it), which is what a body traced once and run on
rank-stacked tensors (JAX's ``vmap`` with an axis name) would cost at least.

The project's targets, 8 ranks on a 2-core CPU machine: x * 2 <= 150 us, psum <= 250
us, its gradient <= 400 us (JAX 0.10.2's jit-compiled shard_map on 8 fake CPU devices,
same kind of machine: 275 / 345 / 100 us; ``benchmarks/jax_shard_map.py`` times them).
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


class _MeshSum(torch.autograd.Function):
    """A sum over every rank's value, as one node (what spmd's psum is on greenlets)."""

    @staticmethod
    def forward(ctx, *xs):
        total = xs[0]
        for t in xs[1:]:
            total = total + t
        return tuple(total.clone() for _ in xs)

    @staticmethod
    def backward(ctx, *gs):
        total = gs[0]
        for g in gs[1:]:
            total = total + g
        return tuple(total for _ in gs)


def _mesh_sum(parts: list) -> list:
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return list(_MeshSum.apply(*parts))
    total = parts[0]
    for t in parts[1:]:
        total = total + t
    return [total.clone() for _ in parts]


def bare_greenlets(n: int, body, calls: int, repeats: int) -> tuple[float, float, float]:
    """The floor of a greenlet per rank: (x * 2, psum, grad psum) with none of spmd."""
    from greenlet import getcurrent, greenlet

    main, k = getcurrent(), 64 // n
    src = {"x": torch.randn(64, 16)}
    res: list = [None] * n
    parts: list = [None] * n
    summed: list = [None]

    def work(_):
        job = main.switch(None)
        while True:
            kind, r = job
            t = body(src["x"].narrow(0, k * r, k))
            if kind == "psum":
                parts[r] = t.sum()
                main.switch("wait")
                t = summed[0][r]
            res[r] = t
            job = main.switch("done")

    workers = [greenlet(work, main) for _ in range(n)]
    for w in workers:
        w.switch(None)

    def fwd():
        for r, w in enumerate(workers):
            w.switch(("x2", r))
        return torch.cat(res)

    def red():
        for r, w in enumerate(workers):
            w.switch(("psum", r))
        summed[0] = _mesh_sum(parts)
        for w in workers:
            w.switch()
        return res[0]

    a = per_call(fwd, calls, repeats)
    b = per_call(red, calls, repeats)
    src["x"] = src["x"].requires_grad_()
    c = per_call(lambda: red().backward(), max(1, calls // 2), repeats)
    return a, b, c


def one_loop(n: int, body, calls: int, repeats: int) -> tuple[float, float, float]:
    """The floor of any per-rank eager program: the ranks one after the other."""
    k = 64 // n
    x = torch.randn(64, 16)
    xg = x.clone().requires_grad_()

    def red(x):
        return _mesh_sum([body(x.narrow(0, k * r, k)).sum() for r in range(n)])[0]

    return (per_call(lambda: torch.cat([body(x.narrow(0, k * r, k)) for r in range(n)]),
                     calls, repeats),
            per_call(lambda: red(x), calls, repeats),
            per_call(lambda: red(xg).backward(), max(1, calls // 2), repeats))


def ranks_batched(n: int, body, calls: int, repeats: int) -> tuple[float, float, float]:
    """One op for all ranks: the shards stacked along a new dim 0, the psum a sum over it."""
    x = torch.randn(64, 16)
    xg = x.clone().requires_grad_()

    def red(x):
        return body(x.view(n, 64 // n, 16)).sum((1, 2)).sum().expand(n)[0]

    return (per_call(lambda: body(x.view(n, 64 // n, 16)).view(64, 16), calls, repeats),
            per_call(lambda: red(x), calls, repeats),
            per_call(lambda: red(xg).backward(), max(1, calls // 2), repeats))


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
        for name, fn in (("bare greenlets, no spmd", bare_greenlets),
                         ("one loop, no spmd", one_loop), ("ranks batched, no spmd",
                                                           ranks_batched)):
            cols = " | ".join(f"{v:.1f}" for v in fn(n, body, a.calls, a.repeats))
            print(f"| {n} | {name} | | {cols} |")
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
