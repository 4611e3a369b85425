"""What torch's autograd engine is doing, asked of it where it only answers privately."""
from __future__ import annotations

import torch

__all__ = ["keep_graph"]


def keep_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``): then the
    ranks' graphs are kept too. Otherwise, in per-rank code, each node of the body's
    graph frees what it saved as soon as it has run, as on one device (keeping them all
    to the end of the backward cost 16% of the demo CNN's peak memory).

    torch answers only through private calls, the ones AOTAutograd uses for the same
    questions (as comm/_torch_state.py does for node numbers); where one is missing, the graphs are
    kept: exact, with more memory."""
    ask = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if ask is None else bool(ask())
