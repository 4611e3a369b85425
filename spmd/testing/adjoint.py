"""The dot-product test: a linear per-rank op and its backward are adjoint."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..comm.rank_threads import run_on_threads
from ..core._context import current, in_rank_of
from ..core.mesh import Mesh
from ..core.placeholder import Placeholder
from ..transforms.scatter_gather import backward

__all__ = ["check_adjoint"]


def check_adjoint(fn: Callable[[torch.Tensor], torch.Tensor], mesh: Mesh,
                  inputs: Callable[[int], torch.Tensor] | Sequence[torch.Tensor], *,
                  seed: int = 0, rtol: float = 1e-10, atol: float = 1e-12) -> tuple[float, float]:
    """Check ``sum_r <T x_r, y_r> == sum_r <x_r, (T* y)_r>`` with T* from autograd.

    ``fn`` is per-rank code (it may call collectives and spmd transforms) that maps this
    rank's tensor ``x_r`` to ``T x_r`` and must be linear. ``y_r`` is random, float64 is
    recommended: then the two sides agree to rounding, and any mistake in a backward
    rule (a missing sum, a wrong permutation, a lost halo) shows up as a difference.

    Args:
        fn: the per-rank linear op.
        mesh: where it runs. Called from ordinary code, the ranks run on the threads of
            a threads mesh; called from per-rank code (a launched function, a torch
            process), this rank does its part and the sums are psum'd over the mesh.
        inputs: ``x_r`` for each rank, as a function of the rank or a list; ``None`` or a
            ``Placeholder`` on ranks without data. ``fn`` may return a ``Placeholder``
            on ranks without output: they contribute nothing to the inner products and
            still take part in backward (``spmd.backward``).
        seed: seeds ``y_r`` (per rank).
        rtol, atol: tolerance of the comparison.

    Returns:
        ``(lhs, rhs)``, the two inner products.

    Raises:
        AssertionError: naming both sides and their difference.

    Example:
        >>> mesh = spmd.Mesh((3,), ("sp",))
        >>> xs = [torch.randn(r + 1, dtype=torch.float64) for r in range(3)]
        >>> lhs, rhs = check_adjoint(lambda x: spmd.all_gather(x, "sp", tiled=True), mesh, xs)
    """
    make = inputs if callable(inputs) else (lambda r: inputs[r])

    def per_rank(rank: int) -> tuple[float, float]:
        x = make(rank)
        if isinstance(x, torch.Tensor):
            x = x.detach().clone().requires_grad_()
        tx = fn(x)
        if isinstance(tx, Placeholder):  # no output here; still takes part in backward
            backward(tx)
            lhs = 0.0
        else:
            g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + rank)
            y = torch.randn(tx.shape, dtype=tx.dtype, generator=g).to(tx.device)
            backward(tx, y)
            lhs = float((tx.detach() * y).sum())
        if not isinstance(x, torch.Tensor):
            return lhs, 0.0
        gx = torch.zeros_like(x) if x.grad is None else x.grad
        return lhs, float((x.detach() * gx).sum())

    if in_rank_of(mesh):
        from ..collectives.primitives import psum
        rank = current("check_adjoint").rank
        mine = torch.tensor(per_rank(rank), dtype=torch.float64)
        with torch.no_grad():
            both = psum(mine, mesh.axis_names)
        lhs, rhs = float(both[0]), float(both[1])
    else:
        parts = run_on_threads(mesh, per_rank)
        lhs, rhs = sum(p[0] for p in parts), sum(p[1] for p in parts)
    if abs(lhs - rhs) > atol + rtol * max(abs(lhs), abs(rhs)):
        raise AssertionError(
            f"check_adjoint: <T x, y> = {lhs!r} but <x, T* y> = {rhs!r} (difference "
            f"{lhs - rhs:.3e}, rtol={rtol}, atol={atol}); the backward of the op is not the "
            f"adjoint of its forward")
    return lhs, rhs
