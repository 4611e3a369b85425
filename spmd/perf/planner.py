"""``plan``: choose the decomposition. Every mesh shape for a rank count and every way of
giving its axes to the example's splittable dims, each converted, run and priced with the
cost model (``estimate``, ``predict``), ranked by predicted step time, memory or bytes.

    plan = spmd.plan(model, x, ranks=8, network=spmd.perf.NETWORKS["ib_ndr"])
    print(plan)                        # every candidate, refused ones with their reason
    mesh, spec = plan.best.mesh(), plan.best.spec
    sharded = spmd.nn.convert(model, mesh, spec)
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..core._format import shape_str
from ..core.errors import CommError, SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P, entry_axes
from . import _measure
from . import model as cost_model
from .candidate import OK, OVER, REFUSED, Candidate, Plan
from .cost import estimate
from .network import Network
from .pricing import measured_step, modelled, rank_key

__all__ = ["plan", "factorizations"]

WHO = "plan"
OBJECTIVES = ("time", "memory", "bytes")


# -- candidates ---------------------------------------------------------------------------

def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """The ordered ways of writing ``n`` as a product of ``k`` factors >= 2 (``(n,)`` for
    ``k = 1``).

    Example:
        >>> factorizations(8, 2), factorizations(8, 3), factorizations(7, 2)
        ([(2, 4), (4, 2)], [(2, 2, 2)], [])
    """
    if k == 1:
        return [(n,)] if n >= 2 else []
    return [(f, *rest) for f in range(2, n + 1) if n % f == 0
            for rest in factorizations(n // f, k - 1)]


def _enumerate(shape: tuple[int, ...], ranks: int, dims: Sequence[int],
               max_axes: int) -> list[tuple[tuple[int, ...], tuple[str, ...], P]]:
    """Each set of up to ``max_axes`` dims, each ordered factorization of ``ranks`` over
    them: one mesh axis per split dim, named after it (``"d2"``)."""
    out = []
    for k in range(1, max_axes + 1):
        for ds in itertools.combinations(sorted(dims), k):
            for sizes in factorizations(ranks, k):
                names = tuple(f"d{d}" for d in ds)
                entries: list[Any] = [None] * (max(ds) + 1)
                for d, a in zip(ds, names):
                    entries[d] = a
                out.append((sizes, names, P(*entries)))
    return out


def _given(specs: Sequence[Any], ranks: int) -> list[tuple[tuple[int, ...], tuple[str, ...], P]]:
    """Candidates from the user's specs: a ``P`` (every ordered factorization of ``ranks``
    over its axes) or a ``(P, mesh_shape)`` pair."""
    out = []
    for s in specs:
        shape = None
        if isinstance(s, tuple) and not isinstance(s, P) and len(s) == 2 and isinstance(s[0], P):
            s, shape = s
        if not isinstance(s, P) or not s.axes:
            raise TypeError(f"{WHO}: specs must be P(...) naming at least one mesh axis, or "
                            f"(P(...), mesh_shape) pairs; got {s!r}")
        names = tuple(dict.fromkeys(s.axes))
        if shape is not None:
            shape = tuple(shape)
            if len(shape) != len(names) or math.prod(shape) != ranks:
                raise ValueError(f"{WHO}: mesh shape {shape} for {s} must give one size per "
                                 f"axis {names} with product {ranks}")
            out.append((shape, names, s))
        else:
            out += [(sizes, names, s) for sizes in factorizations(ranks, len(names))]
    return out


def _empty(shape: tuple[int, ...], sizes: tuple[int, ...], names: tuple[str, ...],
           spec: P) -> str | None:
    size = dict(zip(names, sizes))
    for d, n in enumerate(shape):
        k = math.prod(size[a] for a in entry_axes(spec.entry(d))) if d < len(spec) else 1
        if n < k:
            return f"empty shards: dim {d} of size {n} over {k} ranks"
    return None


# -- pricing --------------------------------------------------------------------------------

def _price(c: Candidate, mdl: torch.nn.Module, x: torch.Tensor, network: Network,
           measure_ranks: int, timings: dict, kw: dict, predict_kw: dict) -> None:
    """Fill in ``c``'s costs (or mark it refused); its shard's compute is in ``timings``."""
    inputs = _inputs(c, x)
    n = c.ranks
    how = timings[("compute", (c.local_shape,))][3]
    try:
        if n <= measure_ranks:
            mesh = Mesh(c.mesh_shape, c.axis_names, backend="threads")
            est = estimate(mdl, mesh, c.spec, x, timings=timings, **kw)
            pred = measured_step(est, network, **predict_kw)
    except (SpecError, RuntimeError) as e:
        _refused(c, e)
        return
    if n > measure_ranks:
        # Measured where predict measures: a mesh of min(size, 3) ranks per axis whose
        # every shard has the target's local shape (the middle rank: the interior
        # rank's halos), so that predict finds that run and does not repeat it.
        small = tuple(min(t, 3) for t in c.mesh_shape)
        grown = tuple(s * math.prod(dict(zip(c.axis_names, small))[a]
                                    for a in entry_axes(c.spec.entry(d)))
                      for d, s in enumerate(c.local_shape))
        try:
            est = estimate(mdl, Mesh(small, c.axis_names, backend="threads"), c.spec,
                           _measure.fit_to(x, grown), timings=timings, **kw)
            pred = est.predict(mesh_shape=c.mesh_shape, network=network,
                               shapes=[tuple(x.shape)], **predict_kw)
        except (ValueError, RuntimeError) as e:  # SpecError is a ValueError
            _refused(c, e, f"on the {'x'.join(map(str, small))} threads mesh whose shards "
                           f"have the target's local shape: ")
            return
    c.estimate, c.prediction = est, pred
    c.param_bytes = sum(est.grad_bytes.values())
    c.input_bytes = max(inputs.values())
    what = f"compute: {how}"
    c.compute = "timed" if how.startswith("timed") else "scaled"
    if n <= measure_ranks:
        c.measured_mesh = True
        c.bytes_per_rank = {r: f + b for r, (f, b) in est.bytes_per_rank.items()}
        c.comm_bytes = max(c.bytes_per_rank.values(), default=0)
        c.memory_per_rank = {r: inputs[r] + est.saved_bytes.get(r, 0)
                             + est.output_bytes.get(r, 0) + 2 * c.param_bytes for r in range(n)}
        c.memory_bytes = max(c.memory_per_rank.values())
        c.saved_bytes = max(est.saved_bytes.values(), default=0)
        c.output_bytes = max(est.output_bytes.values(), default=0)
        c.measured = ("bytes per rank: comm_stats of a step on a threads mesh of this shape",
                      "saved and output bytes: saved_tensors_hooks per rank on that mesh", what)
        c.modelled = modelled(c, network, pred)
    else:
        c.measured_mesh = False
        c.comm_bytes = pred.comm_bytes
        c.saved_bytes = max(est.saved_bytes.values(), default=0)
        c.output_bytes = max(est.output_bytes.values(), default=0)
        c.memory_bytes = c.input_bytes + pred.memory_bytes + 2 * c.param_bytes
        mesh = "x".join(map(str, small))
        c.measured = (f"bytes and memory: comm_stats and saved_tensors_hooks of the busiest "
                      f"rank of a {mesh} threads mesh whose shards have the target's local "
                      f"shape (Estimate.predict)", what)
        c.modelled = modelled(c, network, pred)


def _first_line(e: Exception) -> str:
    """The gist of a refusal: its first line, and its first item where that line only
    announces a list."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    s = lines[0]
    if s.endswith(":") and len(lines) > 1:
        s = f"{s.split(':')[0 if not s.startswith('rank') else 1].strip()}: {lines[1].lstrip('- ')}"
    return s if len(s) <= 200 else s[:197] + "..."


