"""``estimate``: what one step of a domain-parallel body costs per rank, measured here:
its collectives (calls, kinds, bytes), the bytes autograd saves for backward, the
gradients replicated parameters must all-reduce, and the compute time of one rank's
shard; ``Estimate.predict`` carries it to meshes of thousands of ranks."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import _context
from ..core._format import dtype_str, shape_str
from ..core.errors import SpecError
from ..core.mesh import Mesh, check_mesh
from ..core.spec import P
from . import _measure, model
from ._measure import WHO, Collective, Setup

__all__ = ["estimate", "Estimate"]


@dataclass(repr=False)
class Estimate:
    """One step of a body on a mesh, measured: ``spmd.perf.estimate`` makes it.

    Attributes:
        mesh_shape, axis_names: the mesh it was measured on (threads).
        backward: whether the step ran backward.
        global_shapes: the tensor arguments' shapes.
        local_shapes: the tensor arguments' shapes on ``largest_rank``, the rank with
            the largest shard (the one whose compute was timed).
        comm: per rank, its collectives in call order (one steady-state step: after a
            warm-up step that learns the layouts).
        saved_bytes: per rank, the bytes autograd saved for backward (distinct
            storages, without the parameters and the rank's inputs).
        output_bytes: per rank, the body's outputs.
        grad_bytes: ``{dtype: bytes}`` of the replicated parameters' gradients, which a
            run on processes all-reduces over every mesh axis (on threads the ranks
            share the parameters: nothing to reduce, so it is modelled, not measured).
        forward_s, backward_s: compute seconds of ``largest_rank``'s shard on a mesh of
            one rank on this machine (medians).

    Example:
        >>> mesh = Mesh((2,), ("sp",))
        >>> net = torch.nn.Conv1d(1, 1, 3, padding=1)
        >>> est = spmd.perf.estimate(net, mesh, P(None, None, "sp"), torch.randn(1, 1, 64),
        ...                          repeats=1, warmup=0)
        >>> est.bytes_per_rank   # one halo element each way, forward and backward
        {0: (4, 4), 1: (4, 4)}
        >>> est.grad_bytes
        {torch.float32: 16}
    """

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    backward: bool
    global_shapes: tuple[tuple[int, ...], ...]
    local_shapes: tuple[tuple[int, ...], ...]
    largest_rank: int
    comm: dict[int, tuple[Collective, ...]]
    saved_bytes: dict[int, int]
    output_bytes: dict[int, int]
    grad_bytes: dict[torch.dtype, int]
    forward_s: float
    backward_s: float
    _setup: Setup = field(repr=False, compare=False)
    _device: torch.device | None = field(repr=False, compare=False, default=None)
    _params: list[tuple[torch.Size, torch.dtype]] = field(repr=False, compare=False,
                                                          default_factory=list)
    _repeats: int = field(repr=False, compare=False, default=5)
    _warmup: int = field(repr=False, compare=False, default=2)
    _cache: dict = field(repr=False, compare=False, default_factory=dict)
    _timings: dict | None = field(repr=False, compare=False, default=None)

    # -- summaries ---------------------------------------------------------------------------

    @property
    def bytes_per_rank(self) -> dict[int, tuple[int, int]]:
        """``{rank: (forward bytes, backward bytes)}`` sent per step (no gradient sync)."""
        return {r: (sum(c.nbytes for c in cs if c.pass_ == "forward"),
                    sum(c.nbytes for c in cs if c.pass_ == "backward"))
                for r, cs in self.comm.items()}

    @property
    def calls_per_rank(self) -> dict[int, int]:
        """``{rank: collective calls per step}``."""
        return {r: len(cs) for r, cs in self.comm.items()}

    @property
    def peak_activation_bytes(self) -> int:
        """The largest, over ranks, of saved-for-backward plus output bytes."""
        return max((self.saved_bytes.get(r, 0) + self.output_bytes.get(r, 0)
                    for r in self.comm), default=0)

    @property
    def compute_s(self) -> float:
        """``forward_s + backward_s``."""
        return self.forward_s + self.backward_s

    def by_collective(self, rank: int | None = None) -> dict[tuple[str, str, tuple[str, ...], str],
                                                             tuple[int, int]]:
        """``{(name, kind, axes, pass): (calls, bytes)}`` of one rank (default: summed over
        ranks)."""
        out: dict = defaultdict(lambda: (0, 0))
        for r, cs in self.comm.items():
            if rank is not None and r != rank:
                continue
            for c in cs:
                k = (c.name, c.kind, c.axes, c.pass_)
                n, b = out[k]
                out[k] = (n + 1, b + c.nbytes)
        return dict(out)

    def comm_time(self, network: Any) -> float:
        """Seconds the busiest rank spends in this step's collectives on ``network``
        (the measured mesh; no gradient sync)."""
        return max((sum(c.time(network) for c in cs) for cs in self.comm.values()), default=0.0)

    def table(self) -> str:
        """A readable report: compute, collectives of the busiest rank, gradients, memory."""
        busiest = max(self.comm, key=lambda r: (sum(c.nbytes for c in self.comm[r]), -r))
        mesh = ", ".join(f"{a}={s}" for a, s in zip(self.axis_names, self.mesh_shape))
        shapes = ", ".join(shape_str(s) for s in self.local_shapes)
        lines = [
            f"Estimate on Mesh({mesh}) (threads), {'forward + backward' if self.backward else 'forward'}",
            f"compute (this machine, rank {self.largest_rank}'s shard {shapes} on a 1-rank mesh): "
            f"forward {_ms(self.forward_s)}, backward {_ms(self.backward_s)}",
            f"collectives of rank {busiest} per step:",
            f"  {'name':<26} {'travels as':<16} {'axes':<8} {'pass':<8} {'calls':>5} {'bytes':>12}",
        ]
        for (name, kind, axes, pass_), (n, b) in sorted(self.by_collective(busiest).items(),
                                                        key=lambda kv: (kv[0][3] != "forward", kv[0])):
            lines.append(f"  {name:<26} {kind:<16} {'/'.join(axes):<8} {pass_:<8} {n:>5} {b:>12,}")
        if not self.comm.get(busiest):
            lines.append("  (none)")
        else:  # 'all_to_all' under a conv's name is its halo: blocks for the neighbours only
            lines.append("  (name: the op that called it, as spmd.comm_stats() records it; "
                         "a halo travels as an all_to_all to the neighbours)")
        grads = ", ".join(f"{b:,} B {dtype_str(d)}" for d, b in self.grad_bytes.items())
        lines.append(f"gradient all-reduce on processes: {grads or 'none (no parameters)'}"
                     f" over {'/'.join(self.axis_names)} (modelled; threads share the weights)")
        lines.append(f"memory per rank: saved for backward up to {max(self.saved_bytes.values(), default=0):,} B, "
                     f"outputs {max(self.output_bytes.values(), default=0):,} B")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        mesh = ", ".join(f"{a}={s}" for a, s in zip(self.axis_names, self.mesh_shape))
        per = self.bytes_per_rank
        top = max((f + b for f, b in per.values()), default=0)
        return (f"Estimate(Mesh({mesh}): compute {_ms(self.compute_s)}, up to "
                f"{max(self.calls_per_rank.values(), default=0)} collectives and {top:,} B per rank "
                f"per step, gradients {sum(self.grad_bytes.values()):,} B, activations "
                f"{self.peak_activation_bytes:,} B)")

    # -- predictions ---------------------------------------------------------------------------

    def predict(self, ranks: int | None = None, *, network: Any, scaling: str = "strong",
                mesh_shape: Sequence[int] | None = None,
                shapes: Sequence[Sequence[int]] | None = None, grad_sync: str = "end",
                compute_scale: float = 1.0, max_elements: int = 1 << 22) -> model.Prediction:
        """Step time and parallel efficiency on a mesh of ``ranks`` (same axes).

        The model (``spmd.perf.model`` has the details):

        - compute: one rank's forward + backward at its local shape on the target mesh,
          timed on a 1-rank mesh here (divided by ``compute_scale``: how much faster the
          target's devices are than this machine); above ``max_elements`` elements it is
          scaled by volume from a measurement at a smaller shape (work linear in volume).
        - communication: the collectives of the busiest rank of a threads mesh with
          ``min(size, 3)`` ranks per axis whose every shard has the target's local shape
          (3 ranks give a rank neighbours on both sides: the interior rank's halos,
          exactly), each priced by ``collective_time`` at the target's group sizes; where
          that mesh would exceed ``max_elements``, measured at a smaller shape and halo
          bytes scaled by face area (all-gathers by volume, reductions unchanged). A
          halo hides behind the compute between its start and its wait, placed as on
          the 1-rank run (the busiest rank's transfers one after the other; a blocking
          collective hides nothing): ``Prediction.comm_s`` is what is left exposed,
          ``hidden_s`` the rest.
        - gradient sync of the replicated parameters over all ``ranks``: ``"end"`` (one
          all-reduce per dtype after backward plus shard_map's 32-byte check, as
          ``shard_map`` does on processes: spmd.demo's training), ``"overlap"``
          (GradSync's buckets, 1 MiB then 25 MiB, hidden behind backward except the last
          bucket), or ``"none"``.
        - step = forward + backward + exposed communication + exposed gradient sync.
        - efficiency: strong ``T1 / (ranks x step)``, ``T1`` the whole problem's compute
          on one device (measured if it fits ``max_elements``, else the local compute
          times the volume ratio: work linear in volume, ``ranks x compute(local)`` for
          even shards); weak ``compute(local) / step``.

        Args:
            ranks: how many ranks (default: the product of ``mesh_shape``, or the
                measured mesh's).
            network: a ``Network`` (``spmd.perf.NETWORKS[...]``, ``fit_network``).
            scaling: ``"strong"`` (the global problem fixed) or ``"weak"`` (each rank's
                local problem fixed).
            mesh_shape: ranks per axis (default: ``ranks`` spread over the measured
                mesh's axes of size > 1, powers of two alternating).
            shapes: the tensor arguments' global shapes (strong; default: the example
                arguments') or local shapes (weak; default: ``local_shapes``).
            grad_sync: ``"end"``, ``"overlap"`` or ``"none"``.
            compute_scale: divide measured compute times by this.
            max_elements: the largest problem (elements of the split arguments) run
                here; beyond it, scaled (and the prediction's ``notes`` say so).

        Returns:
            A ``Prediction``.

        Raises:
            ValueError: bad arguments, or a target leaving a rank an empty shard.

        Example:
            >>> mesh = Mesh((2,), ("sp",))
            >>> net = torch.nn.Conv1d(1, 1, 3, padding=1)
            >>> est = spmd.perf.estimate(net, mesh, P(None, None, "sp"),
            ...                          torch.randn(1, 1, 64), repeats=1, warmup=0)
            >>> p = est.predict(4, network=spmd.perf.NETWORKS["ib_ndr"])
            >>> p.mesh_shape, p.local_shapes, p.comm_bytes  # 2 neighbours, 1 element each way
            ((4,), ((1, 1, 16),), 16)
        """
        return model.predict(self, ranks, network=network, scaling=scaling,
                             mesh_shape=mesh_shape, shapes=shapes, grad_sync=grad_sync,
                             compute_scale=compute_scale, max_elements=max_elements)

    def sweep(self, ranks: Sequence[int], **kwargs: Any) -> list[model.Prediction]:
        """``[self.predict(r, **kwargs) for r in ranks]``; ``spmd.perf.format_predictions``
        prints them as a table.

        Example:
            >>> mesh = Mesh((2,), ("sp",))
            >>> est = spmd.perf.estimate(torch.nn.Conv1d(1, 1, 3, padding=1), mesh,
            ...                          P(None, None, "sp"), torch.randn(1, 1, 64),
            ...                          repeats=1, warmup=0)
            >>> ps = est.sweep([2, 4], network=spmd.perf.NETWORKS["ib_ndr"])
            >>> [p.ranks for p in ps]
            [2, 4]
        """
        return [self.predict(r, **kwargs) for r in ranks]

    # -- measurements predict asks for (cached) ------------------------------------------------

    def _names(self) -> tuple[str, ...]:
        return self.axis_names

    def _time(self, shapes: list[tuple[int, ...]]) -> tuple[float, float]:
        """(forward, backward) seconds of one rank's shard of ``shapes``."""
        return self._timed(shapes)[:2]

    def _events(self, shapes: list[tuple[int, ...]]) -> tuple[_measure.Event, ...] | None:
        """Where the collectives lie in that compute (``_measure.Event``)."""
        return self._timed(shapes)[2]

    def _timed(self, shapes: list[tuple[int, ...]]) -> tuple:
        # ``timings=`` (estimate's) is shared between estimates of one model: a local shape
        # timed for one spec is not timed again for another.
        store = self._cache if self._timings is None else self._timings
        key = ("compute", tuple(shapes))
        if key not in store:
            args = self._setup.args_of(shapes)
            store[key] = _measure.time_compute(self._setup, self.axis_names, args,
                                               self._device, self._repeats, self._warmup)
        return store[key]

    def _run(self, mesh_shape: tuple[int, ...], shapes: list[tuple[int, ...]]) -> _measure.Run:
        key = ("run", mesh_shape, tuple(shapes))
        if key not in self._cache:
            mesh = Mesh(mesh_shape, self.axis_names, backend="threads", device=self._device)
            self._cache[key] = _measure.run(self._setup, mesh, self._setup.args_of(shapes))
        return self._cache[key]


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def estimate(fn_or_model: Callable | torch.nn.Module, mesh: Mesh, in_specs: Any, *args: Any,
             out_specs: Any = None, spec: Any = None, build: bool = False,
             params: Sequence[torch.Tensor] | None = None, backward: bool = True,
             repeats: int = 5, warmup: int = 2, seed: int = 0,
             timings: dict | None = None) -> Estimate:
    """Measure one step of a domain-parallel body: per rank, its collectives, the bytes it
    keeps for backward and, on one rank's shard, its compute time.

    1. The body runs on a threads mesh of ``mesh``'s shape (a torch mesh's shape too),
       forward and (unless ``backward=False``) backward from a seeded random linear
       functional of its outputs, twice: the first step learns the layouts, the second
       is counted (``spmd.comm_stats``; ``saved_tensors_hooks`` per rank thread).
    2. The replicated parameters' gradient bytes are recorded: on processes they are
       all-reduced over every mesh axis (``shard_map``, ``GradSync``); on threads the
       ranks share them, so that sum is modelled (``Estimate.predict``), not run.
    3. The body runs on a mesh of one rank (no communication) on the largest rank's
       shard, timed: ``repeats`` steps after ``warmup``, medians.

    What runs on each mesh: a plain ``nn.Module`` is converted for it
    (``spmd.nn.convert(model, mesh, spec)``, ``spec`` defaulting to ``in_specs``); a
    function runs as it is (it must name axes, not one mesh); with ``build=True``,
    ``fn_or_model(mesh)`` returns the body (a function or a module used as is) for each
    mesh. A model converted for one mesh, or holding ``spmd.nn`` layers, cannot run on
    the other meshes estimate needs: pass the plain model, or ``build=True``.

    Args:
        fn_or_model: the per-shard function, a plain model, or (``build``) a function of
            the mesh returning one.
        mesh: the mesh to measure (threads, or a torch mesh whose shape is used).
        in_specs: as for ``shard_map``; ``Layout`` leaves fix the sizes on ``mesh`` only.
        *args: global example arguments. Those with ``requires_grad`` get gradients in
            the backward (as the caller's tensors would); the others do not.
        out_specs: as for ``shard_map`` (default for a model: the first input's spec).
        spec: ``convert``'s spec for a plain model (default: ``in_specs``).
        build: ``fn_or_model`` is a function of the mesh.
        params: weights a function body closes over: their gradients are modelled (and
            left as they were). A model's parameters are found by themselves.
        backward: measure the backward too.
        repeats, warmup: timed and untimed steps of the compute measurement.
        seed: seeds the cotangent.
        timings: a dict shared between estimates of one model and example under other
            specs or meshes (``spmd.plan`` passes one): compute at a local shape already
            timed in it is taken from it, not timed again (keyed by the local shapes
            alone; the spec changes which dims exchange halos, not the shard's work).

    Returns:
        An ``Estimate``: ``print(est)`` for a table, ``est.predict(...)`` for larger
        meshes.

    Raises:
        SpecError: specs that do not fit the arguments or the mesh; a body bound to one
            mesh; a body with no output needing grad (with ``backward``).
        TypeError: a wrong kind of argument.
        RuntimeError: called inside a rank of a threads mesh (estimate runs its own).

    Communication:
        None of its own: the body's collectives run among rank threads of this process.

    Example:
        >>> mesh = Mesh((4,), ("sp",))
        >>> def body(x):
        ...     return spmd.psum((x ** 2).sum(), "sp")
        >>> x = torch.randn(64, requires_grad=True)  # else no backward to measure
        >>> est = spmd.estimate(body, mesh, P("sp"), x, out_specs=P(), repeats=1, warmup=0)
        >>> est.bytes_per_rank[0], sorted({c.kind for c in est.comm[0]})
        ((4, 4), ['all_reduce'])
    """
    check_mesh(mesh, WHO)
    if any(m.backend == "threads" and r is not None for m, r in _context.rank_stack()):
        raise RuntimeError(
            f"{WHO}: called on a rank of a threads mesh (inside shard_map or spmd.launch); "
            f"estimate runs the body on threads meshes of its own: call it from ordinary code")
    if not callable(fn_or_model):
        raise TypeError(f"{WHO}: fn_or_model must be a function or an nn.Module, got "
                        f"{type(fn_or_model).__name__}")
    if timings is not None and not isinstance(timings, dict):
        raise TypeError(f"{WHO}: timings must be a dict (or None), got {type(timings).__name__}")
    for arg, v, lo in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{WHO}: {arg} must be an int >= {lo}, got {v!r}")
    is_module = isinstance(fn_or_model, torch.nn.Module)
    if is_module and not build:
        why = _measure.bound(fn_or_model)
        if why is not None:
            raise SpecError(
                f"{WHO}: the model is tied to one mesh ({why}), but estimate runs it on "
                f"meshes of other sizes (one rank, 3 per axis). Pass the plain model (estimate "
                f"converts it for each mesh, with spec=...), or build=True with a function "
                f"mesh -> model")
    if not is_module and params is not None:
        params = list(params)
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError(f"{WHO}: params must be tensors, got "
                            f"{[type(p).__name__ for p in params]}")
    if out_specs is None:
        if not is_module or build:
            raise SpecError(f"{WHO}: out_specs is required for a function body (it is only "
                            f"inferred for a model: its first input's spec), e.g. "
                            f"out_specs=P() for a loss")
    setup = Setup(fn_or_model, in_specs, out_specs, args, spec, build, params, backward, seed)
    if not setup.tensor_idx:
        raise SpecError(f"{WHO}: no tensor among the arguments; pass the example inputs")
    if out_specs is None:
        first = setup.leaf_specs[setup.tensor_idx[0]]
        setup.out_specs = P() if first is None else first
    names = tuple(mesh.axis_names)
    layouts = setup.layouts(setup.shapes(), mesh.shape, names)  # raises on bad specs
    sizes = {r: sum(math.prod(lay.local_shape(r)) for lay in layouts) for r in range(mesh.size)}
    largest = max(sizes, key=lambda r: (sizes[r], -r))
    local = [lay.local_shape(largest) for lay in layouts]
    device = mesh.device if mesh.backend == "torch" else getattr(mesh, "_device", None)
    threads = Mesh(mesh.shape, names, backend="threads", device=device) \
        if mesh.backend != "threads" else mesh
    try:
        res = _measure.run(setup, threads, args)
    except SpecError as e:
        raise _bound_hint(e, threads) from e
    grad: dict[torch.dtype, int] = {}
    for p in res.params:
        grad[p.dtype] = grad.get(p.dtype, 0) + p.numel() * p.element_size()
    est = Estimate(tuple(mesh.shape), names, backward, tuple(setup.shapes()), tuple(local),
                   largest, res.comm, res.saved, res.outputs, grad, 0.0, 0.0, setup, device,
                   [(p.shape, p.dtype) for p in res.params], repeats, warmup,
                   _timings=timings)
    est._cache[("run", tuple(mesh.shape), tuple(setup.shapes()))] = res
    try:
        est.forward_s, est.backward_s = est._time(local)
    except SpecError as e:
        raise _bound_hint(e, Mesh((1,) * len(names), names, backend="threads")) from e
    return est


def _bound_hint(e: SpecError, mesh: Mesh) -> SpecError:
    if "this code runs on" not in str(e) and "different Mesh" not in str(e):
        return e
    return SpecError(f"{WHO}: the body failed on {mesh!r}: {e}. A body tied to one mesh (a "
                     f"model made by spmd.nn.convert, ops given mesh=...) cannot run on the "
                     f"meshes estimate needs: pass the plain model, or build=True with a "
                     f"function mesh -> body")
