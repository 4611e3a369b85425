"""A plan priced again on another network, and a network's per-call overhead calibrated
from one candidate's measured step.

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
from typing import TYPE_CHECKING

from .network import Network

if TYPE_CHECKING:  # pragma: no cover
    from .candidate import Candidate, Plan

__all__ = ["priced", "calibrated"]


def _prediction(c: Candidate, plan: Plan, network: Network):
    from .planner import _measured_step
    kw = dict(grad_sync=plan.grad_sync, compute_scale=plan.compute_scale)
    if c.measured_mesh:
        return _measured_step(c.estimate, network, **kw)
    return c.estimate.predict(mesh_shape=c.mesh_shape, network=network,
                              shapes=[plan.global_shape], **kw)


def priced(plan: Plan, network: Network) -> Plan:
    """``plan`` with every usable or over-budget candidate's step priced on ``network``
    (bytes and memory do not depend on it), ranked again."""
    from .planner import _rank_key
    if not isinstance(network, Network):
        raise TypeError(f"Plan.priced: network must be a spmd.perf.Network, got "
                        f"{type(network).__name__}")
    cands = []
    for c in plan.candidates:
        if c.prediction is not None and c.estimate is not None:
            c = dataclasses.replace(c, prediction=_prediction(c, plan, network))
        cands.append(c)
    usable = sorted((c for c in cands if c.status == "ok"), key=_rank_key(plan.objective))
    rest = [c for c in cands if c.status != "ok"]
    return dataclasses.replace(plan, candidates=usable + rest, network=network)


def calibrated(plan: Plan, candidate: Candidate, step_s: float) -> Plan:
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