def _inputs(c: Candidate, x: torch.Tensor) -> dict[int, int]:
    """``{rank: bytes of its input shard}``; sets ``c.local_shape`` (the largest shard)."""
    lay = Layout(tuple(x.shape), c.spec, _measure._Shape(c.mesh_shape, c.axis_names))
    inputs = {r: math.prod(lay.local_shape(r)) * x.element_size() for r in range(c.ranks)}
    largest = max(inputs, key=lambda r: (inputs[r], -r))
    c.local_shape = tuple(lay.local_shape(largest))
    return inputs


def _is_refusal(e: Exception) -> bool:
    """A SpecError, or torch's own size check (a RuntimeError); a failing collective is
    a fault, not a refusal."""
    return isinstance(e, (SpecError, RuntimeError)) and not isinstance(e, CommError)


def _refused(c: Candidate, e: Exception, where: str = "") -> None:
    """Mark ``c`` refused by ``e`` (``_is_refusal``; anything else propagates)."""
    if not _is_refusal(e):
        raise e
    c.status, c.reason = REFUSED, where + _first_line(e)


def _timed(mdl: torch.nn.Module, x: torch.Tensor, c: Candidate, shape: tuple[int, ...],
           kw: dict) -> tuple:
    """(forward s, backward s, events, how) of ``mdl`` converted for ``c``'s spec on a mesh
    of one rank, with ``x`` cut to ``shape`` as its whole input."""
    setup = _measure.Setup(mdl, c.spec, c.spec, (x,), None, False, None, True, kw["seed"])
    # the fastest of the repeats: steadier than the median on a shared machine, and the
    # ranking compares candidates timed at different moments
    f, b, ev = _measure.time_compute(setup, c.axis_names, setup.args_of([shape]), None,
                                     kw["repeats"], kw["warmup"], stat="min")
    return f, b, ev, f"timed on a 1-rank mesh at {shape_str(shape)} (fastest of {kw['repeats']})"


