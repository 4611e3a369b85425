"""The hash under ``spmd.random.invariant``: 64 random bits per (key, global index).

splitmix64's finalizer applied twice, in int64 torch ops (which wrap as unsigned
arithmetic does; ``tests/test_random.py`` checks them against Python's ints), and the
uniforms, normals and index tensors built on it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["mix64", "draw_key", "bits", "uniform", "normal", "local_index", "global_index"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

#: An index function: (local shape, device, whole_from) -> int64 global flat indices of
#: the local block (dims from ``whole_from`` on are whole: a feature dropout's mask).
IndexOf = Callable[[Sequence[int], torch.device, int], torch.Tensor]


def _signed(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (the reference the tensor version matches)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def _shr(x: torch.Tensor, r: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic)."""
    return (x >> r) & ((1 << (64 - r)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _signed(_C1)
    z = (z ^ _shr(z, 27)) * _signed(_C2)
    return z ^ _shr(z, 31)


def _keys(key: int, lane: int) -> tuple[int, int]:
    k = mix64(key ^ mix64(lane + 1))
    return _signed(mix64(k + 1)), _signed(mix64(k + 2))


def draw_key(seed: int, draw: int) -> int:
    """The key of the ``draw``-th draw (from 0) of ``invariant(seed)``."""
    return mix64(mix64(seed & _M64) + (draw + 1) * _GOLDEN)


def bits(key: int, index: torch.Tensor, lane: int = 0) -> torch.Tensor:
    """64 random bits (int64) per element of ``index`` (int64 global indices).

    Example:
        >>> b = bits(draw_key(0, 0), torch.arange(4))
        >>> b.dtype, bool((b == bits(draw_key(0, 0), torch.arange(4))).all())
        (torch.int64, True)
    """
    k1, k2 = _keys(key, lane)
    with torch.no_grad():
        return _mix(_mix(index * _signed(_GOLDEN) + k1) ^ k2)


def uniform(key: int, index: torch.Tensor, dtype: torch.dtype = torch.float64,
            lane: int = 0) -> torch.Tensor:
    """Uniform in [0, 1), exact multiples of ``2**-bits`` for ``dtype``'s mantissa.

    Example:
        >>> u = uniform(draw_key(0, 0), torch.arange(10_000))
        >>> 0.49 < float(u.mean()) < 0.51 and float(u.min()) >= 0 and float(u.max()) < 1
        True
    """
    n = 1 - int(math.log2(torch.finfo(dtype).eps))  # the mantissa's bits
    return _shr(bits(key, index, lane), 64 - n).to(dtype) * (2.0 ** -n)


def normal(key: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    u1 = uniform(key, index, torch.float64, 1)
    u2 = uniform(key, index, torch.float64, 2)
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def local_index(shape: Sequence[int], device: Any, whole_from: int = 0) -> torch.Tensor:
    """Row-major flat indices of a tensor of ``shape`` (one device: global = local)."""
    return torch.arange(math.prod(shape), device=device, dtype=torch.int64).reshape(tuple(shape))


def global_index(local: Sequence[int], glob: Sequence[int], offsets: Sequence[int],
                 device: Any) -> torch.Tensor:
    """Flat indices in a tensor of shape ``glob`` of the block of shape ``local`` that
    starts at ``offsets``."""
    idx = torch.zeros((1,) * len(local), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(local))):
        shape = [1] * len(local)
        shape[d] = local[d]
        ar = torch.arange(offsets[d], offsets[d] + local[d], dtype=torch.int64, device=device)
        idx = idx + ar.reshape(shape) * stride
        stride *= glob[d]
    return idx.expand(tuple(local)).contiguous()

