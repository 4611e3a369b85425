"""A Fourier neural operator learns 2-D Darcy flow, its domain split over ranks.

    python examples/fno_darcy.py                      # 150 steps: one device, 4 threads, gloo 2
    python examples/fno_darcy.py --steps 500 --out darcy.png
    python examples/fno_darcy.py --check              # a few steps: sharded == one device

1. Data, made here: a piecewise-constant permeability a(x) (3 or 12, thresholded smooth
   noise, as in FNO's Darcy set) on an n x n grid of the unit square, and the pressure u
   solving -div(a grad u) = 1 with u = 0 on the boundary (5-point finite volumes, batched
   conjugate gradients in torch). Inputs (a, x, y), target u, split into train and test.
2. The same FNO (``spmd.nn.FNO``, same initial weights) is trained with Adam three ways:
   on one device; inside ``shard_map`` on a threads mesh of 4 simulated ranks, the rows
   split (uneven when they do not divide); and in 2 gloo processes (``spmd.launch``),
   each training its own copy on its rows, gradients summed over the ranks. The spectral
   layers transform across ranks (``spmd.fft``); the 1x1 convs act on each shard.
3. The loss curves are plotted together (``--out``): they lie on top of each other.
4. The times compare: every variant gets the same cores (``--threads``, default torch's
   intra-op thread count here): one device that many intra-op threads, the threads mesh
   one rank thread per rank with one intra-op thread each (the rank threads share torch's
   one pool), each gloo process its share; the output says what each used. On a machine
   shared with other work the times vary from run to run, multi-threaded steps the most
   (the output says when the load average exceeds the cores). A progress line every
   ``--every`` steps.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable

import torch

import spmd
from spmd import P
from spmd.nn.spectral import FNO

SPEC = P(None, None, "sp")  # (batch, channels, rows, cols): rows split over "sp"


# -- data ---------------------------------------------------------------------------------

def permeability(count: int, n: int, g: torch.Generator) -> torch.Tensor:
    """``[count, n, n]`` fields of 12 where smooth Gaussian noise is positive, 3 elsewhere."""
    k = torch.fft.fftfreq(n, d=1 / n)
    decay = (1 + (k[:, None] ** 2 + k[None, :] ** 2) / 4) ** -2  # a smooth spectrum
    noise = torch.randn(count, n, n, generator=g, dtype=torch.float64)
    field = torch.fft.ifft2(torch.fft.fft2(noise) * decay).real
    return torch.where(field > 0, 12.0, 3.0).to(torch.float64)


def darcy_operator(a: torch.Tensor, u: torch.Tensor, h: float) -> torch.Tensor:
    """-div(a grad u) with u = 0 outside the grid: the flux through each face is the face's
    mean permeability times the difference (a boundary face takes the cell's own a)."""
    ap = torch.nn.functional.pad(a, (1, 1, 1, 1), mode="replicate")
    up = torch.nn.functional.pad(u, (1, 1, 1, 1))
    out = torch.zeros_like(u)
    c = (slice(None), slice(1, -1), slice(1, -1))
    for sl in ((slice(None), slice(0, -2), slice(1, -1)), (slice(None), slice(2, None), slice(1, -1)),
               (slice(None), slice(1, -1), slice(0, -2)), (slice(None), slice(1, -1), slice(2, None))):
        out += (ap[c] + ap[sl]) / 2 * (up[c] - up[sl])
    return out / h**2


def solve(a: torch.Tensor, tol: float = 1e-10, max_iter: int = 2000) -> torch.Tensor:
    """u with -div(a grad u) = 1, by conjugate gradients (the operator is symmetric
    positive definite), all samples at once."""
    h = 1 / (a.shape[-1] + 1)
    b = torch.ones_like(a)
    u, r = torch.zeros_like(a), b.clone()
    p, rr = r.clone(), (r * r).sum((1, 2))
    for _ in range(max_iter):
        ap = darcy_operator(a, p, h)
        alpha = rr / (p * ap).sum((1, 2))
        u += alpha[:, None, None] * p
        r -= alpha[:, None, None] * ap
        new = (r * r).sum((1, 2))
        if new.max().sqrt() < tol * math.sqrt(a[0].numel()):
            break
        p = r + (new / rr)[:, None, None] * p
        rr = new
    return u


def make_data(count: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[count, 3, n, n]`` (a scaled to [0, 1], x, y) and targets ``[count, 1, n, n]``
    (u, scaled to unit standard deviation), float64."""
    a = permeability(count, n, torch.Generator().manual_seed(seed))
    u = solve(a)
    xs = (torch.arange(n, dtype=torch.float64) + 1) / (n + 1)
    grid = torch.stack(torch.meshgrid(xs, xs, indexing="ij")).expand(count, 2, n, n)
    x = torch.cat([((a - 3) / 9)[:, None], grid], 1)
    return x, (u / u.std())[:, None]


# -- training ------------------------------------------------------------------------------

def new_model(mesh: spmd.Mesh | None, dtype: torch.dtype, *, modes: int = 8, width: int = 16,
              hidden: int = 32) -> FNO:
    """The FNO every run trains, the same initial weights each time it is built (seed 0).
    Build it from ordinary code (one process, or each gloo process): rank threads share
    torch's one generator, so it must not be built inside a threads mesh's rank code."""
    torch.manual_seed(0)
    return FNO(3, 1, modes=modes, width=width, hidden=hidden, mesh=mesh,
               spec=None if mesh is None else SPEC, dtype=dtype)


def sharded_mse(model: FNO, mesh: spmd.Mesh, count: int) -> Callable:
    """``loss(x, t)``: the global MSE of a sharded FNO, a ``shard_map`` whose body runs the
    model on this rank's rows and adds the ranks' sums of squared errors (one psum)."""
    body = lambda x, t: spmd.psum(((model(x) - t) ** 2).sum(), "sp") / count  # noqa: E731
    # params named: on processes their gradients are summed over "sp"
    return spmd.shard_map(body, mesh, (SPEC, SPEC), P(), params=list(model.parameters()))


def train(model: FNO, loss: Callable[[], torch.Tensor], test_loss: Callable[[], torch.Tensor],
          steps: int, callback: Callable[[int, float], None] | None = None) -> dict:
    """Adam on ``loss``; ``callback(step, loss)`` after each step. Returns the losses, the
    test loss, the seconds and the trained parameters."""
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    losses, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
        losses.append(value.item())
        if callback is not None:
            callback(step, losses[-1])
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        test = test_loss().item()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "test": test, "seconds": seconds, "params": params}


def train_one_device(data, steps: int, dtype: torch.dtype, callback=None, **sizes) -> dict:
    (x, t), (xt, tt) = [(v.to(dtype) for v in pair) for pair in data]
    model = new_model(None, dtype, **sizes)
    mse = lambda x, t: ((model(x) - t) ** 2).mean()  # noqa: E731
    return train(model, lambda: mse(x, t), lambda: mse(xt, tt), steps, callback)


def train_sharded(mesh: spmd.Mesh, data, steps: int, dtype: torch.dtype, callback=None,
                  **sizes) -> dict:
    """Every rank runs the FNO on its rows; the loss is the global mean (one psum). On a
    threads mesh call it once; on gloo every process calls it and trains the same model."""
    (x, t), (xt, tt) = [(v.to(dtype) for v in pair) for pair in data]
    model = new_model(mesh, dtype, **sizes)
    train_loss = sharded_mse(model, mesh, t.numel())
    test_loss = sharded_mse(model, mesh, tt.numel())
    return train(model, lambda: train_loss(x, t), lambda: test_loss(xt, tt), steps, callback)


def train_gloo(mesh: spmd.Mesh, data, steps: int, dtype: torch.dtype, threads: int,
               every: int) -> dict:
    torch.set_num_threads(threads)  # this process's share of the cores
    progress = Progress(f"{mesh.size} gloo processes", steps, every) if mesh.rank == 0 else None
    return train_sharded(mesh, data, steps, dtype, progress)


class Progress:
    """``callback(step, loss)``: a line every ``every`` steps and at the last, flushed (a
    long run is never silent)."""

    def __init__(self, label: str, steps: int, every: int):
        self.label, self.steps, self.every = label, steps, every

    def __call__(self, step: int, loss: float) -> None:
        if step % self.every == 0 or step == self.steps:
            print(f"    {self.label} step {step:4d}/{self.steps}  loss {loss:.4e}", flush=True)


# -- main -------------------------------------------------------------------------------------

def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, r), style in zip(runs.items(), ("-", "--", ":")):
        ax.semilogy(r["losses"], style, label=f"{name} (test {r['test']:.2e})")
    ax.set(xlabel="Adam step", ylabel="training MSE", title="FNO on 2-D Darcy flow")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=32, help="grid points per side")
    ap.add_argument("--train", type=int, default=16, help="training samples")
    ap.add_argument("--test", type=int, default=16, help="test samples")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--ranks", type=int, default=4, help="threads ranks")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "fno_darcy.png"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="cores each variant may use (default: torch's intra-op threads here, "
                         f"{torch.get_num_threads()}): one device runs that many intra-op "
                         "threads, each gloo process its share, the threads mesh's ranks one "
                         "each")
    ap.add_argument("--every", type=int, default=25, help="a progress line every N steps")
    ap.add_argument("--check", action="store_true",
                    help="a few steps; assert the sharded losses equal one device's")
    args = ap.parse_args(argv)
    if args.check:
        args.n, args.train, args.test, args.steps, args.every = 20, 4, 2, 5, 5
    dtype = torch.float32
    cores, procs = args.threads, 2
    per_proc = max(1, cores // procs)
    names = ("one device", f"{args.ranks} threads ranks", f"{procs} gloo processes")
    # The same cores for every variant, so their times compare: the rank threads share
    # torch's one intra-op pool, so each of their ops runs on the calling rank thread.
    used = {names[0]: f"{cores} intra-op thread{'s' * (cores > 1)}",
            names[1]: f"{args.ranks} rank threads x 1 intra-op thread",
            names[2]: f"{procs} processes x {per_proc} intra-op thread{'s' * (per_proc > 1)}"}

    t0 = time.perf_counter()
    x, t = make_data(args.train + args.test, args.n)
    data = ((x[:args.train], t[:args.train]), (x[args.train:], t[args.train:]))
    print(f"Darcy flow: {args.train} + {args.test} samples on a {args.n} x {args.n} grid, "
          f"solved in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{args.steps} Adam steps each, on {cores} core{'s' * (cores > 1)} "
          f"({os.cpu_count()} on this machine): " + "; ".join(f"{k}: {v}" for k, v in used.items()),
          flush=True)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        print(f"(load average {load:.1f} on {os.cpu_count()} cores: other work shares them, "
              f"so the times below are noisy)", flush=True)
    runs = {}
    torch.set_num_threads(cores)
    print(f"  {names[0]} ...", flush=True)
    runs[names[0]] = train_one_device(data, args.steps, dtype,
                                      Progress(names[0], args.steps, args.every))
    torch.set_num_threads(1)
    print(f"  {names[1]} ...", flush=True)
    mesh = spmd.Mesh((args.ranks,), ("sp",))
    runs[names[1]] = train_sharded(mesh, data, args.steps, dtype,
                                   Progress(names[1], args.steps, args.every))
    torch.set_num_threads(cores)
    print(f"  {names[2]} ...", flush=True)
    got = spmd.launch(train_gloo, (procs,), ("sp",), backend="gloo",
                      args=(data, args.steps, dtype, per_proc, args.every))
    runs[names[2]] = got[0]

    ref = runs["one device"]["losses"]
    for name, r in runs.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        r["rel"] = rel
        print(f"  {name:18s} loss {r['losses'][0]:.4e} -> {r['losses'][-1]:.4e}, test "
              f"{r['test']:.4e}, {r['seconds']:.1f} s on {used[name]}, largest relative "
              f"difference from one device {rel:.1e}")
    if any(math.isnan(r["losses"][-1]) for r in runs.values()):
        raise SystemExit("the loss is NaN")
    if args.check:
        assert got[0]["losses"] == got[1]["losses"], "the gloo processes disagree"
        for name, r in runs.items():
            assert r["rel"] < 1e-6, f"{name}: losses differ from one device by {r['rel']:.1e}"
        print("PASS")
    else:
        plot(runs, args.out)
        print(f"loss curves: {args.out}")
    return runs


if __name__ == "__main__":
    main()
