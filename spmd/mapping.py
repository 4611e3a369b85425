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

import math
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .collectives._anchor import collect_anchors
from .collectives.compiled import prepare
from .comm import comm_of, validating
from .comm.rank_threads import run_on_threads
from .comm.stats import in_backward
from .core import _tree
from .core._context import (
    LayoutTrace,
    RankContext,
    in_rank_of,
    pop_trace,
    push_trace,
    refuse_sparse,
)
from .core._format import describe, shape_str
from .core._nesting import check_nested, mapped_over, refuse_nested_grad, spec_axes
from .core.errors import SpecError
from .core.layout import Layout
from .core.mesh import Mesh, check_mesh
from .core.provenance import mark
from .core.spec import P
from .transforms.sharded import Sharded, cat_plan, run_cat_plan, same_cut

__all__ = ["shard_map"]


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any, *,
              check_rep: bool = False,
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
        check_rep: verify that claim and name the first rank and index that differ.
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


class _ShardMap:
    def __init__(self, f, mesh, in_specs, out_specs, check_rep, params_fn, static_layouts):
        self.f, self.mesh = f, mesh
        self.in_specs, self.out_specs = in_specs, out_specs
        self.check_rep, self.params_fn = check_rep, params_fn
        self.static_layouts = static_layouts
        self._traces: dict = {}  # (call key, rank) -> the last call's LayoutTrace entries
        self._trace_lock = threading.Lock()
        self._in_cache: dict = {}
        self._out_cache: dict = {}
        self._out_spec_cache: dict = {}

    # -- inputs ---------------------------------------------------------------------------

    def _in_layouts(self, args: tuple) -> tuple[list, Any, list]:
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
            hit = self._in_cache[key] = layouts
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
        _refuse_functorch()
        leaves, treedef, layouts = self._in_layouts(args)
        grad_on = torch.is_grad_enabled()
        diff = [i for i, x in enumerate(leaves)
                if isinstance(x, torch.Tensor) and x.requires_grad and grad_on]
        per_rank = in_rank_of(self.mesh)
        # Nested in a body on this mesh: refused over the body's axes (specs only, the
        # same on every rank, before any message); over other axes, without gradients.
        outer = check_nested(self.mesh, self.in_specs, self.out_specs) if per_rank else ()
        if outer and grad_on and (diff or any(isinstance(x, Sharded) for x in leaves)
                                  or (self.params_fn is not None and self.params_fn())):
            refuse_nested_grad(self.mesh, outer)
        used = set(spec_axes(self.out_specs)) | {a for lay in layouts if lay is not None
                                                 for a in lay.spec.axes}
        axes_mapped = tuple(a for a in self.mesh.axis_names if a in used)
        mine = [self.mesh.rank] if per_rank else list(range(self.mesh.size))
        sharded = [i for i, x in enumerate(leaves) if isinstance(x, Sharded)]
        named = self._check_sharded(args, leaves, sharded, mine)
        # Shards needing gradients: each is its own input of the call (per-rank semantics).
        sdiff = [(i, r) for i in sharded for r in mine
                 if grad_on and leaves[i].shards[r].requires_grad]

        detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        diff_set, sdiff_set = set(diff), set(sdiff)
        # Rank threads share the caller's tensors: a replica other than the first gets a
        # copy (made before any rank runs), so that an in-place op in the body acts once
        # on the caller's tensor, as on processes and on one device.
        copies = {(i, r): _shard_of(detached[i], lay, r).detach().clone()
                  for i, lay in enumerate(layouts) if lay is not None and
                  self.mesh.backend == "threads" and lay.replicated_axes
                  for r in mine if any(self.mesh.axis_index(a, r) for a in lay.replicated_axes)}

        check = validating(self.mesh)
        if check and per_rank and self.mesh.backend == "torch":
            self._check_same_globals(leaves, args)

        seq0: dict[int, int | None] = {}
        tkey = self._trace_key(treedef, leaves, layouts)

        def run_rank(rank: int):
            if tkey is None:
                return body_rank(rank)
            trace = LayoutTrace(self.mesh, self._traces.get((tkey, rank)))
            push_trace(trace)
            try:
                out = body_rank(rank)
            finally:
                pop_trace()
            if trace.recorded != trace.cached:  # steady state: the same list, no lock
                self._keep_trace((tkey, rank), trace.recorded)
            return out

        def body_rank(rank: int):
            local_g, local_s = [], []
            loc = list(detached)
            for i, lay in enumerate(layouts):
                if lay is not None:
                    t = copies.get((i, rank))
                    if t is None:
                        t = _shard_of(detached[i], lay, rank)
                    if i in diff_set:
                        t = t.requires_grad_()
                        local_g.append(t)
                    elif (i, rank) in sdiff_set:
                        t = t.detach().requires_grad_()  # this rank's graph starts here
                        local_s.append(t)
                    mark(t, lay)  # ops check their spec= against it (core/provenance.py)
                    loc[i] = t
            args_local = optree.tree_unflatten(treedef, loc)
            local_in = local_g + local_s
            if not grad_on:  # rank threads start with grad mode on
                with torch.no_grad(), mapped_over(self.mesh, axes_mapped):
                    return self.f(*args_local), local_in, []
            if per_rank or rank == 0:  # the body's nodes are numbered from here
                # (see _keep_graph); on a threads mesh rank 0 runs on the caller's
                # thread, whose numbers those of the caller's own nodes are comparable to
                seq0[rank] = _next_node_number()
            with collect_anchors() as anchors, mapped_over(self.mesh, axes_mapped):
                out = self.f(*args_local)
            return out, local_in, anchors

        if per_rank:
            rank = self.mesh.rank
            with RankContext(self.mesh, rank):
                results = {rank: run_rank(rank)}
            ranks = [rank]
        else:
            if self.mesh.backend != "threads":
                raise SpecError(f"shard_map on {self.mesh!r} must be called on every rank")
            results = dict(enumerate(run_on_threads(
                self.mesh, run_rank, rank_rng=self.mesh.rng == "per_rank")))
            ranks = list(range(self.mesh.size))

        outs = {r: _tree.flatten(results[r][0]) for r in ranks}
        out_def = outs[ranks[0]][1]
        for r in ranks[1:]:
            if outs[r][1] != out_def:
                raise SpecError(f"shard_map: f returned {outs[r][1]} on rank {r} but "
                                f"{out_def} on rank {ranks[0]}; every rank must return the "
                                f"same structure")
        hit = self._out_spec_cache.get(out_def)
        if hit is None:
            tree = results[ranks[0]][0]
            hit = self._out_spec_cache[out_def] = (
                _tree.match_specs(self.out_specs, tree, "out_specs", "out"),
                optree.tree_paths(tree, none_is_leaf=True, namespace="spmd"))
        out_specs, out_paths = hit
        state = _State(self, ranks, leaves, layouts, diff, [results[r][1] for r in ranks],
                       [outs[r][0] for r in ranks], out_specs, out_paths, per_rank)
        state.sdiff = sdiff
        state.sharded_inputs = named
        state.s_pos = [[j for j, (_, r) in enumerate(sdiff) if r == rank] for rank in ranks]
        state.anchors = [results[r][2] for r in ranks]
        state.seq0 = seq0.get(ranks[0])
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
        if not sharded:
            return []
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


