"""spmd functions under torch.compile: one opaque graph node each, values and gradients
equal to eager, no rank's plan baked into a graph another rank reuses.

The bodies run in float64 and compare to the eager body at 1e-10: inductor may fuse
and reorder the body's own reductions (the loss's sum), nothing else differs.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Mesh, P
from spmd.collectives import compiled as compiled_mod
from spmd.collectives.compiled import graph_op
from spmd.core.errors import SpecError

F64 = torch.float64
SPEC = P(None, None, "sp")
TOL = dict(rtol=1e-10, atol=1e-10)


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 2, 3, 3, dtype=F64, generator=g).requires_grad_()
    w2 = torch.randn(4, 3, 3, 3, dtype=F64, generator=g).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(4, dtype=F64, generator=g)).requires_grad_()
    x = torch.randn(2, 2, 9, 6, dtype=F64, generator=g)
    return x, (w, w2, gamma)


def _body(mesh: Mesh, params):
    """halo_pad, a local conv, a halo'd conv, group and layer norm, psum."""
    w, w2, gamma = params

    def body(x):
        y = spmd.halo_pad(x, mesh, "sp", 2, (1, 1))
        y = F.conv2d(y, w, padding=(0, 1)).tanh()
        y = spmd.ops.conv2d(y, w2, padding=1, mesh=mesh, spec=SPEC)
        y = spmd.ops.group_norm(y, 2, gamma, None, mesh=mesh, spec=SPEC)
        y = spmd.ops.layer_norm(y, (6,), mesh=mesh, spec=SPEC)
        return spmd.psum((y ** 2).sum(), "sp")
    return body


def _step(mesh: Mesh, body, x, params, in_specs=SPEC):
    """One call and backward; ``x`` a tensor or a tuple of them (``in_specs`` to match)."""
    for p in params:
        p.grad = None
    args = x if isinstance(x, tuple) else (x,)
    out = spmd.shard_map(body, mesh, in_specs=in_specs, out_specs=P())(*args)
    out.backward()
    return out.detach(), [p.grad.clone() for p in params]


def _close(a, b):
    torch.testing.assert_close(a[0], b[0], **TOL)
    for ga, gb in zip(a[1], b[1]):
        torch.testing.assert_close(ga, gb, **TOL)


def test_compiled_body_equals_eager_on_threads_with_uneven_shards():
    """fullgraph=True: a single graph break would raise. Rows split 5/4: the two ranks
    compile one graph each (dynamic=False), and neither bakes its plan into the
    other's. The first compiled call runs inside AOTAutograd's checking mode, where
    torch.func cannot record: its backward recomputes the forward (see
    collectives.compiled); later calls replay the recorded one."""
    mesh = Mesh((2,), ("sp",))
    x, params = _params()
    body = _body(mesh, params)
    want = _step(mesh, body, x, params)
    compiled = torch.compile(body, fullgraph=True, dynamic=False)
    with spmd.comm_stats() as eager_stats:
        _step(mesh, body, x, params)
    for call in range(3):
        with spmd.comm_stats() as stats:
            got = _step(mesh, compiled, x, params)
        _close(got, want)
        if call == 2:
            # The same collectives and bytes as eager, less one: eager anchors the
            # halo_pad of x, which needs no gradient, and sends its halo's zero
            # cotangents home; the graph knows on every rank that none is needed.
            assert sorted(stats.records) == sorted(
                r for r in eager_stats.records if r[0] != "halo_pad" or r[3] != "backward")


def test_explain_finds_no_graph_break():
    mesh = Mesh((1,), ("sp",))
    x, params = _params()
    body = _body(mesh, params)

    def run(x):
        ex = torch._dynamo.explain(body)(x)
        return torch.tensor([ex.graph_count, ex.graph_break_count])

    got = spmd.shard_map(run, mesh, in_specs=SPEC, out_specs=P("sp"))(x)
    assert got.tolist() == [1, 0]


def test_a_call_meta_cannot_describe_breaks_the_graph_and_stays_exact():
    """A strided conv over the split dim: its output rows depend on every rank's size,
    so it runs eagerly (a graph break; fullgraph=True refuses it)."""
    mesh = Mesh((3,), ("sp",))
    _, (w, w2, _) = _params()
    x = torch.randn(1, 3, 11, 5, dtype=F64)

    def body(x):
        y = spmd.ops.conv2d(x, w2, stride=2, padding=1, mesh=mesh, spec=SPEC)
        return spmd.psum(y.tanh().sum(), "sp")

    run = lambda f: spmd.shard_map(f, mesh, in_specs=SPEC, out_specs=P())(x)  # noqa: E731
    want = run(body)
    torch.testing.assert_close(run(torch.compile(body, dynamic=False)), want, **TOL)
    torch._dynamo.reset()  # dynamo caches per code object: forget the graphs with breaks
    with pytest.raises(Exception, match="rank"):
        run(torch.compile(body, fullgraph=True, dynamic=False))


