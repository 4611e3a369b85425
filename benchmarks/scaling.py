"""Predicted parallel efficiency from 8 to 4096 ranks (spmd.perf), checked against step
times measured on gloo processes here.

    python benchmarks/scaling.py [--out /tmp/spmd_scaling.png] [--size 256] [--steps 15]
                                 [--latency-us L --bandwidth-gbps B] [--max-elements N]
                                 [--gpu-factor 1000] [--quick]

1. Network: fitted (``spmd.perf.fit_network``: spmd's all-reduce and all-to-all on gloo,
   world 2, loopback, payloads 64 B .. 4 MiB) unless ``--latency-us`` and
   ``--bandwidth-gbps`` are given.
2. Validation: one training step of the demo CNN (``spmd.demo``: ``nn.convert``, forward,
   backward, shard_map's gradient all-reduce; Adam's step left out), f32[2, 2, size,
   size], rows split over "sp", on gloo world 2 and 4 (one torch thread per process):
   median step time against ``estimate(...).predict(world)`` with the fitted network
   (compute timed beforehand, alone), and against the same model with the compute
   timed inside the gloo ranks, interleaved with their steps (a 1-rank threads mesh on
   the rank's shard): the same load and core sharing, so it checks the communication
   model alone. World 4 runs 4 processes on this machine's 2 cores.
   Then the measured step taken apart (every collective of the gloo ranks timed): the
   slowest rank's time outside collectives (its compute, as it ran) and blocked in
   them, against the model's compute and exposed communication; and the time ranks
   wait for one another, which the model leaves out: per collective, how much later
   the last rank entered it than the first (a rank that computes slower this time),
   summed over the step.
3. Predictions at a realistic size for the demo CNN and the test U-Net (``TinyUNet(c=8)``
   of ``tests/nn/test_unet.py``; both are 2-D): a 32768 x 32768 field (2^30 points, as
   many as a 1024^3 volume), batch 1, float32, split over a 2-D mesh (H over "sx", W over
   "sy"; 4096 ranks = 64 x 64). Strong scaling: that field on 8 .. 4096 ranks. Weak:
   512 x 512 per rank (the 4096-rank shard of the strong case). Compute is this
   machine's (one CPU thread); the dashed lines divide it by ``--gpu-factor`` (default
   1000, an assumption: an H100's nominal 67 TFLOP/s FP32 over ~50 GFLOP/s for one
   AVX2 core), where communication starts to matter. Networks: the nominal presets
   (``spmd.perf.NETWORKS``) and the fitted loopback one (spmd's per-call software
   overhead included).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import spmd
from spmd import P, demo
from spmd.perf import NETWORKS, Network, estimate, fit_network, format_predictions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
SPEC = P(None, None, "sp")
SPEC2 = P(None, None, "sx", "sy")
RANKS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
FIELD = 32768
LOCAL = 512


def _model(which: str) -> torch.nn.Module:
    if which == "demo":
        return demo.make_model(hidden=16)
    from nn.test_unet import TinyUNet
    torch.manual_seed(0)
    return TinyUNet(c=8)


def _data(which: str, size: int, batch: int = 1):
    g = torch.Generator().manual_seed(0)
    c = 2 if which == "demo" else 1
    return (torch.randn(batch, c, size, size, generator=g),
            torch.randn(batch, 1, size, size, generator=g))


def _loss_body(model: torch.nn.Module, spec: P, n: int):
    """``mesh -> body``: the demo's training loss on a model converted for ``mesh``."""
    axes = spec.axes

    def build(mesh):
        sharded = spmd.nn.convert(model, mesh, spec)
        return lambda x, t: spmd.psum(((sharded(x) - t) ** 2).sum(), axes) / n
    return build


# -- 1. the network ------------------------------------------------------------------------

def _fit(mesh):
    torch.set_num_threads(1)
    return fit_network(sizes=(64, 1 << 16, 1 << 20, 1 << 22), repeats=30, warmup=5,
                       name="gloo loopback (fitted)")


# -- 2. measured gloo steps ------------------------------------------------------------------

class _Timed:
    """A started collective whose ``wait`` is timed (delegates everything else)."""

    def __init__(self, inner, entry):
        self._inner, self._entry = inner, entry

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._inner.wait(*args, **kwargs)
        finally:
            self._entry[1] += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _time_collectives(log: list) -> None:
    """Every collective of this process's torch comm appends ``[entered, seconds
    blocked]`` to ``log`` (the call, and for a started one its wait). Patches the class
    in this (benchmark) process only."""
    from spmd.comm import distributed
    cls = distributed.TorchComm
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "scatter",
                 "permute", "broadcast", "barrier", "all_reduce_async", "all_to_all_async"):
        real, started = getattr(cls, name), name.endswith("_async")

        def timed(self, *args, _real=real, _async=started, **kwargs):
            t = time.perf_counter()
            entry = [t, 0.0]
            log.append(entry)
            out = _real(self, *args, **kwargs)
            entry[1] += time.perf_counter() - t
            return _Timed(out, entry) if _async else out
        setattr(cls, name, timed)


