"""``save`` and ``load``: a training state across meshes, on torch.distributed.checkpoint.

Both run in two steps. First every rank checks its own part (its state or template
against the checkpoint) and the ranks agree, in one small exchange, that they pass the
same structure and directory and that none failed: an error is raised on every rank
before any data moves (``_agreement.py``). Then one DCP call per process does the work:
on processes DCP's own collectives, on rank threads one call for all of them (the last
to arrive runs it), on a threads mesh seen from ordinary code one call holding every
rank. The directory of versions is ``versions.py``; what a load reads, ``load_plan.py``;
how a checkpoint is read as data and verified, ``_metadata.py`` and ``_checksums.py``.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..comm import comm_of
from ..core._format import describe
from ..core._records import OpenRecords
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..transforms.sharded import Sharded, held_ranks
from . import _checksums as C
from . import entries as E
from . import versions as V
from ._agreement import run_on_ranks
from ._metadata import CorruptCheckpointError, inside, read_metadata
from ._reader import ShardReader
from .load_plan import plan_load
from .planners import ChunkLoadPlanner, ChunkSavePlanner
from .versions import latest

__all__ = ["ReadStats", "latest", "load", "read_stats", "save"]


# -- public API -------------------------------------------------------------------------

def save(state: Any, path: str | os.PathLike, mesh: Mesh, *, keep: int = 1) -> str:
    """Write ``state`` to the checkpoint directory ``path``; call it on every rank.

    Each element is written by one rank: a ``Sharded`` shard by the lowest rank holding
    it, a replicated tensor by one rank (they take turns, tensor by tensor), Python
    values by rank 0, ``PerRank`` values by their rank. The new version becomes the one
    ``load`` reads only once every rank's bytes are on disk; ``keep`` versions are kept.

    Args:
        state: a pytree of ``Sharded``, tensors, ``PerRank`` and Python values (see
            ``spmd.checkpoint``), with the same keys and shapes on every rank.
        path: the checkpoint directory (shared by every rank: one filesystem).
        mesh: the mesh the ranks run on. On processes, call from every process; on a
            threads mesh, from ordinary code (one call holds every rank) or from every
            rank thread.
        keep: how many finished versions to keep (>= 1).

    Returns:
        The directory of the version written (a plain DCP checkpoint).

    Raises:
        SpecError: on every rank, before anything is written, when the state's keys,
            shapes, layouts or Python values differ between ranks, or a leaf cannot be
            saved.

    Example:
        >>> import tempfile
        >>> mesh = Mesh((2,), ("sp",))
        >>> u = spmd.Sharded.from_global(torch.arange(6.0), mesh, P("sp"))
        >>> path = tempfile.mkdtemp()
        >>> spmd.checkpoint.save({"u": u, "w": torch.ones(2), "step": 3}, path, mesh)
        ... # doctest: +ELLIPSIS
        '.../v000001'
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise SpecError(f"spmd.checkpoint.save: keep must be an int >= 1, got {keep!r}")
    check_mesh(mesh, "spmd.checkpoint.save")
    ents, treedef = E.flatten(state, mesh, "spmd.checkpoint.save", template=False)
    root = os.fspath(path)
    tree = optree.tree_unflatten(treedef, [E.marker(e) for e in ents])
    return run_on_ranks(mesh, _SaveJob(ents, tree, root, mesh, keep), "spmd.checkpoint.save")


def load(template: Any, path: str | os.PathLike, mesh: Mesh | None = None) -> Any:
    """Read the checkpoint at ``path`` into the structure of ``template``; a new state.

    Each leaf of the template says what to read: a ``Sharded`` or a ``Layout`` reads the
    shards of that layout (any layout on any mesh, whatever layout it was saved in; each
    rank reads only the bytes of its own shard), a tensor reads the whole value (a saved
    ``Sharded`` too: its global tensor), ``PerRank`` the held ranks' values, a Python
    value the saved one, and ``AS_SAVED`` the saved subtree as it was.

    Args:
        template: the state's structure; its values are not read or changed.
        path: a checkpoint directory written by ``save`` (its last finished version), or
            one version / any plain DCP checkpoint directory.
        mesh: the mesh to load onto; None for one process with no mesh (then the
            template holds no ``Sharded`` or ``Layout``).

    Raises:
        SpecError: on every rank, before any tensor bytes are read, when a key of the
            template is not in the checkpoint, a global shape or dtype differs (naming the
            key and both), or the template differs between ranks.

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp()
        >>> u = spmd.Sharded.from_global(torch.arange(6.0), Mesh((2,), ("sp",)), P("sp"))
        >>> _ = spmd.checkpoint.save({"u": u, "step": 3}, path, u.mesh)
        >>> mesh3 = Mesh((3,), ("sp",))                 # another mesh, other shards
        >>> tmpl = {"u": Layout((6,), P("sp"), mesh3, sizes={0: [1, 0, 5]}), "step": 0}
        >>> back = spmd.checkpoint.load(tmpl, path, mesh3)
        >>> back["u"].shards[2].tolist(), back["step"]
        ([1.0, 2.0, 3.0, 4.0, 5.0], 3)
        >>> spmd.checkpoint.load({"u": torch.empty(6)}, path)["u"]  # one process, no mesh
        tensor([0., 1., 2., 3., 4., 5.])
    """
    if mesh is None:
        mesh = Mesh((1,), ("_",), backend="threads")
    check_mesh(mesh, "spmd.checkpoint.load")
    ents, treedef = E.flatten(template, mesh, "spmd.checkpoint.load", template=True)
    job = _LoadJob(ents, treedef, os.fspath(path), mesh)
    return run_on_ranks(mesh, job, "spmd.checkpoint.load")


