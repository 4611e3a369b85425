"""What a checkpoint holds: a state pytree cut into named entries, and back.

A state is any pytree (dicts, lists, tuples, a model's and an optimiser's state_dicts)
whose leaves are:

- ``spmd.Sharded``: a global tensor held as shards; saved as its global tensor, each
  element by one rank, and loadable into any other layout;
- ``torch.Tensor``: replicated (every rank holds the same value, as a converted
  model's parameters and their Adam moments); saved once;
- ``PerRank``: one value per rank (a per-process RNG state); saved under
  ``<key>@rank<r>`` by each rank;
- anything else (the step counter, an optimiser's ``param_groups``): replicated Python
  values, saved once, in the checkpoint's tree record. They must load with
  ``torch.load(weights_only=True)``: numbers, strings, None, containers of them.

A template for ``load`` has the same leaves plus ``spmd.Layout`` (a ``Sharded`` of that
layout, dtype from the checkpoint) and ``AS_SAVED`` (this subtree as it was saved).
Keys join a leaf's path with ``.``, as torch's state_dicts do: ``model.conv1.weight``,
``optim.state.0.exp_avg``.
"""
from __future__ import annotations

import pickle
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..transforms.sharded import Sharded, held_ranks

__all__ = ["AS_SAVED", "PerRank", "TREE_KEY"]

#: The record holding the state's structure and its Python values.
TREE_KEY = "__spmd__.tree"
_MARK = "__spmd_leaf__"


class _AsSaved:
    __slots__ = ()

    def __repr__(self) -> str:
        return "spmd.checkpoint.AS_SAVED"

    def __reduce__(self):
        return "AS_SAVED"


#: A template leaf: load this subtree as it was saved (its structure, replicated tensors
#: in full, Python values), e.g. an optimiser's state_dict before its first step.
AS_SAVED = _AsSaved()


class PerRank:
    """One value per rank: saved by each rank under ``<key>@rank<r>``.

    ``values`` maps each rank this process holds to its value (a tensor or a Python
    value): its own rank in per-rank code, every rank on a threads mesh seen from
    outside its ranks. A template ``PerRank`` asks for the values of the ranks it lists.

    Example:
        >>> import tempfile
        >>> path, mesh = tempfile.mkdtemp(), Mesh((2,), ("sp",))
        >>> seeds = PerRank.of(mesh, lambda rank: torch.tensor([100 + rank]))
        >>> _ = spmd.checkpoint.save({"seed": seeds}, path, mesh)
        >>> spmd.checkpoint.load({"seed": seeds}, path, mesh)["seed"].values[1]
        tensor([101])
    """

    __slots__ = ("values",)

    def __init__(self, values: Mapping[int, Any]):
        if not isinstance(values, Mapping) or not values:
            raise TypeError(f"PerRank: values must be a non-empty {{rank: value}} mapping, "
                            f"got {describe(values)}")
        for r in values:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise TypeError(f"PerRank: keys must be ranks (ints >= 0), got {r!r}")
        self.values = dict(sorted(values.items()))

    @classmethod
    def of(cls, mesh: Mesh, fn: Callable[[int], Any]) -> PerRank:
        """``fn(rank)`` for every rank this process holds on ``mesh``."""
        return cls({r: fn(r) for r in held_ranks(mesh)})

    @property
    def local(self) -> Any:
        """The value of the only rank held (per-rank code)."""
        if len(self.values) != 1:
            raise SpecError(f"PerRank.local: this value holds ranks {list(self.values)}; "
                            f"index .values[rank]")
        return next(iter(self.values.values()))

    def __repr__(self) -> str:
        return f"PerRank(ranks {list(self.values)})"


# -- flattening -----------------------------------------------------------------------

@dataclass
class Entry:
    """One leaf of a state or template, named by its key."""

    key: str
    path: tuple
    kind: str             # "sharded" | "tensor" | "per_rank" | "object" | "as_saved"
    value: Any
    layout: Layout | None = None
    extra: dict = field(default_factory=dict)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (Sharded, PerRank, Layout, _AsSaved, torch.Tensor))