def _refuse_functorch() -> None:
    """torch.func's transforms follow tensors on the calling thread: under them the rank
    threads saw unwrapped tensors (grad and vmap failed deep inside functorch, and jvp
    returned a zero tangent, silently). A tensor refuses requires_grad_ exactly there."""
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


def _layout_for(x: torch.Tensor, s: Any, mesh: Mesh, where: str) -> Layout:
    if isinstance(s, Layout):
        if s.shape != tuple(x.shape):
            raise SpecError(f"{where} is {describe(x)} but its Layout is for "
                            f"{shape_str(s.shape)}")
        return s
    try:
        return Layout(x.shape, s, mesh)
    except SpecError as e:
        raise SpecError(f"{where} ({describe(x)}): {e}") from None


def _leaf_key(x: Any) -> Any:
    if isinstance(x, Sharded):
        return x.layout
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _sharded_layout(x: Sharded, s: Any, mesh: Mesh, where: str) -> Layout:
    """A Sharded argument's layout, which its in_specs entry must describe: the same cut
    (a ``P``) or the same layout (a ``Layout``). Moving data is the caller's decision."""
    lay = x.layout
    if not same_cut(lay, s, mesh):
        raise SpecError(f"in_specs for {where} is {s!r} but the argument is {x!r}; pass its "
                        f"own spec ({lay.spec!r}, or its Layout) in in_specs, or re-lay it "
                        f"first with spmd.redistribute(x, mesh, dst_spec={s!r})")
    return lay


