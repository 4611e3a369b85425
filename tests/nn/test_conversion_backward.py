"""Code a converted forward leaves to backward runs under the same conversion: activation
checkpointing's recompute and tensor hooks; what cannot be is refused before anything runs.

Exact cases are compared with ``assert_matches_single_device`` in float64 on a 4-rank
threads mesh with an uneven split (H = 37: 10, 9, 9, 9 rows): values, input gradients and
parameter gradients, its default tolerance 1e-10 (sharded sums are reordered).
Refusals are checked for their message and for moving no data (``comm_stats``).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _modules import Fn
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device

F64 = torch.float64
H = P(None, None, "sp")  # (N, C, H, W) split along H
S = P(None, "sp")  # (N, L, E) split along the sequence


MESH = spmd.Mesh((4,), ("sp",), "threads")  # "threads" also where a worker process imports this


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, t):
        return self.mha(t, t, t, need_weights=False)[0]


def _sdpa(t):
    q = t.unflatten(-1, (2, 4)).transpose(1, 2)  # (N, heads, L, 4)
    return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


# Each case: (the checkpointed function of the model, its layers, input shape, spec).
BLOCKS = {
    "a reduction": (lambda m: lambda t: t * t.sum(2, keepdim=True), (), (2, 3, 37, 5), H),
    "Conv2d": (lambda m: m.layers[0], (nn.Conv2d(3, 2, 3, padding=1),), (2, 3, 37, 5), H),
    "GroupNorm": (lambda m: m.layers[0], (nn.GroupNorm(1, 3),), (2, 3, 37, 5), H),
    "sdpa over the split sequence": (lambda m: _sdpa, (), (2, 37, 8), S),
    "nn.MultiheadAttention": (lambda m: m.layers[0], (Attention(),), (2, 37, 8), S),
}


def _model(name, reentrant):
    fn, layers, shape, spec = BLOCKS[name]
    model = Fn(lambda m, t: checkpoint(fn(m), t, use_reentrant=reentrant), *layers).double()
    return model, _x(*shape), spec


@pytest.mark.parametrize("name", list(BLOCKS))
def test_checkpoint_recomputes_under_the_conversion(name):
    """use_reentrant=False: the recompute in backward makes the forward's swaps (a
    reduction, a conv's halo, a norm's statistics, ring attention), on the same splits."""
    model, x, spec = _model(name, False)
    conv = spmd.nn.convert(model, MESH, spec)
    assert_matches_single_device(conv, model, MESH, spec, spec, x)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_reentrant_checkpoint_is_refused_before_anything_runs(name):
    """use_reentrant=True recomputes in a nested backward that torch refuses under
    torch.autograd.grad (shard_map's backward): refused in the plan, naming the line of
    the checkpoint call and the fix."""
    model, x, spec = _model(name, True)
    mesh = MESH
    conv = spmd.nn.convert(model, mesh, spec)
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        spmd.shard_map(conv, mesh, spec, spec)(x.requires_grad_())
    assert stats.calls() == 0
    msg = str(e.value)
    assert "nothing has run" in msg
    assert "(test_conversion_backward.py:" in msg
    assert ("torch.utils.checkpoint(use_reentrant=True, torch's default where not given) "
            "recomputes in a nested "
            "torch.autograd.backward, which torch refuses under torch.autograd.grad "
            "(shard_map's backward on every rank); pass use_reentrant=False") in msg


class Block(nn.Module):
    """A residual block whose body is checkpointed, as in a memory-bound model."""

    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.GroupNorm(1, c), nn.Conv2d(c, c, 3, padding=1), nn.GELU())

    def forward(self, t):
        return t + checkpoint(self.body, t, use_reentrant=False)


def test_a_checkpointed_block_inside_sequential_trains_like_one_device():
    """Checkpointed blocks between layers (their input an intermediate activation that
    Python no longer holds), to a mean over the split dims."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), Block(3), Block(3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 1)).double()
    conv = spmd.nn.convert(model, MESH, H)
    assert_matches_single_device(conv, model, MESH, H, P(), _x(2, 2, 37, 5))


def test_checkpoint_sequential():
    seq = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.GELU(),
                        nn.Conv2d(3, 2, 3, padding=1), nn.GroupNorm(1, 2)).double()
    model = Fn(lambda m, t: checkpoint_sequential(m.layers[0], 2, t, use_reentrant=False),
               seq)
    assert_matches_single_device(spmd.nn.convert(model, MESH, H), model, MESH, H, H,
                                 _x(2, 3, 37, 5))


