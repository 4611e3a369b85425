"""What each random call is under ``spmd.random.invariant``: torch's semantics (shapes,
dtypes, dropout's scaling, in place or not), its numbers from the draw's key and the
global index of each element (``_Draw.index_of``)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .hashing import IndexOf, _shr, bits, local_index, normal, uniform

__all__ = ["HANDLERS", "RANDOM", "draws_nothing", "feature_dims", "apply_mask"]


def draws_nothing(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a random call draws nothing: dropout in eval mode or with p=0, attention
    without dropout, rrelu in eval mode."""
    if name == "scaled_dot_product_attention":
        return not _arg(args, kwargs, 4, ("dropout_p",), 0.0)
    if name == "multi_head_attention_forward":
        return not (_arg(args, kwargs, 10, ("dropout_p",), 0.0) and
                    _arg(args, kwargs, 13, ("training",), True))
    if name in ("rrelu", "rrelu_"):  # random slopes in training only
        return not _arg(args, kwargs, 3, ("training",), False)
    if "dropout" in name and name != "native_dropout":
        return not _arg(args, kwargs, 2, ("training", "train"), True) or \
            not _arg(args, kwargs, 1, ("p",), 0.5)
    return False




class _Draw:
    """One draw: its key, and how to index a local block globally."""

    def __init__(self, key: int, index_of: IndexOf):
        self.key, self.index_of = key, index_of

    def index(self, shape: Sequence[int], device: Any, whole_from: int | None = None):
        return self.index_of(tuple(shape), torch.device(device),
                             len(shape) if whole_from is None else whole_from)

    def uniform(self, shape, device, dtype=torch.float64, whole_from=None) -> torch.Tensor:
        return uniform(self.key, self.index(shape, device, whole_from), dtype)

    def normal(self, shape, device, dtype) -> torch.Tensor:
        return normal(self.key, self.index(shape, device), dtype)

    def ints(self, shape, device, low: int, high: int) -> torch.Tensor:
        if high <= low:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got "
                               f"from={low} >= to={high}")
        b = _shr(bits(self.key, self.index(shape, device)), 1)
        return b % (high - low) + low


def _arg(args: tuple, kwargs: dict, pos: int, names: tuple[str, ...], default: Any) -> Any:
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[pos] if len(args) > pos else default


def _size(args: tuple, kwargs: dict) -> tuple[int, ...]:
    if "size" in kwargs:
        s = kwargs["size"]
        return tuple(s) if isinstance(s, (tuple, list, torch.Size)) else (s,)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _made(out: torch.Tensor, kwargs: dict) -> torch.Tensor:
    if kwargs.get("requires_grad"):
        out.requires_grad_(True)
    if kwargs.get("out") is not None:
        return kwargs["out"].copy_(out)
    return out


def _device(kwargs: dict) -> torch.device:
    return torch.device(kwargs["device"]) if kwargs.get("device") is not None else \
        torch.get_default_device()


def _rand(d: _Draw, args, kwargs):
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return _made(d.uniform(_size(args, kwargs), _device(kwargs), dtype), kwargs)


def _randn(d: _Draw, args, kwargs):
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return _made(d.normal(_size(args, kwargs), _device(kwargs), dtype), kwargs)


def _randint(d: _Draw, args, kwargs):
    ints = [a for a in args if not isinstance(a, (tuple, list, torch.Size))]
    size = kwargs.get("size", next((a for a in args if isinstance(a, (tuple, list,
                                                                       torch.Size))), ()))
    low, high = (0, ints[0]) if len(ints) == 1 else (ints[0], ints[1]) if ints else (0, 0)
    low, high = kwargs.get("low", low), kwargs.get("high", high)
    out = d.ints(tuple(size), _device(kwargs), int(low), int(high))
    return _made(out.to(kwargs.get("dtype") or torch.int64), kwargs)


def _like(kind: str):
    def handler(d: _Draw, args, kwargs):
        x = args[0] if args else kwargs["input"]
        dtype = kwargs.get("dtype") or x.dtype
        dev = torch.device(kwargs["device"]) if kwargs.get("device") is not None else x.device
        if kind == "rand":
            out = d.uniform(x.shape, dev, dtype)
        elif kind == "randn":
            out = d.normal(x.shape, dev, dtype)
        else:
            rest = list(args[1:])
            if "high" in kwargs:
                low, high = kwargs.get("low", rest[0] if rest else 0), kwargs["high"]
            elif len(rest) >= 2:
                low, high = rest[0], rest[1]
            else:
                low, high = kwargs.get("low", 0), rest[0]
            out = d.ints(x.shape, dev, int(low), int(high)).to(dtype)
        return _made(out, kwargs)
    return handler


def _randperm(d: _Draw, args, kwargs):
    n = int(args[0] if args else kwargs["n"])
    b = bits(d.key, local_index((n,), _device(kwargs)))
    return _made(torch.argsort(b, stable=True).to(kwargs.get("dtype") or torch.int64), kwargs)


def _normal_fn(d: _Draw, args, kwargs):
    mean = _arg(args, kwargs, 0, ("mean",), 0.0)
    std = _arg(args, kwargs, 1, ("std",), 1.0)
    ts = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if not ts:
        size = _arg(args, kwargs, 2, ("size",), ())
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return _made(mean + std * d.normal(tuple(size), _device(kwargs), dtype), kwargs)
    shape = torch.broadcast_shapes(*(t.shape for t in ts))
    z = d.normal(shape, ts[0].device, ts[0].dtype)
    return _made(mean + std * z, kwargs)


