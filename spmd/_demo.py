"""``python -m spmd demo``: a halo'd stencil through shard_map vs one device.

A 2-D heat field is split over a simulated mesh (uneven shards), each rank pads its
block with one row from each neighbour (``ppermute``), takes explicit diffusion steps,
and the sharded result and its gradient are compared with the same code on one device.
"""
from __future__ import annotations

import argparse
import time

import torch

from . import Mesh, P, ppermute, psum, shard_map
from .layout import Layout


def heat_step(u: torch.Tensor, alpha: float = 0.2) -> torch.Tensor:
    """One explicit diffusion step; ``u`` carries one halo row above and below."""
    core = u[1:-1]
    lap = u[:-2] + u[2:] + torch.roll(core, 1, 1) + torch.roll(core, -1, 1) - 4 * core
    return core + alpha * lap


def global_steps(u: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        u = heat_step(torch.nn.functional.pad(u[None], (0, 0, 1, 1))[0])
    return u


def local_steps(u: torch.Tensor, steps: int, n: int) -> torch.Tensor:
    """Per-shard program: exchange one halo row with each neighbour, then step."""
    down = [(i, i + 1) for i in range(n - 1)]  # my last row becomes the next rank's top halo
    up = [(i + 1, i) for i in range(n - 1)]
    for _ in range(steps):
        top = ppermute(u[-1:], "sp", down)      # zeros on rank 0: the boundary condition
        bottom = ppermute(u[:1], "sp", up)      # zeros on the last rank
        u = heat_step(torch.cat([top, u, bottom]))
    return u


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmd demo", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size", type=int, default=30, help="rows of the field (uneven over ranks)")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)

    mesh = Mesh((a.ranks,), ("sp",))
    torch.manual_seed(0)
    u0 = torch.rand(a.size, 16, dtype=torch.float64, requires_grad=True)
    lay = Layout(u0.shape, P("sp"), mesh)
    print(f"{mesh}: field {tuple(u0.shape)} split over rows as {list(lay.sizes[0])}")

    def body(u):
        v = local_steps(u, a.steps, a.ranks)
        return v, psum((v ** 2).sum(), "sp")

    sharded = shard_map(body, mesh, P("sp"), (P("sp"), P()))
    # Warm-up: torch initialises its autograd kernels lazily on first use.
    sharded(u0.detach().requires_grad_())[1].backward()
    global_steps(u0.detach().requires_grad_(), a.steps).sum().backward()
    t0 = time.perf_counter()
    v, energy = sharded(u0)
    energy.backward()
    t_sharded = time.perf_counter() - t0
    g_sharded, u0.grad = u0.grad, None

    t0 = time.perf_counter()
    v_ref = global_steps(u0, a.steps)
    e_ref = (v_ref ** 2).sum()
    e_ref.backward()
    t_single = time.perf_counter() - t0

    dv = (v - v_ref).abs().max().item()
    dg = (g_sharded - u0.grad).abs().max().item()
    print(f"{a.steps} diffusion steps, halo rows exchanged with ppermute, energy psum'd")
    print(f"  energy   sharded {energy.item():.12f}   one device {e_ref.item():.12f}")
    print(f"  max |field difference|    {dv:.2e}")
    print(f"  max |gradient difference| {dg:.2e}")
    print(f"  forward+backward: sharded {t_sharded * 1e3:.1f} ms, one device {t_single * 1e3:.1f} ms")
    ok = dv < 1e-12 and dg < 1e-12
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1