def test_the_plan_with_example_sees_into_the_checkpointed_function():
    """The plan runs the checkpointed function on meta tensors like any other code (its
    swaps listed), at convert time."""
    model = Fn(lambda m, t: checkpoint(lambda u: m.layers[0](u).mean(2), t,
                                       use_reentrant=False), nn.Conv2d(3, 2, 3, padding=1))
    model = model.double()
    x = _x(2, 3, 37, 5)
    conv = spmd.nn.convert(model, MESH, H, example=x)
    plan = str(conv.spmd_plan)
    assert "swapped  in 'layers.0' (test_conversion_backward.py:" in plan
    assert "torch.conv2d -> spmd.ops.conv2d" in plan
    assert "mean over split dim 2 -> spmd.reduce(op='mean')" in plan
    assert_matches_single_device(conv, model, MESH, H, P(None, None, None), x)



@pytest.mark.parametrize("where", ["split", "replicated"])
def test_dropout_in_a_checkpoint_recomputes_the_forwards_mask(where):
    """Each rank thread draws a split mask from its own generator state, and a replicated
    one from the stream the ranks share; the recompute starts both from the states the
    region's forward started from, so the gradients are those of the same model without
    checkpoint (one device draws other masks: compared with itself)."""
    body = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Dropout(0.5)).double() \
        if where == "split" else \
        Fn(lambda m, t: F.dropout(t.mean(2, keepdim=True), 0.5) * m.layers[0](t),
           nn.Conv2d(3, 3, 3, padding=1).double())
    x = _x(2, 3, 37, 5)
    got = []
    for ck in (True, False):
        f = (lambda m, t: checkpoint(m.layers[0], t, use_reentrant=False)) if ck else \
            (lambda m, t: m.layers[0](t))
        conv = spmd.nn.convert(Fn(f, body), MESH, H)
        xx = x.clone().requires_grad_()
        torch.manual_seed(0)
        y = spmd.shard_map(conv, MESH, H, H)(xx)
        (y * y).sum().backward()
        got.append((y.detach(), xx.grad))
    assert torch.equal(got[0][0], got[1][0])
    torch.testing.assert_close(got[0][1], got[1][1], rtol=1e-12, atol=1e-12)


def test_a_recompute_that_raises_leaves_nothing_behind():
    """A node that fails in backward never runs its post-hook (autograd drops its torch
    modes itself): the next converted forward on those threads is exact all the same."""
    calls = []

    def f(t):
        if t.device.type != "meta":
            calls.append(1)
            if len(calls) > 4:  # the 4 ranks' forwards passed: a recompute
                raise RuntimeError("fails in the recompute")
        return t * t.sum(2, keepdim=True)
    mesh = spmd.Mesh((4,), ("sp",), "threads")
    conv = spmd.nn.convert(Fn(lambda m, t: checkpoint(f, t, use_reentrant=False)), mesh, H)
    y = spmd.shard_map(conv, mesh, H, H)(_x(2, 3, 37, 5).requires_grad_())
    with pytest.raises(RuntimeError, match="fails in the recompute"):
        y.sum().backward()
    model = Fn(lambda m, t: t * t.sum(2, keepdim=True))
    mesh = spmd.Mesh((4,), ("sp",), "threads")
    assert_matches_single_device(spmd.nn.convert(model, mesh, H), model, mesh, H, H,
                                 _x(2, 3, 37, 5))


def test_a_converted_layer_inside_a_checkpoint_of_the_caller():
    """A converted model called inside a checkpoint of unconverted code: its plan is
    made in the forward (checkpoint's saved-tensor hooks do not see the plan's meta
    tensors) and the recompute enters it again from outside, converted as in the forward."""
    plain = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.GroupNorm(1, 3)).double()
    outer = Fn(lambda m, t: checkpoint(m.layers[0], t, use_reentrant=False),
               spmd.nn.convert(plain, MESH, H))
    assert_matches_single_device(outer, Fn(lambda m, t: m.layers[0](t), plain), MESH, H, H,
                                 _x(2, 3, 37, 5))


