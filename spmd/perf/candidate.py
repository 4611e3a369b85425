"""What ``spmd.plan`` returns: a ``Candidate`` per decomposition it considered (mesh
shape, axis names, spec, what it costs per rank or why it was discarded) and the
``Plan`` that ranks them, prints them as a table and plots them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..core._format import shape_str
from ..core.mesh import Mesh
from ..core.spec import P
from . import model, pricing
from .cost import Estimate
from .network import Network

__all__ = ["Candidate", "Plan"]

OK, OVER, REFUSED = "ok", "over budget", "refused"


@dataclass(repr=False)
class Candidate:
    """One decomposition ``spmd.plan`` considered: a mesh shape, its axis names and the
    input's spec, with what it costs per rank (or why it was discarded).

    Attributes:
        mesh_shape, axis_names, spec: what ``Mesh`` and ``convert``/``shard_map`` take.
        status: ``"ok"``, ``"over budget"`` (memory above ``memory_per_rank``) or
            ``"refused"`` (empty shards, a ``SpecError`` from convert or shard_map, or
            torch's own size check: a kernel wider than what reaches it).
        reason: why it was discarded (``""`` when it was not).
        local_shape: the input's shard on the largest rank.
        measured_mesh: True where the bytes and memory below come from a run on a
            threads mesh of this very shape; False where they come from a smaller mesh
            whose shards have this one's local shape (``Estimate.predict``).
        bytes_per_rank: ``{rank: bytes sent per step}`` (forward + backward, as
            ``spmd.comm_stats`` records them; the gradient all-reduce apart), on a
            measured mesh; None when predicted.
        comm_bytes: the largest of those (predicted: the busiest rank's).
        memory_per_rank: ``{rank: bytes}`` on a measured mesh (None when predicted):
            the input shard + what autograd saves for backward + the outputs + the
            trainable parameters and as much again for their gradients.
        memory_bytes: the largest of those (predicted: the busiest rank's).
        saved_bytes, output_bytes, input_bytes, param_bytes: the parts of memory_bytes
            (the largest over ranks of each; param_bytes counted twice in memory_bytes).
        prediction: the step on ``network`` (``Prediction``: step, compute, exposed
            communication, gradient sync, efficiency).
        compute: ``"timed"`` (the largest shard's compute timed on a 1-rank mesh) or
            ``"scaled"`` (the model refuses the shard as a whole input, a positional table
            or FNO modes sized for the global input: another candidate's timed shard
            nearest in volume, or the whole problem, scaled by the volume ratio).
        measured, modelled: what was measured and what was scaled or modelled.
        estimate: the ``Estimate`` behind it (None if refused before one was made).

    Example:
        >>> c = Candidate((2, 2), ("d2", "d3"), P(None, None, "d2", "d3"))
        >>> c.status, c.ranks
        ('ok', 4)
    """

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: P
    status: str = OK
    reason: str = ""
    local_shape: tuple[int, ...] = ()
    measured_mesh: bool = True
    bytes_per_rank: dict[int, int] | None = None
    comm_bytes: int = 0
    memory_per_rank: dict[int, int] | None = None
    memory_bytes: int = 0
    saved_bytes: int = 0
    output_bytes: int = 0
    input_bytes: int = 0
    param_bytes: int = 0
    prediction: model.Prediction | None = None
    measured: tuple[str, ...] = ()
    modelled: tuple[str, ...] = ()
    compute: str = ""
    estimate: Estimate | None = field(default=None, compare=False)

    @property
    def ranks(self) -> int:
        """The number of ranks: the product of ``mesh_shape``."""
        return math.prod(self.mesh_shape)

    @property
    def step_s(self) -> float:
        """Predicted seconds per step on the plan's network (nan if discarded early)."""
        return self.prediction.step_s if self.prediction is not None else math.nan

    @property
    def efficiency(self) -> float:
        """Predicted strong-scaling efficiency (nan if discarded early)."""
        return self.prediction.efficiency if self.prediction is not None else math.nan

    def mesh(self, backend: str | None = None, **kwargs: Any) -> Mesh:
        """``Mesh(mesh_shape, axis_names, backend, **kwargs)``: the mesh to run it on.

        Example:
            >>> Candidate((2, 4), ("d2", "d3"), P(None, None, "d2", "d3")).mesh("threads")
            Mesh(d2=2, d3=4, backend='threads')
        """
        return Mesh(self.mesh_shape, self.axis_names, backend, **kwargs)

    def __repr__(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        if self.status == REFUSED:
            return f"Candidate({mesh} {self.spec}: refused: {self.reason})"
        return (f"Candidate({mesh} {self.spec}: step {_ms(self.step_s)}, "
                f"{self.comm_bytes:,} B sent and {self.memory_bytes:,} B memory per rank"
                f"{', over budget' if self.status == OVER else ''})")


@dataclass(repr=False)
class Plan:
    """What ``spmd.plan`` found: every candidate, the usable ones ranked.

    Attributes:
        candidates: all of them: the ranked ones first, then those over budget (by
            memory), then the refused ones.
        ranked: the usable ones, best first by ``objective`` (ties: step time, then
            memory, then bytes).
        best: ``ranked[0]``.
        objective, ranks, network, memory_per_rank, grad_sync, compute_scale: what it
            was asked.
        global_shape: the example's shape.
        timed_shapes: the local shapes whose compute was timed (each once).
        seconds: how long planning took here.

    Example:
        >>> net = torch.nn.Conv2d(1, 1, 3, padding=1)
        >>> p = spmd.plan(net, torch.randn(1, 1, 16, 16), ranks=4, objective="bytes",
        ...               network=spmd.perf.NETWORKS["ib_ndr"], repeats=1, warmup=0)
        >>> p.best.spec, p.best.mesh_shape    # a 2x2 split sends the fewest halo bytes
        (P(None, None, 'd2', 'd3'), (2, 2))
    """

    candidates: list[Candidate]
    objective: str
    ranks: int
    network: Network
    memory_per_rank: int | None
    global_shape: tuple[int, ...]
    timed_shapes: tuple[tuple[int, ...], ...]
    seconds: float
    grad_sync: str = "end"
    compute_scale: float = 1.0

    @property
    def ranked(self) -> list[Candidate]:
        """The candidates that are neither refused nor over budget, best first."""
        return [c for c in self.candidates if c.status == OK]

    @property
    def best(self) -> Candidate:
        """The best candidate by the objective."""
        return self.ranked[0]

    def priced(self, network: Network) -> Plan:
        """This plan with every candidate's step priced on ``network`` (nothing re-runs:
        bytes, memory, collectives and compute were measured once), ranked again.

        Example:
            >>> net = torch.nn.Conv2d(1, 1, 3, padding=1)
            >>> p = spmd.plan(net, torch.randn(1, 1, 16, 16), ranks=4, repeats=1, warmup=0,
            ...               network=spmd.perf.NETWORKS["ib_ndr"])
            >>> slow = p.priced(spmd.perf.Network(1e-3, 1e8, name="slow"))
            >>> slow.network.name, slow.best.step_s > p.best.step_s
            ('slow', True)
        """
        return pricing.priced(self, network)

    def calibrated(self, candidate: Candidate, step_s: float) -> Plan:
        """This plan priced again with the per-call overhead (``Network.overhead_s``)
        that makes ``candidate``'s predicted step the ``step_s`` seconds measured where
        the plan is to run (a few steps of that candidate on the real processes): what
        a step pays per collective beyond the fitted latency and bandwidth (the
        library's Python around each op, a CPU transport's wake-ups on busy cores).

        Example:
            >>> net = torch.nn.Conv2d(1, 1, 3, padding=1)
            >>> p = spmd.plan(net, torch.randn(1, 1, 16, 16), ranks=4, repeats=1, warmup=0,
            ...               network=spmd.perf.NETWORKS["ib_ndr"])
            >>> c = p.ranked[-1]
            >>> cal = p.calibrated(c, 2 * c.step_s)
            >>> mine = next(d for d in cal.ranked if d.spec == c.spec)
            >>> round(mine.step_s / c.step_s, 6), cal.network.overhead_s > 0
            (2.0, True)
        """
        return pricing.calibrated(self, candidate, step_s)

    def table(self) -> str:
        """Every candidate, one row each, and what was measured and what modelled."""
        over = (f" (+{self.network.overhead_s * 1e3:.3g} ms a collective)"
                if self.network.overhead_s else "")
        head = (f"plan for {self.ranks} ranks, input {shape_str(self.global_shape)}, on "
                f"{self.network.name}{over}, by {self.objective}"
                + (f", memory per rank <= {self.memory_per_rank:,} B"
                   if self.memory_per_rank is not None else ""))
        cols = f"  {'#':>2} {'mesh':<7} {'spec':<30} {'local':<18} {'sent B/rank':>12} " \
               f"{'memory B/rank':>14} {'step ms':>9} {'comm ms':>8} {'eff %':>6} compute  status"
        lines = [head, cols]
        n = 0
        for c in self.candidates:
            mesh = "x".join(map(str, c.mesh_shape))
            local = shape_str(c.local_shape) if c.local_shape else "-"
            if c.status == REFUSED:
                lines.append(f"  {'-':>2} {mesh:<7} {str(c.spec):<30} {local:<18} "
                             f"{'-':>12} {'-':>14} {'-':>9} {'-':>8} {'-':>6} {'-':<8} "
                             f"refused: {c.reason}")
                continue
            n += c.status == OK
            p = c.prediction
            tag = ("measured" if c.measured_mesh else "predicted") + (
                "" if c.status == OK else f"; over budget: {c.reason}")
            lines.append(f"  {n if c.status == OK else '-':>2} {mesh:<7} {str(c.spec):<30} "
                         f"{local:<18} {c.comm_bytes:>12,} {c.memory_bytes:>14,} "
                         f"{p.step_s * 1e3:>9.3g} {p.comm_s * 1e3:>8.3g} "
                         f"{100 * p.efficiency:>6.1f} {c.compute:<8} {tag}")
        lines.append("memory = input shard + saved for backward + outputs + 2 x trainable "
                     "parameters (weights and gradients); sent = forward + backward "
                     "collectives (comm_stats), gradient all-reduce apart")
        shown = next((c for c in self.candidates if c.status != REFUSED), None)
        if shown is not None:
            lines.append("measured: " + "; ".join(shown.measured[:-1]))
            lines.append("modelled: " + "; ".join(shown.modelled))
        lines.append("compute: timed = the largest shard's, on a 1-rank mesh; scaled = "
                     "another shard's by the volume ratio (the model refuses this shard as a "
                     "whole input); each candidate's measured[-1] says which")
        lines.append(f"compute timed at {len(self.timed_shapes)} local shape(s), each once; "
                     f"planned in {self.seconds:.3g} s")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        best = self.ranked[0] if self.ranked else None
        return (f"Plan({len(self.candidates)} candidates for {self.ranks} ranks, "
                f"{len(self.ranked)} usable, best {best!r})")

    def plot(self, ax: Any = None) -> Any:
        """A scatter of predicted step time against memory per rank (matplotlib, the
        ``test`` extra), each usable or over-budget candidate labelled with its mesh and
        spec, the budget as a line. Returns the Axes.

        Example:
            >>> net = torch.nn.Conv2d(1, 1, 3, padding=1)
            >>> p = spmd.plan(net, torch.randn(1, 1, 16, 16), ranks=4, repeats=1, warmup=0,
            ...               network=spmd.perf.NETWORKS["ib_ndr"])
            >>> import matplotlib; matplotlib.use("Agg")
            >>> ax = p.plot()
            >>> ax.get_xlabel()
            'memory per rank (MiB)'
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - the test extra has it
            raise ImportError("Plan.plot needs matplotlib (pip install spmd[test])") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        for status, marker in ((OK, "o"), (OVER, "x")):
            cs = [c for c in self.candidates if c.status == status]
            if not cs:
                continue
            xs = [c.memory_bytes / 2 ** 20 for c in cs]
            ys = [c.step_s * 1e3 for c in cs]
            ax.scatter(xs, ys, marker=marker, label=status)
            for c, x, y in zip(cs, xs, ys):
                ax.annotate(f"{'x'.join(map(str, c.mesh_shape))} {c.spec}", (x, y),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        if self.memory_per_rank is not None:
            ax.axvline(self.memory_per_rank / 2 ** 20, color="grey", linestyle="--",
                       label="memory_per_rank")
        ax.set_xlabel("memory per rank (MiB)")
        ax.set_ylabel(f"predicted step (ms) on {self.network.name}")
        ax.set_title(f"{self.ranks} ranks, input {shape_str(self.global_shape)}")
        ax.legend(fontsize=8)
        return ax


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.3g} ms"
