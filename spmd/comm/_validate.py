"""``SPMD_VALIDATE=1``: every collective first compares op, arguments, dtypes and shapes
across the group, with one more small all_gather, and raises the same ``CommError`` on
every rank. ``_Validation`` is that part of ``TorchComm`` (``distributed.py``).
"""
from __future__ import annotations

import torch

from ..core.errors import CommError
from ._meta import (_OPCODES, _OPNAMES, _ROW, _all_gather_single, _axes, _check_rows, _extra,
                    _plan_row, _plans_disagree, _row, _row_of)

__all__ = ["_Validation"]


class _Validation:
    """The validation round trips; mixed into ``TorchComm``."""

    def _gather_rows(self, rec, group, seq, tensors, name) -> list[list[list[int]]]:
        """Every member's metadata rows for ``tensors``, in group order."""
        n = group.size
        meta = torch.tensor([v for t in tensors for v in _row(t, name)], dtype=torch.int64,
                            device=tensors[0].device)
        out = meta.new_empty(n * meta.numel())
        self._call(_all_gather_single, name, group, rec, seq, out, meta)
        flat = out.view(n, len(tensors), _ROW).tolist()
        return [flat[p] for p in rec.pg_of]

    def _check_plan(self, rec, group, seq, rows, shapes, dtype, name) -> None:
        """Under validation: every member's expected shapes (from its plan) against what
        the senders' metadata says; the first disagreement, found by any member, is the
        same CommError on every member (ranks whose plans differ, e.g. a rank-dependent
        halo width, would otherwise read garbage or abort)."""
        mismatch = None
        for i in range(group.size):
            got = rows[rec.pg_of[i]]
            exp = _row_of(tuple(shapes[i]), dtype, name)
            if got != exp:
                mismatch = (group.ranks[i], exp, got)
                break
        vec = torch.tensor(_plan_row(mismatch), dtype=torch.int64, device=self.mesh.device)
        out = vec.new_empty(group.size * vec.numel())
        self._call(_all_gather_single, name, group, rec, seq, out, vec)
        allv = out.view(group.size, -1).tolist()
        for p, v in enumerate(allv):
            if v[0]:
                me = group.ranks[rec.idx_of[p]]
                raise _plans_disagree(name, group, me, v[2:2 + _ROW], v[1], v[2 + _ROW:],
                                      "a halo width", verb="sent")

    def _validate(self, rec, group, seq, op, extra, tensors, name, *, count=None,
                  skip_dim=None, rows=None) -> list[list[list[int]]]:
        """Compare op, ``extra`` argument, chunk count and tensor metadata across members,
        with one all_gather of a fixed-size int64 vector; the same CommError on every rank.
        ``rows``: n metadata rows to send instead of ``tensors``' (compared by the caller)."""
        n = group.size
        if rows is None:
            rows = [_row(t, name) for t in tensors[:n]]
            rows += [[-1] * _ROW] * (n - len(rows))
        vec = [_OPCODES[op], int(extra), len(tensors) if count is None else count]
        vec += [v for r in rows for v in r]
        dev = tensors[0].device if tensors else self.mesh.device
        meta = torch.tensor(vec, dtype=torch.int64, device=dev)
        out = meta.new_empty(n * meta.numel())
        self._call(_all_gather_single, name, group, rec, seq, out, meta)
        allv = out.view(n, -1).tolist()
        allv = [allv[p] for p in rec.pg_of]
        ranks = group.ranks
        for i, v in enumerate(allv):
            if v[0] != allv[0][0]:
                raise CommError(
                    f"{name}: collective mismatch over {_axes(group)}: rank {ranks[i]} called "
                    f"{_OPNAMES.get(v[0], v[0])} while rank {ranks[0]} called {op} (call #{seq} "
                    f"on this group); every rank must run the same collectives in the same order")
        if count is not None:
            for i, v in enumerate(allv):
                if v[2] != n:
                    raise CommError(f"{name}: rank {ranks[i]} passed {v[2]} chunks for a group "
                                    f"of {n}")
        for i, v in enumerate(allv):
            if v[1] != allv[0][1]:
                label, a, b = _extra(op, allv[0][1], v[1])
                raise CommError(f"{name} over {_axes(group)}: rank {ranks[0]} passed {label} {a} "
                                f"but rank {ranks[i]} passed {label} {b}; every rank must pass "
                                f"the same {label}")
        per = [[v[3 + j * _ROW:3 + (j + 1) * _ROW] for j in range(n)] for v in allv]
        if op not in ("all_to_all", "scatter"):
            for j in range(len(tensors[:n])):
                _check_rows([p[j] for p in per], group, name, skip_dim=skip_dim,
                            chunk=j if op == "reduce_scatter" else None)
        return per

    def _validate_scatter(self, rec, group, seq, chunks, src, shape, dtype, name) -> None:
        """``_validate`` with the source's chunk rows and, in each other member's slot,
        the row it expects: the first member whose expectation differs from what the
        source sends is the same CommError on every rank."""
        n, me = group.size, group.index
        if me == src:
            rows = [_row(c, name) for c in chunks]
        else:
            rows = [[-1] * _ROW] * n
            rows[me] = _row_of(shape, dtype, name)
        per = self._validate(rec, group, seq, "scatter", src, [], name, rows=rows)
        for i in range(n):
            if i != src and per[i][i] != per[src][i]:
                raise _plans_disagree(name, group, group.ranks[i], per[i][i],
                                      group.ranks[src], per[src][i], "sizes or spec")

