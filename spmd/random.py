"""Mesh-invariant random numbers: every value a pure function of (seed, draw, global index).

Under ``with spmd.random.invariant(seed):`` each random call (a dropout mask,
``torch.rand``, ``randn``, ``randint``, ``bernoulli``, ``x.uniform_()``, ...) is the
``k``-th *draw* of the context, and the value it puts at an element is a hash of the seed,
``k`` and the element's index in the global tensor, as JAX's partitionable threefry does.
So a model run on one device and the same model converted (``spmd.nn.convert``) on any
mesh, uneven or with empty shards, draw the same numbers; a run resumed on another mesh
replays the same masks from the same ``seed`` and ``draws``.

The hash is splitmix64's finalizer applied twice (to ``index * golden + k1``, then to that
xor ``k2``, the two keys mixed from the seed and the draw number) in int64 torch ops,
which wrap as unsigned arithmetic does: 64 bits per element, a bijection of the index for
each draw. Uniform floats take the top 53 bits (float64), 24 (float32), 11 (float16) or 8
(bfloat16), so they are exact multiples of ``2**-bits`` in [0, 1); normals are
Box-Muller of two uniforms in float64, then cast; integers are the top 63 bits modulo the
range (bias below ``range / 2**63``). Numbers are the same on every device type up to the
last bit of ``log``/``cos`` (normals), bit for bit otherwise.

On one device the context pushes a ``TorchFunctionMode`` that replaces the random calls
(global index = local index); a converted forward computes each rank's global indices from
the split of the tensor drawn (``spmd/nn/rules/draws.py``). Calls it cannot make invariant
(``multinomial``, ``rrelu``, attention dropout, ``nn.init``'s functions, a
``generator=``) raise a ``SpecError`` rather than draw from another stream.
"""
from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .core import _context
from .core.errors import SpecError