def _gloo_steps(mesh, size: int, steps: int):
    """Per step: the gloo step's (start, end) and its collectives' ``[entered, seconds
    blocked]``, and (interleaved, under the same load) the seconds of this rank's shard
    alone on a 1-rank threads mesh: its compute in situ."""
    torch.set_num_threads(1)
    log: list = []
    _time_collectives(log)
    x, t = _data("demo", size, batch=2)
    build = _loss_body(_model("demo"), SPEC, t.numel())
    f = spmd.shard_map(build(mesh), mesh, (SPEC, SPEC), P())
    one = spmd.Mesh((1,), ("sp",), backend="threads")
    rows = spmd.Layout(x.shape, SPEC, mesh).slices(mesh.rank)
    xl, tl = x[rows].contiguous(), t[rows].contiguous()
    g = spmd.shard_map(build(one), one, (SPEC, SPEC), P())
    times, alone = [], []
    for i in range(steps + 2):
        log.clear()
        t0 = time.perf_counter()
        f(x, t).backward()
        t1 = time.perf_counter()
        calls = [tuple(e) for e in log]
        g(xl, tl).backward()
        if i >= 2:  # the first learns the layouts, the second warms up
            times.append((t0, t1, calls))
            alone.append(time.perf_counter() - t1)
    return times, alone


def validate(net: Network, size: int, steps: int) -> None:
    torch.set_num_threads(1)
    x, t = _data("demo", size, batch=2)
    est = estimate(_loss_body(_model("demo"), SPEC, t.numel()), spmd.Mesh((2,), ("sp",)),
                   (SPEC, SPEC), x, t, out_specs=P(), build=True, repeats=steps, warmup=2)
    print("| world | measured ms (median, p10..p90) | predicted ms (compute + comm + sync) "
          "| pred / meas | with compute timed in the gloo ranks | pred / meas |")
    print("|---:|---:|---:|---:|---:|---:|", flush=True)
    parts = []
    for w in (2, 4):
        res = spmd.launch(_gloo_steps, (w,), ("sp",), backend="gloo", args=(size, steps),
                          timeout=900)
        per_step = [max(r[0][i][1] - r[0][i][0] for r in res) for i in range(steps)]
        med = statistics.median(per_step)  # the slowest rank's
        q = statistics.quantiles(per_step, n=10)
        insitu = max(statistics.median(r[1]) for r in res)
        p = est.predict(w, network=net)
        b = insitu + p.comm_s + p.grad_sync_s
        print(f"| {w} | {med * 1e3:.1f} ({q[0] * 1e3:.1f}..{q[-1] * 1e3:.1f}) | "
              f"{p.step_s * 1e3:.1f} ({p.compute_s * 1e3:.1f} + {p.comm_s * 1e3:.1f} + "
              f"{p.grad_sync_s * 1e3:.1f}) | {p.step_s / med:.2f} | "
              f"{b * 1e3:.1f} ({insitu * 1e3:.1f} + ...) | {b / med:.2f} |", flush=True)
        parts.append((w, p, _apart([r[0] for r in res], steps)))
    print("\nThe measured step taken apart (medians over steps; the slowest rank of each step; "
          "waiting: per collective, the last rank's entry less the first's, summed):\n")
    print("| world | step ms | outside collectives ms (model: compute) | blocked in "
          "collectives ms (model: exposed comm + sync, hidden) | waiting for the slowest "
          "rank ms | collectives per rank |")
    print("|---:|---:|---:|---:|---:|---:|")
    for w, p, (step, outside, blocked, waiting, calls) in parts:
        print(f"| {w} | {step * 1e3:.1f} | {outside * 1e3:.1f} ({p.compute_s * 1e3:.1f}) | "
              f"{blocked * 1e3:.1f} ({(p.comm_s + p.grad_sync_s) * 1e3:.1f}, "
              f"{p.hidden_s * 1e3:.1f}) | {waiting * 1e3:.1f} | {calls} |")
    print(f"\nestimate (threads, world 2): {est!r}")


def _apart(per_rank: list, steps: int) -> tuple:
    """Medians over steps of (step, outside collectives, blocked in them) of each step's
    slowest rank, the summed entry skew, and the collectives per rank."""
    rows = []
    for i in range(steps):
        ranks = [r[i] for r in per_rank]
        slow = max(ranks, key=lambda r: r[1] - r[0])
        blocked = sum(c[1] for c in slow[2])
        n = min(len(r[2]) for r in ranks)
        skew = sum(max(r[2][j][0] for r in ranks) - min(r[2][j][0] for r in ranks)
                   for j in range(n))
        rows.append((slow[1] - slow[0], slow[1] - slow[0] - blocked, blocked, skew, n))
    return tuple(statistics.median(r[k] for r in rows) for k in range(5))


# -- 3. predictions at a realistic size ----------------------------------------------------------

