"""What the windowed ops share: the input's layout, the output partition, and fetching
each rank's input window.

Every windowed op (convolution, pooling, interpolation, padding) is exact for the same
reason: the output is partitioned first (``out_sizes``), and each rank then asks for
exactly the global input range its outputs read (``fetch``). That range can be wider
than the shard (a halo, possibly from several ranks away), narrower (a trim), or
empty; positions outside the global input follow the op's padding mode.

Memory (docs/design.md): ``windowed`` runs the op on the window but keeps for backward only
the shard and the halo slabs that arrived, never the padded window, and writes the input
gradient into the window's gradient in place.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch

from ..collectives._anchor import anchor
from ..collectives.vjp import custom_vjp, needs_input_grad
from ..comm import gather_ints
from ..core._context import RankContext, static_layout, static_mismatch
from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout, balanced_sizes
from ..core.mesh import Mesh
from ..core.provenance import check_spec
from ..core.spec import P, as_spec
from ..transforms.halo import (
    Fetch,
    assemble,
    check_mode,
    exchange,
    fetch_range,
    fetch_window,
    plan_fetch,
    transpose,
    unfetch,
)
from ..transforms.spec_arg import spec_arg, takes_sharded

__all__ = ["input_layout", "out_sizes", "fetch", "plan", "windowed", "member_ranges",
           "with_layout"]


def input_layout(x: torch.Tensor, mesh: Mesh, spec: Any, what: str) -> tuple[RankContext, Layout]:
    """This rank's context and ``x``'s global layout.

    ``spec`` is read by ``spec_arg`` (``transforms/spec_arg.py``): a ``Layout`` is
    checked against ``x`` and used, no communication; for a ``P`` the ranks of the
    spec's axes exchange their local shapes (one small int64 all_gather), so uneven
    shards need no extra arguments.
    """
    arg = spec_arg(x, mesh, spec, what)
    rc, spec = arg.rc, arg.spec
    if arg.layout is not None:
        return rc, arg.layout
    axes = spec.axes
    if not axes:
        return rc, _agrees(x, Layout(x.shape, spec, mesh), what)

    def exchange() -> Layout:
        group = mesh.group(axes, rc.rank)
        got = gather_ints(mesh, group, x.shape, name=f"{what} sizes", device=x.device)
        return _from_shapes(tuple(zip(group.ranks, got)), spec, _MeshOf(mesh), what)

    def check(lay: Layout) -> None:
        if lay.local_shape(rc.rank) != tuple(x.shape):
            raise static_mismatch(what, list(x.shape), list(lay.local_shape(rc.rank)), rc.rank)

    lay = static_layout(mesh, ("input_layout", what, spec, x.ndim), exchange, check)
    return rc, _agrees(x, lay, what)


def _agrees(x: torch.Tensor, lay: Layout, what: str) -> Layout:
    """``lay``, checked against the layout shard_map split ``x`` by, where it marked it
    (``core/provenance.py``). Every rank holds the same mark and spec, so every rank
    raises alike."""
    check_spec(x, lay, None, what)
    return lay


@lru_cache(maxsize=256)
def _from_shapes(shapes: tuple, spec: P, mesh: Any, what: str) -> Layout:
    """The layout the gathered local shapes imply (cached: a model calls its layers with
    the same shapes every step)."""
    lay = Layout.from_local_shapes(dict(shapes), spec, mesh)
    for r, shp in shapes:  # every rank sees the same shapes: the same error
        if shp != lay.local_shape(r):
            d = next(i for i, (a, b) in enumerate(zip(shp, lay.local_shape(r))) if a != b)
            raise SpecError(
                f"{what}: x is {list(shp)} on rank {r} but {list(lay.local_shape(r))} is "
                f"expected there (dim {d} is not split by {spec!r}, so every rank of "
                f"{spec.axes} must hold all of it)")
    return lay


def out_sizes(layout: Layout, dim: int, n_out: int, keep: bool) -> tuple[int, ...] | None:
    """How the output's ``dim`` (``n_out`` long) is split: as the input when ``keep``
    (a stride-1 op that preserves the length: pure halo exchange), else balanced."""
    sizes = layout.sizes[dim]
    if sizes is None:
        return None
    if keep and n_out == layout.shape[dim]:
        return sizes
    return balanced_sizes(n_out, len(sizes))


def member_ranges(o_sizes: Sequence[int],
                  window: Callable[[int, int], tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Each member's input range: ``window(o0, o1)`` for its output rows ``[o0, o1)``,
    an empty range where it has no output rows."""
    out, o0 = [], 0
    for k in o_sizes:
        if k == 0:
            out.append((0, 0))
        else:
            a, b = window(o0, o0 + k)
            out.append((a, max(a, b)))
        o0 += k
    return tuple(out)


