"""Domain-parallel conv2d, forward + backward, on gloo processes against one process.

    python benchmarks/conv_domain_parallel.py [--world 2] [--shape 1,32,512,512]
        [--channels-out 32] [--kernel 3] [--steps 10] [--mode zeros|circular] [--stride 1]

Every process uses one thread (torch.set_num_threads(1)). One step is a kxk conv2d
('same' padding, ``--mode``) forward and backward (input and weight gradients) from a
fixed cotangent:

- ``one process``: ``F.conv2d`` on the whole input (T1);
- ``spmd.ops.conv2d``: the input split over H on ``world`` processes, each rank
  running the op on its shard (halo exchange in forward, its transpose in backward),
  then the weight gradient summed over ranks (one all-reduce, what GradSync does). The
  halo travels while the shard's own conv runs (``conv.py: _Frame``); with ``--mode
  circular`` W is wrapped too, a second level (its halo carries the corners) that
  travels while the first level's slabs run, and in backward while the weight
  gradient runs. ``--stride 2`` on even shards is framed too;
- ``spmd, window first``: the same op with the frame turned off: the whole window is
  fetched, then convolved (what every conv did before; a strided one on uneven shards);
- ``hand-written`` (stride 1): the same with a hand-written halo exchange (``dist.isend``/
  ``irecv`` of the rows each neighbour needs, ``F.pad``, ``F.conv2d``, and the halo
  rows' gradients sent back and added), the lower bound spmd should match.

The spmd variants and the hand-written one run interleaved, step by step, so a change
in the machine's load touches them alike. Parallel efficiency is ``T1 / (world *
T_world)``; above 1 means the split runs faster than linear (smaller working sets fit
the cache better). Bytes are what each rank sent per step (spmd.comm_stats), halo rows
plus the weight-gradient all-reduce.
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import median_ms

import spmd
from spmd import Layout, P
from spmd.comm import comm_of
from spmd.ops import conv as conv_mod


def _inputs(shape, c_out, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(c_out, shape[1], k, k, generator=g) * 0.05
    return x, w


def single(shape, c_out, k, steps, mode, stride):
    torch.set_num_threads(1)
    x, w = _inputs(shape, c_out, k)
    x.requires_grad_()
    w.requires_grad_()

    def conv():
        return (F.conv2d(x, w, stride=stride, padding=k // 2) if mode == "zeros" else
                F.conv2d(F.pad(x, [k // 2] * 4, mode=mode), w, stride=stride))
    gy = torch.randn(conv().shape)

    def step():
        torch.autograd.grad(conv(), (x, w), gy)
    return median_ms(step, steps)


def _window_first():
    """spmd's conv with the frame turned off: the whole window, then the conv."""
    return patch.object(conv_mod, "_frame_plan", lambda *args: None)


def per_rank(mesh, shape, c_out, k, steps, mode, stride):
    torch.set_num_threads(1)
    spec = P(None, None, "sp")
    lay = Layout(shape, spec, mesh)
    xg, wg = _inputs(shape, c_out, k)
    x = lay.shard(xg, mesh.rank).clone().requires_grad_()
    w = wg.clone().requires_grad_()
    out = spmd.ops.conv2d.output_layout(lay, w.shape, stride=stride, padding=k // 2)
    gy = torch.randn(out.local_shape(mesh.rank))
    group = mesh.group("sp", mesh.rank)

    def spmd_step():
        with mesh:
            y = spmd.ops.conv2d(x, w, stride=stride, padding=k // 2, padding_mode=mode,
                                mesh=mesh, spec=lay)
            gx, gw = torch.autograd.grad(y, (x, w), gy)
            comm_of(mesh).all_reduce(gw, "sum", group, name="weight grad")

    def window_step():
        with _window_first():
            spmd_step()

    h = k // 2
    rank, world = mesh.rank, mesh.size
    pg = comm_of(mesh).process_group(group)
    wrap = mode == "circular"

    def exchange(top, bottom):
        """Send ``top`` up and ``bottom`` down (around the ends where ``wrap``); return
        what came from above and below. Tags tell the two apart when both neighbours
        are one rank."""
        reqs, got_up, got_down = [], None, None
        if rank > 0 or wrap:
            got_up = torch.empty_like(top)
            reqs += [dist.isend(top.contiguous(), (rank - 1) % world, group=pg, tag=0),
                     dist.irecv(got_up, (rank - 1) % world, group=pg, tag=1)]
        if rank < world - 1 or wrap:
            got_down = torch.empty_like(bottom)
            reqs += [dist.isend(bottom.contiguous(), (rank + 1) % world, group=pg, tag=1),
                     dist.irecv(got_down, (rank + 1) % world, group=pg, tag=0)]
        for r in reqs:
            r.wait()
        return got_up, got_down

    def hand_step():
        xd = x.detach()
        above, below = exchange(xd[:, :, :h], xd[:, :, -h:])
        zeros = xd.new_zeros(xd.shape[0], xd.shape[1], h, xd.shape[3])
        xp = torch.cat([above if above is not None else zeros, xd,
                        below if below is not None else zeros], dim=2).requires_grad_()
        y = (F.conv2d(F.pad(xp, (h, h, 0, 0), mode="circular"), w) if wrap
             else F.conv2d(xp, w, padding=(0, h)))
        gxp, gw = torch.autograd.grad(y, (xp, w), gy)
        gx = gxp[:, :, h:-h].clone()
        up, down = exchange(gxp[:, :, :h], gxp[:, :, -h:])
        if up is not None:
            gx[:, :, :h] += up
        if down is not None:
            gx[:, :, -h:] += down
        dist.all_reduce(gw, group=pg)

    steps_of = {"spmd": spmd_step, "window": window_step}
    if stride == 1:
        steps_of["hand"] = hand_step
    times = {name: [] for name in steps_of}
    for i in range(steps + 2):
        for name, step in steps_of.items():
            t0 = time.perf_counter()
            step()
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    with spmd.comm_stats() as s:
        spmd_step()
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}, s.bytes(rank=mesh.rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", default="1,32,512,512")
    ap.add_argument("--channels-out", type=int, default=32)
    ap.add_argument("--kernel", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mode", default="zeros", choices=["zeros", "circular"])
    ap.add_argument("--stride", type=int, default=1)
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    t1 = spmd.launch(lambda mesh: single(shape, a.channels_out, a.kernel, a.steps, a.mode,
                                         a.stride), (1,), ("sp",))[0]
    got = spmd.launch(per_rank, (a.world,), ("sp",), backend="gloo",
                      args=(shape, a.channels_out, a.kernel, a.steps, a.mode, a.stride),
                      timeout=600)
    t = {name: max(g[0][name] for g in got) for name in got[0][0]}  # the slowest rank
    print(f"conv2d f32{list(shape)} -> {a.channels_out} channels, {a.kernel}x{a.kernel}, "
          f"stride {a.stride}, padding_mode={a.mode!r}, forward + backward, split over H, gloo world "
          f"{a.world}, 1 thread per process\n")
    print("| variant | ms per step | parallel efficiency T1/(world*T) | bytes sent per rank |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| one process (T1) | {t1:.1f} | 1.00 | 0 |")
    rows = [("spmd.ops.conv2d (halo overlapped)", "spmd", ", ".join(str(g[1]) for g in got)),
            ("spmd, window first", "window", ""), ("hand-written halo conv", "hand", "")]
    for title, name, sent in rows:
        if name not in t:
            continue
        print(f"| {title} | {t[name]:.1f} | {t1 / (a.world * t[name]):.2f} | {sent} |")


if __name__ == "__main__":
    main()
