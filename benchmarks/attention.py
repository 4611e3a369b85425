"""Domain-parallel attention on gloo processes against one process.

    python benchmarks/attention.py [--world 2] [--seq 8192] [--heads 8] [--head-dim 64]
        [--causal] [--steps 3] [--quick] [--only ring|neighborhood] [--split x|xy]

Every process uses one thread (torch.set_num_threads(1)). One step is a forward and a
backward (gradients of every input) from a fixed cotangent, float32, batch 1. A step
ends when the slowest rank is done. ``--quick``: a quarter of the sequence, 1 step.

Sections (each a function returning table rows; ``main`` prints them):

- ``ring_section``: ``spmd.ops.ring_attention``, the sequence split over ``world``
  processes, against one process running ``F.scaled_dot_product_attention`` (T1) and
  ring_attention on one rank. Parallel efficiency is ``T1 / (world * T)``. Then how much
  of the communication hides behind compute: the same ring with its transfers replaced
  by ready-made blocks (compute only, ``t_compute``), with its compute replaced by
  nothing (transfers only, ``t_comm``), and whole (``t_total``), interleaved step by step;
  ``hidden = (t_comm + t_compute - t_total) / t_comm`` (1: all of it hidden).
  Bytes are what each rank sent per step (spmd.comm_stats), forward and backward.
- ``neighborhood_section``: ``spmd.ops.neighborhood_attention2d``, f32[1, 128, 128, 4, 32]
  (heads last), kernel 7, the rows split over ``world`` processes (``--split xy``: rows
  and columns over a 2 x world/2 mesh, two levels of halo), against the same op on one
  process (T1, ``mesh=None``): with the halo overlapped with the attention of the
  queries that do not need it (the default), and with the whole window fetched first;
  the halo's transfers alone (the key and value fetches and their transposes, no
  attention), the share of them the overlap hides, and the bytes each rank sent
  (with ``--split x``, against the rows it needs: 3 rows of k and v per neighbour and
  pass).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from _timing import median_ms

import spmd
from spmd import Layout, P
from spmd.comm.base import Pending
from spmd.ops import neighborhood_attention2d, ring_attention

_ring = importlib.import_module("spmd.ops.ring")


# -- ring attention -----------------------------------------------------------------------

def _qkv(shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for _ in range(4)]  # q, k, v, cotangent


def ring_single(mesh, shape, causal, steps):
    """One process: SDPA and ring_attention on a mesh of one rank (ms per step)."""
    torch.set_num_threads(1)
    q, k, v, go = _qkv(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def sdpa():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(y, (q, k, v), go)

    def ring():
        y = ring_attention(q, k, v, mesh, "sp", seq_dim=2, causal=causal)
        torch.autograd.grad(y, (q, k, v), go)

    return median_ms(sdpa, steps, warmup=1), median_ms(ring, steps, warmup=1)


@contextmanager
def _compute_only():
    """The ring's transfers replaced by blocks that are ready at once (zeros of the
    shape that would arrive): the same compute, no communication."""
    real = _ring._start

    def ready(block, plan, owner, name):
        n, me = plan.group.size, plan.group.index
        out = [block.new_empty((0,))] * n
        out[(me - 1) % n] = block.new_zeros(plan.block_shapes[owner])
        return Pending.done(out)

    _ring._start = ready
    try:
        yield
    finally:
        _ring._start = real


@contextmanager
def _transfers_only():
    """The ring's block computations replaced by nothing: the same transfers."""
    real = _ring._fwd_step, _ring._bwd_step
    _ring._fwd_step = _ring._bwd_step = lambda *args: None
    try:
        yield
    finally:
        _ring._fwd_step, _ring._bwd_step = real


def ring_per_rank(mesh, shape, causal, steps):
    """On each gloo rank: (t_total, t_compute, t_comm) in ms, bytes sent fwd, bwd."""
    torch.set_num_threads(1)
    lay = Layout(shape, P(None, None, "sp"), mesh)
    q, k, v, go = (lay.shard(t, mesh.rank).clone() for t in _qkv(shape))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        with mesh:
            y = ring_attention(q, k, v, mesh, "sp", seq_dim=2, causal=causal)
            torch.autograd.grad(y, (q, k, v), go)

    # Interleaved, so that a change in the machine's load hits the three alike.
    variants = (nullcontext, _compute_only, _transfers_only)
    times = [[] for _ in variants]
    for i in range(steps + 1):  # the first round warms up
        for ts, variant in zip(times, variants):
            with variant():
                t = time.perf_counter()
                step()
                if i:
                    ts.append((time.perf_counter() - t) * 1e3)
    t_total, t_compute, t_comm = (statistics.median(ts) for ts in times)
    with spmd.comm_stats() as s:
        step()
    return (t_total, t_compute, t_comm, s.bytes(rank=mesh.rank, pass_="forward"),
            s.bytes(rank=mesh.rank, pass_="backward"))


