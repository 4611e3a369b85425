"""A sharded computation against the same computation on one device, in float64."""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..core import _tree
from ..core._context import current
from ..core._format import dtype_str, shape_str
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..core.spec import P
from ..mapping import shard_map

__all__ = ["assert_matches_single_device", "default_tolerance"]

_WHO = "assert_matches_single_device"

# The sharded run does the same arithmetic as one device, but sums are split into
# per-rank partial sums and combined in rank order (psum, weight gradients, halo
# contributions added after the local part): a reordering, so float64 agrees to a few
# ulps. In lower precision the sharded run is compared with the float64 reference, so the
# tolerance covers rounding the inputs and every op to that precision: float32
# (eps 1.2e-7) gets rtol 1e-5 (~100 ulps, room for sums of some hundred terms) and atol
# 1e-6 for results that cancel to near zero; float16 (eps 9.8e-4) and bfloat16 (eps
# 7.8e-3) a few ulps of their own.
_TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used by ``assert_matches_single_device`` for a run in ``dtype``.

    Example:
        >>> from spmd.testing.single_device import default_tolerance
        >>> default_tolerance(torch.float64)
        (1e-10, 1e-10)
    """
    if dtype not in _TOLERANCE:
        raise TypeError(f"{_WHO}: dtype must be a floating dtype "
                        f"({', '.join(dtype_str(d) for d in _TOLERANCE)}), got {dtype}")
    return _TOLERANCE[dtype]


def assert_matches_single_device(f_local: Callable, f_global: Callable, mesh: Mesh,
                                 in_specs: Any, out_specs: Any, *args: Any,
                                 params: Sequence[torch.Tensor] = (), rtol: float | None = None,
                                 atol: float | None = None, check_grad: bool = True,
                                 dtype: torch.dtype = torch.float64, seed: int = 0,
                                 **shard_map_kwargs: Any) -> Any:
    """Check ``shard_map(f_local, mesh, in_specs, out_specs)(*args) == f_global(*args)``,
    in values and in gradients, against a float64 single-device reference.

    The sharded run gets copies of ``args`` with floating tensors cast to ``dtype``; the
    reference gets float64 copies. ``params`` (weights) are passed to both functions as
    trailing positional arguments; the shard_map body closes over them, so shard_map's
    rule for replicated parameters gives them their global gradients. Outputs may be a
    tensor or a pytree (tuple, list, dict) of tensors. With ``check_grad``, both runs are
    differentiated from the same random linear functional of the outputs (seeded by
    ``seed``) and the gradients of every floating argument and parameter are compared,
    including whether there is one.

    Modules: ``f_local`` and ``f_global`` may be ``nn.Module``s (a model converted with
    ``spmd.nn.convert`` and the original, say). Each is deep-copied (yours are left
    untouched) and cast, and when both are modules the gradients of their parameters are
    compared by name (``gradient of parameter 'net.0.weight'``).

    Tolerance (``rtol``/``atol`` override it): float64 1e-10/1e-10, since the sharded run
    only reorders additions across ranks; float32 1e-5/1e-6, float16 1e-2/1e-3, bfloat16
    5e-2/1e-2, which cover rounding to that precision (the reference stays float64).

    Called from ordinary code with a threads mesh (the main use), each rank runs on a
    thread and a failure names the rank and local index of the first differing element.
    Called on every rank of a torch mesh, each rank checks the global results it holds;
    ranks are named where the shard sizes can be told from the out spec.

    Args:
        f_local: the per-shard function, called as ``f_local(*local args, *params)``.
        f_global: the single-device function, ``f_global(*args, *params)``.
        mesh, in_specs, out_specs: as for ``spmd.shard_map``. A ``Layout`` out spec also
            checks the shard sizes the op produces.
        *args: global arguments (pytrees of tensors are fine).
        params: tensors the functions use as weights.
        rtol, atol: tolerance of every comparison.
        check_grad: compare gradients too.
        dtype: the floating dtype of the sharded run.
        seed: seeds the linear functional.
        **shard_map_kwargs: passed on to ``shard_map`` (e.g. ``check_rep=True``).

    Returns:
        The sharded outputs.

    Raises:
        AssertionError: naming what differs (``output[1]``, ``output['u']``,
            ``gradient of args[0]``, ``gradient of params[2]``), how many elements of
            how many, the first differing global index, the rank(s) holding it and its
            local index there, both values, the difference against the allowed one, and
            every rank whose shard holds a differing element. A shape or structure
            mismatch names both.

    Backward:
        Runs ``backward()`` through the shard_map node, so every rank's backward (its
        collectives included) is exercised.

    Ranks without data:
        A rank whose shard is empty takes part as usual; it is never named as holding
        an element.

    Example:
        >>> from spmd.testing import assert_matches_single_device
        >>> mesh = Mesh((3,), ("sp",))
        >>> x = torch.randn(7, 2)
        >>> y = assert_matches_single_device(
        ...     lambda x: spmd.psum((x ** 2).sum(0), "sp"), lambda x: (x ** 2).sum(0),
        ...     mesh, P("sp"), P(), x)
        >>> y.shape
        torch.Size([2])
    """
    check_mesh(mesh, _WHO)
    d_rtol, d_atol = default_tolerance(dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    params = list(params)
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError(f"{_WHO}: params must be tensors, got "
                        f"{[type(p).__name__ for p in params]}")
    a_args = _copy_tree(args, dtype, check_grad)
    b_args = _copy_tree(args, torch.float64, check_grad)
    a_params = [_copy(p, dtype, check_grad) for p in params]
    b_params = [_copy(p, torch.float64, check_grad) for p in params]
    # Copies, so the caller's modules get no gradients and keep their dtype.
    a_mod = copy.deepcopy(f_local).to(dtype) if isinstance(f_local, torch.nn.Module) else None
    b_mod = (copy.deepcopy(f_global).to(torch.float64)
             if isinstance(f_global, torch.nn.Module) else None)
    f_local = f_local if a_mod is None else a_mod
    f_global = f_global if b_mod is None else b_mod

    local_shapes: dict[int, list] = {}

    def body(*local_args):
        out = f_local(*local_args, *a_params)
        rank = current(_WHO).rank
        local_shapes[rank] = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                              for v in _tree.flatten(out)[0]]
        return out

    if a_mod is not None and "params" not in shard_map_kwargs:
        # wrapping f_local hides the module from shard_map's own parameter discovery
        shard_map_kwargs["params"] = [p for p in f_local.parameters() if p.requires_grad] + [
            p for p in a_params if p.requires_grad]
    out = shard_map(body, mesh, in_specs, out_specs, **shard_map_kwargs)(*a_args)
    ref = f_global(*b_args, *b_params)

    paths, outs, out_def = optree.tree_flatten_with_path(out, none_is_leaf=True,
                                                         namespace="spmd")
    _, refs, ref_def = optree.tree_flatten_with_path(ref, none_is_leaf=True, namespace="spmd")
    if out_def != ref_def:
        raise AssertionError(f"{_WHO}: the sharded output is {out_def} but the single-device "
                             f"reference is {ref_def}")
    out_specs_flat = _tree.match_specs(out_specs, out, "out_specs", "output")
    tol = (rtol, atol)
    for i, (path, o, r, s) in enumerate(zip(paths, outs, refs, out_specs_flat)):
        what = "output" + "".join(f"[{k!r}]" for k in path)
        if isinstance(r, torch.Tensor) and isinstance(o, torch.Tensor):
            layout = _out_layout(s, o, mesh, {k: v[i] for k, v in local_shapes.items()})
            _compare(what, o.detach(), r.detach(), layout, mesh, tol)
        elif o != r:
            raise AssertionError(f"{_WHO}: {what} is {o!r} but the single-device reference "
                                 f"gives {r!r}")
    if not check_grad:
        return out

    g = torch.Generator().manual_seed(seed)
    loss_a, loss_b = [], []
    for o, r in zip(outs, refs):
        if isinstance(r, torch.Tensor) and r.is_floating_point():
            w = torch.randn(r.shape, generator=g, dtype=torch.float64)
            if r.requires_grad:
                loss_b.append((r * w).sum())
            if isinstance(o, torch.Tensor) and o.requires_grad:
                loss_a.append((o.to(torch.float64) * w).sum())
    if loss_a:
        sum(loss_a).backward()
    if loss_b:
        sum(loss_b).backward()

    a_leaves = _tree.flatten(a_args)[0]
    b_leaves = _tree.flatten(b_args)[0]
    arg_paths = optree.tree_paths(args, none_is_leaf=True, namespace="spmd")
    in_flat = _tree.match_specs(in_specs, args, "in_specs", "args")
    for path, a, b, s in zip(arg_paths, a_leaves, b_leaves, in_flat):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            layout = s if isinstance(s, Layout) else Layout(b.shape, s, mesh)
            _compare_grad(f"gradient of {_tree.keystr('args', path)}", a, b, layout, mesh, tol)
    for k, (a, b) in enumerate(zip(a_params, b_params)):
        if b.is_floating_point():
            _compare_grad(f"gradient of params[{k}]", a, b, Layout(b.shape, P(), mesh), mesh,
                          tol)
    if a_mod is not None and b_mod is not None:
        _compare_modules(a_mod, b_mod, mesh, tol)
    return out


def _compare_modules(a: torch.nn.Module, b: torch.nn.Module, mesh: Mesh,
                     tol: tuple[float, float]) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        raise AssertionError(f"{_WHO}: the sharded module's parameters {sorted(pa)} are not "
                             f"the reference module's {sorted(pb)}")
    for name, q in pb.items():
        _compare_grad(f"gradient of parameter {name!r}", pa[name], q,
                      Layout(q.shape, P(), mesh), mesh, tol)


def _copy(x: Any, dtype: torch.dtype, grad: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        return x.detach().to(dtype).clone().requires_grad_(grad)
    return x.detach().clone()


def _copy_tree(args: tuple, dtype: torch.dtype, grad: bool) -> tuple:
    leaves, treedef = _tree.flatten(args)
    return optree.tree_unflatten(treedef, [_copy(x, dtype, grad) for x in leaves])


def _out_layout(spec: Any, out: torch.Tensor, mesh: Mesh, shapes: dict) -> Layout | None:
    """How ``out`` is cut into the ranks' shards, from the out spec and the local
    shapes the body produced; None where they cannot tell (per-rank view, uneven)."""
    if isinstance(spec, Layout):
        return spec
    shapes = {r: s for r, s in shapes.items() if s is not None}
    if len(shapes) == mesh.size:
        return Layout.from_local_shapes(shapes, spec, mesh)
    balanced = Layout(out.shape, spec, mesh)
    if all(balanced.local_shape(r) == s for r, s in shapes.items()):
        return balanced
    return None


def _compare_grad(what: str, a: torch.Tensor, b: torch.Tensor, layout: Layout | None,
                  mesh: Mesh, tol: tuple[float, float]) -> None:
    if (a.grad is None) != (b.grad is None):
        has, lacks = ("the sharded run", "the single-device reference") if b.grad is None \
            else ("the single-device reference", "the sharded run")
        raise AssertionError(f"{_WHO}: {what}: {has} has one but {lacks} has none")
    if b.grad is not None:
        _compare(what, a.grad, b.grad, layout, mesh, tol)


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, layout: Layout | None,
             mesh: Mesh, tol: tuple[float, float]) -> None:
    rtol, atol = tol
    if got.shape != want.shape:
        raise AssertionError(
            f"{_WHO}: {what} is {shape_str(got.shape, got.dtype)} but the single-device "
            f"reference is {shape_str(want.shape, want.dtype)}")
    if want.is_floating_point() or want.is_complex():
        g, w = got.to(want.dtype), want
        ok = torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        tol_str = f" (rtol={rtol:g}, atol={atol:g})"
    else:
        g, w = got, want
        ok = g == w
        tol_str = " (exactly)"
    bad = ~ok
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    idx = tuple(int(i) for i in bad.nonzero()[0])
    gv, wv = g[idx].item(), w[idx].item()
    msg = (f"{_WHO}: {what} differs from the float64 single-device reference in {n_bad} of "
           f"{want.numel()} elements{tol_str}. First at global index {idx}, "
           f"{_where(idx, layout, mesh)}: sharded {gv:.6g} vs reference {wv:.6g}")
    if want.is_floating_point():
        allowed = atol + rtol * abs(wv)
        msg += f" (|diff| {abs(gv - wv):.2e} > {allowed:.2g})"
    msg += "."
    if layout is not None:
        msg += f" Ranks with differing elements: {_bad_ranks(bad, layout, mesh)}."
    raise AssertionError(msg)


def _holders(idx: tuple[int, ...], layout: Layout, mesh: Mesh) -> list[int]:
    return [r for r in range(mesh.size)
            if all(s.start <= i < s.stop for i, s in zip(idx, layout.slices(r)))]


def _where(idx: tuple[int, ...], layout: Layout | None, mesh: Mesh) -> str:
    if layout is None:
        return "on a rank per-rank code cannot name (uneven shards: pass a Layout out spec)"
    holders = _holders(idx, layout, mesh)
    if not layout.split_dims:
        return "held by every rank (replicated)"
    local = tuple(i - o for i, o in zip(idx, layout.offsets(holders[0])))
    who = f"rank {holders[0]}" if len(holders) == 1 else f"ranks {holders}"
    return f"held by {who} at local index {local}"


def _bad_ranks(bad: torch.Tensor, layout: Layout, mesh: Mesh) -> list[int]:
    return [r for r in range(mesh.size) if bool(bad[layout.slices(r)].any())]
