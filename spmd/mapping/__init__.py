"""``shard_map``: run a per-shard function on every rank, as one differentiable call.

Two drivers share the spec handling:

* Global view (a threads mesh called from ordinary code): arguments are global
  tensors; each rank thread runs ``f`` on its shards; outputs are assembled into global
  tensors. The whole call is ONE autograd node whose backward runs every rank's
  backward on the rank threads, so collectives in backward meet as in forward.
* Per-rank view (torch processes, or code already on a rank thread): every rank calls
  it with the same global arguments; outputs are all-gathered so every rank returns
  the global tensors; gradients of inputs and of closed-over parameters are summed
  over the mesh in backward, so every rank ends with the single-device gradients.

The boundary rules (docs/design.md): an input replicated over axes A gets its gradient
summed over A; an output replicated over A has its cotangent divided by |A|.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..collectives.compiled import prepare
from ..comm import comm_of, validating
from ..comm._torch_state import functorch_active as _functorch
from ..comm.rank_threads import run_on_threads
from ..core import _tree
from ..core._context import RankContext, in_rank_of, refuse_sparse
from ..core._format import describe
from ..core._bodies import NO_TRACE, Body, bodies
from ..core._nesting import check_nested, refuse_nested_grad, spec_axes
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..core.provenance import MARK, mark, mark_value
from ..core.spec import P
from ..transforms.sharded import Sharded, cat_plan
from ._agreement import _check_call_agrees, _check_same_across
from ._graph import _Node, _next_node_number
from ._state import _State, _layout_for, _leaf_key, _shard_of, _sharded_layout

__all__ = ["shard_map"]

_NOTHING: list = []  # a call's trace where its body made no size exchange (never changed)


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any, *,
              check_rep: bool | None = None,
              params: Sequence[torch.Tensor] | None = None,
              static_layouts: bool = True) -> Callable:
    """Map ``f`` over the shards of its arguments on every rank of ``mesh``.

    Args:
        f: the per-shard function; it sees each rank's local shards and may call the
            collectives (``psum``, ``all_gather``, ...). An ``nn.Module`` works too.
        mesh: the mesh.
        in_specs: a pytree prefix of the argument tuple with ``P`` (or ``Layout`` for
            explicit uneven sizes, or None for replicated) leaves. Uneven shapes are
            split by the balanced rule.
        out_specs: a pytree prefix of ``f``'s output. A mesh axis missing from an
            output's spec claims the output is the same on every rank of that axis.
        check_rep: how that claim is verified (a rank whose copy differs is a
            ``SpecError`` naming it and the first index that differs). None (default):
            where it costs no message, on a threads mesh (and on processes under
            ``SPMD_VALIDATE=1``), the copies must agree within the dtype's float
            tolerance (the square root of its epsilon, relative to the output's largest
            magnitude: sums made in another order pass, a psum left out does not),
            other dtypes exactly. True: bit for bit, on processes too
            (one all_gather per such output). False: not verified (rank 0's copy
            is returned).
        params: tensors closed over by ``f`` that need gradients. Default: the
            parameters of ``f`` if it is an ``nn.Module``, else every leaf found in the
            ranks' autograd graphs (a closed-over non-leaf, such as ``sin(w)`` computed
            outside, is followed back to ``w``).
        static_layouts: layers in ``f`` given a ``P`` learn their inputs' uneven sizes
            from every rank's shape (one small all_gather each, a host synchronisation
            on GPUs) on the first call only; later calls with the same input layouts
            (and the same Python arguments) reuse what the same exchange learnt, with no
            communication (every rank decides alike: its decision uses no rank's shape).
            A rank whose shape then differs from last time raises. False: exchange on
            every call (bodies whose shapes depend on data).

    Returns:
        A function of global arguments returning global outputs.

    Raises:
        SpecError: nested in a shard_map body on the same mesh, with specs naming an
            axis the enclosing call names (its body holds shards along it).
        NotImplementedError: nested over other axes where a gradient is needed.

    Backward:
        ``loss.backward()`` in the caller gives the single-device gradients for the
        arguments and for the parameters ``f`` closes over.

    Example:
        >>> mesh = spmd.Mesh((4,), ("sp",))
        >>> f = spmd.shard_map(lambda x: spmd.psum(x.sum(), "sp"), mesh, P("sp"), P())
        >>> f(torch.arange(10.0))
        tensor(45.)
    """
    check_mesh(mesh, "shard_map")
    if not callable(f):
        raise TypeError(f"shard_map: f must be callable, got {describe(f)}")
    _check_spec_tree(in_specs, mesh, "in_specs")
    _check_spec_tree(out_specs, mesh, "out_specs")
    if params is None and isinstance(f, torch.nn.Module):
        params_fn = lambda: [p for p in f.parameters() if p.requires_grad]  # noqa: E731
    elif params is not None:
        params = list(params)
        params_fn = lambda: params  # noqa: E731
    else:
        params_fn = None
    sm = _ShardMap(f, mesh, in_specs, out_specs, check_rep, params_fn, static_layouts)

    def mapped(*args: Any) -> Any:
        prepare()  # a body compiled with torch.compile: spmd functions as graph ops
        if torch.compiler.is_compiling():
            # Dynamo cannot follow rank threads or processes' plans: the whole call runs
            # eagerly (a graph break). Compile the body instead: shard_map(torch.compile(f)).
            return torch.compiler.disable(sm)(args)
        return sm(args)

    mapped.__wrapped__ = f  # type: ignore[attr-defined]
    mapped.__doc__ = getattr(f, "__doc__", None)
    return mapped


def _check_spec_tree(specs: Any, mesh: Mesh, root: str) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(specs, is_leaf=_tree._is_spec_leaf,
                                                     none_is_leaf=True, namespace="spmd")
    for p, s in zip(paths, leaves):
        if isinstance(s, P):
            for a in s.axes:
                if a not in mesh.axis_names:
                    raise SpecError(f"{_tree.keystr(root, p)} = {s!r} names axis {a!r}, which "
                                    f"{mesh!r} does not have")
        elif isinstance(s, Layout):
            if not s.is_for(mesh):
                raise SpecError(f"{_tree.keystr(root, p)} is a Layout for another mesh "
                                f"({s!r}) than {mesh!r}")
        elif s is not None:
            raise SpecError(f"{_tree.keystr(root, p)} is {s!r}; specs must be spmd.P, "
                            f"spmd.Layout or None")


class _Signature:
    """What a call's argument structure decides, computed once per structure: the input
    layouts, the axes the body is mapped over, and where each rank's shard lies."""

    __slots__ = ("layouts", "axes_mapped", "cuts", "copies", "sharded", "flat")

    def __init__(self, mesh: Mesh, leaves: list, treedef: Any, layouts: list,
                 out_axes: frozenset):
        self.layouts = layouts
        used = out_axes | {a for lay in layouts if lay is not None for a in lay.spec.axes}
        self.axes_mapped = tuple(a for a in mesh.axis_names if a in used)
        self.sharded = [i for i, x in enumerate(leaves) if isinstance(x, Sharded)]
        # the arguments are a tuple of leaves: a rank's are tuple(leaves), no unflatten
        self.flat = treedef.num_nodes == treedef.num_leaves + 1
        # (leaf, layout, per rank: the (dim, start, length) narrows that cut its shard,
        # per rank: its provenance mark)
        self.cuts = [(i, lay, [tuple((d, lay.offsets(r)[d], lay.local_shape(r)[d])
                                     for d in lay.split_dims) for r in range(mesh.size)],
                      [mark_value(lay, lay.local_shape(r)) for r in range(mesh.size)])
                     for i, lay in enumerate(layouts)
                     if lay is not None and not isinstance(leaves[i], Sharded)]
        # Rank threads share the caller's tensors: a replica other than the first gets a
        # copy (made before any rank runs), so that an in-place op in the body acts once
        # on the caller's tensor, as on processes and on one device.
        self.copies = [(i, r) for i, lay in enumerate(layouts)
                       if lay is not None and mesh.backend == "threads" and lay.replicated_axes
                       for r in range(mesh.size)
                       if any(mesh.axis_index(a, r) for a in lay.replicated_axes)]


class _ShardMap:
    def __init__(self, f, mesh, in_specs, out_specs, check_rep, params_fn, static_layouts):
        self.f, self.mesh = f, mesh
        self.in_specs, self.out_specs = in_specs, out_specs
        self.check_rep, self.params_fn = check_rep, params_fn
        self.static_layouts = static_layouts
        # torch.compile's code runs under C++ guards a rank greenlet cannot leave to let
        # another rank run (comm/rank_greenlets.py): a compiled body runs on threads.
        compiled = getattr(f, "_torchdynamo_orig_callable", None) is not None or \
            type(f).__name__ == "OptimizedModule"
        self.schedule = "threads" if compiled else mesh.schedule
        self._traces: dict = {}  # (call key, rank) -> the last call's LayoutTrace entries
        self._trace_lock = threading.Lock()
        self._in_cache: dict = {}
        self._out_cache: dict = {}
        self._out_spec_cache: dict = {}
        self._out_axes = frozenset(spec_axes(out_specs))
        self._cat_plans: dict = {}

    def cat_plan(self, lay: Layout) -> Any:
        """How to concatenate the ranks' shards of ``lay`` (cached per layout)."""
        plan = self._cat_plans.get(lay)
        if plan is None:
            plan = self._cat_plans[lay] = cat_plan(lay, lay.owners())
            if len(self._cat_plans) > 64:
                self._cat_plans.pop(next(iter(self._cat_plans)))
        return plan

    # -- inputs ---------------------------------------------------------------------------

    def _in_layouts(self, args: tuple) -> tuple[list, Any, _Signature]:
        leaves, treedef = _tree.flatten(args)
        key = (treedef, tuple(_leaf_key(x) for x in leaves))
        hit = self._in_cache.get(key)
        if hit is None:
            specs = _tree.match_specs(self.in_specs, args, "in_specs", "args")
            layouts = []
            paths = optree.tree_paths(args, none_is_leaf=True, namespace="spmd")
            for path, x, s in zip(paths, leaves, specs):
                if isinstance(x, Sharded):
                    layouts.append(_sharded_layout(x, s, self.mesh, _tree.keystr("args", path)))
                elif isinstance(x, torch.Tensor):
                    refuse_sparse(x, f"shard_map: {_tree.keystr('args', path)}")
                    layouts.append(_layout_for(x, s, self.mesh, _tree.keystr("args", path)))
                else:
                    if s is not None and (not isinstance(s, P) or s.axes):
                        raise SpecError(f"in_specs for {_tree.keystr('args', path)} is {s!r} but "
                                        f"the argument is {describe(x)}, not a tensor; only "
                                        f"tensors can be split (use P() or None)")
                    layouts.append(None)
            hit = self._in_cache[key] = _Signature(self.mesh, leaves, treedef, layouts,
                                                   self._out_axes)
            if len(self._in_cache) > 64:
                self._in_cache.pop(next(iter(self._in_cache)))
        return leaves, treedef, hit

    def _trace_key(self, treedef: Any, leaves: list, layouts: list) -> Any:
        """What a call's size exchanges depend on, the same on every rank: the input
        layouts and the Python arguments; None where a call cannot be keyed."""
        if not self.static_layouts:
            return None
        plain = []
        for x, lay in zip(leaves, layouts):
            if lay is None and not isinstance(x, torch.Tensor):
                if not isinstance(x, (int, float, str, bool, type(None))):
                    return None  # an object whose effect on shapes we cannot key
                plain.append((type(x), x))
        return (treedef, tuple(layouts), tuple(plain))

    def _keep_trace(self, key: Any, entries: list) -> None:
        with self._trace_lock:  # rank threads finish together
            self._traces[key] = entries
            if len(self._traces) > 64 * self.mesh.size:
                self._traces.pop(next(iter(self._traces)), None)

    def _check_same_globals(self, leaves: list, args: tuple) -> None:
        """Under validation, per-rank on processes: every rank must pass the same global
        arguments (and ``params``), since each splits its own copy and keeps its shard.
        One all_gather of fingerprints; the same SpecError on every rank."""
        paths = optree.tree_paths(args, none_is_leaf=True, namespace="spmd")
        named = [(_tree.keystr("args", p), x) for p, x in zip(paths, leaves)]
        if self.params_fn is not None:
            named += [(f"params[{j}]", t) for j, t in enumerate(self.params_fn())]
        _check_same_across(self.mesh, named, "shard_map")

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, args: tuple) -> Any:
        if _functorch():
            _refuse_functorch()
        leaves, treedef, sig = self._in_layouts(args)
        layouts = sig.layouts
        grad_on = torch.is_grad_enabled()
        diff = [i for i, x in enumerate(leaves)
                if isinstance(x, torch.Tensor) and x.requires_grad] if grad_on else []
        per_rank = in_rank_of(self.mesh)
        # Nested in a body on this mesh: refused over the body's axes (specs only, the
        # same on every rank, before any message); over other axes, without gradients.
        outer = check_nested(self.mesh, self.in_specs, self.out_specs) if per_rank else ()
        if outer and grad_on and (diff or any(isinstance(x, Sharded) for x in leaves)
                                  or (self.params_fn is not None and self.params_fn())):
            refuse_nested_grad(self.mesh, outer)
        axes_mapped = sig.axes_mapped
        mine = [self.mesh.rank] if per_rank else list(range(self.mesh.size))
        sharded = sig.sharded
        named = self._check_sharded(args, leaves, sharded, mine) if sharded else []
        # Shards needing gradients: each is its own input of the call (per-rank semantics).
        sdiff = [(i, r) for i in sharded for r in mine
                 if grad_on and leaves[i].shards[r].requires_grad]

        detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        diff_set, sdiff_set = set(diff), set(sdiff)
        copies = {(i, r): _shard_of(detached[i], layouts[i], r).detach().clone()
                  for i, r in sig.copies if not per_rank or r == mine[0]} if sig.copies else None
        if sig.copies and per_rank and self.mesh.backend == "threads":
            # Rank threads (or greenlets) called with one shared tensor: every rank's copy
            # is made before any rank's body can change the tensor in place (rank 0 runs
            # on it), as each process has its own before anything runs.
            comm_of(self.mesh).barrier(self.mesh.group(self.mesh.axis_names, mine[0]),
                                       name="shard_map")

        if per_rank and self.mesh.backend == "torch" and comm_of(self.mesh).checks:
            needs = [(x.requires_grad if isinstance(x, torch.Tensor) else
                      isinstance(x, Sharded) and x.shards[self.mesh.rank].requires_grad)
                     for x in leaves]
            _check_call_agrees(self.mesh, self.in_specs, self.out_specs, grad_on, needs,
                               lambda: [_tree.keystr("args", p) for p in optree.tree_paths(
                                   args, none_is_leaf=True, namespace="spmd")])
        if per_rank and self.mesh.backend == "torch" and validating(self.mesh):
            self._check_same_globals(leaves, args)

        seq0: dict[int, int | None] = {}
        tkey = self._trace_key(treedef, leaves, layouts)
        cuts, f, mesh = sig.cuts, self.f, self.mesh

        flat = sig.flat

        def run_rank(rank: int):
            local_g, local_s = [], []
            loc = list(detached)
            for i, lay, by_rank, marks in cuts:
                t = copies.get((i, rank)) if copies else None
                if t is None:
                    t = detached[i]
                    for d, start, n in by_rank[rank]:
                        t = t.narrow(d, start, n)
                if i in diff_set:
                    t = t.requires_grad_()
                    local_g.append(t)
                # ops check their spec= against it (core/provenance.py)
                setattr(t, MARK, marks[rank])
                loc[i] = t
            for i in sharded:
                t = copies.get((i, rank)) if copies else None
                if t is None:
                    t = detached[i].shards[rank]
                if (i, rank) in sdiff_set:
                    t = t.detach().requires_grad_()  # this rank's graph starts here
                    local_s.append(t)
                mark(t, layouts[i])
                loc[i] = t
            args_local = loc if flat else optree.tree_unflatten(treedef, loc)
            # nesting, anchors (grad mode) and the sizes the last call's exchanges learnt
            body = Body(mesh, axes_mapped, [] if grad_on else None,
                        NO_TRACE if tkey is None else self._traces.get((tkey, rank)))
            stack = bodies()
            stack.append(body)
            try:
                if not grad_on:  # rank threads start with grad mode on
                    with torch.no_grad():
                        out = f(*args_local)
                else:
                    if per_rank or rank == 0:  # the body's nodes are numbered from here
                        # (see _keep_graph); on a threads mesh rank 0 runs on the caller's
                        # thread, whose numbers those of the caller's own nodes are
                        # comparable to
                        seq0[rank] = _next_node_number()
                    out = f(*args_local)
            finally:
                stack.pop()
            if tkey is not None:
                got = _NOTHING if body.trace is None else body.trace.recorded
                if got != body.cached:  # steady state: the same list, no lock
                    self._keep_trace((tkey, rank), got)
            return out, local_g + local_s, body.anchors or []

        report = {"per_rank_backward": False}
        if per_rank:
            rank = self.mesh.rank
            with RankContext(self.mesh, rank):
                results = [run_rank(rank)]  # by position in ranks
            ranks = [rank]
        else:
            if self.mesh.backend != "threads":
                raise SpecError(f"shard_map on {self.mesh!r} must be called on every rank")
            if self.schedule == "greenlets":
                from ..comm.rank_greenlets import run_on_greenlets
                results = run_on_greenlets(self.mesh, run_rank,
                                           rank_rng=self.mesh.rng == "per_rank", report=report)
            else:
                results = run_on_threads(self.mesh, run_rank,
                                         rank_rng=self.mesh.rng == "per_rank")
            ranks = list(range(self.mesh.size))

        outs = [_flat_out(res[0]) for res in results]
        out_def = outs[0][1]
        for pos in range(1, len(outs)):
            if outs[pos][1] != out_def:
                raise SpecError(f"shard_map: f returned {outs[pos][1]} on rank {ranks[pos]} "
                                f"but {out_def} on rank {ranks[0]}; every rank must return the "
                                f"same structure")
        hit = self._out_spec_cache.get(out_def)
        if hit is None:
            tree = results[0][0]
            hit = self._out_spec_cache[out_def] = (
                _tree.match_specs(self.out_specs, tree, "out_specs", "out"),
                [_tree.keystr("out", p)
                 for p in optree.tree_paths(tree, none_is_leaf=True, namespace="spmd")])
        out_specs, out_names = hit
        state = _State(self, ranks, leaves, layouts, diff, [res[1] for res in results],
                       [o[0] for o in outs], out_specs, out_names, per_rank)
        state.sdiff = sdiff
        state.outer = outer
        state.sharded_inputs = named
        state.s_pos = [[j for j, (_, r) in enumerate(sdiff) if r == rank] for rank in ranks] \
            if sdiff else [()] * len(ranks)
        state.anchors = [res[2] for res in results]
        state.seq0 = seq0.get(ranks[0])
        state.green = not per_rank and self.schedule == "greenlets" and \
            not report["per_rank_backward"]
        global_outs = state.assemble(bool(sharded))
        if grad_on and state.any_out_grad:
            if outer:  # a parameter the body closes over: found only now, alike on all ranks
                refuse_nested_grad(self.mesh, outer)
            state.find_params()
            if state.diff or state.sdiff or state.params:
                state.node_map = []  # (output, rank position; None for a global tensor)
                for k, g in enumerate(global_outs):
                    if isinstance(g, Sharded):
                        state.node_map += [(k, pos) for pos in range(len(ranks))]
                    elif isinstance(g, torch.Tensor):
                        state.node_map.append((k, None))
                state.node_vals = [global_outs[k] if pos is None
                                   else global_outs[k].shards[ranks[pos]].detach()
                                   for k, pos in state.node_map]
                res = _Node.apply(state, *[leaves[i] for i in diff],
                                  *[leaves[i].shards[r] for i, r in sdiff], *state.params)
                shards: dict[int, dict[int, torch.Tensor]] = {}
                for (k, pos), t in zip(state.node_map, res):
                    if pos is None:
                        global_outs[k] = t
                    else:
                        shards.setdefault(k, {})[ranks[pos]] = t
                for k, d in shards.items():
                    global_outs[k] = Sharded(d, global_outs[k].layout, self.mesh)
        return optree.tree_unflatten(out_def, global_outs)

    def _check_sharded(self, args: tuple, leaves: list, sharded: list[int],
                       mine: list[int]) -> list[tuple[str, Sharded]]:
        """Sharded arguments live on this mesh and hold the shards of the ranks running;
        returns them with their key paths."""
        paths = optree.tree_paths(args, none_is_leaf=True, namespace="spmd")
        named = []
        for i in sharded:
            x = leaves[i]
            where = _tree.keystr("args", paths[i])
            named.append((where, x))
            if x.mesh is not self.mesh:
                raise SpecError(f"shard_map: {where} is {x!r} on {x.mesh!r}, another Mesh "
                                f"object than the one shard_map runs on ({self.mesh!r}); "
                                f"build it on the same mesh")
            lack = [r for r in mine if r not in x.shards]
            if lack:
                raise SpecError(f"shard_map: {where} is {x!r}, which holds no shard of "
                                f"rank{'s' * (len(lack) > 1)} {', '.join(map(str, lack))}; "
                                f"build it where it is used (in per-rank code: "
                                f"Sharded.from_local or Sharded.load on every rank)")
        return named


_LEAF = _tree.flatten(torch.empty(0))[1]


def _flat_out(out: Any) -> tuple[list, Any]:
    """A body's output flattened (one tensor, the common case, without optree)."""
    return ([out], _LEAF) if isinstance(out, torch.Tensor) else _tree.flatten(out)


def _refuse_functorch() -> None:
    """torch.func's transforms follow tensors on the calling thread: under them the rank
    threads saw unwrapped tensors (grad and vmap failed deep inside functorch, and jvp
    returned a zero tangent, silently). Called where one is active (``_functorch()``); a
    tensor refuses requires_grad_ exactly under those that follow tensors."""
    try:
        torch.empty(0).requires_grad_()
    except RuntimeError as e:
        if "functorch" not in str(e):
            raise
        raise RuntimeError(
            "shard_map cannot run under a torch.func transform (grad, vjp, jvp, jacrev, "
            "jacfwd, hessian, vmap): differentiate its output with .backward() or "
            "torch.autograd.grad, batch by adding a dim to the inputs and specs, or apply "
            "torch.func inside the body, on each rank's shard") from None


