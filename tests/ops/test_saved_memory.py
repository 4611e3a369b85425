"""Per rank, the halo'd ops keep for backward what one device keeps divided by P plus the
halo rows: never a padded copy of the input (docs/design.md, "Memory"). And the backward that
rebuilds the window from those tensors is exact at any order.

Saved bytes are counted with ``torch.autograd.graph.saved_tensors_hooks``, installed inside
the shard_map body (hooks are thread-local and each rank is a thread), as the bytes of the
unique storages autograd saves, keyed by ``(untyped_storage().data_ptr(), nbytes)``: a
tensor saved twice (a ReLU's output is also the next conv's input) counts once, and a view
counts its whole storage. So each rank's input is its own copy (a shard_map argument is a
view of the global tensor).

The bound, per rank: ``(one device's saved bytes - params) / P + params + halo``. Params
(weights) are replicated, so every rank keeps them whole. ``halo`` is computed from each
op's geometry: the rows (and on a 2-D split, columns) of the global input that the
rank's output rows read, inside the global input (zero padding is a constant, not data),
minus its own shard, times the bytes of one row. The shards are even, so one device's
bytes divide by P exactly; all of it is deterministic (no timing).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import Layout, P
from spmd.testing.memory import SavedBytes


def _one_device(f: Callable, x: torch.Tensor) -> int:
    with SavedBytes() as s:
        f(x.clone().requires_grad_())
    return s.total


def _per_rank(f: Callable, x: torch.Tensor, mesh: spmd.Mesh, spec: P) -> list[int]:
    """Each rank's saved bytes for ``f(shard, layout)``, in rank order."""
    lay = Layout(x.shape, spec, mesh)

    def body(xl):
        xl = xl.clone().requires_grad_()  # its own storage, as a rank's data would be
        with SavedBytes() as s:
            f(xl, lay)
        return torch.tensor([s.total])

    axes = tuple(mesh.axis_names)
    got = spmd.shard_map(body, mesh, spec, P(axes if len(axes) > 1 else axes[0]))(x)
    return got.tolist()


# -- the halo each rank reads, from the ops' geometry -------------------------------------------

def _window(window: Callable[[int, int], tuple[int, int]], out_sizes, k: int) -> tuple[int, int]:
    """Member k's input range: what its output rows ``[o0, o1)`` read."""
    o0 = sum(out_sizes[:k])
    return window(o0, o0 + out_sizes[k]) if out_sizes[k] else (0, 0)


def _strided(k: int, s: int = 1, p: int = 0, d: int = 1):
    """Conv and pool windows: output rows [o0, o1) read [s*o0 - p, s*(o1-1) + d*(k-1) + 1 - p)."""
    return lambda o0, o1: (s * o0 - p, s * (o1 - 1) + d * (k - 1) + 1 - p)