def fetch(x: torch.Tensor, rc: RankContext, layout: Layout, dim: int,
          ranges: tuple[tuple[int, int], ...], mode: str = "constant",
          value: float = 0.0, *, name: str) -> torch.Tensor:
    """This rank's input window along ``dim``, differentiable: ``ranges`` has one global
    range per member of the axes splitting ``dim`` (one entry for an unsplit dim)."""
    axes, sizes = _split(layout, dim)
    return fetch_range(x, rc, axes, dim, sizes, ranges, mode=mode, value=value, name=name)


def plan(rc: RankContext, layout: Layout, dim: int, ranges: tuple[tuple[int, int], ...],
         mode: str = "constant", value: float = 0.0, *, name: str) -> Fetch:
    """``fetch`` as data, for ``windowed``."""
    axes, sizes = _split(layout, dim)
    return plan_fetch(rc, axes, dim, sizes, ranges, mode=mode, value=value, name=name)


def _split(layout: Layout, dim: int) -> tuple[tuple[str, ...] | None, tuple[int, ...]]:
    """The axes splitting ``dim`` (None if unsplit) and the shard sizes along it."""
    return layout.dim_axes(dim) or None, layout.sizes[dim] or (layout.shape[dim],)


# -- windowed: an op on the fetched window that saves the shard and the halo, not the window ----

Forward = Callable[..., Any]
Backward = Callable[[torch.Tensor, tuple, torch.Tensor, tuple], tuple]


def windowed(x: torch.Tensor, fetches: Sequence[Fetch], forward: Forward, *params: Any,
             backward: Backward | None = None, reads_input: bool = True,
             saves: bool = False) -> Any:
    """``forward(window, *params)``, where ``window`` is ``x`` fetched along each of
    ``fetches`` in turn (a later fetch reads the halos of the earlier ones: corners).

    Autograd keeps what one device would keep of ``x`` (``x`` itself, which a previous
    layer usually keeps already) plus the halo slabs that arrived, never the padded
    window; backward rebuilds the window from them without communication, runs the op's
    backward and sends the halo's cotangents home (added into the shard's part of the
    window's cotangent in place: no shard-sized copy).

    Args:
        forward: the local op, differentiable torch code; it returns a tensor or a tuple
            whose first element is the one differentiated (the others, e.g. indices,
            get no gradient).
        params: further inputs of ``forward`` (weights, bias; None allowed).
        backward: ``backward(window, params, g, needs) -> (g_window, *g_params)`` (None
            where ``needs`` is False), the op's VJP without recomputing its forward;
            default: the forward recomputed under autograd.
        reads_input: whether the backward reads the window's values. If not, nothing of
            ``x`` is kept and ``backward`` gets a meta tensor of the window's shape.
        saves: ``forward`` returns ``(out, saved)``: ``saved`` (say, the argmax of a max
            pool) is kept, and ``backward(window, params, g, needs, saved)`` gets it and
            a meta window, so the window is neither rebuilt nor recomputed; ``x`` is
            kept (if ``reads_input``) only for a differentiable backward.

    Backward with grad mode on (``create_graph=True``, ``torch.func``) recomputes the
    forward through the differentiable fetch and differentiates that, so higher
    derivatives are exact too (at the cost of a second halo exchange).
    """
    if fetches:
        x = anchor(x)  # every rank must run the fetches' backward: an autograd node each
    op = _Op(forward, backward, reads_input, saves)
    return _windowed(x, tuple(fetches), op, *params)


@dataclass(frozen=True)
class _Op:
    """What ``windowed`` runs: see its arguments."""
    full: Forward
    backward: Backward | None
    reads_input: bool
    saves: bool

    def forward(self, *args: Any) -> Any:
        """The op's output alone (what it saves for backward left out)."""
        out = self.full(*args)
        return out[0] if self.saves else out


def _window_of(x: torch.Tensor, fetches: Sequence[Fetch],
               recvs: Sequence | None = None) -> tuple[torch.Tensor, list]:
    """The window (exchanging along each fetch, or reusing ``recvs``: no communication)
    and what arrived."""
    got = []
    for i, f in enumerate(fetches):
        r = exchange(x, f) if recvs is None else recvs[i]
        x = assemble(x, r, f)
        got.append(r)
    return x, got