def _shard_of(x: Any, lay: Layout, rank: int) -> torch.Tensor:
    return x.shards[rank] if isinstance(x, Sharded) else lay.shard(x, rank)


class _State:
    """Everything one shard_map call needs for assembly and backward."""

    def __init__(self, sm, ranks, global_leaves, in_layouts, diff, local_ins, local_outs,
                 out_specs, out_paths, per_rank):
        self.sm, self.mesh, self.ranks = sm, sm.mesh, ranks
        self.global_leaves = global_leaves
        self.in_layouts, self.diff = in_layouts, diff
        self.local_ins, self.local_outs = local_ins, local_outs
        self.out_specs, self.out_paths, self.per_rank = out_specs, out_paths, per_rank
        self.out_layouts: list[Layout | None] = []
        self.params: list[torch.Tensor] = []

    @property
    def any_out_grad(self) -> bool:
        for outs in self.local_outs:
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return True
        return False

    # -- forward assembly -----------------------------------------------------------------

    def assemble(self, sharded: bool) -> list:
        """The outputs: global tensors, or (``sharded``: some argument was a Sharded)
        Sharded values for the outputs whose spec splits a dim."""
        mesh = self.mesh
        out, pending = [], []
        for k, spec in enumerate(self.out_specs):
            where = _tree.keystr("out", self.out_paths[k])
            vals = [outs[k] for outs in self.local_outs]
            if not isinstance(vals[0], torch.Tensor):
                if self.per_rank or all(_same_py(v, vals[0]) for v in vals):
                    out.append(vals[0])
                    self.out_layouts.append(None)
                    continue
                bad = next(r for r, v in zip(self.ranks, vals) if not _same_py(v, vals[0]))
                raise SpecError(f"shard_map: {where} is {vals[0]!r} on rank {self.ranks[0]} but "
                                f"{vals[bad]!r} on rank {bad}; non-tensor outputs must agree")
            spec = P() if spec is None else spec
            if isinstance(spec, Layout):
                spec = spec.spec
            if sharded and spec.axes:
                if self.per_rank:  # layouts below, all in one exchange
                    pending.append((k, vals[0], spec, where))
                    out.append(None)
                    self.out_layouts.append(None)
                    continue
                lay = _out_layout(dict(enumerate(tuple(v.shape) for v in vals)), spec, mesh,
                                  where)
                if self.sm.check_rep:
                    _check_rep_threads(vals, lay, where)
                self.out_layouts.append(lay)
                out.append(Sharded(dict(enumerate(vals)), lay, mesh))
                continue
            if self.per_rank:
                g, lay = _gather_global(vals[0], spec, mesh, self.ranks[0], where,
                                        self.sm.check_rep)
            else:
                g, lay = _assemble_threads(vals, spec, mesh, where, self.sm.check_rep,
                                           self.sm._out_cache)
            self.out_layouts.append(lay)
            out.append(g)
        if pending:
            rank = self.ranks[0]
            lays = _exchange_out_layouts([(v, spec, where) for _, v, spec, where in pending],
                                         mesh, rank, self.sharded_inputs)
            for (k, v, _, where), lay in zip(pending, lays):
                if self.sm.check_rep and lay.replicated_axes:
                    _check_rep_per_rank(v, lay, mesh, rank, where)
                self.out_layouts[k] = lay
                out[k] = Sharded({rank: v}, lay, mesh)
        return out

    # -- parameters ------------------------------------------------------------------------

    def find_params(self) -> None:
        if self.sm.params_fn is not None:
            self.params = [p for p in self.sm.params_fn() if p.requires_grad]
        else:
            mine = {id(t) for ins in self.local_ins for t in ins}
            mine |= {id(a) for anchors in self.anchors for a in anchors}  # not parameters
            found: dict[int, torch.Tensor] = {}
            for outs in self.local_outs:
                _graph_leaves([t for t in outs if isinstance(t, torch.Tensor)], mine, found)
            self.params = list(found.values())
        self.shared = [False] * (len(self.diff) + len(self.params))
        if self.per_rank and self.mesh.backend == "threads":
            # Rank threads may pass the very same tensors (then their partial gradients
            # add up by themselves) or each their own (then they must be summed).
            group = self.mesh.group(self.mesh.axis_names, self.ranks[0])
            ids = [id(self.global_leaves[i]) for i in self.diff] + [id(p) for p in self.params]
            every = comm_of(self.mesh).exchange(group, "shard_map", ids, name="shard_map")
            if any(len(e) != len(ids) for e in every):
                raise SpecError("shard_map: ranks found different numbers of parameters in "
                                "their graphs; pass params=... explicitly")
            self.shared = [all(e[j] == ids[j] for e in every) for j in range(len(ids))]

    # -- backward ----------------------------------------------------------------------------

    def backward(self, gouts: Sequence[torch.Tensor | None], local_outs: list[list],
                 anchors: list[list]):
        """Gradients for the call's inputs: the global arguments', the shards' (each its
        rank's own, as in per-rank code) and the parameters'."""
        mesh = self.mesh
        # Asked here, on the engine's thread, not on a rank thread. On a threads mesh
        # rank 0's graph answers for all: the ranks close over the same caller tensors.
        keep = _keep_graph() or self.seq0 is None or _reaches_older_nodes(
            [t for t in local_outs[0] + anchors[0] if isinstance(t, torch.Tensor)], self.seq0)

        def rank_grads(pos: int, rank: int):
            outs, cots = [], []
            for (k, p), g in zip(self.node_map, gouts):
                t = local_outs[pos][k]
                if g is None or t is None or not t.requires_grad or p not in (None, pos):
                    continue
                outs.append(t)
                if p is None:  # a global output: this rank's part of its cotangent
                    lay = self.out_layouts[k]
                    g = lay.shard(g, rank) / _rep_factor(lay)
                cots.append(g)
            ins = list(self.local_ins[pos]) + self.params
            if not outs:
                return [None] * len(ins)
            # The anchors make autograd run every collective's backward on this rank.
            got = torch.autograd.grad(outs, ins + anchors[pos], cots, allow_unused=True,
                                      retain_graph=keep)
            return list(got[:len(ins)])

        if self.per_rank:
            with RankContext(mesh, self.ranks[0]):
                per = [rank_grads(0, self.ranks[0])]
        else:
            per = run_on_threads(mesh, lambda r: rank_grads(r, r),
                                 rank_rng=mesh.rng == "per_rank")

        n_in = len(self.diff)
        sgrads: list[torch.Tensor | None] = [None] * len(self.sdiff)
        for pos, js in enumerate(self.s_pos):
            for m, j in enumerate(js):
                sgrads[j] = per[pos][n_in + m]
        per = [p[:n_in] + p[n_in + len(js):] for p, js in zip(per, self.s_pos)]
        grads: list[torch.Tensor | None] = []
        for j, i in enumerate(self.diff):
            lay = self.in_layouts[i]
            acc = None
            for pos, rank in enumerate(self.ranks):
                g = per[pos][j]
                if g is None:
                    continue
                if acc is None:
                    acc = torch.zeros(lay.shape, dtype=g.dtype, device=g.device)
                acc[lay.slices(rank)] += g
            grads.append(acc)
        for j in range(len(self.params)):
            acc = None
            for pos in range(len(self.ranks)):
                g = per[pos][n_in + j]
                if g is not None:
                    acc = g if acc is None else acc + g
            grads.append(acc)
        if self.per_rank:
            with in_backward():
                grads = self._sum_over_mesh(grads)
        return grads[:n_in] + sgrads + grads[n_in:]

    def _sum_over_mesh(self, grads: list) -> list:
        """Per-rank view: every rank holds a part of each gradient; sum them everywhere.

        One all-reduce per dtype and device over a flat buffer, not one per tensor.
        (spmd.parallel's bucketed, overlapped reducer is the tool for large models.)
        """
        mesh, rank = self.mesh, self.ranks[0]
        group = mesh.group(mesh.axis_names, rank)
        inputs = [self.global_leaves[i] for i in self.diff] + self.params
        if mesh.backend == "torch":
            self._check_same_gradients(inputs, group)
        out = list(grads)
        buckets: dict[tuple, list[int]] = {}
        for j, (g, x, shared) in enumerate(zip(grads, inputs, self.shared)):
            if not shared:
                out[j] = torch.zeros_like(x) if g is None else g
                buckets.setdefault((out[j].dtype, out[j].device), []).append(j)
        for idx in buckets.values():
            flat = torch.cat([out[j].reshape(-1) for j in idx])
            flat = comm_of(mesh).all_reduce(flat, "sum", group, name="shard_map backward")
            for j, part in zip(idx, flat.split([out[j].numel() for j in idx])):
                out[j] = part.view_as(out[j])
        return out


    def _check_same_gradients(self, inputs: list, group) -> None:
        """Ranks that found different parameters would all-reduce buffers of different
        sizes, which gloo answers by aborting the process: compare first (int64)."""
        n_in, n_par = len(self.diff), len(self.params)
        # Under validation, also the parameters found in the graphs (params= ones were
        # compared before the forward): a rank's own copies must be everyone's.
        fp = 0
        if validating(self.mesh) and self.sm.params_fn is None:
            fp = hash(tuple(_fingerprint(p) for p in self.params)) & _MASK
        mine = torch.tensor([[n_in, n_par, sum(t.numel() for t in inputs), fp]],
                            dtype=torch.int64, device=inputs[0].device if inputs else None)
        rows = [t[0].tolist() for t in comm_of(self.mesh).all_gather(
            mine, group, 0, name="shard_map backward check", sizes=(1,) * group.size)]
        if all(r[:3] == rows[0][:3] for r in rows) and any(r != rows[0] for r in rows):
            differ = [group.ranks[i] for i, r in enumerate(rows) if r != rows[0]]
            raise SpecError(
                f"shard_map backward (SPMD_VALIDATE=1): the parameters the body used differ "
                f"between rank {group.ranks[0]} and rank{'s' * (len(differ) > 1)} "
                f"{', '.join(map(str, differ))}: each process used its own copy, so the "
                f"forward mixed them; initialise them alike on every rank (same seed, or "
                f"broadcast from one rank)")
        if any(r != rows[0] for r in rows):
            desc = ", ".join(f"rank {group.ranks[i]}: {r[0]} inputs + {r[1]} parameters "
                             f"({r[2]} elements)" for i, r in enumerate(rows))
            raise SpecError(
                f"shard_map backward: ranks found different tensors to differentiate ({desc}); "
                f"every rank's body must use the same parameters (pass params=... "
                f"explicitly, or an nn.Module as f)")


