"""Predictions: an ``Estimate`` carried to a larger mesh with a ``Network``.

The model, kept simple so that every number can be checked by hand:

    step  = forward + backward                  one rank's shard, timed here
          + the busiest rank's collectives, each latency + bytes / bandwidth, less
            what hides behind its compute (a halo on its way while a conv's interior runs)
          + the gradient all-reduce not hidden behind backward

- Compute is measured at the target's local shape on a mesh of one rank (a rank with
  neighbours does the same work on the same shape: the halo only adds rows), or, past
  ``max_elements``, scaled by volume from the largest shape measured: linear work.
- The collectives are those of a threads mesh with ``min(size, 3)`` ranks per axis,
  every shard of the target's local shape: its middle rank has a neighbour on both
  sides, so its halo bytes are exactly the target's interior rank's. Group sizes are
  the target's. Past ``max_elements``, measured at a smaller shape and scaled: halo
  exchanges (all-to-all, permute) by face area (the local volume over the split dims'
  sizes), all-gathers and reduce-scatters by volume, reductions and broadcasts not.
- Overlap: a collective hides behind the compute that runs between its start and its
  wait on a rank (a halo exchange behind a convolution's interior), as measured on the
  one-rank mesh (``_measure.Event``: where each collective starts and is waited for, as
  fractions of its pass), scaled with the compute. A rank's transfers go one after the
  other in the order started; a wait stalls the rank until its transfer is done. A
  blocking collective hides nothing. A collective the one-rank run does not have (by
  name, kind, pass and ordinal) is not hidden.
- Gradient sync: see ``Estimate.predict``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core._format import shape_str
from ..core.spec import entry_axes
from ..parallel.buckets import MiB, assign
from . import _measure
from .network import Network, collective_time

if TYPE_CHECKING:
    from .cost import Estimate

__all__ = ["Prediction", "predict", "format_predictions", "mesh_shape_for"]

SCALINGS = ("strong", "weak")
GRAD_SYNCS = ("end", "overlap", "none")
_CHECK_BYTES = 4 * 8  # shard_map's per-rank check before the gradient all-reduce: 4 int64


@dataclass(frozen=True, repr=False)
class Prediction:
    """A predicted step on a target mesh (``Estimate.predict`` makes it).

    Attributes:
        ranks, mesh_shape, scaling, network: the target and the network's name.
        global_shapes, local_shapes: the tensor arguments, whole and on the largest rank.
        forward_s, backward_s: compute of one rank's shard.
        comm_s: the busiest rank's collectives (halos, reductions) not hidden behind
            its compute.
        grad_sync_s: the part of the gradient all-reduce not hidden behind backward.
        step_s: the sum of the above.
        serial_s: strong: the whole problem's compute on one device; weak: one rank's.
        efficiency: ``serial_s / (ranks x step_s)`` (strong), ``serial_s / step_s`` (weak).
        comm_bytes: bytes the busiest rank sends per step (gradient sync apart).
        grad_bytes: the gradients all-reduced per step.
        memory_bytes: the busiest rank's saved-for-backward plus output bytes.
        notes: what was measured and what was scaled.
        hidden_s: the busiest rank's collective time hidden behind its compute.

    Example:
        >>> p = Prediction(8, (8,), "strong", "toy", ((64,),), ((8,),), 1e-3, 2e-3, 1e-3,
        ...                0.0, 4e-3, 24e-3, 0.75, 64, 0, 0, ())
        >>> p
        Prediction(8 ranks (8), strong, toy: step 4 ms = compute 3 ms + comm 1 ms + grad sync 0 ms; efficiency 75.0%)
    """

    ranks: int
    mesh_shape: tuple[int, ...]
    scaling: str
    network: str
    global_shapes: tuple[tuple[int, ...], ...]
    local_shapes: tuple[tuple[int, ...], ...]
    forward_s: float
    backward_s: float
    comm_s: float
    grad_sync_s: float
    step_s: float
    serial_s: float
    efficiency: float
    comm_bytes: int
    grad_bytes: int
    memory_bytes: int
    notes: tuple[str, ...]
    hidden_s: float = 0.0

    @property
    def compute_s(self) -> float:
        """``forward_s + backward_s``."""
        return self.forward_s + self.backward_s

    def __repr__(self) -> str:
        return (f"Prediction({self.ranks} ranks ({'x'.join(map(str, self.mesh_shape))}), "
                f"{self.scaling}, {self.network}: step {_ms(self.step_s)} = compute "
                f"{_ms(self.compute_s)} + comm {_ms(self.comm_s)}"
                f"{f' ({_ms(self.hidden_s)} more hidden)' if self.hidden_s else ''} + grad sync "
                f"{_ms(self.grad_sync_s)}; efficiency {100 * self.efficiency:.1f}%)")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def format_predictions(preds: Sequence[Prediction]) -> str:
    """A markdown table of predictions, one row each.

    Example:
        >>> p = Prediction(8, (8,), "strong", "toy", ((64,),), ((8,),), 1e-3, 2e-3, 1e-3,
        ...                0.0, 4e-3, 24e-3, 0.75, 64, 0, 0, ())
        >>> print(format_predictions([p]).splitlines()[2])
        | 8 | 8 | [8] | 3 | 1 | 0 | 0 | 4 | 75.0 | 64 | 0 |
    """
    head = ("| ranks | mesh | local | compute ms | comm ms | comm hidden ms | grad sync ms | "
            "step ms | efficiency % | comm B/step | activations MiB |")
    rows = [head, "|" + "---:|" * 11]
    for p in preds:
        local = ", ".join(shape_str(s) for s in p.local_shapes)
        rows.append(f"| {p.ranks} | {'x'.join(map(str, p.mesh_shape))} | {local} | "
                    f"{p.compute_s * 1e3:.4g} | {p.comm_s * 1e3:.4g} | {p.hidden_s * 1e3:.4g} | "
                    f"{p.grad_sync_s * 1e3:.4g} | "
                    f"{p.step_s * 1e3:.4g} | {100 * p.efficiency:.1f} | {p.comm_bytes:,} | "
                    f"{p.memory_bytes / MiB:.4g} |")
    return "\n".join(rows)


def mesh_shape_for(ranks: int, base: Sequence[int]) -> tuple[int, ...]:
    """``ranks`` spread over the axes of size > 1 in ``base`` (all axes if none): prime
    factors, largest first, each to the axis with the fewest ranks so far.

    Example:
        >>> mesh_shape_for(64, (2, 2)), mesh_shape_for(8, (1, 4)), mesh_shape_for(12, (2, 2))
        ((8, 8), (1, 8), (3, 4))
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"predict: ranks must be a positive int, got {ranks!r}")
    use = [i for i, s in enumerate(base) if s > 1] or list(range(len(base)))
    shape = [1] * len(base)
    factors, n, f = [], ranks, 2
    while n > 1:
        while n % f == 0:
            factors.append(f)
            n //= f
        f += 1
    for f in sorted(factors, reverse=True):
        i = min(use, key=lambda i: (shape[i], i))
        shape[i] *= f
    return tuple(shape)


