"""Anchors: every rank creates the autograd node of a collective, even without a gradient.

Part of the one autograd convention (see ``collectives``): a collective's backward is
itself a collective, so every rank must run it.
"""
from __future__ import annotations


import torch

from ..comm.threads import _tls as _comm_tls
from ..core._bodies import NO_TRACE, Body, bodies


class collect_anchors:
    """Collect the anchors that collectives create on this thread (see ``anchor``)."""

    def __enter__(self) -> list:
        body = Body(None, (), [], NO_TRACE)
        bodies().append(body)
        return body.anchors

    def __exit__(self, *exc) -> None:
        bodies().pop()


def hand_up(anchors: list) -> None:
    """Give ``anchors`` to the innermost enclosing body that keeps anchors (shard_map's
    in grad mode, whose backward asks for their gradients), if any."""
    for body in reversed(bodies()):
        if body.anchors is not None:
            body.anchors.extend(anchors)
            return


def anchor(x):
    """Make ``x`` require grad (as a detached copy) when grad mode is on and it doesn't.

    A collective's backward is itself a collective, so every rank must run it. A rank
    whose input needs no gradient (an empty shard, a constant) would create no
    autograd node and leave the others waiting; anchoring makes the node exist on
    every rank. shard_map asks autograd for the anchors' gradients too, so no rank's
    engine prunes the collective's backward.
    """
    if x.requires_grad or not torch.is_grad_enabled() or not (x.is_floating_point() or x.is_complex()):
        return x
    run = _comm_tls.get("green")
    if run is not None and not run.per_rank_backward:
        # On rank greenlets a collective is one node over every rank (mesh_vjp.py),
        # made when any rank's input needs a gradient, whose backward runs every
        # rank's: no rank needs a node of its own, and none is made when no rank's
        # input needs a gradient.
        return x
    try:
        a = x.detach().requires_grad_()
    except RuntimeError:  # inside a torch.func transform, which refuses requires_grad_
        return x
    hand_up([a])
    return a
