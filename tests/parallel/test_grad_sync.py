"""spmd.parallel.GradSync and the asynchronous all-reduce, on the threads backend.

Training runs compare against single-device training on the global batch in float64
(tests/parallel/_parallel_cases.py): reductions reorder float64 additions, and the per-rank
losses split sums differently, so parameters after a few SGD/Adam steps agree to
rtol = atol = 1e-9 (Adam divides by sqrt of tiny second moments: looser than 1e-10).
bf16/fp16 buckets: the dtype's own tolerance against the same reduction done by hand.
Models are built on the main thread (torch's RNG is process-global) and copied per rank.
"""
from __future__ import annotations

import copy
import re
import time

import pytest
import torch
from _parallel_cases import (
    CNN,
    MLP,
    Field,
    Heads,
    Partly,
    change_after_wrapping,
    check_heads,
    check_train,
    check_unused,
    different_plans,
    field_single,
    field_train,
    heads_loss,
    heads_single,
    heads_train,
    loss,
    make,
    only_dp0,
    seeded_mlp,
    shifting,
    startup,
    startup_2d,
    train,
    train_single,
    unused,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spmd
from spmd import P
from spmd.comm import comm_of
from spmd.comm.rank_threads import run_on_threads

TOL = dict(rtol=1e-9, atol=1e-9)


# =========================================================================================
# all_reduce_async on the threads backend
# =========================================================================================

def _async_ranks(mesh):
    g = mesh.group("sp")
    r = mesh.rank
    xs = [torch.full((3,), float(r + 1) * (k + 1)) + torch.tensor([0.1, 0.2, 0.3])
          for k in range(3)]
    if r == 1:
        time.sleep(0.3)
    t0 = time.monotonic()
    works = [comm_of(mesh).all_reduce_async(x, "sum", g, name="grad_sync") for x in xs]
    started = time.monotonic() - t0
    outs = [w.wait() for w in reversed(works)][::-1]  # any wait order
    return started, [o is x for o, x in zip(outs, xs)], [x.clone() for x in xs]


def test_all_reduce_async_threads_does_not_block_and_is_bit_identical():
    res = spmd.launch(_async_ranks, (3,), "sp")
    assert res[0][0] < 0.2  # rank 0 deposited without waiting for the late rank 1
    for _, same, xs in res:
        assert all(same)  # in place: wait() returns the caller's tensor
        for k, x in enumerate(xs):
            want = sum(torch.full((3,), float(r + 1) * (k + 1)) + torch.tensor([0.1, 0.2, 0.3])
                       for r in range(3))
            torch.testing.assert_close(x, want)
            assert torch.equal(x, res[0][2][k])  # the same bits on every rank


def _async_missing(mesh):
    w = None
    if mesh.rank == 0:
        w = comm_of(mesh).all_reduce_async(torch.ones(2), "sum", mesh.group("sp"), name="grad_sync")
        return w.wait()
    time.sleep(1.5)
    return None


def test_all_reduce_async_threads_timeout_names_missing_rank():
    with pytest.raises(spmd.CommTimeout, match=r"grad_sync over axis 'sp' timed out after "
                       r"0.5 s on rank 0: ranks \[1\] of the group \[0, 1\] did not arrive"):
        spmd.launch(_async_missing, (2,), "sp", timeout=0.5)


def _async_errors(mesh):
    g = mesh.group("sp")
    out = []
    for x, op in ((torch.ones(4).view(2, 2).t(), "sum"), (torch.ones(2), "mean")):
        try:
            comm_of(mesh).all_reduce_async(x, op, g, name="grad_sync")
        except spmd.SpecError as e:
            out.append(str(e))
    return out


def test_all_reduce_async_threads_refuses_bad_input():
    msgs = spmd.launch(_async_errors, (1,), "sp")[0]
    assert "needs a contiguous tensor" in msgs[0]
    assert "reduction op must be one of ('sum', 'max', 'min'), got 'mean'" in msgs[1]


# =========================================================================================
# Training equals one device
# =========================================================================================

CASES = [  # mesh shape, axis names, GradSync axes
    ((2,), ("dp",), {"dp": "mean"}),
    ((4,), ("dp",), "dp"),
    ((2,), ("sp",), {"sp": "sum"}),
    ((2, 2), ("dp", "sp"), {"dp": "mean", "sp": "sum"}),
]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("shape,names,axes", CASES)
def test_training_matches_single_device(kind, opt, shape, names, axes):
    model, x, y = make(kind, seed=1)
    # small buckets: several per model, so order and overlap matter
    cfg = dict(first_bucket_cap_mb=1e-4, bucket_cap_mb=4e-4)
    got = spmd.launch(train, shape, names, args=(model, x, y, kind, axes, opt, 3, cfg))
    check_train(got, train_single(model, x, y, kind, opt, 3), TOL)


def test_per_rank_seeding_builds_one_devices_model_every_time():
    """Each rank seeds its own generator and builds its own model, as a torchrun script
    does; init="verify" proves the ranks agree (no broadcast to hide a difference), and 20
    runs on rank threads equal one device seeded alike, whatever the threads' timing."""
    torch.manual_seed(3)
    model = MLP().double()
    _, x, y = make("mlp", seed=1)
    want = train_single(model, x, y, "mlp", "adam", 2)
    for _ in range(20):
        got = spmd.launch(train, (2, 2), ("dp", "sp"),
                          args=(seeded_mlp, x, y, "mlp", {"dp": "mean", "sp": "sum"}, "adam",
                                2, {"init": "verify"}))
        check_train(got, want, TOL)


@pytest.mark.parametrize("zero", ["optimizer", "zeros", "sync"])
@pytest.mark.parametrize("view", [True, False])
def test_zeroing_and_copy_path_match(zero, view):
    model, x, y = make("mlp", seed=2)
    cfg = dict(first_bucket_cap_mb=1e-4, bucket_cap_mb=4e-4, grad_as_view=view, zero=zero)
    got = spmd.launch(train, (2, 2), ("dp", "sp"),
                      args=(model, x, y, "mlp", {"dp": "mean", "sp": "sum"}, "adam", 2, cfg))
    check_train(got, train_single(model, x, y, "mlp", "adam", 2), TOL)


@settings(max_examples=12)
@given(shape=st.sampled_from([(1,), (3,), (1, 2), (2, 2), (3, 1)]),
       ops=st.tuples(st.sampled_from(["sum", "mean"]), st.sampled_from(["sum", "mean"])),
       first=st.sampled_from([1e-5, 2e-4, 1.0]), cap=st.sampled_from([1e-5, 1e-3, 25.0]),
       micro=st.sampled_from([1, 2]), view=st.booleans())
def test_one_step_gradients_any_mesh_ops_and_buckets(shape, ops, first, cap, micro, view):
    """One SGD step (lr 0: the gradients are compared) on 1-d and 2-d meshes: the reduced
    gradient is the sum of the local ones, times 1/|axis| for each "mean" axis."""
    names = ("dp",) if len(shape) == 1 else ("dp", "sp")
    axes = dict(zip(names, ops))
    model, x, y = make("mlp", seed=3, batch=6, points=4)
    cfg = dict(first_bucket_cap_mb=first, bucket_cap_mb=cap, grad_as_view=view, micro=micro)
    got = spmd.launch(train, shape, names, args=(model, x, y, "mlp", axes, "sgd", 1, cfg))
    # the single-device gradient, rescaled where an axis sums what the loss averages
    factor = 1.0
    for a, s in zip(names, shape):
        if a == "dp" and axes[a] == "sum":
            factor *= s
        if a == "sp" and axes[a] == "mean":
            factor /= s
    ref = copy.deepcopy(model)
    loss(ref, "mlp", x, y).backward()
    for r, (_, grads, plans, _) in enumerate(got):
        for i, (g, p) in enumerate(zip(grads, ref.parameters())):
            torch.testing.assert_close(g, p.grad * factor, **TOL, msg=f"grad {i} rank {r}")
        for plan in plans:
            assert sorted(n for _, names_ in plan for n in names_) == sorted(
                n for n, _ in model.named_parameters())


def test_cnn_dp_sp_uneven_rows_with_halo_and_psum_head():
    """(2, 2) mesh; rows 7 over sp = [4, 3]; halo_pad and a psum in forward, their
    transposes in backward interleave with the bucket all-reduces."""
    model, x, y = make("cnn", seed=4, batch=4, hw=(7, 5))
    cfg = dict(first_bucket_cap_mb=1e-5, bucket_cap_mb=1e-5)
    got = spmd.launch(train, (2, 2), ("dp", "sp"),
                      args=(model, x, y, "cnn", {"dp": "mean", "sp": "sum"}, "adam", 3, cfg))
    check_train(got, train_single(model, x, y, "cnn", "adam", 3), TOL)


# =========================================================================================
# Buckets: dtypes, plan order, overlap, views
# =========================================================================================

def test_mixed_dtypes_get_separate_buckets_and_correct_gradients():
    model, x, y = make("mixed", seed=5)
    cfg = dict(first_bucket_cap_mb=1e-5, bucket_cap_mb=1.0)
    got = spmd.launch(train, (2,), ("dp",), args=(model, x, y, "mixed", "dp", "sgd", 1, cfg))
    plan = got[0][2][-1]
    for dtype, names in plan:
        prefixes = {n.split(".")[0] for n in names}
        assert len(prefixes) == 1 or dtype == "torch.float32" and prefixes == {"a"}, plan
    assert {d for d, _ in plan} == {"torch.float32", "torch.bfloat16", "torch.float16",
                                    "torch.float64"}
    # expected: each rank's local gradient, halved and summed in its own dtype
    local = []
    for r in range(2):
        m = copy.deepcopy(model)
        loss(m, "mixed", x.chunk(2)[r], y.chunk(2)[r], batch=2).backward()
        local.append([p.grad for p in m.parameters()])
    ref = copy.deepcopy(model).double()
    loss(ref, "mixed", x, y).backward()
    for r, (_, grads, _, _) in enumerate(got):
        for i, (g, p) in enumerate(zip(grads, model.parameters())):
            assert g.dtype == p.dtype
            want = local[0][i] * 0.5 + local[1][i] * 0.5
            torch.testing.assert_close(g, want, msg=f"grad {i} rank {r}")
            # and close to float64 on one device: every gradient went through bf16
            h = list(ref.parameters())[i].grad
            torch.testing.assert_close(g.double(), h, rtol=5e-2, atol=5e-2 * h.abs().max().item())


def test_reverse_defined_model_plan_follows_execution_order():
    """Layers defined l2, l1, l0 but used l0, l1, l2: the first plan (reverse definition
    order) starts with l0's gradients, which are ready last; after one iteration the plan
    starts with l2's, which backward produces first."""
    model, x, y = make("mlp_reverse", seed=6)
    assert [n for n, _ in model.named_parameters()][:2] == ["l2.weight", "l2.bias"]
    cfg = dict(first_bucket_cap_mb=1e-4, bucket_cap_mb=4e-4)
    got = spmd.launch(train, (2,), ("dp",), args=(model, x, y, "mlp_reverse", "dp", "sgd", 2, cfg))
    for _, _, (before, after), started in got:
        first = [n for _, names in before for n in names]
        learned = [n for _, names in after for n in names]
        assert first[0].startswith("l0"), before
        assert learned[0].startswith("l2") and learned[-1].startswith("l0"), after
        # autograd's order: a layer's bias then its weight, last layer first
        assert learned == ["l2.bias", "l2.weight", "l1.bias", "l1.weight", "l0.bias",
                           "l0.weight"], after
        assert started  # a bucket was in flight before the end of backward
    want = train_single(model, x, y, "mlp_reverse", "sgd", 2)
    check_train(got, want, TOL)


def _plan_and_views(mesh, model, learn):
    model = copy.deepcopy(model)
    sync = spmd.parallel.GradSync(model, mesh, "dp", first_bucket_cap_mb=1e-4,
                                  bucket_cap_mb=4e-4, learn_order=learn)
    before = sync.buckets
    x = torch.ones(2, 5, 6, dtype=torch.float64)
    for _ in range(2):
        model.zero_grad()
        model(x).sum().backward()
        sync.wait()
    in_bucket = [p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
                 for b in sync._buckets for p in b.params]
    return before, sync.buckets, sync.order_learned, in_bucket, repr(sync)


def test_plan_is_inspectable_and_learning_can_be_switched_off():
    model = MLP(reverse=True).double()
    for learn in (True, False):
        before, after, learned, in_bucket, text = spmd.launch(
            _plan_and_views, (2,), "dp", args=(model, learn))[0]
        assert learned == learn
        assert (before != after) == learn
        assert all(in_bucket)  # every gradient is a view into its bucket
        assert isinstance(after[0], spmd.parallel.BucketInfo)
        assert after[0].dtype == torch.float64 and after[0].device == torch.device("cpu")
        assert after[0].nbytes == 8 * after[0].numel
        assert repr(after[0]).startswith("Bucket(f64 on cpu over dp, ")
        assert after[0].axes == ("dp",)
        assert "6 parameters in" in text and "rank 0" in text
    # the caps: the first bucket closes at first_bucket_cap_mb, the others at bucket_cap_mb
    sizes = [b.nbytes for b in after]
    assert sum(sizes) == 8 * sum(p.numel() for p in model.parameters())


class _Transposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64).t())  # strides (1, 3)
        self.v = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))


