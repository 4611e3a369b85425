"""``spmd.ops.ring_attention`` on threads meshes against ``F.scaled_dot_product_attention``
on the gathered float64 tensors: values and the gradients of q, k, v (and of an additive
mask), to 1e-10 (``assert_matches_single_device``'s float64 default: the ring only
reorders the softmax's sums into per-block partial sums merged by a max-shifted
log-sum-exp, a few ulps). Under zigzag the reference un-permutes, attends and permutes
back, so causality is checked in the original positions.

Also: float32 error growth on 8 ranks (within 2x of one-device float32 SDPA), the bytes
each rank sends (exactly n - 1 K/V blocks forward; n - 1 K/V and n - 1 dK/dV blocks
backward), the overlap order (the next block leaves before the current one is used),
what is kept for backward and how many remote blocks are alive, and the errors.
"""
from __future__ import annotations

import gc
import importlib
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.core.layout import balanced_sizes
from spmd.ops import ring_attention, zigzag_order
from spmd.testing import assert_matches_single_device
from spmd.testing.memory import SavedBytes

F64 = torch.float64


# -- the case runner --------------------------------------------------------------------------

def _reference(q, k, v, mask, *, causal, gqa, scale, seq_dim, perms):
    """SDPA on the global (stored-order) tensors; zigzag: in the original order."""
    q, k, v = (t.movedim(seq_dim, -2) for t in (q, k, v))
    if perms is not None:
        iq, ik = (torch.argsort(p) for p in perms)
        q, k, v = q[..., iq, :], k[..., ik, :], v[..., ik, :]
        if mask is not None:
            mask = mask[..., iq if mask.shape[-2] > 1 else slice(None), :]
            mask = mask[..., ik] if mask.shape[-1] > 1 else mask
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if perms is not None:
        out = out[..., perms[0], :]
    return out.movedim(-2, seq_dim)


def check(n, q, k, v, *, mask=None, causal=False, gqa=False, scale=None, zigzag=False,
          seq_dim=-2, q_sizes=None, kv_sizes=None, dtype=F64, rtol=None, atol=None):
    """q, k, v (and mask) are GLOBAL tensors in stored order (already zigzag-permuted
    when ``zigzag``); compares ring attention on n threads ranks (or on ``n``, a mesh
    with one axis "sp") with the reference."""
    mesh = n if isinstance(n, spmd.Mesh) else spmd.Mesh((n,), ("sp",))
    n = mesh.size
    sd = seq_dim % q.ndim
    lq, s = q.shape[sd], k.shape[sd]
    perms = None
    if zigzag:
        (pq, q_sizes), (pk, kv_sizes) = zigzag_order(lq, n), zigzag_order(s, n)
        perms = (pq, pk)
    q_sizes = q_sizes or balanced_sizes(lq, n)
    kv_sizes = kv_sizes or balanced_sizes(s, n)
    spec = P(*([None] * sd), "sp")
    specs = [Layout(q.shape, spec, mesh, {sd: q_sizes}),
             Layout(k.shape, spec, mesh, {sd: kv_sizes}),
             Layout(v.shape, spec, mesh, {sd: kv_sizes})]
    args = [q, k, v]
    if mask is not None:
        args.append(mask)
        if mask.shape[-2] > 1:
            specs.append(Layout(mask.shape, P(*([None] * (mask.ndim - 2)), "sp"), mesh,
                                {mask.ndim - 2: q_sizes}))
        else:
            specs.append(P())
    def f_local(q, k, v, m=None):
        return ring_attention(q, k, v, mesh, "sp", seq_dim=seq_dim, causal=causal,
                              attn_mask=m, scale=scale, enable_gqa=gqa,
                              balance="zigzag" if zigzag else None)

    def f_global(q, k, v, m=None):
        return _reference(q, k, v, m, causal=causal, gqa=gqa, scale=scale, seq_dim=sd,
                          perms=perms)

    out_shape = f_global(*args).shape
    out_spec = Layout(tuple(out_shape), spec, mesh, {sd: q_sizes})
    return assert_matches_single_device(f_local, f_global, mesh, tuple(specs), out_spec, *args,
                                        dtype=dtype, rtol=rtol, atol=atol)


