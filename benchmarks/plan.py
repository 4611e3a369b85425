"""How long ``spmd.plan`` takes: a 3-level U-Net (conv, max-pool, nearest upsample, skip
concatenated on channels) planned for 64 ranks, every candidate measured on a mesh of at
most 3 ranks per axis at its local shape and predicted (``measure_ranks``, default 8),
and for 8 ranks, every candidate run at its own shape.

    python benchmarks/plan.py [--size 512] [--ranks 64,8] [--repeats 3] [--warmup 1]
                              [--check]

Prints the load average, each plan's table and the seconds it took (one run each;
the machine is shared: read the load). ``--check`` then runs every usable candidate
as a user would (convert, shard_map, two training steps on a threads mesh of its
shape) and compares the bytes the busiest rank sends (comm_stats) and its memory
(saved-tensor hooks + input shard + outputs + twice the parameters) with the plan's:
predicted ones too (``--size 128 --ranks 64 --check``: about 10 s a candidate).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd.testing.memory import SavedBytes


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


def run(model: nn.Module, c, x: torch.Tensor) -> tuple[int, int]:
    """(bytes sent, memory) of the busiest rank of ``c`` run directly."""
    mesh = c.mesh("threads")
    sharded = spmd.nn.convert(model, mesh, c.spec)
    params = [p for p in sharded.parameters() if p.requires_grad]
    held: dict[int, int] = {}

    def body(xl):
        with SavedBytes([*params, xl]) as s:
            y = sharded(xl)
        held[spmd.axis_index(mesh.axis_names)] = s.total + xl.nbytes + y.nbytes
        return y

    f = spmd.shard_map(body, mesh, c.spec, c.spec, params=params)
    for _ in range(2):  # the second step is the steady state
        with spmd.comm_stats() as st:
            f(x).sum().backward()
    sent = [0] * mesh.size
    for *_, rank, _pass, nbytes in st.records:
        sent[rank] += nbytes
    pbytes = sum(p.numel() * p.element_size() for p in params)
    return max(sent), max(held.values()) + 2 * pbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--ranks", default="64,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--check", action="store_true")
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
        for c in plan.ranked if a.check else ():
            sent, mem = run(model, c, x)
            print(f"  {'x'.join(map(str, c.mesh_shape))} {c.spec}: sent {c.comm_bytes:,} B "
                  f"planned, {sent:,} B run; memory {c.memory_bytes:,} B planned, "
                  f"{mem:,} B run")


if __name__ == "__main__":
    main()