def _transposed(k: int, s: int, p: int):
    """conv_transpose: output o takes input i through tap j where o = s*i - p + j."""
    return lambda o0, o1: (-(-(o0 + p - (k - 1)) // s), (o1 - 1 + p) // s + 1)


def _adaptive(L: int, M: int):
    return lambda o0, o1: (o0 * L // M, -(-o1 * L // M))


def _bilinear_x2(L: int):
    """align_corners=False, scale 2: output o reads floor(max((o + 0.5)/2 - 0.5, 0)) and
    the row after it."""
    i0 = lambda o: math.floor(max((o + 0.5) / 2 - 0.5, 0.0))
    return lambda o0, o1: (i0(o0), min(i0(o1 - 1) + 1, L - 1) + 1)


def _halo(lay: Layout, out: Layout, windows: dict[int, Callable], rank: int,
          itemsize: int) -> int:
    """The bytes this rank receives: along each split dim, the input rows its window reads
    inside the global input and outside its shard (zero padding is a constant, filled
    here). Dims are fetched in order, so a later dim's halo spans the earlier dims'
    whole windows (their halos: the corners, and their padding)."""
    shape = list(lay.local_shape(rank))
    total = 0
    for dim, window in windows.items():
        k = lay.shard_index(rank, dim)
        a, b = _window(window, out.sizes[dim], k)
        start = sum(lay.sizes[dim][:k])
        inside = max(min(b, lay.shape[dim]) - max(a, 0), 0)
        own = max(min(b, start + shape[dim]) - max(a, start), 0)
        row = math.prod(v for d, v in enumerate(shape) if d != dim)
        total += (inside - own) * row * itemsize
        shape[dim] = max(b - a, 0)
    return total


# -- one op at a time ---------------------------------------------------------------------------

def _w(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


W1, W2, W3, WT = _w(4, 4, 3, seed=0), _w(4, 4, 3, 3, seed=1), _w(4, 4, 3, 3, 3, seed=2), \
    _w(4, 4, 2, 2, seed=3)


@dataclass(frozen=True)
class Case:
    """An op: ``op(x, *args, mesh=, spec=)`` against ``ref(x, *args)``; ``params`` are
    the tensors among ``args``; ``window(L)`` gives, for a spatial dim of length L, the
    input rows that output rows ``[o0, o1)`` read."""
    op: Callable
    ref: Callable
    args: tuple
    window: Callable
    n: int
    layout_args: tuple = ()

    def out(self, lay: Layout) -> Layout:
        return self.op.output_layout(lay, *(self.layout_args or self.args))

    @property
    def params(self) -> list[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]


OPS = {
    "conv1d": Case(spmd.ops.conv1d, F.conv1d, (W1, None, 1, 1), lambda L: _strided(3, p=1), 1,
                   (W1.shape, 1, 1)),
    "conv2d": Case(spmd.ops.conv2d, F.conv2d, (W2, None, 1, 1), lambda L: _strided(3, p=1), 2,
                   (W2.shape, 1, 1)),
    "conv2d_strided": Case(spmd.ops.conv2d, F.conv2d, (W2, None, 2, 1),
                           lambda L: _strided(3, 2, 1), 2, (W2.shape, 2, 1)),
    "conv3d": Case(spmd.ops.conv3d, F.conv3d, (W3, None, 1, 1), lambda L: _strided(3, p=1), 3,
                   (W3.shape, 1, 1)),
    "conv_transpose2d": Case(spmd.ops.conv_transpose2d, F.conv_transpose2d, (WT, None, 2),
                             lambda L: _transposed(2, 2, 0), 2, (WT.shape, 2)),
    "max_pool2d": Case(spmd.ops.max_pool2d, F.max_pool2d, (3, 1, 1), lambda L: _strided(3, p=1), 2),
    "avg_pool2d": Case(spmd.ops.avg_pool2d, F.avg_pool2d, (3, 2, 1), lambda L: _strided(3, 2, 1),
                       2),
    "adaptive_max_pool2d": Case(spmd.ops.adaptive_max_pool2d, F.adaptive_max_pool2d, (5,),
                                lambda L: _adaptive(L, 5), 2),
    "adaptive_avg_pool2d": Case(spmd.ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, (5,),
                                lambda L: _adaptive(L, 5), 2),
    "interpolate": Case(spmd.ops.interpolate, F.interpolate, (None, 2, "bilinear"), _bilinear_x2,
                        2),
}
MESHES = {"sp2": ((2,), ("sp",)), "sp4": ((4,), ("sp",)), "2x2": ((2, 2), ("x", "y"))}


def _setup(mesh_kind: str, n: int, **mesh_kw) -> tuple[torch.Tensor, spmd.Mesh, P, Layout]:
    """An input with ``n`` spatial dims, the mesh, and a spec splitting the first spatial
    dim (the first two on the 2x2 mesh), each 32 long."""
    mesh = spmd.Mesh(*MESHES[mesh_kind], **mesh_kw)
    names = mesh.axis_names
    x = torch.randn(1, 4, *([32] * len(names)), *([8] * (n - len(names))),
                    generator=torch.Generator().manual_seed(5))
    spec = P(None, None, *names)
    return x, mesh, spec, Layout(x.shape, spec, mesh)


def _check(local: Callable, one: Callable, x: torch.Tensor, mesh: spmd.Mesh, spec: P,
           params: list, halo: Callable[[int], int]) -> None:
    one_bytes = _one_device(one, x)
    p = sum(t.nbytes for t in params)
    bound = [(one_bytes - p) // mesh.size + p + halo(r) for r in range(mesh.size)]
    got = _per_rank(local, x, mesh, spec)
    assert all(g <= b for g, b in zip(got, bound)), (
        f"saved bytes per rank {got} exceed one device's {one_bytes} / {mesh.size} plus "
        f"params {p} and the halo: {bound}")


@pytest.mark.parametrize("mesh_kind", list(MESHES))
@pytest.mark.parametrize("name", list(OPS))
def test_op_saves_its_shard_and_halo_only(name, mesh_kind):
    c = OPS[name]
    if mesh_kind == "2x2" and c.n == 1:
        pytest.skip("one spatial dim")
    x, mesh, spec, lay = _setup(mesh_kind, c.n)
    out = c.out(lay)
    windows = {d: c.window(x.shape[d]) for d in lay.split_dims}
    _check(lambda xl, lay: c.op(xl, *c.args, mesh=mesh, spec=lay), lambda x: c.ref(x, *c.args),
           x, mesh, spec, c.params,
           lambda r: _halo(lay, out, windows, r, x.element_size()))


# -- a small U-Net ------------------------------------------------------------------------------

WA, WB, WC = _w(4, 4, 3, 3, seed=4), _w(4, 4, 3, 3, seed=5), _w(4, 8, 3, 3, seed=6)


def _unet(x: torch.Tensor, conv: Callable, pool: Callable, upsample: Callable):
    """conv+relu, max pool, conv+relu, upsample (interpolate or conv_transpose), the skip
    connection (channels concatenated), conv."""
    h = conv(x, WA).relu()
    d = conv(pool(h), WB).relu()
    return conv(torch.cat([upsample(d), h], 1), WC)


def _unet_local(x: torch.Tensor, up: str, mesh: spmd.Mesh, spec: P) -> torch.Tensor:
    ops = spmd.ops
    return _unet(
        x, lambda t, w: ops.conv2d(t, w, padding=1, mesh=mesh, spec=spec),
        lambda t: ops.max_pool2d(t, 2, mesh=mesh, spec=spec),
        lambda t: (ops.interpolate(t, scale_factor=2, mode="bilinear", mesh=mesh, spec=spec)
                   if up == "interpolate" else ops.conv_transpose2d(t, WT, stride=2, mesh=mesh,
                                                                    spec=spec)))


def _unet_ref(x: torch.Tensor, up: str) -> torch.Tensor:
    return _unet(x, lambda t, w: F.conv2d(t, w, padding=1), lambda t: F.max_pool2d(t, 2),
                 lambda t: (F.interpolate(t, scale_factor=2, mode="bilinear")
                            if up == "interpolate" else F.conv_transpose2d(t, WT, stride=2)))


def _unet_halo(lay: Layout, mesh: spmd.Mesh, up: str, rank: int, itemsize: int) -> int:
    """The halos of the five windowed ops, each on its input's layout."""
    ops, total = spmd.ops, 0

    def op_halo(in_lay: Layout, out_lay: Layout, window: Callable) -> int:
        return _halo(in_lay, out_lay, {d: window(in_lay.shape[d]) for d in in_lay.split_dims},
                     rank, itemsize)
    h = ops.conv2d.output_layout(lay, WA.shape, 1, 1)
    p = ops.max_pool2d.output_layout(h, 2)
    d = ops.conv2d.output_layout(p, WB.shape, 1, 1)
    if up == "interpolate":
        u, up_window = ops.interpolate.output_layout(d, None, 2, "bilinear"), _bilinear_x2
    else:
        u, up_window = ops.conv_transpose2d.output_layout(d, WT.shape, 2), \
            lambda L: _transposed(2, 2, 0)
    cat = Layout((h.shape[0], 8, *h.shape[2:]), h.spec, mesh,  # the skip connection's
                 {dim: h.sizes[dim] for dim in h.split_dims})
    for in_lay, out_lay, window in [(lay, h, lambda L: _strided(3, p=1)),
                                    (h, p, lambda L: _strided(2, 2)),
                                    (p, d, lambda L: _strided(3, p=1)),
                                    (d, u, up_window),
                                    (cat, ops.conv2d.output_layout(cat, WC.shape, 1, 1),
                                     lambda L: _strided(3, p=1))]:
        total += op_halo(in_lay, out_lay, window)
    return total


@pytest.mark.parametrize("mesh_kind", list(MESHES))
@pytest.mark.parametrize("up", ["interpolate", "conv_transpose"])
def test_unet_saves_what_one_device_saves_over_p(up, mesh_kind):
    x, mesh, spec, lay = _setup(mesh_kind, 2)
    params = [WA, WB, WC] + ([WT] if up == "conv_transpose" else [])
    _check(lambda xl, lay: _unet_local(xl, up, mesh, spec), lambda x: _unet_ref(x, up), x, mesh,
           spec, params, lambda r: _unet_halo(lay, mesh, up, r, x.element_size()))


# -- the rebuilt backward is exact at any order --------------------------------------------------

@pytest.mark.parametrize("mesh_kind", ["sp3_uneven", "2x2"])
@pytest.mark.parametrize("name", [n for n in OPS if OPS[n].n == 2])
def test_double_backward_and_torch_func_match_one_device(name, mesh_kind):
    """With grad mode on in backward (create_graph=True, torch.func.grad) the backward
    runs through the differentiable fetch, whose backward is the transpose and vice
    versa: a Hessian-vector product and torch.func.grad equal one device's (float64),
    on uneven shards with an empty one too."""
    c = OPS[name]
    args = tuple(a.detach().double() if isinstance(a, torch.Tensor) else a for a in c.args)
    # a backward on each rank inside the body: a thread per rank (shard-map.md)
    if mesh_kind == "2x2":
        x, mesh, spec, lay = _setup("2x2", 2, schedule="threads")
    else:
        mesh, spec = spmd.Mesh((3,), ("sp",), schedule="threads"), P(None, None, "sp")
        x = torch.randn(1, 4, 32, 8, generator=torch.Generator().manual_seed(6))
        lay = Layout(x.shape, spec, mesh, {2: (12, 0, 20)})
    x = x.double()
    loss = lambda y: (y.tanh() ** 2).sum()

    def body(xl):
        xl = xl.detach().requires_grad_()
        f = lambda t: loss(c.op(t, *args, mesh=mesh, spec=lay))
        gx, = torch.autograd.grad(f(xl), xl, create_graph=True)
        hv, = torch.autograd.grad((gx ** 2).sum(), xl)
        return hv, torch.func.grad(f)(xl.detach())

    hv, g = spmd.shard_map(body, mesh, lay, (spec, spec))(x)
    xr = x.clone().requires_grad_()
    gr, = torch.autograd.grad(loss(c.ref(xr, *args)), xr, create_graph=True)
    hr, = torch.autograd.grad((gr ** 2).sum(), xr)
    torch.testing.assert_close(g, gr.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hv, hr, rtol=1e-10, atol=1e-10)


def test_halo_pad_double_backward_is_exact():
    """halo_pad's backward (the transpose) is differentiable, its backward the fetch."""
    mesh = spmd.Mesh((3,), ("sp",), schedule="threads")  # a backward inside the body
    x = torch.randn(9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    lay = Layout(x.shape, P("sp"), mesh, {0: (4, 0, 5)})

    def body(xl):
        xl = xl.detach().requires_grad_()
        y = spmd.halo_pad(xl, mesh, "sp", 0, (2, 1), mode="reflect")
        gx, = torch.autograd.grad((y ** 3).sum(), xl, create_graph=True)
        return torch.autograd.grad((gx ** 2).sum(), xl)[0]

    hv = spmd.shard_map(body, mesh, lay, P("sp"))(x)
    xr = x.clone().requires_grad_()
    full = F.pad(xr.T[None], (2, 1), mode="reflect")[0].T
    parts = [full[a:a + s + 3] for a, s in ((0, 4), (4, 0), (4, 5))]
    gr, = torch.autograd.grad(sum((p ** 3).sum() for p in parts), xr, create_graph=True)
    hr, = torch.autograd.grad((gr ** 2).sum(), xr)
    torch.testing.assert_close(hv, hr, rtol=1e-10, atol=1e-10)
