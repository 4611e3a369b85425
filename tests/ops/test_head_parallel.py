"""spmd.ops.head_parallel_attention: each rank's rows equal torch's SDPA on the gathered
q, k, v, in value and in the gradients of q, k, v and a float mask, for sequences split
unevenly (empty shards too) over 1-4 ranks and over a tuple of axes, 1-8 heads (fewer
than ranks too), GQA with kv units shared by two ranks, causal, bool and float masks
(per-rank rows, one row for every query, broadcast over heads and batch), cross-attention
and three layouts of the sequence dim. The bytes each rank sends match the formula;
bad input raises before anything moves (or, for what needs every rank's shapes, on every
rank alike after the shape exchange).

Tolerance: float64 within assert_matches_single_device's 1e-10: every rank runs torch's
SDPA on whole sequences of its units, so the results differ from one device's only by
the batching of the same per-unit computation; float32 within its 1e-5/1e-6 (rounding
to float32, the reference staying float64). Per rank, autograd keeps one device's saved
bytes divided by the number of ranks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Layout, P
from spmd.core.errors import SpecError
from spmd.ops import head_parallel_attention
from spmd.testing import assert_matches_single_device
from spmd.testing import strategies as sst

F64 = torch.float64


def sdpa_ref(q, k, v, mask, causal, scale, gqa):
    """SDPA with a mask and causality combined (a key is attended where both allow)."""
    if causal and mask is not None:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, -math.inf)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


def build(mesh, axis, c):
    """Global tensors, layouts and the local and global functions of a case ``c``:
    layout "bhle" (seq_dim 2), "blhe" (seq_dim 1) or "le" (no batch, no heads)."""
    gen = torch.Generator().manual_seed(c.get("seed", 0))
    B, Hq, Hk, L, S, E, Ev = (c[n] for n in ("B", "Hq", "Hk", "L", "S", "E", "Ev"))
    kind = c.get("layout", "bhle")
    entry = axis if isinstance(axis, str) or len(axis) > 1 else axis[0]
    dp = c.get("dp") if kind != "le" else None  # a mesh axis splitting the batch too

    def shape(h, n, e):
        return {"bhle": (B, h, n, e), "blhe": (B, n, h, e), "le": (n, e)}[kind]
    sd = {"bhle": 2, "blhe": 1, "le": 0}[kind]

    def lay(shp, sizes):
        spec = [None] * len(shp)
        spec[sd] = entry
        if dp is not None:
            spec[0] = dp
        return Layout(shp, P(*spec), mesh, {sd: sizes})
    q = torch.randn(shape(Hq, L, E), generator=gen, dtype=F64)
    k = torch.randn(shape(Hk, S, E), generator=gen, dtype=F64)
    v = torch.randn(shape(Hk, S, Ev), generator=gen, dtype=F64)
    args = [q, k, v]
    specs = [lay(q.shape, c["q_sizes"]), lay(k.shape, c["kv_sizes"]),
             lay(v.shape, c["kv_sizes"])]
    mk = c.get("mask")
    if mk is not None:
        # mk: (lead shape, rows?, dtype) in SDPA's layout (..., H, L, S)
        mlead, rows, dt = mk
        mshape = (*mlead, L if rows else 1, c.get("mask_keys", S))
        m = (torch.rand(mshape, generator=gen) > 0.3 if dt == "bool" else
             torch.randn(mshape, generator=gen, dtype=F64))
        args.append(m)
        spec = [None] * m.ndim
        if dp is not None and len(mlead) == 2 and mlead[0] > 1:
            spec[0] = dp  # the mask's batch is split like q's
        if rows:
            spec[-2] = entry
            specs.append(Layout(m.shape, P(*spec), mesh, {m.ndim - 2: c["q_sizes"]}))
        else:
            specs.append(P(*spec))
    causal, scale = c.get("causal", False), c.get("scale")
    gqa = Hq != Hk and c.get("gqa", True)  # one kv head also broadcasts without it

    def f_local(q, k, v, m=None):
        return head_parallel_attention(q, k, v, mesh, axis, seq_dim=sd, causal=causal,
                                       attn_mask=m, scale=scale, enable_gqa=gqa)

    def f_global(q, k, v, m=None):
        qs, ks, vs = (t.movedim(sd, -2) for t in (q, k, v))
        return sdpa_ref(qs, ks, vs, m, causal, scale, gqa).movedim(-2, sd)
    out = lay(shape(Hq, L, Ev), c["q_sizes"])
    return f_local, f_global, tuple(specs), out, args


def run_case(mesh, axis, c):
    f_local, f_global, specs, out, args = build(mesh, axis, c)
    assert_matches_single_device(f_local, f_global, mesh, specs, out, *args)
    return True


MESHES = [((1,), ("sp",), "sp", None), ((2,), ("sp",), "sp", None),
          ((3,), ("sp",), "sp", None), ((4,), ("sp",), "sp", None),
          ((2, 2), ("dp", "sp"), "sp", "dp"), ((2, 2), ("a", "b"), ("a", "b"), None)]


@st.composite
def cases(draw):
    shape, names, axis, dp = draw(st.sampled_from(MESHES))
    mesh = spmd.Mesh(shape, names)
    n = mesh.axis_size(axis)
    kind = draw(st.sampled_from(["bhle", "bhle", "blhe", "le"]))
    hk = 1 if kind == "le" else draw(st.integers(1, 4))
    hq = hk * (1 if kind == "le" else draw(st.sampled_from([1, 1, 2, 3])))
    hq = min(hq, 8)
    hk = hk if hq % hk == 0 else hq
    B = (2 if dp else draw(st.integers(1, 2)))
    L = draw(st.integers(0, 9))
    S = L if draw(st.booleans()) else draw(st.integers(0, 9))
    c = dict(B=B, Hq=hq, Hk=hk, L=L, S=S, E=draw(st.integers(1, 3)),
             Ev=draw(st.integers(1, 3)), layout=kind, dp=dp,
             q_sizes=draw(sst.split_sizes(L, n)),
             kv_sizes=draw(sst.split_sizes(S, n)), causal=draw(st.booleans()),
             scale=draw(st.sampled_from([None, 0.3])), seed=draw(st.integers(0, 9)),
             gqa=draw(st.booleans()) if hk == 1 else True)
    if L == S:
        c["kv_sizes"] = draw(st.sampled_from([c["q_sizes"], c["kv_sizes"]]))
    mk = draw(st.sampled_from([None, "rows", "one", "lead"]))
    lead = () if kind == "le" else (B, hq)
    if mk is not None and S > 0 and L > 0:  # (torch gives an empty mask no gradient)
        dt = draw(st.sampled_from(["bool", "float"]))
        if mk == "lead" and lead:
            mlead = (draw(st.sampled_from([1, B])), draw(st.sampled_from([1, hq])))
        else:
            mlead = tuple(1 for _ in lead[:draw(st.integers(0, len(lead)))])
        c["mask"] = (mlead, mk != "one", dt)
        c["mask_keys"] = draw(st.sampled_from([S, S, 1]))
    return mesh, axis, c


@given(cases())
def test_matches_sdpa(case):
    mesh, axis, c = case
    run_case(mesh, axis, c)


@pytest.mark.parametrize("c", [
    # fewer heads than ranks, empty sequence shards, causal with a per-head float mask
    dict(B=1, Hq=1, Hk=1, L=5, S=5, E=2, Ev=3, q_sizes=[0, 3, 0, 2], kv_sizes=[0, 3, 0, 2],
         causal=True, mask=((1, 1), True, "float")),
    # GQA 3:1 over 4 ranks: units (2, 2, 1, 1), kv units 0 and 1 go to two ranks each
    dict(B=1, Hq=6, Hk=2, L=7, S=4, E=3, Ev=2, q_sizes=[2, 2, 1, 2], kv_sizes=[1, 0, 2, 1]),
    # GQA on rows of a mask that varies over the batch only; the sequence dim at 1
    dict(B=2, Hq=4, Hk=2, L=6, S=6, E=2, Ev=2, q_sizes=[3, 0, 1, 2], kv_sizes=[1, 1, 1, 3],
         layout="blhe", mask=((2, 1), True, "bool"), causal=True),
    # an empty key sequence (torch gives zeros) and no data on most ranks
    dict(B=1, Hq=2, Hk=2, L=3, S=0, E=2, Ev=2, q_sizes=[3, 0, 0, 0], kv_sizes=[0, 0, 0, 0]),
])
def test_edge_cases(c):
    run_case(spmd.Mesh((4,), ("sp",)), "sp", c)


def test_float32():
    """float32 within the toolkit's 1e-5/1e-6 against the float64 reference."""
    mesh = spmd.Mesh((3,), ("sp",))
    c = dict(B=2, Hq=4, Hk=2, L=8, S=8, E=4, Ev=4, q_sizes=[3, 3, 2], kv_sizes=[2, 3, 3],
             causal=True, mask=((2, 1), True, "bool"))
    f_local, f_global, specs, out, args = build(mesh, "sp", c)
    assert_matches_single_device(f_local, f_global, mesh, specs, out, *args,
                                 dtype=torch.float32)


