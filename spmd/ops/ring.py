"""``ring_attention``: scaled dot-product attention over a sequence split across ranks.

Each rank keeps its query rows and passes K/V blocks around the ring of the mesh axis
(to index + 1, from index - 1). At step t a rank attends to the block of rank
``index - t`` while the next block travels: the transfer starts before the compute.
Partial results merge with flash attention's running max and rescaled sums in float32
or better, so the result is the single-device one to rounding. The backward is a second
ring pass, flash-attention style, from the saved output and log-sum-exp: K/V travel
again, and each block's dK/dV accumulator follows it, one hop behind, back to its owner.

Sequence positions, causality and the mask: without ``balance``, rank i of the axis
holds the i-th consecutive run of the sequence (uneven and empty runs allowed). With
``balance="zigzag"``, the user stores the sequence permuted by ``zigzag_order``; rank i
then holds chunks i and 2n-1-i of 2n, which evens out causal work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..collectives._anchor import anchor
from ..collectives.compiled import graph_op, like_query
from ..collectives.vjp import custom_vjp, needs_input_grad
from ..comm import comm_of, gather_ints
from ..comm.stats import in_backward
from ..comm.threads import in_rank_greenlet
from ..core._context import on_mesh, static_layout, static_mismatch
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import balanced_sizes
from ..core.mesh import Group, Mesh
from ..transforms.spec_arg import last_dim_of_v, sequence_split, takes_sharded
from . import _attention_block as blk

__all__ = ["ring_attention", "zigzag_order"]

_HALF = (torch.float16, torch.bfloat16)
_WHAT = "ring_attention"


@takes_sharded(last_dim_of_v, also=("k", "v"), check=sequence_split)
@graph_op(like_query)
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh,
                   axis: str | tuple[str, ...], *, seq_dim: int, causal: bool = False,
                   attn_mask: torch.Tensor | None = None, scale: float | None = None,
                   enable_gqa: bool = False, balance: str | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of the global q, k, v whose shards these are,
    with the sequence dim split over ``axis``; returns this rank's rows of the output.

    Layout: moving ``seq_dim`` to -2 gives SDPA's layout, ``(*batch, H, L, E)``: the
    last dim is the feature dim, the dim just before the sequence (once moved) the
    heads. So ``seq_dim=-2`` takes ``(B, H, L, E)`` and ``seq_dim=1`` takes
    ``(B, L, H, E)``. q, k, v have the same number of dims (>= 2) and the same
    ``seq_dim`` (negative or not); only their ``seq_dim`` sizes vary between ranks.

    Args:
        q: this rank's query rows, ``(*Bq, Hq, Lq_local, E)`` once ``seq_dim`` is at -2.
        k: this rank's keys, ``(*Bk, Hkv, S_local, E)`` likewise.
        v: this rank's values, ``(*Bk, Hkv, S_local, Ev)``: k's shape but the last dim.
        mesh: the mesh the code runs on.
        axis: the mesh axis (or tuple of axes) that splits the sequence of q, k and v;
            rank i along it holds the i-th part. q and kv may have different global
            lengths and different splits.
        seq_dim: the sequence dim of q, k and v.
        causal: query at global position i attends keys j <= i (torch's ``is_causal``,
            top-left aligned when Lq != S).
        attn_mask: bool (True = attend) or additive float (q's dtype), always in SDPA's
            layout ``(..., Lq_local or 1, S or 1)``, broadcastable to
            ``(*B, Hq, Lq_local, S)``: its query dim holds THIS rank's query rows, its
            key dim the GLOBAL key sequence (in stored order under zigzag). Combines
            with ``causal`` (torch refuses both; here a key must pass both). A float
            mask that requires grad gets its gradient; one whose query dim is 1 is
            shared by the ranks, and each gets its own rows' part (shard_map sums a
            replicated input's gradient over the axis; per-rank code psums it).
        scale: as SDPA's (default ``1 / sqrt(E)``).
        enable_gqa: as SDPA's: Hq a multiple of Hkv, q head h uses kv head
            ``h // (Hq // Hkv)``. Without it Hkv must equal Hq or be 1 (broadcast).
        balance: None, or ``"zigzag"``: q and k/v were stored permuted by
            ``zigzag_order(L, n)`` (``n``: ranks along ``axis``) and split by its sizes,
            each with its own length. Causality then refers to the ORIGINAL positions;
            the mask's rows and columns to the stored (permuted) order.

    Returns:
        This rank's query rows of the attention output, laid out like q with E -> Ev,
        in q's dtype. A query row that may attend to no key (all masked, or S == 0)
        gets zeros, as torch's SDPA. float16/bfloat16 are computed in float32.

    Communication:
        Forward: ``n - 1`` all_to_alls named ``"ring_attention"`` over ``axis``; in
        each a rank sends its current K/V block (k and v packed, q's dtype) to index +
        1 and nothing to the others: every block visits every other rank once, no hop
        back, so each rank sends exactly (n - 1) K/V blocks (those of ranks index,
        index - 1, ..., index - n + 2). Given no cached layout, one int64 all_gather
        ``"ring_attention sizes"`` of the shapes first.

    Backward:
        A second ring with a hand-written rule (P = exp(S - lse), dV += P^T dO,
        dS = P * (dO V^T - rowsum(dO * O)), dQ += dS K scale, dK += dS^T Q scale): the
        same n - 1 K/V hops, plus n - 1 hops ``"ring_attention dkv"`` of each block's
        dK/dV accumulator (compute dtype), one step behind its block, ending at its
        owner; the owner adds its own part, half of its query rows first and half
        while the last accumulator comes home, so every transfer overlaps compute.
        Bytes per rank: (n - 1) K/V blocks + (n - 1) dK/dV blocks. Double backward
        raises (the rule is once-differentiable).

    Memory:
        Saved for backward: q, k, v, the output and the log-sum-exp (B*Hq*Lq_local,
        compute dtype), as flash attention; plus the mask if given. Peak per rank on
        top of that: two K/V blocks (the current and the one arriving; the torch
        backend stages a send copy too; half inputs add a float32 copy of the
        current one), one score tile (``B*Hq*rows*cols`` elements,
        about 4M, at least a 128-key strip, in the compute dtype, a few temporaries of
        it), and the float32-or-better accumulators of this rank's rows; in backward
        also three dK/dV blocks (this step's, the one in flight, the own one) and dQ.

    Ranks without data:
        A rank with no query rows still forwards every block (its compute is empty and
        it returns an empty output); a rank with no keys sends and computes empty blocks.
        Every rank takes part in every transfer, forward and backward.

    Raises:
        SpecError: an unknown ``axis``; ``seq_dim`` out of range or the last dim;
            shapes that disagree (ndim, heads, E, Ev, batch dims, k vs v, the non-sequence
            dims between ranks); a mask whose shape does not fit; zigzag shard sizes
            that are not ``zigzag_order``'s; an unknown ``balance``. All before any data
            moves, on every rank alike (shape checks use the one size exchange).
        TypeError: non-tensor or non-floating q/k/v, different dtypes, a mask dtype
            other than bool or q's.

    Example:
        >>> from spmd.ops import ring_attention
        >>> import torch.nn.functional as F
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
        >>> f = lambda q, k, v: ring_attention(q, k, v, mesh, "sp", seq_dim=2, causal=True)
        >>> s = P(None, None, "sp")
        >>> y = spmd.shard_map(f, mesh, (s, s, s), s)(q, k, v)
        >>> torch.allclose(y, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    rc = on_mesh(mesh, _WHAT, q)
    axes, sd, two_d = _static_checks(q, k, v, mesh, axis, seq_dim, attn_mask, scale, balance)
    group = mesh.group(axes, rc.rank)
    qs, ks, vs = (t.unsqueeze(0) if two_d else t for t in (q, k, v))
    sd = sd + 1 if two_d else sd
    qs, ks, vs = (t.movedim(sd, -2) for t in (qs, ks, vs))
    mask = attn_mask
    if mask is not None and mask.ndim < qs.ndim:
        mask = mask.reshape((1,) * (qs.ndim - mask.ndim) + tuple(mask.shape))
    rows = _exchange(qs, ks, vs, mask, group, mesh, rc.rank)
    plan = _plan(rows, mesh, group, qs.ndim, causal, enable_gqa, balance, scale)
    if plan.expand_q:  # q with one head against many kv heads: SDPA broadcasts q
        qs = qs.expand(*qs.shape[:-3], plan.hkv, *qs.shape[-2:])
    if not (qs.requires_grad or ks.requires_grad or vs.requires_grad):
        qs = anchor(qs)  # every rank must run the backward ring, even without a gradient
    out = (_ring_rule if in_rank_greenlet() else _Ring.apply)(qs, ks, vs, mask, plan)[0]
    out = out.movedim(-2, sd)
    return out.squeeze(0) if two_d else out


def zigzag_order(length: int, n: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The order that balances causal ring attention over ``n`` ranks.

    The sequence is cut into 2n balanced chunks (``numpy.array_split`` sizes); rank i
    holds chunks i and 2n-1-i, so every rank has as many early as late positions.

    Returns:
        ``(perm, sizes)``: store ``x_z = x.index_select(seq_dim, perm)`` and split it
        by ``sizes`` (one per rank, in rank order); bring an output back with
        ``y = y_z.index_select(seq_dim, torch.argsort(perm))``. ``perm`` is int64 on
        the CPU.

    Raises:
        ValueError: a negative length or n < 1.

    Example:
        >>> from spmd.ops import zigzag_order
        >>> perm, sizes = zigzag_order(10, 2)
        >>> perm.tolist(), sizes
        ([0, 1, 2, 8, 9, 3, 4, 5, 6, 7], (5, 5))
    """
    if not isinstance(length, int) or length < 0 or not isinstance(n, int) or n < 1:
        raise ValueError(f"zigzag_order: needs an int length >= 0 and n >= 1, got "
                         f"length={length!r}, n={n!r}")
    starts, chunks = _chunks(length, n)
    idx = [i for r in range(n) for c in (r, 2 * n - 1 - r)
           for i in range(starts[c], starts[c] + chunks[c])]
    sizes = tuple(chunks[r] + chunks[2 * n - 1 - r] for r in range(n))
    return torch.tensor(idx, dtype=torch.int64), sizes


