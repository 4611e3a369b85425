"""spmd functions under ``torch.compile``: each call is one opaque node of the graph.

A per-rank spmd function reads its rank from the thread it runs on, plans its messages
from it, validates data, and moves tensors. If dynamo traced that Python, the plan of the
rank that compiled first would be baked into a graph that, on a threads mesh, every
rank then reuses. So dynamo never traces it. Under ``torch.compile`` a function
decorated with ``graph_op`` becomes one call of the custom op ``spmd::graph_op``:

- the graph holds only rank-independent facts: a handle to (function, its non-tensor
  arguments, which tensors need gradients), fixed at trace time, and the output shapes
  its ``meta`` derives from the local input shapes alone;
- at run time the op runs the eager function on the calling rank, with the rank
  context of that thread and every check of the eager path (nothing is given up);
- its backward is a second op that replays the eager function's own backward, recorded
  by ``torch.func.vjp`` in the forward and kept on the forward's token tensor, so it
  lives exactly as long as the autograd graph that may use it. Where ``torch.func``
  cannot record (the forward runs inside a TorchDispatchMode: AOTAutograd checks the
  first call of a compiled graph with one), the forward runs plainly and the backward
  recomputes it with ``torch.func.vjp``: one extra forward's messages, on every rank
  alike, since every rank runs the same compiled graph.

A call ``meta`` cannot describe (an output shape that depends on other ranks' sizes, a
tensor inside a list) runs the eager function under ``torch.compiler.disable``: a graph
break, never a baked plan.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core._local import RankLocal
from ..core._context import current
from ..core.errors import SpecError
from ..core.mesh import Mesh, mesh_by_uid
from ..core.spec import P

__all__ = ["graph_op", "Meta", "like_input", "like_query", "prepare"]

Meta = Callable[..., "Sequence[tuple[Sequence[int], torch.dtype]] | None"]

# handle -> _Entry; handles are fixed at trace time and baked into graphs
_entries: list[_Entry] = []
_index: dict[tuple, int] = {}


def _encode(v: Any) -> Any:
    """A non-tensor argument as a constant dynamo can hand to ``_handle``: a Mesh by its
    uid, a P as a plain tuple; ``...``-tagged, a tag no real argument carries."""
    if isinstance(v, Mesh):
        return (..., "mesh", v._uid)
    if isinstance(v, P):
        return (..., "P", tuple(v))
    if isinstance(v, list) and not any(isinstance(t, (torch.Tensor, list, dict)) for t in v):
        return tuple(v)  # sizes=[4, 3]: spmd takes any sequence
    return v


def _decode(v: Any, xs: Sequence[torch.Tensor]) -> Any:
    if not (isinstance(v, tuple) and len(v) == 3 and v[0] is ...):
        return v
    kind, val = v[1], v[2]
    if kind == "tensor":
        return xs[val]
    return mesh_by_uid(val) if kind == "mesh" else P(*val)


class _Entry:
    __slots__ = ("fn", "meta", "args", "kwargs", "inputs", "grad", "outputs", "name", "diff")

    def __init__(self, fn, meta, args, kwargs, inputs, grad, outputs):
        self.fn, self.meta, self.args, self.kwargs = fn, meta, args, kwargs
        self.inputs, self.grad, self.outputs = inputs, grad, outputs
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.diff = [i for i, g in enumerate(grad) if g]  # the inputs that get gradients

    def _bound(self, xs: Sequence[torch.Tensor]) -> tuple[list, dict]:
        return ([_decode(a, xs) for a in self.args],
                {k: _decode(v, xs) for k, v in self.kwargs})

    def call(self, xs: Sequence[torch.Tensor]) -> Any:
        args, kwargs = self._bound(xs)
        return self.fn(*args, **kwargs)

    def shapes(self, xs: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        args, kwargs = self._bound(xs)
        return [(tuple(s), d) for s, d in self.meta(*args, **kwargs)]

    def primal(self, xs: Sequence[torch.Tensor], probe: bool = False) -> Callable:
        """The call as a function of its differentiable inputs (the others as in ``xs``),
        for ``torch.func.vjp``; ``probe``: first fail with _NoRecording where torch.func
        cannot record."""
        def f(*d):
            if probe:
                try:
                    d[0].view(d[0].shape)  # a no-op that fails at once where it cannot
                except RuntimeError as err:
                    raise _NoRecording from err
            full = list(xs)
            for i, t in zip(self.diff, d):
                full[i] = t
            return tuple(_outputs(self, self.call(full)))
        return f


def _handle(fn: Callable, meta: Meta, args: tuple, kwargs: tuple, inputs: tuple,
            grad: tuple, outputs: int) -> int:
    key = (fn, meta, args, kwargs, inputs, grad, outputs)
    h = _index.get(key)
    if h is None:
        h = _index[key] = len(_entries)
        _entries.append(_Entry(*key))
    return h


# ``_handle`` as dynamo must see it: run at trace time, its result a constant. Marking
# it imports torch._dynamo (a second, at the time of writing), so it is done only once
# something else has imported dynamo (``torch.compile`` does, before it traces).
_traced_handle: Callable | None = None


# A fingerprint of spmd's source, an argument of every graph_op call. torch's compile
# caches (on disk, across processes) key a graph by what dynamo traced, not by the
# autograd formula registered below nor the ``meta`` that shaped its buffers, so
# without it a cached graph of an older spmd could run with this one.
_BUILD = 0


def prepare() -> None:
    """Get ready for tracing if torch.compile is in use (cheap; shard_map calls it)."""
    global _traced_handle, _BUILD
    if _traced_handle is None and "torch._dynamo" in sys.modules:
        h = hashlib.sha256()
        for f in sorted(Path(__file__).parents[1].rglob("*.py")):  # about 5 ms, once
            h.update(f.read_bytes())
        _BUILD = int(h.hexdigest()[:12], 16)
        _traced_handle = torch.compiler.assume_constant_result(_handle)


def _eager_then_prepare(fn: Callable, args: tuple, kwargs: dict) -> Any:
    prepare()
    return fn(*args, **kwargs)


def graph_op(meta: Meta, outputs: int = 1) -> Callable[[Callable], Callable]:
    """Make a per-rank spmd function one node of a ``torch.compile`` graph.

    ``meta(*args, **kwargs)`` gets the call's arguments (tensors as fake tensors, or
    only their shapes read) and returns one ``(shape, dtype)`` per output, computed
    from this rank's local shapes and the non-tensor arguments alone, or None where
    that is not possible (the call then runs eagerly, a graph break). ``outputs``: how
    many tensors the function returns (1: a tensor, more: a tuple). Outside
    ``torch.compile`` the function runs as written.
    """
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return _traced(fn, meta, outputs, args, kwargs)
            return fn(*args, **kwargs)
        return call
    return wrap


def _traced(fn, meta, outputs, args, kwargs):
    tensors: list[torch.Tensor] = []

    def slot(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return (..., "tensor", len(tensors) - 1)
        return _encode(v)

    targs = tuple(slot(a) for a in args)
    tkw = tuple((k, slot(v)) for k, v in kwargs.items())
    if (_traced_handle is None or not tensors or not _static(targs, tkw)
            or meta(*args, **kwargs) is None):
        # a graph break, never a baked plan (and, if dynamo was imported after the last
        # shard_map call, ready for the recompile the changed global causes)
        return torch.compiler.disable(_eager_then_prepare)(fn, args, kwargs)
    grad = tuple(torch.is_grad_enabled() and t.requires_grad for t in tensors)
    inputs = tuple((t.ndim, t.dtype, t.device) for t in tensors)
    h = _traced_handle(fn, meta, targs, tkw, inputs, grad, outputs)
    got = torch.ops.spmd.graph_op(tensors, h, [_forward.token], _BUILD)
    _forward.token = got[-1]  # dynamo tracks this: the next op's input, an edge
    outs = got[:-2]
    return outs[0] if outputs == 1 else tuple(outs)


def _static(args: tuple, kwargs: tuple) -> bool:
    """Whether the non-tensor arguments can key a handle: hashable, no tensor inside."""
    for v in itertools.chain(args, (v for _, v in kwargs)):
        if isinstance(v, (list, dict, set)):
            return False
        if isinstance(v, tuple) and any(isinstance(t, torch.Tensor) for t in v):
            return False
    try:
        hash((args, kwargs))
    except TypeError:
        return False
    return True


def like_input(x: Any, *args: Any, **kwargs: Any) -> list | None:
    """``meta`` of a function whose one output is shaped like its first argument."""
    return [(x.shape, x.dtype)] if isinstance(x, torch.Tensor) else None


def like_query(q: Any, k: Any, v: Any, *args: Any, seq_dim: int = -2, **kwargs: Any):
    """``meta`` of attention: q's shape with v's head size, where q and k agree on every
    dim but the sequence and the head size (no head broadcast)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.ndim != k.ndim:
        return None
    sd = seq_dim % q.ndim
    if any(q.shape[d] != k.shape[d] for d in range(q.ndim - 1) if d != sd):
        return None
    return [((*q.shape[:-1], v.shape[-1]), q.dtype)]