def _split(draw, length: int, n: int) -> tuple[int, ...]:
    """Any split of ``length`` into n parts, empty ones included."""
    cuts = sorted(draw(st.lists(st.integers(0, length), min_size=n - 1, max_size=n - 1)))
    edges = [0, *cuts, length]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


@st.composite
def cases(draw):
    n = draw(st.integers(1, 4))
    b = draw(st.sampled_from([1, 2]))
    hq = draw(st.sampled_from([1, 4]))
    hkv = draw(st.sampled_from([h for h in (1, 2, 4) if hq % h == 0]))
    gqa = hkv not in (1, hq) or draw(st.booleans())
    lq = draw(st.integers(1, 67))
    s = draw(st.one_of(st.just(lq), st.integers(1, 67)))
    e = draw(st.sampled_from([8, 16]))
    ev = draw(st.sampled_from([e, 5]))
    causal = draw(st.booleans())
    zigzag = draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "bool", "float", "rows1"]))
    heads_last = draw(st.booleans())  # (B, L, H, E), seq_dim=1
    seed = draw(st.integers(0, 2**16))
    q_sizes = None if zigzag else _split(draw, lq, n)
    kv_sizes = None if zigzag else _split(draw, s, n)
    return dict(n=n, b=b, hq=hq, hkv=hkv, gqa=gqa, lq=lq, s=s, e=e, ev=ev, causal=causal,
                zigzag=zigzag, mask_kind=mask_kind, heads_last=heads_last, seed=seed,
                q_sizes=q_sizes, kv_sizes=kv_sizes)


def _tensors(c):
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["hq"], c["lq"], c["e"], generator=g, dtype=F64)
    k = torch.randn(c["b"], c["hkv"], c["s"], c["e"], generator=g, dtype=F64)
    v = torch.randn(c["b"], c["hkv"], c["s"], c["ev"], generator=g, dtype=F64)
    mask = None
    kind = c["mask_kind"]
    if kind == "bool":
        mask = torch.rand(c["lq"], c["s"], generator=g) > 0.3
    elif kind == "float":
        mask = torch.randn(1, c["hq"], c["lq"], c["s"], generator=g, dtype=F64)
        mask[torch.rand(mask.shape, generator=g) < 0.2] = -math.inf
    elif kind == "rows1":  # query dim broadcast: the same mask row for every query
        mask = torch.rand(c["b"], 1, 1, c["s"], generator=g) > 0.2
    return q, k, v, mask


@given(cases())
def test_matches_sdpa(c):
    q, k, v, mask = _tensors(c)
    seq_dim = -2
    if c["heads_last"]:
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        seq_dim = 1
        if mask is not None and mask.ndim == 4 and mask.shape[1] > 1:
            mask = mask[:, :1]  # keep the mask in SDPA layout; its heads broadcast
    check(c["n"], q, k, v, mask=mask, causal=c["causal"], gqa=c["gqa"], zigzag=c["zigzag"],
          seq_dim=seq_dim, q_sizes=c["q_sizes"], kv_sizes=c["kv_sizes"])


# -- named edge cases -------------------------------------------------------------------------

def _qkv(b=1, hq=2, hkv=2, lq=9, s=9, e=8, ev=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, lq, e, generator=g, dtype=F64),
            torch.randn(b, hkv, s, e, generator=g, dtype=F64),
            torch.randn(b, hkv, s, ev, generator=g, dtype=F64))


@pytest.mark.parametrize("causal", [False, True])
def test_empty_shards_of_q_and_of_kv(causal):
    q, k, v = _qkv(lq=7, s=6)
    check(4, q, k, v, causal=causal, q_sizes=(0, 4, 0, 3), kv_sizes=(3, 0, 0, 3))
    check(3, q, k, v, causal=causal, q_sizes=(7, 0, 0), kv_sizes=(0, 0, 6))


def test_a_rank_with_no_data_at_all():
    q, k, v = _qkv(lq=5, s=4)
    check(3, q, k, v, causal=True, q_sizes=(3, 0, 2), kv_sizes=(2, 0, 2))


@pytest.mark.parametrize("lq,s", [(11, 4), (4, 11), (1, 9), (9, 1)])
@pytest.mark.parametrize("zigzag", [False, True])
def test_causal_with_different_query_and_key_lengths(lq, s, zigzag):
    """Top-left aligned, as torch's is_causal: query i sees keys j <= i."""
    q, k, v = _qkv(lq=lq, s=s)
    check(3, q, k, v, causal=True, zigzag=zigzag)