def _grow(setup: _measure.Setup, local: Sequence[Sequence[int]], mesh_shape: Sequence[int],
          names: Sequence[str]) -> list[tuple[int, ...]]:
    """Global shapes whose every shard on ``mesh_shape`` is ``local``."""
    size = dict(zip(names, mesh_shape))
    out = []
    for shp, i in zip(local, setup.tensor_idx):
        spec = setup.leaf_specs[i]
        g = list(shp)
        for d in range(len(g)):
            if spec is not None and d < len(spec):
                for a in entry_axes(spec.entry(d)):
                    g[d] *= size[a]
        out.append(tuple(g))
    return out


def _shapes(given: Any, default: Sequence[tuple[int, ...]], what: str) -> list[tuple[int, ...]]:
    if given is None:
        return [tuple(s) for s in default]
    if isinstance(given, torch.Size) or (isinstance(given, (tuple, list)) and given
                                         and all(isinstance(v, int) for v in given)):
        given = [given]
    given = [tuple(int(v) for v in s) for s in given]
    if len(given) != len(default) or any(len(g) != len(d) for g, d in zip(given, default)):
        raise ValueError(f"predict: shapes must give the {what} shape of each tensor argument "
                         f"({', '.join(shape_str(d) for d in default)}), got "
                         f"{', '.join(shape_str(g) for g in given)}")
    return given