def _non_contiguous(mesh, model, x):
    model = copy.deepcopy(model)
    sync = spmd.parallel.GradSync(model, mesh, "dp")
    for _ in range(2):  # the second iteration runs on the learned plan
        model.zero_grad()
        ((x[mesh.rank] @ model.w) * model.v).sum().backward()
        sync.wait()
    bufs = {b.buffer.untyped_storage().data_ptr() for b in sync._buckets}
    return ([p.grad.clone() for p in (model.w, model.v)],
            [p.grad.untyped_storage().data_ptr() in bufs for p in (model.w, model.v)],
            model.w.grad.stride())


def test_non_contiguous_parameter_takes_the_copy_path():
    torch.manual_seed(10)
    model, x = _Transposed(), torch.randn(2, 5, 3, dtype=torch.float64)
    got = spmd.launch(_non_contiguous, (2,), "dp", args=(model, x))
    ref = copy.deepcopy(model)
    sum(((x[r] @ ref.w) * ref.v).sum() for r in range(2)).div(2).backward()
    for grads, in_bucket, stride in got:
        assert in_bucket == [False, True]  # w keeps its own gradient, v lives in the bucket
        assert stride == ref.w.grad.stride() == (1, 3)
        for g, p in zip(grads, (ref.w, ref.v)):
            torch.testing.assert_close(g, p.grad, **TOL)