def _windowed_primal(x, fetches, op, *params):
    return op.forward(_window_of(x, fetches)[0], *params)


_windowed = custom_vjp(_windowed_primal, nondiff_argnums=(1, 2))


def _windowed_fwd(x, fetches, op, *params):
    win, recvs = _window_of(x, fetches)
    out, saved = op.full(win, *params) if op.saves else (op.full(win, *params), None)
    keep = (x, recvs) if op.reads_input else (None, None)
    meta = (tuple(x.shape), tuple(win.shape))
    return out, (*keep, params, saved, meta)


def _windowed_bwd(fetches, op, res, g):
    x, recvs, params, saved, (x_shape, win_shape) = res
    needs = tuple(isinstance(p, torch.Tensor) and n
                  for p, n in zip(params, needs_input_grad()[3:]))
    g = g[0] if isinstance(g, tuple) else g
    if torch.is_grad_enabled():  # create_graph or torch.func: differentiable all the way
        return vjp_through(x, x_shape, fetches, op.forward, params, needs, g)
    if g.numel() == 0:  # no output here: zero gradients (this rank still sends halos home)
        gwin = g.new_zeros(win_shape)
        gp = [torch.zeros_like(p) if n else None for p, n in zip(params, needs)]
    elif op.saves:
        gwin, *gp = op.backward(torch.empty(win_shape, dtype=g.dtype, device="meta"), params,
                                g, needs, saved)
    else:
        win = (_window_of(x, fetches, recvs)[0] if op.reads_input
               else torch.empty(win_shape, dtype=g.dtype, device="meta"))
        gwin, *gp = (op.backward or partial(_recompute, op.forward))(win, params, g, needs)
        del win  # the rebuilt window goes before the halo exchange
    # A cotangent the backward made is changed in place; one aliasing g is not ours.
    owned = gwin.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    for f in reversed(fetches):
        gwin = transpose(gwin, f, owned=owned)
    return (gwin, *gp)


_windowed.defvjp(_windowed_fwd, _windowed_bwd)


def _recompute(forward: Forward, win: torch.Tensor, params: tuple, g: torch.Tensor,
               needs: tuple) -> tuple:
    """The default backward: ``forward`` again on the rebuilt window, under autograd."""
    with torch.enable_grad():
        wd = win.detach().requires_grad_()
        ps = [p.detach().requires_grad_() if n else p for p, n in zip(params, needs)]
        out = forward(wd, *ps)
        y = out[0] if isinstance(out, tuple) else out
        ins = [wd, *(p for p, n in zip(ps, needs) if n)]
        got = iter(torch.autograd.grad(y, ins, g, allow_unused=True, materialize_grads=True)
                   if y.requires_grad else [torch.zeros_like(t) for t in ins])
    gwin = next(got)
    return (gwin, *(next(got) if n else None for n in needs))


def vjp_through(x: torch.Tensor | None, x_shape: Sequence[int], fetches: Sequence[Fetch],
                forward: Forward, params: tuple, needs: tuple, g: torch.Tensor) -> tuple:
    """The backward as a differentiable function of x, the params and g: the window
    fetched again (differentiable: its backward is the transpose, whose backward is the
    fetch), the op's VJP by torch.func.vjp (which also nests under torch.func's
    transforms), and the transposes, differentiable too. A linear op kept no x: its
    VJP does not read it.

    Every rank's graph must hold the same collectives: the window's cotangent is tied
    to the window and to ``g`` with exact zeros, so a second backward reaches the same
    fetches on every rank, whatever the op's own double backward does (max_pool's reads
    its input on some ranks and not on others; an empty output may read nothing)."""
    win = g.new_zeros(x_shape) if x is None else x
    for f in fetches:
        win = fetch_window(win, f)
    diff = [i for i, n in enumerate(needs) if n]

    def op(w, *ps):
        full = list(params)
        for i, p in zip(diff, ps):
            full[i] = p
        out = forward(w, *full)
        return out[0] if isinstance(out, tuple) else out

    _, vjp = torch.func.vjp(op, win, *(params[i] for i in diff))
    gwin, *gp = vjp(g)
    gwin = gwin + _zero(win) + _zero(g)
    for f in reversed(fetches):
        gwin = unfetch(gwin, f)
    got = iter(gp)
    return (gwin, *(next(got) if n else None for n in needs))


