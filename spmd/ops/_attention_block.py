"""The local math of ring attention: one query shard against one key/value block.

Layouts (grouped, so GQA never copies a K/V head): ``q`` is ``(*Bq, Hkv, g, Lq, E)``
(q head ``h`` is kv head ``h // g``, member ``h % g``), a K/V block ``(*Bk, Hkv, S, E)``
and ``(*Bk, Hkv, S, Ev)``; batch dims broadcast as in ``F.scaled_dot_product_attention``.

Positions: a shard is a few *segments*, runs of rows that are consecutive in the
original sequence (one per shard; two under zigzag), each ``(start, stop, pos)``: local
rows ``[start, stop)`` hold positions ``pos, pos + 1, ...``. Causality compares
positions, so a tile of keys that no query of a segment may see is skipped, one that
every query sees needs no mask, and only a tile on the diagonal builds one.

Scores are computed a tile at a time: rows of one segment against at most ``_cols``
keys, ``B * Hq * rows * cols`` elements (about ``_TILE`` or one 128-key strip). The
forward keeps flash attention's running row max ``m``, sum ``l`` and unnormalised
output ``acc`` in the compute dtype (float32 for half inputs); the backward recomputes
``P = exp(S - lse)`` per tile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Segments", "forward_block", "backward_block", "finish"]

Segments = tuple[tuple[int, int, int], ...]

_TILE = 1 << 20     # score elements per tile (4 MiB in float32): cache-sized, few tiles
_COLS = 512         # keys per tile, at least


@dataclass
class Masking:
    """What masks a block: causality by position, and the user's mask (grouped like q,
    its query dim this shard's rows or 1, its key dim the global stored keys or 1)."""

    causal: bool
    mask: torch.Tensor | None       # bool (True = attend) or additive, compute dtype
    col0: int = 0                   # the block's first column in the mask's key dim

    def rows(self, r0: int, r1: int) -> slice:
        return slice(None) if self.mask is None or self.mask.shape[-2] == 1 else slice(r0, r1)

    def cols(self, c0: int, c1: int) -> slice:
        if self.mask is None or self.mask.shape[-1] == 1:
            return slice(None)
        return slice(self.col0 + c0, self.col0 + c1)


