"""GroupNorm and BatchNorm2d over a split H, on gloo processes against one process, next to
the usual hand-written version; and the float32 error of both on x ~ N(1000, 1).

    python benchmarks/norms.py [--world 2] [--shape 4,64,256,256] [--groups 32] [--steps 5]

Every process uses one thread (torch.set_num_threads(1)). One step is the norm's forward
and backward (input, weight and bias gradients) from a fixed cotangent:

- ``one process``: ``F.group_norm`` / ``F.batch_norm`` (training, running statistics
  updated) on the whole input (T1);
- ``spmd.ops``: the input split over H on ``world`` processes, ``spmd.ops.group_norm``
  / ``batch_norm`` on each shard (one all_gather of (count, mean, M2) per group or
  channel forward, its psum_scatter backward), then the weight and bias gradients
  summed over ranks (one all-reduce, what GradSync does);
- ``hand-written [sum, sum^2]``: what users write in 15 lines: local sums of x and x^2
  in one differentiable all-reduce (``torch.distributed.nn.functional.all_reduce``),
  var = E[x^2] - E[x]^2, then the same weight/bias all-reduce.

Error: the largest |y - y64| over the output, where y64 is the float64 norm of the same
float32 input, on x ~ N(1000, 1) (the accuracy the norms must reach), for each variant. Bytes are
what each rank sent per step (spmd.comm_stats for spmd; the hand-written one's
all-reduce payloads counted by hand, forward and backward).
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from conv_domain_parallel import _median_ms  # run as a script: benchmarks/ is on the path

import spmd
from spmd import Layout, P
from spmd.comm import comm_of


def _inputs(shape, shift: float = 0.0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) + shift
    c = shape[1]
    w = torch.rand(c, generator=g) + 0.5
    b = torch.randn(c, generator=g)
    return x.float(), w, b


def _ref(kind: str, x: torch.Tensor, w, b, groups: int) -> torch.Tensor:
    """The float64 norm of the (float32) input."""
    x, w, b = x.double(), w.double(), b.double()
    if kind == "group":
        return F.group_norm(x, groups, w, b)
    return F.batch_norm(x, None, None, w, b, training=True)


def single(kind: str, shape, groups: int, steps: int):
    torch.set_num_threads(1)
    x, w, b = _inputs(shape)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    rm, rv = torch.zeros(shape[1]), torch.ones(shape[1])
    gy = torch.randn(shape)

    def f(x):
        if kind == "group":
            return F.group_norm(x, groups, w, b)
        return F.batch_norm(x, rm, rv, w, b, training=True)

    def step():
        torch.autograd.grad(f(x), (x, w, b), gy)
    ms = _median_ms(step, steps)
    xb, _, _ = _inputs(shape, 1000.0)
    with torch.no_grad():
        err = (f(xb).double() - _ref(kind, xb, w.detach(), b.detach(), groups)).abs().max()
    return ms, float(err)


def _hand(kind: str, x, w, b, groups: int, total: int, pg):
    """The [sum, sum^2] shortcut with a differentiable all-reduce."""
    n, c = x.shape[0], x.shape[1]
    if kind == "group":
        xs = x.reshape(n, groups, -1)
        dims = (2,)
    else:
        xs = x.transpose(0, 1).reshape(c, -1)
        dims = (1,)
    stats = torch.stack([xs.sum(dims), (xs * xs).sum(dims)])
    stats = dist_fn.all_reduce(stats, group=pg)
    mean, sq = stats[0] / total, stats[1] / total
    var = sq - mean * mean
    y = (xs - mean.unsqueeze(-1)) * torch.rsqrt(var.unsqueeze(-1) + 1e-5)
    if kind == "group":
        y = y.reshape(x.shape)
    else:
        y = y.reshape(c, n, *x.shape[2:]).transpose(0, 1)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return y * w.reshape(shape) + b.reshape(shape)


def per_rank(mesh, kind: str, shape, groups: int, steps: int):
    torch.set_num_threads(1)
    # the public differentiable all_reduce users reach for; torch suggests a private one
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*all_reduce is deprecated")
    spec = P(None, None, "sp")
    lay = Layout(shape, spec, mesh)
    group = mesh.group("sp", mesh.rank)
    pg = comm_of(mesh).process_group(group)
    c = shape[1]
    total = (shape[0] * shape[2] * shape[3]) if kind == "batch" else \
        (c // groups) * shape[2] * shape[3]

    def ours(x, w, b, rm=None, rv=None):
        if kind == "group":
            return spmd.ops.group_norm(x, groups, w, b, mesh=mesh, spec=lay)
        return spmd.ops.batch_norm(x, rm, rv, w, b, training=True, mesh=mesh, spec=lay)

    def hand(x, w, b):
        return _hand(kind, x, w, b, groups, total, pg)

    xg, wg, bg = _inputs(shape)
    x = lay.shard(xg, mesh.rank).clone().requires_grad_()
    w, b = wg.clone().requires_grad_(), bg.clone().requires_grad_()
    rm, rv = torch.zeros(c), torch.ones(c)
    gy = torch.randn(lay.local_shape(mesh.rank))

    def spmd_step():
        with mesh:
            _, gw, gb = torch.autograd.grad(ours(x, w, b, rm, rv), (x, w, b), gy)
        comm_of(mesh).all_reduce(torch.cat([gw, gb]), "sum", group, name="weight grad")

    def hand_step():
        _, gw, gb = torch.autograd.grad(hand(x, w, b), (x, w, b), gy)
        dist.all_reduce(torch.cat([gw, gb]), group=pg)

    t_spmd = _median_ms(spmd_step, steps)
    t_hand = _median_ms(hand_step, steps)
    with spmd.comm_stats() as s:
        spmd_step()
    stat_rows = shape[0] * groups if kind == "group" else c
    hand_bytes = 2 * (2 * stat_rows * 4) + 2 * c * 4  # stats forward + backward, w/b grads

    xb_g, _, _ = _inputs(shape, 1000.0)
    xb = lay.shard(xb_g, mesh.rank)
    with torch.no_grad():
        ref = lay.shard(_ref(kind, xb_g, wg, bg, groups), mesh.rank)
        with mesh:
            e_spmd = (ours(xb, wg, bg).double() - ref).abs().max()
        e_hand = (hand(xb, wg, bg).double() - ref).abs().max()
    return t_spmd, t_hand, s.bytes(rank=mesh.rank), hand_bytes, float(e_spmd), float(e_hand)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", default="4,64,256,256")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    print(f"f32{list(shape)}, split over H, gloo world {a.world}, 1 thread per process, "
          f"forward + backward (input, weight, bias); error on x ~ N(1000, 1) vs float64\n")
    print("| norm | variant | ms per step | efficiency T1/(world*T) | bytes sent per rank "
          "| max abs error |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind in ("group", "batch"):
        name = f"GroupNorm({a.groups})" if kind == "group" else "BatchNorm2d"
        t1, e1 = spmd.launch(lambda mesh, kind=kind: single(kind, shape, a.groups, a.steps),
                             (1,), ("sp",))[0]
        got = spmd.launch(per_rank, (a.world,), ("sp",), backend="gloo",
                          args=(kind, shape, a.groups, a.steps), timeout=600)
        t_spmd = max(g[0] for g in got)  # a step ends when the slowest rank is done
        t_hand = max(g[1] for g in got)
        print(f"| {name} | one process (T1) | {t1:.1f} | 1.00 | 0 | {e1:.1e} |")
        print(f"| {name} | spmd.ops | {t_spmd:.1f} | {t1 / (a.world * t_spmd):.2f} | "
              f"{', '.join(str(g[2]) for g in got)} | {max(g[4] for g in got):.1e} |")
        print(f"| {name} | hand-written [sum, sum^2] | {t_hand:.1f} | "
              f"{t1 / (a.world * t_hand):.2f} | {got[0][3]} | {max(g[5] for g in got):.1e} |")


if __name__ == "__main__":
    main()