def _chunks(length: int, n: int) -> tuple[list[int], tuple[int, ...]]:
    chunks = balanced_sizes(length, 2 * n)
    starts = [0]
    for c in chunks[:-1]:
        starts.append(starts[-1] + c)
    return starts, chunks


# -- checks: the arguments alone, then the shapes of every rank ------------------------------

def _static_checks(q, k, v, mesh, axis, seq_dim, mask, scale, balance):
    """What every rank can check without the others: returns the axes, seq_dim
    normalised, and whether the tensors are 2-d (no heads dim)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHAT}: {name} must be a tensor, got {describe(t)}")
        if not t.is_floating_point():
            raise TypeError(f"{_WHAT}: {name} must be a real floating tensor, got {describe(t)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{_WHAT}: q, k, v must share a dtype, got q {describe(q)}, "
                        f"k {describe(k)}, v {describe(v)}; convert them to one dtype")
    if not q.ndim == k.ndim == v.ndim or q.ndim < 2:
        raise SpecError(f"{_WHAT}: q, k, v must have the same number of dims (>= 2), got "
                        f"q {describe(q)}, k {describe(k)}, v {describe(v)}; add the "
                        f"missing batch dims with unsqueeze")
    axes = mesh.check_axes(axis, _WHAT)
    if not axes:
        raise SpecError(f"{_WHAT}: axis must name at least one mesh axis of {mesh!r}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"{_WHAT}: seq_dim must be an int, got {seq_dim!r}")
    nd = q.ndim
    if not -nd <= seq_dim < nd or seq_dim % nd == nd - 1:
        raise SpecError(f"{_WHAT}: seq_dim={seq_dim} is not a sequence dim of q "
                        f"{describe(q)}: it must be one of 0..{nd - 2} or -{nd}..-2 (the "
                        f"last dim is the feature dim E)")
    if balance not in (None, "zigzag"):
        raise SpecError(f"{_WHAT}: balance must be None or 'zigzag', got {balance!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{_WHAT}: scale must be a number or None, got {scale!r}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{_WHAT}: attn_mask must be a tensor or None, got {describe(mask)}")
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            raise TypeError(f"{_WHAT}: attn_mask must be bool (True = attend) or q's dtype "
                            f"{q.dtype} (added to the scores), got {describe(mask)}")
        if not 2 <= mask.ndim <= q.ndim:
            raise SpecError(f"{_WHAT}: attn_mask {describe(mask)} must have 2 to {q.ndim} "
                            f"dims, SDPA's layout (..., Lq_local or 1, S or 1)")
    return axes, seq_dim % nd, nd == 2


def _exchange(q, k, v, mask, group: Group, mesh: Mesh, rank: int) -> tuple[tuple[int, ...], ...]:
    """Every rank's shapes (q, k, v in SDPA layout, then the mask's or -1s), in group
    order: one int64 all_gather, or the value the same call learnt last time."""
    nd = q.ndim
    mine = (*q.shape, *k.shape, *v.shape, *(mask.shape if mask is not None else (-1,) * nd))
    if group.size == 1:
        return (tuple(mine),)

    def exchange():
        return gather_ints(mesh, group, mine, name=f"{_WHAT} sizes", device=q.device)

    def check(rows):
        if rows[group.index] != tuple(mine):
            raise static_mismatch(_WHAT, _shapes_str(mine, nd), _shapes_str(rows[group.index], nd),
                                  rank)

    return static_layout(mesh, (_WHAT, group.axes, nd, mask is not None), exchange, check)


def _split_row(row, nd):
    return row[:nd], row[nd:2 * nd], row[2 * nd:3 * nd], (None if row[3 * nd] < 0 else row[3 * nd:])


def _shapes_str(row, nd) -> str:
    q, k, v, m = _split_row(tuple(row), nd)
    return f"q {list(q)}, k {list(k)}, v {list(v)}" + (f", attn_mask {list(m)}" if m else "")


@dataclass(frozen=True)
class _Plan:
    mesh: Mesh
    group: Group
    q_segs: tuple          # per rank: its query segments (start, stop, position)
    k_segs: tuple          # per rank: its K/V block's segments
    k_cols: tuple[int, ...]  # per rank: its block's first column in the global (stored) keys
    block_shapes: tuple    # per rank: its packed K/V block's shape
    hkv: int
    g: int
    e: int
    expand_q: bool
    causal: bool
    scale: float


def _plan(rows, mesh: Mesh, group: Group, nd: int, causal: bool, gqa: bool, balance,
          scale) -> _Plan:
    """Check every rank's shapes (the same on every rank: the same error) and plan."""
    parts = [_split_row(r, nd) for r in rows]
    q0, k0, v0, m0 = parts[0]
    for i, (qr, kr, vr, mr) in enumerate(parts):
        r = group.ranks[i]
        for name, a, b in (("q", qr, q0), ("k", kr, k0), ("v", vr, v0)):
            if a[:-2] + a[-1:] != b[:-2] + b[-1:]:
                raise SpecError(
                    f"{_WHAT}: {name} is {list(a)} (seq_dim moved to -2) on rank {r} but "
                    f"{list(b)} on rank {group.ranks[0]}; only the sequence dim may differ "
                    f"between the ranks of {group.axes}")
        if kr[-2] != vr[-2] or kr[:-2] != vr[:-2]:
            raise SpecError(
                f"{_WHAT}: k {list(kr)} and v {list(vr)} (seq_dim moved to -2) on rank {r} "
                f"must have the same shape but the last dim; expand them to one shape")
        if (mr is None) != (m0 is None):
            raise SpecError(f"{_WHAT}: rank {r} passes {'no' if mr is None else 'an'} "
                            f"attn_mask but rank {group.ranks[0]} does not; pass one on every rank")
    hq, e = q0[-3], q0[-1]
    hkv, ek = k0[-3], k0[-1]
    if e != ek:
        raise SpecError(f"{_WHAT}: q's feature dim E={e} differs from k's E={ek} "
                        f"(q {list(q0)}, k {list(k0)}); they must match")
    if e == 0:
        raise SpecError(f"{_WHAT}: the feature dim E of q and k is 0; it must be >= 1")
    try:
        torch.broadcast_shapes(tuple(q0[:-3]), tuple(k0[:-3]))
    except RuntimeError:
        raise SpecError(f"{_WHAT}: the batch dims of q {list(q0[:-3])} and k/v "
                        f"{list(k0[:-3])} do not broadcast (SDPA layout {list(q0)} vs "
                        f"{list(k0)})") from None
    expand_q = False
    if gqa:
        if hkv == 0 or hq % hkv:
            raise SpecError(f"{_WHAT}: enable_gqa needs q's heads ({hq}) to be a multiple "
                            f"of k/v's heads ({hkv})")
        g = hq // hkv
    elif hkv == hq or hkv == 1:
        g = hq // hkv if hkv else 1
    elif hq == 1:
        g, expand_q = 1, True
    else:
        raise SpecError(f"{_WHAT}: q has {hq} heads and k/v {hkv}; they must be equal (or "
                        f"one of them 1), or pass enable_gqa=True for grouped-query attention")
    heads = hkv if expand_q else hq
    lqs = [p[0][-2] for p in parts]
    ss = [p[1][-2] for p in parts]
    lq, s_len = sum(lqs), sum(ss)
    if m0 is not None:
        bshape = torch.broadcast_shapes(tuple(q0[:-3]), tuple(k0[:-3]))
        for i, p in enumerate(parts):
            want = (*bshape, heads, lqs[i], s_len)
            mr = p[3]
            if any(a not in (1, b) for a, b in zip(mr, want)):
                raise SpecError(
                    f"{_WHAT}: attn_mask is {list(mr)} on rank {group.ranks[i]} but must "
                    f"broadcast to {list(want)} (batch, heads, this rank's {lqs[i]} query "
                    f"rows or 1, all {s_len} keys or 1)")
    n = group.size
    if balance == "zigzag":
        for name, sizes, total in (("q", lqs, lq), ("k/v", ss, s_len)):
            want = zigzag_order(total, n)[1]
            if tuple(sizes) != want:
                raise SpecError(
                    f"{_WHAT}: balance='zigzag' needs {name}'s sequence ({total} long) split "
                    f"{list(want)} over {group.axes} (zigzag_order({total}, {n})), got "
                    f"{list(sizes)}; store x.index_select(seq_dim, perm) split by those sizes")
        q_segs = _zigzag_segs(lq, n)
        k_segs = _zigzag_segs(s_len, n)
    else:
        q_segs = _run_segs(lqs)
        k_segs = _run_segs(ss)
    k_cols = tuple(sum(ss[:i]) for i in range(n))
    ev = parts[0][2][-1]
    shapes = tuple((*p[1][:-1], e + ev) for p in parts)
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(e)
    return _Plan(mesh, group, q_segs, k_segs, k_cols, shapes, hkv, g, e, expand_q, causal, sc)


