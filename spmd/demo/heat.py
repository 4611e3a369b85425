"""A domain-parallel CNN that learns one step of 2-D heat diffusion: the pieces of
``python -m spmd demo``, for scripts and notebooks.

``heat_data`` makes smooth random fields and their state after one time step;
``make_model`` builds a small CNN with plain ``torch.nn``; ``train_single`` trains it
on one device and ``train_sharded`` trains a copy converted with ``spmd.nn.convert``,
every sample's rows split over the ``"sp"`` axis of a mesh. Both return a ``History``
(per-step losses, final parameters, seconds and bytes per step) to compare.

Example:
    >>> x, t = heat_data(batch=2, size=10, width=8, seed=0)
    >>> model = make_model(hidden=4, seed=0)
    >>> one = train_single(model, (x, t), steps=2)
    >>> sharded = train_sharded(model, spmd.Mesh((4,), ("sp",)), (x, t), steps=2)
    >>> max_param_diff(one, sharded) < 1e-5
    True
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..collectives.primitives import psum
from ..comm.rank_threads import manual_seed
from ..comm.stats import CommStats, comm_stats
from ..core.mesh import Mesh
from ..core.spec import P
from ..mapping import shard_map
from ..nn import convert

__all__ = ["SPEC", "heat_step", "heat_data", "HeatCNN", "make_model", "History",
           "train_single", "train_sharded", "max_param_diff"]

#: The spec of inputs, targets and activations: (N, C, H, W) with H split over "sp".
SPEC = P(None, None, "sp")

_LAPLACE = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])


def heat_step(u: torch.Tensor, kappa: torch.Tensor, dt: float = 1.0,
              substeps: int = 3) -> torch.Tensor:
    """One time step of ``du/dt = kappa * laplace(u)``, ``u = 0`` outside the domain
    (Dirichlet), as ``substeps`` explicit 5-point stencil steps of ``dt / substeps``.

    Args:
        u: fields, ``(N, 1, H, W)``.
        kappa: diffusivity, same shape, ``<= substeps / (4 * dt)`` for stability.

    Returns:
        The fields after the step, ``(N, 1, H, W)``.

    Example:
        >>> u = torch.zeros(1, 1, 5, 5, dtype=torch.float64); u[..., 2, 2] = 1.0
        >>> v = heat_step(u, torch.full_like(u, 0.1), substeps=1)
        >>> [round(a, 12) for a in v[0, 0, 2, 1:4].tolist()], round(v.sum().item(), 12)
        ([0.1, 0.6, 0.1], 1.0)
    """
    k = _LAPLACE.to(u)[None, None]
    h = dt / substeps
    for _ in range(substeps):
        u = u + h * kappa * F.conv2d(F.pad(u, (1, 1, 1, 1)), k)
    return u


def _blobs(g: torch.Generator, batch: int, size: int, width: int, count: int) -> torch.Tensor:
    """``count`` Gaussian blobs per sample of random centre, width and amplitude."""
    y = torch.arange(size, dtype=torch.float64)[:, None]
    x = torch.arange(width, dtype=torch.float64)[None, :]
    out = torch.zeros(batch, 1, size, width, dtype=torch.float64)
    for b in range(batch):
        cy, cx, s, a = torch.rand(4, count, generator=g, dtype=torch.float64)
        for i in range(count):
            sig = 1.5 + 0.1 * min(size, width) * s[i]
            r2 = (y - cy[i] * size) ** 2 + (x - cx[i] * width) ** 2
            out[b, 0] += (2 * a[i] - 1) * torch.exp(-r2 / (2 * sig ** 2))
    return out


def heat_data(batch: int = 8, size: int = 30, width: int = 32, seed: int = 0, *,
              dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
              substeps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of smooth initial fields and their state one time step later.

    Inputs are ``(batch, 2, size, width)``: channel 0 the temperature ``u`` (a sum of 4
    Gaussian blobs of either sign), channel 1 a smooth diffusivity ``kappa`` in
    ``[0.05, 0.7]`` (2 positive blobs). Targets are ``(batch, 1, size, width)``:
    ``heat_step(u, kappa, substeps=substeps)``. Generated in float64 on the CPU, then
    cast, so every dtype and device sees the same numbers up to rounding.

    Example:
        >>> x, t = heat_data(batch=2, size=10, width=8, seed=0)
        >>> x.shape, t.shape, x.dtype
        (torch.Size([2, 2, 10, 8]), torch.Size([2, 1, 10, 8]), torch.float32)
    """
    g = torch.Generator().manual_seed(seed)
    u = _blobs(g, batch, size, width, 4)
    k = _blobs(g, batch, size, width, 2).abs()
    kappa = 0.05 + 0.65 * k / k.amax(dim=(2, 3), keepdim=True).clamp_min(1e-12)
    target = heat_step(u, kappa, substeps=substeps)
    x = torch.cat([u, kappa], dim=1)
    return x.to(device=device, dtype=dtype), target.to(device=device, dtype=dtype)