def test_fully_masked_rows_are_zero_as_in_torch():
    """A row that may attend to nothing: torch's SDPA gives 0 (and zero gradients)."""
    q, k, v = _qkv(lq=6, s=5)
    mask = torch.rand(6, 5) > 0.5
    mask[1] = False
    mask[4] = False
    out = check(2, q, k, v, mask=mask)
    assert out[:, :, 1].abs().max() == 0 and out[:, :, 4].abs().max() == 0
    fmask = torch.zeros(1, 1, 6, 5, dtype=F64)
    fmask[..., 2, :] = -math.inf
    check(3, q, k, v, mask=fmask, causal=True)


def test_no_keys_at_all_gives_zeros_as_in_torch():
    q, k, v = _qkv(lq=5, s=0)
    out = check(2, q, k, v)
    assert out.abs().max() == 0


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_mask_and_causal_combine(mask_kind):
    q, k, v = _qkv(lq=10, s=10)
    mask = (torch.rand(10, 10) > 0.3) if mask_kind == "bool" else torch.randn(2, 10, 10, dtype=F64)
    check(3, q, k, v, mask=mask, causal=True)
    check(3, q, k, v, mask=mask, causal=True, zigzag=True)


def test_mask_that_broadcasts_over_keys():
    q, k, v = _qkv(lq=6, s=7)
    check(2, q, k, v, mask=torch.randn(6, 1, dtype=F64))


def test_gqa_and_head_broadcasts():
    q, k, v = _qkv(hq=6, hkv=2, lq=8, s=8)
    check(3, q, k, v, gqa=True, causal=True)
    q, k, v = _qkv(hq=4, hkv=1, lq=8, s=5)  # kv heads broadcast, no GQA needed
    check(2, q, k, v)
    q, k, v = _qkv(hq=1, hkv=3, lq=8, s=5)  # q heads broadcast
    check(2, q, k, v, causal=True)


def test_batch_dims_broadcast_and_more_of_them():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 2, 7, 8, generator=g, dtype=F64)
    k = torch.randn(1, 3, 2, 6, 8, generator=g, dtype=F64)
    v = torch.randn(1, 3, 2, 6, 4, generator=g, dtype=F64)
    check(3, q, k, v, causal=True)


@pytest.mark.parametrize("seq_dim", [0, 1, -3, 2])
def test_seq_dim_positive_or_negative_and_2d_tensors(seq_dim):
    if seq_dim in (0, -3):  # (L, H, E) with seq_dim 0 == -3
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in _qkv(lq=7, s=6))
    elif seq_dim == 1:  # (B, L, H, E)
        q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(lq=7, s=6))
    else:  # (B, H, L, E)
        q, k, v = _qkv(lq=7, s=6)
    check(3, q, k, v, causal=True, seq_dim=seq_dim)
    q2, k2, v2 = (t[0, 0] for t in _qkv(lq=7, s=6))  # 2-d (L, E): no heads dim
    check(2, q2, k2, v2, causal=True, seq_dim=0)


@pytest.mark.parametrize("tile,cols", [(16, 2), (40, 3), (1, 1)])
def test_scores_in_small_tiles(monkeypatch, tile, cols):
    """Blocks are cut into tiles of rows x keys (large ones by default); tiny tiles
    exercise the cuts (rows and columns, causal skips inside a block, mask slices)."""
    from spmd.ops import _attention_block as blk
    monkeypatch.setattr(blk, "_TILE", tile)
    monkeypatch.setattr(blk, "_COLS", cols)
    q, k, v = _qkv(hq=2, hkv=1, lq=13, s=11)
    mask = torch.randn(2, 13, 11, dtype=F64)
    check(2, q, k, v, mask=mask, causal=True, gqa=True, zigzag=True)
    check(3, q, k, v, mask=mask > 0, causal=True, q_sizes=(5, 0, 8), kv_sizes=(2, 9, 0))


