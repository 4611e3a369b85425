"""Eager against ``torch.compile``d shard_map bodies: the demo CNN's training step.

    python benchmarks/compile.py [--size 256] [--steps 15] [--hidden 16]

The demo's ``HeatCNN`` (3x3 convs, tanh, a residual) with its convolutions swapped for
``spmd.nn.Conv2d`` twins (same parameters), f32[2, 2, size, size], rows split over "sp";
one step = the global MSE's forward (psum), backward and shard_map's gradient sum.
Compiled: ``shard_map(torch.compile(body, dynamic=False), ...)``: every spmd call in
it is one opaque graph node (``spmd.collectives.compiled``), inductor compiles the rest.
Rows: one process (a 1-rank threads mesh), gloo world 2 (one torch thread per
process; the slowest rank's step), and a 2-rank threads mesh. Times are medians after
warm-up steps (the compile, and the first compiled call, which AOTAutograd checks and
whose backward recomputes its spmd forward, are left out; the compile time is shown).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import spmd
from spmd import P, demo

SPEC = P(None, None, "sp")


def _sharded(model: torch.nn.Module, mesh: spmd.Mesh) -> torch.nn.Module:
    m = copy.deepcopy(model)
    for i, layer in enumerate(m.net):
        if isinstance(layer, torch.nn.Conv2d):
            m.net[i] = spmd.nn.Conv2d.from_torch(layer, mesh, SPEC)
    return m


def _steps(mesh: spmd.Mesh, size: int, steps: int, hidden: int, compiled: bool):
    """Median step seconds (and the first call's) of one rank, eager or compiled."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, size, size, generator=g)
    t = torch.randn(2, 1, size, size, generator=g)
    model = _sharded(demo.make_model(hidden=hidden), mesh)
    n = t.numel()

    def body(x, t):
        return spmd.psum(((model(x) - t) ** 2).sum(), "sp") / n

    f = spmd.shard_map(torch.compile(body, dynamic=False) if compiled else body, mesh,
                       (SPEC, SPEC), P())
    times = []
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        f(x, t).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]), times[0]


def _gloo(mesh, size, steps, hidden):
    torch.set_num_threads(1)
    return [_steps(mesh, size, steps, hidden, c) for c in (False, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=16)
    a = ap.parse_args()
    print(f"demo CNN step, f32[2, 2, {a.size}, {a.size}], hidden {a.hidden}, "
          f"torch {torch.__version__}")
    print("| where | eager ms | compiled ms | eager / compiled | first compiled call s |")
    print("|---|---:|---:|---:|---:|", flush=True)
    rows = []
    torch.set_num_threads(1)
    one = spmd.Mesh((1,), ("sp",))
    rows.append(("1 process, 1 thread",
                 [_steps(one, a.size, a.steps, a.hidden, c) for c in (False, True)]))
    res = spmd.launch(_gloo, (2,), ("sp",), backend="gloo",
                      args=(a.size, a.steps, a.hidden), timeout=1800)
    slowest = [(max(r[c][0] for r in res), max(r[c][1] for r in res)) for c in (0, 1)]
    rows.append(("gloo world 2, 1 thread each", slowest))
    torch.set_num_threads(2)
    two = spmd.Mesh((2,), ("sp",))
    rows.append(("threads mesh of 2, 2 threads",
                 [_steps(two, a.size, a.steps, a.hidden, c) for c in (False, True)]))
    for name, ((e, _), (c, first)) in rows:
        print(f"| {name} | {e * 1e3:.1f} | {c * 1e3:.1f} | {e / c:.2f} | {first:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
