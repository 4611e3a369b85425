"""Numbers a converted forward computes from a split dim's size that Python made plain.

Inside a converted forward, ``x.shape[d]`` of a split dim is this rank's share: a
``LocalSize`` (``_tags.py``) that follows arithmetic on it, so that ``x / x.shape[2]``
is refused. Python turns it into a plain number where no int subclass can follow:
``float(h)``, ``math.sqrt(h)``, ``0.5 * h``, ``1.0 / h``, ``int(h * 1.5)``. Such a number
changes with the size it came from, so the plan runs twice: once with the split dims'
sizes shifted (recording, call by call, the plain ints and floats each torch call is
given), then as the plan itself, comparing. A number that differs is refused at its call
site; a forward that makes other calls at the other sizes (a Python branch or loop on a
split dim's size) is refused where the two part.

No number is exempt by position: a plain number in a shape (``x.view(b, c, int(h), w)``,
``torch.zeros(int(h))``) cannot be told from a global size either, and would make a whole
dim of a share's size; ``x.shape[d]`` passed as it is stays a ``LocalSize``, which the
rules check; a branch on it (``if h > 64:``) decides on the global size (``_tags.py``).
Not seen: plain numbers and branches on them that agree at both sizes (``int(h) % 8``),
and the calls after a branch on data, where both plans stop (the run has one size to
compare with).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import rules
from ._tags import _Tracked

__all__ = ["Sizes"]

_FIX = ("compute it from the global size (a constant, or an argument of the model), or "
        "pass x.shape[d] itself, which convert follows")


class Sizes:
    """The plain numbers each torch call of a plan is given: recorded in a plan at
    shifted sizes (``calls``), then compared call by call in the plan itself (``mine``).

    A difference is a refusal only once a third run, at the plan's own sizes, gives the
    plan's numbers again (``confirm``): a number that changes from run to run for another
    reason (a counter outside the model, the clock) is not the size's doing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []
        self.mine: list[tuple[str, list]] = []
        self.recording = True
        self.finished = False  # the recording plan ran its forward to the end
        self.off = False  # stopped comparing (the two plans parted, or the other stopped)
        self.found: list[tuple[int, Any]] = []  # (call index, the plan's entry)

    def compare(self) -> None:
        """Stop recording; start comparing."""
        self.recording = False

    def see(self, run: Any, func: Any, args: tuple, kwargs: dict, poisoned: bool) -> str:
        """Record (first plan) or compare (second) one call: the problem, or ''."""
        name = rules.op_name(func)
        nums = _numbers(args, kwargs)
        if self.recording:
            self.calls.append((name, nums))
            return ""
        k = len(self.mine)
        self.mine.append((name, nums))
        if self.off:
            return ""
        if k >= len(self.calls):
            self.off = True  # the other plan stopped (it raised) or ended before this call
            return _parted(run, "is reached here, where the same forward planned with other "
                           "sizes of the split dims has ended") if self.finished else ""
        other, theirs = self.calls[k]
        if other != name:
            self.off = True
            return _parted(run, f"is reached here, where the same forward planned with other "
                                f"sizes of the split dims calls {other}")
        if poisoned:
            return ""  # after a refused call: that refusal says it
        if len(nums) != len(theirs):
            return (f"is given {len(nums)} numbers here and {len(theirs)} with other sizes of "
                    f"the split dims (a list built from a split dim's size): each rank would "
                    f"build it from its own share; {_FIX}")
        for (label, a), (_, b) in zip(nums, theirs):
            if a != b and not (a != a and b != b):  # NaN is NaN at both sizes
                at = f", {a:.6g} at the global sizes" if run.plan is not None and \
                    run.plan.global_sizes else ""
                return (f"is given {label} computed from a split dim's size (it changes with "
                        f"that size{at}): Python made x.shape[d] a plain number (float(), "
                        f"int(), math.*, a float on the left), which each rank would compute "
                        f"from its own share; {_FIX}")
        return ""

    def end(self, run: Any) -> str:
        """After the second plan's forward: the problem if the first went on, or ''."""
        if self.off or self.recording or len(self.mine) >= len(self.calls) or run.plan is None:
            return ""
        other = self.calls[len(self.mine)][0]
        return _parted(run, f"ends here, where planned with other sizes of the split dims it "
                            f"goes on to call {other}")

    def confirm(self, entries: list, again: Callable[[], Sizes]) -> None:
        """Keep the refusals ``found`` (in ``entries``, the plan's) whose call a run at the
        plan's own sizes (``again()``, recording) makes with the same numbers."""
        if not self.found:
            return
        other = again()
        for k, e in self.found:
            if k < len(self.mine):
                same = k < len(other.calls) and other.calls[k] == self.mine[k]
            else:  # the plan ended where the shifted one went on
                same = len(other.calls) == k and other.finished
            if not same:
                entries.remove(e)


def _parted(run: Any, text: str) -> str:
    if run.plan is not None and run.plan.refused:
        return ""  # the refusals already there come first: this may follow from them
    return (f"{text}: a Python loop or branch on a split dim's size (range(x.shape[d]), "
            f"if x.shape[d] ...:) runs with each rank's own share; loop or decide on the "
            f"global size, or keep such code out of the converted forward")


def _numbers(args: tuple, kwargs: dict) -> list[tuple[str, int | float]]:
    """The plain ints and floats (not bools, not tracked sizes) in a call's arguments,
    with a label for messages."""
    out: list[tuple[str, int | float]] = []
    for a in args:
        _collect(a, "a number", out)
    for k, v in kwargs.items():
        _collect(v, f"{k}=", out)
    return out


def _collect(a: Any, label: str, out: list) -> None:
    if isinstance(a, (bool, _Tracked, torch.Tensor)) or a is None:
        return
    if isinstance(a, (int, float)):
        out.append((label, a))
    elif isinstance(a, (tuple, list)):  # torch.Size too: a whole tensor's, or a list's
        for v in a:
            _collect(v, label, out)
    elif isinstance(a, slice):
        for v in (a.start, a.stop, a.step):
            _collect(v, "an index", out)