def test_the_rank_is_never_baked_into_a_shared_graph():
    """axis_index reads the rank: under compile it is a graph break, and the code after
    it is guarded on the value, so each rank gets its own (equal-shaped shards)."""
    mesh = Mesh((4,), ("sp",))

    def body(x):
        r = spmd.axis_index("sp")
        return x * (r + 1)

    x = torch.ones(8, dtype=F64)
    got = spmd.shard_map(torch.compile(body), mesh, in_specs=P("sp"), out_specs=P("sp"))(x)
    assert got.tolist() == [1, 1, 2, 2, 3, 3, 4, 4]


def _wrong_meta(x, axis_name):
    return [((x.shape[0] + 1,), x.dtype)]


@graph_op(_wrong_meta)
def _misdescribed(x, axis_name):
    return spmd.psum(x, axis_name)


def test_an_output_unlike_its_meta_raises():
    mesh = Mesh((2,), ("sp",))
    f = torch.compile(lambda x: _misdescribed(x, "sp") * 2, backend="eager")
    with pytest.raises(SpecError, match="meta promised"):
        spmd.shard_map(f, mesh, in_specs=P("sp"), out_specs=P("sp"))(torch.ones(4))


def test_no_grad_call_records_nothing():
    mesh = Mesh((2,), ("sp",))
    x, params = _params()
    body = _body(mesh, params)
    want = spmd.shard_map(body, mesh, in_specs=SPEC, out_specs=P())(x)
    with torch.no_grad():
        got = spmd.shard_map(torch.compile(body, dynamic=False), mesh, in_specs=SPEC,
                             out_specs=P())(x)
    assert not got.requires_grad
    torch.testing.assert_close(got, want.detach(), **TOL)


# -- torch processes (gloo) ----------------------------------------------------------------

def _gloo_compiled(mesh):
    x, params = _params()
    body = _body(mesh, params)
    want = _step(mesh, body, x, params)
    ex = torch._dynamo.explain(body)(x.narrow(2, 5 * mesh.rank, 5 - mesh.rank))
    compiled = torch.compile(body, dynamic=False)
    got = [_step(mesh, compiled, x, params) for _ in range(2)]
    return ex.graph_count, ex.graph_break_count, want, got


@pytest.mark.gloo
def test_compiled_body_on_gloo_processes(gloo2):
    for graphs, breaks, want, got in gloo2.run(_gloo_compiled, (2,), ("sp",)):
        assert (graphs, breaks) == (1, 0)
        for g in got:
            _close(g, want)


def test_compiling_shard_map_itself_runs_it_eagerly():
    """torch.compile(shard_map(body)): dynamo cannot follow rank threads, so the call is
    a graph break and runs as eager (compile the body instead)."""
    mesh = Mesh((2,), ("sp",))
    x, params = _params()
    body = _body(mesh, params)
    want = _step(mesh, body, x, params)
    f = torch.compile(spmd.shard_map(body, mesh, in_specs=SPEC, out_specs=P()))
    for p in params:
        p.grad = None
    out = f(x)
    out.backward()
    _close((out.detach(), [p.grad for p in params]), want)


def test_a_converted_model_refuses_compile_on_every_rank():
    mesh = Mesh((2,), ("sp",))
    model = spmd.nn.convert(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1)), mesh,
                            SPEC)
    f = spmd.shard_map(torch.compile(lambda x: spmd.psum(model(x).sum(), "sp")), mesh,
                       in_specs=SPEC, out_specs=P())
    with pytest.raises(SpecError, match="torch.compile cannot trace a model made by") as e:
        f(torch.randn(1, 2, 6, 5))
    assert "rank" in str(e.value)


