"""``shard_map`` over ``spmd.Sharded`` values: the locals go in, Sharded values come out
for outputs whose spec splits a dim, and gradients flow per rank; values and gradients
equal the global-tensor path and one device. On processes no global tensor is made:
the demo CNN and the U-Net train on blocks read from a file by a loader that refuses
anything but its rank's block.

float64 throughout; the Sharded and global paths run the same per-rank code, so their
values agree to an ulp or two (a sum over a view and over a copy may round apart), and
training matches one device to 1e-10 (sums reordered).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import Layout, P, Sharded, SpecError, demo

F64 = torch.float64


@st.composite
def cases(draw):
    """A 1-d or 2-d mesh, a 2-d tensor, a spec over some of its axes (the others
    replicate) or one dim over the product of both, uneven sizes (zeros included)."""
    mesh_shape = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (1, 3), (3, 2)]))
    names = ("a", "b")[:len(mesh_shape)]
    rows, cols = draw(st.integers(0, 9)), draw(st.integers(1, 5))
    if len(names) == 2 and draw(st.booleans()):
        entries = draw(st.permutations([names, None]))
    else:
        entries = draw(st.permutations([*names, None, None]))[:2]
    spec = P(*entries)
    mesh = spmd.Mesh(mesh_shape, names)
    probe = Layout((rows, cols), spec, mesh)
    sizes = {}
    for d in probe.split_dims:
        n = len(probe.sizes[d])
        cuts = sorted(draw(st.lists(st.integers(0, probe.shape[d]), min_size=n - 1,
                                    max_size=n - 1)))
        sizes[d] = [b - a for a, b in zip([0, *cuts], [*cuts, probe.shape[d]])]
    return mesh, Layout((rows, cols), spec, mesh, sizes or None), draw(st.integers(0, 2**16))


def _body(w, axes):
    def f(t):
        # a position-wise part, a collective, and a closed-over parameter
        total = spmd.psum(t.sum(), axes) if axes else t.sum()
        return torch.tanh(t * w) + total, spmd.psum((t ** 2).sum(), axes) if axes else (t ** 2).sum()
    return f


@given(cases())
def test_sharded_path_equals_global_path_values_and_gradients(case):
    mesh, lay, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(lay.shape, generator=g, dtype=F64)
    w = torch.randn((), generator=g, dtype=F64)
    cot = torch.randn(lay.shape, generator=g, dtype=F64)
    axes = tuple(mesh.axis_names)

    # The global path: global tensors in and out (all axes psum'd: a replicated scalar).
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    f = spmd.shard_map(_body(wg, axes), mesh, lay, (lay, P()))
    y, s = f(xg)
    ((y * cot).sum() + s).backward()

    # The Sharded path: the same per-rank code on each rank's own shard.
    ws = w.clone().requires_grad_()
    xs = Sharded({r: x[lay.slices(r)].clone().requires_grad_() for r in range(mesh.size)},
                 lay, mesh)
    fs = spmd.shard_map(_body(ws, axes), mesh, lay, (lay, P()))
    ys, ss = fs(xs)
    assert not isinstance(ss, Sharded)
    if not lay.split_dims:  # an output that splits no dim stays a global tensor
        assert not isinstance(ys, Sharded)
        torch.testing.assert_close(ys.detach(), y.detach(), rtol=1e-13, atol=1e-13)
        ((ys * cot).sum() + ss).backward()
    else:
        assert isinstance(ys, Sharded) and ys.layout == lay
        # The shards are copies here, views there: sums may round apart by an ulp.
        torch.testing.assert_close(spmd.gather(ys.detach(), mesh), y.detach(), rtol=1e-13,
                                   atol=1e-13)
        # Per-rank cotangents: a replicated output's copies each carry a part (here: the
        # global cotangent on the lowest replica, zero on the others), as in per-rank code.
        owners = lay.owners()
        parts = [(ys.shards[r] * (cot[lay.slices(r)] if owners[lay.shard_key(r)] == r
                                  else 0)).sum() for r in range(mesh.size)]
        (sum(parts) + ss).backward()
    torch.testing.assert_close(ss, s.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ws.grad, wg.grad, rtol=1e-12, atol=1e-12)
    # Each shard's gradient is its rank's; over replicas they add up to the global one.
    got = torch.zeros_like(x)
    for r in range(mesh.size):
        got[lay.slices(r)] += xs.shards[r].grad
    torch.testing.assert_close(got, xg.grad, rtol=1e-12, atol=1e-12)


def _per_rank_chain(mesh):
    """Two shard_maps joined by a Sharded value, on every rank's own block only."""
    x = torch.arange(24.0, dtype=F64).view(8, 3) / 10
    lay = Layout(x.shape, P("sp"), mesh, sizes={0: [5, 0, 3]})
    xs = Sharded.from_local(x[lay.slices(mesh.rank)].clone().requires_grad_(), mesh, lay)
    w = torch.tensor(0.7, dtype=F64, requires_grad=True)
    with spmd.comm_stats() as st:
        ys = spmd.shard_map(lambda t: torch.sin(t * w), mesh, P("sp"), P("sp"))(xs)
        loss = spmd.shard_map(lambda t: spmd.psum((t ** 3).sum(), "sp"), mesh, P("sp"), P())(ys)
        loss.backward()
    return (ys.layout == lay, tuple(ys.local.shape), loss.item(), w.grad.item(),
            xs.local.grad.tolist(), st.calls("shard_map output", rank=mesh.rank),
            st.calls("shard_map sizes", rank=mesh.rank))


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_per_rank_chain_keeps_local_shards_and_one_device_gradients(backend):
    got = spmd.launch(_per_rank_chain, (3,), ("sp",), backend=backend)
    x = (torch.arange(24.0, dtype=F64).view(8, 3) / 10).requires_grad_()
    w = torch.tensor(0.7, dtype=F64, requires_grad=True)
    loss = (torch.sin(x * w) ** 3).sum()
    loss.backward()
    rows = [(0, 5), (5, 5), (5, 8)]
    for r, g in enumerate(got):
        assert g[0] and g[1] == (rows[r][1] - rows[r][0], 3)
        assert g[2] == pytest.approx(loss.item(), rel=1e-13)
        assert g[3] == pytest.approx(w.grad.item(), rel=1e-12)
        torch.testing.assert_close(torch.tensor(g[4], dtype=F64).view(-1, 3),
                                   x.grad[rows[r][0]:rows[r][1]], rtol=1e-13, atol=1e-13)
        assert g[5] == 0  # no output was all-gathered: nothing global was made
        assert g[6] == 1  # one small exchange gave the first output's layout


