"""Spec pytrees: match a prefix tree of specs to the leaves of arguments, by key path."""
from __future__ import annotations

from typing import Any

import optree

from .errors import SpecError
from .spec import P, as_spec


def _is_spec_leaf(x: object) -> bool:
    from .layout import Layout
    return x is None or isinstance(x, (P, Layout))


def keystr(root: str, path: tuple) -> str:
    return root + "".join(f"[{k!r}]" for k in path)


def flatten(tree: Any) -> tuple[list, optree.PyTreeSpec]:
    return optree.tree_flatten(tree, none_is_leaf=True, namespace="spmd")


def match_specs(specs: Any, tree: Any, spec_root: str, tree_root: str) -> list:
    """One spec (P or Layout) per leaf of ``tree``, from the prefix tree ``specs``.

    Raises SpecError naming the key path where the two trees part ways.
    """
    spaths, sleaves, _ = optree.tree_flatten_with_path(specs, is_leaf=_is_spec_leaf,
                                                       none_is_leaf=True, namespace="spmd")
    tpaths, tleaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True, namespace="spmd")
    by_path = dict(zip(spaths, sleaves))
    for sp, sv in zip(spaths, sleaves):
        if not _is_spec_leaf(sv):
            raise SpecError(f"{keystr(spec_root, sp)} is {sv!r}; specs must be spmd.P, "
                            f"spmd.Layout or None")
    # A spec must sit at a node or leaf of the tree: some tree path starts with it.
    for sp in spaths:
        if not any(tp[:len(sp)] == sp for tp in tpaths):
            near = sorted({keystr(tree_root, tp[:len(sp)]) for tp in tpaths
                           if len(tp) >= len(sp) and tp[:len(sp) - 1] == sp[:-1]})
            raise SpecError(
                f"{keystr(spec_root, sp)} matches nothing in {tree_root}: the specs must be a "
                f"prefix of the {tree_root} tree"
                + (f" (there, {tree_root} has {near})" if near else ""))
    out = []
    for tp in tpaths:
        for k in range(len(tp), -1, -1):
            if tp[:k] in by_path:
                s = by_path[tp[:k]]
                out.append(s if not (s is None or isinstance(s, P)) else as_spec(s))
                break
        else:
            raise SpecError(
                f"{spec_root} does not cover {keystr(tree_root, tp)}: the specs must be a "
                f"prefix of the {tree_root} tree (spec paths: "
                f"{[keystr(spec_root, p) for p in spaths][:6]})")
    return out