def test_custom_scale():
    q, k, v = _qkv(lq=6, s=6)
    check(2, q, k, v, scale=0.37, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lower_precision(dtype):
    """Computed in float32 (half inputs too): within assert_matches_single_device's
    default tolerance for the dtype, against float64."""
    q, k, v = _qkv(lq=33, s=33, e=16, ev=16)
    out = check(4, q, k, v, causal=True, dtype=dtype, zigzag=True)
    assert out.dtype == dtype


def test_two_dim_mesh_and_an_axis_tuple():
    """Batch over 'dp', sequence over ('x', 'y'): rank order along the tuple is x-major."""
    mesh = spmd.Mesh((2, 2), ("x", "y"))
    q, k, v = _qkv(b=2, lq=10, s=9)
    s = P(None, None, ("x", "y"))
    f = lambda q, k, v: ring_attention(q, k, v, mesh, ("x", "y"), seq_dim=2, causal=True)
    assert_matches_single_device(f, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True), mesh, (s, s, s), s, q, k, v)
    mesh = spmd.Mesh((2, 3), ("dp", "sp"))
    s = P("dp", None, "sp")
    f = lambda q, k, v: ring_attention(q, k, v, mesh, "sp", seq_dim=2, causal=True)
    assert_matches_single_device(f, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True), mesh, (s, s, s), s, q, k, v)


def test_double_backward_raises():
    """The backward rule is once-differentiable: a second derivative raises, on each rank
    (shard_map itself refuses create_graph, so per-rank code differentiates twice)."""
    def body(mesh):
        q, k, v = (t.chunk(2, 2)[mesh.rank].clone().requires_grad_() for t in _qkv(lq=4, s=4))
        y = ring_attention(q, k, v, mesh, "sp", seq_dim=2)
        (gq,) = torch.autograd.grad(y.square().sum(), q, create_graph=True)
        try:
            gq.sum().backward()
        except RuntimeError as e:
            return str(e)

    got = spmd.launch(body, (2,), ("sp",))
    assert all("once_differentiable" in m for m in got), got


# -- zigzag_order -----------------------------------------------------------------------------

@pytest.mark.parametrize("length,n", [(10, 2), (17, 3), (5, 4), (0, 2), (8, 1), (67, 4)])
def test_zigzag_order(length, n):
    perm, sizes = zigzag_order(length, n)
    assert perm.dtype == torch.int64 and sorted(perm.tolist()) == list(range(length))
    assert sum(sizes) == length and len(sizes) == n
    chunks = balanced_sizes(length, 2 * n)
    starts = [sum(chunks[:i]) for i in range(2 * n)]
    off = 0
    for r in range(n):
        a, b = r, 2 * n - 1 - r
        want = list(range(starts[a], starts[a] + chunks[a])) + \
            list(range(starts[b], starts[b] + chunks[b]))
        assert perm[off:off + sizes[r]].tolist() == want
        off += sizes[r]
    if n == 1:
        assert perm.tolist() == list(range(length))


def test_zigzag_order_errors():
    with pytest.raises(ValueError, match="n >= 1"):
        zigzag_order(4, 0)
    with pytest.raises(ValueError, match="length >= 0"):
        zigzag_order(-1, 2)


def test_zigzag_evens_out_causal_work():
    """Count score elements computed per rank: zigzag within 1.5x from the mean, the
    plain split's last rank computes about twice the mean (n=4, L=64)."""
    from spmd.ops import _attention_block as blk
    ra = importlib.import_module("spmd.ops.ring")
    work = {}
    real = blk.forward_block

    def count(q, kb, vb, how, q_segs, k_segs, state):
        r = spmd.axis_index("sp")
        work[r] = work.get(r, 0) + sum((t[1] - t[0]) * (t[4] - t[3])
                                       for t in blk._tiles(q_segs, k_segs, how.causal, 1))
        return real(q, kb, vb, how, q_segs, k_segs, state)

    ra.blk.forward_block = count
    try:
        for zig in (False, True):
            work.clear()
            q, k, v = _qkv(lq=64, s=64)
            with torch.no_grad():
                check(4, q, k, v, causal=True, zigzag=zig)
            mean = sum(work.values()) / 4
            spread = max(work.values()) / mean
            assert (spread < 1.1) if zig else (spread > 1.5), (zig, work)
    finally:
        ra.blk.forward_block = real