def keyname(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def flatten(tree: Any, mesh: Mesh, what: str, *, template: bool) -> tuple[list[Entry], Any]:
    """The entries of ``tree`` and its treedef. Raises ``SpecError`` naming the key."""
    paths, leaves, treedef = optree.tree_flatten_with_path(
        tree, is_leaf=_is_leaf, none_is_leaf=True, namespace="spmd")
    out: list[Entry] = []
    seen: dict[str, tuple] = {}
    for path, leaf in zip(paths, leaves):
        key = keyname(path)
        if not key:
            raise SpecError(f"{what}: the state must be a container (a dict of named "
                            f"values), got a bare {describe(leaf)}")
        if key in seen:
            raise SpecError(f"{what}: the paths {list(seen[key])} and {list(path)} both "
                            f"name the key {key!r}; rename one")
        if "@rank" in key or key.startswith("__spmd__"):
            raise SpecError(f"{what}: the key {key!r} is reserved (it contains '@rank' or "
                            f"starts with '__spmd__')")
        seen[key] = path
        out.append(_entry(key, path, leaf, mesh, what, template))
    return out, treedef


def _entry(key: str, path: tuple, leaf: Any, mesh: Mesh, what: str, template: bool) -> Entry:
    if isinstance(leaf, Sharded):
        if not leaf.layout.is_for(mesh):
            raise SpecError(f"{what}: {key!r} is a Sharded on {leaf.mesh!r}, not on the "
                            f"mesh given ({mesh!r})")
        return Entry(key, path, "sharded", leaf, leaf.layout)
    if isinstance(leaf, Layout):
        if not template:
            raise SpecError(f"{what}: {key!r} is a Layout; a state to save holds values "
                            f"(a Sharded, a tensor), a template may hold a Layout")
        if not leaf.is_for(mesh):
            raise SpecError(f"{what}: the layout of {key!r} is for a mesh "
                            f"{dict(zip(leaf.axis_names, leaf.mesh_shape))}, not {mesh!r}")
        return Entry(key, path, "sharded", None, leaf)
    if isinstance(leaf, torch.Tensor):
        if leaf.layout != torch.strided:
            raise SpecError(f"{what}: {key!r} is a {leaf.layout} tensor; checkpoints hold "
                            f"dense (strided) tensors: call .to_dense() first")
        if leaf.is_meta and not template:
            raise SpecError(f"{what}: {key!r} is a meta tensor, which has no values to save")
        return Entry(key, path, "tensor", leaf)
    if isinstance(leaf, PerRank):
        return Entry(key, path, "per_rank", leaf)
    if isinstance(leaf, _AsSaved):
        if not template:
            raise SpecError(f"{what}: {key!r} is AS_SAVED, which only a load template holds")
        return Entry(key, path, "as_saved", leaf)
    return Entry(key, path, "object", leaf)


# -- the tree record: structure and Python values, written once -------------------------

def marker(e: Entry) -> Any:
    """What the tree record holds for ``e``: a Python value itself, else
    ``(_MARK, kind, key)``; the record loads with ``torch.load(weights_only=True)``."""
    return e.value if e.kind == "object" else (_MARK, e.kind, e.key)


def is_marker(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and x[0] == _MARK


def digest(parts: list[Any]) -> int:
    """A 63-bit checksum of picklable parts, equal on every rank for equal parts."""
    h = 0
    for p in parts:
        try:
            b = pickle.dumps(p, protocol=4)
        except Exception:  # noqa: BLE001 - an unpicklable value still gets a stable name
            b = repr(p).encode()
        h = zlib.crc32(b, h)
        h = (h * 1_000_003 + len(b)) % (1 << 61)
    return h


def structure(entries: list[Entry]) -> list[Any]:
    """What every rank must agree on: keys, kinds, global shapes, dtypes, layouts."""
    out: list[Any] = []
    for e in entries:
        if e.kind == "sharded":
            lay = e.layout
            dt = str(e.value.dtype) if e.value is not None else ""
            out.append((e.key, "sharded", lay.shape, repr(lay.spec), lay.sizes, dt))
        elif e.kind == "tensor":
            out.append((e.key, "tensor", tuple(e.value.shape), str(e.value.dtype)))
        else:
            out.append((e.key, e.kind))
    return out
