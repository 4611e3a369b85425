"""The bucket plan of a ``GradSync``: which parameters share a bucket, in which launch
order, and the checks that every rank has the same one (``agreement.py``).

``_Plan`` is mixed into ``GradSync`` (``grad_sync.py``), which sets the parameters
(``_params``, ``_names``, ``_axes_of``), the caps, ``axes``, ``mesh``, the groups and the
order being learned (``_order``, ``_seen``).
"""
from __future__ import annotations

import torch

from ..comm import comm_of
from ..core.errors import SpecError
from .agreement import check_plan, plan_fingerprint, plan_summary
from .buckets import Bucket, BucketInfo, assign

__all__ = ["_Plan"]


class _Plan:
    """The bucket plan; mixed into ``GradSync``."""

    @property
    def buckets(self) -> list[BucketInfo]:
        """The bucket plan in launch order: dtype, device, axes, parameter names, size.

        Before the first synchronised iteration it follows the reverse of the module's
        definition order (backward usually runs last layer first); after it, with
        ``learn_order``, the order in which the gradients of the group's first rank
        became ready (every rank of the group adopts it).
        """
        return [b.info() for b in self._buckets]

    @property
    def order_learned(self) -> bool:
        """Whether the plan has been rebuilt from the order seen in backward."""
        return self.active and self._learn and self._order is None

    def _build(self, order: list[int]) -> None:
        plan = assign(order, self._params, self._cap, self._first_cap, self._axes_of)
        self._buckets = [Bucket(idx, self._params, self._names, self._grad_as_view,
                                self._axes_of[idx[0]]) for idx in plan]
        self._where: dict[int, tuple[Bucket, int]] = {
            i: (b, j) for b in self._buckets for j, i in enumerate(b.index)}

    def _plan_of(self, axes: tuple[str, ...]) -> tuple[list[tuple], list[list[int]]]:
        """The parameters (name, shape, dtype, axes) and the buckets (in launch order, as
        positions in that list) that are reduced over ``axes``."""
        buckets = [b.index for b in self._buckets if b.axes == axes]
        mine = sorted(i for b in buckets for i in b)
        at = {i: k for k, i in enumerate(mine)}
        params = [(self._names[i], tuple(self._params[i].shape), self._params[i].dtype, axes)
                  for i in mine]
        return params, [[at[i] for i in b] for b in buckets]

    def _fingerprint(self, axes: tuple[str, ...]) -> int:
        """The fingerprint (``agreement.py``) of what fixes the size of every bucket
        reduced over ``axes``, and the ops of those axes."""
        return plan_fingerprint({a: self.axes[a] for a in axes}, *self._plan_of(axes))

    def _summary(self, axes: tuple[str, ...]) -> str:
        return plan_summary(*self._plan_of(axes), self._order is not None)

    def _rebuild(self) -> None:
        """Adopt rank 0's ready order (so every rank has the same plan), once."""
        seen, self._order = self._order, None
        rest = [i for b in self._buckets for i in b.index if i not in self._seen]
        mine = torch.tensor(seen + rest, dtype=torch.int64, device=self.mesh.device)
        g = self._plan_group  # one plan on every rank of the mesh
        if g.size > 1:
            mine = comm_of(self.mesh).broadcast(mine, 0, g, name=f"{self.name} plan")
        order = mine.tolist()
        if sorted(order) != list(range(len(self._params))):
            raise SpecError(f"{self._what}: rank {g.ranks[0]} sent a bucket order "
                            f"for other parameters than this rank's")
        if (assign(order, self._params, self._cap, self._first_cap, self._axes_of)
                == [b.index for b in self._buckets]):
            return
        old = self._where
        self._build(order)
        with torch.no_grad():  # the gradients just reduced move into the new buckets
            for i, p in enumerate(self._params):
                b, j = self._where[i]
                if p.grad is not None:
                    ob, oj = old[i]
                    b.views[j].copy_(p.grad)
                    if b.viewable[j] and p.grad is ob.views[oj]:
                        p.grad = b.views[j]

    def _check_plans(self) -> None:
        """Every rank's buckets alike, compared over each group that reduces them (a
        parameter varying over an axis has another shape on the other side of it)."""
        for axes, g in self._groups.items():
            check_plan(self.mesh, g, self._fingerprint(axes), self._order is not None,
                       lambda axes=axes: self._summary(axes), self._what, self.name)
