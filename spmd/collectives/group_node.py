"""A collective on the simulated mesh as ONE autograd node over its group, made in the
collective's own rendezvous: ``psum`` (and every sum built on it), ``all_gather``,
``psum_scatter`` and ``ppermute``.

On rank greenlets (``Mesh(schedule="greenlets")``) a ``custom_vjp`` call is a node over
every rank (``mesh_vjp``): each rank runs the rule, the ranks meet a second time, and
the node's backward runs every rank's ``bwd`` as a greenlet, whose transpose
collective meets once more. A linear collective needs none of that: the last member to
arrive already holds every member's input, so it computes the result once and makes
the node there (inputs: the members' tensors that need a gradient; outputs: a private
copy of the result for every member that asks), and the node's backward applies the
transpose to the members' cotangents itself, with no greenlet. The results are those
of the ``custom_vjp`` path bit for bit (the same sums in the same member order), in one
rendezvous instead of two forward and one backward; communication accounting counts
every member's forward and backward collective as that path does.

Used where the calling rank is a greenlet whose backward is one pass (not per rank),
grad mode is on, the input is floating or complex, and neither a torch.func transform
nor activation checkpointing is active; elsewhere the collective is its ``custom_vjp``.
A member that calls it in ``no_grad`` gets a plain copy, and its input is a constant
for the others' gradients (it was computed without a graph).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import comm_of
from ..comm._torch_state import functorch_active
from ..comm.stats import count, in_backward
from ..comm.threads import Outputs, _copy, _reduce, _tls as _comm_tls
from ..core._context import RankContext
from ..core._engine import keep_graph
from ..core.mesh import Group
from .mesh_vjp import node_info
from .vjp import _checkpointing

__all__ = ["wants_node", "node_psum", "node_all_gather", "node_ppermute", "node_psum_scatter"]


def wants_node(x: torch.Tensor) -> bool:
    """Whether this rank's collective of ``x`` is made one node over its group here."""
    if not torch.is_grad_enabled() or not (x.is_floating_point() or x.is_complex()):
        return False
    run = _comm_tls.get("green")
    if run is None or run.per_rank_backward or functorch_active():
        return False
    return not _checkpointing()  # a checkpointed region recomputes per rank


def node_psum(x: torch.Tensor, axes: tuple[str, ...], rc: RankContext, name: str
              ) -> torch.Tensor:
    """This rank's ``psum`` of ``x`` over ``axes``, one node with the group's other
    members that ask for it. Transpose: the sum of the members' cotangents."""
    mesh = rc.mesh
    group = mesh.group(axes, rc.rank)

    def build(xs: list, total: torch.Tensor, asking: list[int]) -> Outputs:
        def transpose(gs: list[torch.Tensor], ins: list) -> list[torch.Tensor]:
            g = _reduce(gs, "sum")
            return [g if k == len(ins) - 1 else g.clone() for k in range(len(ins))]
        return _build(_Info(mesh, axes, group, asking, _each(xs, asking), xs, transpose,
                            lambda member, g: count("all_reduce", name, member, x=g)), total)

    return comm_of(mesh).all_reduce(x, "sum", group, name=name, node=build)


