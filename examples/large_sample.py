"""Train on a sample that no process holds whole: every step, from the data file to the
loss, touches only each rank's block.

    python examples/large_sample.py                       # 2 gloo processes, 96 x 64 field
    python examples/large_sample.py --ranks 4 --rows 4096 --cols 2048
    python examples/large_sample.py --check               # small: also compare one device

1. The ranks write the data file together: rank 0 writes the .npy header, then each rank
   fills its own rows (Gaussian blobs of heat and their exact state a time step later,
   evaluated on its rows' coordinates only).
2. Each rank reads its block through a memmap: ``spmd.Sharded.load``.
3. ``spmd.nn.convert`` makes the demo's CNN domain-parallel; ``shard_map`` takes the
   Sharded fields, gives each rank's body its block, and returns the loss; gradients of
   the replicated weights are summed over the ranks, so every process trains the same
   model. Nothing global is allocated on the way (``--check`` gathers it at the end, on
   purpose, to compare with one device).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import numpy as np
import torch

import spmd
from spmd import Layout, P, Sharded, demo

SPEC = P(None, None, "sp")  # (batch, channel, rows, cols): rows split over "sp"
BLOBS = ((0.3, 0.4, 0.05, 1.0), (0.7, 0.6, 0.08, -0.7), (0.5, 0.2, 0.04, 0.5))
KAPPA, DT = 0.02, 0.05  # diffusivity and time step, in units of the unit square


def blobs(rows: range, cols: int, n_rows: int, t: float) -> np.ndarray:
    """Heat at time ``t`` of Gaussian blobs on the unit square, for the given rows only:
    a Gaussian of variance s2 diffuses into one of variance s2 + 2 kappa t."""
    y = (np.arange(rows.start, rows.stop, dtype=np.float64)[:, None] + 0.5) / n_rows
    x = (np.arange(cols, dtype=np.float64)[None, :] + 0.5) / cols
    out = np.zeros((len(rows), cols))
    for cx, cy, s2, a in BLOBS:
        v = s2 + 2 * KAPPA * t
        out += a * s2 / v * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * v))
    return out


def write_data(mesh: spmd.Mesh, folder: str, rows: int,
               cols: int) -> dict[str, tuple[str, Layout]]:
    """Inputs (u, kappa) and targets u(t + DT) as .npy files, each rank writing its rows."""
    lays = {"x": Layout((1, 2, rows, cols), SPEC, mesh), "t": Layout((1, 1, rows, cols), SPEC, mesh)}
    paths = {k: os.path.join(folder, f"{k}.npy") for k in lays}
    if mesh.rank == 0:
        for k, lay in lays.items():
            np.lib.format.open_memmap(paths[k], "w+", np.float32, lay.shape).flush()
    spmd.psum(torch.zeros(()), "sp")  # a barrier: the headers exist
    mine = range(*lays["x"].slices(mesh.rank)[2].indices(rows))
    for k, chans in (("x", [blobs(mine, cols, rows, 0.0), np.full((len(mine), cols), KAPPA)]),
                     ("t", [blobs(mine, cols, rows, DT)])):
        out = np.load(paths[k], mmap_mode="r+")
        out[0, :, mine.start:mine.stop] = np.stack(chans)
        out.flush()
    spmd.psum(torch.zeros(()), "sp")  # every block is written
    return {k: (paths[k], lay) for k, lay in lays.items()}


def reader(path: str):
    """A loader for ``Sharded.load``: the block of the .npy file at ``path`` that the
    slices name (a memmap: only that block is read)."""
    field = np.load(path, mmap_mode="r")
    return lambda sl: field[sl]


class Say:
    """Progress lines from rank 0, flushed, with the seconds since ``start`` (wall clock:
    the processes start after the launching one)."""

    def __init__(self, mesh: spmd.Mesh, start: float, steps: int, every: int):
        self.on, self.start, self.steps, self.every = mesh.rank == 0, start, steps, every

    def __call__(self, message: str) -> None:
        if self.on:
            print(f"  [{time.time() - self.start:5.1f} s] {message}", flush=True)

    def step(self, step: int, loss: float) -> None:
        """``callback(step, loss)`` for the training: a line every ``every`` steps."""
        if step % self.every == 0 or step == self.steps:
            self(f"step {step}/{self.steps}, loss {loss:.4e}")


def train(mesh: spmd.Mesh, folder: str, rows: int, cols: int, steps: int, check: bool,
          start: float, every: int):
    say = Say(mesh, start, steps, every)
    say(f"{mesh.size} processes up; each writes its rows of the data file")
    data = write_data(mesh, folder, rows, cols)
    x, t = (Sharded.load(reader(p), mesh, lay) for p, lay in data.values())
    say(f"each read its block ({list(x.layout.sizes[2])} rows); training (the first step "
        f"also plans the converted model)")
    model = demo.make_model(hidden=8, seed=0)
    history = demo.train_sharded(model, mesh, (x, t), steps=steps, lr=2e-3, callback=say.step)
    out = {"rank": mesh.rank, "block": tuple(x.local.shape), "losses": history.losses}
    if check:  # gathers the global field, on purpose: a small run only
        say("--check: the same training on one device, on the gathered field")
        xg, tg = (spmd.gather(v, mesh, dst=None) for v in (x, t))
        one = demo.train_single(model, (xg, tg), steps=steps, lr=2e-3)
        out["param_diff"] = demo.max_param_diff(history, one)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--every", type=int, default=1, help="a progress line every N steps")
    ap.add_argument("--check", action="store_true", help="compare with one device")
    args = ap.parse_args(argv)
    start = time.time()
    print(f"starting {args.ranks} gloo processes (each imports torch and spmd)", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        got = spmd.launch(train, (args.ranks,), ("sp",), backend="gloo",
                          args=(folder, args.rows, args.cols, args.steps, args.check, start,
                                args.every))
    size = 4 * 3 * args.rows * args.cols / 2**20
    print(f"field f32[1, 2+1, {args.rows}, {args.cols}] ({size:.1f} MiB) over {args.ranks} "
          f"processes; each read only its block:")
    for r in got:
        line = f"  rank {r['rank']}: block {list(r['block'])}, loss {r['losses'][0]:.3e} -> " \
               f"{r['losses'][-1]:.3e}"
        if "param_diff" in r:
            line += f", largest parameter difference from one device {r['param_diff']:.1e}"
        print(line)
    if math.isnan(got[0]["losses"][-1]):
        raise SystemExit("the loss is NaN")
    return got


if __name__ == "__main__":
    main()