def test_a_checkpoint_inside_another_is_refused_before_anything_runs():
    """Nested regions (in the forward, or a checkpoint of the caller around the converted
    model) are not followed together: refused, naming the inner checkpoint's line."""
    def nested(m, t):
        return checkpoint(lambda u: checkpoint(lambda v: v * v.sum(2, keepdim=True),
                                               m.layers[0](u), use_reentrant=False),
                          t, use_reentrant=False)
    inner = Fn(nested, nn.Conv2d(3, 3, 3, padding=1)).double()
    caller = Fn(lambda m, t: checkpoint(m.layers[0], t, use_reentrant=False),
                spmd.nn.convert(Fn(lambda m, t: checkpoint(
                    lambda u: u * u.sum(2, keepdim=True), t, use_reentrant=False)), MESH, H))
    for model in (spmd.nn.convert(inner, MESH, H), caller):
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
            spmd.shard_map(model, MESH, H, H)(_x(2, 3, 37, 5).requires_grad_())
        assert stats.calls() == 0
        assert "(test_conversion_backward.py:" in str(e.value)
        assert ("torch.utils.checkpoint inside the function of another checkpoint: the two "
                "recomputes are not followed together") in str(e.value)


def test_selective_checkpointing_is_refused_before_anything_runs():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    model = Fn(lambda m, t: checkpoint(m.layers[0], t, use_reentrant=False,
                                       context_fn=contexts), nn.Conv2d(3, 3, 3, padding=1))
    with pytest.raises(spmd.SpecError) as e:
        spmd.nn.convert(model.double(), MESH, H, example=(2, 3, 37, 5))
    assert "torch.utils.checkpoint(context_fn=...) gives the recompute contexts of its own" \
        in str(e.value) and "drop context_fn" in str(e.value)


def test_state_updated_in_a_checkpoint_is_refused_on_rank_threads():
    """The recompute updates BatchNorm's running statistics a second time (as on one
    device); rank threads sharing the layer would each apply it: refused in the plan."""
    model = Fn(lambda m, t: checkpoint(m.layers[0], t, use_reentrant=False),
               nn.BatchNorm2d(3)).double()
    with pytest.raises(spmd.SpecError) as e:
        spmd.nn.convert(model, MESH, H, example=(2, 3, 37, 5))
    assert ("in Fn.layers.0: self.running_mean updates the buffer in place inside "
            "torch.utils.checkpoint, whose recompute in backward updates it again; the rank "
            "threads of a threads mesh share the layer") in str(e.value)


# -- tensor hooks -------------------------------------------------------------------------------

def _hooked(hook):
    def f(m, x):
        h = m.layers[0](x)
        if h.requires_grad:
            h.register_hook(hook)
        return (h * h).mean((2, 3))
    return Fn(f, nn.Conv2d(3, 2, 3, padding=1)).double()


def test_a_tensor_hook_runs_under_the_conversion():
    """The hook gets the gradient split like the hooked tensor and its calls converted:
    g.abs().amax() is the global amax."""
    model = _hooked(lambda g: g / g.abs().amax())
    conv = spmd.nn.convert(model, MESH, H, example=(2, 3, 37, 5))
    assert "amax over split dim 2 -> spmd.reduce(op='max')" in str(conv.spmd_plan)
    assert_matches_single_device(conv, model, MESH, H, P(), _x(2, 3, 37, 5))


def test_a_hook_on_a_whole_tensor_gets_the_whole_gradient():
    """Each rank holds a part of a whole tensor's gradient (the parts add up to it): the
    hook body gets their sum, so that clipping it is exact."""
    def f(m, x):
        h = x.mean((2, 3))
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-0.3, 0.3))
        return m.layers[0](h) + (x * h[:, :, None, None]).mean((2, 3))
    model = Fn(f, nn.Linear(3, 3)).double()
    x = _x(2, 3, 37, 5)
    assert (torch.func.grad(lambda h: (model.layers[0](h) + h * x.mean((2, 3))).sum())(
        x.mean((2, 3))).abs() > 0.3).any()  # the clamp bites
    assert_matches_single_device(spmd.nn.convert(model, MESH, H), model, MESH, H, P(), x)


