"""Training step time: spmd.parallel.GradSync against torch's DistributedDataParallel.

Gloo, world 2 (two spawned processes on 127.0.0.1), one thread per rank
(``torch.set_num_threads(1)``), data parallel over one mesh axis ("dp": mean).

    python benchmarks/grad_sync.py [--steps 30] [--warmup 5] [--models mlp,cnn,mlp_reverse]
                                   [--bucket-cap-mb 25] [--first-bucket-cap-mb 1]

Models (each rank its own batch; both variants start from the same weights):

    mlp          4 x Linear(1024, 1024) with ReLU, batch 32 per rank (16 MiB of fp32
                 gradients: two buckets at the default caps, 1 MiB first, then 25 MiB)
    cnn          3 conv layers (3->32->64->128, 3x3, max-pooling), global average pooling,
                 Linear(128, 10); batch 8 per rank of 3 x 64 x 64 (0.4 MiB of gradients)
    mlp_reverse  the mlp with its layers defined in the reverse of the order forward uses
                 them (GradSync learns the order in the first step; so does DDP)

A step is ``zero_grad(); loss.backward(); step()`` (``sync.wait()`` before the step for
GradSync; both reduce inside backward, finishing when the autograd engine does). Variants run interleaved, in an order rotated
each step, after a barrier outside the timed region; times are taken on rank 0 with
``perf_counter``. Columns:

    DDP, GradSync   median step time (ms)
    local           the same step with no communication at all (the compute floor)
    ratio           median over steps of the paired ratio GradSync / DDP (same step
                    index), and its range over 5 blocks of steps (wide = the load moved)
    exposed         median over steps of the time spent at the end of backward starting
                    the last buckets and waiting for all of them (and in ``sync.wait()``),
                    by the rank that waited least (the other one also waits for its lag)
    alone           median time to all-reduce the same buckets with nothing else running
    overlap         1 - exposed / alone: the part of GradSync's communication hidden
                    behind backward (0 = none, 1 = all; noise can push it below 0)
    DDP comm        median(DDP) - median(local): what communication adds to a DDP step

Then per-phase medians on rank 0 (forward with zero_grad, backward, wait, step) say where
the time goes, and the bucket plans are printed.

The target: ratio <= 1.0.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

from spmd.comm import comm_of

# Runnable from a checkout without installing.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

MODELS = ("mlp", "cnn", "mlp_reverse")


def _build(name: str):
    import torch
    from torch import nn

    if name in ("mlp", "mlp_reverse"):
        class MLP(nn.Module):
            def __init__(self, reverse: bool):
                super().__init__()
                names = ["l0", "l1", "l2", "l3"]
                for n in (reversed(names) if reverse else names):
                    setattr(self, n, nn.Linear(1024, 1024))

            def forward(self, x):
                for n in ("l0", "l1", "l2"):
                    x = torch.relu(getattr(self, n)(x))
                return self.l3(x)

        return MLP(name == "mlp_reverse"), (32, 1024), (32, 1024)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 10))
    return model, (8, 3, 64, 64), (8, 10)


def per_rank(mesh, name: str, steps: int, warmup: int, caps: tuple[float, float]) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, xshape, yshape = _build(name)
    g = torch.Generator().manual_seed(1 + mesh.rank)
    x, y = torch.randn(xshape, generator=g), torch.randn(yshape, generator=g)

    cap, first = caps
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gs_model = copy.deepcopy(base)
    sync = spmd.parallel.GradSync(gs_model, mesh, {"dp": "mean"}, bucket_cap_mb=cap,
                                  first_bucket_cap_mb=first)
    gs_opt = torch.optim.SGD(gs_model.parameters(), lr=1e-4)
    local = copy.deepcopy(base)
    local_opt = torch.optim.SGD(local.parameters(), lr=1e-4)
    mse = torch.nn.functional.mse_loss
    flag = torch.zeros(1)
    waits: list[float] = []
    clock = time.perf_counter

    phases: dict[str, list[tuple[float, ...]]] = {"DDP": [], "GradSync": [], "local": []}

    def run(v, model, opt, sync=None):
        t0 = clock()
        opt.zero_grad()
        loss = mse(model(x), y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        if sync is not None:
            sync.wait()
        t3 = clock()
        opt.step()
        t4 = clock()
        phases[v].append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        if sync is not None:
            # The buckets left at the end of backward are started and waited for there
            # (inside loss.backward()); wait() only ends the iteration.
            waits.append(sync._finish_s + (t3 - t2))

    def step_ddp():
        run("DDP", ddp, ddp_opt)

    def step_gs():
        run("GradSync", gs_model, gs_opt, sync)

    def step_local():
        run("local", local, local_opt)

    variants = {"DDP": step_ddp, "GradSync": step_gs, "local": step_local}
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + steps):
        k = i % len(names)
        for v in names[k:] + names[:k]:
            dist.all_reduce(flag)  # line the ranks up, outside the timed region
            t = clock()
            variants[v]()
            dt = clock() - t
            if i >= warmup:
                times[v].append(dt)
    waits = waits[warmup:]
    # The same buckets all-reduced with nothing else running.
    alone = []
    comm, group = comm_of(mesh), sync.group
    for _ in range(max(steps // 2, 10)):
        dist.all_reduce(flag)
        t = clock()
        works = [comm.all_reduce_async(b.buffer, "sum", group, name="alone")
                 for b in sync._buckets]
        for w in works:
            w.wait()
        alone.append(clock() - t)
    phase_ms = {v: [statistics.median(p[k] for p in ps[warmup:]) * 1e3 for k in range(4)]
                for v, ps in phases.items()}
    return {"times": times, "waits": waits, "alone": alone, "phases": phase_ms,
            "buckets": [repr(b) for b in sync.buckets]}


def _med(v: list[float]) -> float:
    return statistics.median(v) * 1e3


def report(name: str, results: list[dict], blocks: int = 5) -> tuple[str, float]:
    res = results[0]
    t = res["times"]
    ratios = [a / b for a, b in zip(t["GradSync"], t["DDP"])]
    ratio = statistics.median(ratios)
    n = len(ratios)
    per = [statistics.median(ratios[i * n // blocks:(i + 1) * n // blocks])
           for i in range(blocks) if (i + 1) * n // blocks > i * n // blocks]
    exposed = _med([min(w) for w in zip(*(r["waits"] for r in results))])
    alone = _med(res["alone"])
    overlap = 1 - exposed / alone if alone > 0 else float("nan")
    row = (f"| {name} | {_med(t['DDP']):.1f} | {_med(t['GradSync']):.1f} | "
           f"{_med(t['local']):.1f} | {ratio:.3f} | {min(per):.2f}-{max(per):.2f} | "
           f"{exposed:.2f} | {alone:.2f} | {overlap:.2f} | "
           f"{_med(t['DDP']) - _med(t['local']):.1f} |")
    return row, ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="both DDP's and GradSync's bucket cap (default 25, DDP's)")
    ap.add_argument("--first-bucket-cap-mb", type=float, default=1.0,
                    help="GradSync's first bucket cap (DDP's is fixed at 1 MiB)")
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {MODELS}")
    if a.steps < 20:
        ap.error("--steps must be at least 20 (fewer paired steps give no stable median)")

    import torch

    import spmd

    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "?"
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load}; gloo world 2, 1 thread per rank; "
          f"{a.steps} steps after {a.warmup} warm-up\n")
    print("| model | DDP ms | GradSync ms | local ms | ratio | ratio range | exposed ms | "
          "alone ms | overlap | DDP comm ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    plans, phase_tables = {}, {}
    for m in models:
        res = spmd.launch(per_rank, (2,), ("dp",), backend="gloo",
                          args=(m, a.steps, a.warmup, (a.bucket_cap_mb, a.first_bucket_cap_mb)),
                          timeout=600)
        row, _ = report(m, res)
        print(row, flush=True)
        plans[m] = res[0]["buckets"]
        phase_tables[m] = res[0]["phases"]
    print("\nPhases on rank 0, median ms (forward incl. zero_grad | backward | wait | step):")
    for m, ph in phase_tables.items():
        print(f"  {m}: " + "; ".join(f"{v} " + " | ".join(f"{t:.1f}" for t in ts)
                                    for v, ts in ph.items()))
    print("\nGradSync bucket plans (after the first step):")
    for m, p in plans.items():
        print(f"  {m}:")
        for b in p:
            print(f"    {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
