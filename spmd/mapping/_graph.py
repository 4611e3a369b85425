"""The autograd side of ``shard_map``: the parameters a body's graph reaches, and the
one node whose backward runs every rank's backward."""
from __future__ import annotations


import torch

from ..comm._torch_state import next_sequence_nr as _peek


def _graph_leaves(roots: list[torch.Tensor], exclude: set[int], found: dict[int, torch.Tensor],
                  seq0: int | None = None) -> bool:
    """Leaves needing grad reached from ``roots``' graphs, excluding ``exclude`` ids, go
    into ``found``. Returns whether the walk reached a node numbered below ``seq0`` (see
    ``_reaches_older_nodes``; False without ``seq0``)."""
    stack, seen, older = [], set(), False
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad and id(t) not in exclude:
            found.setdefault(id(t), t)
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        v = getattr(fn, "variable", None)
        if v is not None:
            if id(v) not in exclude:
                found.setdefault(id(v), v)
            continue
        if seq0 is not None and not older and fn._sequence_nr() < seq0:
            older = True
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return older


def _next_node_number() -> int | None:
    """The creation number the next autograd node of this thread gets (per-thread and
    increasing: the nodes the body makes have this number or more)."""
    if _peek is not None:
        return _peek()
    node = (torch.zeros((), requires_grad=True) * 1).grad_fn
    number = getattr(node, "_sequence_nr", None)
    return None if number is None else number() + 1


def _reaches_older_nodes(roots: list[torch.Tensor], seq0: int) -> bool:
    """Whether the body's graph reaches a node made before the body ran (a tensor the
    body closes over that the caller computed, ``sin(w)``): the caller's graph may need
    that node's saved tensors after this backward, so the body's graph must be kept."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen or fn is None:
            continue
        seen.add(id(fn))
        if hasattr(fn, "variable"):  # a leaf's AccumulateGrad: nothing saved
            continue
        if fn._sequence_nr() < seq0:
            return True
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return False


class _Node(torch.autograd.Function):
    """The whole shard_map call as one node: backward runs all ranks' backwards."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        # The ranks' outputs and anchors are the roots of their graphs: saved here, not
        # kept by the state, so that autograd frees every rank's graph with this node's
        # saved tensors after a backward (unless retain_graph), and refuses a second
        # backward as it would for one device.
        roots, where = [], []
        for pos, outs in enumerate(state.local_outs):
            for k, t in enumerate(outs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    roots.append(t)
                    where.append(("out", pos, k))
        for pos, anchors in enumerate(state.anchors):
            for k, a in enumerate(anchors):
                roots.append(a)
                where.append(("anchor", pos, k))
        ctx.save_for_backward(*roots)
        ctx.where = where
        state.local_outs = [[None] * len(outs) for outs in state.local_outs]
        state.anchors = [[None] * len(a) for a in state.anchors]
        outs = tuple(state.node_vals)
        state.node_vals = None
        nondiff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return outs

    @staticmethod
    def backward(ctx, *gouts):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "shard_map: differentiating its gradient (create_graph=True, double "
                "backward) is not supported; take the second derivative inside the body "
                "(torch.func or torch.autograd.grad on each rank), or outside shard_map")
        saved = ctx.saved_tensors  # raises torch's own error on a second backward
        state = ctx.state
        outs = [list(o) for o in state.local_outs]
        anchors = [list(a) for a in state.anchors]
        for (kind, pos, k), t in zip(ctx.where, saved):
            (outs if kind == "out" else anchors)[pos][k] = t
        grads = state.backward(gouts, outs, anchors)
        return (None,) + tuple(grads)