def test_check_rep_on_a_sharded_output_names_the_replica_that_differs():
    mesh = spmd.Mesh((2, 2), ("dp", "sp"))
    xs = Sharded.from_global(torch.zeros(4, 2), mesh, P("sp"))
    f = spmd.shard_map(lambda t: t + spmd.axis_index("dp"), mesh, P("sp"), P("sp"),
                       check_rep=True)
    with pytest.raises(SpecError, match=r"claimed replicated over \['dp'\].*rank 2 differs"):
        f(xs)


def test_in_specs_must_describe_the_sharded_argument():
    mesh = spmd.Mesh((2,), ("sp",))
    xs = Sharded.from_global(torch.zeros(4, 2), mesh, P("sp"))
    f = spmd.shard_map(lambda t: t, mesh, P(None, "sp"), P(None, "sp"))
    with pytest.raises(SpecError, match=r"in_specs for args\[0\] is P\(None, 'sp'\) but the "
                                        r"argument is Sharded\(f32\[4, 2\], P\('sp'\).*"
                                        r"spmd.redistribute\(x, mesh, dst_spec="):
        f(xs)
    other = spmd.Mesh((2,), ("sp",))
    with pytest.raises(SpecError, match="another Mesh object"):
        spmd.shard_map(lambda t: t, other, P("sp"), P("sp"))(xs)
    part = Sharded({0: torch.zeros(2, 2)}, xs.layout, mesh)
    with pytest.raises(SpecError, match="holds no shard of rank 1"):
        spmd.shard_map(lambda t: t, mesh, P("sp"), P("sp"))(part)


def _disagreeing_layouts(mesh):
    """Each process builds its own Layout: rank 1 claims sizes [3, 3] while rank 0 says
    [4, 2]; rank 1's shard fits its own claim, and a halo'd op trusting the layouts
    would read the wrong rows."""
    sizes = [4, 2] if mesh.rank == 0 else [3, 3]
    lay = Layout((6, 2), P("sp"), mesh, sizes={0: sizes})
    xs = Sharded.from_local(torch.zeros(3 if mesh.rank else 4, 2), mesh, lay)
    try:
        spmd.shard_map(lambda t: t + 1, mesh, P("sp"), P("sp"))(xs)
    except SpecError as e:
        return str(e)


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_layouts_that_differ_between_processes_raise_on_every_rank(backend):
    got = spmd.launch(_disagreeing_layouts, (2,), ("sp",), backend=backend)
    for msg in got:
        assert msg is not None and "Sharded arguments are laid out differently on rank 0 and "             "rank 1" in msg and "every process must build the same Layout" in msg


