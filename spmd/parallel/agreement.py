"""What the ranks of a ``GradSync`` agree on, so that no bucket's all-reduce ever meets
one of another size (garbage on threads; gloo aborts the process) and every rank's
error names what differs.

A bucket's all-reduce carries no envelope of its own (it reduces the bucket in place,
and a check per bucket would cost a round trip per bucket). Its size follows from the
plan: the synchronised parameters (names, shapes, dtypes, the axes each is reduced
over) and the buckets made from them (caps, axes, order). So:

- ``check_plan``, once when GradSync is built: one small all_gather of ``[plan
  fingerprint, learning the order]`` over each group that reduces buckets. Ranks whose
  plans differ (a parameter that requires grad on one rank only, another
  ``bucket_cap_mb``, another ``learn_order``) raise a ``SpecError`` on every rank, each
  naming every rank's plan, before any bucket exists. The plan learned after the first
  backward is built from rank 0's order, broadcast: the same on every rank again.
- At every synchronised backward, with no round trip of its own: a parameter added,
  removed, replaced or reshaped afterwards (``param_set.py``) sets the *alarm* element
  that rides in every bucket's all-reduce (``buckets.py``; the bucket sizes are the
  plan's, which no change alters). Summed, it says how many ranks of the group changed;
  ``changed_error`` then exchanges what each found, so that every rank's error names the
  parameter. (A blocking check inside backward would deadlock with a collective that
  backward runs itself, a ``psum`` of a batch statistic, on ranks whose gradients arrive
  in another order: the buckets start asynchronously for that reason.)

Example:
    >>> params = [("w", (2, 3), torch.float32, ("dp",)), ("b", (2,), torch.float32, ("dp",))]
    >>> plan_summary(params, [[1, 0]], learning=False)
    "2 parameters ('w' (f32[2, 3]), 'b' (f32[2])) in 1 bucket of [8] elements"
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from ..comm import comm_of
from ..comm.stats import uncounted
from ..core._format import axis_phrase, shape_str
from ..core.errors import SpecError
from ..core.mesh import Group, Mesh

__all__ = ["plan_fingerprint", "plan_summary", "check_plan", "changed_error"]

FIX = ("the synchronised parameters (their count, names, shapes, dtypes and order) are "
       "fixed when GradSync is built, and a change would leave gradients unreduced or "
       "misplaced; build a new GradSync after changing the model (close() the old one), or "
       "set requires_grad before building it")
PLAN_FIX = ("every rank must synchronise the same parameters (requires_grad alike when "
            "GradSync is built) and pass the same axes, bucket_cap_mb, first_bucket_cap_mb "
            "and learn_order: each bucket's all-reduce must carry the same gradients on "
            "every rank")


def plan_fingerprint(axes: Mapping[str, str], params: Sequence[tuple], plan: Sequence[
        Sequence[int]]) -> int:
    """63 bits of the plan: the axes and their ops, every parameter (name, shape, dtype,
    the axes it is reduced over) and the buckets (which parameters, in which order)."""
    text = repr((sorted(axes.items()), [(n, tuple(s), str(d), tuple(a)) for n, s, d, a in params],
                 [list(b) for b in plan]))
    return zlib.crc32(text.encode()) ^ zlib.crc32(text[::-1].encode()) << 31


def plan_summary(params: Sequence[tuple], plan: Sequence[Sequence[int]],
                 learning: bool) -> str:
    """A short description of a plan, to name what differs between ranks."""
    shown = ", ".join(f"{n!r} ({shape_str(s, d)})" for n, s, d, _ in params[:6])
    more = f" and {len(params) - 6} more" if len(params) > 6 else ""
    sizes = [sum(_numel(params[i][1]) for i in b) for b in plan]
    return (f"{len(params)} parameter{'s' * (len(params) != 1)} ({shown}{more}) in "
            f"{len(plan)} bucket{'s' * (len(plan) != 1)} of {sizes} elements"
            + (", order still to be learned" if learning else ""))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _gather_texts(mesh: Mesh, group: Group, text: str, name: str) -> list[str]:
    """Every member's ``text`` (member order), in one all_gather of uneven sizes."""
    raw = torch.tensor(list(text.encode()), dtype=torch.uint8, device=mesh.device)
    with uncounted():  # an agreement check, not the program's communication
        got = comm_of(mesh).all_gather(raw, group, 0, name=f"{name} check")
    return [bytes(t.tolist()).decode(errors="replace") for t in got]


def check_plan(mesh: Mesh, group: Group, fingerprint: int, learning: bool, summary,
               what: str, name: str) -> None:
    """Raise the same ``SpecError`` on every member of ``group`` unless all have the
    same plan; it names every distinct plan and its ranks. ``summary()``: this rank's
    ``plan_summary``."""
    if group.size == 1:
        return
    mine = torch.tensor([fingerprint, int(learning)], dtype=torch.int64, device=mesh.device)
    with uncounted():
        rows = [t.tolist() for t in comm_of(mesh).all_gather(
            mine, group, 0, name=f"{name} check", sizes=(2,) * group.size)]
    if all(r == rows[0] for r in rows):
        return
    # Every member read the same rows: every member is here.
    plans: dict[str, list[int]] = {}
    for r, t in zip(group.ranks, _gather_texts(mesh, group, summary(), name)):
        plans.setdefault(t, []).append(r)
    said = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {t}"
                     for t, rs in plans.items())
    if len(plans) == 1:
        said += " (the same summary: their axes, ops or bucket order differ)"
    raise SpecError(f"{what}: the ranks of {_axes(group)} would reduce different buckets "
                    f"(this is rank {group.rank}): {said}; {PLAN_FIX}")


def changed_error(mesh: Mesh, group: Group | None, change: str | None, count: int,
                  axes, what: str, name: str) -> str:
    """The error of a synchronised backward in which ``count`` ranks found their
    parameters changed (every rank knows it: the alarm's sum). ``group``: the members that
    all know it (a bucket over every synchronised axis carried the alarm): they exchange
    what each changed one found, so that every member names it; None: only the changed
    ranks can."""
    me = mesh.rank
    if group is not None:
        texts = _gather_texts(mesh, group, change or "", name)
        changed = [(r, t) for r, t in zip(group.ranks, texts) if t]
    else:
        changed = [(me, change)] if change else []
    if change:
        others = "".join(f"; rank {r}: {t}" for r, t in changed if r != me)
        return f"{what}: {change} after GradSync was built (rank {me}){others}; {FIX}"
    fix = f"{FIX[0].upper()}{FIX[1:]}"
    if changed:
        where = ", ".join(str(r) for r, _ in changed)
        said = "; ".join(f"{t} (rank {r})" for r, t in changed)
        return (f"{what}: the synchronised parameters changed after GradSync was built on "
                f"rank{'s' * (len(changed) > 1)} {where} of {_axes(group)} (this is rank "
                f"{me}): {said}. {fix}")
    names = ", ".join(repr(a) for a in axes)
    return (f"{what}: the synchronised parameters changed after GradSync was built on "
            f"{count} other rank{'s' * (count > 1)} of axis{'es' * (len(axes) > 1)} {names} "
            f"(this is rank {me}); {'their errors name' if count > 1 else 'its error names'} "
            f"the parameter. {fix}")


def _axes(group: Group) -> str:
    return axis_phrase(group.axes)