def _time_shards(timings: dict, mdl: torch.nn.Module, x: torch.Tensor,
                 cands: list[Candidate], kw: dict) -> dict[tuple[int, ...], Exception]:
    """The compute of every candidate's largest shard, once per distinct shape, into
    ``timings`` (as estimate times it: a mesh of one rank, the shard as its whole
    input). A shard the model refuses as a whole input (a positional table or FNO
    modes sized for the global input) takes the time of the timed shard nearest in
    volume, scaled by the volume ratio (per-call costs included, as they are for the
    others: every shard of one rank count has about the same volume), or, if none
    was timed, the whole problem's scaled by the shard's share. Returns the shards left
    untimed (the model refuses even the whole problem under that spec) and why."""
    def timed(c: Candidate, shape: tuple[int, ...]) -> tuple:
        return _timed(mdl, x, c, shape, kw)

    refused: dict[tuple[int, ...], tuple[Candidate, Exception]] = {}
    for c in cands:
        key = ("compute", (c.local_shape,))
        if key in timings or c.local_shape in refused:
            continue
        try:
            timings[key] = timed(c, c.local_shape)
        except (SpecError, RuntimeError) as e:
            if not _is_refusal(e):
                raise
            refused[c.local_shape] = (c, e)
    done = [k[1][0] for k in timings if k[0] == "compute"]
    failed: dict[tuple[int, ...], Exception] = {}
    for shape, (c, e) in refused.items():
        vol = math.prod(shape)
        if done:
            ref = min(done, key=lambda s: (abs(math.log(math.prod(s) / vol)), s))
            what = f"the shard {shape_str(ref)}'s (timed)"
        else:
            ref = tuple(x.shape)
            whole = ("compute", (ref,))
            if whole not in timings:
                try:
                    timings[whole] = timed(c, ref)
                except (SpecError, RuntimeError) as e2:  # refused whatever the size
                    if not _is_refusal(e2):
                        raise
                    failed[shape] = e
                    continue
            what = "the whole problem's (timed on one rank)"
        k = vol / math.prod(ref)
        f, b = timings[("compute", (ref,))][:2]
        timings[("compute", (shape,))] = (f * k, b * k, None, (
            f"{what} x {k:.4g} (the volume ratio: the model refuses the shard "
            f"{shape_str(shape)} as a whole input: {_first_line(e)})"))
    return failed