def _fingerprint(x: Any) -> int:
    """63 bits that differ, but for a collision, where two ranks' values differ: the
    tensor's dtype, shape and bytes (two weighted sums of its 32-bit words, in bounded
    chunks), or a plain Python value's repr; other objects give 0 (not compared)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous().view(-1)
        h = zlib.crc32(f"{t.dtype}{tuple(x.shape)}".encode())
        b = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        words = b.view(torch.int32) if b.numel() % 4 == 0 else b
        s1 = s2 = 0
        for off in range(0, words.numel(), _CHUNK):
            v = words[off:off + _CHUNK].to(torch.int64)
            w = torch.arange(off, off + v.numel(), device=v.device) % 65521 + 1
            s1, s2 = s1 + int(v.sum()), s2 + int((v * w).sum())
        return hash((h, s1, s2)) & _MASK  # ints hash alike in every process
    if isinstance(x, Sharded):  # each rank holds its own shards: compare how they are cut
        return zlib.crc32(f"{x.layout!r} {x.dtype}".encode()) + 1
    if isinstance(x, list):
        return hash(tuple(_fingerprint(v) for v in x)) & _MASK
    if x is None or isinstance(x, (bool, int, float, str, complex)):
        return zlib.crc32(repr(x).encode()) + 1
    return 0


_CHUNK = 1 << 20
_MASK = (1 << 63) - 1


def _check_same_across(mesh: Mesh, named: list[tuple[str, Any]], what: str) -> None:
    group = mesh.group(mesh.axis_names, mesh.rank)
    mine = torch.tensor([_fingerprint(v) for _, v in named], dtype=torch.int64,
                        device=mesh.device)
    got = [t.tolist() for t in comm_of(mesh).all_gather(mine, group, 0, name=f"{what} check")]
    for i, row in enumerate(got):
        if len(row) != len(got[0]):
            raise SpecError(f"{what}: rank {group.ranks[i]} passed {len(row)} arguments and "
                            f"parameters, rank {group.ranks[0]} {len(got[0])}")
    for j, (name, _) in enumerate(named):
        differ = [group.ranks[i] for i, row in enumerate(got) if row[j] != got[0][j]]
        if differ:
            raise SpecError(
                f"{what} (SPMD_VALIDATE=1): {name} differs between ranks: rank "
                f"{group.ranks[0]} and rank{'s' * (len(differ) > 1)} "
                f"{', '.join(map(str, differ))} passed different values. Each process "
                f"splits its own copy of a global argument (and uses its own parameters) and "
                f"keeps its shard, so copies "
                f"that differ mix into a wrong result: give every rank the same value (seed "
                f"the initialisation alike, or broadcast it from one rank)")


def _same_py(a: Any, b: Any) -> bool:
    """Whether two non-tensor outputs are the same value (NaN equal to NaN: every rank
    computing NaN agrees)."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "__array__") and hasattr(a, "shape") and hasattr(a, "dtype"):
        import numpy as np  # numpy arrays (and the like): compared as arrays, not by ==
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return a is b


