"""A training step and halo'd ops on the simulated mesh (a threads mesh), against one device.

    python benchmarks/simulated_steps.py [--ranks 4,8] [--size 128] [--repeats 5]
                                         [--schedule greenlets,threads]

Rows: ``halo_pad`` (one row each side along H) and ``spmd.ops.conv2d`` (3x3, 'same') on
f32[1, 4, 64, 64] split along H, in no_grad and as forward + backward; and a training
step (forward, backward) of the demo's 3-level U-Net converted with ``spmd.nn.convert``
on f32[1, 4, size, size] split along H. Each cell is the best over ``repeats`` of the
mean time per call (milliseconds); the "one device" column is the same work unsplit.
What a call costs above one device is the simulated mesh's own: every rank's shard
runs in one process, one rank at a time, plus spmd's Python per rank and collective.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import spmd
from spmd import P
from spmd.demo import UNet

H = P(None, None, "sp")


def best(fn, calls: int, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return min(times) * 1e3


def rows(n: int, schedule: str, size: int, repeats: int) -> list[tuple[str, float, float]]:
    mesh = spmd.Mesh((n,), ("sp",), schedule=schedule)
    torch.manual_seed(0)
    x = torch.randn(1, 4, 64, 64)
    xg = x.clone().requires_grad_()
    w = torch.randn(4, 4, 3, 3, requires_grad=True)
    halo = spmd.shard_map(lambda t: spmd.halo_pad(t, mesh, "sp", 2, 1), mesh, H, H)
    conv = spmd.shard_map(lambda t: spmd.ops.conv2d(t, w, padding=1, mesh=mesh, spec=H),
                          mesh, H, H)
    one_conv = lambda t: torch.nn.functional.conv2d(t, w, padding=1)  # noqa: E731
    out = []
    with torch.no_grad():
        out.append(("halo_pad, no_grad", best(lambda: halo(x), 50, repeats),
                    best(lambda: torch.nn.functional.pad(x, (0, 0, 1, 1)), 50, repeats)))
        out.append(("conv2d, no_grad", best(lambda: conv(x), 50, repeats),
                    best(lambda: one_conv(x), 50, repeats)))
    out.append(("conv2d, forward + backward", best(lambda: conv(xg).sum().backward(), 20,
                                                   repeats),
                best(lambda: one_conv(xg).sum().backward(), 20, repeats)))
    model, xu = UNet(c=4, w=8, levels=3), torch.randn(1, 4, size, size)
    step = spmd.shard_map(spmd.nn.convert(model, mesh, H), mesh, H, H)
    out.append((f"U-Net step on [1, 4, {size}, {size}]",
                best(lambda: step(xu).sum().backward(), 3, repeats),
                best(lambda: model(xu).sum().backward(), 3, repeats)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--schedule", default="greenlets,threads")
    a = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, load average "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| ranks | schedule | what | simulated mesh (ms) | one device (ms) |")
    print("| ---: | --- | --- | ---: | ---: |")
    for n in [int(r) for r in a.ranks.split(",")]:
        for schedule in a.schedule.split(","):
            for what, mesh_ms, one_ms in rows(n, schedule, a.size, a.repeats):
                print(f"| {n} | {schedule} | {what} | {mesh_ms:.2f} | {one_ms:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