def _compute(est: Estimate, shapes: list[tuple[int, ...]], limit: int,
             split: list[bool]) -> tuple[float, float, str, tuple | None]:
    """(forward, backward, how they were got, where the collectives lie in them)."""
    vol = _measure.volume(shapes, split)
    where = ", ".join(shape_str(s) for s in shapes)
    if vol <= limit:
        f, b = est._time(shapes)
        return f, b, f"compute measured at {where}", est._events(shapes)
    ref = _measure.shrink(shapes, limit, split)
    f, b = est._time(ref)
    k = vol / _measure.volume(ref, split)
    return (f * k, b * k, f"compute at {where} scaled by volume (x{k:.4g}) from "
            f"{', '.join(shape_str(s) for s in ref)} (measured): work assumed linear in volume",
            est._events(ref))


def exposed(times: Sequence[float], events: Sequence[_measure.Event | None], forward_s: float,
            backward_s: float, overlap: float = 1.0) -> float:
    """Seconds a rank stalls in its collectives: ``times[j]`` each takes, ``events[j]``
    where it starts and is waited for in the compute (None: blocking, at no known place:
    all of it exposed). Transfers go one after the other in the order started. Only
    the part ``overlap`` of each (``Network.overlap``) can go on behind compute; the rest
    is the rank's own work and adds to the step.

    Example:
        >>> from spmd.perf._measure import Event
        >>> halo = Event("conv2d", "all_to_all", "forward", 0, 0.0, 0.5)  # waited mid-forward
        >>> exposed([0.3], [halo], 1.0, 1.0), exposed([0.8], [halo], 1.0, 1.0)
        (0.0, 0.30000000000000004)
    """
    if overlap < 1:
        own = (1.0 - overlap) * sum(times)
        return own + exposed([overlap * t for t in times], events, forward_s, backward_s)
    stall, free = 0.0, 0.0
    marks = []  # (compute seconds, 0 start / 1 wait, j)
    for j, e in enumerate(events):
        if e is None:
            stall += times[j]
            continue
        off, span = (0.0, forward_s) if e.pass_ == "forward" else (forward_s, backward_s)
        marks += [(off + e.start * span, 0, j), (off + e.wait * span, 1, j)]
    done = {}
    for at, what, j in sorted(marks):
        now = at + stall
        if what == 0:
            free = done[j] = max(now, free) + times[j]
        elif done[j] > now:
            stall += done[j] - now
    return stall


