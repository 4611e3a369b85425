"""Save a sharded field on one gloo world and load it on others: time and bytes per rank.

    python benchmarks/checkpoint.py [--shape 1,16,2048,1024] [--save 4] [--load 2,3,4]

A float32 field of ``--shape`` (128 MiB by default) is split over H on ``--save``
gloo processes (each makes only its own shard) and saved with ``spmd.checkpoint.save``
together with a model's state (the demo CNN, replicated). Each ``--load`` world then
loads it in its own layout: H split over its ranks, and for comparison the same world
with W split instead (each new shard cuts across every stored chunk). Per row:

    save s, load s     the slowest rank's wall time (fsync included in save)
    MiB read/rank      the largest tensor bytes any rank read (spmd.checkpoint.read_stats)
    ideal              its new shard's bytes: what it must read at least
    stock DCP          what torch's FileSystemReader would read for the same plan: every
                       stored chunk the new shard touches, whole (from the metadata)
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import torch
from torch.distributed.checkpoint import FileSystemReader

import spmd
import spmd.checkpoint as ck
from spmd import Layout, P, Sharded, demo

MiB = 1 << 20


def _field(lay: Layout, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + lay.offsets(rank)[2])
    return torch.randn(lay.local_shape(rank), generator=g)


def save_rank(mesh, path, shape):
    torch.set_num_threads(1)
    lay = Layout(shape, P(None, None, "sp"), mesh)
    u = Sharded.from_local(_field(lay, mesh.rank), mesh, lay)
    model = demo.make_model(hidden=16)
    t0 = time.perf_counter()
    ck.save({"model": model.state_dict(), "u": u, "step": 1}, path, mesh)
    return time.perf_counter() - t0


def load_rank(mesh, path, shape, dim):
    torch.set_num_threads(1)
    spec = [None] * 4
    spec[dim] = "sp"
    lay = Layout(shape, P(*spec), mesh)
    model = demo.make_model(hidden=16)
    t0 = time.perf_counter()
    with ck.read_stats() as st:
        got = ck.load({"model": model.state_dict(), "u": lay, "step": 0}, path, mesh)
    dt = time.perf_counter() - t0
    field = st.payload_bytes - sum(t.numel() * t.element_size()
                                   for t in got["model"].values())
    return dt, field, got["u"].local.numel() * 4, _stock(path, lay, mesh.rank)


def _stock(path, lay: Layout, rank: int) -> int:
    """Bytes FileSystemReader reads for this rank's new shard: each touched chunk, whole."""
    md = FileSystemReader(ck.latest(path)).read_metadata()
    off, size = lay.offsets(rank), lay.local_shape(rank)
    total = 0
    for c in md.state_dict_metadata["u"].chunks:
        if all(o < co + cs and co < o + s for o, s, co, cs in
               zip(off, size, c.offsets, c.sizes)) and math.prod(size):
            total += math.prod(c.sizes) * 4
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,16,2048,1024")
    ap.add_argument("--save", type=int, default=4)
    ap.add_argument("--load", default="2,3,4")
    a = ap.parse_args()
    shape = tuple(int(s) for s in a.shape.split(","))
    root = tempfile.mkdtemp(prefix="spmd-ckpt-bench-")
    path = os.path.join(root, "ck")
    print(f"# spmd.checkpoint, f32{list(shape)} ({math.prod(shape) * 4 / MiB:.0f} MiB) + demo "
          f"CNN state; torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, gloo, 1 thread per process")
    try:
        t = spmd.launch(save_rank, (a.save,), ("sp",), backend="gloo", args=(path, shape),
                        timeout=600)
        print(f"save on {a.save} ranks (H split): {max(t):.2f} s")
        print()
        print("| load on | split | load s | MiB read/rank | ideal | stock DCP |")
        print("| ---: | :---: | ---: | ---: | ---: | ---: |")
        for w in (int(x) for x in a.load.split(",")):
            for dim, name in ((2, "H"), (3, "W")):
                rows = spmd.launch(load_rank, (w,), ("sp",), backend="gloo",
                                   args=(path, shape, dim), timeout=600)
                worst = max(rows, key=lambda r: r[1])
                print(f"| {w} | {name} | {max(r[0] for r in rows):.2f} | "
                      f"{worst[1] / MiB:.1f} | {worst[2] / MiB:.1f} | "
                      f"{max(r[3] for r in rows) / MiB:.1f} |")
                sys.stdout.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