# -- float32 error growth on 8 ranks ------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_float32_error_does_not_grow_on_8_ranks(causal):
    """S=4096 over 8 ranks in float32: the max error (values, grads of q, k, v) against
    float64 is within 2x of one-device float32 SDPA's."""
    n, L = 8, 4096
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, L, 16, generator=g, dtype=F64) for _ in range(3))
    go = torch.randn(1, 1, L, 16, generator=g, dtype=F64)

    def grads(f, dtype):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        y = f(*ins)
        gs = torch.autograd.grad(y, ins, go.to(dtype))
        return [t.detach().to(F64) for t in (y, *gs)]

    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    ref = grads(sdpa, F64)
    one = grads(sdpa, torch.float32)
    mesh = spmd.Mesh((n,), ("sp",))
    s = P(None, None, "sp")
    ring = spmd.shard_map(lambda q, k, v: ring_attention(q, k, v, mesh, "sp", seq_dim=2,
                                                         causal=causal), mesh, (s, s, s), s)
    got = grads(ring, torch.float32)
    for name, r, o, x in zip(("out", "dq", "dk", "dv"), ref, one, got):
        e_one, e_ring = (o - r).abs().max().item(), (x - r).abs().max().item()
        assert e_ring <= 2 * e_one, (name, e_ring, e_one)


# -- bytes, overlap, memory -------------------------------------------------------------------

@pytest.mark.parametrize("n,kv_sizes", [(2, (5, 3)), (3, (4, 0, 3)), (4, (2, 2, 2, 2))])
def test_bytes_are_n_minus_1_blocks_per_rank(n, kv_sizes):
    """Forward: rank i sends the K/V blocks of ranks i, i-1, ..., i-n+2 (never its own
    home), one all_to_all each. Backward: those K/V blocks again, and n-1 dK/dV
    accumulators (the blocks of ranks i-1, ..., i-n+1: the last is its owner's i+1)."""
    mesh = spmd.Mesh((n,), ("sp",))
    b, h, e, ev = 2, 2, 8, 4
    s_len = sum(kv_sizes)
    q = torch.randn(b, h, 6, e, dtype=F64, requires_grad=True)
    k = torch.randn(b, h, s_len, e, dtype=F64, requires_grad=True)
    v = torch.randn(b, h, s_len, ev, dtype=F64, requires_grad=True)
    lay = lambda t: Layout(t.shape, P(None, None, "sp"), mesh,  # noqa: E731
                           {2: kv_sizes if t is not q else balanced_sizes(6, n)})
    f = spmd.shard_map(lambda q, k, v: ring_attention(q, k, v, mesh, "sp", seq_dim=2, causal=True),
                       mesh, (lay(q), lay(k), lay(v)), lay(q))
    with spmd.comm_stats() as fwd:
        y = f(q, k, v)
    with spmd.comm_stats() as bwd:
        y.sum().backward()
    row = b * h * (e + ev) * 8  # one sequence position of packed K/V, float64
    for i in range(n):
        want = sum(kv_sizes[(i - t) % n] for t in range(n - 1)) * row
        assert fwd.calls("ring_attention", rank=i) == n - 1
        assert fwd.bytes("ring_attention", rank=i) == want
        assert bwd.bytes("ring_attention", pass_="backward", rank=i) == want
        want_acc = sum(kv_sizes[(i - t) % n] for t in range(1, n)) * row
        assert bwd.calls("ring_attention dkv", rank=i) == n - 1
        assert bwd.bytes("ring_attention dkv", pass_="backward", rank=i) == want_acc
        assert fwd.calls("ring_attention sizes", rank=i) == 1
    names = {r[0] for r in fwd.records} | {r[0] for r in bwd.records}
    assert names == {"ring_attention", "ring_attention dkv", "ring_attention sizes"}


