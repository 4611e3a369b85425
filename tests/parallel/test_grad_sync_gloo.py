"""GradSync and all_reduce_async on real gloo processes (the session pools, world 2 and 4).

The same per-rank programs as tests/parallel/test_grad_sync.py (tests/parallel/_parallel_cases.py),
compared with single-device float64 training at rtol = atol = 1e-9 (gloo's ring adds in
another order than one device: a few ulps, grown a little by a few Adam steps). Few,
small runs: the CI machine has 2 cores.
"""
from __future__ import annotations

import time

import pytest
import torch
from _parallel_cases import (
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
    heads_single,
    heads_train,
    make,
    only_dp0,
    shifting,
    startup,
    startup_2d,
    train,
    train_single,
    unused,
)
from torch import nn

import spmd
from spmd.comm import comm_of

pytestmark = pytest.mark.gloo

TOL = dict(rtol=1e-9, atol=1e-9)
SMALL = dict(first_bucket_cap_mb=1e-4, bucket_cap_mb=4e-4)


# -- all_reduce_async -------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]


def _async(mesh, axes):
    """Several all-reduces in flight at once, waited in reverse order; a blocking psum
    on another group in between."""
    g, r = mesh.group(axes), mesh.rank
    xs = [(torch.arange(5) * (r + 1) + k).to(dt) for k, dt in enumerate(DTYPES)]
    works = [comm_of(mesh).all_reduce_async(x, "sum", g, name="grad_sync") for x in xs]
    other = spmd.psum(torch.tensor([float(r)]), mesh.axis_names[0])
    outs = [w.wait() for w in reversed(works)][::-1]
    return [o is x for o, x in zip(outs, xs)], xs, other


def _check_async(got, shape, names, axes):
    want = spmd.launch(_async, shape, names, args=(axes,))
    for (same, xs, other), (_, wxs, wother) in zip(got, want):
        assert all(same)
        for x, w in zip(xs, wxs):
            assert x.dtype == w.dtype
            torch.testing.assert_close(x, w, rtol=0, atol=0)  # small integers: exact
        assert torch.equal(other, wother)


def test_all_reduce_async_world2(gloo2):
    _check_async(gloo2.run(_async, (2,), "dp", args=("dp",)), (2,), "dp", "dp")


def _async_validated(mesh, mismatch):
    """SPMD_VALIDATE's check runs before the transfer starts: a size mismatch is a
    CommError on every rank (gloo would abort the process otherwise)."""
    comm_of(mesh).validate = True
    try:
        n = 3 + (mesh.rank if mismatch else 0)
        w = comm_of(mesh).all_reduce_async(torch.ones(n), "sum", mesh.group("dp"), name="grad_sync")
        return w.wait()
    except spmd.CommError as e:
        return str(e)
    finally:
        comm_of(mesh).validate = False


def test_all_reduce_async_validated_world2(gloo2):
    assert all(torch.equal(t, torch.full((3,), 2.0))
               for t in gloo2.run(_async_validated, (2,), "dp", args=(False,)))
    for msg in gloo2.run(_async_validated, (2,), "dp", args=(True,)):
        assert "grad_sync over axis 'dp': rank 0 passed f32[3] but rank 1 passed f32[4]" in msg


def test_all_reduce_async_2x2(gloo4):
    args = ((2, 2), ("dp", "sp"), ("sp", "dp"))
    _check_async(gloo4.run(_async, args[0], args[1], args=(args[2],)), *args)


def _async_rank_1_never_waits(mesh):
    if mesh.rank == 1:
        time.sleep(60)  # ended by the pool
    w = comm_of(mesh).all_reduce_async(torch.ones(3), "sum", mesh.group("dp"), name="grad_sync")
    return w.wait()


def _ok(mesh):
    return mesh.rank


def test_all_reduce_async_timeout_names_missing_rank(gloo2):
    with pytest.raises(spmd.CommTimeout, match=r"rank 0: grad_sync over axis 'dp' timed out "
                       r"after 3 s on rank 0: ranks \[1\] of the group \[0, 1\] did not arrive"):
        gloo2.run(_async_rank_1_never_waits, (2,), "dp", timeout=3)
    assert gloo2.run(_ok, (2,), "dp") == [0, 1]