def node_ppermute(x: torch.Tensor, axes: tuple[str, ...], rc: RankContext,
                  pairs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """This rank's ``ppermute`` of ``x`` (zeros where no pair sends to it), one node with
    the group's other members that ask for it. Transpose: the cotangent of each source's
    destination, sent back (zeros for a rank that sends nothing)."""
    mesh = rc.mesh
    group = mesh.group(axes, rc.rank)
    src = {d: s for s, d in pairs}
    dst = {s: d for s, d in pairs}
    back = tuple((d, s) for s, d in pairs)  # what each member's backward permutes

    def build(xs: list, same: list, asking: list[int]) -> Outputs:
        def received(i: int, device: torch.device) -> torch.Tensor | None:
            return _copy(xs[src[i]], device) if i in src else None

        def transpose(gs: list[torch.Tensor], ins: list) -> list[torch.Tensor]:
            return [_copy(gs[dst[j]], x.device) if j in dst else torch.zeros_like(gs[j])
                    for j, x in ins]
        outs = {i: received(i, xs[i].device) if i in src else torch.zeros_like(xs[i])
                for i in asking}
        return _node(_Info(mesh, axes, group, asking, _each(xs, asking), xs, transpose,
                           lambda member, g: count("permute", "ppermute", member, x=g,
                                                   pairs=back)),
                     outs, [(x.shape, x.dtype) for x in xs], received)

    return comm_of(mesh).permute(x, group, pairs, name="ppermute", node=build)


def node_all_gather(x: torch.Tensor, axes: tuple[str, ...], rc: RankContext, axis: int,
                    sizes: tuple[int, ...] | None, name: str) -> torch.Tensor:
    """This rank's tiled ``all_gather`` of ``x`` along ``axis`` (untiled: pass
    ``x.unsqueeze(axis)`` and one-sizes), one node with the group's other members that
    ask for it. Transpose: member i's block of the sum of the members' cotangents
    (``psum_scatter``)."""
    mesh = rc.mesh
    group = mesh.group(axes, rc.rank)

    def build(xs: list, parts: list, asking: list[int]) -> Outputs:
        dev = xs[0].device
        total = torch.cat([_on(p, dev) for p in parts], axis)
        got = [p.shape[axis] for p in parts]
        starts = [sum(got[:i]) for i in range(len(got))]

        def transpose(gs: list[torch.Tensor], ins: list) -> list[torch.Tensor]:
            return [_reduce([g.narrow(axis, starts[i], got[i]) for g in gs], "sum")
                    for i, _ in ins]

        def counted(member: Group, g: torch.Tensor) -> None:  # as psum_scatter counts
            count("reduce_scatter", "psum_scatter", member, chunks=list(g.split(got, axis)))
        return _build(_Info(mesh, axes, group, asking, _each(xs, asking), xs, transpose,
                            counted), total)

    return comm_of(mesh).all_gather(x, group, axis, name=name, sizes=sizes, node=build)


def node_psum_scatter(chunks: list[torch.Tensor], axes: tuple[str, ...], rc: RankContext,
                      d: int, tiled: bool) -> torch.Tensor:
    """This rank's block of the sum of the members' ``chunks`` (``x`` split along ``d``,
    or unbound where not ``tiled``), one node with the group's other members that ask
    for it. Transpose: member i's cotangent to chunk i of every member
    (``all_gather``)."""
    mesh = rc.mesh
    group = mesh.group(axes, rc.rank)

    def build(cs: list, same: list, asking: list[int]) -> Outputs:
        n = len(cs)
        sums = [_reduce([c[i] for c in cs], "sum") for i in range(n)]  # each its own
        # the node's inputs: every asking member's blocks, and which block each is
        block = [(j, i, c) for j in asking for i, c in enumerate(cs[j]) if c.requires_grad]
        ins = [(j, c) for j, _, c in block]

        def transpose(gs: list[torch.Tensor], ins: list) -> list[torch.Tensor]:
            # block i of every member gets a copy of member i's cotangent
            return [_copy(gs[i], c.device) for _, i, c in block]
        # each sum is one member's alone: no copy
        outs = {i: _on(sums[i], cs[i][0].device) for i in asking}

        def counted(member: Group, g: torch.Tensor) -> None:  # as all_gather counts
            count("all_gather", "all_gather", member, x=g if tiled else g.unsqueeze(d))

        return _node(_Info(mesh, axes, group, asking, ins, [c[0] for c in cs], transpose,
                           counted),
                     outs, [(t.shape, t.dtype) for t in sums],
                     lambda i, device: _on(sums[i], device))

    return comm_of(mesh).reduce_scatter(chunks, "sum", group, name="psum_scatter", node=build)


class _Info:
    """One node: its group, inputs, outputs and transpose, for the backward."""

    __slots__ = ("mesh", "axes", "group", "asking", "ins", "devices", "outs", "out_meta",
                 "transpose", "count")

    def __init__(self, mesh, axes: tuple[str, ...], group: Group, asking: list[int],
                 ins: list[tuple[int, torch.Tensor]], xs: list[torch.Tensor],
                 transpose: Callable[[list[torch.Tensor], list], list[torch.Tensor]],
                 count: Callable[[Group, torch.Tensor], None]):
        self.mesh, self.axes, self.group, self.asking = mesh, axes, group, asking
        self.ins = ins  # (member, tensor): the node's inputs, those needing a gradient
        self.devices = [t.device for t in xs]  # each member's
        self.transpose = transpose  # member cotangents -> the gradients of ins
        self.count = count  # records a member's backward collective (comm_stats)
        self.outs: list[torch.Tensor] = []
        self.out_meta: list[tuple] = []  # every member's output (shape, dtype)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def _each(xs: list[torch.Tensor], asking: list[int]) -> list[tuple[int, torch.Tensor]]:
    """The node's inputs where each member passes one tensor: those needing a gradient."""
    return [(i, xs[i]) for i in asking if xs[i].requires_grad]


def _build(info: _Info, total: torch.Tensor) -> Outputs:
    """Run once, by the last member to arrive, for a collective whose every member gets
    ``total``: the asking members' outputs, one node over them if any of their inputs
    needs a gradient."""
    asking, n = info.asking, len(info.devices)
    # Every output is a tensor of its own, on its member's device (one member may write
    # to its result in place); the result itself goes to one asking member when every
    # member asks.
    outs = {i: (total if i == asking[-1] and len(asking) == n and
                info.devices[i] == total.device else _copy(total, info.devices[i]))
            for i in asking}
    return _node(info, outs, [(total.shape, total.dtype)] * n,
                 lambda i, device: _copy(total, device))


def _node(info: _Info, outs: dict[int, torch.Tensor], out_meta: list[tuple],
          rest: Callable) -> Outputs:
    """The node over the asking members' ``outs`` (each a tensor of its own), if any of
    their inputs needs a gradient; ``out_meta``: every member's output (shape, dtype);
    ``rest``: the result of a member that did not ask."""
    if not info.ins:
        return Outputs(outs, rest)
    run = _comm_tls.get("green")
    if run is not None:
        run.nodes += 1  # a later per-rank backward request is refused (threads.py)
    info.outs = [outs[i] for i in info.asking]
    info.out_meta = out_meta
    with torch.enable_grad():  # the last to arrive may be a member in no_grad
        got = _GroupNode.apply(info, *[t for _, t in info.ins])
    return Outputs(dict(zip(info.asking, got)), rest)


class _GroupNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, info: _Info, *inputs):
        ctx.set_materialize_grads(False)
        ctx.info = info
        outs, info.outs = info.outs, []  # made by _build; the node holds no reference
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        info = node_info(ctx)
        if not comm_of(info.mesh).one_pass:  # per_rank_backward refuses once nodes exist
            raise RuntimeError("spmd: a collective's node over rank greenlets met a "
                               "per-rank backward; please report this")
        if torch.is_grad_enabled():  # shard_map refuses create_graph before this
            raise RuntimeError("spmd: differentiating a collective's gradient on rank "
                               "greenlets (create_graph=True) is not supported")
        if not keep_graph():
            ctx.info = None
        group, n = info.group, len(info.devices)
        got = dict(zip(info.asking, grads))
        gs = []
        with in_backward():
            for i in range(n):
                g = got.get(i)
                if g is None:  # no cotangent, or a member that did not ask: zeros
                    shape, dt = info.out_meta[i]
                    g = torch.zeros(shape, dtype=dt, device=info.devices[i])
                if i in got:  # the members whose backward runs the transpose
                    info.count(info.mesh.group(info.axes, group.ranks[i]), g)
                gs.append(g)
        gx = [_on(t, x.device) for t, (_, x) in zip(info.transpose(gs, info.ins), info.ins)]
        return (None, *gx)
