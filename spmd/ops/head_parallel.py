"""``head_parallel_attention``: attention over a split sequence by swapping the split to
the heads (the "Ulysses" scheme).

q, k and v arrive split along the sequence over a mesh axis of n ranks. Their dims before
the sequence (batch and heads, SDPA's ``(..., H, L, E)``) are flattened into U *units*
(one attention problem each) and one all_to_all (q, k and v packed together) gives every
rank whole sequences for a balanced, contiguous block of units. Plain
``F.scaled_dot_product_attention`` runs there, on whole sequences, so causality, masks,
scale and fully masked rows behave exactly as on one device; one all_to_all brings the
output back to the sequence split. Batch and heads both count as units, so fewer heads
than ranks still spreads the work when the batch makes up for it (a rank with no unit
runs an empty SDPA and still takes part in every collective; with fewer units than ranks
some ranks idle: prefer ``ring_attention`` there).

GQA (q heads a multiple g of the kv heads): q unit i reads kv unit ``i // g``, so a rank
receives the kv units its q units read; a kv unit read by q units on two ranks is sent to
both (the gradients of both return and add up). A rank whose block starts and ends on a
group boundary calls SDPA with ``enable_gqa=True``; otherwise its kv units are repeated
for its q units, as SDPA's own GQA does.

The mask goes with the units that read it: its query dim holds this rank's query rows
(or 1, the same rows for every query: then it moves nothing) and its key dim the global
key length (or 1). Its leading dims broadcast against the units; each rank receives only
the mask units its q units read (in the same all_to_all as q, k, v when it has their
dtype), so a mask shared by all heads moves once per rank, not once per head.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op, like_query
from ..collectives.vjp import custom_vjp
from ..comm import comm_of, gather_ints
from ..core._context import RankContext, on_mesh, static_layout, static_mismatch
from ..core._format import describe, shape_str
from ..core.errors import SpecError
from ..core.layout import balanced_sizes
from ..core.mesh import Mesh
from ..transforms.spec_arg import last_dim_of_v, sequence_split, takes_sharded

__all__ = ["head_parallel_attention"]

_WHAT = "head_parallel_attention"


@takes_sharded(last_dim_of_v, also=("k", "v"), check=sequence_split)
@graph_op(like_query)
def head_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh,
                            axis: str | tuple[str, ...], *, seq_dim: int, causal: bool = False,
                            attn_mask: torch.Tensor | None = None, scale: float | None = None,
                            enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of q, k, v whose ``seq_dim`` is split over
    ``axis``, computed by moving the split from the sequence to batch x heads.

    Args:
        q: this rank's query rows, ``(..., H, L_r, E)`` once ``seq_dim`` is moved to -2
            (``(L_r, E)`` without heads). Every rank holds the same other dims.
        k, v: this rank's key and value rows, ``(..., H_kv, S_r, E)`` and
            ``(..., H_kv, S_r, E_v)`` likewise; ``S_r`` may differ from ``L_r``
            (cross-attention), and any shard may be empty.
        mesh: the mesh the code runs on.
        axis: the mesh axis (or tuple of axes, the first major) that splits ``seq_dim`` of
            q, k and v; the shards lie in the order of the axis' ranks.
        seq_dim: the sequence dim of q, k and v (negative allowed).
        causal: SDPA's ``is_causal`` on the global sequences (top-left aligned, as torch).
            With ``attn_mask`` too, a key is attended where both allow it.
        attn_mask: None, or a bool (True: attend) or float (added to the scores) mask,
            broadcastable to SDPA's ``(..., H, L_r, S)``: its query dim holds this rank's
            ``L_r`` rows on every rank, or 1 on every rank (a mask for every query, then
            the same on all ranks); its key dim the global key length ``S`` (or 1).
            The conventions of ``ring_attention``.
        scale: as SDPA's (default ``1 / sqrt(E)``).
        enable_gqa: as SDPA's: H a multiple of H_kv, q head h reads kv head ``h // (H /
            H_kv)``. Without it H_kv is H or 1 (one kv head for all, as SDPA broadcasts).

    Returns:
        This rank's rows of the output, laid out like q with last dim ``E_v``.

    Communication:
        Over ``axis`` (n ranks, U units, this rank ``u`` of them and ``L_r`` of the L
        query rows): one int64 all_gather ``"head_parallel_attention sizes"`` of the
        shapes (none on later calls of a shard_map body with the same layouts); then two
        all_to_alls ``"head_parallel_attention"``: q, k and v (and a per-rank-rows mask
        of q's dtype) packed in one, where each rank sends the rows of the U - u units
        other ranks hold ((n-1)/n of each shard when balanced; with GQA a kv unit at a
        block boundary goes to two ranks), and the output, where it sends its u units'
        rows of the other ranks (L - L_r rows). A bool mask with per-rank rows takes one
        more all_to_all: each rank sends the mask units it holds to the ranks whose
        units read them (a mask shared by all heads and batch goes whole to every other
        rank). A mask with one query row moves nothing.

    Backward:
        The transposes, also two all_to_alls: the output's cotangent to the units' ranks,
        then q's, k's and v's gradients (and a float mask's, when it requires grad on
        the ranks) back to the sequence split in one; a kv unit sent to two ranks gets
        the sum of both. A one-row mask's gradient is this rank's part: sum it over
        ``axis``, as shard_map does for a replicated input.

    Ranks without data:
        A rank with an empty sequence shard sends and receives empty blocks; a rank with
        no unit (fewer units than ranks) runs SDPA on zero units. Both take part in every
        collective, forward and backward, and return empty tensors of the right shape.

    Raises:
        SpecError: a bad axis or seq_dim; q, k, v, mask shapes that do not fit (on this
            rank, before anything moves, or after the shape exchange on every rank alike:
            other dims that differ between ranks, a mask whose key dim is not the global
            key length or whose query dim is neither the rows nor 1 on every rank).
        TypeError: non-tensors, non-floating or mixed dtypes, a mask of another dtype.

    Example:
        >>> from spmd.ops import head_parallel_attention
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)   # (batch, heads, seq, feat)
        >>> f = lambda q, k, v: head_parallel_attention(q, k, v, mesh, "sp", seq_dim=2)
        >>> s = P(None, None, "sp")
        >>> out = spmd.shard_map(f, mesh, (s, s, s), s)(q, k, v)
        >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v),
        ...                atol=1e-6)
        True
    """
    rc = on_mesh(mesh, _WHAT, q)
    axes = mesh.check_axes(axis, _WHAT)
    sd, mask = _check_local(q, k, v, attn_mask, seq_dim, causal, scale, enable_gqa)
    qs, ks, vs = (t.movedim(sd, -2) for t in (q, k, v))
    group = mesh.group(axes, rc.rank)
    if group.size == 1:
        out = _sdpa(qs, ks, vs, mask, causal, scale, enable_gqa)
        return out.movedim(-2, sd)
    grad = mask is not None and mask.requires_grad and torch.is_grad_enabled()
    mine = _shapes(qs, ks, vs, mask) + ((int(grad),),)

    def exchange() -> tuple:
        got = gather_ints(mesh, group, [v for s in mine for v in s], name=f"{_WHAT} sizes",
                          device=q.device)
        return tuple(_unflat(list(r), mine) for r in got)

    def check(value: tuple) -> None:
        if value[group.index] != mine:
            raise static_mismatch(_WHAT, _show(mine), _show(value[group.index]), rc.rank)

    key = (_WHAT, axes, tuple(len(s) for s in mine), grad)
    plan = _plan(static_layout(mesh, key, exchange, check), enable_gqa)
    me = group.index
    u = len(plan.q_sel[me])
    lead = qs.shape[:-2]
    # (units, rows, features); one exchange swaps rows for units in all of them.
    xs = [anchor(_units(t)) for t in (qs, ks, vs)]
    sels, rows = [plan.q_sel, plan.kv_sel, plan.kv_sel], [plan.q_rows, plan.kv_rows,
                                                          plan.kv_rows]
    if mask is not None and plan.mask_rows:
        xs.append(anchor(_units(mask)) if plan.mask_grad else _units(mask).detach())
        sels.append(plan.mask_sel)
        rows.append(plan.q_rows)
    # which exchanged tensors get a gradient: q, k, v (anchored), a mask that needs one
    needs = (True, True, True, plan.mask_grad)[:len(xs)]
    got = _to_heads((tuple(sels), tuple(rows), rc, axes, needs), *xs)
    qh, kh, vh = got[:3]
    mh = None
    if mask is not None:
        mh = _mask_of_units(got[3] if plan.mask_rows else _units(mask), plan.mask_pos[me])
    if causal:
        mh = _with_causal(mh, qh.shape[-2], kh.shape[-2], q.device)
    oh = _local_attention(qh, kh, vh, mh, causal and mh is None, scale, plan, me, u)
    out = _to_seq(oh, plan.q_sel, plan.q_rows, rc, axes)
    return out.reshape(*lead, out.shape[-2], out.shape[-1]).movedim(-2, sd)