def test_mixed_sharded_and_global_arguments():
    """A global argument is still split (and its gradient summed); a replicated output
    stays a global tensor, a split one becomes Sharded."""
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(5, 3, dtype=F64)
    b = torch.randn(5, 3, dtype=F64, requires_grad=True)
    xl = x.clone().requires_grad_()
    xs = Sharded.from_global(xl, mesh, P("sp"))  # views of xl: their gradients reach it
    y, m = spmd.shard_map(lambda t, u: (t * u, spmd.pmax(t.max(), "sp")), mesh,
                          (P("sp"), P("sp")), (P("sp"), P()))(xs, b)
    assert isinstance(y, Sharded) and isinstance(m, torch.Tensor)
    spmd.gather(y, mesh).sum().backward()
    torch.testing.assert_close(b.grad, x)
    torch.testing.assert_close(xl.grad, b.detach())


# -- the demo CNN and the U-Net on blocks read from a file ------------------------------------

class BlockLoader:
    """Reads a rank's block of a .npy file through a memmap; refuses anything larger, so a
    test fails if any process asks for more than its block."""

    def __init__(self, path, lay: Layout):
        self.field, self.lay = np.load(path, mmap_mode="r"), lay
        self.biggest = max(int(np.prod(lay.local_shape(r))) for r in range(
            int(np.prod(lay.mesh_shape))))

    def __call__(self, sl):
        n = int(np.prod([s.stop - s.start for s in sl]))
        if n > self.biggest:
            raise AssertionError(f"asked for {n} elements, more than a block ({self.biggest})")
        return self.field[sl]


def _files(tmp_path, x, t):
    """The data as .npy files, with their shapes: all a process needs to read a block."""
    out = []
    for name, v in (("x", x), ("t", t)):
        np.save(tmp_path / f"{name}.npy", v.numpy())
        out.append((str(tmp_path / f"{name}.npy"), tuple(v.shape)))
    return tuple(out)


def _load(mesh, files):
    lays = [Layout(shape, P(None, None, "sp"), mesh) for _, shape in files]
    return tuple(Sharded.load(BlockLoader(p, lay), mesh, lay) for (p, _), lay in zip(files, lays))


def _model(which):
    """The model both runs start from: the U-Net of the training tests or the demo CNN."""
    if which == "unet":
        from nn.test_unet import _model
        return _model()
    return demo.make_model(hidden=4, dtype=F64)


def _train_on_blocks(mesh, files, which):
    x, t = _load(mesh, files)
    return demo.train_sharded(_model(which), mesh, (x, t), steps=3, lr=0.05,
                              optimizer=torch.optim.SGD)


def _reference(which, shape):
    if which == "unet":
        from nn.test_unet import _data
        x, t = _data(shape)
    else:
        x, t = demo.heat_data(shape[0], shape[2], shape[3], dtype=F64)
    model = _model(which)
    return x, t, demo.train_single(model, (x, t), steps=3, lr=0.05, optimizer=torch.optim.SGD)


CASES = [("cnn", (2, 2, 11, 8)), ("unet", (2, 1, 14, 10))]


def _check(got, want):
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses),
                               rtol=1e-10, atol=1e-10)
    for k, p in want.params.items():
        torch.testing.assert_close(got.params[k], p, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("which, shape", CASES)
def test_trains_on_blocks_like_one_device_on_threads(tmp_path, which, shape):
    x, t, want = _reference(which, shape)
    mesh = spmd.Mesh((3,), ("sp",))
    got = _train_on_blocks(mesh, _files(tmp_path, x, t), which)
    _check(got, want)


@pytest.mark.gloo
@pytest.mark.parametrize("which, shape", CASES)
def test_trains_on_blocks_like_one_device_on_gloo_world_2(gloo2, tmp_path, which, shape):
    x, t, want = _reference(which, shape)
    got = gloo2.run(_train_on_blocks, (2,), ("sp",), args=(_files(tmp_path, x, t), which))
    for g in got:
        _check(g, want)
