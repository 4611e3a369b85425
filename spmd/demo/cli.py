"""python -m spmd demo: a domain-parallel CNN learns one step of 2-D heat diffusion,
trained with every field split over a mesh and, side by side, on one device.

The fields' rows are split over the ranks (unevenly unless they divide: 30 rows over
4 ranks are [8, 8, 7, 7]); every 3x3 convolution exchanges one halo row with each
neighbour; the loss is the global MSE (a psum of the ranks' sums). Both runs start
from the same weights and train with Adam; at the end the parameters must agree to
1e-5 (the exit status says whether they did).

Backends: threads (a simulated mesh, every rank a thread of this process), gloo (one
process per rank on 127.0.0.1 via spmd.launch), or torchrun (gloo on CPU, NCCL on CUDA;
add --standalone to rendezvous on a free port):

    torchrun --nproc-per-node 2 -m spmd demo --size 29
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time

import torch

from ..core.layout import balanced_sizes
from ..core.mesh import Mesh
from . import heat as demo

TOL = 1e-5
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m spmd demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks of the mesh (default 4; under torchrun: the world size)")
    ap.add_argument("--size", type=int, default=30,
                    help="rows of every field, split over the ranks (default 30: [8, 8, 7, 7])")
    ap.add_argument("--width", type=int, default=32, help="columns, not split (default 32)")
    ap.add_argument("--batch", type=int, default=8, help="fields per batch (default 8)")
    ap.add_argument("--steps", type=int, default=40, help="Adam steps (default 40)")
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3)")
    ap.add_argument("--hidden", type=int, default=16, help="channels of the CNN (default 16)")
    ap.add_argument("--backend", choices=("threads", "gloo"), default="threads",
                    help="threads: a simulated mesh in this process (default); gloo: one "
                         "process per rank on 127.0.0.1")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="float32",
                    help="float32 (default: its rounding differences stay ~1e-7 after "
                         "200 Adam steps) or float64")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    return ap


class Progress:
    """``callback(step, loss)`` for the train functions: one line rewritten with '\\r'
    on a terminal, else a line at step 1, every ``every`` steps and the last."""

    def __init__(self, label: str, steps: int, every: int = 10):
        self.label, self.steps, self.every = label, steps, every
        self.tty = sys.stdout.isatty()

    def __call__(self, step: int, loss: float) -> None:
        line = f"  training {self.label:<11} step {step:>4}/{self.steps}  loss {loss:.4e}"
        if self.tty:
            end = "\n" if step == self.steps else ""
            sys.stdout.write(f"\r{line}{end}")
        elif step in (1, self.steps) or step % self.every == 0:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _setup(a: argparse.Namespace, device=None):
    dtype = _DTYPES[a.dtype]
    data = demo.heat_data(a.batch, a.size, a.width, a.seed, dtype=dtype, device=device)
    model = demo.make_model(a.hidden, seed=a.seed, dtype=dtype, device=device)
    return data, model


def _header(a: argparse.Namespace, mesh_desc: str, ranks: int, model) -> None:
    rows = list(balanced_sizes(a.size, ranks))  # how train_sharded's spec splits the rows
    nparam = sum(p.numel() for p in model.parameters())
    print("spmd demo: a CNN learns one time step of 2-D heat diffusion, du/dt = kappa * lap(u)")
    print(f"  data   {a.batch} fields of {a.size} x {a.width} ({a.dtype}); inputs (u, kappa), "
          f"target u one step later (zero boundary)")
    print(f"  mesh   {mesh_desc}: rows split {rows} over axis 'sp'")
    print(f"  model  {len(model.net) // 2 + 1} conv 3x3 layers, {a.hidden} channels, tanh, "
          f"zero padding; {nparam:,} parameters; Adam lr {a.lr:g}, {a.steps} steps")


def _rows(steps: int) -> tuple[list[int], str]:
    if steps <= 20:
        return list(range(1, steps + 1)), "all steps"
    picked = sorted({*range(1, 6), *range(10, steps + 1, 10), steps})
    return picked, "steps 1-5, every 10th and the last"


def _report(a: argparse.Namespace, sharded: demo.History, single: demo.History,
            nbytes: dict[int, tuple[int, int]], by_op: dict[str, tuple[int, int]],
            note: str, spread: float | None = None) -> bool:
    """Print the comparison; ``spread``: how far the ranks' own copies of the parameters
    are apart (processes only), which must be within the tolerance too."""
    steps, which = _rows(len(single.losses))
    print(f"\nlosses ({which}):")
    print(f"  {'step':>5} | {'sharded loss':>14} | {'one-device loss':>15} | {'|diff|':>9}")
    for s in steps:
        x, y = sharded.losses[s - 1], single.losses[s - 1]
        print(f"  {s:>5} | {x:>14.8e} | {y:>15.8e} | {abs(x - y):>9.2e}")
    diff = demo.max_param_diff(sharded, single)
    ok = diff < TOL and (spread is None or spread < TOL)
    print(f"\nlargest |parameter difference| after {len(single.losses)} steps: {diff:.2e}  "
          f"{'PASS' if ok else 'FAIL'} (tolerance {TOL:g})")
    if spread is not None:
        print(f"  (and between the ranks' copies of the parameters: {spread:.2e})")

    print("\nbytes sent per step (spmd.comm_stats()):")
    print(f"  {'rank':>5} | {'forward':>10} | {'backward':>10} | {'total':>10}")
    for r, (f, b) in sorted(nbytes.items()):
        print(f"  {r:>5} | {f:>10,} | {b:>10,} | {f + b:>10,}")
    tf, tb = sum(f for f, _ in nbytes.values()), sum(b for _, b in nbytes.values())
    print(f"  {'total':>5} | {tf:>10,} | {tb:>10,} | {tf + tb:>10,}")
    ops = ", ".join(f"{op} {f:,}/{b:,}" for op, (f, b) in by_op.items())
    print(f"  by collective (forward/backward, all ranks): {ops}")
    print("  (conv2d: the halo row each 3x3 convolution takes from each neighbour, and in "
          "backward the halo's gradient sent back; "
          "psum: the loss; on processes only, shard_map backward: the parameter gradients' "
          "all-reduce, and shard_map backward check: a few int64s by which the ranks check "
          "that they hold the same parameters before that all-reduce)")

    print(f"\ntime per step (mean of steps 2-{len(single.losses)}): sharded "
          f"{sharded.seconds_per_step * 1e3:.1f} ms, one device {single.seconds_per_step * 1e3:.1f} ms"
          f" (first step: {sharded.first_step_seconds * 1e3:.0f} ms, "
          f"{single.first_step_seconds * 1e3:.0f} ms)")
    if note:
        print(f"  {note}")
    print("PASS" if ok else "FAIL")
    return ok


# -- backends ---------------------------------------------------------------------------------

def _gloo_rank(mesh: Mesh, model, data, steps: int, lr: float) -> demo.History:
    """Runs on every gloo process: the same data and weights, sharded training."""
    cb = Progress("sharded", steps) if mesh.rank == 0 else None
    return demo.train_sharded(model, mesh, data, steps, lr, callback=cb)


def _run_local(a: argparse.Namespace) -> bool:
    data, model = _setup(a)
    if a.backend == "threads":
        mesh = Mesh((a.ranks,), ("sp",), backend="threads")
        _header(a, repr(mesh), a.ranks, model)
        sharded = demo.train_sharded(model, mesh, data, a.steps, a.lr,
                                     callback=Progress("sharded", a.steps))
        nbytes, by_op = sharded.bytes_per_step, sharded.bytes_by_op
        spread = None  # the ranks share one copy of the parameters
        note = (f"(the threads mesh runs {a.ranks} ranks as threads of this process on the "
                f"same cores: it shows the numbers and bytes, not a speed-up)")
    elif a.backend == "gloo":
        from ..run.launcher import launch
        _header(a, f"{a.ranks} gloo processes on 127.0.0.1", a.ranks, model)
        t0 = time.perf_counter()
        hs = launch(_gloo_rank, (a.ranks,), ("sp",), backend="gloo",
                    args=(model, data, a.steps, a.lr), timeout=120.0)
        spread = max(demo.max_param_diff(hs[0], h) for h in hs)
        sharded = hs[0]
        nbytes = {r: h.bytes_per_step.get(r, (0, 0)) for r, h in enumerate(hs)}
        by_op = _sum_ops([h.bytes_by_op for h in hs])
        note = f"(gloo: {time.perf_counter() - t0:.1f} s for the run including process start-up)"
    else:
        raise ValueError(f"--backend must be threads or gloo, got {a.backend!r}")
    single = demo.train_single(model, data, a.steps, a.lr,
                               callback=Progress("one device", a.steps))
    return _report(a, sharded, single, nbytes, by_op, note, spread)


def _sum_ops(dicts: list[dict[str, tuple[int, int]]]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for d in dicts:
        for op, (f, b) in d.items():
            f0, b0 = out.get(op, (0, 0))
            out[op] = (f0 + f, b0 + b)
    return dict(sorted(out.items()))


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _run_torchrun(a: argparse.Namespace) -> bool:
    """Every torchrun process trains the sharded model; rank 0 also trains the
    one-device model and prints the report; every process exits with its verdict."""
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    try:
        return _torchrun_body(a, dist)
    finally:
        # The mesh and its comm refer to each other, so their process groups would be
        # freed by the interpreter's last collection, with no Python frame left, where a
        # process died with "terminate called without an active exception" (2 of 108
        # runs here; 0 of 70 with this collection: likely the cause, not proven at that
        # rate). Collected now, while torch.distributed still runs. And torch 2.13's gloo
        # can abort a process that exits while a peer still has traffic in flight: a
        # world barrier first makes the exit clean.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _torchrun_body(a: argparse.Namespace, dist) -> bool:
    """``_run_torchrun``'s work, in a frame of its own: what it made is garbage once it
    returns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh((world,), ("sp",), timeout=120.0)  # backend "torch": a process group exists
    data, model = _setup(a, mesh.device)
    if rank == 0:
        _header(a, f"{mesh!r}, torchrun world {world}, {mesh.device.type}", world, model)
    sharded = demo.train_sharded(model, mesh, data, a.steps, a.lr,
                                 callback=Progress("sharded", a.steps) if rank == 0 else None)
    mine = torch.tensor(sharded.bytes_per_step.get(rank, (0, 0)), device=mesh.device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    ops = [None] * world if rank == 0 else None
    dist.gather_object(sharded.bytes_by_op, ops, dst=0)
    # Each process holds its own copy of the parameters: how far from rank 0's?
    flat = torch.cat([p.flatten() for p in sharded.params.values()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    spread = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    verdict = torch.zeros(1, device=mesh.device)
    if rank == 0:
        single = demo.train_single(model, data, a.steps, a.lr,
                                   callback=Progress("one device", a.steps))
        nbytes = {r: tuple(int(v) for v in t.tolist()) for r, t in enumerate(every)}
        ok = _report(a, sharded, single, nbytes, _sum_ops(ops),
                     f"(torchrun: {world} processes, {dist.get_backend()})",
                     spread.item())
        verdict.fill_(1.0 if ok else 0.0)
    dist.broadcast(verdict, src=0)
    return bool(verdict.item())


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if _under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if a.ranks not in (None, world):
            ap.error(f"--ranks {a.ranks}: under torchrun the mesh has the world's "
                     f"{world} ranks; leave --ranks out or pass --nproc-per-node {a.ranks}")
        a.ranks = world
    elif a.ranks is None:
        a.ranks = 4
    for name in ("ranks", "size", "width", "batch", "steps", "hidden"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    ok = _run_torchrun(a) if _under_torchrun() else _run_local(a)
    return 0 if ok else 1