def predictions(which: str, nets: dict[str, Network], gpu: float, max_elements: int,
                ranks: list[int]) -> dict:
    torch.set_num_threads(1)
    x, t = _data(which, 128)
    est = estimate(_loss_body(_model(which), SPEC2, FIELD * FIELD), spmd.Mesh((2, 2), ("sx", "sy")),
                   (SPEC2, SPEC2), x, t, out_specs=P(), build=True, repeats=3, warmup=1)
    c = x.shape[1]
    strong = [(1, c, FIELD, FIELD), (1, 1, FIELD, FIELD)]
    weak = [(1, c, LOCAL, LOCAL), (1, 1, LOCAL, LOCAL)]
    out = {}
    for name, net in nets.items():
        for scale in (1.0, gpu):
            for scaling, shapes in (("strong", strong), ("weak", weak)):
                out[(name, scale, scaling)] = est.sweep(
                    ranks, network=net, scaling=scaling, shapes=shapes, compute_scale=scale,
                    max_elements=max_elements)
    return {"estimate": est, "preds": out}


def plot(results: dict, nets: list[str], gpu: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(2, 2, figsize=(12, 9), sharex=True, sharey=True)
    colors = dict(zip(nets, ["C0", "C1", "C2", "C3", "C4"]))
    for i, which in enumerate(("demo", "unet")):
        for j, scaling in enumerate(("strong", "weak")):
            ax = axs[i][j]
            for name in nets:
                for scale, style in ((1.0, "-"), (gpu, "--")):
                    ps = results[which]["preds"][(name, scale, scaling)]
                    label = f"{name}" + ("" if scale == 1.0 else f", compute / {gpu:g}")
                    ax.plot([p.ranks for p in ps], [100 * p.efficiency for p in ps], style,
                            color=colors[name], marker="o", ms=3, label=label)
            title = {"demo": "demo CNN (3 conv)", "unet": "TinyUNet(c=8)"}[which]
            what = (f"{FIELD}^2 field" if scaling == "strong" else f"{LOCAL}^2 per rank")
            ax.set_title(f"{title}: {scaling} scaling, {what}")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 110)
            ax.grid(alpha=0.3)
            if i == 1:
                ax.set_xlabel("ranks (2-D mesh sx x sy)")
            if j == 0:
                ax.set_ylabel("predicted parallel efficiency %")
    axs[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("spmd.perf predictions: compute measured on this CPU (1 thread); solid: as "
                 f"measured, dashed: / {gpu:g} (assumed accelerator); networks nominal or "
                 "fitted", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/spmd_scaling.png")
    ap.add_argument("--size", type=int, default=256, help="validation field rows = cols")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--latency-us", type=float)
    ap.add_argument("--bandwidth-gbps", type=float, help="GB/s, one direction")
    ap.add_argument("--max-elements", type=int, default=1 << 21)
    ap.add_argument("--gpu-factor", type=float, default=1000.0)
    ap.add_argument("--quick", action="store_true", help="fewer rank counts, no validation")
    a = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# spmd.perf scaling: torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load:.1f}")
    t0 = time.perf_counter()
    if a.latency_us is not None and a.bandwidth_gbps is not None:
        fitted = Network(a.latency_us * 1e-6, a.bandwidth_gbps * 1e9, name="given")
    else:
        fitted = spmd.launch(_fit, (2,), ("sp",), backend="gloo", timeout=600)[0]
    print(f"\nnetwork: {fitted!r} ({fitted.source})", flush=True)
    if not a.quick:
        print(f"\n## validation: demo CNN step, f32[2, 2, {a.size}, {a.size}], gloo\n")
        validate(fitted, a.size, a.steps)
    ranks = RANKS[::3] if a.quick else RANKS
    nets = {"nvlink4": NETWORKS["nvlink4"], "ib_ndr": NETWORKS["ib_ndr"],
            "slingshot11": NETWORKS["slingshot11"], fitted.name: fitted}
    results = {}
    for which in ("demo", "unet"):
        results[which] = predictions(which, nets, a.gpu_factor, a.max_elements, ranks)
        est = results[which]["estimate"]
        print(f"\n## {which}: {est!r}\n")
        print(est.table())
        for scale in (1.0, a.gpu_factor):
            for scaling in ("strong", "weak"):
                ps = results[which]["preds"][("ib_ndr", scale, scaling)]
                print(f"\n### {which}, {scaling}, ib_ndr, compute / {scale:g}\n")
                print(format_predictions(ps))
        last = results[which]["preds"][("ib_ndr", 1.0, "strong")]
        print("\nnotes (strong, 8 and 4096 ranks):")
        for p in (last[0], last[-1]):
            print(f"  {p.ranks}: " + "; ".join(p.notes))
        print("\nefficiency % at the largest rank count, per network (strong / weak; "
              f"compute as measured | / {a.gpu_factor:g}):")
        for name in nets:
            effs = [results[which]["preds"][(name, s, sc)][-1].efficiency * 100
                    for s in (1.0, a.gpu_factor) for sc in ("strong", "weak")]
            print(f"  {name:<26} {effs[0]:6.1f} / {effs[1]:6.1f} | {effs[2]:6.1f} / {effs[3]:6.1f}")
        sys.stdout.flush()
    plot(results, list(nets), a.gpu_factor, a.out)
    print(f"\nplot: {a.out}; took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