def _comm_counts(mesh, model):
    model = copy.deepcopy(model)
    sync = spmd.parallel.GradSync(model, mesh, "dp", first_bucket_cap_mb=1e-4,
                                  bucket_cap_mb=4e-4, learn_order=False)
    x = torch.ones(2, 5, 6, dtype=torch.float64)
    model(x).sum().backward()
    # each bucket: its gradients, a used flag per parameter, one alarm element
    return len(sync.buckets), [b.numel + len(b.names) + 1 for b in sync.buckets]


def test_comm_stats_counts_one_async_all_reduce_per_bucket_in_backward():
    model = MLP().double()
    with spmd.comm_stats() as s:
        res = spmd.launch(_comm_counts, (2,), "dp", args=(model,))
    nb, numels = res[0]
    # the wait() happens at the latest in GradSync.wait; here backward launched them all
    assert s.calls("grad_sync", pass_="backward") == 2 * nb
    assert s.bytes("grad_sync", pass_="backward") == 2 * 8 * sum(numels)
    assert s.calls("grad_sync", pass_="forward") == 0


# =========================================================================================
# no_sync, unused parameters, misuse
# =========================================================================================

@pytest.mark.parametrize("view", [True, False])
def test_no_sync_accumulation_equals_one_large_batch(view):
    model, x, y = make("mlp", seed=7, batch=8)
    cfg = dict(first_bucket_cap_mb=1e-4, bucket_cap_mb=4e-4, grad_as_view=view, micro=4)
    got = spmd.launch(train, (2, 2), ("dp", "sp"),
                      args=(model, x, y, "mlp", {"dp": "mean", "sp": "sum"}, "adam", 2, cfg))
    check_train(got, train_single(model, x, y, "mlp", "adam", 2), TOL)