class HeatCNN(nn.Module):
    """``u + f(u, kappa)``: a residual stack of 3x3 convolutions with zero padding (the
    Dirichlet boundary of ``heat_step``) and tanh, learning the change over one step.

    Example:
        >>> HeatCNN(hidden=4)(torch.zeros(1, 2, 6, 6)).shape
        torch.Size([1, 1, 6, 6])
    """

    def __init__(self, hidden: int = 16, layers: int = 3):
        super().__init__()
        chans = [2] + [hidden] * (layers - 1)
        body: list[nn.Module] = []
        for c_in, c_out in zip(chans, chans[1:]):
            body += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.Tanh()]
        body.append(nn.Conv2d(chans[-1], 1, 3, padding=1))
        self.net = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1] + self.net(x)


def make_model(hidden: int = 16, layers: int = 3, seed: int = 0, *,
               dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> HeatCNN:
    """A ``HeatCNN`` with seeded initial weights (same seed, same weights).

    Seeds with ``spmd.manual_seed``: torch's generator in a process, the rank's own on a
    rank thread, so every rank that builds one gets the same weights.

    Example:
        >>> sum(p.numel() for p in make_model(hidden=4).parameters())
        261
    """
    manual_seed(seed)
    return HeatCNN(hidden, layers).to(device=device, dtype=dtype)


@dataclass
class History:
    """What a training run leaves: per-step losses, final parameters (by name),
    mean seconds per step over steps 2.. (step 1 pays torch's one-off start-up costs),
    the first step's seconds, and, for sharded runs, bytes sent per step (averaged
    over the steps) by this process's ranks, ``{rank: (forward, backward)}``, and by
    collective, ``{op: (forward, backward)}`` summed over those ranks."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    seconds_per_step: float
    first_step_seconds: float
    bytes_per_step: dict[int, tuple[int, int]] = field(default_factory=dict)
    bytes_by_op: dict[str, tuple[int, int]] = field(default_factory=dict)


Callback = Callable[[int, float], None]
Optimizer = Callable[..., torch.optim.Optimizer]


def _train(model: nn.Module, step_loss: Callable[[], torch.Tensor], steps: int, lr: float,
           callback: Callback | None, optimizer: Optimizer) -> tuple[list[float], list[float]]:
    opt = optimizer(model.parameters(), lr=lr)
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = step_loss()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # .item() waits for the device: the time is honest
        times.append(time.perf_counter() - t0)
        if callback is not None:
            callback(i + 1, losses[-1])
    return losses, times


def _history(model: nn.Module, losses: list[float], times: list[float],
             stats: CommStats | None = None) -> History:
    rest = times[1:] or times
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    h = History(losses, params, sum(rest) / len(rest), times[0] if times else 0.0)
    if stats is not None:
        steps = max(len(losses), 1)

        def per(**which: Any) -> tuple[int, int]:
            return (stats.bytes(pass_="forward", **which) // steps,
                    stats.bytes(pass_="backward", **which) // steps)

        h.bytes_per_step = {r: per(rank=r) for r in sorted({r[2] for r in stats.records})}
        h.bytes_by_op = {op: per(op=op) for op in sorted({r[0] for r in stats.records})}
    return h


def train_single(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], steps: int = 30,
                 lr: float = 2e-3, *, callback: Callback | None = None,
                 optimizer: Optimizer = torch.optim.Adam) -> History:
    """Train a copy of ``model`` on one device with Adam on the MSE loss.

    Args:
        model: the plain model (not modified: a deep copy is trained).
        data: ``(inputs, targets)`` on the model's device.
        callback: called as ``callback(step, loss)`` after every step (progress).
        optimizer: made as ``optimizer(parameters, lr=lr)``; Adam by default.

    Example:
        >>> h = train_single(make_model(hidden=4), heat_data(2, 8, 8), steps=3)
        >>> len(h.losses), h.losses[-1] < h.losses[0]
        (3, True)
    """
    model = copy.deepcopy(model)
    x, t = data
    losses, times = _train(model, lambda: ((model(x) - t) ** 2).mean(), steps, lr, callback,
                           optimizer)
    return _history(model, losses, times)


def train_sharded(model: nn.Module, mesh: Mesh, data: tuple[torch.Tensor, torch.Tensor],
                  steps: int = 30, lr: float = 2e-3, *, axis: str = "sp",
                  callback: Callback | None = None,
                  optimizer: Optimizer = torch.optim.Adam) -> History:
    """Train ``spmd.nn.convert(model, mesh, P(None, None, axis))`` with Adam on the
    global MSE loss: every rank sums its shard's squared errors, ``psum`` adds them
    up, divided by the global count. The rows (dim 2) of every sample are split over
    ``axis`` by the balanced rule (uneven when they do not divide).

    On a threads mesh call it from ordinary code; on a torch mesh (torchrun,
    ``spmd.launch(..., backend="gloo")``) every process calls it with the same data and
    ends with the same parameters.

    Args:
        model: the plain model (not modified: ``convert`` trains a copy).
        mesh: a mesh with axis ``axis`` (its other axes, if any, replicate).
        data: global ``(inputs, targets)``.
        callback: called as ``callback(step, loss)`` after every step.
        optimizer: made as ``optimizer(parameters, lr=lr)``; Adam by default.

    Returns:
        A ``History``; ``bytes_per_step`` from ``spmd.comm_stats()`` covers every rank
        on a threads mesh, this process's rank on a torch mesh.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> h = train_sharded(make_model(hidden=4), mesh, heat_data(2, 8, 8), steps=2)
        >>> sorted(h.bytes_per_step), h.losses[1] < h.losses[0]
        ([0, 1, 2], True)
    """
    spec = P(None, None, axis)
    sharded = convert(model, mesh, spec)
    x, t = data
    n = t.numel()

    def body(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return psum(((sharded(x) - t) ** 2).sum(), axis) / n

    loss_fn = shard_map(body, mesh, (spec, spec), P())
    with comm_stats() as stats:
        losses, times = _train(sharded, lambda: loss_fn(x, t), steps, lr, callback, optimizer)
    return _history(sharded, losses, times, stats)


def max_param_diff(a: History, b: History) -> float:
    """The largest absolute difference between the final parameters of two runs.

    Example:
        >>> h = History([1.0], {"w": torch.ones(2)}, 0.0, 0.0)
        >>> max_param_diff(h, History([1.0], {"w": torch.tensor([1.0, 1.5])}, 0.0, 0.0))
        0.5
    """
    if a.params.keys() != b.params.keys():
        raise ValueError(f"max_param_diff: the runs have different parameters: "
                         f"{sorted(a.params)} vs {sorted(b.params)}")
    return max(((a.params[k].cpu() - b.params[k].cpu()).abs().max().item()
                for k in a.params), default=0.0)
