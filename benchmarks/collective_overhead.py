"""Per-call overhead of spmd's differentiable collectives over raw torch.distributed.

Gloo, world 2 (two spawned processes on 127.0.0.1), one thread per rank. For each
payload size, every variant below runs once per iteration, in an order rotated each
iteration (so drift and neighbour effects hit every variant alike); per-call times are
taken on rank 0 with ``perf_counter_ns``. Overhead = median(spmd) - median(baseline).

    python benchmarks/collective_overhead.py [--iters N] [--sizes 4,65536,1048576]
                                             [--budget SECONDS] [--only VARIANT,...]
                                             [--profile N]

Each size gets at most ``--iters`` rounds, fewer when the warm-up says they would take
more than its share of ``--budget`` (default 36 s in all: the default run takes ~45 s).
The "5 blocks" column is the overhead measured on each fifth of the run separately:
a wide range means the machine's load moved while measuring; trust the medians less.
``--profile N`` also prints the N functions that cost most of their own time on rank 0
(cProfile over the timed calls: run it with ``--only`` one spmd variant).

Variants (x is float32, ``nbytes`` bytes; spmd calls run inside ``with mesh:``, which
``spmd.launch`` sets up; the raw calls use the same process group as the mesh axis):

    raw all_reduce        dist.all_reduce(x)                  in place (destroys x)
    raw all_reduce+clone  dist.all_reduce(x.clone())          fair: spmd keeps x intact
    comm all_reduce       comm_of(mesh).all_reduce(x, "sum", group): the protocol alone,
                          with its always-on check (no collectives layer, no autograd)
    comm all_reduce unchecked
                          the same with ``comm.checks`` off for that call only (as
                          ``SPMD_VALIDATE=0``): checked against unchecked in one run
    psum no_grad          spmd.psum(x, "x") under torch.no_grad()
    psum                  spmd.psum(x, "x"), grad mode on, x.requires_grad False (the
                          default in user code: spmd "anchors" x, an autograd node is made)
    psum requires_grad    spmd.psum(x, "x"), x.requires_grad True
    raw all_gather        dist.all_gather_single(new out, x) (all_gather_into_tensor
                          on older torch)
    all_gather            spmd.all_gather(x, "x", tiled=True)  (sizes unknown: spmd
                          first exchanges the sizes)
    all_gather sizes=     spmd.all_gather(x, "x", tiled=True, sizes=[n, n])
    raw ppermute          dist.batch_isend_irecv([isend x, irecv new buf]) + wait
    ppermute              spmd.ppermute(x, "x", [(0, 1), (1, 0)])

The project's targets: overhead <= 5 % at 1 MiB and <= 30 us at 4 B.

spmd's reductions of CPU tensors check op, dtype and shape (element counts included)
on every call: up to 512 bytes as one all_gather of envelopes (metadata and payload)
reduced locally, above that with one all_gather of envelopes before gloo's ring
reduction (gloo aborts the process on a ring reduction whose sizes differ). Measured
2026-11-28 on a 2-core AMD EPYC VM shared with other jobs (load average 1.5-2.9),
``python benchmarks/collective_overhead.py --sizes 4,1048576 --only "raw all_reduce,raw
all_reduce+clone,comm all_reduce,comm all_reduce unchecked,psum no_grad,psum"``, two
runs, medians, overhead over ``raw all_reduce+clone``:

    variant                    4 B          1 MiB
    comm all_reduce            +147, +166   +1427, +1089 us
    comm all_reduce unchecked  +70, +74     +71, +208 us (4.0 %, 14.9 %)
    checked - unchecked        +77, +92     +1356, +881 us
    psum no_grad               +234, +250   +1528, +1269 us
    psum                       +301, +309   +1497, +1376 us

The targets are not met with the checks on, and the reason is gloo's own cost: on this
machine a raw all_reduce of 1-2 elements takes ~230 us, of 4 or more ~400-450 us, and an
all_gather of 16 B .. 2 KiB per rank ~290-340 us whatever its size (idle medians,
raw torch.distributed, world 2). A small checked reduction is one all_gather instead of
one all_reduce (+60-90 us, gloo's difference between the two); a large one is one
all_gather more (a round trip: +0.3 ms idle, 0.9-1.4 ms under this load). spmd's own
work per call at 4 B is ~12 us for ``comm all_reduce``, 20 us for ``psum`` under
``no_grad`` and 37 us in grad mode (timed with the all_gather replaced by a local copy,
best of three runs). Without the checks (the "unchecked" row, or ``SPMD_VALIDATE=0``:
+76 us at 4 B, +119 us = 7.7 % at 1 MiB in one run) 1 MiB is at +4-15 %, near the 5 %
target; 4 B stays +70-76 us, a buffer, a copy and a bounded wait that this loaded
machine makes cost several times their idle time. GradSync's bucket all-reduces carry
no envelope: their sizes follow from the plan, which GradSync compares across the ranks
when it is built.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# Runnable from a checkout without installing (and measuring that checkout, not an
# installed spmd elsewhere).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from spmd.comm import comm_of  # noqa: E402

AXIS = "x"
WARMUP = 20
MIN_ITERS = 200

VARIANTS = ["raw all_reduce", "raw all_reduce+clone", "comm all_reduce",
            "comm all_reduce unchecked", "psum no_grad", "psum",
            "psum requires_grad", "raw all_gather", "all_gather", "all_gather sizes=",
            "raw ppermute", "ppermute"]

# (spmd variant, baseline variant) pairs that the table and the goals report.
COMPARISONS = [
    ("comm all_reduce", "raw all_reduce+clone"),
    ("comm all_reduce unchecked", "raw all_reduce+clone"),
    ("comm all_reduce", "comm all_reduce unchecked"),
    ("psum no_grad", "raw all_reduce"),
    ("psum no_grad", "raw all_reduce+clone"),
    ("psum", "raw all_reduce"),
    ("psum", "raw all_reduce+clone"),
    ("psum requires_grad", "raw all_reduce"),
    ("psum requires_grad", "raw all_reduce+clone"),
    ("all_gather", "raw all_gather"),
    ("all_gather sizes=", "raw all_gather"),
    ("ppermute", "raw ppermute"),
]


def _make_calls(mesh, nbytes: int):
    """name -> zero-argument callable doing one collective of ``nbytes`` of float32."""
    import torch
    import torch.distributed as dist

    import spmd

    # As spmd does: all_gather_into_tensor is deprecated in favour of all_gather_single.
    _all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = max(nbytes // 4, 1)
    world = mesh.size
    rank = dist.get_rank()
    group = mesh.group(AXIS, rank)
    pg = comm_of(mesh).process_group(group)  # the process group spmd uses for this axis
    peer = group.ranks[1 - group.index]
    perm = [(0, 1), (1, 0)]
    sizes = [n] * world

    x = torch.randn(n)
    x_inplace = torch.zeros(n)  # raw in-place all_reduce overwrites it: zeros stay zeros
    x_rg = x.clone().requires_grad_()

    def raw_ar():
        dist.all_reduce(x_inplace, group=pg)

    def raw_ar_clone():
        y = x.clone()
        dist.all_reduce(y, group=pg)
        return y

    comm = comm_of(mesh)
    checks = comm.checks

    def comm_ar():
        return comm.all_reduce(x, "sum", group, name="psum")

    def comm_ar_unchecked():
        comm.checks = False  # as SPMD_VALIDATE=0, for this call only
        try:
            return comm.all_reduce(x, "sum", group, name="psum")
        finally:
            comm.checks = checks

    def psum_ng():
        with torch.no_grad():
            return spmd.psum(x, AXIS)

    def psum():
        return spmd.psum(x, AXIS)

    def psum_rg():
        return spmd.psum(x_rg, AXIS)

    def raw_ag():
        out = torch.empty(world * n)
        _all_gather_single(out, x, group=pg)
        return out

    def ag():
        return spmd.all_gather(x, AXIS, tiled=True)

    def ag_sizes():
        return spmd.all_gather(x, AXIS, tiled=True, sizes=sizes)

    def raw_pp():
        buf = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, pg),
                                        dist.P2POp(dist.irecv, buf, peer, pg)])
        for w in works:
            w.wait()
        return buf

    def pp():
        return spmd.ppermute(x, AXIS, perm)

    calls = {
        "raw all_reduce": raw_ar, "raw all_reduce+clone": raw_ar_clone, "comm all_reduce": comm_ar,
        "comm all_reduce unchecked": comm_ar_unchecked,
        "psum no_grad": psum_ng, "psum": psum, "psum requires_grad": psum_rg,
        "raw all_gather": raw_ag, "all_gather": ag, "all_gather sizes=": ag_sizes,
        "raw ppermute": raw_pp, "ppermute": pp,
    }
    # Sanity: spmd and raw agree, and spmd did not touch its input.
    x0 = x.clone()
    ref = raw_ar_clone()
    for name in ("comm all_reduce", "comm all_reduce unchecked", "psum no_grad", "psum",
                 "psum requires_grad"):
        assert torch.allclose(calls[name]().detach(), ref), name
    assert torch.equal(ag().detach(), raw_ag()) and torch.equal(ag_sizes().detach(), raw_ag())
    assert torch.equal(pp().detach(), raw_pp())
    assert torch.equal(x, x0), "spmd modified its input"
    return calls


def per_rank(mesh, sizes: list[int], iters: int, budget: float, names: list[str],
             profile: int = 0):
    """Runs on every rank: {nbytes: {variant: [ns per call, ...]}}.

    Per size, at most ``iters`` rounds, fewer if the warm-up says they would take more
    than ``budget`` seconds (rank 0 decides, so both ranks run the same calls).
    ``profile``: also profile the timed calls on rank 0 (cProfile, which slows every
    Python call: the times are then not comparable) and return the ``profile`` lines
    that cost most of their own time under ``"profile"``.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    clock = time.perf_counter_ns
    out = {}
    for nbytes in sizes:
        calls = _make_calls(mesh, nbytes)
        fns = [calls[k] for k in names]
        k = len(fns)
        t0 = clock()
        for _ in range(WARMUP):
            for f in fns:
                f()
        per_round = (clock() - t0) / 1e9 / WARMUP
        n_it = torch.tensor([min(iters, max(MIN_ITERS, int(budget / per_round)))])
        dist.broadcast(n_it, 0)
        n_it = int(n_it)
        times = [[0] * n_it for _ in range(k)]
        prof = None
        if profile and dist.get_rank() == 0:
            import cProfile
            prof = cProfile.Profile()
        dist.barrier()
        if prof is not None:
            prof.enable()
        for i in range(n_it):
            for j in range(k):  # rotated order: each variant follows each other one
                v = (i + j) % k
                f = fns[v]
                t0 = clock()
                f()
                times[v][i] = clock() - t0
        if prof is not None:
            import io
            import pstats
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(profile)
            out.setdefault("profile", {})[nbytes] = text.getvalue()
        out[nbytes] = dict(zip(names, times))
    return out