@dataclass
class ReadStats:
    """Bytes read by ``load`` in this process while the ``read_stats`` block is open.

    ``payload_bytes``: tensor data; ``overhead_bytes``: DCP's and torch.save's headers,
    Python values and the tree record; ``full_reads``: stored chunks read whole because
    they could not be read in part (written by other tools, or compressed);
    ``check_bytes``: bytes read only to verify a checksum block a shard cuts;
    ``unverified_bytes``: bytes of tensors and Python values loaded that no checksum
    covered (checkpoints without checksums; edges of partial reads, see
    ``docs/checkpoints.md``).
    """

    payload_bytes: int = 0
    overhead_bytes: int = 0
    full_reads: int = 0
    check_bytes: int = 0
    unverified_bytes: int = 0


_stats: OpenRecords[ReadStats] = OpenRecords()


@contextlib.contextmanager
def read_stats() -> Iterator[ReadStats]:
    """Count the bytes ``load`` reads in this process.

    Example:
        >>> import tempfile
        >>> path, mesh = tempfile.mkdtemp(), Mesh((2,), ("sp",))
        >>> _ = spmd.checkpoint.save({"w": torch.zeros(1000)}, path, mesh)
        >>> with spmd.checkpoint.read_stats() as st:
        ...     _ = spmd.checkpoint.load({"w": Layout((1000,), P("sp"), mesh)}, path, mesh)
        >>> st.payload_bytes          # both ranks' halves, as this process holds both
        4000
    """
    with _stats.opened(ReadStats()) as st:
        yield st


def _count(reader: ShardReader, tree_bytes: int, tree_unverified: int) -> None:
    def add(s: ReadStats) -> None:
        s.payload_bytes += reader.payload_bytes
        s.overhead_bytes += reader.overhead_bytes + tree_bytes
        s.full_reads += reader.fallbacks
        s.check_bytes += reader.check_bytes
        s.unverified_bytes += reader.unverified_bytes + tree_unverified
    _stats.each(add)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP's calls, minus its noise: one process with no process group is what we asked
    for (DCP warns it "assumes" so), and a failure is raised as the rank's own exception
    (DCP wraps them in a CheckpointException, a BaseException that ``except Exception``
    does not catch) with the ranks it failed on in a note."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as ex:
            fails = getattr(ex, "failures", None) or {}
            if not fails:
                raise RuntimeError(str(ex)) from None
            rank = min(fails)
            first = fails[rank]
            err = first[0] if isinstance(first, tuple) else first
            if not isinstance(err, Exception):
                raise RuntimeError(str(ex)) from None
            if hasattr(err, "add_note"):
                err.add_note(f"(torch.distributed.checkpoint failed on ranks {sorted(fails)}; "
                             f"this is rank {rank}'s error)")
            raise err from None


# -- save -------------------------------------------------------------------------------