def _run_segs(sizes) -> tuple:
    out, pos = [], 0
    for s in sizes:
        out.append(((0, s, pos),))
        pos += s
    return tuple(out)


def _zigzag_segs(length: int, n: int) -> tuple:
    starts, chunks = _chunks(length, n)
    out = []
    for r in range(n):
        a, b = r, 2 * n - 1 - r
        out.append(((0, chunks[a], starts[a]), (chunks[a], chunks[a] + chunks[b], starts[b])))
    return tuple(out)


# -- the two rings ----------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _start(block: torch.Tensor, plan: _Plan, owner: int, name: str):
    """Start sending ``block`` to index + 1 and nothing to the others; what arrives
    from index - 1 is a block (K/V, or a dK/dV accumulator) shaped as ``owner``'s."""
    g = plan.group
    n, me = g.size, g.index
    chunks = [block.new_empty((0,))] * n
    chunks[(me + 1) % n] = block
    shapes = [(0,)] * n
    shapes[(me - 1) % n] = plan.block_shapes[owner]
    return comm_of(plan.mesh).all_to_all_async(chunks, g, name=name, shapes=shapes)


def _masking(plan: _Plan, mask5, owner: int) -> blk.Masking:
    return blk.Masking(plan.causal, mask5, plan.k_cols[owner])