def test_attention_and_softmax_over_a_split_dim_compile_whole():
    """ring and head-parallel attention, neighbourhood attention and softmax over the
    split sequence: one node each (fullgraph), values and gradients as eager."""
    mesh = Mesh((2,), ("sp",))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 11, 8, dtype=F64, generator=g) for _ in range(3))
    w = torch.randn(8, 8, dtype=F64, generator=g).requires_grad_()
    s = P(None, None, "sp")

    def body(q, k, v):
        a = spmd.ops.ring_attention(q @ w, k, v, mesh, "sp", seq_dim=2, causal=True)
        b = spmd.ops.head_parallel_attention(q, k @ w, v, mesh, "sp", seq_dim=2)
        # [B, L, heads, head_dim] for neighbourhood attention, L split
        n = spmd.ops.neighborhood_attention1d(*(t.transpose(1, 2) for t in (q @ w, k, v)),
                                               3, mesh=mesh, spec=P(None, "sp"))
        p = spmd.ops.softmax(a + b + n.transpose(1, 2), 2, mesh=mesh, spec=s)
        return spmd.psum((p * v).sum(), "sp")

    want = _step(mesh, body, (q, k, v), [w], (s, s, s))
    compiled = torch.compile(body, fullgraph=True, dynamic=False)
    for _ in range(2):
        _close(_step(mesh, compiled, (q, k, v), [w], (s, s, s)), want)


def test_errors_under_compile_are_the_eager_errors_on_every_rank():
    """A wrong axis and a halo wider than the global size: the eager function raises
    at run time inside the compiled graph, with its own message, on every rank."""
    mesh = Mesh((2,), ("sp",))
    bad_axis = torch.compile(lambda x: spmd.psum(x.sin(), "nope"), dynamic=False)
    too_wide = torch.compile(lambda x: spmd.halo_pad(x.sin(), mesh, "sp", 0, (5, 5),
                                                     mode="reflect"), dynamic=False)
    for f, match in ((bad_axis, "nope"), (too_wide, "reflect")):
        with pytest.raises(SpecError, match=match):
            spmd.shard_map(f, mesh, in_specs=P("sp"), out_specs=P("sp"))(torch.ones(4))


def test_before_dynamo_was_seen_spmd_calls_run_eagerly_then_compile(monkeypatch):
    """spmd marks its trace-time handle only once torch._dynamo is imported (importing
    it costs a second); per-rank code compiled under spmd.launch, with no shard_map
    call since, first runs its spmd calls eagerly (graph breaks), then recompiles."""
    from spmd.collectives import compiled
    monkeypatch.setattr(compiled, "_traced_handle", None)
    torch._dynamo.reset()

    def rank(mesh):
        f = torch.compile(lambda x: spmd.psum(x.sin(), "sp") * 2, dynamic=False)
        x = torch.full((3,), float(mesh.rank + 1))
        return [f(x).tolist() for _ in range(2)]

    want = [(2 * (torch.full((3,), 1.0).sin() + torch.full((3,), 2.0).sin())).tolist()] * 2
    for got in spmd.launch(rank, (2,), ("sp",)):
        assert torch.allclose(torch.tensor(got), torch.tensor(want))
    assert compiled._traced_handle is not None


@pytest.mark.parametrize("rows", [3, 7])
def test_a_2d_mesh_a_product_of_axes_uneven_and_empty_shards(rows):
    """Rows split over ("a", "b") of a 2x2 mesh: 7 rows are [2, 2, 2, 1]; of 3 rows the
    last rank holds none. There every tensor is a known zero and nothing but the chain
    tokens orders the ops: without them inductor ran halo_pad's backward before
    conv2d's on that rank only (the threads backend names the mismatch: CommError)."""
    mesh = Mesh((2, 2), ("a", "b"))
    spec = P(None, None, ("a", "b"))
    _, (w, _, _) = _params()
    x = torch.randn(1, 2, rows, 5, dtype=F64, generator=torch.Generator().manual_seed(4))
    x.requires_grad_()

    def body(x):
        y = spmd.halo_pad(x, mesh, ("a", "b"), 2, (1, 1))
        d = (y[:, :, 2:] - y[:, :, :-2]).tanh()  # a central difference: x's rows
        z = spmd.ops.conv2d(d, w, padding=1, mesh=mesh, spec=spec)
        return spmd.psum((z ** 2).sum(), ("a", "b"))

    want = _step(mesh, body, x, (w, x), spec)
    compiled = torch.compile(body, fullgraph=True, dynamic=False)
    for _ in range(2):
        _close(_step(mesh, compiled, x, (w, x), spec), want)