# -- checks on this rank, before anything moves ------------------------------------------------

def _check_local(q: Any, k: Any, v: Any, mask: Any, seq_dim: Any, causal: Any, scale: Any,
                 gqa: Any) -> tuple[int, torch.Tensor | None]:
    """The normalised seq_dim and the mask with q's number of dims (1s in front)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHAT}: {name} must be a tensor, got {describe(t)}")
        if not t.is_floating_point():
            raise TypeError(f"{_WHAT}: {name} must be floating point, got {describe(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{_WHAT}: q, k, v must share a dtype, got {describe(q)}, "
                        f"{describe(k)}, {describe(v)}; cast them first")
    if not (q.ndim == k.ndim == v.ndim) or q.ndim < 2:
        raise SpecError(f"{_WHAT}: q, k, v must have the same number of dims, at least 2 "
                        f"(sequence and features), got {describe(q)}, {describe(k)}, "
                        f"{describe(v)}")
    if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or \
            not -q.ndim <= seq_dim < q.ndim or seq_dim % q.ndim == q.ndim - 1:
        raise SpecError(f"{_WHAT}: seq_dim={seq_dim!r} must name a dim of the {q.ndim}-d q, "
                        f"k, v other than the last (the features)")
    sd = seq_dim % q.ndim
    for name, val in (("causal", causal), ("enable_gqa", gqa)):
        if not isinstance(val, bool):
            raise TypeError(f"{_WHAT}: {name} must be a bool, got {val!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{_WHAT}: scale must be a number or None, got {scale!r}")
    qs, ks, vs = (t.movedim(sd, -2) for t in (q, k, v))
    _check_shapes(qs.shape, ks.shape, vs.shape, gqa, "")
    if mask is None:
        return sd, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{_WHAT}: attn_mask must be a tensor or None, got {describe(mask)}")
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        raise TypeError(f"{_WHAT}: attn_mask must be bool or q's dtype ({describe(q)}), got "
                        f"{describe(mask)}")
    if mask.ndim > q.ndim:
        raise SpecError(f"{_WHAT}: attn_mask {describe(mask)} has more dims than q "
                        f"{describe(q)}; it must broadcast to (..., H, L_r, S)")
    mask = mask.reshape((1,) * (q.ndim - mask.ndim) + tuple(mask.shape))
    lead = qs.shape[:-2]
    for d, (m, s) in enumerate(zip(mask.shape[:-2], lead)):
        if m not in (1, s):
            raise SpecError(f"{_WHAT}: attn_mask {describe(mask)} does not broadcast against "
                            f"q's leading dims {list(lead)} (dim {d}: {m} vs {s})")
    if mask.shape[-2] not in (1, qs.shape[-2]):
        raise SpecError(f"{_WHAT}: attn_mask {describe(mask)} has {mask.shape[-2]} query rows "
                        f"but q has {qs.shape[-2]} on this rank; pass this rank's rows (or 1 "
                        f"row for every query)")
    return sd, mask


def _check_shapes(qs: Any, ks: Any, vs: Any, gqa: bool, where: str) -> None:
    """q, k, v shapes (sequence at -2) fit SDPA: features, kv agreement, heads."""
    if qs[-1] != ks[-1]:
        raise SpecError(f"{_WHAT}: q and k must have the same feature size{where}, got "
                        f"{shape_str(qs)} and {shape_str(ks)}")
    if tuple(ks[:-1]) != tuple(vs[:-1]):
        raise SpecError(f"{_WHAT}: k and v must agree in every dim but the last{where}, got "
                        f"{shape_str(ks)} and {shape_str(vs)} (sequence at dim -2)")
    if tuple(qs[:-3]) != tuple(ks[:-3]):
        raise SpecError(f"{_WHAT}: q and k must have the same batch dims{where}, got "
                        f"{shape_str(qs)} and {shape_str(ks)} (sequence at dim -2)")
    if len(qs) >= 3 and qs[-3] != ks[-3] and ks[-3] != 1:  # one kv head broadcasts
        hq, hk = qs[-3], ks[-3]
        if not gqa:
            raise SpecError(f"{_WHAT}: q has {hq} heads and k {hk}{where}; pass "
                            f"enable_gqa=True for grouped-query attention")
        if hk == 0 or hq % hk:
            raise SpecError(f"{_WHAT}: with enable_gqa the q heads ({hq}) must be a multiple "
                            f"of the kv heads ({hk}){where}")


def _shapes(qs, ks, vs, mask) -> tuple:
    m = tuple(mask.shape) if mask is not None else ()
    return (tuple(qs.shape), tuple(ks.shape), tuple(vs.shape), m)


def _unflat(vals: list[int], like: tuple) -> tuple:
    out, i = [], 0
    for s in like:
        out.append(tuple(int(x) for x in vals[i:i + len(s)]))
        i += len(s)
    return tuple(out)


def _show(shapes: tuple) -> str:
    names = ("q", "k", "v", "attn_mask")
    return ", ".join(f"{n} {list(s)}" for n, s in zip(names, shapes[:4]) if s or n != "attn_mask")


# -- the plan: which units and rows go where, from every rank's shapes -------------------------

@dataclass(frozen=True)
class _Plan:
    q_sel: tuple[range, ...]      # q (and output) units of each rank: disjoint, in order
    kv_sel: tuple[range, ...]     # kv units each rank's q units read (GQA: may overlap)
    q_rows: tuple[int, ...]       # each rank's query rows
    kv_rows: tuple[int, ...]      # each rank's key rows
    g: int                        # q units per kv unit
    mask_rows: bool               # the mask holds per-rank rows (else one row for all)
    mask_grad: bool               # ... and needs a gradient (a float mask that requires it)
    mask_sel: tuple[Any, ...]     # mask units each rank receives (range or sorted tuple)
    mask_pos: tuple[tuple[int, ...], ...]  # per rank, per q unit: its mask unit's position


@functools.lru_cache(maxsize=256)
def _plan(shapes: tuple, gqa: bool) -> _Plan:
    """From every rank's (q, k, v, mask) shapes, sequence at -2; every rank computes the
    same plan, and raises the same error, from the same shapes."""
    n = len(shapes)
    q0, k0, v0, m0, grad0 = shapes[0]
    for r, (qs, ks, vs, ms, grad) in enumerate(shapes):
        for name, a, b in (("q", qs, q0), ("k", ks, k0), ("v", vs, v0)):
            if a[:-2] + a[-1:] != b[:-2] + b[-1:]:
                raise SpecError(f"{_WHAT}: {name} is {shape_str(a)} on index {r} of the axis "
                                f"but {shape_str(b)} on index 0; only the sequence dim may "
                                f"differ between ranks")
        if bool(ms) != bool(m0) or (ms and ms[:-2] + ms[-1:] != m0[:-2] + m0[-1:]):
            raise SpecError(f"{_WHAT}: attn_mask is {_mshape(ms)} on index {r} of the axis but "
                            f"{_mshape(m0)} on index 0; pass a mask on every rank, differing "
                            f"only in its query rows")
        if grad != grad0:
            yes, no = (0, r) if grad0[0] else (r, 0)
            raise SpecError(f"{_WHAT}: attn_mask requires grad on index {yes} of the axis but "
                            f"not on index {no}; make it require grad on every rank or none")
    q_rows = tuple(s[0][-2] for s in shapes)
    kv_rows = tuple(s[1][-2] for s in shapes)
    _check_shapes(q0[:-2] + (sum(q_rows),) + q0[-1:], k0[:-2] + (sum(kv_rows),) + k0[-1:],
                  v0[:-2] + (sum(kv_rows),) + v0[-1:], gqa, " (global shapes)")
    lead = q0[:-2]
    units = math.prod(lead)
    g = lead[-1] // k0[-3] if len(lead) >= 1 and k0[-3] else 1
    q_sel, a = [], 0
    for s in balanced_sizes(units, n):
        q_sel.append(range(a, a + s))
        a += s
    kv_sel = tuple(range(r.start // g, -(-r.stop // g)) if len(r) else range(0) for r in q_sel)
    mask_rows, mask_sel, mask_pos = False, (), ()
    if m0:
        s_total = sum(kv_rows)
        if m0[-1] not in (1, s_total):
            raise SpecError(f"{_WHAT}: attn_mask has {m0[-1]} key columns but the keys are "
                            f"{s_total} long over the axis; the mask's key dim is global "
                            f"(or 1)")
        rows = tuple(s[3][-2] for s in shapes)
        if rows == q_rows:
            mask_rows = True
        elif any(r != 1 for r in rows):
            raise SpecError(f"{_WHAT}: attn_mask has {list(rows)} query rows on the axis' "
                            f"ranks, whose q rows are {list(q_rows)}; pass each rank's rows "
                            f"(or 1 row, for every query, on every rank)")
        unit_of = _mask_units_of(lead, m0[:-2])
        sel, pos = [], []
        for r in q_sel:
            need = sorted({unit_of[i] for i in r})
            where = {m: j for j, m in enumerate(need)}
            sel.append(_as_range(need))
            pos.append(tuple(where[unit_of[i]] for i in r) if mask_rows else
                       tuple(unit_of[i] for i in r))
        mask_sel, mask_pos = tuple(sel), tuple(pos)
    return _Plan(tuple(q_sel), kv_sel, q_rows, kv_rows, g, mask_rows,
                 mask_rows and bool(grad0[0]), mask_sel, mask_pos)


def _mshape(s: tuple) -> str:
    return shape_str(s) if s else "None"


def _mask_units_of(lead: tuple[int, ...], mlead: tuple[int, ...]) -> tuple[int, ...]:
    """For each q unit (flattened ``lead`` index), the mask unit (flattened index of the
    mask's leading dims, 1s broadcast) it reads."""
    out = []
    for i in range(math.prod(lead)):
        m, stride, rest = 0, 1, i
        for s, ms in zip(reversed(lead), reversed(mlead)):
            rest, idx = divmod(rest, s)
            if ms != 1:
                m += idx * stride
            stride *= ms
        out.append(m)
    return tuple(out)


def _as_range(idx: list[int]) -> Any:
    if not idx:
        return range(0)
    if idx == list(range(idx[0], idx[-1] + 1)):
        return range(idx[0], idx[-1] + 1)
    return tuple(idx)


# -- the two exchanges, each the other's transpose ---------------------------------------------
#
# One exchange moves several tensors (q, k, v and a mask) in one all_to_all per dtype, from
# one autograd node: every rank then runs their backward exchanges in the same order (two
# nodes side by side could run in different orders on different ranks, and deadlock).

def _take(x: torch.Tensor, sel: Any) -> torch.Tensor:
    if isinstance(sel, range):
        return x[sel.start:sel.stop]
    return x.index_select(0, torch.tensor(sel, dtype=torch.long, device=x.device))


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])


