"""spmd.fft on real gloo processes: the checks of test_fft.py (values and gradients against
torch.fft in float64, the adjoint test, the all_to_alls counted on each rank), a few cases
each, since CI has 2 cores. Per-rank functions are module-level so the spawned workers can
import them.
"""
from __future__ import annotations

import pytest
import torch
from test_fft import check_case

import spmd
import spmd.fft
from spmd import Layout, P
from spmd.testing import check_adjoint

pytestmark = pytest.mark.gloo

CASES_2 = [  # (transform, global shape, spec, sizes, n or s, dim, norm)
    ("rfft2", (1, 2, 7, 6), (None, None, "sp"), {2: [6, 1]}, None, None, "ortho"),
    ("irfft2", (1, 2, 7, 4), (None, None, "sp"), None, (7, 5), None, None),
    ("fftn", (3, 13), (None, "sp"), None, (2, 17), None, "forward"),
    ("rfft", (1, 5), (None, "sp"), {1: [0, 5]}, 8, -1, None),       # an empty shard
    ("ifft", (3,), ("sp",), None, None, 0, None),                   # a 1-d tensor
]


def _cases(mesh, cases):
    for name, shape, spec, sizes, ns, dim, norm in cases:
        check_case(name, mesh, Layout(shape, P(*spec), mesh, sizes), ns, dim, norm)
    return True


def test_transforms_match_torch_fft_on_gloo_world_2(gloo2):
    assert gloo2.run(_cases, (2,), ("sp",), args=(CASES_2,)) == [True, True]


def _slab_round_trip(mesh):
    """A slab rfft2 and its inverse on this rank: one all_to_all each way per transform,
    the values back, and backward the adjoint."""
    lay = Layout((1, 3, 8, 6), P(None, None, "sp"), mesh)
    freq = spmd.fft.rfft2.output_layout(lay)
    x = lay.shard(torch.randn(lay.shape, generator=torch.Generator().manual_seed(0),
                              dtype=torch.float64), mesh.rank).clone().requires_grad_()
    with spmd.comm_stats() as stats:
        y = spmd.fft.rfft2(x, mesh=mesh, spec=lay)
        z = spmd.fft.irfft2(y, s=(8, 6), mesh=mesh, spec=freq)
        (z * torch.arange(z.numel()).view(z.shape)).sum().backward()
    calls = [stats.calls("fft transpose", pass_=p) for p in ("forward", "backward")]
    # the inverse sends back what the forward sent: the bytes of half the half-spectrum
    half = 3 * 4 * (freq.shape[3] - freq.sizes[3][mesh.rank]) * 16
    check_adjoint(lambda t: torch.view_as_real(spmd.fft.rfft2(t, mesh=mesh, spec=lay)),
                  mesh, lambda r: torch.randn(lay.local_shape(r), dtype=torch.float64))
    return (calls, stats.calls(), stats.bytes("fft transpose", pass_="forward") == 2 * half,
            torch.allclose(z, x), z.shape == x.shape)


def test_slab_moves_once_each_way_on_gloo_world_2(gloo2):
    got = gloo2.run(_slab_round_trip, (2,), ("sp",))
    assert got == [([2, 2], 4, True, True, True)] * 2


def _pencil(mesh):
    lay = Layout((2, 5, 6, 7), P(None, "x", "y"), mesh, {1: [4, 1]})
    check_case("rfftn", mesh, lay, None, (1, 2, 3), "ortho")
    x = lay.shard(torch.randn(lay.shape, dtype=torch.float64), mesh.rank).requires_grad_()
    with spmd.comm_stats() as stats:
        y = spmd.fft.rfftn(x, dim=(1, 2, 3), mesh=mesh, spec=lay)
        torch.view_as_real(y).sum().backward()
    return [stats.calls("fft transpose", axes=a, pass_=p) for a in ("x", "y")
            for p in ("forward", "backward")]


def test_pencil_moves_twice_each_way_on_gloo_world_4(gloo4):
    assert gloo4.run(_pencil, (2, 2), ("x", "y")) == [[1, 1, 1, 1]] * 4
