"""Pricing a candidate's step from what its run measured (``measured_step``), a plan
priced again on another network (``priced``), and a network's per-call overhead
calibrated from one candidate's measured step (``calibrated``).

The fitted latency and bandwidth time collectives on their own (``fit_network``); a
real step pays per collective what they do not see: the library's Python around each
halo'd op, and on CPU transports the wake-ups of transport threads on cores that are
computing. ``Plan.calibrated(candidate, step_s)`` finds the per-call ``overhead_s``
that makes ``candidate``'s predicted step what was measured, and prices every candidate
again with it (nothing re-runs: the collectives and compute were measured once).

    plan = spmd.plan(model, x, ranks=4, network=net)
    step = time_a_few_steps(plan.ranked[-1])            # on the real processes
    plan = plan.calibrated(plan.ranked[-1], step)
    print(plan)                                          # re-ranked
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import _measure
from . import model as cost_model
from .cost import Estimate
from .network import Network

__all__ = ["measured_step", "modelled", "rank_key", "priced", "calibrated"]

OK = "ok"  # candidate.OK (candidate.py imports this module)


def measured_step(est: Estimate, network: Network, grad_sync: str,
                   compute_scale: float) -> cost_model.Prediction:
    """The step on ``network`` from the collectives run on this very mesh (every rank's,
    the one that stalls longest), compute timed at the largest shard: ``predict``'s
    model without its re-measurement on a smaller mesh."""
    f, b = est.forward_s / compute_scale, est.backward_s / compute_scale
    events = {e.key: e for e in est._events(list(est.local_shapes)) or ()}
    best = (-1.0, 0.0, 0)
    for cs in est.comm.values():
        keys = [(c.name, c.kind, c.pass_) for c in cs]
        evs = [events.get((*k, o)) for k, o in zip(keys, _measure.ordinals(keys))]
        times = [c.time(network) for c in cs]
        t = cost_model.exposed(times, evs, f, b, network.overlap)
        nbytes = sum(c.nbytes for c in cs)
        if (t, nbytes) > (best[0], best[2]):
            best = (t, sum(times) - t, nbytes)
    comm_s, hidden_s, nbytes = best
    n = math.prod(est.mesh_shape)
    gs, gbytes, _ = cost_model._grad_sync(est, n, network, grad_sync, b)
    sf, sb = est._time(list(est.global_shapes))
    serial = (sf + sb) / compute_scale
    step_s = f + b + comm_s + gs
    eff = serial / (n * step_s) if step_s > 0 else 1.0
    return cost_model.Prediction(n, est.mesh_shape, "strong", network.name, est.global_shapes,
                            est.local_shapes, f, b, comm_s, gs, step_s, serial, eff, nbytes,
                            gbytes, est.peak_activation_bytes, (), hidden_s)


def rank_key(objective: str) -> Any:
    """The sort key of candidates by ``objective`` (ties: step, memory, bytes, then mesh
    shape and spec)."""
    def key(c: Any) -> tuple:
        order = {"time": (c.step_s, c.memory_bytes, c.comm_bytes),
                 "memory": (c.memory_bytes, c.step_s, c.comm_bytes),
                 "bytes": (c.comm_bytes, c.step_s, c.memory_bytes)}[objective]
        return (*order, c.mesh_shape, str(c.spec))
    return key


def modelled(c: Any, network: Network, pred: cost_model.Prediction) -> tuple[str, ...]:
    """What of candidate ``c``'s price on ``network`` is modelled (the table says it)."""
    if c.measured_mesh:
        hides = (f", at most {network.overlap:.0%} of each hidden" if network.overlap < 1
                 else "")
        over = (f", +{network.overhead_s * 1e3:.3g} ms a call" if network.overhead_s else "")
        return (f"collective times: {network.name}'s latency and bandwidth{over}, overlap "
                f"as on the 1-rank run{hides}",
                f"gradient all-reduce over {c.ranks} ranks (threads share the weights)")
    small = "x".join(str(min(t, 3)) for t in c.mesh_shape)
    return (f"bytes per rank on {'x'.join(map(str, c.mesh_shape))}: the interior rank's of "
            f"the {small} mesh", *pred.notes[1:])


def _prediction(c: Any, plan: Any, network: Network) -> cost_model.Prediction:
    kw = dict(grad_sync=plan.grad_sync, compute_scale=plan.compute_scale)
    if c.measured_mesh:
        return measured_step(c.estimate, network, **kw)
    return c.estimate.predict(mesh_shape=c.mesh_shape, network=network,
                              shapes=[plan.global_shape], **kw)


def priced(plan: Any, network: Network) -> Any:
    """``plan`` with every usable or over-budget candidate's step priced on ``network``
    (bytes and memory do not depend on it), ranked again."""
    if not isinstance(network, Network):
        raise TypeError(f"Plan.priced: network must be a spmd.perf.Network, got "
                        f"{type(network).__name__}")
    cands = []
    for c in plan.candidates:
        if c.prediction is not None and c.estimate is not None:
            pred = _prediction(c, plan, network)
            c = dataclasses.replace(c, prediction=pred, modelled=modelled(c, network, pred))
        cands.append(c)
    usable = sorted((c for c in cands if c.status == OK), key=rank_key(plan.objective))
    rest = [c for c in cands if c.status != OK]
    return dataclasses.replace(plan, candidates=usable + rest, network=network)


def calibrated(plan: Any, candidate: Any, step_s: float) -> Any:
    """``plan`` priced on its network plus the per-call overhead (``Network.overhead_s``)
    that makes ``candidate``'s predicted step equal ``step_s``, measured where it runs.

    Raises:
        ValueError: ``candidate`` is not one of the plan's priced ones, makes no
            collective, or ``step_s`` is not a positive number.
    """
    if isinstance(step_s, bool) or not isinstance(step_s, (int, float)) \
            or not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"Plan.calibrated: step_s must be a positive number of seconds, "
                         f"got {step_s!r}")
    mine = next((c for c in plan.candidates if c.mesh_shape == candidate.mesh_shape
                 and c.spec == candidate.spec and c.axis_names == candidate.axis_names
                 and c.prediction is not None and c.estimate is not None), None)
    if mine is None:
        raise ValueError(f"Plan.calibrated: {candidate!r} is not a priced candidate of "
                         f"this plan")
    net = plan.network

    def step(overhead: float) -> float:
        return _prediction(mine, plan, dataclasses.replace(net, overhead_s=overhead)).step_s

    lo, hi = net.overhead_s, net.overhead_s + step_s
    if step(lo) < step_s:  # the step grows with the overhead: bisect
        for _ in range(64):
            if step(hi) >= step_s:
                break
            hi *= 2
        else:
            raise ValueError(f"Plan.calibrated: {candidate!r} makes no collective whose "
                             f"overhead could explain its step; calibrate on one that does")
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    # else: measured no slower than predicted without any overhead: none is added
    where = f"{'x'.join(map(str, mine.mesh_shape))} {mine.spec}"
    cal = dataclasses.replace(
        net, overhead_s=lo, name=f"{net.name}, calibrated",
        source=f"{net.source}; overhead_s from {where}'s measured step of "
               f"{step_s * 1e3:.4g} ms")
    return priced(plan, cal)
