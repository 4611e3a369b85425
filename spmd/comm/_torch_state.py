"""One rank's share of torch's per-thread state, taken off the thread and put back at
every switch between the rank greenlets of the simulated mesh (``rank_greenlets``).

Ranks that run as greenlets share one OS thread, and torch keeps its modes in
thread-local storage: without this, a ``torch.no_grad()`` entered by rank 0 before a
collective would still hold when rank 1 runs, and convert's interpreter mode pushed by
one rank would intercept another's calls. What moves with a rank: grad mode, inference
mode, autocast (CPU and the accelerator), the saved-tensor hooks (activation
checkpointing), the torch-function and torch-dispatch mode stacks, and the CPU random
generator's state (each rank draws from its own, as a process does).

torch has no public API to lift these stacks off a thread and restore them, so this
module (and only this one) uses the ``torch._C`` calls the public context managers are
built on. Each is read once, here; a torch without them fails at import with a message.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["RankState", "CLEAN", "fresh", "take", "put", "guards", "inside_guard",
           "saved_tensor_hooks", "next_sequence_nr", "functorch_active"]

_C = torch._C
_auto = torch._C._autograd
try:
    _fn_len, _fn_pop, _fn_push = (_C._len_torch_function_stack, _C._pop_torch_function_stack,
                                  _C._push_on_torch_function_stack)
    _d_len, _d_pop, _d_push = (_C._len_torch_dispatch_stack, _C._pop_torch_dispatch_stack,
                               _C._push_on_torch_dispatch_stack)
    _h_top, _h_pop, _h_push = (_auto._top_saved_tensors_default_hooks,
                               _auto._pop_saved_tensors_default_hooks,
                               _auto._push_saved_tensors_default_hooks)
    _Inference = _C._InferenceMode
    _excluded, _included = _C._dispatch_tls_local_exclude_set, _C._dispatch_tls_local_include_set
    _functorch = _C._are_functorch_transforms_active
    _any_autocast = getattr(_C, "_is_any_autocast_enabled", lambda: True)
except AttributeError as e:  # pragma: no cover - a torch this module was not written for
    raise ImportError(f"spmd's simulated mesh needs torch's mode-stack internals ({e}); "
                      f"use Mesh(..., schedule='threads') or a torch >= 2.5") from None

# The number the next autograd node made on this thread gets (torch has no public API;
# without it, spmd makes a node and reads its number, ~6 us).
next_sequence_nr = getattr(_auto, "_get_sequence_nr", None)

_default_gen = torch.default_generator


def _autocast_types() -> tuple[str, ...]:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") and \
        torch.accelerator.is_available() else None
    return ("cpu",) if acc is None else ("cpu", acc.type)


_AUTOCAST = _autocast_types()


class RankState:
    """What ``take`` lifted off the thread: put it back with ``put``. ``rng``: the
    generator state the rank draws from (None: the thread's own, shared)."""

    __slots__ = ("grad", "fmodes", "dmodes", "hooks", "autocast", "inference", "rng", "seed")

    def __init__(self, grad: bool = True, rng: torch.Tensor | None = None,
                 seed: int | None = None):
        self.grad = grad
        self.fmodes: list[Any] = []
        self.dmodes: list[Any] = []
        self.hooks: list[tuple] = []
        self.autocast: list[tuple[str, bool, torch.dtype]] | None = None
        self.inference: Any = None
        self.rng, self.seed = rng, seed


CLEAN = RankState()  # torch's defaults and the thread's own generator: nothing to move


def fresh(grad: bool = True, seed: int | None = None) -> RankState:
    """A new rank's state: torch's defaults (with grad mode ``grad``), its generator
    seeded with ``seed`` (None: the thread's own)."""
    return CLEAN if grad and seed is None else RankState(grad, seed=seed)


def take(per_rank_rng: bool) -> RankState | _Generator:
    """Lift the calling thread's state (the running rank's) off it, leaving torch's
    defaults: grad mode on, no modes, no hooks, no autocast."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    nf, nd, top = _fn_len(), _d_len(), _h_top(True)
    autocast = [dev for dev in _AUTOCAST if torch.is_autocast_enabled(dev)] \
        if _any_autocast() else ()
    if grad and not (inference or nf or nd or autocast) and top is None:
        if not per_rank_rng:
            return CLEAN  # the common case, checked in a few calls
        return _Generator(_default_gen.get_state())  # the common case on rng="per_rank"
    s = RankState(grad)
    if inference:
        guard = _Inference(False)
        guard.__enter__()
        s.inference = guard
    if per_rank_rng:
        s.rng = _default_gen.get_state()
    if nf:
        s.fmodes = [_fn_pop() for _ in range(nf)][::-1]
    if nd:
        s.dmodes = [_d_pop() for _ in range(nd)][::-1]
    while top is not None:
        s.hooks.append(top)
        _h_pop()
        top = _h_top(True)
    s.hooks.reverse()
    if autocast:
        s.autocast = []
        for dev in autocast:
            s.autocast.append((dev, True, torch.get_autocast_dtype(dev)))
            torch.set_autocast_enabled(dev, False)
    if not grad:
        torch.set_grad_enabled(True)
    return s


class _Generator:
    """A state that is torch's defaults but for the generator's: ``take``'s common case
    with per-rank generators, put back without the general path's checks."""

    __slots__ = ("rng",)

    def __init__(self, rng: torch.Tensor):
        self.rng = rng


def put(s: RankState | _Generator) -> None:
    """Install a state ``take`` lifted (or a new rank's) on the calling thread, which
    holds torch's defaults."""
    if s is CLEAN:
        return
    if s.__class__ is _Generator:
        _default_gen.set_state(s.rng)
        return
    if s.inference is not None:
        guard, s.inference = s.inference, None
        guard.__exit__(None, None, None)
    if s.rng is not None:
        _default_gen.set_state(s.rng)
    elif s.seed is not None:  # a rank's first turn: its generator starts from its seed
        _default_gen.manual_seed(s.seed)
        s.seed = None
    for m in s.fmodes:
        _fn_push(m)
    for m in s.dmodes:
        _d_push(m)
    for pack, unpack in s.hooks:
        _h_push(pack, unpack)
    if s.autocast:
        for dev, on, dt in s.autocast:
            torch.set_autocast_dtype(dev, dt)
            torch.set_autocast_enabled(dev, on)
    if not s.grad:
        torch.set_grad_enabled(False)


def guards() -> tuple:
    """What torch's C++ guards set per thread and ``take`` cannot move: the dispatch keys
    included and excluded locally (code compiled by torch.compile runs below autograd
    with them changed), and whether a torch.func transform is active."""
    return (_excluded(), _included(), _functorch())


def inside_guard(baseline: tuple) -> str | None:
    """What the calling rank is inside of that a switch to another rank would leak into
    it (compared with ``baseline``, the thread's ``guards()`` between ranks), or None."""
    ex, inc, fn = guards()
    if fn and not baseline[2]:
        return "a torch.func transform (grad, vmap, ...)"
    if ex != baseline[0] or inc != baseline[1]:
        return "code that runs below autograd or with dispatch keys changed (a function " \
               "compiled with torch.compile, a custom op's kernel)"
    return None


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vmap, ...) is active on the calling thread."""
    return _functorch()


def saved_tensor_hooks() -> tuple | None:
    """The innermost saved-tensor hooks of the calling thread (pack, unpack), if any."""
    return _h_top(True)
