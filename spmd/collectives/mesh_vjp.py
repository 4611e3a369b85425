"""A ``custom_vjp`` call as ONE autograd node over every rank of a greenlet run.

On the simulated mesh (``Mesh(schedule="greenlets")``) a ``shard_map`` body's ranks are
greenlets of one thread. Each rank runs the rule's ``fwd`` itself (its collectives meet
as usual); then the ranks meet, and the last to arrive makes one autograd node whose
inputs are every rank's differentiable arguments and whose outputs are every rank's
results. ``shard_map``'s backward is then one pass of torch's engine over all ranks'
graphs, with no switching between ranks but inside these nodes: a node's backward runs
each rank's ``bwd`` as a greenlet, so a ``bwd`` that calls collectives (every
collective's transpose is one) meets the other ranks' there.

Residuals are kept on the node (not ``save_for_backward``): they are freed after the
backward unless the graph is retained, as saved tensors are.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from ..comm import comm_of
from ..comm._torch_state import saved_tensor_hooks
from ..comm.stats import in_backward
from ..comm.threads import in_rank_greenlet
from ..core._engine import keep_graph
from ..core.errors import SpecError

__all__ = ["mesh_call", "node_info"]


def mesh_call(rule: Any, run: Any, args: tuple, stash: Any) -> Any:
    """``rule(*args)`` on this rank, joined with the other ranks' calls into one node.

    The ranks meet by position: each rank's k-th such call joins the others' k-th, which
    may be another rule (a rank with an empty shard takes another path through an op
    than its peers, with the same collectives). A rank whose arguments need no gradient
    meets the others too: if another rank's do, the node's outputs are its results as
    well, so the cotangent of a replicated output reaches every rank's ``bwd``.
    ``stash``: where custom_vjp's ``needs_input_grad()`` reads from."""
    with torch.no_grad():
        out, res = rule.fwd(*args)
    hooks = saved_tensor_hooks()
    if hooks is not None:
        # What save_for_backward would do with this rank's hooks (they are this rank's:
        # the node is made on whichever rank arrives last).
        res = _Packed(res, *hooks)
    return run.meet("custom_vjp", (rule, args, out, res),
                    lambda items: _node(run.mesh, items, stash))


class _Packed:
    """Residuals packed by the saved-tensor hooks of the rank that made them."""

    __slots__ = ("leaves", "spec", "unpack")

    def __init__(self, res: Any, pack: Any, unpack: Any):
        leaves, self.spec = optree.tree_flatten(res, none_is_leaf=True)
        self.leaves = [(True, pack(t)) if isinstance(t, torch.Tensor) else (False, t)
                       for t in leaves]
        self.unpack = unpack

    def get(self) -> Any:
        return optree.tree_unflatten(self.spec, [self.unpack(v) if packed else v
                                                 for packed, v in self.leaves])


class _Info:
    __slots__ = ("mesh", "ranks", "items", "pos", "metas", "n_in", "n_outs", "stash")

    def __init__(self, mesh, ranks, items, pos, n_in, stash):
        self.mesh, self.ranks, self.items, self.pos = mesh, ranks, items, pos
        self.stash = stash
        self.metas: list[tuple] = []  # every output's (shape, dtype, device), rank order
        self.n_in = n_in
        self.n_outs: dict[int, int] = {}


def _node(mesh: Any, items: dict[int, tuple], stash: Any) -> dict[int, Any]:
    ranks = sorted(items)
    flat_in: list[torch.Tensor] = []
    pos: dict[int, list[int | None]] = {}
    for r in ranks:
        rule, args = items[r][0], items[r][1]
        nondiff = rule.nondiff_argnums
        p = []
        for i, a in enumerate(args):
            if i not in nondiff and isinstance(a, torch.Tensor) and a.requires_grad:
                p.append(len(flat_in))
                flat_in.append(a)
            else:
                p.append(None)
        pos[r] = p
    if not flat_in:
        return {r: items[r][2] for r in ranks}
    # Only what backward needs stays: the rule, the arguments' values for its
    # nondiff_argnums and whether each needs a gradient, the residuals.
    kept = {}
    for r in ranks:
        rule, args, out, res = items[r]
        kept[r] = (rule, [args[i] for i in rule.nondiff_argnums],
                   tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args),
                   res, out)
    outs = _MeshVJP.apply(_Info(mesh, ranks, kept, pos, len(flat_in), stash), *flat_in)
    result, k = {}, 0
    for r in ranks:
        out = items[r][2]
        n = len(out) if isinstance(out, tuple) else 1
        mine = outs[k:k + n]
        k += n
        result[r] = tuple(mine) if isinstance(out, tuple) else mine[0]
    return result