# -- the custom ops ----------------------------------------------------------------------


class _NoRecording(Exception):
    """torch.func cannot record here (the forward runs inside a TorchDispatchMode)."""


@torch.library.custom_op("spmd::graph_op", mutates_args=())
def _graph_op(xs: list[torch.Tensor], h: int, after: list[torch.Tensor],
              build: int) -> list[torch.Tensor]:
    # returns the outputs, the token that keeps the record, and a chain token; ``after``
    # is the chain token of the op before it, an input only to order it (see _Chain);
    # ``build``: _BUILD, unused at run time
    e = _entries[h]
    token = torch.zeros((), dtype=torch.int64)
    if e.diff:
        outs = _record(e, xs, token)
        # What the record keeps must be ours: the compiled graph reuses a buffer's
        # memory once its last use has run. The record saved copies of the inputs;
        # the eager backward may save the outputs too (ring attention does), so the
        # graph gets copies of those (contiguous, as the fake outputs are).
        got = [o.clone(memory_format=torch.contiguous_format) for o in outs]
    else:
        outs = _outputs(e, e.call(xs))
        # contiguous, as the fake outputs are; never an alias of an input
        got = [_unaliased(o.contiguous(), xs) for o in outs]
    _check(e, xs, outs)
    return got + [token, _new_token()]