def test_bytes_per_rank_forward_and_backward():
    """Rank r (L_r rows, u_r of the U units) sends, of each of q, k, v, the rows of the
    U - u_r units other ranks hold, and of the output its u_r units' rows of the other
    ranks' L - L_r rows; backward the same with the roles swapped. The shapes move once,
    in the first call."""
    mesh = spmd.Mesh((4,), ("sp",))
    B, H, L, E = 2, 4, 10, 3   # U = 8 units: 2 per rank
    sizes = [4, 3, 2, 1]
    lay = Layout((B, H, L, E), P(None, None, "sp"), mesh, {2: sizes})
    q, k, v = (torch.randn(B, H, L, E, dtype=F64, requires_grad=True) for _ in range(3))
    f = spmd.shard_map(lambda q, k, v: head_parallel_attention(q, k, v, mesh, "sp", seq_dim=2),
                       mesh, (lay, lay, lay), lay)
    with spmd.comm_stats() as s:
        f(q, k, v).sum().backward()
    row = E * 8   # bytes of one unit's row of one tensor
    U, u = B * H, 2
    for r, rows in enumerate(sizes):
        to_heads = (U - u) * rows * row      # of one tensor
        to_seq = u * (L - rows) * row
        for p in ("forward", "backward"):
            assert s.bytes("head_parallel_attention", pass_=p, rank=r) == 3 * to_heads + to_seq \
                if p == "forward" else to_heads + 3 * to_seq
            # one fused exchange for q, k, v and one for the output, each way
            assert s.calls("head_parallel_attention", pass_=p, rank=r) == 2
    assert s.calls("head_parallel_attention sizes") == 4
    with spmd.comm_stats() as s2:
        f(q, k, v)
    assert s2.calls("head_parallel_attention sizes") == 0   # learnt in the first call