def test_independent_branches_start_their_collectives_in_program_order_on_every_rank():
    """Two convs of one input, two psums: no data orders them. On the rank with the
    empty shard inductor ran both convs before the first psum, its peers did not
    (CommError here; on processes a swap of two same-shaped collectives would go
    unnoticed). The chain tokens make every rank run program order."""
    mesh = Mesh((2, 2), ("a", "b"))
    spec = P(None, None, ("a", "b"))
    g = torch.Generator().manual_seed(5)
    wa = torch.randn(2, 2, 3, 3, dtype=F64, generator=g).requires_grad_()
    wb = torch.randn(2, 2, 3, 3, dtype=F64, generator=g).requires_grad_()
    x = torch.randn(1, 2, 3, 5, dtype=F64, generator=g).requires_grad_()

    def body(x):
        a = spmd.ops.conv2d(x, wa, padding=1, mesh=mesh, spec=spec)
        b = spmd.ops.conv2d(x * 2, wb, padding=1, mesh=mesh, spec=spec)
        return spmd.psum((a * a).sum(), ("a", "b")) + spmd.psum((b ** 3).sum(), ("a", "b"))

    want = _step(mesh, body, x, (wa, wb, x), spec)
    compiled = torch.compile(body, fullgraph=True, dynamic=False)
    for _ in range(2):
        _close(_step(mesh, compiled, x, (wa, wb, x), spec), want)


def _op_nodes(gm):
    """(node, the op's arguments) of each spmd op of a graph, in graph order; through
    ``with_effects`` where the op is an ordered effect."""
    ops = (torch.ops.spmd.graph_op.default, torch.ops.spmd.graph_op_backward.default)
    out = []
    for n in gm.graph.nodes:
        if n.target in ops:
            out.append((n, n.target, n.args))
        elif n.op == "call_function" and len(n.args) > 1 and n.args[1] in ops:
            out.append((n, n.args[1], n.args[2:]))
    return out


def _source(n):
    while n.target is operator.getitem:
        n = n.args[0]
    return n


def test_each_op_forward_and_backward_takes_the_chain_token_of_the_one_before():
    """The graphs AOTAutograd hands the compiler: each spmd op's ``after`` is an output
    of the op just before it in the graph, forward and backward; this order does not
    rest on inductor keeping ordered effects (it does not)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    mesh = Mesh((1,), ("sp",))
    g = torch.Generator().manual_seed(6)
    wa = torch.randn(2, 2, 3, 3, dtype=F64, generator=g).requires_grad_()
    wb = torch.randn(2, 2, 3, 3, dtype=F64, generator=g).requires_grad_()

    def body(x):
        a = spmd.ops.conv2d(x, wa, padding=1, mesh=mesh, spec=SPEC)
        b = spmd.ops.conv2d(x, wb, padding=1, mesh=mesh, spec=SPEC)
        return spmd.psum((a * b).sum(), "sp")

    compiled = torch.compile(body, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True, dynamic=False)
    x = torch.randn(1, 2, 6, 5, dtype=F64, generator=g)
    spmd.shard_map(compiled, mesh, in_specs=SPEC, out_specs=P())(x).backward()
    assert len(graphs) == 2
    for gm in graphs:
        ops = _op_nodes(gm)
        assert len(ops) == 3  # two convs and a psum, or their backwards
        after = [args[2] if op is torch.ops.spmd.graph_op.default else args[4]
                 for _, op, args in ops]
        assert len(after[0]) <= 1
        for (prev, _, _), a in zip(ops, after[1:]):
            assert [_source(t) for t in a] == [prev]
    # and each forward call carries the fingerprint of the code that will run its
    # backward, so that torch's on-disk caches never pair it with an older formula
    assert [args[3] for _, _, args in _op_nodes(graphs[0])] == [compiled_mod._BUILD] * 3


def test_bool_and_integer_reductions_keep_their_dtypes_under_compile():
    """psum counts bools (int64) and pmean of bools and integers is a float: the graph
    node's meta says so, so the compiled body matches the eager one exactly."""
    mesh = Mesh((2,), ("sp",))

    def body(x):
        b = x > 0
        return (spmd.psum(b, "sp") * 10 + spmd.pmean(b, "sp") + spmd.pmean(x.long(), "sp"),
                spmd.pmax(b, "sp"))

    x = torch.tensor([1.0, -1.0, 2.0, 0.0], dtype=F64)
    run = lambda f: spmd.shard_map(f, mesh, in_specs=P("sp"), out_specs=P("sp"))(x)  # noqa: E731
    want = run(body)
    got = run(torch.compile(body, fullgraph=True, dynamic=False))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (got, want)
    assert want[0].dtype == torch.get_default_dtype() and want[1].dtype == torch.bool