class _SaveJob:
    def __init__(self, ents: list[E.Entry], tree: Any, root: str, mesh: Mesh, keep: int):
        self.ents, self.tree, self.root, self.mesh, self.keep = ents, tree, root, mesh, keep

    def place(self) -> str:
        """The directory, resolved: the ranks must agree on it."""
        return os.path.realpath(self.root)

    def local_check(self) -> tuple[int, SpecError | None]:
        err = None
        held = set(held_ranks(self.mesh))
        try:
            V.check_root(self.root)
            for e in self.ents:
                if e.kind == "per_rank" and set(e.value.values) != held:
                    raise SpecError(
                        f"spmd.checkpoint.save: {e.key!r} is a PerRank holding ranks "
                        f"{sorted(e.value.values)}, but this process holds ranks "
                        f"{sorted(held)}: build it with PerRank.of(mesh, fn)")
                if e.kind == "sharded" and not held <= set(e.value.shards):
                    raise SpecError(
                        f"spmd.checkpoint.save: {e.key!r} holds the shards of ranks "
                        f"{sorted(e.value.shards)}, but this process holds ranks "
                        f"{sorted(held)}: a Sharded must hold the shards of every rank "
                        f"this process holds")
                if e.kind == "object":
                    _check_loadable(e.value, f"{e.key!r} ({describe(e.value)})")
            _check_loadable(self.tree, "the state's structure (its containers)")
        except SpecError as ex:
            err = ex
        objects = [e.value for e in self.ents if e.kind == "object"]
        return E.digest([E.structure(self.ents), objects, _sums(self.ents)]), err

    def run(self, held: tuple[int, ...], jobs: list[_SaveJob] | None) -> str:
        ents = self.ents if jobs is None else _merge_saves([j.ents for j in jobs], held)
        mesh, P = self.mesh, self.mesh.size
        tensors: dict[tuple[str, tuple], tuple[torch.Tensor, tuple]] = {}
        blobs: dict[str, Any] = {}
        turn = 0
        for e in ents:
            if e.kind == "sharded":
                lay: Layout = e.layout
                empty = 0 in lay.shape
                for r in sorted(set(lay.owners().values())):
                    if r not in held:
                        continue
                    t = e.value.shards[r]
                    if t.numel() == 0 and not (empty and r == 0):
                        continue  # nothing to write; one empty chunk names an empty tensor
                    tensors[(e.key, lay.offsets(r))] = (t, lay.shape)
            elif e.kind == "tensor":
                if turn % P in held:
                    tensors[(e.key, (0,) * e.value.ndim)] = (e.value, tuple(e.value.shape))
                turn += 1
            elif e.kind == "per_rank":
                for r in held:
                    v = e.value.values[r]
                    k = f"{e.key}@rank{r}"
                    if isinstance(v, torch.Tensor):
                        tensors[(k, (0,) * v.ndim)] = (v, tuple(v.shape))
                    else:
                        blobs[k] = v
        if 0 in held:
            blobs[E.TREE_KEY] = {"tree": self.tree, "ranks": P,
                                 "mesh": [list(mesh.shape), list(mesh.axis_names)]}
        version = V.begin(self.root, mesh, held)
        target = os.path.join(self.root, version)
        dist = mesh.backend == "torch"
        with _quiet():
            dcp.save({}, storage_writer=C.ChecksumWriter(target, sync_files=True),
                     planner=ChunkSavePlanner(tensors, blobs), no_dist=not dist)
        if 0 in held:
            V.commit(self.root, version, self.keep)
        if dist:
            comm_of(mesh).barrier(mesh.group(mesh.axis_names), name="spmd.checkpoint.save")
        return target


def _sums(ents: list[E.Entry]) -> list[float]:
    """One float64 sum per replicated tensor: ranks whose copies differ (a rank that
    skipped a gradient sync) disagree here, and one rank's copy alone would be saved."""
    vals = [e.value.detach() for e in ents if e.kind == "tensor"]
    if not vals:
        return []
    sums = [(torch.view_as_real(v) if v.is_complex() else v).double().sum() for v in vals]
    return torch.stack(sums).tolist()  # one device sync for all


def _merge_saves(parts: list[list[E.Entry]], held: tuple[int, ...]) -> list[E.Entry]:
    """Rank threads' entries as one process's: their shards and per-rank values joined."""
    out = []
    for i, e in enumerate(parts[0]):
        if e.kind == "sharded":
            shards = {r: p[i].value.shards[r] for r, p in zip(held, parts)}
            e = E.Entry(e.key, e.path, e.kind, Sharded(shards, e.layout, e.value.mesh),
                        e.layout)
        elif e.kind == "per_rank":
            e = E.Entry(e.key, e.path, e.kind,
                        E.PerRank({r: p[i].value.values[r] for r, p in zip(held, parts)}))
        out.append(e)
    return out