def test_a_hook_in_a_checkpointed_function_and_allow_running_it_as_is():
    model = Fn(lambda m, t: checkpoint(_hooked_body, m.layers[0](t), use_reentrant=False),
               nn.Conv2d(3, 2, 3, padding=1)).double()
    assert_matches_single_device(spmd.nn.convert(model, MESH, H), model, MESH, H, P(),
                                 _x(2, 3, 37, 5))
    # allow= runs the hook as it is, on this rank's part of the gradient: the user's word
    # for a hook that only scales by a constant
    model = _hooked(lambda g: g * 0.5)
    conv = spmd.nn.convert(model, MESH, H, allow=(torch.Tensor.register_hook,))
    assert_matches_single_device(conv, model, MESH, H, P(), _x(2, 3, 37, 5))


def _hooked_body(h):
    h = h * 1.0
    if h.requires_grad:
        h.register_hook(lambda g: g - g.mean(2, keepdim=True))
    return (h * h).sum((2, 3))


def test_a_tensor_hook_that_cannot_be_followed_is_refused_before_anything_runs():
    """The plan runs the hook once on a meta stand-in of the gradient: a refused call in
    it, or a result split otherwise than the gradient, raises before any data moves."""
    mesh = MESH
    x = _x(2, 3, 37, 5).requires_grad_()
    for hook, want in [
        (lambda g: g.roll(1, 2), "roll shifts values along dim 2, which is split over 'sp'"),
        (lambda g: g.sum(2, keepdim=True).expand(g.shape),
         "x.register_hook(fn): fn returns a gradient split as P(), but the hooked tensor's "
         "gradient is split as P(None, None, 'sp'); return a tensor computed from the "
         "gradient position by position"),
    ]:
        conv = spmd.nn.convert(_hooked(hook), mesh, H)
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
            spmd.shard_map(conv, mesh, H, P())(x)
        assert stats.calls() == 0
        assert "nothing has run" in str(e.value) and want in str(e.value)
        assert "(test_conversion_backward.py:" in str(e.value)


# -- module hooks -------------------------------------------------------------------------------

def test_a_layers_backward_hook_is_refused_before_anything_runs():
    """Torch hands a layer's backward hooks this rank's part of the gradients, outside
    the conversion: refused in the plan, naming the layer and the fix."""
    mesh = MESH
    for register in (lambda m: m.register_full_backward_hook(lambda mod, gi, go: None),
                     lambda m: m.register_full_backward_pre_hook(lambda mod, go: None)):
        model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1))
        conv = spmd.nn.convert(model.double(), mesh, H)
        register(conv[1])
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
            spmd.shard_map(conv, mesh, H, H)(_x(2, 3, 37, 5).requires_grad_())
        assert stats.calls() == 0
        assert ("in '1': Conv2d has a backward hook (register_full_backward_hook or "
                "register_full_backward_pre_hook), which torch runs on this rank's part of "
                "the gradients, outside the conversion") in str(e.value)
        assert "output.register_hook(fn)" in str(e.value)
    # registered after the plan was made (a first call): raised before the forward runs
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1))
    conv = spmd.nn.convert(model.double(), mesh, H)
    x = _x(2, 3, 37, 5).requires_grad_()
    spmd.shard_map(conv, mesh, H, H)(x)
    conv[1].register_full_backward_hook(lambda mod, gi, go: None)
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
        spmd.shard_map(conv, mesh, H, H)(x)
    assert stats.calls() == 0
    assert "convert: in '1': Conv2d has a backward hook" in str(e.value)
    assert "nothing has run" in str(e.value)


def test_a_global_module_backward_hook_is_refused_before_anything_runs():
    """torch.nn.modules.module.register_module_full_backward_hook: the plan sees the
    tensors torch wraps for it."""
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1))
    conv = spmd.nn.convert(model.double(), MESH, H)
    handle = torch.nn.modules.module.register_module_full_backward_hook(
        lambda mod, gi, go: None)
    try:
        with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError) as e:
            spmd.shard_map(conv, MESH, H, H)(_x(2, 3, 37, 5).requires_grad_())
    finally:
        handle.remove()
    assert stats.calls() == 0
    assert ("a layer's backward hook (register_module_full_backward_hook, "
            "register_full_backward_hook or their pre-hooks) watches this tensor; torch runs "
            "it on this rank's part of the gradients, outside the conversion") in str(e.value)


