"""How long ``spmd.plan`` takes: a 3-level U-Net (conv, max-pool, nearest upsample, skip
concatenated on channels) planned for 64 ranks, every candidate measured on a mesh of at
most 3 ranks per axis at its local shape and predicted (``measure_ranks``, default 8),
and for 8 ranks, every candidate run at its own shape.

    python benchmarks/plan.py [--size 512] [--ranks 64,8] [--repeats 3] [--warmup 1]
                              [--check] [--gloo 4 --steps 10 --rounds 2 --load-ms 1.5
                              --batch 1 --dims 0,2,3]

Prints the load average, each plan's table and the seconds it took (one run each;
the machine is shared: read the load). ``--check`` then runs every usable candidate
as a user would (convert, shard_map, two training steps on a threads mesh of its
shape) and compares the bytes the busiest rank sends (comm_stats) and its memory
(saved-tensor hooks + input shard + outputs + twice the parameters) with the plan's:
predicted ones too (``--size 128 --ranks 64 --check``: about 10 s a candidate).

``--gloo N`` plans for N ranks priced for the processes the candidates then run as:
the network fitted on gloo here among N processes (loopback, ``fit_network`` at world
N, each call after ``--load-ms`` of compute), and the compute scaled by what N
one-thread processes computing at once measure against one alone (``compute_scale``:
N > 2 oversubscribes this machine's two cores). ``--batch B --dims 0,2,3`` adds the
batch to the splittable dims (a data-parallel candidate).
It then runs every usable candidate as N gloo processes, the candidates alternating
``--rounds`` times, and prints per candidate the predicted step (compute + exposed
collectives + gradient sync), the slowest rank's measured step (median and quartiles
over the steps of every round), the noise (the interquartile range of those steps or
the spread of the rounds' medians, whichever is larger) and the collectives a step;
then, for every pair of candidates whose predictions differ by more than the larger
of their noises, whether the measured order agrees; then the same with the plan priced
again with the per-collective overhead calibrated on each third candidate's measured
step (``Plan.calibrated``), so that neither of a pair prices itself.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import spmd
from spmd.demo import UNet
from spmd.testing.memory import SavedBytes




def run(model: nn.Module, c, x: torch.Tensor) -> tuple[int, int]:
    """(bytes sent, memory) of the busiest rank of ``c`` run directly."""
    mesh = c.mesh("threads")
    sharded = spmd.nn.convert(model, mesh, c.spec)
    params = [p for p in sharded.parameters() if p.requires_grad]
    held: dict[int, int] = {}

    def body(xl):
        with SavedBytes([*params, xl]) as s:
            y = sharded(xl)
        held[spmd.axis_index(mesh.axis_names)] = s.total + xl.nbytes + y.nbytes
        return y

    f = spmd.shard_map(body, mesh, c.spec, c.spec, params=params)
    for _ in range(2):  # the second step is the steady state
        with spmd.comm_stats() as st:
            f(x).sum().backward()
    sent = [0] * mesh.size
    for *_, rank, _pass, nbytes in st.records:
        sent[rank] += nbytes
    pbytes = sum(p.numel() * p.element_size() for p in params)
    return max(sent), max(held.values()) + 2 * pbytes


def _fit(mesh, load_s: float):
    torch.set_num_threads(1)
    return spmd.perf.fit_network(sizes=(64, 1 << 14, 1 << 18, 1 << 20), repeats=15, warmup=3,
                                 load_s=load_s,
                                 name=f"gloo loopback world {mesh.size} (fitted)")


def _compute(shape: tuple[int, ...], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` forward and backward passes of the plain U-Net at
    ``shape`` with one torch thread (after one warm-up)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = UNet(c=4, w=8, levels=3), torch.randn(shape)
    out = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        model(x).sum().backward()
        if i:
            out.append(time.perf_counter() - t0)
    return out


def _compute_together(mesh, shape: tuple[int, ...], repeats: int) -> list[float]:
    """``_compute`` on every process of the world at once (started by a barrier): what
    compute costs when the run's processes share this machine's cores."""
    import torch.distributed as dist
    dist.barrier()
    return _compute(shape, repeats)


def _gloo_steps(mesh, spec, size: int, steps: int, batch: int = 1) -> list[float]:
    """Seconds of each training step (forward, backward from a fixed cotangent, the
    gradient all-reduce shard_map does on processes) of this rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = UNet(c=4, w=8, levels=3), torch.randn(batch, 4, size, size)
    f = spmd.shard_map(spmd.nn.convert(model, mesh, spec), mesh, spec, spec)
    w = torch.randn(x.shape[0], 1, size, size, generator=torch.Generator().manual_seed(1))
    out = []
    for i in range(steps + 2):  # the first learns the layouts, the second warms up
        t0 = time.perf_counter()
        (f(x) * w).sum().backward()
        if i >= 2:
            out.append(time.perf_counter() - t0)
    with spmd.comm_stats() as st:  # one more step, untimed: its collectives
        (f(x) * w).sum().backward()
    return out, len(st.records)


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def _label(c) -> str:
    return f"{'x'.join(map(str, c.mesh_shape))} {c.spec}"


