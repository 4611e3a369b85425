"""The plan's communicating steps, checked as a converted forward runs.

The plan records, in order, every call it swaps for a twin that communicates and every
layer it does not look into (kind, call, source line): its *steps*. A real call
compares each step it is about to run with the plan's next one, on this rank alone (no
message): a rank whose run leaves the plan (a branch on Python state that differs
between ranks, an extra or a missing collective) raises a ``SpecError`` naming the line
and the step the plan expected, before the step sends anything, and tells the other
ranks (``Comm.leave``: threads abort the run's pending collectives, processes send the
group's next envelope as one that says so), which raise ``CommAborted`` instead of
waiting for the timeout. Past the end of a plan that stopped at a data-dependent branch
nothing is checked.

    >>> import torch, spmd
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv = nn.Conv2d(1, 1, 3, padding=1)
    ...     def forward(self, x):
    ...         return self.conv(x).mean((2, 3))
    >>> mesh = spmd.Mesh((2,), ("sp",))
    >>> s = spmd.P(None, None, "sp")
    >>> net = spmd.nn.convert(Net(), mesh, s, example=(1, 1, 8, 4))
    >>> [(k, c) for k, c, _ in net.spmd_plan.steps]
    [('swapped', 'torch.conv2d'), ('swapped', 'mean')]
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..comm import comm_of
from ..core._context import current_rank
from ..core.errors import SpecError

if TYPE_CHECKING:
    from .interpreter import Plan, _Run

__all__ = ["STEP_KINDS", "step", "finished", "leave"]

#: The plan entries that are steps: a twin that communicates, a layer not looked into.
STEP_KINDS = frozenset({"swapped", "allowed"})


def step(run: _Run, kind: str, call: str) -> None:
    """Step ``kind``/``call`` at this line: recorded in a plan, compared in a real call."""
    if kind not in STEP_KINDS or run.in_backward or run.aside:
        return
    if run.plan is not None:
        run.plan.steps.append((kind, call, run.where()))
        return
    plan = run.expected
    if plan is None:
        return
    k = run.step
    here = (kind, call, run.where())
    if k < len(plan.steps):
        if plan.steps[k] == here:
            run.step = k + 1
            return
        raise _left(run, plan, k, f"it is about to run {_say(here)}, where the plan's "
                                  f"step #{k} is {_say(plan.steps[k])}")
    if plan.incomplete:
        return  # past where the plan stopped: not checked
    raise _left(run, plan, k, f"it is about to run {_say(here)}, but the plan has no step "
                              f"#{k} (it has {len(plan.steps)})")


def finished(run: _Run) -> None:
    """The forward ended: every step of the plan must have run (a missing collective)."""
    plan = run.expected
    if plan is None or run.step >= len(plan.steps):
        return
    k = run.step
    raise _left(run, plan, k, f"its forward ended after {k} of the plan's "
                              f"{len(plan.steps)} steps; the plan's step #{k} is "
                              f"{_say(plan.steps[k])}")


def leave(run: _Run, exc: BaseException) -> None:
    """Tell the other ranks that this rank stops (it left the plan, or was told that
    another did), so that they raise instead of waiting; best effort."""
    left = getattr(exc, "plan_left", None)
    if left is None or getattr(exc, "plan_told", False):
        return
    exc.plan_told = True
    fn = getattr(comm_of(run.mesh), "leave", None)
    if fn is not None:
        try:
            fn(left[0], left[1], exc)
        except Exception:  # noqa: BLE001 - this rank's own error is the one to raise
            pass


def _left(run: _Run, plan: Plan, k: int, what: str) -> SpecError:
    rank = current_rank(run.mesh)
    e = SpecError(
        f"convert: rank {rank} left the plan of {plan.model}'s forward at its "
        f"communicating step #{k}: {what}. Every rank must run the plan's steps in "
        f"order: a branch on Python state that differs between ranks (or on data) makes "
        f"them call different collectives. Nothing of this step was sent; the other "
        f"ranks stop with CommAborted naming rank {rank}")
    e.plan_left = (rank, k)
    return e


def _say(s: tuple[str, str, str]) -> str:
    kind, call, where = s
    return f"{call} {where}" if kind == "swapped" else f"{call} (not looked into) {where}"