@_graph_op.register_fake
def _(xs, h, after, build):
    e = _entries[h]
    outs = [xs[0].new_empty(s, dtype=d) for s, d in e.shapes(xs)]
    return outs + [_new_token(), _new_token()]


def _new_token() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device="cpu")


def _record(e: _Entry, xs: list[torch.Tensor], token: torch.Tensor) -> list[torch.Tensor]:
    """Run the call, keeping on ``token`` what its backward needs; returns its outputs."""
    xs = [x.clone() for x in xs]  # see _graph_op: the record's inputs are its own
    rc = current(e.name)
    try:
        outs, vjp = torch.func.vjp(e.primal(xs, probe=True), *[xs[i] for i in e.diff])
        token.spmd_backward = ("vjp", vjp, rc)
    except _NoRecording:
        outs = tuple(_outputs(e, e.call(xs)))
        token.spmd_backward = ("recompute", xs, rc)
    token.spmd_outs = [(o.shape, o.dtype, o.device) for o in outs]
    return list(outs)


def _outputs(e: _Entry, out: Any) -> list[torch.Tensor]:
    outs = [out] if e.outputs == 1 else list(out)
    if len(outs) != e.outputs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"{e.name}: under torch.compile it must return {e.outputs} "
                        f"tensor(s), got {type(out).__name__}")
    return outs


