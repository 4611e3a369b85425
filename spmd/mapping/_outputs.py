"""``shard_map``'s outputs: their layouts, assembled on a threads mesh or gathered on
processes, and the check that a replicated output is the same on every rank."""
from __future__ import annotations

import math
import os

import torch

from ..comm import comm_of, validating
from ..core._format import describe, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.spec import P
from ..transforms.sharded import Sharded, cat_plan, run_cat_plan
from ._agreement import _fingerprint



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
                      check_rep: bool | None, cache: dict) -> tuple[torch.Tensor, Layout]:
    shapes = tuple(tuple(v.shape) for v in vals)
    hit = cache.get((shapes, spec))
    if hit is None:
        lay = _out_layout(dict(enumerate(shapes)), spec, mesh, where)
        owners = lay.owners()
        hit = cache[(shapes, spec)] = (lay, owners, cat_plan(lay, owners))
        if len(cache) > 256:
            cache.pop(next(iter(cache)))
    lay, owners, plan = hit
    _check_rep_threads(vals, lay, where, check_rep, mesh, owners)
    with torch.no_grad():
        return run_cat_plan(plan, vals), lay


def rep_check(check_rep: bool | None, mesh: Mesh, lay: Layout) -> str | None:
    """How this call verifies that an output of layout ``lay`` is the same on every rank
    of the axes its spec leaves out: ``"exact"`` (``check_rep=True``: bit for bit),
    ``"close"`` (the default where it costs no message: on a threads mesh, unless
    ``SPMD_VALIDATE=0``; on processes only under ``SPMD_VALIDATE=1``: equal within the
    dtype's float tolerance, exact for other dtypes) or None (``check_rep=False``, or
    no such axes)."""
    if not lay.replicated_axes:
        return None
    if check_rep is not None:
        return "exact" if check_rep else None
    if mesh.backend == "threads":
        return None if os.environ.get("SPMD_VALIDATE", "") == "0" else "close"
    return "close" if validating(mesh) else None


def _all_equal(vals: list[torch.Tensor]) -> bool:
    """Whether every value equals the first, bit for bit (one stack and one compare)."""
    v0 = vals[0]
    if not any(v.requires_grad for v in vals):
        return torch.equal(torch.stack(vals[1:]), v0.expand(len(vals) - 1, *v0.shape))
    with torch.no_grad():  # no graph for the stack
        return torch.equal(torch.stack(vals[1:]), v0.expand(len(vals) - 1, *v0.shape))


def _check_rep_threads(vals: list[torch.Tensor], lay: Layout, where: str,
                       check_rep: bool | None, mesh: Mesh, owners: dict | None = None) -> None:
    """Every rank's value equals the copy of the lowest rank holding its shard (as
    ``rep_check`` says)."""
    mode = rep_check(check_rep, mesh, lay)
    if mode is None:
        return
    owners = lay.owners() if owners is None else owners
    if len(owners) == 1 and len(vals) > 2:  # one shard, every rank's: compared at once
        if _all_equal(vals):
            return
    for r in range(len(vals)):
        o = owners[lay.shard_key(r)]
        if r != o:
            _compare_rep(vals[o], vals[r], o, r, where, lay, mode)


def _check_rep_per_rank(v: torch.Tensor, lay: Layout, mesh: Mesh, rank: int, where: str,
                        check_rep: bool | None, outer: tuple[str, ...] = ()) -> None:
    """Per-rank view: every rank of the replicated axes holds the same value (as
    ``rep_check`` says; but along ``outer``, the axes an enclosing shard_map body is
    mapped over: there each rank holds its own shards, and the nested call's specs say
    nothing about them)."""
    mode = rep_check(check_rep, mesh, lay)
    axes = tuple(a for a in lay.replicated_axes if a not in outer)
    if mode is None or not axes:
        return
    group = mesh.group(axes, rank)
    parts = comm_of(mesh).all_gather(v.detach().unsqueeze(0), group, 0, name="check_rep")
    for i, p in enumerate(parts):
        _compare_rep(parts[0][0], p[0], group.ranks[0], group.ranks[i], where, lay, mode,
                     axes)


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


def rep_tolerance(dtype: torch.dtype) -> float:
    """How far apart, relative to the output's largest magnitude, two ranks' copies of a
    replicated float output may be and still count as one value (``check_rep``'s
    default): the square root of the dtype's epsilon (f32: 3.5e-4, bf16: 0.088). Sums
    made in another order on each rank (a ring of ppermutes) differ by a few epsilons; a
    value that is not replicated at all (a rank's partial sum, a psum left out) differs
    by about its own size."""
    return torch.finfo(dtype).eps ** 0.5


def _beyond(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where ``a`` and ``b`` differ by more than ``rep_tolerance`` of their largest finite
    magnitude (NaN and infinities must match exactly)."""
    with torch.no_grad():
        fin = torch.isfinite(a) & torch.isfinite(b)
        scale = torch.where(fin, torch.maximum(a.abs(), b.abs()), 0).max() if a.numel() else 0
        far = (a - b).abs() > rep_tolerance(a.dtype) * scale
        off = (a != b) & ~(torch.isnan(a) & torch.isnan(b))  # NaN on both: equal
        return torch.where(fin, far, off)


def _compare_rep(a: torch.Tensor, b: torch.Tensor, ra: int, rb: int, where: str,
                 lay: Layout, mode: str, axes: tuple[str, ...] | None = None) -> None:
    if a.shape == b.shape and torch.equal(a, b):
        return
    axes = lay.replicated_axes if axes is None else axes
    head = "shard_map(check_rep=True)" if mode == "exact" else "shard_map"
    if a.shape != b.shape:
        raise SpecError(
            f"{head}: {where} is claimed replicated over "
            f"{list(axes)} by out_specs {lay.spec!r}, but it is "
            f"{tuple(a.shape)} on rank {ra} and {tuple(b.shape)} on rank {rb}")
    inexact = a.is_floating_point() or a.is_complex()
    if mode == "close" and inexact:
        diff = _beyond(a, b)
    else:
        diff = (a != b)
        if inexact:
            diff &= ~(torch.isnan(a) & torch.isnan(b))  # NaN where every rank has NaN: equal
    if not diff.any():
        return
    idx = tuple(int(i) for i in diff.nonzero()[0])
    how = (f" (by more than {rep_tolerance(a.dtype):.2g} of its largest magnitude)"
           if mode == "close" and inexact else "")
    raise SpecError(
        f"{head}: {where} is claimed replicated over "
        f"{list(axes)} by out_specs {lay.spec!r}, but rank {rb} differs from "
        f"rank {ra} at local index {list(idx)}: {b[idx].item()!r} vs {a[idx].item()!r}{how}; "
        f"split the output over those axes in out_specs, or make it equal (e.g. psum)"
        + ("" if mode == "exact" else "; check_rep=False skips this check"))


def _gather_global(v: torch.Tensor, spec: P, mesh: Mesh, rank: int, where: str,
                   check_rep: bool | None, outer: tuple[str, ...] = ()
                   ) -> tuple[torch.Tensor, Layout]:
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
    _check_rep_per_rank(v, lay, mesh, rank, where, check_rep, outer)
    return g, lay