@pytest.mark.parametrize("view", [True, False])
def test_unused_parameters_do_not_hang_and_match_single_device(view):
    """``only0`` (used by rank 0 only) gets the reduced gradient on every rank; ``never``
    (used by no rank) keeps grad None, so Adam leaves it alone, as on one device."""
    torch.manual_seed(8)
    model, x = Partly(), torch.randn(4, 3, dtype=torch.float64)
    cfg = dict(first_bucket_cap_mb=1e-5, bucket_cap_mb=1e-5, grad_as_view=view)
    got = spmd.launch(unused, (2,), "dp", args=(model, x, cfg), timeout=20)
    check_unused(got, model, x, 2, TOL)


def _misuse(mesh):
    model = torch.nn.Linear(2, 2)
    sync = spmd.parallel.GradSync(model, mesh, "dp")
    out = []
    model(torch.ones(1, 2)).sum().backward()
    try:
        model(torch.ones(1, 2)).sum().backward()  # again, without wait()
    except RuntimeError as e:
        out.append(str(e))
    sync.wait()
    sync.wait()  # a second wait is a no-op
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    try:
        with sync.no_sync():
            model(torch.ones(1, 2)).sum().backward()
    except RuntimeError as e:
        out.append(str(e))
    sync.wait()
    sync2 = spmd.parallel.GradSync(model, mesh, "dp")  # replaces the first (closes it)
    out.append((sync._closed, sync2._closed))
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    out.append((sync._reduced, sync2._reduced))  # only the second one's hooks fired
    sync2.wait()
    return out


def test_misuse_is_reported():
    out = spmd.launch(_misuse, (2,), "dp", timeout=20)[0]
    assert "parameter 'bias' got a gradient twice before sync.wait()" in out[0]
    assert "a backward ran under no_sync() after a synchronised backward whose reduced" in out[1]
    assert out[2] == (True, False) and out[3] == (False, True)


def _shared_model(mesh, model):
    spmd.parallel.GradSync(model, mesh, "dp", init=None)


def _sparse(mesh):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    spmd.parallel.GradSync(emb, mesh, "dp")  # the hooks keep it alive
    try:
        emb(torch.tensor([1, 2])).sum().backward()
    except NotImplementedError as e:
        return str(e)


def test_sparse_gradients_are_refused_clearly():
    msg = spmd.launch(_sparse, (1,), "dp")[0]
    assert "parameter 'weight' got a torch.sparse_coo gradient; only dense" in msg


def test_ranks_sharing_one_model_on_a_threads_mesh_are_refused():
    with pytest.raises(spmd.SpecError, match="already synchronised by a GradSync on rank"):
        spmd.launch(_shared_model, (2,), "dp", args=(torch.nn.Linear(2, 2),), timeout=10)


# =========================================================================================
# Start-up consistency and argument errors
# =========================================================================================

def test_init_broadcast_copies_parameters_and_buffers_from_rank_0():
    got = spmd.launch(startup, (3,), "dp", args=("broadcast", True))
    assert not any(isinstance(g, str) for g in got)
    for ts in got[1:]:
        for a, b in zip(ts, got[0]):
            assert torch.equal(a, b)
    torch.manual_seed(0)
    assert torch.equal(got[0][0], torch.nn.Linear(3, 4).weight.detach())
    assert torch.equal(got[0][6], torch.zeros(4))  # rank 0's BatchNorm running_mean