def test_the_next_block_travels_while_the_current_one_is_used(monkeypatch):
    """Forward, each step: the next transfer starts, this block's compute runs, then the
    wait. Backward: the K/V transfer starts before the compute; the dK/dV accumulator
    leaves right after it (the one from the rank before is waited for just before); the
    last one to come home travels while the second half of the own block is computed.
    Recorded on rank 1 of 3. Also: at each compute, at most one received K/V block is
    alive (the one in flight is not materialised on the threads backend)."""
    from spmd.comm.threads import ThreadComm
    ra = importlib.import_module("spmd.ops.ring")

    events, arrived = [], []
    start = ThreadComm.all_to_all_async
    fwd, bwd = ra._fwd_step, ra._bwd_step
    mid = lambda: spmd.axis_index("sp") == 1  # noqa: E731

    def alive():
        gc.collect()
        return sum(1 for w in arrived if w() is not None and w().numel())

    def rec_start(self, chunks, group, *, name, shapes=None):
        work = start(self, chunks, group, name=name, shapes=shapes)
        if not mid():
            return work
        events.append(f"send {name.split()[-1]}")

        class Waited:
            def wait(self):
                out = work.wait()
                arrived.extend(weakref.ref(t) for t in out if name == "ring_attention")
                events.append(f"wait {name.split()[-1]}")
                return out
        return Waited()

    def rec(kind, f):
        def g(*args):
            if mid():
                events.append(f"{kind} {args[4]} alive={alive()}")
            return f(*args)
        return g

    monkeypatch.setattr(ThreadComm, "all_to_all_async", rec_start)
    monkeypatch.setattr(ra, "_fwd_step", rec("fwd", fwd))
    monkeypatch.setattr(ra, "_bwd_step", rec("bwd", bwd))
    mesh = spmd.Mesh((3,), ("sp",))
    q, k, v = (t.requires_grad_() for t in _qkv(lq=9, s=9))
    s = P(None, None, "sp")
    y = spmd.shard_map(lambda q, k, v: ring_attention(q, k, v, mesh, "sp", seq_dim=2),
                       mesh, (s, s, s), s)(q, k, v)
    forward = list(events)
    events.clear()
    arrived.clear()
    y.square().sum().backward()
    assert forward == ["send ring_attention", "fwd 1 alive=0", "wait ring_attention",
                       "send ring_attention", "fwd 0 alive=1", "wait ring_attention",
                       "fwd 2 alive=1"]
    # own block: half its query rows first, half while the last accumulator comes home
    assert events == ["send ring_attention", "bwd 1 alive=0", "wait ring_attention",
                      "send ring_attention", "bwd 0 alive=1", "send dkv", "wait ring_attention",
                      "bwd 2 alive=1", "wait dkv", "send dkv", "bwd 1 alive=0", "wait dkv"]


def test_saved_for_backward_is_q_k_v_out_and_lse():
    """Per rank: this rank's q, k, v, output and log-sum-exp (B*Hq*Lq_local), as flash
    attention keeps: nothing of another rank's blocks, no scores."""
    n, b, h, lq, s_len, e = 3, 2, 4, 12, 15, 8
    mesh = spmd.Mesh((n,), ("sp",))
    q, k, v = _qkv(b=b, hq=h, hkv=h, lq=lq, s=s_len, e=e, ev=e)
    sp = P(None, None, "sp")

    def body(q, k, v):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with SavedBytes() as saved:
            y = ring_attention(q, k, v, mesh, "sp", seq_dim=2, causal=True)
        want = sum(t.nbytes for t in (q, k, v, y)) + b * h * q.shape[2] * 8
        return torch.tensor([[saved.total, want]])

    got = spmd.shard_map(body, mesh, (sp, sp, sp), P("sp"))(q, k, v)
    assert (got[:, 0] == got[:, 1]).all(), got


# -- errors -----------------------------------------------------------------------------------

def _raises(match, *, n=2, q=None, k=None, v=None, exc=spmd.SpecError, spec=None, **kw):
    mesh = spmd.Mesh((n,), ("sp",))
    q0, k0, v0 = _qkv(lq=6, s=6)
    q, k, v = (x if x is not None else d for x, d in ((q, q0), (k, k0), (v, v0)))
    s = spec or P(None, None, "sp")
    kw.setdefault("seq_dim", 2)
    axis = kw.pop("axis", "sp")
    f = lambda q, k, v: ring_attention(q, k, v, mesh, axis, **kw)  # noqa: E731
    with spmd.comm_stats() as stats, pytest.raises(exc, match=match):
        spmd.shard_map(f, mesh, (s, s, s), s)(q, k, v)
    moved = {r[0] for r in stats.records}
    assert moved <= {"ring_attention sizes"}, moved  # no K/V moved
    return moved