def _rep_factor(lay: Layout) -> int:
    return math.prod(lay.mesh_shape[lay.axis_names.index(a)] for a in lay.replicated_axes)


def _out_layout(shapes: dict[int, tuple], spec: P, mesh: Mesh, where: str) -> Layout:
    """The global layout implied by each rank's local output shape."""
    r0 = min(shapes)
    nd = len(shapes[r0])
    if len(spec) > nd:
        raise SpecError(f"out_specs for {where} is {spec!r} but the output is {nd}-d "
                        f"({shape_str(shapes[r0])} on rank {r0})")
    for r, s in shapes.items():
        if len(s) != nd:
            raise SpecError(f"shard_map: {where} is {shape_str(s)} on rank {r} but "
                            f"{shape_str(shapes[r0])} on rank {r0}")
    lay = Layout.from_local_shapes(shapes, spec, mesh)
    for d in range(nd):
        axes = lay.dim_axes(d)
        for r in sorted(shapes):
            got, want = shapes[r][d], lay.local_shape(r)[d]
            if got == want:
                continue
            if not axes:
                raise SpecError(
                    f"shard_map: dim {d} of {where} has size {got} on rank {r} but "
                    f"{want} on rank {r0}; {spec!r} does not split dim {d}, so "
                    f"every rank must agree (or split it in out_specs)")
            raise SpecError(
                f"shard_map: dim {d} of {where} has size {got} on rank {r} but "
                f"{want} on another rank holding the same shard over {axes}")
    return lay