class _MeshVJP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, info: _Info, *flat_in):
        ctx.set_materialize_grads(False)
        outs = []
        for r in info.ranks:
            rule, nd, needs, res, out = info.items[r]
            mine = out if isinstance(out, tuple) else (out,)
            info.n_outs[r] = len(mine)
            for o in mine:
                outs.append(o)
                info.metas.append((o.shape, o.dtype, o.device))
            info.items[r] = (rule, nd, needs, res, isinstance(out, tuple))
        nondiff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        ctx.info = info
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        from ..comm.rank_greenlets import run_ranks

        info = node_info(ctx)
        if not comm_of(info.mesh).one_pass:
            # Each rank's backward on its own thread (shard_map chose it: the forward
            # installed backward code of its own that communicates): this rank's part.
            return _one_rank(info, grads)
        if not keep_graph():
            ctx.info = None
        per, k = {}, 0
        for r in info.ranks:
            tup = info.items[r][4]
            gs = []
            for j in range(k, k + info.n_outs[r]):
                g = grads[j]
                if g is None:  # every rank runs its bwd: its collectives meet the others'
                    shape, dt, dev = info.metas[j]
                    g = torch.zeros(shape, dtype=dt, device=dev)
                gs.append(g)
            k += info.n_outs[r]
            per[r] = tuple(gs) if tup else gs[0]
        got = dict(zip(info.ranks, run_ranks(info.mesh, info.ranks,
                                             lambda r: _bwd(info, r, per[r]))))
        return (None, *_flat(info, got))


def node_info(ctx: Any) -> Any:
    """The ``info`` of a node over several ranks whose backward runs now: refused inside
    a body (one rank's backward), and after the graph was freed."""
    _refuse_body_backward()
    if ctx.info is None:
        raise RuntimeError("Trying to backward through the graph a second time (or "
                           "directly access saved tensors after they have already been "
                           "freed); specify retain_graph=True if you need to")
    return ctx.info


def _refuse_body_backward() -> None:
    """A node over every rank cannot be differentiated by one rank's backward."""
    if in_rank_greenlet():
        # The engine runs on one rank greenlet, inside a body: a per-rank backward,
        # whose collectives would need the other ranks inside torch's engine at the
        # same time, which torch keeps per OS thread.
        raise SpecError(
            "a backward taken inside a shard_map body (torch.autograd.grad, "
            ".backward() or torch.func on a rank) through spmd collectives needs a "
            "thread per rank: run this shard_map on Mesh(..., schedule='threads'); "
            "on rank greenlets a body's collectives are one autograd node over all "
            "ranks, differentiated by the backward of the whole call")


def _bwd(info: _Info, r: int, g: Any) -> tuple:
    """Rank ``r``'s rule's ``bwd`` for cotangent ``g``, checked like custom_vjp's."""
    _stash = info.stash
    rule, nd, needs, res, _ = info.items[r]
    if isinstance(res, _Packed):
        res = res.get()
    name = rule.fun.__name__
    prev = _stash.get("needs")
    _stash.needs = needs
    try:
        with in_backward():
            got = rule.bwd(*nd, res, g)
    finally:
        _stash.needs = prev
    if not isinstance(got, (tuple, list)):
        raise TypeError(f"custom_vjp {name!r}: bwd must return a tuple, got "
                        f"{type(got).__name__}")
    n_diff = len(needs) - len(rule.nondiff_argnums)
    if len(got) != n_diff:
        raise TypeError(f"custom_vjp {name!r}: bwd returned {len(got)} gradients for "
                        f"{n_diff} differentiable arguments")
    return got


def _flat(info: _Info, got: dict[int, tuple]) -> list[torch.Tensor | None]:
    """The ranks' gradients (``got``) in the node's input order."""
    flat: list[torch.Tensor | None] = [None] * info.n_in
    for r, grads in got.items():
        nondiff = info.items[r][0].nondiff_argnums
        it = iter(grads)
        for i, p in enumerate(info.pos[r]):
            g = None if i in nondiff else next(it)
            if p is not None:
                flat[p] = g
    return flat


def _one_rank(info: _Info, grads: tuple) -> tuple:
    """The backward of the rank whose thread runs it: its outputs' cotangents in,
    gradients for its inputs only; the other ranks' threads run theirs."""
    from ..core._context import current

    r = current("a custom_vjp rule's backward").rank
    if r not in info.ranks:
        return (None,) * (1 + info.n_in)
    k = 0
    for q in info.ranks:
        if q == r:
            break
        k += info.n_outs[q]
    gs = []
    for j in range(k, k + info.n_outs[r]):
        g = grads[j]
        if g is None:
            shape, dt, dev = info.metas[j]
            g = torch.zeros(shape, dtype=dt, device=dev)
        gs.append(g)
    got = _bwd(info, r, tuple(gs) if info.items[r][4] else gs[0])
    return (None, *_flat(info, {r: got}))