def _zero(t: torch.Tensor) -> torch.Tensor:
    """An exact 0 that depends on ``t`` (even where ``t`` holds -inf padding)."""
    return t.flatten()[:0].sum()


def narrowed(t: torch.Tensor, cuts: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """``t`` narrowed by each ``(dim, start, length)`` of ``cuts`` in turn (a view)."""
    for dim, start, length in cuts:
        t = t.narrow(dim, start, length)
    return t


def my_range(layout: Layout, rank: int, dim: int,
             ranges: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    return ranges[layout.shard_index(rank, dim) if layout.sizes[dim] is not None else 0]


def mode_error(what: str, n: int, lo: int, hi: int, mode: str, dim: int,
               shape: Sequence[int]) -> None:
    """Raise torch's error type where ``F.pad`` would refuse ``mode`` on one device."""
    why = check_mode(n, lo, hi, mode)
    if why is not None:
        raise RuntimeError(f"{what}: padding ({lo}, {hi}) at dim {dim} of the global input "
                           f"{list(shape)}: {why}")


def out_layout(layout: Layout, shape: Sequence[int], sizes: dict[int, tuple[int, ...] | None]) -> Layout:
    """The output layout: same spec, new global shape; split dims as ``sizes`` says,
    the others split as the input."""
    given = {d: s for d, s in enumerate(layout.sizes) if s is not None}
    given.update({d: s for d, s in sizes.items() if s is not None})
    return Layout(shape, layout.spec, _MeshOf(layout), given or None)


class _MeshOf:
    """Axis names and shape of a mesh or layout: all a Layout needs, hashable."""

    def __init__(self, of: Any):
        self.axis_names = tuple(of.axis_names)
        self.shape = tuple(of.mesh_shape if isinstance(of, Layout) else of.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MeshOf) and (self.axis_names, self.shape) == (
            other.axis_names, other.shape)

    def __hash__(self) -> int:
        return hash((self.axis_names, self.shape))


def refuse_split(layout: Layout | Any, dims: Sequence[int], what: str, why: str) -> None:
    """A SpecError, before any communication, if ``layout`` (a Layout or a spec) splits
    one of ``dims``."""
    spec = layout.spec if isinstance(layout, Layout) else as_spec(layout)
    for d in dims:
        if spec.entry(d) is not None:
            raise SpecError(f"{what}: the spec {spec!r} splits dim {d} ({why}); keep it whole "
                            f"(None in the spec) and split a spatial or batch dim instead")


def link(out: torch.Tensor, *tensors: torch.Tensor | None) -> torch.Tensor:
    """``out`` made to depend (with zero gradient) on ``tensors``.

    A rank whose output window is empty still ran the input fetch, whose backward is a
    collective the other ranks wait for; its output must reach that node (and the
    weights, so every rank's gradients have the same structure)."""
    for t in tensors:
        if t is not None and t.requires_grad:
            out = out + t.sum() * 0
    return out


def check_ndim(x: torch.Tensor, n: int, what: str) -> None:
    if x.ndim != n + 2:
        raise SpecError(f"{what}: expected a batched input (N, C, {n} spatial dims), got "
                        f"{describe(x)}; add the batch dim with x[None] (and None in the spec)")


# How an op's arguments give its output_layout's: weight_shape from the weight (convs),
# head_dim_v from v (attention).
_RENAMES = {"weight_shape": lambda a: a["weight"].shape, "head_dim_v": lambda a: a["v"].shape[-1]}


def with_layout(fn: Callable) -> Callable[[Callable], Callable]:
    """Decorator: attach ``fn`` as the ``output_layout`` of the op it decorates, so users
    can ask for the output layout before running the op; and let the op take a
    ``spmd.Sharded`` (its result is then a Sharded of that layout)."""
    def attach(op: Callable) -> Callable:
        op.output_layout = fn
        return takes_sharded(renames=_RENAMES, also=("k", "v"))(op)
    return attach


def ntuple(v: Any, n: int, name: str, what: str) -> tuple[int, ...]:
    """``v`` as ``n`` ints (one int repeats), as torch accepts it."""
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    if isinstance(v, (tuple, list)) and len(v) == 1 and n > 1:
        v = tuple(v) * n
    if (isinstance(v, (tuple, list)) and len(v) == n
            and all(isinstance(e, int) and not isinstance(e, bool) for e in v)):
        return tuple(v)
    raise SpecError(f"{what}: {name} must be an int or {n} ints, got {v!r}")