def _tiles(q_segs: Segments, k_segs: Segments, causal: bool, row_elems: int):
    """``(r0, r1, qp, c0, c1, kp, diag)`` for every tile with at least one visible key:
    rows ``[r0, r1)`` (row ``r0`` at position ``qp``) against block columns ``[c0, c1)``
    (column ``c0`` at ``kp``); ``diag``: causality masks part of the tile."""
    for s0, s1, sp in q_segs:
        if s1 == s0:
            continue
        # wide tiles: the running output is rescaled once per tile (rows x Ev)
        rows = max(1, min(s1 - s0, _TILE // (row_elems * _COLS)))
        cols = max(_COLS, _TILE // (row_elems * rows))
        for r0 in range(s0, s1, rows):
            r1 = min(s1, r0 + rows)
            qp = sp + (r0 - s0)
            q_last = qp + (r1 - r0) - 1
            for c0, c1, kp0 in k_segs:
                for t0 in range(c0, c1, cols):
                    t1 = min(c1, t0 + cols)
                    kp = kp0 + (t0 - c0)
                    if causal and kp > q_last:
                        break  # only later keys from here on: none visible
                    yield r0, r1, qp, t0, t1, kp, causal and kp + (t1 - t0) - 1 > qp


def _scores(qs: torch.Tensor, ks: torch.Tensor, how: Masking, tile: tuple) -> torch.Tensor:
    """Scaled (q is pre-scaled) and masked scores of one tile: ``(*B, Hkv, g, R, C)``."""
    r0, r1, qp, c0, c1, kp, diag = tile
    s = torch.einsum("...grd,...cd->...grc", qs, ks)
    if how.mask is not None:
        m = how.mask[..., how.rows(r0, r1), how.cols(c0, c1)]
        if m.dtype == torch.bool:
            s.masked_fill_(~m, -math.inf)
        else:
            s.add_(m)
    if diag:
        qpos = torch.arange(qp, qp + (r1 - r0), device=s.device)
        kpos = torch.arange(kp, kp + (c1 - c0), device=s.device)
        s.masked_fill_(kpos[None, :] > qpos[:, None], -math.inf)
    return s


def forward_block(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, how: Masking,
                  q_segs: Segments, k_segs: Segments, state: tuple) -> None:
    """Fold one K/V block into ``state = (acc, m, ssum)`` (updated in place); ``q`` is in
    the compute dtype and already multiplied by the scale."""
    acc, m, ssum = state
    row_elems = math.prod(acc.shape[:-2])
    for tile in _tiles(q_segs, k_segs, how.causal, row_elems):
        r0, r1, _, c0, c1, _, _ = tile
        s = _scores(q[..., r0:r1, :], kb[..., c0:c1, :], how, tile)
        m_old = m[..., r0:r1]
        m_new = torch.maximum(m_old, s.amax(-1))
        shift = torch.where(m_new == -math.inf, 0.0, m_new)  # a row with no key yet
        p = s.sub_(shift.unsqueeze(-1)).exp_()
        alpha = torch.exp(m_old - shift)
        ssum[..., r0:r1] = ssum[..., r0:r1] * alpha + p.sum(-1)
        a = acc[..., r0:r1, :]
        a.mul_(alpha.unsqueeze(-1)).add_(torch.einsum("...grc,...cd->...grd", p, vb[..., c0:c1, :]))
        m_old.copy_(m_new)


def finish(state: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from the merged state. A row that saw no key (all masked) gets 0
    and lse -inf, as torch's SDPA returns 0 there."""
    acc, m, ssum = state
    empty = ssum == 0
    out = acc / torch.where(empty, 1.0, ssum).unsqueeze(-1)
    lse = torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, ssum)))
    return out.to(dtype), lse


def backward_block(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, how: Masking,
                   q_segs: Segments, k_segs: Segments, go: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                   dmask: torch.Tensor | None) -> None:
    """Add one block's contributions to ``dq`` (this shard; still to be multiplied by
    the scale), ``dk``/``dv`` (the block's) and ``dmask`` (this shard's rows, the
    block's columns), in place.

    ``q`` is pre-scaled as in ``forward_block``; ``go`` the output's cotangent, ``lse``
    the saved log-sum-exp (``-inf`` where a row saw no key), ``delta`` = rowsum(go * out).
    """
    row_elems = math.prod(go.shape[:-2])
    shift = torch.where(lse == -math.inf, 0.0, lse)  # such rows have only -inf scores
    for tile in _tiles(q_segs, k_segs, how.causal, row_elems):
        r0, r1, _, c0, c1, _, _ = tile
        qs, ks, vs = q[..., r0:r1, :], kb[..., c0:c1, :], vb[..., c0:c1, :]
        s = _scores(qs, ks, how, tile)
        p = s.sub_(shift[..., r0:r1].unsqueeze(-1)).exp_()
        gos = go[..., r0:r1, :]
        _add(dv[..., c0:c1, :], torch.einsum("...grc,...grd->...cd", p, gos))
        dp = torch.einsum("...grd,...cd->...grc", gos, vs)
        ds = dp.sub_(delta[..., r0:r1].unsqueeze(-1)).mul_(p)
        _add(dq[..., r0:r1, :], torch.einsum("...grc,...cd->...grd", ds, ks))
        _add(dk[..., c0:c1, :], torch.einsum("...grc,...grd->...cd", ds, qs))
        if dmask is not None:
            _add(dmask[..., how.rows(r0, r1), how.cols(c0, c1)], ds)


def _add(into: torch.Tensor, t: torch.Tensor) -> None:
    """``into += t``, summing ``t`` over the dims ``into`` broadcasts."""
    into.add_(t.sum_to_size(into.shape) if t.shape != into.shape else t)