def test_init_verify_names_the_first_differing_parameter_on_every_rank():
    got = spmd.launch(startup, (2,), "dp", args=("verify", True))
    for msg in got:
        assert msg.startswith("GradSync: parameter '0.weight' (f32[4, 3]) differs between "
                              "rank 0 and rank 1 of axis 'dp' (checksums "), msg
        assert "init='broadcast'" in msg and "varying={'0.weight': axis}" in msg
    assert got[0] == got[1]
    same = spmd.launch(startup, (2,), "dp", args=("verify", False))
    assert all(isinstance(t, list) for t in same)


def test_different_shapes_are_refused_before_any_data_moves():
    got = spmd.launch(startup, (2,), "dp", args=("broadcast", False, True))
    for msg in got:
        assert "parameter '0.weight' has shape [4, 3] on rank 0 but [5, 3] on rank 1" in msg
        assert "varying={'0.weight': axis}" in msg and "ignore=['0.weight']" in msg


def _bad_args(mesh):
    m = torch.nn.Linear(2, 2)
    G = spmd.parallel.GradSync
    calls = {
        "axis": lambda: G(m, mesh, {"xx": "sum"}),
        "op": lambda: G(m, mesh, {"dp": "max"}),
        "empty": lambda: G(m, mesh, {}),
        "repeat": lambda: G(m, mesh, ["dp", "dp"]),
        "module": lambda: G([m.weight], mesh, "dp"),
        "mesh": lambda: G(m, "dp", "dp"),
        "cap": lambda: G(m, mesh, "dp", bucket_cap_mb=0),
        "init": lambda: G(m, mesh, "dp", init="copy"),
        "ignore": lambda: G(m, mesh, "dp", ignore=["nope"]),
        "varying_type": lambda: G(m, mesh, "dp", varying=["weight"]),
        "varying_name": lambda: G(m, mesh, "dp", varying={"nope": "dp"}),
        "varying_axis": lambda: G(m, mesh, "dp", varying={"weight": "sp"}),
        "varying_ignored": lambda: G(m, mesh, "dp", ignore=["bias"], varying={"bias": "dp"}),
        "first_cap": lambda: G(m, mesh, "dp", first_bucket_cap_mb=-1),
    }
    out = {}
    for k, f in calls.items():
        try:
            f()
            out[k] = None
        except Exception as e:  # noqa: BLE001 - the type is part of what is checked
            out[k] = (type(e).__name__, str(e))
    return out


def test_bad_arguments_raise_clear_errors():
    out = spmd.launch(_bad_args, (2,), "dp")[0]
    assert out["axis"] == ("SpecError", "GradSync: 'xx' is not an axis of Mesh(dp=2, "
                           "backend='threads'); its axes are ['dp']")
    assert out["op"] == ("SpecError", "GradSync: the op for axis 'dp' must be 'sum' or "
                         "'mean', got 'max'")
    assert out["empty"][0] == "SpecError" and "non-empty" in out["empty"][1]
    assert out["repeat"] == ("SpecError", "GradSync: axes ['dp', 'dp'] repeat an axis")
    assert out["module"][0] == "TypeError" and "torch.nn.Module, got list" in out["module"][1]
    assert out["mesh"][0] == "TypeError" and "spmd.Mesh, got str" in out["mesh"][1]
    assert out["cap"][0] == "ValueError" and "bucket_cap_mb" in out["cap"][1]
    assert out["init"][0] == "ValueError" and "'broadcast', 'verify', None" in out["init"][1]
    assert out["ignore"] == ("SpecError", "GradSync: ignore names ['nope'], which are not "
                             "parameters or buffers of the module")
    assert out["varying_type"] == ("TypeError", "GradSync: varying must be a {name: axis or "
                                   "axes} dict, got list")
    assert out["varying_name"] == ("SpecError", "GradSync: varying names 'nope', which is not "
                                   "a parameter or buffer of the module")
    assert out["varying_axis"] == ("SpecError", "GradSync: varying['weight']: 'sp' is not an "
                                   "axis of Mesh(dp=2, backend='threads'); its axes are ['dp']")
    assert out["varying_ignored"][0] == "SpecError" and "both ignored and varying" in \
        out["varying_ignored"][1]
    assert out["first_cap"][0] == "ValueError" and "first_bucket_cap_mb" in out["first_cap"][1]


# =========================================================================================
# The global view of a threads mesh: nothing to do
# =========================================================================================

def test_global_view_threads_mesh_is_inactive_and_shard_map_gives_global_grads():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    torch.manual_seed(9)
    model = CNN().double()
    sync = spmd.parallel.GradSync(model, mesh, {"dp": "mean", "sp": "sum"})
    assert not sync.active and sync.buckets == [] and "inactive" in repr(sync)
    x = torch.randn(4, 2, 6, 5, dtype=torch.float64)
    w = model.conv1.weight

    def body(x):  # a domain-parallel conv: shard_map sums the weight's gradient itself
        h = spmd.halo_pad(x, mesh, "sp", 2, (1, 1))
        return torch.nn.functional.conv2d(h, w, padding=(0, 1))

    out = spmd.shard_map(body, mesh, P("dp", None, "sp"), P("dp", None, "sp"))(x)
    out.pow(2).sum().backward()
    sync.wait()  # no-op
    ref = w.detach().clone().requires_grad_()
    torch.nn.functional.conv2d(x, ref, padding=1).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, **TOL)