def _assemble_threads(vals: list[torch.Tensor], spec: P, mesh: Mesh, where: str,
                      check_rep: bool, cache: dict) -> tuple[torch.Tensor, Layout]:
    shapes = tuple(tuple(v.shape) for v in vals)
    hit = cache.get((shapes, spec))
    if hit is None:
        lay = _out_layout(dict(enumerate(shapes)), spec, mesh, where)
        owners = lay.owners()
        hit = cache[(shapes, spec)] = (lay, owners, cat_plan(lay, owners))
        if len(cache) > 256:
            cache.pop(next(iter(cache)))
    lay, owners, plan = hit
    if check_rep:
        _check_rep_threads(vals, lay, where, owners)
    with torch.no_grad():
        return run_cat_plan(plan, vals), lay


def _check_rep_threads(vals: list[torch.Tensor], lay: Layout, where: str,
                       owners: dict | None = None) -> None:
    """Every rank's value equals the copy of the lowest rank holding its shard."""
    owners = lay.owners() if owners is None else owners
    for r in range(len(vals)):
        o = owners[lay.shard_key(r)]
        if r != o:
            _compare_rep(vals[o], vals[r], o, r, where, lay)


def _check_rep_per_rank(v: torch.Tensor, lay: Layout, mesh: Mesh, rank: int, where: str) -> None:
    """Per-rank view: every rank of the replicated axes holds the same value."""
    group = mesh.group(lay.replicated_axes, rank)
    parts = comm_of(mesh).all_gather(v.detach().unsqueeze(0), group, 0, name="check_rep")
    for i, p in enumerate(parts):
        _compare_rep(parts[0][0], p[0], group.ranks[0], group.ranks[i], where, lay)