# -- training equals one device ---------------------------------------------------------------

@pytest.mark.parametrize("kind,opt", [("mlp", "sgd"), ("mlp", "adam"), ("cnn", "adam")])
def test_training_world2(gloo2, kind, opt):
    model, x, y = make(kind, seed=11)
    got = gloo2.run(train, (2,), ("dp",), args=(model, x, y, kind, "dp", opt, 3, SMALL))
    check_train(got, train_single(model, x, y, kind, opt, 3), TOL)


def test_training_world4(gloo4):
    model, x, y = make("mlp", seed=12)
    got = gloo4.run(train, (4,), ("dp",), args=(model, x, y, "mlp", "dp", "adam", 3, SMALL))
    check_train(got, train_single(model, x, y, "mlp", "adam", 3), TOL)


@pytest.mark.parametrize("kind,opt", [("mlp", "sgd"), ("cnn", "adam")])
def test_training_dp_sp_2x2(gloo4, kind, opt):
    """(dp, sp) = (2, 2): batch over dp (mean), points or image rows (7 rows: [4, 3])
    over sp (sum), with halo_pad and a psum in the CNN's forward."""
    model, x, y = make(kind, seed=13)
    axes = {"dp": "mean", "sp": "sum"}
    got = gloo4.run(train, (2, 2), ("dp", "sp"), args=(model, x, y, kind, axes, opt, 3, SMALL))
    check_train(got, train_single(model, x, y, kind, opt, 3), TOL)


# -- buckets, no_sync, unused, start-up ---------------------------------------------------------

def test_reverse_model_plan_no_sync_and_mixed_dtypes_world2(gloo2):
    model, x, y = make("mlp_reverse", seed=14, batch=8)
    cfg = dict(SMALL, micro=2, zero="zeros")
    got = gloo2.run(train, (2,), ("dp",), args=(model, x, y, "mlp_reverse", "dp", "adam", 2, cfg))
    check_train(got, train_single(model, x, y, "mlp_reverse", "adam", 2), TOL)
    for _, _, (before, after), started in got:
        assert [n for _, ns in before for n in ns][0] == "l0.bias"
        assert [n for _, ns in after for n in ns] == ["l2.bias", "l2.weight", "l1.bias",
                                                     "l1.weight", "l0.bias", "l0.weight"]
        assert started
    # bf16, fp16, fp32 and fp64 parameters: four buckets of one dtype each
    model, x, y = make("mixed", seed=15)
    got = gloo2.run(train, (2,), ("dp",), args=(model, x, y, "mixed", "dp", "sgd", 1,
                                                dict(first_bucket_cap_mb=1.0)))
    plan = got[0][2][-1]
    assert sorted(d for d, _ in plan) == ["torch.bfloat16", "torch.float16", "torch.float32",
                                          "torch.float64"]
    want = spmd.launch(train, (2,), ("dp",), args=(model, x, y, "mixed", "dp", "sgd", 1,
                                                   dict(first_bucket_cap_mb=1.0)))
    for (_, gs, _, _), (_, wgs, _, _) in zip(got, want):
        for g, w in zip(gs, wgs):  # two ranks: one addition, the same on gloo and threads
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_unused_parameters_world2(gloo2):
    torch.manual_seed(16)
    model, x = Partly(), torch.randn(4, 3, dtype=torch.float64)
    got = gloo2.run(unused, (2,), "dp", args=(model, x, SMALL), timeout=20)
    check_unused(got, model, x, 2, TOL)


def test_startup_world2(gloo2):
    got = gloo2.run(startup, (2,), "dp", args=("broadcast", True))
    for a, b in zip(got[0], got[1]):
        assert torch.equal(a, b)
    msgs = gloo2.run(startup, (2,), "dp", args=("verify", True))
    assert msgs[0] == msgs[1] and "parameter '0.weight' (f32[4, 3]) differs" in msgs[0]
    msgs = gloo2.run(startup, (2,), "dp", args=("verify", False, True))
    assert msgs[0] == msgs[1] and "has shape [4, 3] on rank 0 but [5, 3] on rank 1" in msgs[0]


