"""The arithmetic and the local kernel of neighbourhood attention (``neighborhood_attention.py``
holds the public functions).

Windows, one spatial dim at a time (NATTEN's semantics). A dim of length ``L`` with
dilation ``d`` splits into ``d`` dilation groups: position ``i`` is element
``t = i // d`` of group ``g = i % d``, which holds ``n = ceil((L - g) / d)`` positions.
Inside its group the query attends to ``k`` consecutive elements:

- not causal: ``[s, s + k)`` with ``s = clamp(t - k // 2, 0, n - k)``, the window
  centred on the query (one more element before it than after for even ``k``) and
  shifted inward at the ends, so every window is full;
- causal: ``[t - k + 1, t]``, the elements that exist (fewer than ``k`` at the start).

A key at group element ``u`` gets the relative position bias ``rpb[..., u - t + k - 1]``
(per dim): offsets run from ``-(k - 1)`` to ``k - 1``, hence NATTEN's ``2k - 1`` entries.

Fetch plans: a rank's queries read the union of their windows, which along a split dim
is a set of rows (not always a range: dilated windows skip rows); every row of the own
shard is in it (each window holds its query). The plan asks for exactly the rows
outside the shard, in the format of ``spmd.transforms.halo``'s plans, so its
``exchange``/``assemble``/``transpose`` move them.

The local kernel (``attend``) sees the queries flattened to ``[B, NQ, H, D]``, the fetched
keys and values to ``[B, W, H, D]``, and an index ``G[NQ, K]`` (``K = prod k``) of the
window position of each query's key in each slot. It keeps for backward the queries, the
windows, the output and the log-sum-exp, never the ``K``-fold gathered keys: backward
gathers again, slot chunk by slot chunk.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..collectives.vjp import custom_vjp

__all__ = ["dim_windows", "dim_plan", "Index", "local_index", "attend", "attend_forward",
           "attend_backward", "compute_dtype"]


# -- one dim: windows and plans (pure arithmetic, the same on every rank) ---------------------

@lru_cache(maxsize=256)
def dim_windows(L: int, k: int, d: int, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(keys, valid, rel)``, each ``[L, k]`` (CPU): the global key position of every
    query's window slot, whether the slot exists (causal windows at the start are
    short; None when all do), and the slot's relative-position-bias index."""
    i = torch.arange(L)
    g, t = i % d, i // d
    n = (L - g + d - 1) // d  # the size of each query's dilation group
    j = torch.arange(k)
    if causal:
        u = t[:, None] - (k - 1) + j
        valid = u >= 0
        rel = j.expand(L, k)
        u = torch.where(valid, u, t[:, None])  # a missing slot points at the query itself
    else:
        s = torch.minimum((t - k // 2).clamp(min=0), n - k)
        u = s[:, None] + j
        valid = None
        rel = u - t[:, None] + (k - 1)
    return (g[:, None] + d * u).contiguous(), valid, rel.contiguous()


@lru_cache(maxsize=256)
def dim_plan(L: int, k: int, d: int, causal: bool, sizes: tuple[int, ...]
             ) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """``(rows, plan)`` for a dim split in shards of ``sizes``: ``rows[r]``, the sorted
    global rows member ``r``'s queries read (empty without queries), and the halo plan
    (``spmd.transforms.halo``'s format) that brings each member exactly its rows."""
    keys, valid, _ = dim_windows(L, k, d, causal)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    rows = []
    for r, s in enumerate(sizes):
        ks = keys[starts[r]:starts[r] + s]
        if valid is not None:
            ks = ks[valid[starts[r]:starts[r] + s]]
        rows.append(tuple(int(x) for x in torch.unique(ks).tolist()))
    owners = [r for r, s in enumerate(sizes) if s > 0]
    owner_starts = [starts[r] for r in owners]
    ranges, own, need = [], [], []
    for r, rs in enumerate(rows):
        st, s = starts[r], sizes[r]
        below = bisect.bisect_left(rs, st)
        if rs[below:below + s] != tuple(range(st, st + s)):  # every window holds its query
            raise AssertionError(f"rows {rs} of member {r} miss part of its shard [{st}, {st + s})")
        ranges.append((0, len(rs)))  # only the window's length matters to the plan
        own.append((below, 0, s))
        by_src: dict[int, tuple[list[int], list[int]]] = {}
        for pos, x in enumerate(rs):
            if below <= pos < below + s:
                continue
            src = owners[bisect.bisect_right(owner_starts, x) - 1]
            p, idx = by_src.setdefault(src, ([], []))
            p.append(pos)
            idx.append(x - starts[src])
        need.append({src: (tuple(p), tuple(i)) for src, (p, i) in by_src.items()})
    plan = (tuple(sizes), tuple(ranges), tuple(own), tuple(need), tuple(() for _ in sizes))
    return tuple(rows), plan


@lru_cache(maxsize=256)
def _dim_local(L: int, k: int, d: int, causal: bool, q0: int, nq: int,
               rows: tuple[int, ...] | None) -> tuple:
    """This rank's ``(pos, valid, rel)`` along one dim, ``[nq, k]``: the window position
    (in ``rows``, or the global position where the window is the whole dim) of each
    slot of its queries ``[q0, q0 + nq)``."""
    keys, valid, rel = dim_windows(L, k, d, causal)
    keys, rel = keys[q0:q0 + nq], rel[q0:q0 + nq]
    valid = None if valid is None else valid[q0:q0 + nq]
    if rows is not None:
        keys = torch.searchsorted(torch.tensor(rows, dtype=torch.long), keys)
    return keys, valid, rel


# -- the flattened index of this rank's queries --------------------------------------------------

_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True, eq=False)
class Index:
    """Where each local query's window slots are: ``G[NQ, K]`` window positions,
    ``valid[NQ, K]`` (None: all slots exist), ``rel[NQ, K]`` flat rpb indices, and the
    chunk of slots gathered at once."""
    G: torch.Tensor
    valid: torch.Tensor | None
    rel: torch.Tensor
    chunk: int


def local_index(dims: tuple[tuple, ...], device: torch.device, row_elems: int) -> Index:
    """The ``Index`` of a rank's queries; ``dims`` holds, per spatial dim,
    ``(L, k, d, causal, q0, nq, rows, w)``: the global length, kernel, dilation,
    causality, the rank's query rows ``[q0, q0 + nq)``, its window rows (None for the
    whole dim) and the window's extent. ``row_elems``: elements per gathered token
    (batch x heads x head dim), which sets the chunk of slots gathered at once."""
    G, valid, rel = _combined(dims, str(device))
    K = G.shape[1]
    # Gather about _CHUNK_ELEMS elements at a time: few Python steps for small shards,
    # temporaries of a few MiB for large ones (cache-sized: faster than big chunks).
    chunk = max(1, min(K, _CHUNK_ELEMS // max(1, row_elems * G.shape[0])))
    return Index(G, valid, rel, chunk)


@lru_cache(maxsize=16)  # entries are NQ x K indices on the device: keep few
def _combined(dims: tuple[tuple, ...], device: str):
    N = len(dims)
    G = R = V = None
    wstride = rstride = 1
    for n in reversed(range(N)):
        L, k, d, causal, q0, nq, rows, w = dims[n]
        pos, val, rel = _dim_local(L, k, d, causal, q0, nq, rows)
        shape = [1] * (2 * N)
        shape[n], shape[N + n] = nq, k
        term, rterm = pos.view(shape) * wstride, rel.view(shape) * rstride
        G = term if G is None else G + term
        R = rterm if R is None else R + rterm
        if val is not None:
            V = val.view(shape) if V is None else V & val.view(shape)
        wstride *= w
        rstride *= 2 * k - 1
    full = [dm[5] for dm in dims] + [dm[1] for dm in dims]
    NQ, K = math.prod(full[:N]), math.prod(full[N:])
    G = G.expand(full).reshape(NQ, K).to(device)
    R = R.expand(full).reshape(NQ, K).to(device)
    V = None if V is None else V.expand(full).reshape(NQ, K).to(device)
    return G, V, R


# -- the local kernel -----------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in _HALF else t.dtype


def _gather(x: torch.Tensor, ix: Index, j0: int, j1: int) -> torch.Tensor:
    """``x[B, W, H, D]`` at the slots ``[j0, j1)`` of every query: ``[B, NQ, c, H, D]``."""
    G = ix.G[:, j0:j1]
    return x.index_select(1, G.reshape(-1)).view(x.shape[0], *G.shape, *x.shape[2:])


def _scores(q: torch.Tensor, kw: torch.Tensor, ix: Index, bias: torch.Tensor | None,
            scale: float, j0: int, j1: int) -> torch.Tensor:
    """Scores of the slots ``[j0, j1)``, ``[B, NQ, c, H]``: a gather and an elementwise
    product summed over head_dim. Memory-bound; batched per-token matrix products this
    small (1 x D by D x c) measured several times slower on CPU."""
    s = (q.unsqueeze(2) * _gather(kw, ix, j0, j1)).sum(-1) * scale
    return s if bias is None else s + bias[:, j0:j1]


def _bias(rpb: torch.Tensor | None, ix: Index, cd: torch.dtype) -> torch.Tensor | None:
    """``rpb`` at every query's slots, ``[NQ, K, H]``."""
    if rpb is None:
        return None
    return rpb.to(cd).reshape(rpb.shape[0], -1)[:, ix.rel].permute(1, 2, 0)


def attend_forward(q: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor, rpb: torch.Tensor | None,
             ix: Index, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output ``[B, NQ, H, Dv]``, log-sum-exp ``[B, NQ, 1, H]``), differentiable torch
    code (the double backward differentiates it): scores slot chunk by slot chunk,
    bias, mask, softmax over the slots, weighted values."""
    K = ix.G.shape[1]
    cd = compute_dtype(q)
    q, kw, vw = q.to(cd), kw.to(cd), vw.to(cd)
    bias = _bias(rpb, ix, cd)
    s = torch.cat([_scores(q, kw, ix, bias, scale, j, min(j + ix.chunk, K))
                   for j in range(0, K, ix.chunk)], dim=2)
    if ix.valid is not None:
        s = s.masked_fill(~ix.valid[..., None], float("-inf"))
    lse = torch.logsumexp(s, dim=2, keepdim=True)
    p = torch.exp(s - lse)
    out = vw.new_zeros((*q.shape[:-1], vw.shape[-1]))
    for j in range(0, K, ix.chunk):
        j1 = min(j + ix.chunk, K)
        out = out + (p[:, :, j:j1, :, None] * _gather(vw, ix, j, j1)).sum(2)
    return out, lse


def _attend_primal(q, kw, vw, rpb, ix, scale):
    out, _ = attend_forward(q, kw, vw, rpb, ix, scale)
    return out.to(q.dtype)


attend = custom_vjp(_attend_primal, nondiff_argnums=(4, 5))


def _attend_fwd(q, kw, vw, rpb, ix, scale):
    with torch.no_grad():
        out, lse = attend_forward(q, kw, vw, rpb, ix, scale)
    return out.to(q.dtype), (q, kw, vw, rpb, out, lse)


def _attend_bwd(ix, scale, res, g):
    q, kw, vw, rpb, out, lse = res
    if torch.is_grad_enabled():  # create_graph: differentiate the forward again
        args = [a for a in (q, kw, vw, rpb) if a is not None]
        _, vjp = torch.func.vjp(
            lambda *a: attend_forward(*a, *([None] if rpb is None else []), ix, scale)[0], *args)
        got = vjp(g.to(out.dtype))
        return (*(t.to(a.dtype) for t, a in zip(got, args)), *([None] if rpb is None else []))
    return attend_backward(q, kw, vw, rpb, out, lse, g, ix, scale)


def attend_backward(q, kw, vw, rpb, out, lse, g, ix, scale):
    """The softmax-attention VJP, recomputing the scores chunk by chunk: ``dS = P * (dP -
    rowsum(dO * O))``; key and value gradients are added into the window at the
    gathered positions (``index_add_``: the transpose of ``index_select``)."""
    cd = out.dtype
    qc, kc, vc, g = q.to(cd), kw.to(cd), vw.to(cd), g.to(cd)
    K = ix.G.shape[1]
    bias = _bias(rpb, ix, cd)
    delta = (g * out).sum(-1).unsqueeze(2)  # [B, NQ, 1, H]
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    drpb = None if rpb is None else torch.zeros(rpb.shape[0], rpb[0].numel(), dtype=cd,
                                                device=rpb.device)
    for j in range(0, K, ix.chunk):
        j1 = min(j + ix.chunk, K)
        at = ix.G[:, j:j1].reshape(-1)
        p = torch.exp(_scores(qc, kc, ix, bias, scale, j, j1) - lse)  # [B, NQ, c, H]
        if ix.valid is not None:
            p = p.masked_fill(~ix.valid[:, j:j1, None], 0.0)
        vg = _gather(vc, ix, j, j1)
        ds = p * ((g.unsqueeze(2) * vg).sum(-1) - delta)
        del vg
        dv.index_add_(1, at, (p[..., None] * g.unsqueeze(2)).flatten(1, 2))
        dq += (ds[..., None] * _gather(kc, ix, j, j1)).sum(2)
        dk.index_add_(1, at, (ds[..., None] * qc.unsqueeze(2)).flatten(1, 2))
        if drpb is not None:
            drpb.index_add_(1, ix.rel[:, j:j1].reshape(-1),
                            ds.sum(0).permute(2, 0, 1).reshape(ds.shape[3], -1))
    dq, dk = dq * scale, dk * scale
    return (dq.to(q.dtype), dk.to(kw.dtype), dv.to(vw.dtype),
            None if drpb is None else drpb.view(rpb.shape).to(rpb.dtype))


attend.defvjp(_attend_fwd, _attend_bwd)
