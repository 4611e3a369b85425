"""``GradSync``: reduce the gradients of replicated parameters over mesh axes, bucketed
and overlapped with backward.

One Python code path for every backend and device (threads, gloo, NCCL): gradients are
packed into flat buckets keyed by (dtype, device); a post-accumulate-grad hook on each
parameter marks it ready; a bucket's asynchronous all-reduce starts once all its
gradients are ready and every earlier bucket has started (buckets start strictly in
plan order, the same on every rank, so collectives never cross); ``wait()`` starts
what is left and waits for all of them.
"""
from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from ..comm import comm_of
from ..comm.stats import in_backward
from ..core._context import in_rank_of
from ..core._format import describe
from ..core.errors import SpecError
from ..core.mesh import Mesh
from .buckets import Bucket, BucketInfo, MiB, assign
from .startup import broadcast_from_first, check_same_tensors, verify_equal

__all__ = ["GradSync"]

OPS = ("sum", "mean")
INITS = ("broadcast", "verify", None)

# Which live GradSync owns each parameter, by id (a live GradSync keeps its parameters
# alive, so the ids stay theirs): two of them hooking one parameter is the mistake of
# ranks of a threads mesh sharing one model.
_owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_owners_lock = threading.RLock()


class GradSync:
    """Reduce the gradients of ``module``'s parameters over mesh axes, DDP-style.

    For per-rank programs (torchrun scripts, ``spmd.launch``, a rank thread of a
    threads mesh) in which every rank holds its own copy of the weights and backprops
    from its local contribution to the loss. After ``loss.backward()`` and
    ``sync.wait()`` (or an attached optimizer's ``step()``), every parameter holds its
    gradient reduced over ``axes``: per axis, the sum (a domain axis whose ranks each
    hold part of one sample's loss) or the mean (a data axis whose ranks each average
    their own batch). All axes go in ONE all-reduce per bucket over the group of all of
    them, the means folded into one multiply by ``1 / prod(sizes of the mean axes)``.

    Args:
        module: the model; its parameters that require grad are synchronised.
        mesh: the mesh.
        axes: ``{axis: "sum" | "mean"}``, e.g. ``{"dp": "mean", "sp": "sum"}``; an axis
            name or a sequence of them means ``"mean"`` over each (as DDP).
        bucket_cap_mb: close a bucket once it holds this many MiB (default 25, as DDP).
        first_bucket_cap_mb: the cap of the first bucket of each dtype and device (1 MiB,
            as DDP), so that communication starts early in backward.
        init: ``"broadcast"`` (default) copies parameters and buffers from the first rank
            of the group; ``"verify"`` checks by checksum that they are equal and raises
            a ``SpecError`` naming the first differing parameter, on every rank; ``None``
            trusts them. Names, dtypes and shapes are compared in every case.
        grad_as_view: let each ``p.grad`` be a view into its bucket (dense, contiguous
            parameters), so gradients are neither copied in nor out, and take no memory
            of their own.
        learn_order: after the first synchronised iteration, rebuild the buckets in the
            order rank 0's gradients became ready (see ``buckets``).
        ignore: names of parameters (and buffers) to leave alone, e.g. parameters
            sharded over a synchronised axis.
        name: what communication accounting (``spmd.comm_stats``) and errors call it.

    Rules:
        - Buckets never mix dtypes or devices and start in plan order on every rank.
        - One backward per iteration outside ``no_sync()``, then ``wait()`` before
          reading or changing gradients (clipping included) or stepping. Gradients are
          reduced as they are: zero them between iterations (``zero_grad``), and
          accumulate micro-batches under ``no_sync()``.
        - Every rank runs backward through the model each iteration (a rank without
          data backprops a zero loss): ``wait()`` after a backward that reached no
          parameter is a no-op, as is a second ``wait()``.
        - Unused parameters: a parameter that got no gradient on a rank contributes
          zeros there. Every rank ends with the reduced gradient of a parameter that
          any rank used; a parameter no rank used keeps what it had (``None`` after
          ``zero_grad()``), as on one device. Which is which travels in the buckets'
          all-reduce (one element per parameter), so nothing hangs or costs a
          collective more.
        - Double backward (``create_graph=True``) and sparse gradients are not supported.
        - Build it after moving the model to its device and dtype. A new GradSync over
          the same parameters on the same rank replaces the old one (closes it).

    On a threads mesh used from ordinary code (``shard_map`` in the global view), all
    ranks share the Parameter objects and their gradients add up by themselves: the
    synchroniser has nothing to do. Built outside the rank threads of a threads mesh,
    it is inactive (``sync.active`` is False, ``wait()`` does nothing), and says so if
    used on a rank thread.

    Example:
        >>> def train(mesh):
        ...     torch.manual_seed(0)                 # the same weights on every rank
        ...     model = torch.nn.Linear(3, 1)
        ...     sync = spmd.parallel.GradSync(model, mesh, {"dp": "mean"})
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     sync.attach(opt)                      # step() waits for the gradients
        ...     x = torch.full((2, 3), float(mesh.rank))  # this rank's batch
        ...     model(x).sum().backward()
        ...     opt.step()
        ...     return model.weight.grad.tolist()
        >>> spmd.launch(train, (2,), ("dp",))
        [[[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]]]
    """

    def __init__(self, module: torch.nn.Module, mesh: Mesh,
                 axes: Mapping[str, str] | str | Sequence[str], *,
                 bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
                 init: str | None = "broadcast", grad_as_view: bool = True,
                 learn_order: bool = True, ignore: Collection[str] = (),
                 name: str = "grad_sync"):
        what = f"GradSync({name!r})" if name != "grad_sync" else "GradSync"
        self._what = what
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{what}: module must be a torch.nn.Module, got {describe(module)}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{what}: mesh must be a spmd.Mesh, got {describe(mesh)}")
        self.axes: dict[str, str] = _check_axes(axes, mesh, what)
        for arg, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{what}: {arg} must be a positive number of MiB, got {v!r}")
        if init not in INITS:
            raise ValueError(f"{what}: init must be one of {INITS}, got {init!r}")
        if isinstance(ignore, str):
            ignore = (ignore,)
        ignore = set(ignore)
        known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        if ignore - known:
            raise SpecError(f"{what}: ignore names {sorted(ignore - known)}, which are not "
                            f"parameters or buffers of the module")
        self.mesh, self.name = mesh, name
        self._cap = int(bucket_cap_mb * MiB)
        self._first_cap = int(first_bucket_cap_mb * MiB)
        self._grad_as_view, self._learn = grad_as_view, learn_order
        mean = math.prod(mesh.axis_size(a) for a, op in self.axes.items() if op == "mean")
        self.scale: float | None = 1.0 / mean if mean > 1 else None
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in ignore]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buckets: list[Bucket] = []
        self._hooks: list = []
        self._closed = False
        self.active = in_rank_of(mesh)
        if not self.active:  # the global view of a threads mesh: nothing to do
            return
        self.rank = mesh.rank
        self.group = mesh.group(tuple(self.axes), self.rank)
        self._claim()
        try:
            state = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers())
                     if n not in ignore]
            if self.group.size > 1:
                check_same_tensors(mesh, self.group, state, what)
                if init == "broadcast":
                    broadcast_from_first(mesh, self.group, [t for _, t in state], what)
                elif init == "verify":
                    verify_equal(mesh, self.group, state, what)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._enabled = True  # False inside no_sync()
        self._dirty = False  # a synchronised backward produced gradients not yet waited for
        self._next = 0  # the next bucket to start, in plan order
        self._used = [False] * len(self._params)  # got a gradient since the last sync
        self._order: list[int] | None = [] if learn_order else None  # the first ready order
        self._seen: set[int] = set()
        self._build(list(reversed(range(len(self._params)))))
        # The hooks keep the GradSync alive as long as the parameters live.
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(_hook(self, i)))

    # -- the plan ------------------------------------------------------------------------

    @property
    def buckets(self) -> list[BucketInfo]:
        """The bucket plan in launch order: dtype, device, parameter names, size.

        Before the first synchronised iteration it follows the reverse of the module's
        definition order (backward usually runs last layer first); after it, with
        ``learn_order``, the order in which the gradients of the group's first rank
        became ready (every rank of the group adopts it).
        """
        return [b.info() for b in self._buckets]

    @property
    def order_learned(self) -> bool:
        """Whether the plan has been rebuilt from the order seen in backward."""
        return self.active and self._learn and self._order is None

    def _build(self, order: list[int]) -> None:
        plan = assign(order, self._params, self._cap, self._first_cap)
        self._buckets = [Bucket(idx, self._params, self._names, self._grad_as_view)
                         for idx in plan]
        self._where: dict[int, tuple[Bucket, int]] = {
            i: (b, j) for b in self._buckets for j, i in enumerate(b.index)}

    def _rebuild(self) -> None:
        """Adopt rank 0's ready order (so every rank has the same plan), once."""
        seen, self._order = self._order, None
        rest = [i for b in self._buckets for i in b.index if i not in self._seen]
        mine = torch.tensor(seen + rest, dtype=torch.int64, device=self.mesh.device)
        if self.group.size > 1:
            mine = comm_of(self.mesh).broadcast(mine, 0, self.group, name=f"{self.name} plan")
        order = mine.tolist()
        if sorted(order) != list(range(len(self._params))):
            raise SpecError(f"{self._what}: rank {self.group.ranks[0]} sent a bucket order "
                            f"for other parameters than this rank's")
        if assign(order, self._params, self._cap, self._first_cap) == [b.index for b in self._buckets]:
            return
        old = self._where
        self._build(order)
        with torch.no_grad():  # the gradients just reduced move into the new buckets
            for i, p in enumerate(self._params):
                b, j = self._where[i]
                if p.grad is not None:
                    ob, oj = old[i]
                    b.views[j].copy_(p.grad)
                    if b.viewable[j] and p.grad is ob.views[oj]:
                        p.grad = b.views[j]

    # -- backward ------------------------------------------------------------------------

    def _ready(self, i: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i``."""
        if self._order is not None and i not in self._seen:
            self._seen.add(i)
            self._order.append(i)
        b, j = self._where[i]
        if p.grad is not None and p.grad.layout != torch.strided:
            raise NotImplementedError(
                f"{self._what}: parameter {self._names[i]!r} got a {p.grad.layout} gradient; "
                f"only dense gradients are supported (e.g. nn.Embedding(sparse=False)), or "
                f"leave it out with ignore=[{self._names[i]!r}] and reduce it yourself")
        self._used[i] = True
        if not self._enabled:
            if self._dirty:
                raise RuntimeError(
                    f"{self._what}: a backward ran under no_sync() while gradients of an "
                    f"earlier synchronised backward are still being reduced; call "
                    f"sync.wait() first")
            if b.viewable[j] and p.grad is not b.views[j]:
                # Accumulate the micro-batches in the bucket: no copy at the sync.
                with torch.no_grad():
                    b.views[j].copy_(p.grad)
                p.grad = b.views[j]
            return
        if b.ready[j]:
            raise RuntimeError(
                f"{self._what}: parameter {self._names[i]!r} got a gradient twice before "
                f"sync.wait(); run one backward per iteration (sum the losses), wait() "
                f"after it, and accumulate micro-batches under sync.no_sync()")
        self._dirty = True
        self._fill(b, j, p)
        b.ready[j] = True
        b.pending -= 1
        if b.pending == 0:
            while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
                self._launch(self._buckets[self._next])

    def _fill(self, b: Bucket, j: int, p: torch.Tensor) -> None:
        """Put this rank's contribution for ``b.params[j]`` into the bucket, scaled."""
        view, g, s = b.views[j], p.grad, self.scale
        with torch.no_grad():
            if g is None:
                view.zero_()
            elif g is view:
                if s is not None:
                    view.mul_(s)
            else:
                if s is not None:
                    torch.mul(g, s, out=view)
                else:
                    view.copy_(g)
                if b.viewable[j]:
                    p.grad = view

    def _launch(self, b: Bucket) -> None:
        """Start bucket ``b`` (the next in plan order); fill what is not ready yet."""
        with torch.no_grad():
            if b.pending:
                for j, p in enumerate(b.params):
                    if not b.ready[j]:
                        self._fill(b, j, p)
            used = [self._used[i] for i in b.index]
            if all(used):
                b.flags.fill_(1)
            else:
                b.flags.copy_(torch.tensor(used, dtype=b.flags.dtype))
        with in_backward():
            b.work = comm_of(self.mesh).all_reduce_async(b.buffer, "sum", self.group,
                                                     name=self.name)
        self._next += 1

    # -- the sync --------------------------------------------------------------------------

    def wait(self) -> None:
        """Start every bucket not started yet (in plan order) and wait for all of them.

        Afterwards every synchronised parameter that any rank used holds its reduced
        gradient. A no-op when no gradient arrived since the last ``wait()``.

        Raises:
            CommTimeout: a rank did not arrive within the mesh's timeout (names it).
        """
        if not self.active:
            if in_rank_of(self.mesh):
                raise SpecError(
                    f"{self._what} was built outside the rank threads of {self.mesh!r}, where "
                    f"it does nothing; build it inside the per-rank function (spmd.launch), "
                    f"one per rank, each rank with its own model")
            return
        if not self._dirty:
            return
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
        with torch.no_grad():
            for b in self._buckets:
                b.work.wait()
                local = [self._used[i] for i in b.index]
                used = local if all(local) else [f > 0 for f in b.flags.tolist()]
                for j, p in enumerate(b.params):
                    if not used[j]:
                        continue  # no rank used it: leave its .grad alone
                    view = b.views[j]
                    if b.viewable[j]:
                        p.grad = view
                    elif p.grad is None:
                        p.grad = torch.empty_like(p).copy_(view)
                    else:
                        p.grad.copy_(view)
                b.reset()
        self._dirty = False
        self._next = 0
        self._used = [False] * len(self._params)
        if self._order is not None:
            self._rebuild()

    def attach(self, optimizer: torch.optim.Optimizer):
        """Make ``optimizer.step()`` call ``wait()`` first; returns the hook's handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.wait())

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block accumulate gradients locally, without
        communication; the first synchronised backward after it reduces the sum.

        Example (k micro-batches equal one batch k times larger, with ``"mean"`` axes
        and a sum-reduced loss, or a mean loss divided by k)::

            with sync.no_sync():
                for xb in micro[:-1]:
                    loss_fn(model(xb)).backward()
            loss_fn(model(micro[-1])).backward()
            sync.wait()
        """
        prev, self._enabled = getattr(self, "_enabled", True), False
        try:
            yield
        finally:
            self._enabled = prev

    def zero_grad(self) -> None:
        """Zero every synchronised gradient in place, one fill per bucket: the cheapest
        way to keep gradients as bucket views (``optimizer.zero_grad()`` sets them to
        None, after which the next backward copies each gradient into its bucket)."""
        if not self.active:
            for p in self._params:
                p.grad = None
            return
        if self._dirty:
            raise RuntimeError(f"{self._what}: zero_grad() while gradients are being "
                               f"reduced; call wait() first")
        with torch.no_grad():
            for b in self._buckets:
                b.grads.zero_()
                for j, p in enumerate(b.params):
                    if b.viewable[j]:
                        p.grad = b.views[j]
                    elif p.grad is not None:
                        p.grad.zero_()

    def close(self) -> None:
        """Remove the hooks; the parameters can be synchronised by another GradSync."""
        _remove(self._hooks)
        self._hooks = []
        self._closed = True
        with _owners_lock:
            for p in self._params:
                if _owners.get(id(p)) is self:
                    del _owners[id(p)]

    def __repr__(self) -> str:
        axes = ", ".join(f"{a!r}: {op!r}" for a, op in self.axes.items())
        if not self.active:
            return f"GradSync({{{axes}}}, inactive: global view of {self.mesh!r})"
        return (f"GradSync({{{axes}}}, {len(self._params)} parameters in "
                f"{len(self._buckets)} buckets, rank {self.rank})")

    def _claim(self) -> None:
        """Own the parameters: a GradSync of this rank over them is replaced (closed); one
        of another rank means the ranks of a threads mesh share one model."""
        with _owners_lock:
            for n, p in zip(self._names, self._params):
                other = _owners.get(id(p))
                if other is None or other is self or other._closed or other.rank == self.rank:
                    continue
                raise SpecError(
                    f"{self._what}: parameter {n!r} is already synchronised by a GradSync "
                    f"on rank {other.rank}; on a threads mesh every rank builds its own "
                    f"model (copy.deepcopy per rank)")
            for p in self._params:
                other = _owners.get(id(p))
                if other is not None and other is not self and not other._closed:
                    other.close()  # replaced by this one, on the same rank
                _owners[id(p)] = self


def _hook(sync: GradSync, i: int):
    def hook(p: torch.Tensor) -> None:
        # Autograd runs the hooks of parameters on different devices on different
        # threads: the plan-order bookkeeping must see one at a time.
        with sync._lock:
            sync._ready(i, p)
    return hook


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()


def _check_axes(axes: object, mesh: Mesh, what: str) -> dict[str, str]:
    given = axes
    if isinstance(axes, str):
        axes = [(axes, "mean")]
    elif isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
        axes = [(a, "mean") for a in axes]
    elif isinstance(axes, Mapping):
        axes = list(axes.items())
    else:
        axes = []
    if not axes:
        raise SpecError(f"{what}: axes must be a non-empty {{axis: 'sum' | 'mean'}} dict (or "
                        f"axis names, meaning 'mean'), got {given!r}")
    for a, op in axes:
        if not isinstance(a, str):
            raise SpecError(f"{what}: axes must map mesh axis names to ops, got key {a!r}")
        mesh.check_axes(a, what)
        if op not in OPS:
            raise SpecError(f"{what}: the op for axis {a!r} must be 'sum' or 'mean', got "
                            f"{op!r}")
    names = [a for a, _ in axes]
    if len(set(names)) != len(names):
        raise SpecError(f"{what}: axes {names} repeat an axis")
    return dict(axes)
