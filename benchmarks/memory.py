"""Per-rank peak memory of sharded training steps on gloo processes, against one process.

    python benchmarks/memory.py [--worlds 1,2,4] [--shape 1,16,2048,1024] [--layers 3]
        [--split h|hw] [--rows conv_stack]

Every process uses one thread. The input is split over H on a mesh ``(P,)`` (``--split
h``), or over H and W on a mesh ``(P/2, 2)`` (``--split hw``, even P). A row is a step
(forward and backward) of per-rank code: each rank makes only its own shard of the
input (``torch.randn`` of its local shape, seeded by where the shard starts:
``Layout.slices``) and never sees the global tensor.
For each row the table gives, per world size:

    MiB per rank   the largest peak resident memory of any rank during one step, above
                   the value measured once its input shard and parameters exist and one
                   warm-up step has run (Linux VmHWM, reset by spmd.testing.memory)
    ideal          the same step in one process with plain torch (no spmd), divided by
                   the world size: what a rank would need if the work split perfectly
    ratio          MiB per rank / ideal (target: <= 1.15)

Rows (add one by writing ``row(mesh, args, plain)``, which makes one rank's inputs and
returns its step, a function of no arguments; ``args`` are the parsed command-line
arguments, ``plain`` asks for the plain-torch one-process version; then list it in
``ROWS``):

- ``conv_stack``: ``layers`` x [3x3 conv2d C -> C (padding 1) + ReLU] on the split
  input, ``spmd.ops.conv2d`` with ``spec=`` its ``Layout`` (``F.conv2d`` for the plain
  one-process reference), then the sum's gradient with respect to the input and the
  weights.
- ``demo_cnn``: the demo's CNN (C hidden channels, ``layers`` convolutions, tanh) on
  (u, kappa) -> u of the same N, H, W, through ``spmd.nn.convert`` and ``shard_map`` over
  ``spmd.Sharded`` values that each rank made alone: the wrapped forward, on processes,
  with no global tensor; the global MSE's gradient with respect to the weights.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable

# Runnable from a checkout without installing (and measuring that checkout).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spmd  # noqa: E402
from spmd import Layout, P, Sharded, demo  # noqa: E402
from spmd.testing.memory import peak, reset_peak  # noqa: E402

_MIB = 2 ** 20


def _shard(lay: Layout, rank: int) -> torch.Tensor:
    """This rank's shard of a seeded input, made without the global tensor."""
    start = tuple(sl.start or 0 for sl in lay.slices(rank))
    g = torch.Generator().manual_seed(hash(start) % 2 ** 31)
    return torch.randn(lay.local_shape(rank), generator=g)


def conv_stack(mesh: spmd.Mesh, args: argparse.Namespace, plain: bool) -> Callable[[], None]:
    """The conv stack's inputs on this rank, and its step."""
    shape = _shape(args)
    lay = Layout(shape, P(None, None, *mesh.axis_names), mesh)
    x = _shard(lay, mesh.rank).requires_grad_()
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    ws = [(torch.randn(c, c, 3, 3, generator=g) * 0.1).requires_grad_() for _ in range(args.layers)]

    def step() -> None:
        y = x
        for w in ws:
            y = (F.conv2d(y, w, padding=1) if plain else
                 spmd.ops.conv2d(y, w, padding=1, mesh=mesh, spec=lay)).relu()
        torch.autograd.grad(y.sum(), [x, *ws])
    return step


def demo_cnn(mesh: spmd.Mesh, args: argparse.Namespace, plain: bool) -> Callable[[], None]:
    """The demo's CNN (``demo.make_model(hidden=C, layers=layers)``: 3x3 convs and tanh)
    through the wrapped forward: ``spmd.nn.convert`` and ``shard_map`` over
    ``spmd.Sharded`` inputs that each rank made alone; the global MSE's gradient with
    respect to the weights (plain: the module itself on the whole field)."""
    n, c, h, w = _shape(args)
    spec = P(None, None, *mesh.axis_names)
    lays = [Layout((n, k, h, w), spec, mesh) for k in (2, 1)]  # (u, kappa) -> u
    x, t = (_shard(lay, mesh.rank) for lay in lays)
    model = demo.make_model(hidden=c, layers=args.layers)
    if plain:
        return lambda: torch.autograd.grad(((model(x) - t) ** 2).mean(), list(model.parameters()))
    sharded = spmd.nn.convert(model, mesh, spec)
    xs, ts = (Sharded.from_local(v, mesh, lay) for v, lay in zip((x, t), lays))
    count = ts.numel()
    axes = tuple(mesh.axis_names)
    loss = spmd.shard_map(lambda a, b: spmd.psum(((sharded(a) - b) ** 2).sum(), axes) / count,
                          mesh, (spec, spec), P())
    return lambda: torch.autograd.grad(loss(xs, ts), list(sharded.parameters()))


Row = Callable[[spmd.Mesh, argparse.Namespace, bool], Callable[[], None]]
ROWS: dict[str, Row] = {"conv_stack": conv_stack, "demo_cnn": demo_cnn}


def _shape(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(v) for v in args.shape.split(","))


def _rank(mesh: spmd.Mesh, row: str, args: argparse.Namespace, plain: bool) -> int | None:
    """One rank: build the row's inputs, warm up, and measure one step's peak."""
    torch.set_num_threads(1)
    with mesh:
        step = ROWS[row](mesh, args, plain)
        step()  # warm-up: kernels, process group buffers
        base = reset_peak()
        step()
        top = peak()
    return None if base is None or top is None else top - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    ap.add_argument("--shape", default="1,16,2048,1024", help="global input shape")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--split", choices=("h", "hw"), default="h", help="H, or H and W")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"rows, from {list(ROWS)}")
    a = ap.parse_args()
    print(f"f32{list(_shape(a))} split over {a.split.upper()}, {a.layers} layers, gloo, "
          f"1 thread per process; "
          f"{platform.node()}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}\n")
    print("| row | world | MiB per rank | ideal (one process / P) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in a.rows.split(","):
        one = spmd.launch(_rank, (1,), ("sp",), backend="gloo",
                          args=(row, a, True), timeout=600)[0]
        if one is None:
            print(f"| {row} | - | n/a (no /proc/self/clear_refs) | | |")
            continue
        print(f"| {row}, plain torch | 1 | {one / _MIB:.0f} | {one / _MIB:.0f} | 1.00 |")
        for world in (int(w) for w in a.worlds.split(",")):
            mesh = ((world,), ("sp",)) if a.split == "h" or world == 1 else \
                ((world // 2, 2), ("x", "y"))
            got = spmd.launch(_rank, *mesh, backend="gloo", args=(row, a, False), timeout=600)
            ideal = one / world
            print(f"| {row} | {world} | {max(got) / _MIB:.0f} | {ideal / _MIB:.0f} | "
                  f"{max(got) / ideal:.2f} |", flush=True)


if __name__ == "__main__":
    main()
