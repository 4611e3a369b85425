"""Size exchanges per step, with and without static layouts, paired in one run.

    python benchmarks/static_layouts.py [--size 256] [--steps 20] [--worlds 2,4]

The demo's CNN (``spmd.nn.convert``, 3 convolutions) and the test U-Net (convolutions,
max pool, bilinear upsampling), float32, one training step (forward and backward) of
``shard_map`` over a batch of 2 fields of ``size x size`` rows split over "sp", on gloo
processes (one thread each) and on a threads mesh. Columns, per world and backend:

    sizes/step     "<op> sizes" all_gathers per step after the first (comm_stats)
    ms/step        median step time, static_layouts=True then False, interleaved
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import spmd
from spmd import P, demo

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
SPEC = P(None, None, "sp")


def _model(which: str) -> torch.nn.Module:
    if which == "demo":
        return demo.make_model(hidden=16)
    from nn.test_unet import TinyUNet
    torch.manual_seed(0)
    return TinyUNet(c=8)


def _data(which: str, size: int):
    g = torch.Generator().manual_seed(0)
    c = 2 if which == "demo" else 1
    return torch.randn(2, c, size, size, generator=g), torch.randn(2, 1, size, size, generator=g)


def run(mesh, which: str, size: int, steps: int):
    torch.set_num_threads(1)
    x, t = _data(which, size)
    sharded = spmd.nn.convert(_model(which), mesh, SPEC)
    n = t.numel()
    fs = {s: spmd.shard_map(lambda x, t: spmd.psum(((sharded(x) - t) ** 2).sum(), "sp") / n,
                            mesh, (SPEC, SPEC), P(), static_layouts=s) for s in (True, False)}
    times = {True: [], False: []}
    sizes = {True: 0, False: 0}
    for i in range(steps + 1):
        for s in (True, False):  # interleaved: both see the same machine
            with spmd.comm_stats() as st:
                t0 = time.perf_counter()
                fs[s](x, t).backward()
                dt = time.perf_counter() - t0
            if i:  # the first call of each exchanges and warms up
                times[s].append(dt)
                sizes[s] += sum(1 for r in st.records if r[0].endswith(" sizes"))
    rank = mesh.rank if mesh.backend == "torch" else 0
    per = mesh.size if mesh.backend == "threads" else 1
    return {s: (sizes[s] / steps / per, statistics.median(times[s]) * 1e3) for s in times}, rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="2,4")
    a = ap.parse_args()
    print(f"# static layouts: f32[2, C, {a.size}, {a.size}], torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} cores; median of {a.steps} steps")
    print("| model | backend | world | sizes/step on | off | ms/step on | off |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for which in ("demo", "unet"):
        for w in (int(v) for v in a.worlds.split(",")):
            for backend in ("gloo", "threads"):
                if backend == "gloo":
                    res = spmd.launch(run, (w,), ("sp",), backend="gloo",
                                      args=(which, a.size, a.steps), timeout=600)
                    got = max((r[0] for r in res), key=lambda d: d[True][1])
                else:
                    got = run(spmd.Mesh((w,), ("sp",)), which, a.size, a.steps)[0]
                print(f"| {which} | {backend} | {w} | {got[True][0]:.0f} | {got[False][0]:.0f} "
                      f"| {got[True][1]:.1f} | {got[False][1]:.1f} |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