def test_forward_hooks_run_inside_the_converted_forward():
    """Forward (pre-)hooks are part of the forward: their calls are converted."""
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)).double()
    model[1].register_forward_pre_hook(lambda mod, a: (a[0] - a[0].mean(2, keepdim=True),))
    model[1].register_forward_hook(lambda mod, a, o: o / o.abs().amax())
    conv = spmd.nn.convert(model, MESH, H, example=(2, 3, 37, 5))
    plan = str(conv.spmd_plan)
    assert "mean over split dim 2" in plan and "amax over split dim 2" in plan
    assert_matches_single_device(conv, model, MESH, H, H, _x(2, 3, 37, 5))


# -- processes ----------------------------------------------------------------------------------

class Checkpointed(nn.Module):
    """Module-level (spawned workers import it): a conv, a checkpointed norm and conv."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.body = nn.Sequential(nn.GroupNorm(1, 2), nn.Conv2d(2, 1, 3, padding=1))

    def forward(self, x):
        return checkpoint(self.body, self.conv(x), use_reentrant=False)


@pytest.mark.gloo
def test_checkpoint_trains_like_one_device_world2(gloo2):
    from test_conversion_gloo import _one_device, _train
    plain = Checkpointed().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 9, 4, generator=g, dtype=F64)
    t = torch.randn(2, 1, 9, 4, generator=g, dtype=F64)
    got = gloo2.run(_train, (2,), ("sp",), args=(plain, x, t, 2))
    one, want = _one_device(plain, x, t, 2)
    for losses, params in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-10,
                                   atol=1e-10)
        for p, q in zip(params, one.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)


def _weighted(y):
    return (y * torch.arange(1.0, y.numel() + 1, dtype=y.dtype).view(y.shape)).sum()


def test_without_backward_code_a_converted_model_is_in_the_one_backward_pass():
    """On rank greenlets a converted forward that leaves no code to backward (no
    checkpoint, no tensor hook; its plan says so) is differentiated in shard_map's one
    pass over every rank, so it may follow a sum that needs gradients in the same body.
    float64 against one device, 1e-10 (sharded sums are reordered)."""
    model = Fn(lambda m, t: torch.relu(m.layers[0](t)), nn.Conv2d(3, 2, 3, padding=1)).double()
    mesh = spmd.Mesh((4,), ("sp",), schedule="greenlets")
    conv = spmd.nn.convert(model, mesh, H)
    x = _x(2, 3, 37, 5).requires_grad_()
    y = spmd.shard_map(lambda t: conv(t * spmd.psum(t.sum(), "sp")), mesh, H, H)(x)
    _weighted(y).backward()
    assert conv.spmd_plan.backward_code is False
    ref = x.detach().clone().requires_grad_()
    want = model(ref * ref.sum())
    _weighted(want).backward()
    torch.testing.assert_close(y.detach(), want.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-10, atol=1e-10)
    for p, q in zip(conv.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["checkpoint", "tensor hook"])
def test_backward_code_after_a_sum_that_needs_gradients_is_refused_on_greenlets(kind):
    """A checkpoint's recompute or a tensor hook runs per rank in backward: after a sum
    that needs gradients (one node over every rank) the call cannot do both, and says
    so on every rank before the model runs."""
    model = _model("Conv2d", False)[0] if kind == "checkpoint" else _hooked(lambda g: g * 2)
    mesh = spmd.Mesh((4,), ("sp",), schedule="greenlets")
    conv = spmd.nn.convert(model, mesh, H, example=(2, 3, 37, 5))
    assert conv.spmd_plan.backward_code is True
    out = H if kind == "checkpoint" else P()
    x = _x(2, 3, 37, 5).requires_grad_()
    with pytest.raises(spmd.SpecError, match="leaves code to backward.*call the converted "
                                             "model first"):
        spmd.shard_map(lambda t: conv(t * spmd.psum(t.sum(), "sp")), mesh, H, out)(x)
    # called first, it trains like one device (its backward per rank)
    assert_matches_single_device(conv, model, mesh, H, out, x.detach())