def ring_section(a) -> list[tuple[str, list[str], list[list[str]]]]:
    seq = a.seq // 4 if a.quick else a.seq
    steps = 1 if a.quick else a.steps
    shape = (1, a.heads, seq, a.head_dim)
    t_sdpa, t_ring1 = spmd.launch(ring_single, (1,), ("sp",), args=(shape, a.causal, steps),
                                  timeout=3600)[0]
    got = spmd.launch(ring_per_rank, (a.world,), ("sp",), backend="gloo",
                      args=(shape, a.causal, steps), timeout=3600)
    total, compute, comm = (max(g[i] for g in got) for i in range(3))
    hidden = (comm + compute - total) / comm if comm > 0 else float("nan")
    w = a.world
    title = (f"ring attention f32[1, {a.heads}, {seq}, {a.head_dim}]"
             f"{', causal' if a.causal else ''}, forward + backward, gloo world {w}, "
             f"1 thread per process")
    eff = lambda t: f"{t_sdpa / (w * t):.2f}"  # noqa: E731
    steps_rows = [
        ["one process: F.scaled_dot_product_attention (T1)", f"{t_sdpa:.0f}", "1.00", "0"],
        ["one process: ring_attention, 1 rank", f"{t_ring1:.0f}", f"{t_sdpa / t_ring1:.2f}", "0"],
        [f"ring_attention, world {w}", f"{total:.0f}", eff(total),
         " / ".join(f"{g[3]:,} + {g[4]:,}" for g in got)],
    ]
    overlap_rows = [[f"{w}", f"{total:.0f}", f"{compute:.0f}", f"{comm:.0f}", f"{hidden:.0%}"]]
    return [
        (title, ["variant", "ms per step", "parallel efficiency T1/(world*T)",
                 "bytes sent per rank, fwd + bwd (rank 0 / rank 1 ...)"], steps_rows),
        ("ring attention: communication hidden behind compute (ms per step, slowest rank)",
         ["world", "t_total", "t_compute (no transfers)", "t_comm (no compute)",
          "hidden = (t_comm + t_compute - t_total) / t_comm"], overlap_rows),
    ]


# -- neighbourhood attention --------------------------------------------------------------

NA_SHAPE, NA_KERNEL = (1, 128, 128, 4, 32), 7