def test_inactive_sync_used_on_a_rank_thread_says_so():
    mesh = spmd.Mesh((2,), "dp")
    sync = spmd.parallel.GradSync(torch.nn.Linear(2, 2), mesh, "dp")
    with pytest.raises(spmd.SpecError, match="was built outside the rank threads"):
        run_on_threads(mesh, lambda r: sync.wait())


def test_grad_sync_with_converted_spmd_nn_layers_on_a_dp_sp_mesh():
    """The documented (dp, sp) loop with spmd.nn layers: every rank holds its own copy of
    a converted CNN, its batch shard and its rows; each backprops its part of the global
    mean loss, GradSync sums over both axes: the single-device gradients after 2 Adam
    steps (float64, 1e-10: only the order of additions differs)."""
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, padding_mode="reflect"), nn.Tanh(),
                          nn.MaxPool2d(2), nn.Conv2d(3, 2, 3, padding=1), nn.Tanh(),
                          nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(2, 1, 1)).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 10, 6, generator=g, dtype=torch.float64)
    t = torch.randn(4, 1, 10, 6, generator=g, dtype=torch.float64)
    spec = P("dp", None, "sp")
    copies = [copy.deepcopy(plain) for _ in range(4)]

    def per_rank(mesh):
        model = spmd.nn.convert(copies[mesh.rank], mesh, spec)
        sync = spmd.parallel.GradSync(model, mesh, {"dp": "sum", "sp": "sum"})
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sync.attach(opt)
        lay = spmd.Layout(x.shape, spec, mesh)
        xs, ts = lay.shard(x, mesh.rank), lay.shard(t, mesh.rank)
        for _ in range(2):
            opt.zero_grad()
            (((model(xs) - ts) ** 2).sum() / x.numel()).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    got = spmd.launch(per_rank, (2, 2), ("dp", "sp"))
    opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        ((plain(x) - t) ** 2).mean().backward()
        opt.step()
    for rank_params in got:
        for a, b in zip(rank_params, plain.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-10)


# =========================================================================================
# Collectives around the buckets: every rank meets the same ones (a rank-local unused
# parameter must not desynchronise them)
# =========================================================================================

TINY = dict(first_bucket_cap_mb=1e-5, bucket_cap_mb=1e-5)  # a bucket per parameter


def test_logging_loop_with_a_parameter_used_on_rank_0_only():
    """backward, log the global loss with pmean, step: the head's bucket is started on
    rank 0 in backward but not on rank 1, and pmean must not meet it. Logged losses and
    parameters after 3 SGD steps equal one device."""
    torch.manual_seed(20)
    model, x = Heads(), torch.randn(6, 3, dtype=torch.float64)
    got = spmd.launch(heads_train, (2,), "dp", args=(model, x, only_dp0, False, TINY),
                      timeout=20)
    check_heads(got, heads_single(model, x, 2, only_dp0, False), TOL)
    # After the first iteration the plan starts with rank 0's head: rank 0 starts
    # buckets early in backward (overlap kept), rank 1 at its end.
    assert got[0][2][-1] > 0 and got[1][2][-1] == 0


@pytest.mark.parametrize("shape,names", [((2,), ("dp",)), ((2, 2), ("dp", "sp"))])
@pytest.mark.parametrize("schedule", [only_dp0, shifting], ids=["dp0-only", "shifting"])
def test_psum_inside_backward_and_rank_local_unused_parameters(shape, names, schedule):
    """The backward holds a psum over the synchronised axis (a batch statistic) while a
    head is used on some dp ranks only; small buckets. ``shifting`` also leaves every
    head out of the first (order-learning) iteration and swaps them between ranks."""
    torch.manual_seed(21)
    model, x = Heads(), torch.randn(6, 3, dtype=torch.float64)
    got = spmd.launch(heads_train, shape, names, args=(model, x, schedule, True, TINY),
                      timeout=20)
    check_heads(got, heads_single(model, x, 2, schedule, True), TOL)


def _pending_after_backward(mesh):
    spmd.manual_seed(0)
    model = Heads()
    sync = spmd.parallel.GradSync(model, mesh, "dp", **TINY)
    x = torch.randn(2, 3, dtype=torch.float64)
    with sync.no_sync():
        heads_loss(model, x, [0]).backward()
        inside = [b.work for b in sync._buckets]
    heads_loss(model, x, [0] if mesh.rank == 0 else []).backward()
    after = [b.work for b in sync._buckets], sync._next, sync._dirty
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    sync.wait()
    return inside, after, grads


def test_nothing_is_pending_after_backward_returns():
    """Outside no_sync, backward() returns with every bucket started and waited for (and
    the gradients reduced); inside no_sync nothing starts."""
    got = spmd.launch(_pending_after_backward, (2,), "dp", timeout=20)
    for inside, (works, nxt, dirty), grads in got:
        assert inside == [None] * len(inside)
        assert works == [None] * len(works) and nxt == 0 and not dirty
        for g, h in zip(grads, got[0][2]):
            assert (g is None) == (h is None) and (g is None or torch.equal(g, h))