def _grouped_mask(mask: torch.Tensor | None, plan: _Plan, cdt) -> torch.Tensor | None:
    """The mask in q's grouped layout ``(*B, Hkv, g, Lq|1, S|1)`` (a view; floats in
    the compute dtype)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask.to(cdt)
    h = mask.shape[-3]
    if h == 1 or plan.expand_q:
        return mask.unsqueeze(-3)
    return mask.unflatten(-3, (plan.hkv, plan.g))


class _Ring(torch.autograd.Function):
    """The ring's forward and its hand-written backward ring. setup_context style, so
    torch.func (and torch.compile's spmd::graph_op, which records with it) can use it:
    the log-sum-exp the backward needs is a second, non-differentiable output."""

    @staticmethod
    def forward(q, k, v, mask, plan):
        cdt = _compute_dtype(q.dtype)
        g = plan.group
        n, me = g.size, g.index
        q5 = (q.to(cdt) * plan.scale).unflatten(-3, (plan.hkv, plan.g))
        mask5 = _grouped_mask(mask, plan, cdt)
        bshape = torch.broadcast_shapes(q5.shape[:-4], k.shape[:-3])
        acc = q5.new_zeros((*bshape, *q5.shape[-4:-1], v.shape[-1]))
        m = q5.new_full(acc.shape[:-1], -math.inf)
        ssum = q5.new_zeros(acc.shape[:-1])
        cur = torch.cat([k, v], -1)
        for t in range(n):
            owner = (me - t) % n
            work = _start(cur, plan, (owner - 1) % n, _WHAT) if t < n - 1 else None
            _fwd_step(q5, cur, plan, mask5, owner, (acc, m, ssum), cdt)
            if work is not None:
                cur = work.wait()[(me - 1) % n]
        out5, lse = blk.finish((acc, m, ssum), q.dtype)
        return out5.flatten(-4, -3), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, plan = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.plan = plan
        ctx.mask_is_float = mask is not None and mask.dtype != torch.bool
        ctx.save_for_backward(q, k, v, out, lse, mask)

    @staticmethod
    @once_differentiable
    def backward(ctx, gout, _glse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        plan = ctx.plan
        with in_backward():
            dq, dk, dv, dmask = _ring_backward(q, k, v, out, lse, mask, gout, plan,
                                               ctx.needs_input_grad[3] and ctx.mask_is_float)
        return dq, dk, dv, dmask, None


def _ring_fwd(q, k, v, mask, plan):
    out, lse = _Ring.forward(q, k, v, mask, plan)
    return (out, lse), (q, k, v, out, lse, mask, mask is not None and mask.dtype != torch.bool)


def _ring_bwd(plan, res, g):
    q, k, v, out, lse, mask, mask_is_float = res
    dq, dk, dv, dmask = _ring_backward(q, k, v, out, lse, mask, g[0], plan,
                                       mask_is_float and needs_input_grad()[3])
    return dq, dk, dv, dmask


# The same ring as a custom_vjp rule, for the simulated mesh's rank greenlets, where a
# rule is one autograd node over every rank (collectives/mesh_vjp.py) and so its
# backward ring meets the other ranks' in a single backward pass.
_ring_rule = custom_vjp(lambda q, k, v, mask, plan: _Ring.forward(q, k, v, mask, plan),
                        nondiff_argnums=(4,))
_ring_rule.defvjp(_ring_fwd, _ring_bwd)


def _fwd_step(q5, cur, plan, mask5, owner, state, cdt):
    """Fold the K/V block of ``owner`` into the running state (a hook point for tests)."""
    c = cur.to(cdt)
    e = plan.e
    blk.forward_block(q5, c[..., :e], c[..., e:], _masking(plan, mask5, owner),
                      plan.q_segs[plan.group.index], plan.k_segs[owner], state)


def _bwd_step(q5, kv, plan, mask5, owner, go5, lse, delta, dq, dkv, dmask, cdt, rows):
    """Add the contributions of ``rows`` (query segments) against the block of ``owner``
    (``kv``: packed, or the pair (k, v)) (a hook point for tests)."""
    e = plan.e
    if isinstance(kv, tuple):
        kb, vb = (t.to(cdt) for t in kv)
    else:
        c = kv.to(cdt)
        kb, vb = c[..., :e], c[..., e:]
    blk.backward_block(q5, kb, vb, _masking(plan, mask5, owner), rows, plan.k_segs[owner],
                       go5, lse, delta, dq, dkv[..., :e], dkv[..., e:], dmask)


def _halves(segs: blk.Segments) -> tuple[blk.Segments, blk.Segments]:
    """The query segments cut at the middle row: the rows before it and from it on."""
    r = sum(b - a for a, b, _ in segs) // 2
    first = tuple((a, min(b, r), p) for a, b, p in segs if a < r)
    last = tuple((max(a, r), b, p + max(0, r - a)) for a, b, p in segs if b > r)
    return first, last


def _ring_backward(q, k, v, out, lse, mask, gout, plan: _Plan, mask_grad: bool):
    """The second ring. The own block's work is cut in two halves of the query rows,
    one first (while the first K/V transfer runs) and one last (while the last dK/dV
    accumulator comes home), so every transfer has compute to hide behind."""
    cdt = _compute_dtype(q.dtype)
    g = plan.group
    n, me = g.size, g.index
    q5 = (q.to(cdt) * plan.scale).unflatten(-3, (plan.hkv, plan.g))
    go5 = gout.to(cdt).unflatten(-3, (plan.hkv, plan.g))
    delta = (go5 * out.to(cdt).unflatten(-3, (plan.hkv, plan.g))).sum(-1)
    mask5 = _grouped_mask(mask, plan, cdt)
    dq = torch.zeros_like(q5)
    dmask = torch.zeros_like(mask5) if mask_grad else None
    segs = plan.q_segs[me]
    first, last = _halves(segs)
    shape = (*k.shape[:-1], k.shape[-1] + v.shape[-1])
    own = k.new_zeros(shape, dtype=cdt)
    step = (q5, (k, v), plan, mask5, me, go5, lse, delta, dq, own, dmask, cdt)
    cur = torch.cat([k, v], -1) if n > 1 else None
    acc_work = None
    for t in range(n):
        owner = (me - t) % n
        work = _start(cur, plan, (owner - 1) % n, _WHAT) if t < n - 1 else None
        if t == 0:
            _bwd_step(*step, first)
        else:
            dkv = cur.new_zeros(cur.shape, dtype=cdt)
            _bwd_step(q5, cur, plan, mask5, owner, go5, lse, delta, dq, dkv, dmask, cdt, segs)
            if acc_work is not None:  # this block's accumulator, from the rank before
                dkv += acc_work.wait()[(me - 1) % n]
            # what arrives is the accumulator of the block this rank attends to next
            acc_work = _start(dkv, plan, (owner - 1) % n, f"{_WHAT} dkv")
        if work is not None:
            cur = work.wait()[(me - 1) % n]
    del cur
    _bwd_step(*step, last)
    if acc_work is not None:
        own += acc_work.wait()[(me - 1) % n]
    e = plan.e
    dq = (dq * plan.scale).flatten(-4, -3).to(q.dtype)
    dk = own[..., :e].to(k.dtype)
    dv = own[..., e:].to(v.dtype)
    if dmask is not None:
        dmask = dmask.reshape(mask.shape).to(mask.dtype)
    return dq, dk, dv, dmask