# -- collectives around the buckets, start-up over the whole mesh, varying parameters ---------

TINY = dict(first_bucket_cap_mb=1e-5, bucket_cap_mb=1e-5)


def test_logging_loop_with_a_rank_0_only_parameter_world2(gloo2):
    """The ordinary loop (backward, pmean of the loss, step) with a head used on rank 0
    only hung until the timeout; now it equals one device (and finishes at once)."""
    torch.manual_seed(20)
    model, x = Heads(), torch.randn(6, 3, dtype=torch.float64)
    got = gloo2.run(heads_train, (2,), "dp", args=(model, x, only_dp0, False, TINY), timeout=30)
    check_heads(got, heads_single(model, x, 2, only_dp0, False), TOL)


def test_psum_inside_backward_and_shifting_unused_heads_2x2(gloo4):
    """A psum over "dp" inside backward, heads used by some dp ranks only (none in the
    first iteration), GradSync's buckets on their own process groups: equals one device."""
    torch.manual_seed(21)
    model, x = Heads(), torch.randn(6, 3, dtype=torch.float64)
    got = gloo4.run(heads_train, (2, 2), ("dp", "sp"), args=(model, x, shifting, True, TINY),
                    timeout=30)
    check_heads(got, heads_single(model, x, 2, shifting, True), TOL)


def test_startup_over_the_whole_mesh_and_a_varying_field_2x2(gloo4):
    got = gloo4.run(startup_2d, (2, 2), ("dp", "sp"), args=("broadcast", "sp"))
    torch.manual_seed(0)
    want = [p.detach() for p in nn.Linear(3, 2).parameters()]
    for ps in got:
        for p, w in zip(ps, want):
            assert torch.equal(p, w)
    torch.manual_seed(22)
    model = Field(points=5)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    y = torch.randn(4, 5, 3, dtype=torch.float64)
    got = gloo4.run(field_train, (2, 2), ("dp", "sp"), args=(model, x, y, 100))
    torch.manual_seed(100)
    want = field_single(model, nn.Linear(6, 3).double(), x, y)
    for r, (_, end, _) in enumerate(got):
        rows = slice(0, 3) if r % 2 == 0 else slice(3, 5)
        torch.testing.assert_close(end["lin.weight"], want["lin.weight"], **TOL)
        torch.testing.assert_close(end["pos"], want["pos"][rows], **TOL)


def test_a_parameter_added_on_one_rank_raises_on_every_rank_world2(gloo2):
    """Whether any rank changed its synchronised parameters rides in the buckets'
    all-reduce; what changed is then exchanged: the unchanged rank raises too, naming it,
    instead of waiting or reducing."""
    msgs = gloo2.run(change_after_wrapping, (2,), ("dp",), args=("added", (1,)))
    assert msgs[1].startswith("GradSync: parameter 'extra' (f32[2]) was added"), msgs[1]
    assert msgs[0].startswith("GradSync: the synchronised parameters changed after GradSync "
                              "was built on rank 1 of axis 'dp' (this is rank 0): parameter "
                              "'extra' (f32[2]) was added"), msgs[0]


@pytest.mark.parametrize("how", ["requires_grad", "cap"])
def test_ranks_whose_buckets_would_differ_are_refused_when_built_world2(gloo2, how):
    """Bucket all-reduces of different sizes would abort both processes in gloo: the plans
    are compared first, and both ranks raise the same refusal."""
    msgs = gloo2.run(different_plans, (2,), ("dp",), args=(how,))
    for r, m in enumerate(msgs):
        assert m is not None and m.startswith(
            f"GradSync: the ranks of axis 'dp' would reduce different buckets (this is rank "
            f"{r}): rank 0: 4 parameters"), m


def test_broadcast_of_parameters_of_different_shapes_is_refused_world2(gloo2):
    """init="broadcast" (the default) compares names, dtypes and shapes before it moves
    anything: one broadcast of concatenated parameters of different sizes would abort."""
    msgs = gloo2.run(startup, (2,), "dp", args=("broadcast", False, True))
    assert msgs[0] == msgs[1] and "has shape [4, 3] on rank 0 but [5, 3] on rank 1" in msgs[0]