def test_startup_covers_every_mesh_axis():
    """(dp, sp) = (2, 2), GradSync over "dp" only: weights that differ over "sp" are made
    equal on all four ranks (broadcast), or named in an error on every rank (verify)."""
    for by in ("sp", "dp"):
        got = spmd.launch(startup_2d, (2, 2), ("dp", "sp"), args=("broadcast", by))
        torch.manual_seed(0)
        want = [p.detach() for p in nn.Linear(3, 2).parameters()]
        for ps in got:
            for p, w in zip(ps, want):
                assert torch.equal(p, w)
        msgs = spmd.launch(startup_2d, (2, 2), ("dp", "sp"), args=("verify", by))
        assert len(set(msgs)) == 1, msgs
        assert msgs[0].startswith("GradSync: parameter 'weight' (f32[2, 3]) differs between "
                                  "rank 0 and rank "), msgs[0]
        assert "of axes ('dp', 'sp')" in msgs[0]


def test_a_parameter_varying_over_the_domain_axis():
    """A per-point field split over "sp" (uneven: 5 points as [3, 2]) is declared varying
    over "sp": start-up leaves each sp rank its rows (and broadcasts the replicated layer
    from rank 0), its gradient is reduced over "dp" only, and training equals one device
    on the global field."""
    torch.manual_seed(22)
    model = Field(points=5)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    y = torch.randn(4, 5, 3, dtype=torch.float64)
    got = spmd.launch(field_train, (2, 2), ("dp", "sp"), args=(model, x, y, 100))
    torch.manual_seed(100)
    lin = nn.Linear(6, 3).double()
    want = field_single(model, lin, x, y)
    rows = [slice(0, 3), slice(3, 5)]
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    for r, (start, end, buckets) in enumerate(got):
        sp = mesh.coords(r)[1]
        assert torch.equal(start["lin.weight"], lin.weight.detach())
        assert torch.equal(start["pos"], model.pos.detach()[rows[sp]])
        torch.testing.assert_close(end["lin.weight"], want["lin.weight"], **TOL)
        torch.testing.assert_close(end["pos"], want["pos"][rows[sp]], **TOL)
        over = {n: b.axes for b in buckets for n in b.names}
        assert over == {"pos": ("dp",), "lin.weight": ("dp", "sp"), "lin.bias": ("dp", "sp")}


def _plan(mesh, sizes, cfg):
    model = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in sizes])
    return [(b.nbytes, [model[int(n)].numel() * 4 for n in b.names])
            for b in spmd.parallel.GradSync(model, mesh, "dp", **cfg).buckets]


def test_bucket_cap_alone_bounds_the_first_bucket_too():
    """With only bucket_cap_mb set, no bucket holds more than the cap plus its last
    parameter (the first included, as torch DDP since 2.x); the default first cap is
    1 MiB, and first_bucket_cap_mb, given, wins."""
    sizes = [3000, 70_000, 20_000, 300, 90_000, 5, 40_000] * 3  # float32 elements
    cap = 0.25  # MiB
    for nbytes, members in spmd.launch(_plan, (1,), "dp", args=(sizes, dict(bucket_cap_mb=cap)))[0]:
        assert nbytes - members[-1] < cap * 2**20, (nbytes, members)
    default = spmd.launch(_plan, (1,), "dp", args=(sizes, {}))[0]
    assert default[0][0] >= 2**20 and default[0][0] - default[0][1][-1] < 2**20
    first = spmd.launch(_plan, (1,), "dp", args=(sizes, dict(bucket_cap_mb=cap,
                                                             first_bucket_cap_mb=1.0)))[0]
    assert first[0][0] >= 2**20 > first[0][0] - first[0][1][-1]
    assert all(n - m[-1] < cap * 2**20 for n, m in first[1:])


def _reentrant(mesh, first_checkpointed):
    spmd.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    sync = spmd.parallel.GradSync(model, mesh, "dp", **TINY)
    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        if first_checkpointed:  # the last layer's gradients come from a reentrant backward
            h = model[1](model[0](x))
            out = torch.utils.checkpoint.checkpoint(model[2], h, use_reentrant=True)
        else:  # the first layer's: the outer backward has already begun the iteration
            h = torch.utils.checkpoint.checkpoint(lambda t: model[1](model[0](t)),
                                                  x.requires_grad_(), use_reentrant=True)
            out = model[2](h)
        out.sum().backward()
        sync.wait()
    except RuntimeError as e:
        return str(e)
    return [p.grad.clone() for p in model.parameters()]


def test_reentrant_checkpoint_gradients_are_reduced_or_refused_clearly():
    """A reentrant backward (use_reentrant=True) whose parameter gradients come after the
    outer pass began is handled; one that produces the first gradients of the pass ends
    it early, and the next gradient is refused with the fix in the message."""
    ok = spmd.launch(_reentrant, (2,), "dp", args=(False,), timeout=20)
    for g, h in zip(ok[0], ok[1]):
        assert torch.equal(g, h)
    msgs = spmd.launch(_reentrant, (2,), "dp", args=(True,), timeout=20)
    assert all("use use_reentrant=False" in m for m in msgs), msgs


