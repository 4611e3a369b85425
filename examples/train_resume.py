"""Data-parallel training with ``spmd.parallel.GradSync``, stopped mid-way, resumed on a
mesh of another size from a checkpoint, and compared with one uninterrupted device.

    python examples/train_resume.py                                # 4 threads ranks, then 2
    python examples/train_resume.py --backend gloo --ranks 2 --resume-ranks 3
    python examples/train_resume.py --steps 200 --save-at 120 --every 20

1. A small MLP learns a smooth function of 8 inputs. The initial model is built once, in
   this process, and every rank trains its own deep copy (on a threads mesh the rank
   threads share torch's one generator, so ranks must not seed or initialise models
   themselves; GradSync's ``init="broadcast"`` would also copy rank 0's weights).
2. Phase 1: ``spmd.launch`` runs the per-rank program on ``--ranks`` ranks of a "dp" axis.
   Each step every rank takes its rows of the step's batch, backprops the mean squared
   error of its rows, and ``GradSync(model, mesh, {"dp": "mean"})`` averages the
   gradients (bucketed, during backward) before Adam's step. At ``--save-at``
   ``spmd.checkpoint.save`` writes the model, Adam's state and the step, and the run ends.
3. Phase 2: a new launch on ``--resume-ranks`` ranks builds the model from *other*
   weights (so a load that did nothing would show), loads the checkpoint (Adam's state
   ``AS_SAVED``: a fresh optimizer has none to template), and trains the remaining steps.
4. One device trains the same initial model on the whole batches, uninterrupted. The
   largest parameter difference must be below the tolerance (float64: 1e-10, since the
   ranks add up the batch and the gradients in another order than one device; float32:
   1e-4).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile

import torch

import spmd
import spmd.checkpoint as ck
from spmd.parallel import GradSync

LR = 0.02
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def make_data(samples: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` inputs in [-1, 1]^8 and a smooth target of them, with a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(samples, 8, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * x[:, :1]) * x[:, 1:2] + 0.5 * x[:, 2:3] ** 2
    y = y + 0.01 * torch.randn(samples, 1, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def make_model(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """Built in ordinary code, never inside rank code (see the module docstring)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1)).to(dtype)


def batch_rows(step: int, batch: int, samples: int) -> slice:
    """The rows of step ``step``'s batch (1-based steps; the batches cycle)."""
    start = ((step - 1) * batch) % samples
    return slice(start, start + batch)


def train_steps(mesh: spmd.Mesh, model, opt, data, first: int, last: int, batch: int,
                every: int, label: str) -> None:
    """Steps ``first`` to ``last``: this rank's rows of each batch, gradients averaged
    over "dp" by GradSync (attached to ``opt``: its step waits for the buckets)."""
    sync = GradSync(model, mesh, {"dp": "mean"})
    sync.attach(opt)
    x, y = data
    n, r = mesh.shape[0], mesh.rank
    per = batch // n
    for step in range(first, last + 1):
        rows = batch_rows(step, batch, x.shape[0])
        mine = slice(rows.start + r * per, rows.start + (r + 1) * per)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        if step % every == 0 or step == last:
            # the loss on the whole data set, for the log: every rank takes every n-th
            # sample, and one psum adds the ranks' sums (every rank joins it)
            with torch.no_grad():
                sse = ((model(x[r::n]) - y[r::n]) ** 2).sum()
            mse = spmd.psum(sse, "dp").item() / x.shape[0]
            if r == 0:
                print(f"  {label} step {step:4d}  loss on all {x.shape[0]} samples {mse:.4e}",
                      flush=True)


def first_run(mesh: spmd.Mesh, init, data, args) -> None:
    model = copy.deepcopy(init)  # this rank's replica of the one initial model
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    train_steps(mesh, model, opt, data, 1, args.save_at, args.batch, args.every,
                f"{mesh.shape[0]} ranks")
    ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": args.save_at},
            args.path, mesh)


def resumed_run(mesh: spmd.Mesh, other, data, args) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(other)  # other weights: the checkpoint must replace them
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    state = ck.load({"model": model.state_dict(), "optim": ck.AS_SAVED, "step": 0},
                    args.path, mesh)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    train_steps(mesh, model, opt, data, state["step"] + 1, args.steps, args.batch, args.every,
                f"{mesh.shape[0]} ranks")
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def one_device(init, data, steps: int, batch: int) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(init)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data
    for step in range(1, steps + 1):
        rows = batch_rows(step, batch, x.shape[0])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    return dict(model.named_parameters())


def main(argv: list[str] | None = None) -> bool:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("threads", "gloo"), default="threads")
    ap.add_argument("--ranks", type=int, default=4, help="ranks before the checkpoint")
    ap.add_argument("--resume-ranks", type=int, default=2, help="ranks after it")
    ap.add_argument("--steps", type=int, default=60, help="Adam steps in all")
    ap.add_argument("--save-at", type=int, default=30, help="the step after which to save")
    ap.add_argument("--batch", type=int, default=24, help="samples per step, all ranks")
    ap.add_argument("--samples", type=int, default=96, help="the data set (batches cycle)")
    ap.add_argument("--every", type=int, default=10, help="a progress line every N steps")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = ap.parse_args(argv)
    for n in (args.ranks, args.resume_ranks):
        if n < 1 or args.batch % n:
            ap.error(f"--batch {args.batch} must split evenly over --ranks {args.ranks} and "
                     f"--resume-ranks {args.resume_ranks} (each rank averages its own rows, "
                     f"so equal rows per rank make the mean over 'dp' the batch's mean)")
    if not 1 <= args.save_at < args.steps:
        ap.error(f"--save-at must be between 1 and --steps - 1 = {args.steps - 1}, "
                 f"got {args.save_at}")
    if args.batch > args.samples:
        ap.error(f"--batch {args.batch} is larger than --samples {args.samples}")
    dtype = getattr(torch, args.dtype)
    data = make_data(args.samples, 0, dtype)
    init, other = make_model(0, dtype), make_model(1, dtype)
    nparam = sum(p.numel() for p in init.parameters())
    print(f"an MLP 8-32-1 ({nparam} parameters, {args.dtype}), Adam lr {LR:g}, {args.steps} "
          f"steps of {args.batch} samples; backend {args.backend}", flush=True)

    with tempfile.TemporaryDirectory() as folder:
        args.path = os.path.join(folder, "ckpt")
        print(f"phase 1: {args.ranks} ranks on 'dp', steps 1-{args.save_at}, then save",
              flush=True)
        spmd.launch(first_run, (args.ranks,), ("dp",), backend=args.backend,
                    args=(init, data, args))
        print(f"phase 2: resume on {args.resume_ranks} ranks, steps {args.save_at + 1}-"
              f"{args.steps}", flush=True)
        got = spmd.launch(resumed_run, (args.resume_ranks,), ("dp",), backend=args.backend,
                          args=(other, data, args))
    want = one_device(init, data, args.steps, args.batch)
    diff = max((p - want[k]).abs().max().item() for ps in got for k, p in ps.items())
    spread = max((p - got[0][k]).abs().max().item() for ps in got for k, p in ps.items())
    tol = TOL[dtype]
    ok = diff < tol and not math.isnan(diff)
    print(f"one device, uninterrupted: {args.steps} steps of the whole batches")
    print(f"largest |parameter difference| from one device {diff:.2e} (between the ranks "
          f"{spread:.2e}), tolerance {tol:g}: {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
