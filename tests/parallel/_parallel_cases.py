"""Per-rank training programs for GradSync and their single-device references.

Shared by tests/parallel/test_grad_sync.py (threads backend, through ``spmd.launch``) and
tests/parallel/test_grad_sync_gloo.py (the gloo pools): module-level, so spawned processes can
import them. Models are built by the caller (one process, one RNG) and passed in; every
rank trains its own ``copy.deepcopy``.

The per-rank loss is each rank's *local contribution* (docs/design.md): a data axis ``dp``
splits the batch (every dp rank averages its own part: GradSync's op ``"mean"``), a
domain axis ``sp`` splits each sample (points of the MLP, rows of the CNN's images: each
sp rank holds a part of the sample's loss: op ``"sum"``). Where the loss is replicated
over ``sp`` (the CNN's head, after a psum of pooled features), each sp rank contributes
``loss / |sp|``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd import P

F64 = torch.float64


class MLP(nn.Module):
    """Pointwise MLP on (batch, points, 6); ``reverse`` defines the layers in the
    reverse of the order forward uses them."""

    def __init__(self, reverse: bool = False, width: int = 8):
        super().__init__()
        dims = [(6, width), (width, width), (width, 3)]
        names = ["l0", "l1", "l2"]
        order = list(zip(names, dims))
        for n, (i, o) in (reversed(order) if reverse else order):
            setattr(self, n, nn.Linear(i, o))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


class CNN(nn.Module):
    """Two 3x3 convolutions and a head on pooled features."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.conv2 = nn.Conv2d(4, 2, 3)
        self.head = nn.Linear(2, 3)


