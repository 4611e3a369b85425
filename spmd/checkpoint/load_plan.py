"""Planning a load: what to read for each template entry, checked against the
checkpoint's metadata, and how to build the loaded leaves once the bytes are in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from ..core._format import describe, shape_str
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..transforms.sharded import Sharded
from . import entries as E

__all__ = ["Plan", "plan_load"]


@dataclass
class Plan:
    dests: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]
    blobs: list[str]
    finish: Any
    tree_bytes: int
    tree_unverified: int = 0


def plan_load(ents: list[E.Entry], md: Metadata, saved: dict | None, mesh: Mesh,
               held: tuple[int, ...], d: str) -> Plan:
    """What to read for each template entry, checked against the checkpoint's metadata;
    and how to build the loaded leaves afterwards. Raises SpecError naming the key."""
    sdm = md.state_dict_metadata
    dests: dict[str, list] = {}
    blobs: list[str] = []
    makers: list[Any] = []

    def tensor_md(key: str, want: str) -> TensorStorageMetadata:
        m = sdm.get(key)
        if m is None:
            near = [k for k in sdm if k.startswith(key.rsplit(".", 1)[0])][:4]
            raise SpecError(f"spmd.checkpoint.load: the checkpoint {d!r} has no {key!r}"
                            + (f" (it has {near})" if near else "")
                            + f"; the template asks for {want}")
        if isinstance(m, BytesStorageMetadata):
            raise SpecError(f"spmd.checkpoint.load: {key!r} is a Python value in the "
                            f"checkpoint but the template asks for {want}")
        return m

    def full(key: str, m: TensorStorageMetadata, device) -> Any:
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype, device=device)
        dests[key] = [((0,) * t.ndim, t)]
        return lambda vals: t

    for e in ents:
        if e.kind == "sharded":
            lay: Layout = e.layout
            m = tensor_md(e.key, f"a Sharded of global shape {shape_str(lay.shape)}")
            dtype = e.value.dtype if e.value is not None else m.properties.dtype
            _same(e.key, tuple(m.size), lay.shape, m.properties.dtype, dtype)
            dev = e.value.device if e.value is not None else mesh.device
            reads: dict[int, torch.Tensor] = {}   # the first holder of each shard reads it
            copies: dict[int, int] = {}           # a replica copies its first holder's
            by_key: dict[tuple, int] = {}
            for r in held:
                k = lay.shard_key(r)
                if k in by_key:
                    copies[r] = by_key[k]
                    continue
                by_key[k] = r
                reads[r] = torch.empty(lay.local_shape(r), dtype=dtype, device=dev)
            dests[e.key] = [(lay.offsets(r), t) for r, t in reads.items()]
            makers.append(_sharded_maker(reads, copies, lay, mesh))
        elif e.kind == "tensor":
            m = tensor_md(e.key, f"a tensor of shape {shape_str(e.value.shape)}")
            _same(e.key, tuple(m.size), tuple(e.value.shape), m.properties.dtype,
                  e.value.dtype)
            makers.append(full(e.key, m, e.value.device))
        elif e.kind == "per_rank":
            n = (saved or {}).get("ranks", "?")
            makers.append(_per_rank_reads(
                e.key, e.value.values, sdm, full, blobs, mesh,
                lambda r, key=e.key, n=n: (
                    f"{key!r} holds one value per rank and the checkpoint was saved on {n} "
                    f"ranks, so it has none for rank {r}; leave {key!r} out of the "
                    f"template (and start that rank's value afresh) to load onto a "
                    f"different mesh")))
        elif e.kind == "object":
            makers.append(_object_maker(e, saved, d))
        elif e.kind == "as_saved":
            makers.append(_as_saved_maker(e, saved, sdm, d, full, mesh, held, blobs))
    tree_bytes = saved["bytes"] if saved else 0
    tree_unverified = saved["unverified"] if saved else 0

    def finish(values: dict[str, Any]) -> list[Any]:
        return [mk(values) for mk in makers]
    return Plan(dests, blobs, finish, tree_bytes, tree_unverified)


def _same(key: str, saved_shape: tuple, want_shape: tuple, saved_dtype, want_dtype) -> None:
    if tuple(saved_shape) != tuple(want_shape):
        raise SpecError(f"spmd.checkpoint.load: {key!r} has global shape "
                        f"{shape_str(saved_shape)} in the checkpoint but "
                        f"{shape_str(want_shape)} in the template")
    if saved_dtype != want_dtype:
        raise SpecError(f"spmd.checkpoint.load: {key!r} is {saved_dtype} in the checkpoint "
                        f"but {want_dtype} in the template; load it as {saved_dtype} "
                        f"(a Layout or AS_SAVED leaf) and convert")


def _sharded_maker(reads: dict[int, torch.Tensor], copies: dict[int, int], lay: Layout,
                   mesh: Mesh):
    def make(values: dict) -> Sharded:
        out = dict(reads)
        for r, src in copies.items():
            out[r] = reads[src].clone()  # every rank holds a tensor of its own
        return Sharded(dict(sorted(out.items())), lay, mesh)
    return make


def _per_rank_reads(key: str, ranks, sdm: dict, full, blobs: list[str], mesh: Mesh,
                    missing) -> Any:
    """Reads of ``key@rank<r>`` for ``ranks`` (tensors whole, Python values as blobs);
    ``missing(r)`` words the error for a rank the checkpoint has no value for."""
    vals = {}
    for r in ranks:
        k = f"{key}@rank{r}"
        m = sdm.get(k)
        if m is None:
            raise SpecError(f"spmd.checkpoint.load: {missing(r)}")
        if isinstance(m, BytesStorageMetadata):
            blobs.append(k)
            vals[r] = (k, None)
        else:
            vals[r] = (k, full(k, m, mesh.device))
    return _per_rank_maker(vals)


def _per_rank_maker(vals: dict[int, tuple[str, Any]]):
    def make(values: dict) -> E.PerRank:
        return E.PerRank({r: (values[k] if mk is None else mk(values))
                          for r, (k, mk) in vals.items()})
    return make


def _at(tree: Any, path: tuple, key: str, d: str) -> Any:
    node = tree
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            raise SpecError(f"spmd.checkpoint.load: the checkpoint {d!r} has no {key!r}") \
                from None
    return node


def _object_maker(e: E.Entry, saved: dict | None, d: str):
    if saved is None:
        raise SpecError(f"spmd.checkpoint.load: {e.key!r} is a Python value, but the "
                        f"checkpoint {d!r} was not written by spmd.checkpoint.save (it has "
                        f"no tree record)")
    v = _at(saved["tree"], e.path, e.key, d)
    if E.is_marker(v):
        raise SpecError(f"spmd.checkpoint.load: {e.key!r} is a {v[1]} in the checkpoint but "
                        f"the template holds a Python value ({describe(e.value)}); put a "
                        f"tensor, a Layout or AS_SAVED there")
    return lambda values: v


def _as_saved_maker(e: E.Entry, saved: dict | None, sdm: dict, d: str, full, mesh: Mesh,
                    held: tuple[int, ...], blobs: list[str]):
    if saved is None:
        raise SpecError(f"spmd.checkpoint.load: {e.key!r} is AS_SAVED, but the checkpoint "
                        f"{d!r} was not written by spmd.checkpoint.save (it has no tree "
                        f"record): give a template leaf for each value")
    sub = _at(saved["tree"], e.path, e.key, d)
    leaves, treedef = optree.tree_flatten(sub, is_leaf=E.is_marker, none_is_leaf=True,
                                          namespace="spmd")
    makers = []
    for leaf in leaves:
        if not E.is_marker(leaf):
            makers.append(lambda values, v=leaf: v)
            continue
        _, kind, key = leaf
        if kind == "tensor":
            makers.append(full(key, sdm[key], mesh.device))
        elif kind == "sharded":
            raise SpecError(f"spmd.checkpoint.load: {key!r} (under AS_SAVED {e.key!r}) was "
                            f"saved as a Sharded; the template must say how to hold it: a "
                            f"Layout (shards) or a tensor of its global shape")
        else:  # per_rank
            makers.append(_per_rank_reads(
                key, held, sdm, full, blobs, mesh,
                lambda r, key=key: f"{key!r} (under AS_SAVED {e.key!r}) has no value for "
                                   f"rank {r}"))

    def make(values: dict) -> Any:
        return optree.tree_unflatten(treedef, [mk(values) for mk in makers])
    return make
