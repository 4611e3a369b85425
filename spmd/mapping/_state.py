"""Per-call state of a ``shard_map``: the layouts of its arguments, each rank's
shards, and the records its backward needs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm import comm_of, validating
from ..comm.rank_threads import run_on_threads, take_turn
from ..comm.stats import in_backward
from ..core._context import RankContext, one_pass
from ..core._format import describe, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P
from ..transforms.sharded import Sharded, run_cat_plan, same_cut
from ._agreement import _MASK, _fingerprint, _same_py
from ..core._engine import keep_graph as _keep_graph
from ._graph import _graph_leaves, _reaches_older_nodes
from ._outputs import (_assemble_threads, _check_rep_per_rank, _check_rep_threads,
                       _exchange_out_layouts, _gather_global, _out_layout, _rep_factor)



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


def _same_dtype(vals: list, ranks: list[int], where: str) -> None:
    """Every rank returned a tensor of one dtype (a concatenation would promote the
    others' silently, and a replicated output would be rank 0's)."""
    t0 = vals[0]
    for r, v in zip(ranks, vals):
        if not isinstance(v, torch.Tensor) or v.dtype != t0.dtype:
            raise SpecError(f"shard_map: {where} is {describe(t0)} on rank {ranks[0]} but "
                            f"{describe(v)} on rank {r}; every rank must return a tensor of "
                            f"the same dtype")


class _State:
    """Everything one shard_map call needs for assembly and backward."""

    def __init__(self, sm, ranks, global_leaves, in_layouts, diff, local_ins, local_outs,
                 out_specs, out_names, per_rank):
        self.sm, self.mesh, self.ranks = sm, sm.mesh, ranks
        self.global_leaves = global_leaves
        self.in_layouts, self.diff = in_layouts, diff
        self.local_ins, self.local_outs = local_ins, local_outs
        # out_names: each output's name in messages ("out[0]")
        self.out_specs, self.out_names, self.per_rank = out_specs, out_names, per_rank
        self.out_layouts: list[Layout | None] = []
        self.params: list[torch.Tensor] = []
        self.green = False  # the forward ran on rank greenlets: one backward pass
        self.seq0: int | None = None
        self.older: bool | None = None  # whether the graph reaches the caller's nodes
        self.outer: tuple[str, ...] = ()  # the axes an enclosing body is mapped over

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
            where = self.out_names[k]
            vals = [outs[k] for outs in self.local_outs]
            if not isinstance(vals[0], torch.Tensor):
                if self.per_rank or all(_same_py(v, vals[0]) for v in vals):
                    out.append(vals[0])
                    self.out_layouts.append(None)
                    continue
                bad = next(r for r, v in zip(self.ranks, vals) if not _same_py(v, vals[0]))
                raise SpecError(f"shard_map: {where} is {vals[0]!r} on rank {self.ranks[0]} but "
                                f"{vals[bad]!r} on rank {bad}; non-tensor outputs must agree")
            if not self.per_rank:  # processes: the gather compares them
                _same_dtype(vals, self.ranks, where)
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
                _check_rep_threads(vals, lay, where, self.sm.check_rep, mesh)
                self.out_layouts.append(lay)
                out.append(Sharded(dict(enumerate(vals)), lay, mesh))
                continue
            if self.per_rank:
                g, lay = _gather_global(vals[0], spec, mesh, self.ranks[0], where,
                                        self.sm.check_rep, self.outer)
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
                _check_rep_per_rank(v, lay, mesh, rank, where, self.sm.check_rep, self.outer)
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
            # One walk over every rank's graph (on rank greenlets custom_vjp calls are
            # nodes over all ranks, so each rank's graph reaches the others'). There the
            # ranks number their nodes on one thread, so the walk also answers
            # _reaches_older_nodes; rank threads number theirs apart.
            older = _graph_leaves([t for outs in self.local_outs for t in outs
                                   if isinstance(t, torch.Tensor)], mine, found,
                                  self.seq0 if self.green else None)
            if self.green:
                self.older = older
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
        keep = _keep_graph() or self.seq0 is None or (self.older if self.older is not None else
                                                        _reaches_older_nodes(
            [t for t in local_outs[0] + anchors[0] if isinstance(t, torch.Tensor)], self.seq0))

        def rank_grads(pos: int, rank: int):
            outs, cots = self._roots(pos, rank, gouts, local_outs)
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
        elif self.green:
            per = self._one_pass(gouts, local_outs, anchors, keep)
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
            got = [p[j] for p in per]
            if not self.per_rank and not lay.replicated_axes and all(g is not None for g in got):
                # every shard held by one rank: the gradient is their concatenation
                grads.append(run_cat_plan(self.sm.cat_plan(lay), got))
                continue
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

    def _roots(self, pos: int, rank: int, gouts, local_outs: list[list],
               shared: dict | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Rank ``rank``'s outputs that need a gradient and their cotangents. ``shared``:
        cotangents already cut for another rank holding the same shard (one pass)."""
        outs, cots = [], []
        for (k, p), g in zip(self.node_map, gouts):
            t = local_outs[pos][k]
            if g is None or t is None or not t.requires_grad or p not in (None, pos):
                continue
            outs.append(t)
            if p is None:  # a global output: this rank's part of its cotangent
                lay = self.out_layouts[k]
                if shared is None:
                    g = lay.shard(g, rank) / _rep_factor(lay)
                else:
                    key = (k, lay.shard_key(rank))
                    cut = shared.get(key)
                    if cut is None:
                        cut = shared[key] = lay.shard(g, rank) / _rep_factor(lay)
                    g = cut
            cots.append(g)
        return outs, cots

    def _one_pass(self, gouts, local_outs: list[list], anchors: list[list], keep: bool
                  ) -> list[list]:
        """Every rank's backward as ONE pass of torch's engine over all their graphs (the
        forward ran on rank greenlets, so each collective is one node over all ranks,
        ``collectives/mesh_vjp.py``): per rank, its inputs' gradients; the parameters'
        (summed over the ranks by the engine) with the first."""
        outs, cots, ins, roots = [], [], [], []
        shared: dict = {}  # a replicated output's cotangent is cut once
        for pos, rank in enumerate(self.ranks):
            o, c = self._roots(pos, rank, gouts, local_outs, shared)
            outs += o
            cots += c
            ins += self.local_ins[pos]
            roots += anchors[pos]
        n_local = [len(x) for x in self.local_ins]
        if not outs:
            return [[None] * (n + (len(self.params) if pos == 0 else 0))
                    for pos, n in enumerate(n_local)]
        comm = comm_of(self.mesh)
        take_turn(comm, self.mesh, self.mesh.timeout, "shard_map", "shard_map backward: ")
        comm.one_pass = True
        try:
            with one_pass():
                got = torch.autograd.grad(outs, ins + self.params + roots, cots,
                                          allow_unused=True, retain_graph=keep)
        finally:
            comm.one_pass = False
            comm.run_lock.release()
        per, at = [], 0
        for pos, n in enumerate(n_local):
            per.append(list(got[at:at + n]) + [None] * len(self.params))
            at += n
        if per:
            per[0][n_local[0]:] = got[at:at + len(self.params)]
        return per

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