def _different_models(mesh, how):
    if how == "count" and mesh.rank == 1:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    elif how == "names" and mesh.rank == 1:
        model = nn.ModuleDict({"b": nn.Linear(2, 2)})
    else:
        model = nn.ModuleDict({"a": nn.Linear(2, 2)})
    try:
        spmd.parallel.GradSync(model, mesh, "dp")
    except spmd.SpecError as e:
        return str(e)


def test_ranks_with_different_models_get_the_same_error():
    msgs = spmd.launch(_different_models, (2,), "dp", args=("count",))
    assert msgs[0] == msgs[1] and msgs[0] == (
        "GradSync: the ranks of axis 'dp' hold different numbers of parameters and buffers "
        "(rank 0: 2, rank 1: 4); every rank must build the same model (and pass the same "
        "ignore=... and varying=...)")
    msgs = spmd.launch(_different_models, (2,), "dp", args=("names",))
    assert "disagree about entry 0 of the parameters and buffers" in msgs[0]
    assert "rank 1 differs from rank 0" in msgs[0] and "rank 1 differs from rank 0" in msgs[1]


# =========================================================================================
# The synchronised set is fixed when GradSync is built
# =========================================================================================

@pytest.mark.parametrize("change, says", [
    ("added", r"parameter 'extra' \(f32\[2\]\) was added to the module \(or set to require "
              r"grad\)"),
    ("off", r"parameter 'bias' \(f32\[2\]\) no longer requires grad \(or was removed\)"),
    ("reshaped", r"parameter 'bias' changed from f32\[2\] to f32\[1\]"),
])
def test_a_changed_parameter_set_raises_on_every_rank_naming_it(change, says):
    msgs = spmd.launch(change_after_wrapping, (2,), "dp", args=(change, (0, 1)), timeout=20)
    for r, m in enumerate(msgs):
        assert m is not None, f"rank {r} raised nothing"
        assert re.search(r"^GradSync: " + says + r" after GradSync was built \(rank " + str(r)
                         + r"\).*build a new GradSync after changing the model", m), m


def test_a_change_on_one_rank_only_raises_on_every_rank_naming_it():
    msgs = spmd.launch(change_after_wrapping, (2,), "dp", args=("added", (1,)), timeout=20)
    assert re.search(r"^GradSync: parameter 'extra' \(f32\[2\]\) was added", msgs[1]), msgs[1]
    assert msgs[0].startswith(
        "GradSync: the synchronised parameters changed after GradSync was built on rank 1 of "
        "axis 'dp' (this is rank 0): parameter 'extra' (f32[2]) was added to the module (or "
        "set to require grad) (rank 1). The synchronised parameters"), msgs[0]


def test_changes_on_both_ranks_are_named_on_both():
    msgs = spmd.launch(change_after_wrapping, (2,), "dp", args=("off", (0, 1)), timeout=20)
    for r, m in enumerate(msgs):
        assert m.startswith(f"GradSync: parameter 'bias' (f32[2]) no longer requires grad (or "
                            f"was removed) after GradSync was built (rank {r}); rank {1 - r}: "
                            f"parameter 'bias' (f32[2]) no longer requires grad"), m


@pytest.mark.parametrize("how, differ", [
    ("requires_grad", "rank 0: 4 parameters ('0.weight' (f32[4, 3]), '0.bias' (f32[4]), "
                      "'1.weight' (f32[2, 4]), '1.bias' (f32[2])) in 1 bucket of [26] elements, "
                      "order still to be learned; rank 1: 3 parameters ('0.weight' (f32[4, 3]), "
                      "'1.weight' (f32[2, 4]), '1.bias' (f32[2])) in 1 bucket of [22] elements"),
    ("cap", "rank 0: 4 parameters ('0.weight' (f32[4, 3]), '0.bias' (f32[4]), '1.weight' "
            "(f32[2, 4]), '1.bias' (f32[2])) in 1 bucket of [26] elements, order still to be "
            "learned; rank 1: 4 parameters ('0.weight' (f32[4, 3]), '0.bias' (f32[4]), "
            "'1.weight' (f32[2, 4]), '1.bias' (f32[2])) in 3 buckets of [10, 4, 12] elements"),
])
def test_ranks_whose_buckets_would_differ_are_refused_on_every_rank_when_built(how, differ):
    """Buckets of different sizes would be reduced together (gloo aborts the process on
    that): the plans are compared when GradSync is built."""
    msgs = spmd.launch(different_plans, (2,), "dp", args=(how,), timeout=20)
    for r, m in enumerate(msgs):
        assert m is not None, f"rank {r} raised nothing"
        assert m.startswith(f"GradSync: the ranks of axis 'dp' would reduce different buckets "
                            f"(this is rank {r}): {differ}"), m
        assert "pass the same axes, bucket_cap_mb, first_bucket_cap_mb and learn_order" in m