def na_single(mesh, shape, kernel, steps):
    """One process, one thread: neighborhood_attention2d on the whole field (ms/step)."""
    torch.set_num_threads(1)
    q, k, v, go = _qkv(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        y = neighborhood_attention2d(q, k, v, kernel)
        torch.autograd.grad(y, (q, k, v), go)

    return median_ms(step, steps, warmup=1)


def na_per_rank(mesh, shape, kernel, steps, spec):
    """On each gloo rank, in ms: (overlapped, not overlapped, transfers alone), and the
    bytes sent forward and backward. The three variants interleave step by step, so a
    change in the machine's load hits them alike."""
    torch.set_num_threads(1)
    lay = Layout(shape, spec, mesh)
    q, k, v, go = (lay.shard(t, mesh.rank).clone() for t in _qkv(shape))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _na = importlib.import_module("spmd.ops.neighborhood_attention")
    real = {name: getattr(_na, name) for name in ("_overlapped", "attend_forward",
                                                   "attend_backward", "exchange_async",
                                                   "transpose_async")}

    def windowed(q, k, v, rpb, sp):  # the whole window fetched first, then attended
        return _na._windowed(q, k, v, rpb, sp.fetches, sp.whole, sp.scale)

    def no_forward(q, kw, vw, rpb, ix, scale):
        return (q.new_zeros((*q.shape[:-1], vw.shape[-1])),
                q.new_zeros((q.shape[0], q.shape[1], 1, q.shape[2])))

    def no_backward(q, kw, vw, rpb, out, lse, g, ix, scale):
        return torch.zeros_like(q), torch.zeros_like(kw), torch.zeros_like(vw), None

    def arrived(x, f):  # zeros of the shape that would arrive, at once
        need = f.plan[3][f.me]
        return Pending.done([x.new_zeros([len(need[s][0]) if (d == f.dim and s in need) else n
                                          for d, n in enumerate(x.shape)])
                             for s in range(len(f.plan[0]))])

    class Returned:  # the halo's gradients sent nowhere, none coming back
        def __init__(self, g, f, apart):
            pass

        def wait(self, *, owned, own_grad=None):
            return own_grad

    variants = {"overlapped": {}, "windowed": {"_overlapped": windowed},
                "compute": {"exchange_async": arrived, "transpose_async": Returned},
                "transfers": {"attend_forward": no_forward, "attend_backward": no_backward}}

    def step(variant):
        for name, fn in variants[variant].items():
            setattr(_na, name, fn)
        try:
            with mesh:
                y = neighborhood_attention2d(q, k, v, kernel, mesh=mesh, spec=lay)
                torch.autograd.grad(y, (q, k, v), go)
        finally:
            for name, fn in real.items():
                setattr(_na, name, fn)

    times = {name: [] for name in variants}
    for name in variants:
        step(name)  # warm up
    for _ in range(steps):
        for name in variants:
            t0 = time.perf_counter()
            step(name)
            times[name].append((time.perf_counter() - t0) * 1e3)
    with spmd.comm_stats() as s:
        step("overlapped")
    med = [statistics.median(times[name]) for name in variants]
    return (*med, s.bytes(rank=mesh.rank, pass_="forward"),
            s.bytes(rank=mesh.rank, pass_="backward"))


def neighborhood_section(a) -> list[tuple[str, list[str], list[list[str]]]]:
    """Neighbourhood attention 2-D, 128x128, kernel 7, against one process: its table
    (title, header, rows), in ring_section's format."""
    steps = 1 if a.quick else a.steps
    shape, kernel, w = NA_SHAPE, NA_KERNEL, a.world
    t1 = spmd.launch(na_single, (1,), ("sp",), args=(shape, kernel, steps), timeout=3600)[0]
    if a.split == "xy":
        if w % 2 or w < 4:
            raise SystemExit("--split xy needs an even --world of at least 4")
        mesh_shape, names, spec = (2, w // 2), ("sx", "sy"), P(None, "sx", "sy")
    else:
        mesh_shape, names, spec = (w,), ("sp",), P(None, "sp")
    got = spmd.launch(na_per_rank, mesh_shape, names, backend="gloo",
                      args=(shape, kernel, steps, spec), timeout=3600)
    over, whole, compute, comm = (max(g[i] for g in got) for i in range(4))
    hidden = lambda t: f"{(comm + compute - t) / comm:.0%}"  # noqa: E731
    halo = kernel // 2 * shape[2] * shape[3] * shape[4] * 4 * 2  # rows x (k and v), f32
    need = " / ".join(f"{halo * (1 if r in (0, w - 1) else 2):,}" for r in range(w))
    where = ("X" if a.split == "x" else f"X and Y ({mesh_shape[0]} x {mesh_shape[1]})")
    title = (f"neighborhood attention f32{list(shape)} (batch, X, Y, heads, head_dim), "
             f"kernel {kernel}, {where} split over gloo world {w}, forward + backward, 1 thread "
             f"per process (slowest rank); attention alone (no transfers): {compute:.1f} ms, "
             f"transfers alone (no attention): {comm:.1f} ms")
    sent = " / ".join(f"{g[4]:,} + {g[5]:,}" for g in got)
    if a.split == "x":
        sent += f" (halo: {need} each)"
    rows = [
        ["one process: neighborhood_attention2d, mesh=None (T1)", f"{t1:.1f}", "1.00", "", "0"],
        [f"world {w}, halo overlapped with the interior (the default)", f"{over:.1f}",
         f"{t1 / (w * over):.2f}", hidden(over), sent],
        [f"world {w}, whole window fetched first", f"{whole:.1f}", f"{t1 / (w * whole):.2f}",
         hidden(whole), sent],
    ]
    return [(title, ["variant", "ms per step", "parallel efficiency T1/(world*T)",
                     "transfers hidden: (t_comm + t_compute - t) / t_comm",
                     "bytes sent per rank, fwd + bwd (rank 0 / rank 1 ...)"], rows)]


# -- the tables -----------------------------------------------------------------------------

SECTIONS = {"ring": ring_section, "neighborhood": neighborhood_section}


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("| --- |" + " ---: |" * (len(header) - 1))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a quarter of the sequence, 1 step")
    ap.add_argument("--only", choices=sorted(SECTIONS), help="run one section")
    ap.add_argument("--split", choices=("x", "xy"), default="x",
                    help="neighbourhood attention: split rows, or rows and columns")
    a = ap.parse_args()
    for name, section in SECTIONS.items():
        if a.only in (None, name):
            for table in section(a):
                print_table(*table)


if __name__ == "__main__":
    main()