__all__ = ["invariant", "Invariant", "bits", "uniform"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_local = threading.local()

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


def _normal(key: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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


class Stream:
    """The state of one entered ``invariant`` context: its seed and draws so far."""

    def __init__(self, seed: int, draws: int):
        self.seed, self.draws = seed, draws

    def next_key(self) -> int:
        key = draw_key(self.seed, self.draws)
        self.draws += 1
        return key

    def apply(self, func: Callable, name: str, args: tuple, kwargs: dict,
              index_of: IndexOf = local_index) -> Any:
        """Run the random call ``func`` as this stream's next draw."""
        handler = _HANDLERS.get(name)
        if handler is None or kwargs.get("generator") is not None:
            raise SpecError(_refusal(name, "generator=" if handler else ""))
        return handler(_Draw(self.next_key(), index_of), args, kwargs)

    def __repr__(self) -> str:
        return f"Stream(seed={self.seed}, draws={self.draws})"


def active() -> Stream | None:
    """The innermost ``invariant`` stream entered on this thread, or None."""
    s = getattr(_local, "streams", None)
    return s[-1] if s else None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """spmd's own draws (a rank thread's seed) pass the invariant context by."""
    prev = getattr(_local, "paused", False)
    _local.paused = True
    try:
        yield
    finally:
        _local.paused = prev


def fork() -> Stream | None:
    """The stream active on this thread, for the rank threads a per-rank program starts
    from it (``spmd.comm.rank_threads``)."""
    return active()


@contextlib.contextmanager
def on_rank_thread(parent: Stream | None, rank: int) -> Iterator[None]:
    """On a rank thread: a copy of the caller's stream (same seed, same draws so far), so
    that ``with invariant(seed): shard_map(...)(x)`` draws on every rank as the body
    would on one; rank 0's count goes back to the caller's stream."""
    if parent is None:
        yield
        return
    with Invariant(parent.seed, parent.draws) as copy:
        try:
            yield
        finally:
            if rank == 0:
                parent.draws = copy.draws


class Invariant:
    """``invariant(seed)``: the context manager (see ``invariant``)."""

    def __init__(self, seed: int, draws: int = 0):
        for what, v in (("seed", seed), ("draws", draws)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"spmd.random.invariant: {what} must be an int >= 0, got "
                                f"{v!r}")
        self.seed, self.draws = seed, draws
        self._entered: list[tuple[Stream, _Mode]] = []

    def __enter__(self) -> Stream:
        stream = Stream(self.seed, self.draws)
        mode = _Mode(stream)
        mode.__enter__()
        if getattr(_local, "streams", None) is None:
            _local.streams = []
        _local.streams.append(stream)
        self._entered.append((stream, mode))  # per entry: each rank thread its own
        return stream

    def __exit__(self, *exc: Any) -> None:
        stream = _local.streams.pop()
        mode = next(m for s, m in reversed(self._entered) if s is stream)
        self._entered = [(s, m) for s, m in self._entered if s is not stream]
        mode.__exit__(*exc)


def invariant(seed: int, draws: int = 0) -> Invariant:
    """Random draws that are a pure function of ``seed``, the draw's number and the global
    index of each element: the same on one device and on any mesh.

    Enter it where the model runs: around a model on one device; around the ``shard_map``
    call of a converted model (its rank threads draw from copies of it) or in the per-rank
    code (the body, the function ``spmd.launch`` runs, each process's own code).
    The ``as`` target's ``draws`` counts the draws so far: pass it back as ``draws=`` to
    resume (on another mesh, after a checkpoint) with the masks that would have come next.

    Args:
        seed: an int >= 0.
        draws: the number of draws already made (0 to start).

    Example:
        >>> import torch, spmd
        >>> x = torch.ones(2, 6)
        >>> with spmd.random.invariant(0) as s:
        ...     a = torch.nn.functional.dropout(x, 0.5)
        >>> with spmd.random.invariant(0):
        ...     b = torch.nn.functional.dropout(x, 0.5)
        >>> torch.equal(a, b), s.draws
        (True, 1)
    """
    return Invariant(seed, draws)


class _Mode(TorchFunctionMode):
    def __init__(self, stream: Stream):
        super().__init__()
        self.stream = stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in _HANDLERS and name not in RANDOM or _no_values(name, args, kwargs) \
                or getattr(_local, "paused", False):
            return func(*args, **kwargs)
        if _context.converting() is True:
            raise SpecError(f"spmd.random.invariant: {name} is drawn inside a converted "
                            f"forward under a context entered inside it; enter "
                            f"invariant(...) around the converted model's call")
        return self.stream.apply(func, name, args, kwargs)


def _no_values(name: str, args: tuple, kwargs: dict) -> bool:
    """A call on meta tensors (a plan) draws nothing; eval-mode attention draws nothing."""
    if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
        return True
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in list(args) + list(kwargs.values())):
        return True
    return draws_nothing(name, args, kwargs)


def draws_nothing(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a random call draws nothing: dropout in eval mode or with p=0, attention
    without dropout."""
    if name == "scaled_dot_product_attention":
        return not _arg(args, kwargs, 4, ("dropout_p",), 0.0)
    if name == "multi_head_attention_forward":
        return not (_arg(args, kwargs, 10, ("dropout_p",), 0.0) and
                    _arg(args, kwargs, 13, ("training",), True))
    if "dropout" in name and name != "native_dropout":
        return not _arg(args, kwargs, 2, ("training", "train"), True) or \
            not _arg(args, kwargs, 1, ("p",), 0.5)
    return False


def _refusal(name: str, why: str) -> str:
    if why:
        return (f"spmd.random.invariant: {name} is given its own {why}, whose numbers "
                f"depend on the mesh; leave it out (the invariant stream draws it)")
    return (f"spmd.random.invariant: {name} has no mesh-invariant version; draw it outside "
            f"the invariant context, or use one of: {', '.join(sorted(_HANDLERS))}")


# -- the random calls ------------------------------------------------------------------------


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
        return _normal(self.key, self.index(shape, device), dtype)

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


_HANDLERS: dict[str, Callable] = {
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
RANDOM = frozenset(_HANDLERS) | {
    "rrelu", "rrelu_", "multinomial", "poisson", "binomial", "random_", "native_dropout",
    "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
    "_standard_gamma", "_sample_dirichlet", "scaled_dot_product_attention",
    "multi_head_attention_forward", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_", "sparse_"}