def plan(model: torch.nn.Module, example: torch.Tensor, *, ranks: int, network: Network,
         memory_per_rank: int | None = None, dims: Sequence[int] | None = None,
         specs: Sequence[Any] | None = None, max_axes: int = 2, objective: str = "time",
         measure_ranks: int = 8, grad_sync: str = "end", compute_scale: float = 1.0,
         repeats: int = 3, warmup: int = 1, seed: int = 0) -> Plan:
    """Choose a decomposition of ``example`` for ``model`` on ``ranks`` ranks: every mesh
    shape and assignment of its axes to the splittable dims, each converted, run on a
    threads mesh and priced; the usable ones ranked by ``objective``.

    Candidates: for every set of up to ``max_axes`` of the splittable dims, every ordered
    factorization of ``ranks`` into that many sizes >= 2, one mesh axis per split dim
    named after it (``"d2"`` splits dim 2): for 8 ranks over dims 2 and 3,
    ``P(None, None, "d2")`` on (8,), ``P(None, None, None, "d3")`` on (8,), and
    ``P(None, None, "d2", "d3")`` on (2, 4) and (4, 2). The splittable dims are ``dims``,
    by default every dim from 2 on whose size is above 1 (the layout ``(N, C, spatial...)``:
    batch and channels are not a sample's domain; pass ``dims=(1,)`` for a sequence
    ``(N, S, E)``), or the axes of ``specs``. Discarded, kept in the table with the reason:
    a split leaving some rank an empty shard, a ``SpecError`` from convert or shard_map
    ("refused"), memory above ``memory_per_rank`` ("over budget").

    Each candidate is priced with ``spmd.perf.estimate``. Up to ``measure_ranks`` ranks,
    on a threads mesh of its very shape: the bytes each rank sends (comm_stats) and keeps
    (saved_tensors_hooks) are measured, and the step time is the cost model on those
    collectives (``Estimate.predict``'s model: latency and bandwidth of ``network``,
    overlap as on a 1-rank run, the gradient all-reduce modelled: threads share the
    weights). Above it (64 ranks), on a mesh of ``min(size, 3)`` ranks per axis whose
    every shard has the target's local shape (its middle rank has the interior rank's
    halos), carried to the target by ``Estimate.predict``. Compute is timed once per
    distinct local shape (a mesh of one rank, the shard as its whole input), shared by
    every candidate with that shard; where the model refuses the shard as a whole input
    (a positional table or FNO modes sized for the global input), the timed shard
    nearest in volume (or the whole problem) scaled by the volume ratio stands in
    (``Candidate.compute``).

    Memory per rank = the input shard + what autograd saves for backward + the outputs +
    the trainable parameters twice (weights and gradients); no optimizer state.

    Args:
        model: a plain ``nn.Module`` (convert is applied per candidate).
        example: the global input (one tensor; ``requires_grad`` is not needed).
        ranks: how many ranks (>= 2).
        network: a ``Network`` (``spmd.perf.NETWORKS[...]``, ``fit_network()``).
        memory_per_rank: bytes a rank may hold (None: no limit).
        dims: the dims that may be split (default: see above).
        specs: candidate specs instead of ``dims``: each a ``P`` (every factorization of
            ``ranks`` over its axes) or a ``(P, mesh_shape)`` pair.
        max_axes: at most this many mesh axes (1, 2 or 3).
        objective: ``"time"`` (predicted step), ``"memory"`` or ``"bytes"`` (sent per rank).
        measure_ranks: candidates of up to this many ranks are run at their own shape.
        grad_sync, compute_scale: as for ``Estimate.predict``.
        repeats, warmup, seed: as for ``estimate`` (compute: the fastest of the repeats,
            steadier on a shared machine than their median).

    Returns:
        A ``Plan``: ``print(plan)``, ``plan.best.spec``, ``plan.best.mesh()``,
        ``plan.plot()``.

    Raises:
        ValueError: bad ``ranks``, ``objective``, ``dims`` or ``max_axes``; no splittable
            dim; every usable candidate over ``memory_per_rank`` (naming the one with the
            least memory).
        SpecError: every candidate refused (naming each reason).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU())
        >>> p = spmd.plan(net, torch.randn(1, 1, 16, 8), ranks=4, objective="memory",
        ...               network=spmd.perf.NETWORKS["ib_ndr"], repeats=1, warmup=0)
        >>> [(c.mesh_shape, c.spec) for c in p.candidates][:1]
        [((2, 2), P(None, None, 'd2', 'd3'))]
        >>> mesh = p.best.mesh()   # threads by default here: Mesh(d2=2, d3=2)
        >>> sharded = spmd.nn.convert(net, mesh, p.best.spec)
    """
    t0 = time.perf_counter()
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"{WHO}: ranks must be an int >= 2 (one rank has nothing to split), "
                         f"got {ranks!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{WHO}: model must be an nn.Module, got {type(model).__name__}")
    why = _measure.bound(model)
    if why is not None:
        raise SpecError(f"{WHO}: the model is tied to one mesh ({why}); plan converts it for "
                        f"every candidate mesh: pass the plain model")
    if grad_sync not in cost_model.GRAD_SYNCS:
        raise ValueError(f"{WHO}: grad_sync must be one of {cost_model.GRAD_SYNCS}, got "
                         f"{grad_sync!r}")
    for arg, v, lo in (("measure_ranks", measure_ranks, 1), ("repeats", repeats, 1),
                       ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{WHO}: {arg} must be an int >= {lo}, got {v!r}")
    if isinstance(compute_scale, bool) or not isinstance(compute_scale, (int, float)) \
            or not compute_scale > 0:
        raise ValueError(f"{WHO}: compute_scale must be a positive number, got "
                         f"{compute_scale!r}")
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"{WHO}: example must be the global input tensor, got "
                        f"{type(example).__name__}")
    if not isinstance(network, Network):
        raise TypeError(f"{WHO}: network must be a spmd.perf.Network (e.g. "
                        f"spmd.perf.NETWORKS['ib_ndr']), got {type(network).__name__}")
    if objective not in OBJECTIVES:
        raise ValueError(f"{WHO}: objective must be one of {OBJECTIVES}, got {objective!r}")
    if max_axes not in (1, 2, 3):
        raise ValueError(f"{WHO}: max_axes must be 1, 2 or 3, got {max_axes!r}")
    if memory_per_rank is not None and (isinstance(memory_per_rank, bool) or not isinstance(
            memory_per_rank, int) or memory_per_rank < 1):
        raise ValueError(f"{WHO}: memory_per_rank must be a positive int (bytes), got "
                         f"{memory_per_rank!r}")
    shape = tuple(example.shape)
    if specs is not None:
        if dims is not None:
            raise ValueError(f"{WHO}: give dims or specs, not both")
        found = _given(specs, ranks)
    else:
        if dims is None:
            dims = [d for d in range(2, len(shape)) if shape[d] > 1]
            rule = "dims from 2 on (N, C, spatial...) of size > 1"
        else:
            dims = sorted({int(d) % len(shape) if -len(shape) <= int(d) < len(shape) else
                           _bad_dim(d, shape) for d in dims})
            rule = f"dims={tuple(dims)}"
        if not dims:
            raise ValueError(f"{WHO}: no dim of the example {shape_str(shape, example.dtype)} "
                             f"can be split "
                             f"({rule}); pass dims=(...) naming the domain's dims, e.g. "
                             f"dims=(1,) for a sequence (N, S, E)")
        found = _enumerate(shape, ranks, dims, min(max_axes, len(dims)))
    kw = dict(repeats=repeats, warmup=warmup, seed=seed)
    predict_kw = dict(grad_sync=grad_sync, compute_scale=compute_scale)
    timings: dict = {}
    candidates = [Candidate(sizes, names, spec) for sizes, names, spec in found]
    for c in candidates:
        _inputs(c, example)
        why = _empty(shape, c.mesh_shape, c.axis_names, c.spec)
        if why is not None:
            c.status, c.reason = REFUSED, why
    usable = [c for c in candidates if c.status == OK]
    untimed = _time_shards(timings, model, example, usable, kw)
    whole = ("compute", (shape,))
    for c in usable if ranks <= measure_ranks else ():  # the efficiency's one-device time
        if whole in timings or c.local_shape in untimed:
            continue
        try:
            timings[whole] = _timed(model, example, c, shape, kw)
        except (SpecError, RuntimeError) as e:  # that spec is refused: try the next one
            if not _is_refusal(e):
                raise
    for c in candidates:
        if c.status == OK and c.local_shape in untimed:
            _refused(c, untimed[c.local_shape])
        elif c.status == OK:
            _price(c, model, example, network, measure_ranks, timings, kw, predict_kw)
    for c in candidates:
        if (c.status == OK and memory_per_rank is not None
                and c.memory_bytes > memory_per_rank):
            c.status = OVER
            c.reason = f"{c.memory_bytes:,} B > {memory_per_rank:,} B"
    usable = [c for c in candidates if c.status == OK]
    over = sorted((c for c in candidates if c.status == OVER), key=rank_key("memory"))
    refused = [c for c in candidates if c.status == REFUSED]
    if not usable and over:
        low = over[0]
        raise ValueError(
            f"{WHO}: every candidate needs more than memory_per_rank={memory_per_rank:,} B; "
            f"the least is {low.memory_bytes:,} B per rank for "
            f"{'x'.join(map(str, low.mesh_shape))} {low.spec}: raise the budget or the ranks")
    if not usable:
        reasons = "\n".join(f"  - {'x'.join(map(str, c.mesh_shape))} {c.spec}: {c.reason}"
                            for c in refused)
        raise SpecError(f"{WHO}: no decomposition of {shape_str(shape)} over {ranks} ranks "
                        f"works for this model:\n{reasons}")
    usable.sort(key=rank_key(objective))
    shapes = tuple(k[1][0] for k, v in timings.items()
                   if k[0] == "compute" and (len(v) < 4 or v[3].startswith("timed")))
    return Plan(usable + over + refused, objective, ranks, network, memory_per_rank, shape,
                shapes, time.perf_counter() - t0, grad_sync, compute_scale)


def _bad_dim(d: Any, shape: tuple[int, ...]) -> int:
    raise ValueError(f"{WHO}: dims must be dims of the example {shape_str(shape)}, got {d!r}")