def test_errors_before_any_communication():
    assert not _raises("'tp' is not an axis", axis="tp")
    assert not _raises("seq_dim=3 is not a sequence dim", seq_dim=3)
    assert not _raises("seq_dim=-1 is not a sequence dim", seq_dim=-1)
    assert not _raises("balance must be None or 'zigzag'", balance="ring")
    assert not _raises("same number of dims", k=torch.randn(2, 6, 8, dtype=F64),
                       spec=P(None, "sp"), seq_dim=1)
    assert not _raises("share a dtype", k=torch.randn(1, 2, 6, 8), exc=TypeError)
    assert not _raises("real floating", q=torch.ones(1, 2, 6, 8, dtype=torch.int64),
                       exc=TypeError)
    assert not _raises("bool .* or q's dtype", attn_mask=torch.ones(6, 6, dtype=torch.int32),
                       exc=TypeError)
    assert not _raises("attn_mask must be a tensor", attn_mask=[[True]], exc=TypeError)
    assert not _raises("seq_dim must be an int", seq_dim=2.0, exc=TypeError)
    assert not _raises("2 to 4 dims", attn_mask=torch.ones(6, dtype=torch.bool))


def test_shape_errors_after_the_one_size_exchange():
    _raises("q's feature dim E=8 differs from k's E=4", k=torch.randn(1, 2, 6, 4, dtype=F64))
    _raises("q has 4 heads and k/v 2", q=torch.randn(1, 4, 6, 8, dtype=F64),
            k=torch.randn(1, 2, 6, 8, dtype=F64), v=torch.randn(1, 2, 6, 8, dtype=F64))
    _raises("enable_gqa needs q's heads \\(3\\) to be a multiple", enable_gqa=True,
            q=torch.randn(1, 3, 6, 8, dtype=F64))
    _raises("k .* and v .* must have the same shape", v=torch.randn(1, 1, 6, 8, dtype=F64))
    _raises("batch dims .* do not broadcast", q=torch.randn(3, 2, 6, 8, dtype=F64),
            k=torch.randn(2, 2, 6, 8, dtype=F64), v=torch.randn(2, 2, 6, 8, dtype=F64))
    # the mask holds this rank's 3 query rows and all 6 keys: the global mask is wrong
    _raises("attn_mask is \\[1, 1, 6, 6\\] on rank 0 but must broadcast to \\[1, 2, 3, 6\\]",
            attn_mask=torch.ones(6, 6, dtype=torch.bool))
    _raises("must broadcast to \\[1, 2, 3, 6\\]", attn_mask=torch.ones(3, 5, dtype=torch.bool))
    _raises("the feature dim E of q and k is 0", q=torch.randn(1, 2, 6, 0, dtype=F64),
            k=torch.randn(1, 2, 6, 0, dtype=F64))


def test_zigzag_needs_the_zigzag_split():
    mesh = spmd.Mesh((2,), ("sp",))
    q, k, v = _qkv(lq=7, s=7)
    lay = Layout(q.shape, P(None, None, "sp"), mesh, {2: (4, 3)})  # zigzag: (2+1, 2+2)
    f = lambda q, k, v: ring_attention(q, k, v, mesh, "sp", seq_dim=2, balance="zigzag")
    with pytest.raises(spmd.SpecError, match=r"split \[3, 4\] over \('sp',\) \(zigzag_order\(7, 2\)\), got \[4, 3\]"):
        spmd.shard_map(f, mesh, (lay, lay, lay), lay)(q, k, v)


def test_ranks_that_disagree_on_a_non_sequence_dim():
    """Rank 1 has 3 heads, rank 0 has 2: every rank raises the same error."""
    def body(mesh):
        h = 2 + mesh.rank
        q, k, v = (torch.randn(1, h, 3, 8, dtype=F64) for _ in range(3))
        try:
            ring_attention(q, k, v, mesh, "sp", seq_dim=2)
        except spmd.SpecError as e:
            return str(e)

    got = spmd.launch(body, (2,), ("sp",))
    assert len(set(got)) == 1 and "is [1, 3, 3, 8] (seq_dim moved to -2) on rank 1 but" in got[0], got


def test_called_outside_a_mesh():
    mesh = spmd.Mesh((2,), ("sp",))
    q, k, v = _qkv()
    with pytest.raises(spmd.SpecError, match="ring_attention needs a mesh"):
        ring_attention(q, k, v, mesh, "sp", seq_dim=2)