def _exchange_out_layouts(outs: list[tuple[torch.Tensor, P, str]], mesh: Mesh, rank: int,
                          inputs: list[tuple[str, Sharded]]) -> list[Layout]:
    """Per-rank view: the layouts of this call's Sharded outputs, from every rank's local
    shapes (one int64 all_gather over the mesh for all of them). The same exchange
    compares the Sharded ``inputs``' layouts: each process may have built its own (a
    Layout given to ``from_local`` or ``load``), and ops trusting one that another rank
    does not share would fetch the wrong halos."""
    row = [len(outs), _fingerprint([x for _, x in inputs])]
    for v, _, _ in outs:
        row += [v.ndim, *v.shape]
    group = mesh.group(mesh.axis_names, rank)
    mine = torch.tensor(row, dtype=torch.int64, device=outs[0][0].device)
    got = [t.tolist() for t in comm_of(mesh).all_gather(mine, group, 0, name="shard_map sizes")]
    for i, r in enumerate(group.ranks):
        if got[i][0] != len(outs):
            raise SpecError(f"shard_map: rank {r} returned {got[i][0]} split outputs, rank "
                            f"{rank} {len(outs)}; every rank must return the same structure")
    differ = [r for i, r in enumerate(group.ranks) if got[i][1] != got[0][1]]
    if differ:
        raise SpecError(
            f"shard_map: the Sharded arguments are laid out differently on rank "
            f"{group.ranks[0]} and rank{'s' * (len(differ) > 1)} {', '.join(map(str, differ))} "
            f"(here: {', '.join(f'{w} = {x!r}' for w, x in inputs)}); every process must "
            f"build the same Layout (same shape, spec and sizes)")
    lays, at = [], [2] * len(got)
    for _, spec, where in outs:
        shapes = {}
        for i, r in enumerate(group.ranks):
            nd = got[i][at[i]]
            shapes[r] = tuple(got[i][at[i] + 1:at[i] + 1 + nd])
            at[i] += 1 + nd
        lays.append(_out_layout(shapes, spec, mesh, where))
    return lays


def _compare_rep(a: torch.Tensor, b: torch.Tensor, ra: int, rb: int, where: str,
                 lay: Layout) -> None:
    if a.shape == b.shape and torch.equal(a, b):
        return
    if a.shape != b.shape:
        raise SpecError(
            f"shard_map(check_rep=True): {where} is claimed replicated over "
            f"{list(lay.replicated_axes)} by out_specs {lay.spec!r}, but it is "
            f"{tuple(a.shape)} on rank {ra} and {tuple(b.shape)} on rank {rb}")
    diff = (a != b)
    if a.is_floating_point() or a.is_complex():
        diff &= ~(torch.isnan(a) & torch.isnan(b))  # NaN where every rank has NaN: equal
    if not diff.any():
        return
    idx = tuple(int(i) for i in diff.nonzero()[0])
    raise SpecError(
        f"shard_map(check_rep=True): {where} is claimed replicated over "
        f"{list(lay.replicated_axes)} by out_specs {lay.spec!r}, but rank {rb} differs from "
        f"rank {ra} at local index {list(idx)}: {b[idx].item()!r} vs {a[idx].item()!r}; split "
        f"the output over those axes in out_specs, or make it equal (e.g. psum)")