def _compare(pair: str, dp: float, dm: float, noise: float) -> bool | None:
    """Print whether a pair's predicted order (``dp``: the second's step minus the
    first's) is the measured one (``dm``); None where the predictions are within the
    noise (not ranked)."""
    if abs(dp) <= noise:
        print(f"{pair}: predictions {dp * 1e3:+.1f} ms apart, within the noise "
              f"({noise * 1e3:.1f} ms): not ranked")
        return None
    ok = (dp > 0) == (dm > 0)
    print(f"{pair}: predicted {dp * 1e3:+.1f} ms, measured {dm * 1e3:+.1f} ms (noise "
          f"{noise * 1e3:.1f} ms): {'agree' if ok else 'DISAGREE'}"
          f"{'' if abs(dm) > noise else ' (the measured difference is within the noise)'}")
    return ok


def gloo(world: int, size: int, steps: int, rounds: int, repeats: int, warmup: int,
         load_s: float, batch: int = 1, dims: tuple[int, ...] | None = None) -> None:
    """Plan for ``world`` ranks priced for this machine, run every candidate as gloo
    processes, and compare the orders where the predictions differ by more than the
    measured noise."""
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; input [{batch}, 4, {size}, {size}]; "
          f"world {world}")
    # The network the candidates run on: gloo over loopback among `world` processes on
    # this machine (with more processes than cores a collective also waits for its
    # peers to be scheduled, which a fit at a smaller world does not see).
    net = spmd.launch(_fit, (world,), ("sp",), backend="gloo", args=(load_s,), timeout=300)[0]
    print(f"network: {net!r}")
    # Compute as the run has it: `world` one-thread processes on the cores at once,
    # against one alone (as plan times it): the ratio is plan's compute_scale.
    shard = (batch, 4, size // world, size)
    alone = statistics.median(_compute(shard, 9))
    together = max(statistics.median(r) for r in spmd.launch(
        _compute_together, (world,), ("sp",), backend="gloo", args=(shard, 9), timeout=300))
    scale = alone / together
    print(f"compute of f32{list(shard)}, forward and backward, one thread: {alone * 1e3:.1f} "
          f"ms alone, {together * 1e3:.1f} ms with {world} processes at once (slowest "
          f"median): compute_scale {scale:.3f}")
    torch.manual_seed(0)
    model, x = UNet(c=4, w=8, levels=3), torch.randn(batch, 4, size, size)
    plan = spmd.plan(model, x, ranks=world, network=net, compute_scale=scale,
                     repeats=repeats, warmup=warmup, dims=dims)
    print(plan)
    # Candidates alternate, `rounds` times (a launch each): a drift in the load shows as
    # a difference between rounds, which counts in the noise.
    cands = plan.ranked
    per_step: dict[int, list[float]] = {i: [] for i in range(len(cands))}
    per_round: dict[int, list[float]] = {i: [] for i in range(len(cands))}
    calls: dict[int, int] = {}
    for _ in range(rounds):
        for i, c in enumerate(cands):
            res = spmd.launch(_gloo_steps, c.mesh_shape, c.axis_names, backend="gloo",
                              args=(c.spec, size, steps, batch), timeout=300)
            slowest = [max(r[0][k] for r in res) for k in range(steps)]
            calls[i] = max(r[1] for r in res)
            per_step[i] += slowest
            per_round[i].append(statistics.median(slowest))
    print(f"\nload average after the runs {os.getloadavg()[0]:.2f}\n")
    print("| candidate | predicted ms (compute + comm + grad sync) | measured ms, median "
          "[q1, q3] | noise ms | collectives a step (busiest rank) | (measured - predicted "
          "compute) / collectives, ms |\n|---|---:|---:|---:|---:|---:|")
    meas, noise = {}, {}
    for i, c in enumerate(cands):
        q1, med, q3 = _quartiles(per_step[i])
        rs = per_round[i]
        # the noise: the spread of the steps (interquartile range) or of the rounds'
        # medians, whichever is larger
        noise[i] = max(q3 - q1, max(rs) - min(rs))
        meas[i] = med
        p = c.prediction
        print(f"| {'x'.join(map(str, c.mesh_shape))} {c.spec} | {c.step_s * 1e3:.1f} "
              f"({(p.forward_s + p.backward_s) * 1e3:.1f} + {p.comm_s * 1e3:.1f} + "
              f"{p.grad_sync_s * 1e3:.1f}) | {med * 1e3:.1f} [{q1 * 1e3:.1f}, {q3 * 1e3:.1f}] "
              f"| {noise[i] * 1e3:.1f} | {calls[i]} | "
              f"{(med - p.forward_s - p.backward_s) / max(calls[i], 1) * 1e3:.2f} |")
    print()
    compared = agree = 0
    for i in range(len(cands)):
        for j in range(i + 1, len(cands)):
            ok = _compare(f"{_label(cands[i])} vs {_label(cands[j])}",
                          cands[j].step_s - cands[i].step_s, meas[j] - meas[i],
                          max(noise[i], noise[j]))
            compared += ok is not None
            agree += bool(ok)
    print(f"\nplan's order:     {', '.join(_label(c) for c in cands)}")
    print(f"measured order:   {', '.join(_label(cands[i]) for i in sorted(meas, key=meas.get))}")
    print(f"verdict: {agree} of {compared} pairs whose predictions differ by more than the "
          f"noise are measured in the predicted order")
    # Calibrated, leaving the pair out: the per-call overhead comes from a third
    # candidate's measured step (Plan.calibrated), so neither of the two compared was
    # used to price them.
    print("\ncalibrated on a third candidate (Plan.calibrated: the per-collective overhead "
          "that makes its prediction its measured median):")
    cal = {k: plan.calibrated(c, meas[k]) for k, c in enumerate(cands)}
    for k, p_ in cal.items():
        steps = {(c.mesh_shape, str(c.spec)): c.step_s for c in p_.ranked}
        row = ", ".join(f"{_label(c)} {steps[(c.mesh_shape, str(c.spec))] * 1e3:.1f}"
                        for i, c in enumerate(cands) if i != k)
        print(f"  on {_label(cands[k])}: +{p_.network.overhead_s * 1e3:.2f} ms a collective; "
              f"predicted {row}")
    compared = agree = 0
    for i in range(len(cands)):
        for j in range(i + 1, len(cands)):
            for k in (k for k in range(len(cands)) if k not in (i, j)):
                steps = {(c.mesh_shape, str(c.spec)): c.step_s for c in cal[k].ranked}
                a, b = (steps[(cands[x].mesh_shape, str(cands[x].spec))] for x in (i, j))
                ok = _compare(f"{_label(cands[i])} vs {_label(cands[j])} (on {_label(cands[k])})",
                              b - a, meas[j] - meas[i], max(noise[i], noise[j]))
                compared += ok is not None
                agree += bool(ok)
    print(f"verdict, calibrated: {agree} of {compared} pair calibrations whose predictions "
          f"differ by more than the noise are measured in the predicted order")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--ranks", default="64,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--gloo", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load-ms", type=float, default=1.5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dims", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.gloo:
        dims = tuple(int(d) for d in a.dims.split(",")) if a.dims else None
        return gloo(a.gloo, a.size, a.steps, a.rounds, a.repeats, a.warmup, a.load_ms / 1e3,
                    a.batch, dims)
    torch.manual_seed(0)
    model, x = UNet(c=4, w=8, levels=3), torch.randn(1, 4, a.size, a.size)
    print(f"load average {os.getloadavg()[0]:.2f}; input {list(x.shape)}, 3-level U-Net")
    for ranks in (int(r) for r in a.ranks.split(",")):
        t0 = time.perf_counter()
        plan = spmd.plan(model, x, ranks=ranks, network=spmd.perf.NETWORKS["ib_ndr"],
                         repeats=a.repeats, warmup=a.warmup)
        dt = time.perf_counter() - t0
        print(plan)
        print(f"{ranks} ranks: {len(plan.candidates)} candidates planned in {dt:.1f} s "
              f"(load average {os.getloadavg()[0]:.2f})\n")
        for c in plan.ranked if a.check else ():
            sent, mem = run(model, c, x)
            print(f"  {'x'.join(map(str, c.mesh_shape))} {c.spec}: sent {c.comm_bytes:,} B "
                  f"planned, {sent:,} B run; memory {c.memory_bytes:,} B planned, "
                  f"{mem:,} B run")


if __name__ == "__main__":
    main()