class Mixed(nn.Module):
    """fp32, bf16 and fp16 layers in one model (and one float64 one)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 8).to(torch.float16)
        self.d = nn.Linear(8, 3).to(F64)

    def forward(self, x):  # each layer in its own dtype (all float64 after .double())
        for layer in (self.a, self.b, self.c):
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return self.d(x.to(self.d.weight.dtype)).double()


def make(kind: str, seed: int, batch: int = 4, points: int = 5, hw: tuple = (7, 5)):
    """(model, X, Y) in float64 (Mixed: the model in its own dtypes)."""
    torch.manual_seed(seed)
    if kind in ("mlp", "mlp_reverse"):
        model = MLP(reverse=kind == "mlp_reverse").double()
        x = torch.randn(batch, points, 6, dtype=F64)
        y = torch.randn(batch, points, 3, dtype=F64)
    elif kind == "cnn":
        model = CNN().double()
        x = torch.randn(batch, 2, *hw, dtype=F64)
        y = (torch.randn(batch, 2, *hw, dtype=F64), torch.randn(batch, 3, dtype=F64))
    elif kind == "mixed":
        model = Mixed()
        x = torch.randn(batch, points, 6, dtype=F64)
        y = torch.randn(batch, points, 3, dtype=F64)
    else:
        raise ValueError(kind)
    return model, x, y


# -- the loss: one function for the per-rank run and the single device -----------------------

def _conv(x, w, b, mesh, sizes):
    if mesh is None:
        return F.conv2d(x, w, b, padding=1)
    if "sp" in mesh.axis_names:
        x = spmd.halo_pad(x, mesh, "sp", 2, (1, 1), sizes=sizes)
    else:
        x = F.pad(x, (0, 0, 1, 1))
    return F.conv2d(x, w, b, padding=(0, 1))


def loss(model, kind, x, y, *, mesh=None, batch=None, sizes=None):
    """The local loss: the global mean on one device (``mesh=None``); on a rank, its
    contribution (``batch``: the dp rank's batch; ``sizes``: rows per sp rank)."""
    sp = mesh.axis_size("sp") if mesh is not None and "sp" in mesh.axis_names else 1
    b = x.shape[0] if batch is None else batch
    if kind in ("mlp", "mlp_reverse", "mixed"):
        n = x.shape[1] * sp if sizes is None else sum(sizes)
        return ((model(x) - y) ** 2).sum() / (b * n * 3)
    t, yh = y
    h = torch.tanh(_conv(x, model.conv1.weight, model.conv1.bias, mesh, sizes))
    o = _conv(h, model.conv2.weight, model.conv2.bias, mesh, sizes)
    rows = x.shape[2] if sizes is None else sum(sizes)
    pix = ((o - t) ** 2).sum() / (b * 2 * rows * x.shape[3])
    feat = o.sum((2, 3))
    if sp > 1:
        feat = spmd.psum(feat, "sp")
    head = model.head(feat / (rows * x.shape[3]))
    return pix + ((head - yh) ** 2).sum() / (b * 3) / sp


def _shard(mesh, kind, x, y):
    """This rank's part: batch over dp, points (MLP) or rows (CNN) over sp."""
    dp = "dp" if "dp" in mesh.axis_names else None
    sp = "sp" if "sp" in mesh.axis_names else None
    spec = P(dp, sp) if kind != "cnn" else P(dp, None, sp)
    lay = spmd.Layout(x.shape, spec, mesh)
    r = mesh.rank
    xs = lay.shard(x, r)
    dim = 1 if kind != "cnn" else 2
    sizes = list(lay.sizes[dim]) if sp else None
    if kind == "cnn":
        t, yh = y
        ys = (spmd.Layout(t.shape, spec, mesh).shard(t, r),
              spmd.Layout(yh.shape, P(dp), mesh).shard(yh, r))
    else:
        ys = spmd.Layout(y.shape, spec, mesh).shard(y, r)
    return xs, ys, sizes


def _micro(t, k, i):
    if isinstance(t, tuple):
        return tuple(_micro(u, k, i) for u in t)
    return t.chunk(k)[i]


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


# -- per-rank training ------------------------------------------------------------------------

def train(mesh, model, x, y, kind, axes, opt, steps, cfg=None):
    """Per-rank: ``steps`` optimizer steps with GradSync; returns the parameters, the
    bucket plans (dtype, names) before and after the first step, and whether a bucket
    had started before the end of backward, in the last step (overlap)."""
    cfg = dict(cfg or {})
    micro = cfg.pop("micro", 1)
    zero = cfg.pop("zero", "optimizer")
    # a model, copied; or a function that builds this rank's own (per-rank seeding)
    model = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    sync = spmd.parallel.GradSync(model, mesh, axes, **cfg)
    o = _optimizer(opt, model.parameters())
    sync.attach(o)
    xs, ys, sizes = _shard(mesh, kind, x, y)
    plans = [[(str(b.dtype), b.names) for b in sync.buckets]]
    started = None
    for _ in range(steps):
        if zero == "sync":
            sync.zero_grad()
        else:
            o.zero_grad(set_to_none=zero == "optimizer")
        b = xs.shape[0]
        with sync.no_sync():
            for i in range(micro - 1):
                (loss(model, kind, _micro(xs, micro, i), _micro(ys, micro, i), mesh=mesh,
                      batch=b, sizes=sizes)).backward()
        loss(model, kind, _micro(xs, micro, micro - 1), _micro(ys, micro, micro - 1),
             mesh=mesh, batch=b, sizes=sizes).backward()
        started = sync.overlapped > 0
        o.step()
        if len(plans) == 1:
            plans.append([(str(b.dtype), b.names) for b in sync.buckets])
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return [p.detach() for p in model.parameters()], grads, plans, started


def seeded_mlp(seed: int = 3) -> nn.Module:
    """An MLP built after seeding this rank's generator, as a per-rank script does."""
    spmd.manual_seed(seed)
    return MLP().double()


def train_single(model, x, y, kind, opt, steps):
    """The same steps on one device, on the global batch."""
    model = copy.deepcopy(model)
    o = _optimizer(opt, model.parameters())
    for _ in range(steps):
        o.zero_grad()
        loss(model, kind, x, y).backward()
        o.step()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return [p.detach() for p in model.parameters()], grads


def check_train(got, want, tol):
    params, grads = want
    for r, (ps, gs, _, _) in enumerate(got):
        for i, (p, q) in enumerate(zip(ps, params)):
            torch.testing.assert_close(p, q, **tol, msg=f"parameter {i}, rank {r}")
            assert torch.equal(p, got[0][0][i]), f"parameter {i} differs on rank {r}"
        for i, (g, h) in enumerate(zip(gs, grads)):
            torch.testing.assert_close(g, h, **tol, msg=f"grad {i}, rank {r}")


# -- unused parameters -------------------------------------------------------------------------

class Partly(nn.Module):
    """``used`` always; ``only0`` on rank 0 only; ``never`` on no rank."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(3, 2).double()
        self.only0 = nn.Linear(3, 2).double()
        self.never = nn.Linear(3, 2).double()


def unused(mesh, model, x, cfg):
    """Per-rank: two Adam steps where ``only0`` is used by rank 0 and ``never`` by none;
    returns the parameters and the gradients after the last step."""
    model = copy.deepcopy(model)
    sync = spmd.parallel.GradSync(model, mesh, {"dp": "mean"}, **cfg)
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    sync.attach(o)
    xs = x.chunk(mesh.size)[mesh.rank]
    for _ in range(2):
        o.zero_grad()
        out = model.used(xs).sum()
        if mesh.rank == 0:
            out = out + model.only0(xs).pow(2).sum()
        (out / xs.shape[0]).backward()
        o.step()
    return ([p.detach() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()])


def unused_single(model, x, world):
    model = copy.deepcopy(model)
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        o.zero_grad()
        loss = 0
        for r, xs in enumerate(x.chunk(world)):
            out = model.used(xs).sum()
            if r == 0:
                out = out + model.only0(xs).pow(2).sum()
            loss = loss + out / xs.shape[0] / world
        loss.backward()
        o.step()
    return ([p.detach() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()])


def check_unused(got, model, x, world, tol):
    """Every rank's parameters and gradients equal ``unused_single``'s: ``only0`` (used
    by rank 0 only) gets the reduced gradient everywhere, ``never`` keeps grad None."""
    want_p, want_g = unused_single(model, x, world)
    names = [n for n, _ in model.named_parameters()]
    for params, grads in got:
        for n, p, q, g, h in zip(names, params, want_p, grads, want_g):
            torch.testing.assert_close(p, q, **tol, msg=n)
            if n.startswith("never"):
                assert g is None and h is None, n
            else:
                torch.testing.assert_close(g, h, **tol, msg=n)


# -- start-up -----------------------------------------------------------------------------------

def startup(mesh, init, seed_by_rank, shape_by_rank=False):
    """Per-rank: a model built from a per-rank seed (or shape); GradSync with ``init``;
    returns the parameters and buffers, or the error message."""
    width = 4 + mesh.rank if shape_by_rank else 4
    spmd.manual_seed(mesh.rank if seed_by_rank else 0)  # this rank's own generator
    model = nn.Sequential(nn.Linear(3, width), nn.BatchNorm1d(width), nn.Linear(width, 2))
    model[1].running_mean.add_(mesh.rank if seed_by_rank else 0)
    try:
        spmd.parallel.GradSync(model, mesh, {"dp": "mean"}, init=init)
    except spmd.SpecError as e:
        return str(e)
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


# -- parameters used on some ranks, in some iterations, around other collectives ------------

class Heads(nn.Module):
    """A trunk every rank uses and ``k`` heads each used by a schedule of (iteration,
    dp index); defined trunk first, so the first plan (reverse definition order) puts the
    heads' buckets first: the ones a rank that uses no head cannot start early."""

    def __init__(self, k: int = 2):
        super().__init__()
        self.trunk = nn.Linear(3, 4).double()
        self.heads = nn.ModuleList([nn.Linear(4, 1).double() for _ in range(k)])


def heads_loss(model, xs, used, *, stat=None):
    """One dp rank's loss: a trunk, the heads in ``used``; with ``stat`` (a function that
    sums over the data-parallel ranks: ``spmd.psum`` per rank, the identity on one
    device), a batch statistic whose backward is a collective over the same ranks."""
    h = torch.tanh(model.trunk(xs))
    out = (h ** 2).sum()
    if stat is not None:
        s = stat(h.sum(0))  # the psum'd batch statistic: psum's backward is a psum
        out = out + (h * s).sum() / 10
    for k in used:
        out = out + model.heads[k](h).pow(2).sum()
    return out / xs.shape[0]


def heads_train(mesh, model, x, schedule, psum_in_backward, cfg, steps=3):
    """Per-rank: the "ordinary loop" (backward, log the global loss with ``spmd.pmean``,
    ``optimizer.step()``) with GradSync over "dp" (mean) attached to SGD.
    ``schedule(it, dp)`` is the set of heads the dp rank uses in iteration ``it``.
    The batch is split over "dp" and the same on every rank of the other axes.
    Returns the logged losses, the parameters and the overlap of each iteration."""
    model = copy.deepcopy(model)
    sync = spmd.parallel.GradSync(model, mesh, {"dp": "mean"}, **cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync.attach(opt)
    dp = mesh.axis_index("dp")
    xs = x.chunk(mesh.axis_size("dp"))[dp]
    stat = (lambda t: spmd.psum(t, "dp")) if psum_in_backward else None
    logged, overlap = [], []
    for it in range(steps):
        opt.zero_grad()
        loss = heads_loss(model, xs, schedule(it, dp), stat=stat)
        loss.backward()
        logged.append(spmd.pmean(loss.detach(), "dp").item())
        overlap.append(sync.overlapped)
        opt.step()
    return logged, [p.detach().clone() for p in model.parameters()], overlap


def heads_single(model, x, world, schedule, psum_in_backward, steps=3):
    """The same training on one device: the mean of the dp ranks' losses."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = x.chunk(world)
    logged = []
    for it in range(steps):
        opt.zero_grad()
        stat = None
        if psum_in_backward:
            total = sum(torch.tanh(model.trunk(xs)).sum(0) for xs in parts)
            stat = lambda t, total=total: total  # noqa: E731 - every rank sees the sum
        loss = sum(heads_loss(model, xs, schedule(it, r), stat=stat)
                   for r, xs in enumerate(parts)) / world
        loss.backward()
        logged.append(loss.item())
        opt.step()
    return logged, [p.detach().clone() for p in model.parameters()]


def check_heads(got, want, tol):
    logged, params = want
    for r, (lg, ps, _) in enumerate(got):
        torch.testing.assert_close(torch.tensor(lg), torch.tensor(logged), **tol,
                                   msg=f"logged losses on rank {r}")
        for i, (p, q) in enumerate(zip(ps, params)):
            torch.testing.assert_close(p, q, **tol, msg=f"parameter {i}, rank {r}")
            assert torch.equal(p, got[0][1][i]), f"parameter {i} differs on rank {r}"


def only_dp0(it, dp):
    """Head 0 on the first dp rank only, every iteration; head 1 on no rank."""
    return [0] if dp == 0 else []


def shifting(it, dp):
    """No head in the first (order-learning) iteration; then head 0 on dp rank 0 and
    head 1 on the last dp rank, swapping every iteration."""
    if it == 0:
        return []
    return [(it + dp) % 2] if dp in (0, 1) else []


# -- a parameter that varies over the domain axis ---------------------------------------------

class Field(nn.Module):
    """A replicated layer and a per-point bias ``pos`` of shape (points, 3), split over
    "sp" in the per-rank program (each rank holds its points' rows)."""

    def __init__(self, points: int):
        super().__init__()
        self.lin = nn.Linear(6, 3).double()
        self.pos = nn.Parameter(torch.randn(points, 3, dtype=F64))


def field_loss(model, x, y, batch, points):
    return ((model.lin(x) + model.pos - y) ** 2).sum() / (batch * points * 3)


def field_train(mesh, model, x, y, init_seed, steps=2):
    """Per-rank on ("dp", "sp"): ``lin`` built from a per-rank seed (init="broadcast"
    must make it rank 0's), ``pos`` holding this sp rank's rows of the global field
    (varying over "sp"); GradSync {"dp": "mean", "sp": "sum"}; SGD steps."""
    model = copy.deepcopy(model)
    lay = spmd.Layout(model.pos.shape, P("sp"), mesh)
    spmd.manual_seed(init_seed + mesh.rank)
    model.lin = nn.Linear(6, 3).double()
    model.pos = nn.Parameter(lay.shard(model.pos.detach(), mesh.rank).clone())
    sync = spmd.parallel.GradSync(model, mesh, {"dp": "mean", "sp": "sum"},
                                  varying={"pos": "sp"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync.attach(opt)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    xl = spmd.Layout(x.shape, P("dp", "sp"), mesh).shard(x, mesh.rank)
    yl = spmd.Layout(y.shape, P("dp", "sp"), mesh).shard(y, mesh.rank)
    for _ in range(steps):
        opt.zero_grad()
        field_loss(model, xl, yl, xl.shape[0], x.shape[1]).backward()
        opt.step()
    return start, {n: p.detach().clone() for n, p in model.named_parameters()}, sync.buckets


def field_single(model, lin, x, y, steps=2):
    model = copy.deepcopy(model)
    model.lin = copy.deepcopy(lin)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        field_loss(model, x, y, x.shape[0], x.shape[1]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- start-up over the whole mesh ---------------------------------------------------------------

def startup_2d(mesh, init, by):
    """Per-rank on ("dp", "sp"): weights from a seed that differs over ``by`` ("sp" or
    "dp"); GradSync over "dp" only. Returns the weights after construction, or the error."""
    spmd.manual_seed(mesh.axis_index(by))
    model = nn.Linear(3, 2)
    try:
        spmd.parallel.GradSync(model, mesh, {"dp": "mean"}, init=init)
    except spmd.SpecError as e:
        return str(e)
    return [p.detach().clone() for p in model.parameters()]


def change_after_wrapping(mesh, change, on_ranks):
    """One clean step, then ``change`` applied to the model on ``on_ranks``; the next
    backward's error (or None) and whether the second step left per-rank gradients."""
    spmd.manual_seed(0)
    model = nn.Linear(3, 2)
    sync = spmd.parallel.GradSync(model, mesh, "dp")
    x = torch.full((1, 3), float(mesh.rank + 1))
    model(x).sum().backward()
    sync.wait()
    model.zero_grad()
    if mesh.rank in on_ranks:
        if change == "added":
            model.extra = nn.Parameter(torch.ones(2))
        elif change == "off":
            model.bias.requires_grad_(False)
        elif change == "reshaped":
            model.bias.data = torch.zeros(1)  # broadcasts in F.linear
    out = model(x)
    if change == "added" and mesh.rank in on_ranks:
        out = out * model.extra
    try:
        out[..., :2].sum().backward()
        sync.wait()
    except spmd.SpecError as e:
        return str(e)
    return None


def different_plans(mesh, how):
    """Per-rank: GradSync over a model whose bucket plan differs on rank 1 (``how``:
    a parameter that does not require grad there, or another bucket cap); the error."""
    spmd.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    kw = {}
    if how == "requires_grad" and mesh.rank == 1:
        model[0].bias.requires_grad_(False)
    elif how == "cap":
        kw = dict(bucket_cap_mb=1e-5 if mesh.rank == 1 else 1.0)
    try:
        spmd.parallel.GradSync(model, mesh, "dp", **kw)
    except spmd.SpecError as e:
        return str(e)