def _by_dtype(xs: tuple) -> list[list[int]]:
    """Positions of ``xs`` grouped by dtype, in order of first appearance."""
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.dtype, []).append(i)
    return list(groups.values())


def _packed_all_to_all(rc: RankContext, group, idx: list[int], parts: list[list[torch.Tensor]],
                       shape_of: dict) -> dict[int, list[torch.Tensor]]:
    """One all_to_all for the tensors ``idx`` (one dtype): ``parts[j]`` holds what goes to
    member ``j`` (one piece per tensor, flattened into one message), ``shape_of[i, j]`` the
    shape of tensor ``i``'s piece arriving from member ``j``. Returns, per tensor, its
    pieces in member order."""
    sizes = {ij: math.prod(s) for ij, s in shape_of.items()}
    got = comm_of(rc.mesh).all_to_all(
        [_flat(p) for p in parts], group, name=_WHAT,
        shapes=[(sum(sizes[i, j] for i in idx),) for j in range(group.size)])
    pieces: dict = {i: [] for i in idx}
    for j, flat in enumerate(got):
        for i, t in zip(idx, flat.split([sizes[i, j] for i in idx])):
            pieces[i].append(t.view(shape_of[i, j]))
    return pieces


def _heads_fwd(xs: tuple, sels: tuple, rows: tuple, rc: RankContext,
               axes: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """Each ``x`` ``(units, rows of this rank, ...)`` -> ``(sel[me] units, all rows, ...)``:
    every rank sends each rank that rank's selected units, and concatenates the rows that
    arrive, in the axis' order."""
    group = rc.mesh.group(axes, rc.rank)
    me, n = group.index, group.size
    out: list = [None] * len(xs)
    for idx in _by_dtype(xs):
        pieces = _packed_all_to_all(
            rc, group, idx, [[_take(xs[i], sels[i][j]) for i in idx] for j in range(n)],
            {(i, j): (len(sels[i][me]), rows[i][j], *xs[i].shape[2:])
             for i in idx for j in range(n)})
        for i in idx:
            out[i] = torch.cat(pieces[i], 1)
    return tuple(out)


def _seq_fwd(ys: tuple, sels: tuple, rows: tuple, units: tuple, rc: RankContext,
             axes: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """Each ``y`` ``(sel[me] units, all rows, ...)`` -> ``(units, rows of this rank, ...)``:
    every rank sends each rank its rows; a unit that arrives from several ranks (GQA's kv
    units at block boundaries) is their sum."""
    group = rc.mesh.group(axes, rc.rank)
    me, n = group.index, group.size
    out: list = [None] * len(ys)
    for idx in _by_dtype(ys):
        cuts = {i: ys[i].split(list(rows[i]), 1) for i in idx}
        pieces = _packed_all_to_all(
            rc, group, idx, [[cuts[i][j] for i in idx] for j in range(n)],
            {(i, r): (len(sels[i][r]), rows[i][me], *ys[i].shape[2:])
             for i in idx for r in range(n)})
        for i in idx:
            if _tiles(sels[i], units[i]):
                out[i] = torch.cat(pieces[i], 0)
                continue
            acc = ys[i].new_zeros((units[i], rows[i][me], *ys[i].shape[2:]))
            for sel, t in zip(sels[i], pieces[i]):
                if len(sel):
                    acc.index_add_(0, torch.tensor(list(sel), dtype=torch.long,
                                                   device=acc.device), t)
            out[i] = acc
    return tuple(out)


def _tiles(sel: tuple, units: int) -> bool:
    """Whether the selections are consecutive ranges covering ``range(units)``."""
    a = 0
    for s in sel:
        if not isinstance(s, range) or (len(s) and s.start != a):
            return False
        a += len(s)
    return a == units


@custom_vjp
def _to_heads(meta, *xs):
    sels, rows, rc, axes, _ = meta
    return _heads_fwd(xs, sels, rows, rc, axes)


def _to_heads_fwd(meta, *xs):
    return _to_heads.fun(meta, *xs), (meta, tuple(x.shape[0] for x in xs))


def _to_heads_bwd(res, gs):
    (sels, rows, rc, axes, needs), units = res
    keep = [i for i, f in enumerate(needs) if f]  # the same on every rank (from the plan)
    with rc:
        got = _seq_fwd(tuple(gs[i] for i in keep), tuple(sels[i] for i in keep),
                       tuple(rows[i] for i in keep), tuple(units[i] for i in keep), rc, axes)
    out: list = [None] * len(needs)
    for i, gx in zip(keep, got):
        out[i] = gx
    return (None, *out)


_to_heads.defvjp(_to_heads_fwd, _to_heads_bwd)


@custom_vjp
def _to_seq(y, sel, rows, rc, axes):
    return _seq_fwd((y,), (sel,), (rows,), (sum(len(s) for s in sel),), rc, axes)[0]


def _to_seq_bwd(res, g):
    sel, rows, rc, axes = res
    with rc:
        return _heads_fwd((g,), (sel,), (rows,), rc, axes)[0], None, None, None, None


_to_seq.defvjp(lambda y, sel, rows, rc, axes: (_to_seq.fun(y, sel, rows, rc, axes),
                                               (sel, rows, rc, axes)), _to_seq_bwd)


# -- the local attention -----------------------------------------------------------------------

def _units(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(units, rows, last)``: its leading dims flattened."""
    return t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])


def _mask_of_units(flat: torch.Tensor, pos: tuple[int, ...]) -> torch.Tensor:
    """The mask of this rank's units, ``(units, rows or 1, S)``, from the mask units
    ``flat`` holds (a view where all units read one)."""
    if pos and all(p == pos[0] for p in pos):
        return flat[pos[0]:pos[0] + 1].expand(len(pos), -1, -1)
    if pos == tuple(range(flat.shape[0])):
        return flat
    return flat.index_select(0, torch.tensor(pos, dtype=torch.long, device=flat.device))


def _with_causal(mask: torch.Tensor | None, rows: int, cols: int,
                 device: torch.device) -> torch.Tensor | None:
    """The mask combined with causality (None: SDPA's is_causal does it alone)."""
    if mask is None:
        return None
    keep = torch.ones(rows, cols, dtype=torch.bool, device=device).tril()
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -math.inf)


def _local_attention(qh, kh, vh, mh, is_causal, scale, plan: _Plan, me: int, u: int):
    """SDPA on this rank's units, as one batch of ``u`` heads: 4-d, so torch picks the
    kernel it picks on one device (on CPU a 3-d call takes the math path, which keeps the
    whole score matrix for backward)."""
    g = plan.g
    r = plan.q_sel[me]
    if g > 1 and u and not (r.start % g == 0 and r.stop % g == 0):
        # the block splits a group: repeat the kv units for its q units, as SDPA's GQA does
        first = plan.kv_sel[me].start
        idx = torch.tensor([i // g - first for i in r], dtype=torch.long, device=qh.device)
        kh, vh = kh.index_select(0, idx), vh.index_select(0, idx)
    gqa = kh.shape[0] != u  # whole groups: SDPA's own GQA
    mh = None if mh is None else mh.unsqueeze(0)
    out = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0),
                                         attn_mask=mh, is_causal=is_causal, scale=scale,
                                         enable_gqa=gqa)
    return out.squeeze(0)


def _sdpa(q, k, v, mask, causal, scale, gqa):
    """One rank (or a group of one): SDPA itself, causal and a mask combined as above."""
    m = _with_causal(mask, q.shape[-2], k.shape[-2], q.device) if causal else mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal and m is None,
                                          scale=scale, enable_gqa=gqa)