def _gather_global(v: torch.Tensor, spec: P, mesh: Mesh, rank: int, where: str,
                   check_rep: bool) -> tuple[torch.Tensor, Layout]:
    """Per-rank view: all-gather this rank's shard into the global output."""
    comm = comm_of(mesh)
    probe = Layout((0,) * v.ndim, spec, mesh) if len(spec) <= v.ndim else None
    if probe is None:
        raise SpecError(f"out_specs for {where} is {spec!r} but the output is "
                        f"{describe(v)} on rank {rank}")
    g = v.detach()
    sizes: list[tuple[int, ...] | None] = []
    for d in range(v.ndim):
        axes = probe.dim_axes(d)
        if not axes:
            sizes.append(None)
            continue
        parts = comm.all_gather(g, mesh.group(axes, rank), d, name="shard_map output")
        sizes.append(tuple(p.shape[d] for p in parts))
        g = torch.cat(parts, d)
    lay = Layout(g.shape, spec, mesh, sizes)
    if check_rep and lay.replicated_axes:
        _check_rep_per_rank(v, lay, mesh, rank, where)
    return g, lay


def _graph_leaves(roots: list[torch.Tensor], exclude: set[int], found: dict[int, torch.Tensor]) -> None:
    """Leaves needing grad reached from ``roots``' graphs, excluding ``exclude`` ids."""
    stack, seen = [], set()
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad and id(t) not in exclude:
            found.setdefault(id(t), t)
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        v = getattr(fn, "variable", None)
        if v is not None:
            if id(v) not in exclude:
                found.setdefault(id(v), v)
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)


def _keep_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``): then the
    ranks' graphs are kept too. Otherwise, in per-rank code, each node of the body's
    graph frees what it saved as soon as it has run, as on one device (keeping them all
    to the end of the backward cost 16% of the demo CNN's peak memory).

    torch answers only through private calls, the ones AOTAutograd uses for the same
    questions (here, and the node numbers below); where one is missing, the graphs are
    kept: exact, with more memory."""
    ask = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if ask is None else bool(ask())


def _next_node_number() -> int | None:
    """The creation number the next autograd node of this thread gets (per-thread and
    increasing: the nodes the body makes have this number or more)."""
    node = (torch.zeros((), requires_grad=True) * 1).grad_fn
    number = getattr(node, "_sequence_nr", None)
    return None if number is None else number() + 1


def _reaches_older_nodes(roots: list[torch.Tensor], seq0: int) -> bool:
    """Whether the body's graph reaches a node made before the body ran (a tensor the
    body closes over that the caller computed, ``sin(w)``): the caller's graph may need
    that node's saved tensors after this backward, so the body's graph must be kept."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen or fn is None:
            continue
        seen.add(id(fn))
        if hasattr(fn, "variable"):  # a leaf's AccumulateGrad: nothing saved
            continue
        if fn._sequence_nr() < seq0:
            return True
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return False


class _Node(torch.autograd.Function):
    """The whole shard_map call as one node: backward runs all ranks' backwards."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        # The ranks' outputs and anchors are the roots of their graphs: saved here, not
        # kept by the state, so that autograd frees every rank's graph with this node's
        # saved tensors after a backward (unless retain_graph), and refuses a second
        # backward as it would for one device.
        roots, where = [], []
        for pos, outs in enumerate(state.local_outs):
            for k, t in enumerate(outs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    roots.append(t)
                    where.append(("out", pos, k))
        for pos, anchors in enumerate(state.anchors):
            for k, a in enumerate(anchors):
                roots.append(a)
                where.append(("anchor", pos, k))
        ctx.save_for_backward(*roots)
        ctx.where = where
        state.local_outs = [[None] * len(outs) for outs in state.local_outs]
        state.anchors = [[None] * len(a) for a in state.anchors]
        outs = tuple(state.node_vals)
        state.node_vals = None
        nondiff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return outs

    @staticmethod
    def backward(ctx, *gouts):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "shard_map: differentiating its gradient (create_graph=True, double "
                "backward) is not supported; take the second derivative inside the body "
                "(torch.func or torch.autograd.grad on each rank), or outside shard_map")
        saved = ctx.saved_tensors  # raises torch's own error on a second backward
        state = ctx.state
        outs = [list(o) for o in state.local_outs]
        anchors = [list(a) for a in state.anchors]
        for (kind, pos, k), t in zip(ctx.where, saved):
            (outs if kind == "out" else anchors)[pos][k] = t
        grads = state.backward(gouts, outs, anchors)
        return (None,) + tuple(grads)
