"""What ``estimate`` runs: one training-like step (forward, backward from a seeded random
cotangent) of a body on a threads mesh with ``comm_stats`` and saved-bytes counting open,
and the same body timed on a mesh of one rank."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..collectives._anchor import collect_anchors, hand_up
from ..comm.stats import comm_stats
from ..core import _tree
from ..core._context import current
from ..core._format import shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P
from ..mapping import shard_map
from ..mapping._graph import _graph_leaves
from ..nn import convert
from ..testing.memory import SavedBytes

WHO = "estimate"


@dataclass(frozen=True)
class Collective:
    """One collective call of one rank in one step, as ``spmd.comm_stats`` saw it.

    Attributes:
        name: what called it (``"conv2d"``, ``"psum"``, ...).
        kind: the protocol's collective (``"all_reduce"``, ``"all_to_all"``, ...).
        axes: the mesh axes it ran over.
        pass_: ``"forward"`` or ``"backward"``.
        group_size: ranks in its group.
        peers: other ranks this rank sent a non-empty payload to.
        payload: bytes passed in (see ``CommStats.details``).
        nbytes: bytes sent to other ranks.

    Example:
        >>> from spmd.perf import Collective, Network
        >>> c = Collective("conv2d", "all_to_all", ("sp",), "forward", 3, 2, 512, 512)
        >>> c.time(Network(1e-6, 1e9)) * 1e6  # 2 messages + 512 bytes
        2.512
    """

    name: str
    kind: str
    axes: tuple[str, ...]
    pass_: str
    group_size: int
    peers: int
    payload: int
    nbytes: int

    def time(self, network: Any, group_size: int | None = None) -> float:
        """Seconds this call takes on ``network`` (in a group of ``group_size`` ranks,
        default its own); see ``spmd.perf.collective_time``."""
        from .network import collective_time
        n = self.group_size if group_size is None else group_size
        sent, peers, payload = self.nbytes, self.peers, self.payload
        if self.dense and n != self.group_size:  # a transpose: every rank gets a block
            peers, sent = n - 1, payload * (n - 1) // n
        return collective_time(network, self.kind, n, payload=payload, sent=sent, peers=peers)

    @property
    def dense(self) -> bool:
        """An all-to-all that keeps a block of its own and sends one to every other rank
        (a transpose), as opposed to a halo exchange (blocks for neighbours only)."""
        return (self.kind == "all_to_all" and self.group_size > 1
                and self.peers == self.group_size - 1 and self.payload > self.nbytes)


# -- the body on any mesh --------------------------------------------------------------------

def bound(obj: Any) -> str | None:
    """Why a module is tied to one mesh (made by convert, or holding spmd.nn layers),
    else None."""
    if not isinstance(obj, torch.nn.Module):
        return None
    if hasattr(obj, "spmd_plan"):
        return "it was made by spmd.nn.convert for one mesh"
    for name, m in obj.named_modules():
        mesh = getattr(m, "mesh", None)
        if isinstance(mesh, Mesh):
            return f"its layer {name or type(obj).__name__!r} holds {mesh!r}"
    return None


def as_p(specs: Any) -> Any:
    """The spec tree with every Layout replaced by its P (for meshes of other sizes)."""
    return optree.tree_map(lambda s: s.spec if isinstance(s, Layout) else s, specs,
                           is_leaf=_tree._is_spec_leaf, none_is_leaf=True, namespace="spmd")


class Setup:
    """The user's body and specs, and how to get the body for any mesh."""

    def __init__(self, fn_or_model: Any, in_specs: Any, out_specs: Any, args: tuple,
                 spec: Any, build: bool, params: Sequence[torch.Tensor] | None,
                 backward: bool, seed: int):
        self.fn = fn_or_model
        self.build = build
        self.in_specs, self.out_specs = as_p(in_specs), as_p(out_specs)
        self.spec = self.in_specs if spec is None else spec
        self.args = args
        self.params = None if params is None else list(params)
        self.backward, self.seed = backward, seed
        # The tensors a function body's graph reaches that need gradients (its weights),
        # found in the first step when params= is not given.
        self.found: list[torch.Tensor] = []
        self.leaves, self.treedef = _tree.flatten(args)
        self.leaf_specs: list[P | None] = [
            None if s is None else s for s in
            _tree.match_specs(self.in_specs, args, "in_specs", "args")]
        self.tensor_idx = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]

    def body_for(self, mesh: Mesh) -> tuple[Callable, list[torch.Tensor] | None]:
        """The body to run on ``mesh`` and the parameters shard_map must differentiate."""
        fn = self.fn(mesh) if self.build else self.fn
        if isinstance(fn, torch.nn.Module):
            if not self.build and bound(fn) is None:
                fn = convert(fn, mesh, self.spec)
            return fn, [p for p in fn.parameters() if p.requires_grad]
        if not callable(fn):
            raise TypeError(f"{WHO}: build(mesh) must return a function or an nn.Module, "
                            f"got {type(fn).__name__}")
        return fn, self.params

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(self.leaves[i].shape) for i in self.tensor_idx]

    def split(self, k: int) -> bool:
        """Whether tensor leaf ``k`` (of ``tensor_idx``) is split over some axis."""
        s = self.leaf_specs[self.tensor_idx[k]]
        return s is not None and bool(s.axes)

    def layouts(self, shapes: Sequence[Sequence[int]], mesh_shape: Sequence[int],
                names: Sequence[str]) -> list[Layout]:
        m = _Shape(tuple(mesh_shape), tuple(names))
        return [Layout(shp, self.leaf_specs[i] or P(), m) for shp, i in zip(shapes, self.tensor_idx)]

    def args_of(self, shapes: Sequence[Sequence[int]]) -> tuple:
        """The example arguments tiled or cropped to ``shapes`` (one per tensor leaf)."""
        leaves = list(self.leaves)
        for shp, i in zip(shapes, self.tensor_idx):
            leaves[i] = fit_to(leaves[i], shp)
        return optree.tree_unflatten(self.treedef, leaves)