def _check_loadable(o: Any, what: str) -> None:
    """Python values are read back with torch.load(weights_only=True): refuse at save
    what that load would refuse, naming it."""
    buf = io.BytesIO()
    try:
        torch.save(o, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as ex:  # noqa: BLE001 - reworded below
        found = re.search(r"GLOBAL ([\w.]+)", str(ex))
        why = f"it refuses {found.group(1)}" if found else type(ex).__name__
        raise SpecError(
            f"spmd.checkpoint.save: torch.load(weights_only=True) could not read back "
            f"{what} ({why}); save numbers, strings, None, tensors, and dicts, lists and "
            f"tuples of them") from None


# -- load -------------------------------------------------------------------------------

class _LoadJob:
    def __init__(self, ents: list[E.Entry], treedef: Any, path: str, mesh: Mesh):
        self.ents, self.treedef, self.path, self.mesh = ents, treedef, path, mesh

    def place(self) -> str:
        return ""  # ranks may read the same checkpoint through different paths

    def local_check(self) -> tuple[int, SpecError | None]:
        err = None
        try:
            self.dir = V.read_dir(self.path)
            self.md = read_metadata(self.dir)
            self.saved = _read_tree(self.dir, self.md)
            self.plan = plan_load(self.ents, self.md, self.saved, self.mesh,
                                   held_ranks(self.mesh), self.dir)
        except SpecError as ex:
            err = ex
        return E.digest([E.structure(self.ents)]), err

    def run(self, held: tuple[int, ...], jobs: list[_LoadJob] | None) -> Any:
        if jobs is None:
            ents, plan = self.ents, self.plan
        else:
            # One plan for all rank threads; each one's own plan (its checks, done) holds
            # buffers for its shards: let them go before the joint plan makes its own.
            for j in jobs:
                j.plan = None
            ents = _merge_templates([j.ents for j in jobs], held)
            plan = plan_load(ents, self.md, self.saved, self.mesh, held, self.dir)
        planner = ChunkLoadPlanner(plan.dests, plan.blobs)
        reader = ShardReader(self.dir, metadata=self.md)
        with _quiet():
            dcp.load({}, storage_reader=reader, planner=planner,
                     no_dist=self.mesh.backend != "torch")
        _count(reader, plan.tree_bytes, plan.tree_unverified)
        leaves = plan.finish(planner.values)
        if jobs is None:
            return optree.tree_unflatten(self.treedef, leaves)
        return {r: optree.tree_unflatten(self.treedef, [_own(v, r, r == held[0])
                                                         for v in leaves])
                for r in held}


def _own(v: Any, rank: int, first: bool) -> Any:
    """Rank ``rank``'s part of a loaded leaf. Rank threads get values of their own, as
    processes do: an optimizer that loads a state uses its tensors in place."""
    if isinstance(v, Sharded):
        return Sharded({rank: v.shards[rank]}, v.layout, v.mesh)
    if isinstance(v, E.PerRank):
        return E.PerRank({rank: v.values[rank]})
    if first:
        return v
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor)
                           else copy.deepcopy(x), v, none_is_leaf=True, namespace="spmd")


def _merge_templates(parts: list[list[E.Entry]], held: tuple[int, ...]) -> list[E.Entry]:
    out = []
    for i, e in enumerate(parts[0]):
        if e.kind == "per_rank":
            e = E.Entry(e.key, e.path, e.kind,
                        E.PerRank({r: p[i].value.values.get(r) for r, p in zip(held, parts)}))
        out.append(e)
    return out


def _read_tree(d: str, md: Metadata) -> dict | None:
    """The tree record (structure and Python values), read directly: it is one small item."""
    info = (md.storage_data or {}).get(MetadataIndex(E.TREE_KEY))
    if info is None:
        return None
    path = inside(d, info.relative_path, f"spmd.checkpoint.load: the tree record of {d!r}")
    with open(path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    if getattr(info, "transform_descriptors", None):
        raise SpecError(f"spmd.checkpoint.load: the tree record of {d!r} was written with "
                        f"stream transforms {info.transform_descriptors}; load it with "
                        f"torch.distributed.checkpoint directly")
    where = f"{path}, item {E.TREE_KEY!r} (the state's structure and Python values)"
    if len(raw) != info.length:
        raise CorruptCheckpointError(f"{where}: truncated, {len(raw)} of {info.length} bytes")
    blocks = C.Blocks(info, len(raw))
    bad = blocks.check(0, memoryview(raw))
    if bad is not None:
        raise CorruptCheckpointError(f"{where}: checksum mismatch in bytes [{bad[0]}, "
                                     f"{bad[1]}); the file was damaged after it was written")
    try:
        out = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as ex:  # noqa: BLE001 - damaged, or a global weights_only refuses
        raise CorruptCheckpointError(f"{where}: cannot be read with torch.load(weights_only="
                                     f"True) ({type(ex).__name__}: {ex})") from None
    if not isinstance(out, dict) or "tree" not in out:
        raise CorruptCheckpointError(f"{where}: holds a {type(out).__name__}, not the record "
                                     f"spmd.checkpoint.save writes")
    out["bytes"], out["unverified"] = len(raw), blocks.unverified(0, len(raw))
    return out