def test_one_row_mask_moves_nothing_and_rows_mask_moves_its_rows():
    mesh = spmd.Mesh((2,), ("sp",))
    B, H, L, E = 1, 2, 4, 2
    lay = Layout((B, H, L, E), P(None, None, "sp"), mesh)
    q = torch.randn(B, H, L, E, dtype=F64)
    one = torch.rand(1, 1, 1, L) > 0.3
    rows = torch.rand(1, 1, L, L) > 0.3

    def f(q, m):
        return head_parallel_attention(q, q, q, mesh, "sp", seq_dim=2, attn_mask=m)
    with torch.no_grad():
        with spmd.comm_stats() as s1:
            spmd.shard_map(f, mesh, (lay, P()), lay)(q, one)
        with spmd.comm_stats() as s2:
            spmd.shard_map(f, mesh, (lay, P(None, None, "sp")), lay)(q, rows)
    # bool mask rows go in a second all_to_all (another dtype), to the rank of the other
    # head: every rank sends its 2 rows x 4 keys
    base = s1.bytes("head_parallel_attention")
    assert s1.calls("head_parallel_attention") == 4
    assert s2.calls("head_parallel_attention") == 6
    assert s2.bytes("head_parallel_attention") - base == 2 * 2 * 4


def test_saved_for_backward_is_one_devices_over_ranks():
    """Per rank, autograd keeps SDPA's own residuals for this rank's units (whole
    sequences of U / n units): one device's saved bytes divided by n, and nothing else."""
    from spmd.testing.memory import SavedBytes
    B, H, L, E, n = 2, 4, 12, 8, 4
    q, k, v = (torch.randn(B, H, L, E, dtype=F64) for _ in range(3))
    with SavedBytes() as one:
        F.scaled_dot_product_attention(*(t.clone().requires_grad_() for t in (q, k, v)))
    mesh = spmd.Mesh((n,), ("sp",))
    s = P(None, None, "sp")

    def body(q, k, v):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with SavedBytes() as saved:
            head_parallel_attention(q, k, v, mesh, "sp", seq_dim=2)
        return torch.tensor([saved.total])
    got = spmd.shard_map(body, mesh, (s, s, s), P("sp"))(q, k, v)
    assert got.tolist() == [one.total // n] * n


# -- errors ----------------------------------------------------------------------------------

MESH2 = spmd.Mesh((2,), ("sp",))
SEQ = P(None, None, "sp")


def _raises(fn, *args, match, kind=SpecError, specs=None):
    specs = specs or tuple(SEQ for _ in args)
    with pytest.raises(kind, match=match):
        spmd.shard_map(fn, MESH2, specs, SEQ)(*args)


def hpa(q, k, v, **kw):
    kw.setdefault("seq_dim", 2)
    return head_parallel_attention(q, k, v, MESH2, kw.pop("axis", "sp"), **kw)


def test_errors_before_anything_moves():
    x = torch.randn(1, 2, 4, 3)
    with spmd.comm_stats() as s:
        _raises(lambda q: hpa(q, q, q, seq_dim=3), x, match="seq_dim=3")
        _raises(lambda q: hpa(q, q, q, axis="zz"), x, match="'zz' is not an axis")
        _raises(lambda q: hpa(q, q.double(), q), x, match="share a dtype", kind=TypeError)
        _raises(lambda q: hpa(q.long(), q, q), x, match="floating point", kind=TypeError)
        _raises(lambda q: hpa(q.repeat(1, 2, 1, 1), q, q), x, match="enable_gqa=True")
        _raises(lambda q: hpa(q.repeat(1, 3, 1, 1)[:, :3], q, q, enable_gqa=True), x,
                match=r"q heads \(3\) must be a multiple of the kv heads \(2\)")
        _raises(lambda q: hpa(q, q[..., :2], q[..., :2]), x, match="same feature size")
        _raises(lambda q: hpa(q, q, q, attn_mask=torch.ones(3, 4, dtype=F64)), x,
                match="attn_mask must be bool or q's dtype", kind=TypeError)
        _raises(lambda q: hpa(q, q, q, attn_mask=torch.ones(3, 4, dtype=torch.bool)), x,
                match="3 query rows but q has 2")
        _raises(lambda q: hpa(q, q, q, attn_mask=torch.ones(3, 1, 4, dtype=torch.bool)), x,
                match="does not broadcast")
        _raises(lambda q: hpa(q, q, q, causal=1), x, match="causal must be a bool",
                kind=TypeError)
    assert s.records == []


def test_errors_from_every_ranks_shapes():
    """What needs the other ranks' shapes raises on every rank alike, after the exchange
    of shapes only."""
    x = torch.randn(1, 2, 4, 3)
    with spmd.comm_stats() as s:
        # the mask's key dim is the global key length (4), not this rank's (2)
        _raises(lambda q, m: hpa(q, q, q, attn_mask=m), x,
                torch.ones(1, 1, 4, 2, dtype=torch.bool), match="key dim is global")
        # rows on one rank, one row on the other
        _raises(lambda q, m: hpa(q, q, q, attn_mask=m), x,
                torch.ones(1, 1, 3, 4, dtype=torch.bool), match="query rows on the axis",
                specs=(SEQ, Layout((1, 1, 3, 4), SEQ, MESH2, {2: [2, 1]})))
        # batch differs between ranks
        _raises(lambda q: hpa(q, q, q), torch.randn(3, 2, 4, 3),
                match="only the sequence dim may differ", specs=(P("sp"),))
    assert {r[0] for r in s.records} == {"head_parallel_attention sizes"}


# -- gloo ------------------------------------------------------------------------------------

def _gloo_cases(mesh):
    return [run_case(mesh, "sp", dict(B=1, Hq=3, Hk=1, L=5, S=4, E=2, Ev=3,
                                      q_sizes=[4, 1], kv_sizes=[0, 4], causal=True,
                                      mask=((1, 3), True, "float"))),
            run_case(mesh, "sp", dict(B=2, Hq=1, Hk=1, L=3, S=3, E=2, Ev=2,
                                      q_sizes=[1, 2], kv_sizes=[1, 2], layout="blhe",
                                      mask=((), False, "bool")))]


@pytest.mark.gloo
def test_gloo_world_2(gloo2):
    assert gloo2.run(_gloo_cases, (2,), ("sp",)) == [[True, True]] * 2
