"""``psum`` on the simulated mesh as ONE autograd node over a group's ranks, made in its
own rendezvous.

On rank greenlets (``Mesh(schedule="greenlets")``) a ``custom_vjp`` call is a node over
every rank (``mesh_vjp``): each rank runs the rule, the ranks meet a second time, and
the node's backward runs every rank's ``bwd`` as a greenlet, whose transpose
collective meets once more. A sum needs none of that: the last member to arrive in
the all_reduce already holds every member's input, so it makes the node there (inputs:
the members' tensors that need a gradient; outputs: every asking member's result),
and the node's backward sums the members' cotangents itself, in member order, with no
greenlet at all. The result is what ``custom_vjp``'s path gives, bit for bit, in one
rendezvous instead of two forward and one backward.

Used when the calling rank is a greenlet whose backward is one pass (not per rank),
grad mode is on, the input is floating or complex, and neither a torch.func transform
nor activation checkpointing is active; elsewhere ``psum`` is its ``custom_vjp``.
"""
from __future__ import annotations

import torch

from ..comm import comm_of
from ..comm._torch_state import functorch_active
from ..comm.stats import count, in_backward
from ..comm.threads import Outputs, _copy, _reduce, _tls as _comm_tls
from ..core._context import RankContext
from ..core._engine import keep_graph
from .mesh_vjp import refuse_body_backward

__all__ = ["wants_node", "node_psum"]


def wants_node(x: torch.Tensor) -> bool:
    """Whether this rank's ``psum`` of ``x`` is made one node over its group here."""
    if not torch.is_grad_enabled() or not (x.is_floating_point() or x.is_complex()):
        return False
    run = _comm_tls.get("green")
    if run is None or run.per_rank_backward or functorch_active():
        return False
    from .vjp import _checkpointing  # a checkpointed region recomputes per rank
    return not _checkpointing()


def node_psum(x: torch.Tensor, axes: tuple[str, ...], rc: RankContext, name: str
              ) -> torch.Tensor:
    """This rank's ``psum`` of ``x`` over ``axes``, one node with the group's other
    members that ask for it."""
    mesh = rc.mesh
    group = mesh.group(axes, rc.rank)

    def build(xs: list, total: torch.Tensor, asking: list[int]) -> Outputs:
        return _build(mesh, axes, group, name, xs, total, asking)

    return comm_of(mesh).all_reduce(x, "sum", group, name=name, node=build)


def _build(mesh, axes, group, name, xs, total, asking) -> Outputs:
    """Run once, by the last member to arrive: the asking members' outputs, one node
    over them if any of their inputs needs a gradient."""
    n = len(xs)
    # Every output is a tensor of its own, on its member's device (one member may write
    # to its result in place); the sum itself goes to one asking member when every
    # member asks.
    outs = {i: (total if i == asking[-1] and len(asking) == n and
                xs[i].device == total.device else _copy(total, xs[i].device))
            for i in asking}
    inputs = [i for i in asking if xs[i].requires_grad]
    if not inputs:
        return Outputs(total, outs)
    info = _Info(mesh, axes, group, name, asking, inputs,
                 [(xs[i].shape, xs[i].dtype, xs[i].device) for i in range(n)])
    run = _comm_tls.get("green")
    if run is not None:
        run.nodes += 1  # a later per-rank backward request is refused (threads.py)
    info.outs = [outs[i] for i in asking]
    with torch.enable_grad():  # the last to arrive may be a member in no_grad
        got = _SumNode.apply(info, *[xs[i] for i in inputs])
    return Outputs(total, dict(zip(asking, got)))


class _Info:
    __slots__ = ("mesh", "axes", "group", "name", "asking", "inputs", "metas", "outs")

    def __init__(self, mesh, axes, group, name, asking, inputs, metas):
        self.mesh, self.axes, self.group, self.name = mesh, axes, group, name
        self.asking, self.inputs, self.metas = asking, inputs, metas
        self.outs: list[torch.Tensor] = []


class _SumNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, info: _Info, *inputs):
        ctx.set_materialize_grads(False)
        ctx.info = info
        outs, info.outs = info.outs, []  # made by _build; the node holds no reference
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        refuse_body_backward()
        info = ctx.info
        if info is None:
            raise RuntimeError("Trying to backward through the graph a second time (or "
                               "directly access saved tensors after they have already been "
                               "freed); specify retain_graph=True if you need to")
        if not comm_of(info.mesh).one_pass:  # per_rank_backward refuses once nodes exist
            raise RuntimeError("spmd: a psum node over rank greenlets met a per-rank "
                               "backward; please report this")
        if not keep_graph():
            ctx.info = None
        group, n = info.group, len(info.metas)
        got = dict(zip(info.asking, grads))
        if torch.is_grad_enabled():  # shard_map refuses create_graph before this
            raise RuntimeError("spmd: differentiating a psum's gradient on rank greenlets "
                               "(create_graph=True) is not supported")
        gs = []
        with in_backward():
            for i in range(n):
                g = got.get(i)
                if g is None:
                    shape, dt, dev = info.metas[i]
                    g = torch.zeros(shape, dtype=dt, device=dev)
                if i in got:  # the members whose backward runs a psum
                    count("all_reduce", info.name,
                          info.mesh.group(info.axes, group.ranks[i]), x=g)
                gs.append(g)
        total = _reduce(gs, "sum")
        last = info.inputs[-1]
        gx = [total if i == last else total.clone() for i in info.inputs]
        gx = [g if g.device == info.metas[i][2] else g.to(info.metas[i][2])
              for g, i in zip(gx, info.inputs)]
        return (None, *gx)
