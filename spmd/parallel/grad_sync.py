"""``GradSync``: reduce the gradients of replicated parameters over mesh axes, bucketed
and overlapped with backward.

One Python code path for every backend and device (threads, gloo, NCCL): gradients are
packed into flat buckets keyed by (dtype, device, axes); a post-accumulate-grad hook on
each parameter marks it ready; a bucket's asynchronous all-reduce starts once all its
gradients are ready and every earlier bucket has started (strictly in plan order, the
same on every rank). The buckets run on a channel of their own (``Group.channel``), so
their early starts never meet the program's other collectives, whose order may differ
from rank to rank relative to the buckets (a parameter used on some ranks only, a psum
inside backward). When the autograd engine finishes the backward pass, a callback
queued on it starts what is left and waits for every bucket: when ``backward()``
returns, the gradients are reduced.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from ..comm import comm_of
from ..comm.stats import in_backward
from ..core._context import in_rank_of
from ..core._format import describe
from ..core.errors import SpecError
from ..core.mesh import Mesh, check_mesh
from .agreement import changed_error
from .arguments import check_axes, check_varying
from .buckets import Bucket, MiB
from .param_set import ParamSet
from .plan import _Plan
from .startup import start_up

__all__ = ["GradSync"]

INITS = ("broadcast", "verify", None)
DEFAULT_CAP_MB = 25.0  # as DDP
DEFAULT_FIRST_CAP_MB = 1.0  # as DDP, when bucket_cap_mb is not given

# Which live GradSync owns each parameter, by id (a live GradSync keeps its parameters
# alive, so the ids stay theirs): two of them hooking one parameter is the mistake of
# ranks of a threads mesh sharing one model.
_owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_owners_lock = threading.RLock()


class GradSync(_Plan):
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
        bucket_cap_mb: close a bucket once it holds this many MiB (default 25, as DDP);
            no bucket exceeds its cap by more than its last parameter.
        first_bucket_cap_mb: the cap of the first bucket of each dtype, device and axes,
            so that communication starts early in backward. Default: 1 MiB, or
            ``bucket_cap_mb`` when that is given (torch DDP's convention since 2.x).
        init: ``"broadcast"`` (default) copies parameters and buffers from the mesh's
            first rank to every rank holding a replica; ``"verify"`` checks by checksum
            that they are equal and raises a ``SpecError`` naming the first differing
            parameter, on every rank; ``None`` trusts them. Names, dtypes and shapes are
            compared in every case. Parameters are replicas over EVERY mesh axis (not
            only the synchronised ones) unless declared ``varying``.
        grad_as_view: let each ``p.grad`` be a view into its bucket (dense, contiguous
            parameters), so gradients are neither copied in nor out, and take no memory
            of their own.
        learn_order: after the first synchronised iteration, rebuild the buckets in the
            order rank 0's gradients became ready (see ``buckets``).
        ignore: names of parameters (and buffers) to leave alone entirely.
        varying: ``{name: axis or axes}`` for parameters (and buffers) whose value
            differs over those mesh axes, e.g. a field sharded over the domain axis
            ``"sp"``: they are compared and broadcast at start only over the other axes,
            and their gradients are reduced only over the synchronised axes they do not
            vary over (not at all if that leaves none).
        name: what communication accounting (``spmd.comm_stats``) and errors call it,
            and the channel its buckets run on: two GradSyncs whose backward passes
            overlap need different names.

    Rules:
        - Buckets never mix dtypes, devices or axes, and start in plan order on every
          rank, on the GradSync's own channel: collectives of the program (a loss
          logged with ``pmean``, a ``psum`` inside backward) never meet them.
        - When ``backward()`` returns, every bucket has been reduced: the end of the
          backward pass (a callback queued on the autograd engine) starts the buckets
          not started yet and waits for all of them. Nothing is pending afterwards,
          except inside ``no_sync()``.
        - One backward per iteration outside ``no_sync()``, then ``wait()`` (or the
          attached optimizer's ``step()``), which ends the iteration, before the next
          one. Gradients are reduced as they are: zero them between iterations
          (``zero_grad``), and accumulate micro-batches under ``no_sync()``.
        - Every rank runs backward through the model each iteration (a rank without
          data backprops a zero loss); a rank whose backward reaches no synchronised
          parameter starts no bucket, and the others' wait ends in ``CommTimeout``
          naming it. ``wait()`` after a backward that reached no parameter on any rank
          is a no-op, as is a second ``wait()``.
        - Unused parameters: a parameter that got no gradient on a rank contributes
          zeros there. Every rank ends with the reduced gradient of a parameter that
          any rank used; a parameter no rank used keeps what it had (``None`` after
          ``zero_grad()``), as on one device. Which is which travels in the buckets'
          all-reduce (one element per parameter), so nothing hangs or costs a
          collective more. This holds in any iteration, the first one included.
        - Double backward (``create_graph=True``), reentrant backward passes that
          accumulate parameter gradients (``torch.utils.checkpoint`` with
          ``use_reentrant=True``) and sparse gradients are refused with an error.
        - The synchronised parameters (count, names, shapes, dtypes, order) and the
          buckets made from them are compared across the ranks when it is built:
          ranks that would reduce different buckets (a parameter that requires grad on
          one rank only, another ``bucket_cap_mb``) raise a ``SpecError`` on every rank,
          naming each rank's plan. They are fixed then: a parameter added, replaced,
          reshaped or switched to or from ``requires_grad`` afterwards raises a
          ``SpecError`` at the end of the next synchronised backward, naming it, on
          every rank of the group (whether any rank changed rides in the buckets'
          all-reduce); that backward's gradients are dropped. Build a new GradSync
          after changing the model.
        - Build it after moving the model to its device and dtype, at the same point of
          the program on every rank of the mesh. A new GradSync over the same
          parameters on the same rank replaces the old one (closes it).

    On a threads mesh used from ordinary code (``shard_map`` in the global view), all
    ranks share the Parameter objects and their gradients add up by themselves: the
    synchroniser has nothing to do. Built outside the rank threads of a threads mesh,
    it is inactive (``sync.active`` is False, ``wait()`` does nothing), and says so if
    used on a rank thread.

    Example:
        >>> def train(mesh):
        ...     spmd.manual_seed(0)                  # the same weights on every rank
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
                 bucket_cap_mb: float | None = None, first_bucket_cap_mb: float | None = None,
                 init: str | None = "broadcast", grad_as_view: bool = True,
                 learn_order: bool = True, ignore: Collection[str] = (),
                 varying: Mapping[str, str | Sequence[str]] | None = None,
                 name: str = "grad_sync"):
        what = f"GradSync({name!r})" if name != "grad_sync" else "GradSync"
        self._what = what
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{what}: module must be a torch.nn.Module, got {describe(module)}")
        check_mesh(mesh, what)
        self.axes: dict[str, str] = check_axes(axes, mesh, what)
        for arg, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not v > 0):
                raise ValueError(f"{what}: {arg} must be a positive number of MiB, got {v!r}")
        if first_bucket_cap_mb is None:
            first_bucket_cap_mb = DEFAULT_FIRST_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_CAP_MB
        if init not in INITS:
            raise ValueError(f"{what}: init must be one of {INITS}, got {init!r}")
        if isinstance(ignore, str):
            ignore = (ignore,)
        ignore = set(ignore)
        known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        if ignore - known:
            raise SpecError(f"{what}: ignore names {sorted(ignore - known)}, which are not "
                            f"parameters or buffers of the module")
        self._varying = check_varying(varying, known, ignore, mesh, what)
        self.mesh, self.name = mesh, name
        self._cap = int(bucket_cap_mb * MiB)
        self._first_cap = int(first_bucket_cap_mb * MiB)
        self._grad_as_view, self._learn = grad_as_view, learn_order
        # Each parameter is reduced over the synchronised axes it does not vary over.
        named = [(n, p, tuple(a for a in self.axes if a not in self._varying.get(n, ())))
                 for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
        named = [(n, p, ax) for n, p, ax in named if ax]
        self._names = [n for n, _, _ in named]
        self._params = [p for _, p, _ in named]
        self._axes_of = [ax for _, _, ax in named]
        # What each synchronised backward checks the module against: the same selection.
        self._set = ParamSet(module, lambda n, p: p.requires_grad and n not in ignore and any(
            a not in self._varying.get(n, ()) for a in self.axes))
        self._change: str | None = None  # this iteration's, found when its first bucket starts
        self._buckets: list[Bucket] = []
        self._hooks: list = []
        self._closed = False
        self.overlapped = 0
        self._finish_s = 0.0  # seconds the last end of backward spent starting and waiting
        self.active = in_rank_of(mesh)
        if not self.active:  # the global view of a threads mesh: nothing to do
            return
        self.rank = mesh.rank
        # The buckets' own channel: their order is plan order on every rank, whatever
        # the program's other collectives do around them.
        self.group = mesh.group(tuple(self.axes), self.rank, channel=name)
        self._groups = {ax: mesh.group(ax, self.rank, channel=name)
                        for ax in sorted(set(self._axes_of), key=self._axis_order)}
        self._scale = {ax: _mean_scale(mesh, self.axes, ax) for ax in self._groups}
        self._claim()
        try:
            state = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers())
                     if n not in ignore]
            start_up(mesh, self.rank, state, self._varying, init, what)
            comm = comm_of(mesh)
            self._plan_group = mesh.group(mesh.axis_names, self.rank, channel=name)
            for g in [self._plan_group, *self._groups.values()]:
                comm.open(g)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._enabled = True  # False inside no_sync()
        self._dirty = False  # a synchronised backward produced gradients not yet reduced
        self._queued = False  # the end-of-backward callback is queued
        self._reduced = False  # the buckets were reduced and wait() has not been called
        self._next = 0  # the next bucket to start, in plan order
        self._early = 0  # buckets started before the end of this backward
        self._used = [False] * len(self._params)  # got a gradient since the last sync
        self._order: list[int] | None = [] if learn_order else None  # the first ready order
        self._seen: set[int] = set()
        self._build(list(reversed(range(len(self._params)))))
        try:  # every rank's buckets alike, per group that reduces them, before any starts
            self._check_plans()
        except BaseException:
            self.close()
            raise
        # The hooks keep the GradSync alive as long as the parameters live.
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(_hook(self, i)))

    def _axis_order(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.mesh.axis_names.index(a) for a in axes)

    # -- the plan ------------------------------------------------------------------------

    overlapped: int
    """How many buckets of the last synchronised backward started before it ended (the
    others started at its end): a measure of the overlap of communication with backward."""

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
        if not self._enabled:
            if self._dirty or self._reduced:
                raise RuntimeError(
                    f"{self._what}: a backward ran under no_sync() after a synchronised "
                    f"backward whose reduced gradients were not taken yet; call "
                    f"sync.wait() (or step the attached optimizer) first")
            self._used[i] = True
            # Accumulate the micro-batches in the bucket: no copy at the sync. (Another
            # shape: the parameter changed; the next synchronised backward says so.)
            if b.viewable[j] and p.grad is not b.views[j] and p.grad.shape == b.views[j].shape:
                with torch.no_grad():
                    b.views[j].copy_(p.grad)
                p.grad = b.views[j]
            return
        if b.ready[j] or self._reduced:
            raise RuntimeError(
                f"{self._what}: parameter {self._names[i]!r} got a gradient twice before "
                f"sync.wait(); run one backward per iteration (sum the losses), wait() "
                f"after it, and accumulate micro-batches under sync.no_sync(). (A reentrant "
                f"backward, torch.utils.checkpoint(..., use_reentrant=True), does this "
                f"too: use use_reentrant=False.)")
        if not self._queued:
            # Once per backward pass: its end starts what is left and waits for it all.
            _at_backward_end(_finisher(self))
            self._queued = True
            if not self._dirty:  # once per synchronised backward, before any bucket fills
                self._change = self._set.change()
        self._used[i] = True
        self._dirty = True
        self._fill(b, j, p)
        b.ready[j] = True
        b.pending -= 1
        if b.pending == 0:
            while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
                self._launch(self._buckets[self._next])
                self._early += 1

    def _fill(self, b: Bucket, j: int, p: torch.Tensor) -> None:
        """Put this rank's contribution for ``b.params[j]`` into the bucket, scaled."""
        view, g, s = b.views[j], p.grad, self._scale[b.axes]
        with torch.no_grad():
            if g is None or self._change:  # changed: nothing is reduced, the end raises
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
            b.alarm.fill_(1 if self._change else 0)
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
            b.work = comm_of(self.mesh).all_reduce_async(b.buffer, "sum", self._groups[b.axes],
                                                         name=self.name)
        self._next += 1

    # -- the sync --------------------------------------------------------------------------

    def _finish(self) -> None:
        """Start every bucket not started yet (in plan order), wait for all of them and
        hand the reduced gradients to the parameters: the end of a synchronised backward."""
        t0 = time.perf_counter()
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
        with torch.no_grad(), in_backward():
            for b in self._buckets:
                b.work.wait()
            alarms = [int(a) for a in torch.cat([b.alarm for b in self._buckets]).tolist()]
            if max(alarms):
                self._refuse_changed(max(alarms), next(
                    (a for a, b in zip(alarms, self._buckets) if b.axes == self.group.axes),
                    None))
            for b in self._buckets:
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
            self.overlapped, self._early = self._early, 0
            self._finish_s = time.perf_counter() - t0
            self._dirty, self._reduced = False, True
            self._next = 0
            self._used = [False] * len(self._params)
            if self._order is not None:
                self._rebuild()

    def _refuse_changed(self, changed: int, full: int | None) -> None:
        """A rank of a bucket's group changed its synchronised parameters: drop this
        backward's gradients (nothing was reduced) and raise, on every rank of the group.
        ``full``: the alarm of a bucket over every synchronised axis (None: no such
        bucket), the same on every rank of ``self.group``: where it is set, they all
        exchange what changed, so that each names it."""
        for b in self._buckets:
            b.reset()
        self._dirty, self._reduced, self._next, self._early = False, False, 0, 0
        self._used = [False] * len(self._params)
        raise SpecError(changed_error(self.mesh, self.group if full else None, self._change,
                                      changed, self.axes, self._what, self.name))

    def _at_end(self) -> None:
        """The end-of-backward callback."""
        with self._lock:
            self._queued = False
            if self._dirty:
                self._finish()

    def wait(self) -> None:
        """End the iteration: afterwards every synchronised parameter that any rank used
        holds its reduced gradient, and the next synchronised backward may run.

        The reduction itself ran when ``backward()`` returned; ``wait()`` only finishes
        it where that did not happen. A no-op when no gradient arrived since the last
        ``wait()``.

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
        with self._lock:
            if self._dirty:  # a backward whose end this GradSync did not see
                self._finish()
            self._reduced = False

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
        self._reduced = False  # the reduced gradients are gone: a new iteration
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


def _at_backward_end(fn) -> None:
    # torch's own DDP and FSDP finish their reductions this way: a callback queued on
    # the autograd engine runs once the whole backward pass is done. torch has no public
    # wrapper for it; the engine object is the one DDP uses.
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _finisher(sync: GradSync):
    ref = weakref.ref(sync)  # a queued callback must not keep a closed GradSync alive

    def finish() -> None:
        s = ref()
        if s is not None:
            s._at_end()
    return finish


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


def _mean_scale(mesh: Mesh, ops: Mapping[str, str], axes: tuple[str, ...]) -> float | None:
    """The factor that turns a sum over ``axes`` into the requested per-axis means."""
    mean = math.prod(mesh.axis_size(a) for a in axes if ops[a] == "mean")
    return 1.0 / mean if mean > 1 else None