def _bernoulli(d: _Draw, args, kwargs):
    x = args[0] if args else kwargs["input"]
    p = _arg(args, kwargs, 1, ("p",), None)
    u = d.uniform(x.shape, x.device)
    return _made((u < (x.detach().double() if p is None else p)).to(x.dtype), kwargs)


def _inplace(kind: str, names: tuple[tuple[str, ...], tuple[str, ...]], defaults: tuple):
    def handler(d: _Draw, args, kwargs):
        x = args[0] if args else kwargs["tensor"]
        a = _arg(args, kwargs, 1, names[0], defaults[0])
        b = _arg(args, kwargs, 2, names[1], defaults[1])
        if kind == "normal":
            v = a + b * d.normal(x.shape, x.device, torch.float64)
        elif kind == "bernoulli":
            v = d.uniform(x.shape, x.device) < (a.double() if isinstance(a, torch.Tensor) else a)
        else:
            u = d.uniform(x.shape, x.device)
            v = {"uniform": lambda: a + (b - a) * u,
                 "exponential": lambda: -torch.log1p(-u) / a,
                 "cauchy": lambda: a + b * torch.tan(math.pi * (u - 0.5)),
                 "log_normal": lambda: torch.exp(a + b * d.normal(x.shape, x.device,
                                                                  torch.float64)),
                 "geometric": lambda: torch.ceil(torch.log1p(-u) / math.log1p(-a)).clamp_min(1),
                 }[kind]()
        if x.is_leaf:  # initialising a parameter, as nn.init does, under no_grad
            with torch.no_grad():
                return x.copy_(v.to(x.dtype))
        return x.copy_(v.to(x.dtype))  # recorded: no gradient flows to x's old value
    return handler


_ALPHA = 1.7580993408473766


def _dropout(feature: int, alpha: bool):
    """Dropout as torch computes it, the mask drawn per element (feature 0) or per
    (sample, channel): the dims before ``whole_from`` (feature dropouts)."""
    def handler(d: _Draw, args, kwargs):
        x = args[0] if args else kwargs["input"]
        p = float(_arg(args, kwargs, 1, ("p",), 0.5))
        training = _arg(args, kwargs, 2, ("training", "train"), True)
        inplace = _arg(args, kwargs, 3, ("inplace",), False)
        if not training or p == 0:
            return x
        keep = feature_dims(x.ndim, feature)
        shape = tuple(x.shape[:keep]) + (1,) * (x.ndim - keep)
        mask = d.uniform(shape, x.device, whole_from=keep) >= p
        return apply_mask(x, mask, p, alpha, inplace)
    return handler


def feature_dims(ndim: int, feature: int) -> int:
    """How many leading dims a dropout mask has: all (``feature`` 0), or (sample,
    channel), or the channel only for an unbatched input of ``dropout{feature}d``."""
    if not feature:
        return ndim
    if feature > 0 and ndim == feature + 1 and feature != 2:
        return 1  # (C, L) for dropout1d, (C, D, H, W) for dropout3d: unbatched
    return min(2, ndim)


def apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float, alpha: bool,
               inplace: bool) -> torch.Tensor:
    """``x`` with a dropout mask (True: kept) applied, scaled as torch's dropout is."""
    if p == 1:
        keep = torch.zeros_like(keep)
    noise = keep.to(x.dtype)
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p)) if p < 1 else 0.0
        b = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
        noise = noise * a
        return x.mul_(noise).add_(b) if inplace else x * noise + b
    noise = noise / (1 - p) if p < 1 else noise
    return x.mul_(noise) if inplace else x * noise


HANDLERS: dict[str, Callable] = {
    "rand": _rand, "randn": _randn, "randint": _randint, "randperm": _randperm,
    "rand_like": _like("rand"), "randn_like": _like("randn"),
    "randint_like": _like("randint"), "normal": _normal_fn, "bernoulli": _bernoulli,
    "uniform_": _inplace("uniform", (("from", "a"), ("to", "b")), (0.0, 1.0)),
    "normal_": _inplace("normal", (("mean",), ("std",)), (0.0, 1.0)),
    "bernoulli_": _inplace("bernoulli", (("p",), ()), (0.5, None)),
    "exponential_": _inplace("exponential", (("lambd",), ()), (1.0, None)),
    "cauchy_": _inplace("cauchy", (("median",), ("sigma",)), (0.0, 1.0)),
    "log_normal_": _inplace("log_normal", (("mean",), ("std",)), (1.0, 2.0)),
    "geometric_": _inplace("geometric", (("p",), ()), (0.5, None)),
    "dropout": _dropout(0, False), "alpha_dropout": _dropout(0, True),
    "feature_dropout": _dropout(-1, False), "feature_alpha_dropout": _dropout(-1, True),
    "dropout1d": _dropout(1, False), "dropout2d": _dropout(2, False),
    "dropout3d": _dropout(3, False),
}


#: Every random call torch makes by name (the ones without a handler are refused).
RANDOM = frozenset(HANDLERS) | {
    "rrelu", "rrelu_", "multinomial", "poisson", "binomial", "random_", "native_dropout",
    "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
    "_standard_gamma", "_sample_dirichlet", "scaled_dot_product_attention",
    "multi_head_attention_forward", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_", "sparse_"}
