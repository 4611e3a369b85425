"""How long ``spmd.plan`` takes: a 3-level U-Net (conv, max-pool, nearest upsample, skip
concatenated on channels) planned for 64 ranks, every candidate measured on a mesh of at
most 3 ranks per axis at its local shape and predicted (``measure_ranks``, default 8),
and for 8 ranks, every candidate run at its own shape.

    python benchmarks/plan.py [--size 512] [--ranks 64,8] [--repeats 3] [--warmup 1]

Prints the load average, each plan's table and the seconds it took (one run each;
the machine is shared: read the load).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import spmd


class UNet(nn.Module):
    def __init__(self, c: int = 4, w: int = 8, levels: int = 3):
        super().__init__()
        self.inc = nn.Conv2d(c, w, 3, padding=1)
        self.down = nn.ModuleList(nn.Conv2d(w, w, 3, padding=1) for _ in range(levels))
        self.up = nn.ModuleList(nn.Conv2d(2 * w, w, 3, padding=1) for _ in range(levels))
        self.out = nn.Conv2d(w, 1, 1)

    def forward(self, x):
        h = torch.relu(self.inc(x))
        skips = []
        for conv in self.down:
            skips.append(h)
            h = torch.relu(conv(F.max_pool2d(h, 2)))
        for conv, s in zip(self.up, reversed(skips)):
            h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = torch.relu(conv(torch.cat([h, s], 1)))
        return self.out(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--ranks", default="64,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = UNet(), torch.randn(1, 4, a.size, a.size)
    print(f"load average {os.getloadavg()[0]:.2f}; input {list(x.shape)}, 3-level U-Net")
    for ranks in (int(r) for r in a.ranks.split(",")):
        t0 = time.perf_counter()
        plan = spmd.plan(model, x, ranks=ranks, network=spmd.perf.NETWORKS["ib_ndr"],
                         repeats=a.repeats, warmup=a.warmup)
        dt = time.perf_counter() - t0
        print(plan)
        print(f"{ranks} ranks: {len(plan.candidates)} candidates planned in {dt:.1f} s "
              f"(load average {os.getloadavg()[0]:.2f})\n")


if __name__ == "__main__":
    main()