def _comm(est: Estimate, local: list[tuple[int, ...]], target: tuple[int, ...], network: Network,
          limit: int, split: list[bool], events: tuple | None, forward_s: float,
          backward_s: float) -> tuple[float, float, int, int, str]:
    """(exposed seconds, hidden seconds, bytes sent, activation bytes) of the busiest
    rank (the one that stalls longest), and how they were got."""
    setup, names = est._setup, est.axis_names
    small = tuple(min(t, 3) for t in target)
    ref = local
    if _measure.volume(_grow(setup, local, small, names), split) > limit:
        ref = _measure.shrink(local, max(limit // math.prod(small), 1), split)
    run = est._run(small, _grow(setup, ref, small, names))
    size = dict(zip(names, target))
    scaled = ref != local
    where = {e.key: e for e in events or ()}
    best = (-1.0, 0.0, 0)
    unmatched = 0
    for cs in run.comm.values():
        times, evs, nbytes = [], [], 0
        for c, k in zip(cs, _measure.ordinals([(c.name, c.kind, c.pass_) for c in cs])):
            evs.append(where.get((c.name, c.kind, c.pass_, k)))
            if scaled:
                c = _scale(c, setup, local, ref, split)
            times.append(c.time(network, math.prod(size[a] for a in c.axes)))
            nbytes += c.nbytes
        t = exposed(times, evs, forward_s, backward_s, network.overlap)
        if (t, nbytes) > (best[0], best[2]):
            best = (t, sum(times) - t, nbytes)
            unmatched = sum(e is None for e in evs)
    t, hidden, nbytes = best
    mem = max((run.saved.get(r, 0) + run.outputs.get(r, 0) for r in run.comm), default=0)
    mesh = "x".join(map(str, small))
    if events is None:
        how = "nothing hidden: the one-rank run's collectives differed from step to step"
    elif unmatched:
        how = f"overlap as on the one-rank run; {unmatched} collective(s) it lacks not hidden"
    else:
        how = "overlap as on the one-rank run"
    if network.overlap < 1 and events is not None:
        how += f", at most {network.overlap:.0%} of each collective hidden (the network's)"
    if not scaled:
        return (t, hidden, nbytes, mem,
                f"collectives measured on a {mesh} threads mesh at the local shape; {how}")
    k = _measure.volume(local, split) / _measure.volume(ref, split)
    return (t, hidden, nbytes, int(mem * k),
            f"collectives measured on a {mesh} threads mesh at local "
            f"{', '.join(shape_str(s) for s in ref)}, halo bytes scaled by face area, memory "
            f"by volume; {how}")


def _scale(c: _measure.Collective, setup: _measure.Setup, local: list, ref: list,
           split: list[bool]) -> _measure.Collective:
    """``c`` measured at local shapes ``ref``, scaled to ``local``: halos by face area,
    gathers by volume, reductions not."""
    if c.kind in ("all_reduce", "all_reduce_async", "broadcast", "barrier"):
        return c
    best, k = -1, 1.0
    for j, (loc, r, sp) in enumerate(zip(local, ref, split)):
        spec = setup.leaf_specs[setup.tensor_idx[j]]
        if not sp or not any(a in spec.axes for a in c.axes):
            continue
        vol = math.prod(r)
        if vol <= best:
            continue
        ratio = 1.0
        for d, (a_, b_) in enumerate(zip(loc, r)):
            axes = entry_axes(spec.entry(d)) if d < len(spec) else ()
            if c.kind in ("all_to_all", "permute") and any(a in axes for a in c.axes):
                continue  # the face: the split dim's own size does not count
            ratio *= a_ / max(b_, 1)
        best, k = vol, ratio
    return dataclasses.replace(c, payload=round(c.payload * k), nbytes=round(c.nbytes * k))


def _grad_sync(est: Estimate, ranks: int, network: Network, how: str,
               backward_s: float) -> tuple[float, int, str]:
    total = sum(est.grad_bytes.values())
    if how == "none" or ranks == 1 or not total:
        why = "no gradient sync" + (" (no parameters)" if not total else "")
        return 0.0, 0 if how == "none" else total, why
    if how == "end":
        t = sum(collective_time(network, "all_reduce", ranks, payload=b)
                for b in est.grad_bytes.values())
        t += collective_time(network, "all_gather", ranks, payload=_CHECK_BYTES)
        return t, total, "gradient all-reduce after backward, not hidden (shard_map)"
    metas = [torch.empty(shape, dtype=dt, device="meta") for shape, dt in est._params]
    plan = assign(list(reversed(range(len(metas)))), metas, 25 * MiB, 1 * MiB)
    # each bucket: its gradients, a used flag per parameter and one alarm element
    ts = [collective_time(network, "all_reduce", ranks, payload=sum(
        (metas[i].numel() + 1) * metas[i].element_size() for i in b)
        + metas[b[0]].element_size()) for b in plan]
    # Every bucket but the last starts while backward still runs: hidden up to its
    # length, as far as the network lets a transfer go on behind compute.
    ov, early = network.overlap, sum(ts[:-1])
    exposed = ts[-1] + (1.0 - ov) * early + max(ov * early - backward_s, 0.0)
    return exposed, total, (f"GradSync: {len(plan)} bucket(s) overlapped with backward, "
                            f"the last one exposed")


def predict(est: Estimate, ranks: int | None, *, network: Network, scaling: str = "strong",
            mesh_shape: Sequence[int] | None = None, shapes: Any = None,
            grad_sync: str = "end", compute_scale: float = 1.0,
            max_elements: int = 1 << 22) -> Prediction:
    """``Estimate.predict``'s work (see there and this module's docstring).

    Example:
        >>> from spmd.perf import NETWORKS, estimate, predict
        >>> est = estimate(torch.nn.Conv1d(1, 1, 3, padding=1), Mesh((2,), ("sp",)),
        ...                P(None, None, "sp"), torch.randn(1, 1, 64), repeats=1, warmup=0)
        >>> predict(est, 8, network=NETWORKS["ib_ndr"], scaling="weak").global_shapes
        ((1, 1, 256),)
    """
    if not isinstance(network, Network):
        raise TypeError(f"predict: network must be a spmd.perf.Network (e.g. "
                        f"spmd.perf.NETWORKS['ib_ndr'] or fit_network()), got "
                        f"{type(network).__name__}")
    if scaling not in SCALINGS:
        raise ValueError(f"predict: scaling must be one of {SCALINGS}, got {scaling!r}")
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"predict: grad_sync must be one of {GRAD_SYNCS}, got {grad_sync!r}")
    if isinstance(compute_scale, bool) or not isinstance(compute_scale, (int, float)) \
            or not compute_scale > 0:
        raise ValueError(f"predict: compute_scale must be a positive number, got {compute_scale!r}")
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ValueError(f"predict: max_elements must be a positive int, got {max_elements!r}")
    names = est.axis_names
    if mesh_shape is not None:
        target = tuple(mesh_shape)
        if len(target) != len(names) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in target):
            raise ValueError(f"predict: mesh_shape must give a positive int for each of the "
                             f"axes {names}, got {mesh_shape!r}")
        if ranks is not None and math.prod(target) != ranks:
            raise ValueError(f"predict: mesh_shape {target} has {math.prod(target)} ranks, "
                             f"not {ranks}")
    elif ranks is None:
        target = est.mesh_shape
    else:
        target = mesh_shape_for(ranks, est.mesh_shape)
    n = math.prod(target)
    setup = est._setup
    split = [setup.split(k) for k in range(len(setup.tensor_idx))]
    if scaling == "strong":
        glob = _shapes(shapes, setup.shapes(), "global")
    else:
        glob = _grow(setup, _shapes(shapes, est.local_shapes, "local"), target, names)
    lays = setup.layouts(glob, target, names)
    local = [lay.local_shape(0) for lay in lays]  # balanced: the first shard is the largest
    for lay, sp in zip(lays, split):
        empty = [d for d in lay.split_dims if min(lay.sizes[d]) == 0]
        if sp and empty:
            raise ValueError(f"predict: on a {'x'.join(map(str, target))} mesh, "
                             f"{shape_str(lay.shape)} leaves some ranks an empty shard (dim "
                             f"{empty[0]} over {lay.axis_size(lay.dim_axes(empty[0]))} ranks); "
                             f"use fewer ranks or a larger problem")
    f, b, how_c, events = _compute(est, local, max_elements, split)
    f, b = f / compute_scale, b / compute_scale
    comm_s, hidden_s, comm_bytes, mem, how_m = _comm(est, local, target, network, max_elements,
                                                     split, events, f, b)
    gs, gbytes, how_g = _grad_sync(est, n, network, grad_sync, b)
    step_s = f + b + comm_s + gs
    if scaling == "strong":
        vol_g = _measure.volume(glob, split)
        if vol_g <= max_elements:
            sf, sb, how_s, _ = _compute(est, glob, max_elements, split)
            serial = (sf + sb) / compute_scale
            how_s = "one device: " + how_s
        else:  # the local compute, scaled: the same rate, so efficiency stays <= 100%
            k = vol_g / max(_measure.volume(local, split), 1)
            serial = (f + b) * k
            how_s = (f"one device: the local compute x {k:.4g} (the volume ratio: work "
                     f"assumed linear in volume)")
        eff = serial / (n * step_s) if step_s > 0 else 1.0
    else:
        serial, how_s = f + b, "one device: the local compute"
        eff = serial / step_s if step_s > 0 else 1.0
    notes = [how_c, how_m, how_g, how_s]
    if compute_scale != 1:
        notes.append(f"compute divided by {compute_scale:g}")
    return Prediction(n, target, scaling, network.name, tuple(glob), tuple(local), f, b, comm_s,
                      gs, step_s, serial, eff, comm_bytes, gbytes, mem, tuple(notes), hidden_s)