# -- reporting (parent process) -----------------------------------------------------------

def _q(sorted_vals, q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _stats(ns: list[int]) -> tuple[float, float, float]:
    s = sorted(v / 1000.0 for v in ns)
    return _q(s, 0.5), _q(s, 0.1), _q(s, 0.9)


def _size_str(n: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def _goal(nbytes: int):
    """(label, test(us, pct)) of the target for this size, or None."""
    if nbytes <= 4:
        return "<= 30 us", lambda us, pct: us <= 30.0
    if nbytes >= 1 << 20:
        return "<= 5 %", lambda us, pct: pct <= 5.0
    return None


def _overhead(a: list[int], b: list[int], blocks: int = 5) -> tuple[float, float, float]:
    """median(a) - median(b) in us over all iterations, and its min and max over
    ``blocks`` contiguous blocks of iterations (how much it moves with the load)."""
    per = []
    k = max(len(a) // blocks, 1)
    for i in range(0, len(a) - k + 1, k):
        per.append(_stats(a[i:i + k])[0] - _stats(b[i:i + k])[0])
    return _stats(a)[0] - _stats(b)[0], min(per), max(per)


def report(res: list[dict], sizes: list[int], wall: float, load) -> None:
    import torch
    r0 = res[0]
    print("# spmd collective overhead: gloo, world 2, 1 thread per rank, variants interleaved")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPU cores ({_cpu_name()}), {platform.system()} "
          f"{platform.machine()}; load average {load[0]} before, {load[1]} after; "
          f"times on rank 0; run took {wall:.1f} s")
    for nbytes in sizes:
        iters = len(next(iter(r0[nbytes].values())))
        print(f"\n## {_size_str(nbytes)} ({max(nbytes // 4, 1)} float32), {iters} calls "
              f"per variant\n")
        print(f"| {'variant':<25} | {'median us':>9} | {'p10 us':>8} | {'p90 us':>8} |")
        print(f"|{'-' * 27}|{'-' * 10}:|{'-' * 9}:|{'-' * 9}:|")
        for name, ns in r0[nbytes].items():
            m, p10, p90 = _stats(ns)
            print(f"| {name:<25} | {m:>9.1f} | {p10:>8.1f} | {p90:>8.1f} |")
        goal = _goal(nbytes)
        head = f"goal {goal[0]}" if goal else "goal"
        print(f"\n| {'spmd':<25} | {'baseline':<25} | {'overhead us':>11} | {'%':>6} | "
              f"{'5 blocks, us':>14} | {head:<13} |")
        print(f"|{'-' * 27}|{'-' * 27}|{'-' * 12}:|{'-' * 7}:|{'-' * 15}:|{'-' * 15}|")
        for a, b in COMPARISONS:
            if a not in r0[nbytes] or b not in r0[nbytes]:
                continue
            us, lo, hi = _overhead(r0[nbytes][a], r0[nbytes][b])
            pct = 100.0 * us / _stats(r0[nbytes][b])[0]
            ok = ("met" if goal[1](us, pct) else "NOT met") if goal else "-"
            rng = f"{lo:.0f} .. {hi:.0f}"
            print(f"| {a:<25} | {b:<25} | {us:>11.1f} | {pct:>5.1f}% | {rng:>14} | {ok:<13} |")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000,
                    help="timed calls per variant and size, at most (default 2000)")
    ap.add_argument("--budget", type=float, default=36.0,
                    help="seconds of timed calls in all, split over the sizes; fewer "
                         "iterations (not below 200) where --iters would take longer "
                         "(default 36)")
    ap.add_argument("--sizes", default="4,65536,1048576",
                    help="payload sizes in bytes, comma-separated (default 4,65536,1048576)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print the N functions that cost most of their own time on "
                         "rank 0 (cProfile: slows every call, so read the tables of such a "
                         "run for where the time goes, not for the overhead)")
    ap.add_argument("--only", default="",
                    help="comma-separated variant names to run (default: all)")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 4 or any(s % 4 for s in sizes):
        ap.error("--sizes must be multiples of 4 bytes (float32), at least 4")
    names = list(VARIANTS)
    if a.only:
        want = [s.strip() for s in a.only.split(",")]
        bad = [w for w in want if w not in names]
        if bad:
            ap.error(f"unknown variants {bad}; choose from {names}")
        names = [n for n in names if n in want]

    import spmd
    load0 = _load()
    t0 = time.perf_counter()
    res = spmd.launch(per_rank, (2,), (AXIS,), backend="gloo",
                      args=(sizes, a.iters, a.budget / len(sizes), names, a.profile),
                      timeout=600.0)
    report(res, sizes, time.perf_counter() - t0, (load0, _load()))
    for nbytes, text in res[0].get("profile", {}).items():
        print(f"\n## profile, {_size_str(nbytes)}, rank 0, variants {', '.join(names)}\n")
        print(text.strip())
    return 0


if __name__ == "__main__":  # spawned ranks re-import this file as __mp_main__
    sys.exit(main())
