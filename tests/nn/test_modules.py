"""spmd.nn: the drop-in layers equal their torch twins on one device (values and
gradients, float64, tolerance in tests/_ops.py) and keep state_dict keys so checkpoints
load both ways; convert() makes a copy whose forward runs each layer's twin on shards.
(The interpreter behind convert is tested in tests/nn/test_conversion.py.)
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _ops import F64, TOL
from torch import nn

import spmd
from spmd import Layout, P
from spmd.testing import assert_matches_single_device

SPEC = P(None, None, "sp")


def _compare_module(sharded, plain, mesh, x, in_spec=SPEC, out_spec=SPEC):
    # values, the input gradient and every parameter's gradient, by name
    assert_matches_single_device(sharded, plain, mesh, in_spec, out_spec, x, **TOL)


@pytest.mark.parametrize("make", [
    lambda **kw: (nn.Conv1d(2, 3, 4, stride=2, padding=1), spmd.nn.Conv1d, (1, 2, 13)),
    lambda **kw: (nn.Conv2d(2, 4, 3, padding="same", padding_mode="circular", bias=False),
                  spmd.nn.Conv2d, (2, 2, 7, 5)),
    lambda **kw: (nn.Conv3d(2, 2, (3, 1, 2), dilation=(2, 1, 1), padding_mode="reflect",
                            padding=(2, 0, 1)), spmd.nn.Conv3d, (1, 2, 9, 3, 4)),
    lambda **kw: (nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1),
                  spmd.nn.ConvTranspose1d, (1, 2, 6)),
    lambda **kw: (nn.ConvTranspose2d(2, 2, 2, stride=2, groups=2), spmd.nn.ConvTranspose2d,
                  (1, 2, 5, 3)),
    lambda **kw: (nn.ConvTranspose3d(2, 1, 3, padding=1), spmd.nn.ConvTranspose3d, (1, 2, 5, 2, 2)),
    lambda **kw: (nn.MaxPool1d(3, 2, padding=1, ceil_mode=True), spmd.nn.MaxPool1d, (1, 2, 10)),
    lambda **kw: (nn.MaxPool2d(2), spmd.nn.MaxPool2d, (1, 2, 9, 4)),
    lambda **kw: (nn.MaxPool3d(2, 1, dilation=2), spmd.nn.MaxPool3d, (1, 1, 7, 3, 3)),
    lambda **kw: (nn.AvgPool1d(3, 1, 1, count_include_pad=False), spmd.nn.AvgPool1d, (1, 2, 7)),
    lambda **kw: (nn.AvgPool2d(3, 2, 1, divisor_override=2), spmd.nn.AvgPool2d, (1, 2, 9, 5)),
    lambda **kw: (nn.AvgPool3d(2, ceil_mode=True), spmd.nn.AvgPool3d, (1, 1, 5, 3, 3)),
    lambda **kw: (nn.AdaptiveMaxPool1d(4), spmd.nn.AdaptiveMaxPool1d, (1, 2, 11)),
    lambda **kw: (nn.AdaptiveAvgPool2d((5, None)), spmd.nn.AdaptiveAvgPool2d, (1, 2, 7, 3)),
    lambda **kw: (nn.AdaptiveAvgPool3d(2), spmd.nn.AdaptiveAvgPool3d, (1, 1, 6, 3, 3)),
    lambda **kw: (nn.Upsample(scale_factor=1.5, mode="bicubic"), spmd.nn.Upsample, (1, 2, 7, 4)),
    lambda **kw: (nn.UpsamplingBilinear2d(scale_factor=2), spmd.nn.Upsample, (1, 2, 5, 3)),
], ids=["conv1d", "conv2d", "conv3d", "convt1d", "convt2d", "convt3d", "maxpool1d", "maxpool2d",
        "maxpool3d", "avgpool1d", "avgpool2d", "avgpool3d", "adamax1d", "adaavg2d", "adaavg3d",
        "upsample", "upsampling_bilinear"])
def test_converted_layers_match_torch(make):
    """Each layer with a twin, converted (the copy runs the spmd.ops twin) and as its
    spmd.nn twin (from_torch, sharing the parameters)."""
    plain, twin, shape = make()
    plain = plain.double()
    mesh = spmd.Mesh((3,), ("sp",))
    sharded = spmd.nn.convert(plain, mesh, SPEC, example=shape)
    assert type(sharded) is type(plain)
    swapped = sharded.spmd_plan.swapped  # (padding modes other than zeros: F.pad, then conv)
    assert swapped and all(e.detail.startswith("-> spmd.ops.") for e in swapped)
    for a, b in zip(sharded.parameters(), plain.parameters()):
        assert a is not b and torch.equal(a, b)  # a copy
    x = torch.randn(shape, dtype=F64)
    _compare_module(sharded, plain, mesh, x)
    layer = twin.from_torch(plain, mesh, SPEC)
    assert type(layer) is twin and isinstance(layer, twin._torch_base)
    _compare_module(layer, plain, mesh, x)


def test_checkpoints_load_both_ways():
    mesh = spmd.Mesh((2,), ("sp",))
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.ReflectionPad2d(1),
                        nn.Conv2d(4, 4, 3), nn.ConvTranspose2d(4, 1, 2, stride=2))
    sharded = spmd.nn.convert(net, mesh, SPEC)
    assert list(sharded.state_dict()) == list(net.state_dict())
    fresh = spmd.nn.convert(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                                          nn.ReflectionPad2d(1), nn.Conv2d(4, 4, 3),
                                          nn.ConvTranspose2d(4, 1, 2, stride=2)), mesh, SPEC)
    fresh.load_state_dict(net.state_dict())
    back = copy.deepcopy(net)
    for p in back.parameters():
        p.data.zero_()
    back.load_state_dict(fresh.state_dict())
    x = torch.randn(1, 1, 6, 6)
    y = spmd.shard_map(fresh, mesh, SPEC, SPEC)(x)
    torch.testing.assert_close(y, back(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, net(x), rtol=1e-5, atol=1e-5)
    pad = spmd.nn.Pad.from_torch(net[2], mesh, SPEC)
    assert pad.mode == "reflect" and pad.padding == (1, 1, 1, 1)
    assert type(spmd.nn.Conv2d.from_torch(net[0], mesh, SPEC).to_torch()) is nn.Conv2d


def test_convert_leaves_the_model_alone_and_refuses_unsafe_layers():
    mesh = spmd.Mesh((2,), ("sp",))
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    with pytest.raises(spmd.SpecError, match=r"in '1': flatten flattens dim 2"):
        spmd.nn.convert(net, mesh, SPEC, example=(1, 1, 8, 8))
    out = spmd.nn.convert(net, mesh, SPEC, allow=(nn.Flatten,), example=(1, 1, 8, 8))
    assert type(net[0]) is nn.Conv2d and type(out[0]) is nn.Conv2d
    assert type(out[1]) is nn.Flatten
    assert [e.kind for e in out.spmd_plan.entries] == ["swapped", "allowed"]


def test_conv_transpose_output_size_is_global():
    mesh = spmd.Mesh((3,), ("sp",))
    plain = nn.ConvTranspose1d(2, 2, 3, stride=2, padding=1).double()
    sharded = spmd.nn.convert(plain, mesh, SPEC)
    x = torch.randn(1, 2, 7, dtype=F64)
    y = spmd.shard_map(lambda x: sharded(x, output_size=[14]), mesh, SPEC, SPEC)(x)
    torch.testing.assert_close(y, plain(x, output_size=[14]), **TOL)


def test_a_layer_constructed_directly():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    spec = P("dp", None, "sp")
    conv = spmd.nn.Conv2d(2, 3, 3, padding=1, padding_mode="replicate", mesh=mesh, spec=spec).double()
    plain = nn.Conv2d(2, 3, 3, padding=1, padding_mode="replicate").double()
    plain.load_state_dict(conv.state_dict())
    assert "mesh=Mesh(dp=2, sp=2" in repr(conv)
    lay = Layout((4, 2, 9, 4), spec, mesh, {2: [2, 7]})
    _compare_module(conv, plain, mesh, torch.randn(4, 2, 9, 4, dtype=F64), lay, spec)


def test_a_copied_converted_model_keeps_its_mesh_and_runs():
    mesh = spmd.Mesh((2,), ("sp",))
    sharded = spmd.nn.convert(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1)), mesh, SPEC)
    twin = copy.deepcopy(sharded)  # as an EMA model or a checkpoint copy would be made
    assert copy.copy(mesh) is mesh
    x = torch.randn(1, 1, 5, 4, dtype=F64)
    twin.double()
    torch.testing.assert_close(spmd.shard_map(twin, mesh, SPEC, SPEC)(x),
                               F.conv2d(x, twin[0].weight, twin[0].bias, padding=1), **TOL)


NORMS = {
    "group_norm": (lambda: nn.GroupNorm(2, 4), spmd.nn.GroupNorm, (2, 4, 7, 5), SPEC),
    "group_norm_3d": (lambda: nn.GroupNorm(1, 4), spmd.nn.GroupNorm, (1, 4, 5, 3, 2),
                      P(None, None, "sp", None, "sp2")),
    "layer_norm": (lambda: nn.LayerNorm([7, 5]), spmd.nn.LayerNorm, (2, 4, 7, 5), SPEC),
    "rms_norm": (lambda: nn.RMSNorm([5]), spmd.nn.RMSNorm, (2, 4, 7, 5),
                 P(None, None, None, "sp")),
    "batch_norm1d": (lambda: nn.BatchNorm1d(4), spmd.nn.BatchNorm1d, (3, 4, 9), SPEC),
    "batch_norm2d": (lambda: nn.BatchNorm2d(4, momentum=None), spmd.nn.BatchNorm2d,
                     (3, 4, 7, 5), P("sp2", None, "sp")),
    "batch_norm3d": (lambda: nn.BatchNorm3d(4, affine=False), spmd.nn.BatchNorm3d,
                     (2, 4, 5, 3, 2), SPEC),
    "instance_norm1d": (lambda: nn.InstanceNorm1d(4, affine=True), spmd.nn.InstanceNorm1d,
                        (2, 4, 9), SPEC),
    "instance_norm2d": (lambda: nn.InstanceNorm2d(4, track_running_stats=True),
                        spmd.nn.InstanceNorm2d, (2, 4, 7, 5), SPEC),
    "instance_norm3d": (lambda: nn.InstanceNorm3d(4), spmd.nn.InstanceNorm3d, (1, 4, 5, 3, 2),
                        SPEC),
    "softmax": (lambda: nn.Softmax(2), spmd.nn.Softmax, (2, 4, 7, 5), SPEC),
    "log_softmax": (lambda: nn.LogSoftmax(-1), spmd.nn.LogSoftmax, (2, 4, 7, 5),
                    P(None, None, None, "sp")),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_and_softmax_twins_match_torch(name):
    """Each twin, made from its torch layer and constructed directly (loading the torch
    layer's state_dict), equals it in training (values, input and parameter gradients)
    and, after the training forward has updated any running statistics exactly as
    torch's did, in eval."""
    make, twin, shape, spec = NORMS[name]
    mesh = spmd.Mesh((2, 2), ("sp", "sp2"))
    plain = make().double()
    for p in plain.parameters():  # not the default ones and zeros
        p.data.uniform_(0.5, 1.5)
    d = next(k for k in range(len(shape)) if spec.entry(k))  # uneven: sizes [n - 1, 1]
    lay = Layout(shape, spec, mesh, {d: [shape[d] - 1, 1]})
    x = torch.randn(shape, dtype=F64) * 2 + 3
    layer = twin.from_torch(plain, mesh, spec)
    assert type(layer) is twin and isinstance(layer, twin._torch_base)
    assert layer.to_torch().__class__ is twin._torch_base
    _compare_module(layer, plain, mesh, x, lay, lay)
    args = dict(mesh=mesh, spec=spec)
    direct = twin(*{"group_norm": (2, 4), "group_norm_3d": (1, 4), "layer_norm": ([7, 5],),
                    "rms_norm": ([5],), "softmax": (2,), "log_softmax": (-1,)}.get(name, (4,)),
                  **{k: getattr(plain, k) for k in ("affine", "track_running_stats", "momentum")
                     if hasattr(plain, k)}, **args).double()
    direct.load_state_dict(plain.state_dict())
    assert list(direct.state_dict()) == list(plain.state_dict())
    ref = copy.deepcopy(plain)
    y = spmd.shard_map(direct, mesh, lay, lay)(x)
    torch.testing.assert_close(y, ref(x), **TOL)
    for a, b in zip(direct.buffers(), ref.buffers()):  # running stats, num_batches_tracked
        torch.testing.assert_close(a, b, **TOL)
    direct.eval(), ref.eval()
    torch.testing.assert_close(spmd.shard_map(direct, mesh, lay, lay)(x), ref(x), **TOL)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_twin_trains_five_steps_then_evals_like_torch(momentum):
    """BatchNorm2d on a (dp, sp) mesh (SyncBatchNorm semantics): 5 training steps on
    uneven shards, running statistics and num_batches_tracked counted once per step by
    the rank threads that share them, then eval: as torch's on the whole batch."""
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    spec = P("dp", None, "sp")
    bn = spmd.nn.BatchNorm2d(3, momentum=momentum, mesh=mesh, spec=spec).double()
    ref = nn.BatchNorm2d(3, momentum=momentum).double()
    lay = Layout((4, 3, 9, 4), spec, mesh, {2: [8, 1]})
    f = spmd.shard_map(bn, mesh, lay, lay)
    for step in range(5):
        x = torch.randn(lay.shape, dtype=F64) * (step + 1) + step
        torch.testing.assert_close(f(x), ref(x), **TOL)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 5
    torch.testing.assert_close(bn.running_mean, ref.running_mean, **TOL)
    torch.testing.assert_close(bn.running_var, ref.running_var, **TOL)
    bn.eval(), ref.eval()
    x = torch.randn(lay.shape, dtype=F64)
    torch.testing.assert_close(f(x), ref(x), **TOL)


def test_batch_norm_in_a_converted_model_on_rank_threads_via_types():
    """convert on a threads mesh refuses torch's BatchNorm in training (its forward counts
    num_batches_tracked once per rank thread); types= swaps in the twin, which counts it
    once per step: 3 training steps equal torch's, buffers included."""
    mesh = spmd.Mesh((2,), ("sp",))
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=None),
                        nn.ReLU()).double()
    x = torch.randn(2, 1, 7, 5, dtype=F64)
    with pytest.raises(spmd.SpecError, match=r"types=\{nn.BatchNorm2d: spmd.nn.BatchNorm2d\}"):
        # momentum=None reads num_batches_tracked, which a plan on meta tensors cannot:
        # the refusal comes at the first forward, before any data moves
        spmd.shard_map(spmd.nn.convert(net, mesh, SPEC), mesh, SPEC, SPEC)(x)
    assert int(net[1].num_batches_tracked) == 0
    sharded = spmd.nn.convert(net, mesh, SPEC, types={nn.BatchNorm2d: spmd.nn.BatchNorm2d},
                              example=(2, 1, 7, 5))
    assert type(sharded[1]) is spmd.nn.BatchNorm2d
    f = spmd.shard_map(sharded, mesh, SPEC, SPEC)
    for _ in range(3):
        x = torch.randn(2, 1, 7, 5, dtype=F64)
        torch.testing.assert_close(f(x), net(x), **TOL)
    for (k, a), b in zip(sharded.state_dict().items(), net.state_dict().values()):
        torch.testing.assert_close(a, b, **TOL, msg=k)