class _Shape:
    """What Layout needs of a mesh: axis names and sizes."""

    def __init__(self, shape: tuple[int, ...], axis_names: tuple[str, ...]):
        self.shape, self.axis_names = shape, axis_names


def fit_to(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``x`` repeated along each dim as often as needed, then cropped to ``shape``: the
    same dtype, device and values, at another size."""
    shape = tuple(int(s) for s in shape)
    if tuple(x.shape) == shape:
        return x.detach().clone().requires_grad_(x.requires_grad)
    if len(shape) != x.ndim or any(d == 0 and s > 0 for d, s in zip(x.shape, shape)):
        raise SpecError(f"{WHO}: cannot make {shape_str(shape)} from an example of shape "
                        f"{shape_str(x.shape, x.dtype)}")
    reps = [max(1, math.ceil(s / d)) if d else 1 for s, d in zip(shape, x.shape)]
    y = x.detach().repeat(*reps)[tuple(slice(0, s) for s in shape)].contiguous()
    return y.requires_grad_(x.requires_grad)


def copy_args(args: tuple) -> tuple:
    leaves, treedef = _tree.flatten(args)
    return optree.tree_unflatten(treedef, [
        x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in leaves])


# -- one step -----------------------------------------------------------------------------------

def step(f: Callable, args: tuple, backward: bool, seed: int) -> Any:
    """``f(*args)``, then backward from a seeded random linear functional of its floating
    outputs (as ``assert_matches_single_device`` does)."""
    if not backward:
        with torch.no_grad():
            return f(*args)
    out = f(*args)
    outs = _diff_outputs(out)
    if not outs:
        raise SpecError(f"{WHO}: no output of the body requires grad, so there is no "
                        f"backward to measure; pass backward=False for a forward only")
    torch.autograd.backward(outs, _cotangents(outs, seed))
    return out


def _diff_outputs(out: Any) -> list[torch.Tensor]:
    """The floating outputs that need a gradient: what a step's backward starts from."""
    return [o for o in _tree.flatten(out)[0]
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]


def _cotangents(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A fixed random cotangent per output (the same every step and on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) for o in outs]


@dataclass
class Run:
    """What one measured step on a threads mesh left, per rank."""

    comm: dict[int, tuple[Collective, ...]]
    saved: dict[int, int]
    outputs: dict[int, int]
    params: list[torch.Tensor]


def run(setup: Setup, mesh: Mesh, args: tuple) -> Run:
    """A warm-up step (it learns the layouts: ``static_layouts``), then a step with
    ``comm_stats`` open and each rank's saved bytes counted: the steady state."""
    body, params = setup.body_for(mesh)
    saved: dict[int, int] = {}
    outb: dict[int, int] = {}
    counting = [False]

    found: dict[int, torch.Tensor] = {}
    before: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def wrapped(*local: Any) -> Any:
        ins = [t for t in _tree.flatten(local)[0] if isinstance(t, torch.Tensor)]
        if not counting[0]:
            with collect_anchors() as anchors:
                out = body(*local)
            hand_up(anchors)  # to shard_map's list (grad mode): its backward needs them
            if params is None and current(WHO).rank == 0:
                _graph_leaves([t for t in _tree.flatten(out)[0] if isinstance(t, torch.Tensor)],
                              {id(t) for t in [*ins, *anchors]}, found)
                before.update({k: (v, _kept(v)) for k, v in found.items() if k not in before})
            return out
        rank = current(WHO).rank
        with SavedBytes([*(params or found.values()), *ins]) as s:
            out = body(*local)
        saved[rank] = s.total
        outb[rank] = sum(t.nbytes for t in _tree.flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    grads = [(p, _kept(p)) for p in (params or ())]
    try:
        f = shard_map(wrapped, mesh, setup.in_specs, setup.out_specs, params=params)
        step(f, copy_args(args), setup.backward, setup.seed)
        counting[0] = True
        with comm_stats() as st:
            step(f, copy_args(args), setup.backward, setup.seed)
    finally:
        # The caller's tensors keep the gradients they had (found ones: noted in forward).
        for p, g in grads + list(before.values()):
            p.grad = g
    comm: dict[int, list[Collective]] = {r: [] for r in range(mesh.size)}
    for (name, axes, rank, pass_, nbytes), (kind, n, peers, payload) in zip(st.records, st.details):
        if kind == "barrier" and n == 1:
            continue
        comm[rank].append(Collective(name, kind, tuple(axes), pass_, n, peers, payload, nbytes))
    if params is None and not setup.found:
        setup.found = list(found.values())
    return Run({r: tuple(c) for r, c in comm.items()}, saved, outb,
               list(params if params is not None else found.values()))


def _kept(p: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``p.grad``: autograd accumulates into the tensor itself."""
    return None if p.grad is None else p.grad.detach().clone()




@dataclass(frozen=True)
class Event:
    """Where one collective of a step lies in the compute of a rank, timed on a mesh of
    one rank (where collectives cost nothing): ``start`` and ``wait`` are fractions of
    its pass (``pass_``, forward or backward) elapsed when it was started and when its
    result was first waited for (equal for a blocking call; later for a halo that
    travels while compute runs). ``ordinal``: its rank among the step's collectives of
    the same name, kind and pass (what matches it to a collective of another mesh)."""

    name: str
    kind: str
    pass_: str
    ordinal: int
    start: float
    wait: float

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.name, self.kind, self.pass_, self.ordinal)


def ordinals(keys: Sequence[tuple]) -> list[int]:
    """Each key's count among the keys before it: what matches a step's collectives
    between meshes (``Event.ordinal``).

    Example:
        >>> ordinals(["a", "b", "a", "a"])
        [0, 0, 1, 2]
    """
    seen: dict = {}
    out = []
    for k in keys:
        seen[k] = seen.get(k, -1) + 1
        out.append(seen[k])
    return out


def _frac(t: float, span: tuple[float, float]) -> float:
    t0, t1 = span
    return min(max((t - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else 0.0


def _events(st, spans: dict[str, tuple[float, float]]) -> list[tuple]:
    """One timed step's ``(name, kind, pass, start, wait)``, as fractions of each pass."""
    out = []
    for (name, _, _, pass_, _), (kind, n, _, _), (t_s, t_w) in zip(st.records, st.details,
                                                                 st.times):
        if kind == "barrier" and n == 1:
            continue
        span = spans[pass_]
        out.append((name, kind, pass_, _frac(t_s, span),
                    _frac(t_s if t_w is None else t_w, span)))
    return out


def _median_events(steps: list[list[tuple]]) -> tuple[Event, ...] | None:
    """The steps' events with the median fractions; None if the steps' collectives
    differ (then nothing is assumed hidden)."""
    if not steps or any([e[:3] for e in s] != [e[:3] for e in steps[0]] for s in steps):
        return None
    out = []
    keys = [e[:3] for e in steps[0]]
    for j, ((name, kind, pass_), k) in enumerate(zip(keys, ordinals(keys))):
        start = statistics.median(s[j][3] for s in steps)
        out.append(Event(name, kind, pass_, k, start,
                         max(start, statistics.median(s[j][4] for s in steps))))
    return tuple(out)


def time_compute(setup: Setup, names: tuple[str, ...], args: tuple, device: torch.device | None,
                 repeats: int, warmup: int, stat: str = "median"
                 ) -> tuple[float, float, tuple[Event, ...] | None]:
    """(forward, backward) seconds of the body on a mesh of one rank (every group of one:
    no communication): ``repeats`` steps after ``warmup``, each timed in two parts,
    the median (or the minimum: ``stat="min"``, steadier on a loaded machine) of each;
    and where each collective lies in that compute (``Event``s, median fractions)."""
    mesh = Mesh((1,) * len(names), names, backend="threads", device=device)
    body, params = setup.body_for(mesh)
    f = shard_map(body, mesh, setup.in_specs, setup.out_specs, params=params)
    dev = next((x.device for x in _tree.flatten(args)[0] if isinstance(x, torch.Tensor)), None)
    sync = (torch.get_device_module(dev.type).synchronize
            if dev is not None and dev.type != "cpu" else (lambda: None))
    pick = statistics.median if stat == "median" else min
    fwd: list[float] = []
    bwd: list[float] = []
    events: list[list[tuple]] = []
    step_grads = None
    grads = [(p, _kept(p)) for p in (params if params is not None else setup.found)]
    try:
        for _ in range(warmup):
            step(f, copy_args(args), setup.backward, setup.seed)
        for _ in range(repeats):
            a = copy_args(args)
            sync()
            with comm_stats() as st:
                t0 = time.perf_counter()
                if not setup.backward:
                    with torch.no_grad():
                        f(*a)
                    sync()
                    fwd.append(time.perf_counter() - t0)
                    events.append(_events(st, {"forward": (t0, t0 + fwd[-1])}))
                    continue
                out = f(*a)
                sync()
                t1 = time.perf_counter()
                fwd.append(t1 - t0)
                outs = _diff_outputs(out)
                if step_grads is None:
                    step_grads = _cotangents(outs, setup.seed)
                    t1 = time.perf_counter()  # the cotangent is not the body's work
                torch.autograd.backward(outs, step_grads)
                sync()
                bwd.append(time.perf_counter() - t1)
            events.append(_events(st, {"forward": (t0, t0 + fwd[-1]),
                                       "backward": (t1, t1 + bwd[-1])}))
    finally:
        for p, gr in grads:  # the caller's parameters keep the gradients they had
            p.grad = gr
    return pick(fwd), (pick(bwd) if bwd else 0.0), _median_events(events)


def shrink(shapes: list[tuple[int, ...]], limit: int, split: Sequence[bool],
           floor: int = 8) -> list[tuple[int, ...]]:
    """``shapes`` with their largest dims halved (the same dim position in every split
    leaf of that size, so that inputs stay consistent) until the split leaves hold at
    most ``limit`` elements, or every dim is down to ``floor``."""
    out = [list(s) for s in shapes]

    def vol() -> int:
        return sum(math.prod(s) for s, sp in zip(out, split) if sp)
    while vol() > limit:
        best = max(((s[d], d) for s, sp in zip(out, split) if sp for d in range(len(s))
                    if s[d] > floor), default=None)
        if best is None:
            break
        size, d = best
        for s, sp in zip(out, split):
            if sp and len(s) > d and s[d] == size:
                s[d] = max(floor, math.ceil(size / 2))
    return [tuple(s) for s in out]


def volume(shapes: Sequence[Sequence[int]], split: Sequence[bool]) -> int:
    """Elements of the split leaves (what the work grows with)."""
    return sum(math.prod(s) for s, sp in zip(shapes, split) if sp)
