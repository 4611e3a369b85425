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
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from ..core._local import RankLocal
from ..core import _context
from ..core.errors import SpecError
from .calls import HANDLERS, RANDOM, _Draw, draws_nothing
from .hashing import IndexOf, bits, draw_key, local_index, uniform

__all__ = ["invariant", "Invariant", "Stream", "draw_key", "bits", "uniform", "RANDOM"]

_local = RankLocal()


class Stream:
    """The state of one entered ``invariant`` context: its seed and draws so far."""

    def __init__(self, seed: int, draws: int):
        self.seed, self.draws = seed, draws

    def next_key(self) -> int:
        """The next draw's key (``draw_key(seed, draws)``); counts the draw."""
        key = draw_key(self.seed, self.draws)
        self.draws += 1
        return key

    def apply(self, func: Callable, name: str, args: tuple, kwargs: dict,
              index_of: IndexOf = local_index) -> Any:
        """Run the random call ``func`` as this stream's next draw."""
        handler = HANDLERS.get(name)
        if handler is None or kwargs.get("generator") is not None:
            raise SpecError(_refusal(name, "generator=" if handler else ""))
        if in_checkpoint():
            raise SpecError(f"spmd.random.invariant: {name} {IN_CHECKPOINT}")
        return handler(_Draw(self.next_key(), index_of), args, kwargs)

    def __repr__(self) -> str:
        return f"Stream(seed={self.seed}, draws={self.draws})"


def active() -> Stream | None:
    """The innermost ``invariant`` stream entered on this thread, or None."""
    s = _local.get("streams")
    return s[-1] if s else None


class paused:
    """spmd's own draws (a rank thread's seed) pass the invariant context by. (A class,
    not a generator: every shard_map call on a threads mesh enters it once.)"""

    def __enter__(self) -> None:
        self._prev = _local.get("paused", False)
        _local.paused = True

    def __exit__(self, *exc: object) -> None:
        _local.paused = self._prev


def fork() -> tuple[Stream, int] | None:
    """The stream active on this thread and its draws so far, for the rank threads a
    per-rank program starts from it (``spmd.comm.rank_threads``)."""
    s = active()
    return None if s is None else (s, s.draws)


@contextlib.contextmanager
def on_rank_thread(parent: tuple[Stream, int] | None, rank: int) -> Iterator[None]:
    """On a rank thread: a copy of the caller's stream as ``fork`` found it (same seed,
    same draws so far), so that ``with invariant(seed): shard_map(...)(x)`` draws on
    every rank as the body would on one, whichever rank starts first; rank 0's count
    goes back to the caller's stream."""
    if parent is None:
        yield
        return
    stream, draws = parent
    with Invariant(stream.seed, draws) as copy:
        try:
            yield
        finally:
            if rank == 0:
                stream.draws = copy.draws


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
        if _local.get("streams") is None:
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
        if name not in RANDOM or _local.get("paused", False) or \
                _no_values(name, args, kwargs):
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


#: Why a draw in a checkpointed function is refused under ``invariant``.
IN_CHECKPOINT = (
    "is drawn under spmd.random.invariant inside torch.utils.checkpoint's function, whose "
    "recompute in backward would be the stream's next draw (another mask than the "
    "forward's: a wrong gradient); draw it outside the checkpointed function, or call "
    "the model outside the invariant context")
# checkpoint itself is wrapped (torch._compile): its file, from a plain function of it
_CHECKPOINT = (torch.utils.checkpoint.detach_variable.__code__.co_filename, "checkpoint")


def in_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint.checkpoint``'s function."""
    f = sys._getframe(1)
    while f is not None:
        if (f.f_code.co_filename, f.f_code.co_name) == _CHECKPOINT:
            return True
        f = f.f_back
    return False


def _refusal(name: str, why: str) -> str:
    if why:
        return (f"spmd.random.invariant: {name} is given its own {why}, whose numbers "
                f"depend on the mesh; leave it out (the invariant stream draws it)")
    return (f"spmd.random.invariant: {name} has no mesh-invariant version; draw it outside "
            f"the invariant context, or use one of: {', '.join(sorted(HANDLERS))}")

