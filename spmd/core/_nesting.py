"""Which mesh axes the running ``shard_map`` body is mapped over, for nested calls.

A ``shard_map`` body that splits its arguments over an axis holds shards along it. A
``shard_map`` called inside that body (per rank, on the same mesh) would treat each
rank's shard as the whole tensor: over the same axis it splits the shards again (a
silently wrong value); over another axis the values are right, but its boundary rule
(an input replicated over axes A gets its gradient summed over A) would sum over the
outer call's axes too. So the first is refused, and the second is refused where a
gradient is needed. Both decisions use only specs, the same on every rank
(tests/test_mapping.py, "nesting").
"""
from __future__ import annotations

from typing import Any

import optree

from ._bodies import bodies
from . import _tree
from .errors import SpecError
from .layout import Layout
from .mesh import Mesh
from .spec import P

__all__ = ["enclosing_axes", "spec_axes", "check_nested", "refuse_nested_grad"]


def enclosing_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` the enclosing shard_map bodies are mapped over (mesh order)."""
    used = {a for b in bodies() if b.mesh is mesh for a in b.axes}
    return tuple(a for a in mesh.axis_names if a in used)


def spec_axes(specs: Any) -> tuple[str, ...]:
    """Every axis named by a pytree of specs (``P``, ``Layout`` or None leaves)."""
    return tuple(a for _, a in _named_axes(specs, ""))


def _named_axes(specs: Any, root: str) -> list[tuple[str, str]]:
    paths, leaves, _ = optree.tree_flatten_with_path(specs, is_leaf=_tree._is_spec_leaf,
                                                     none_is_leaf=True, namespace="spmd")
    out = []
    for p, s in zip(paths, leaves):
        spec = s.spec if isinstance(s, Layout) else s
        if isinstance(spec, P):
            out += [(f"{_tree.keystr(root, p)} = {s!r}", a) for a in spec.axes]
    return out


def _ax(axes: tuple[str, ...]) -> str:
    return (f"axis {axes[0]!r}" if len(axes) == 1
            else "axes " + ", ".join(repr(a) for a in axes))


def check_nested(mesh: Mesh, in_specs: Any, out_specs: Any) -> tuple[str, ...]:
    """Refuse a nested call whose specs name an axis the enclosing body is mapped over;
    returns the enclosing axes (empty when not nested)."""
    outer = enclosing_axes(mesh)
    if not outer:
        return outer
    for where, a in _named_axes(in_specs, "in_specs") + _named_axes(out_specs, "out_specs"):
        if a in outer:
            raise SpecError(
                f"shard_map: nested in a shard_map body mapped over {_ax(outer)} of {mesh!r}, "
                f"but {where} names {a!r} again: the body holds shards along {a!r}, which the "
                f"nested call would split as if each were the whole tensor. Call the function "
                f"on the shards directly (collectives work in the body), or nest over an "
                f"axis the outer call does not name")
    return outer


def refuse_nested_grad(mesh: Mesh, outer: tuple[str, ...]) -> None:
    """Where a nested call (over other axes) would need a gradient."""
    raise NotImplementedError(
        f"nested shard_map: gradients are not supported yet: the enclosing shard_map body is "
        f"mapped over {_ax(outer)} of {mesh!r}, and the nested call would sum its inputs' and "
        f"parameters' gradients over {_ax(outer)} too, as if they were replicated there. Run "
        f"the nested call under torch.no_grad(), or call the function on the shards directly")