def _check(e: _Entry, xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """The shapes the graph was compiled for are the ones the eager function made."""
    want = e.shapes(xs)
    got = [(tuple(o.shape), o.dtype) for o in outs]
    if got != want:
        raise SpecError(f"{e.name} under torch.compile: made {got} on this rank, but its "
                        f"meta promised {want}; run it outside torch.compile (a bug: "
                        f"please report it)")


def _unaliased(o: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
    # a custom op's output may not alias its input (an identity at width 0, a no-op psum)
    # or another output; an empty tensor aliases nothing
    p = o.untyped_storage().data_ptr()
    if p and any(x.untyped_storage().data_ptr() == p for x in xs):
        return o.clone()
    return o


@torch.library.custom_op("spmd::graph_op_backward", mutates_args=())
def _graph_op_backward(token: torch.Tensor, grads: list[torch.Tensor | None], h: int,
                       sizes: list[int], after: list[torch.Tensor]) -> list[torch.Tensor]:
    # ``after``: the chain token of the backward that autograd ran just before this
    # one; taking it as an input is what orders this op after it (see _Chain)
    e = _entries[h]
    saved = getattr(token, "spmd_backward", None)
    if saved is None:
        raise SpecError(f"{e.name} under torch.compile: its backward ran twice, or its "
                        f"forward's record was lost; use retain_graph=False and one backward")
    how, what, rc = saved
    token.spmd_backward = None  # once, as autograd frees its buffers
    gs = [torch.zeros(s, dtype=d, device=dev) if g is None else g
          for g, (s, d, dev) in zip(grads, token.spmd_outs)]
    with rc:
        if how == "recompute":
            _, what = torch.func.vjp(e.primal(what), *[what[i] for i in e.diff])
        got = what(tuple(gs))
    outs: list[torch.Tensor] = []
    for g in got:  # nor may a gradient alias an incoming one, or another gradient
        outs.append(_unaliased(g.contiguous(), [*gs, *outs]))
    return outs + [_new_token()]


@_graph_op_backward.register_fake
def _(token, grads, h, sizes, after):
    # one gradient per input that needs one: its shape from the flat ``sizes``
    out, at = [], 0
    for (nd, dtype, device), g in zip(_entries[h].inputs, _entries[h].grad):
        if g:
            out.append(torch.empty(sizes[at:at + nd], dtype=dtype, device=device))
            at += nd
    return out + [_new_token()]


class _Chain:
    """The order every rank starts its collectives in, as data the compiler must keep.

    Every rank must start its collectives in the same order. Ranks with uneven shards
    run graphs compiled apart, and inductor orders what no data orders by its own
    heuristics, which depend on shapes: with an empty shard (every tensor a known
    zero) it was seen to run two independent convs' forwards, and a halo_pad's and
    a conv's backwards, in another order than its peers did. A swap of two
    collectives of one shape would go unnoticed: a silently wrong result. Ordered
    effects do not prevent this in torch 2.13. So each op takes a chain token of the
    op before it as an input:

    - forward, ``_forward.token`` holds the last op's token; dynamo tracks the
      attribute, so within a graph each op's input is its predecessor's output (and
      between graphs, which run in program order anyway, it carries the last one on);
    - backward, the ops of one traced graph join a ``_Chain`` in the order autograd
      ran their formulas at trace time (on fake tensors: an order that comes from the
      graph, the same on every rank), and each takes the last one's token.
    """
    __slots__ = ("last", "used")

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.used = False


class _ForwardToken:
    __slots__ = ("token",)

    def __init__(self) -> None:
        # a tensor from the start: dynamo guards on what it reads, and None would
        # recompile once the first graph stores a token
        self.token = _new_token()


_forward = _ForwardToken()
_local = RankLocal()  # per rank thread: the chain the next forward joins


def _forward_chain() -> _Chain:
    # A forward joins the chain of the forwards before it until a backward has used
    # that chain: a graph is traced forward first, then backward, so a new trace
    # never reaches an old trace's tokens.
    c = _local.get("chain")
    if c is None or c.used:
        c = _local.chain = _Chain()
    return c


def _setup(ctx, inputs, output):
    xs, h, after, _ = inputs
    ctx.h, ctx.after = h, len(after)
    ctx.sizes = [s for x, g in zip(xs, _entries[h].grad) if g for s in x.shape]
    ctx.chain = _forward_chain()
    ctx.save_for_backward(output[-2])


def _backward(ctx, grads):
    (token,) = ctx.saved_tensors
    e, chain = _entries[ctx.h], ctx.chain
    after = [] if chain.last is None else [chain.last]
    got = torch.ops.spmd.graph_op_backward(token, list(grads[:-2]), ctx.h, ctx.sizes,
                                           after)
    chain.last, chain.used = got[-1], True
    it = iter(got[:-1])
    return [next(it) if g else None for g in e.grad], None, [None] * ctx.after, None


_graph_op.register_autograd(_backward, setup_context=_setup)
# Ordered effects: torch.compile keeps these ops in program order forward (every rank
# must start its collectives in the same order, and ranks with uneven shards run graphs
# compiled apart); backward, _Chain orders them, as torch 2.13 does not order effects
# there.
if hasattr(torch.library, "EffectType"):  # torch >= 2.9
    _graph_op.register_effect(torch.library.EffectType.ORDERED)
    _graph_op_backward.register_effect(torch.library.EffectType.ORDERED)
