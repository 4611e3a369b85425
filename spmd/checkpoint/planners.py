"""torch.distributed.checkpoint planners that write and read exactly the given chunks.

DCP's default planners know DTensor's and ShardedTensor's layouts. Ours are told the
chunks directly: the save planner writes the boxes ``(key, global offsets) -> tensor``
that this process owns (``store.py`` decides ownership so each element is written by one
rank), and the load planner fills destination boxes from whatever chunks the checkpoint
holds, so any saved layout loads into any other. The files are plain DCP: a checkpoint
written here loads with ``torch.distributed.checkpoint.load`` into tensors or DTensors of
the same keys, and the other way round.
"""
from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import _checksums as C

__all__ = ["ChunkLoadPlanner", "ChunkSavePlanner"]


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that owns exactly its elements: torch.save writes a view's
    whole storage, and the partial reader needs C order."""
    t = t.detach()
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and whole:
        return t
    return t.contiguous().clone() if t.is_contiguous() else t.contiguous()


class ChunkSavePlanner(SavePlanner):
    """Writes ``tensors[(key, offsets)] = (tensor, global_shape)`` and ``blobs[key]``
    (a Python value, torch.save'd) from this process, and the checksums of what it hands
    the writer in ``checksums[(key, offsets or None)]`` (``_checksums.ChecksumWriter``
    records them in the metadata)."""

    def __init__(self, tensors: Mapping[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple]],
                 blobs: Mapping[str, Any]):
        self.tensors = dict(tensors)
        self.blobs = dict(blobs)
        self.checksums: dict[tuple[str, tuple[int, ...] | None], tuple[int, list[int]]] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offs), (t, shape) in self.tensors.items():
            full = tuple(t.shape) == tuple(shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=t.shape)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offs)),
                type=WriteItemType.TENSOR if full else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                    size=torch.Size(shape))))
        for key in self.blobs:
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # No dedup: store.py gives each element one writer, and DCP's dedup would move
        # writes between ranks by its own rule.
        plans, md = create_default_global_save_plan(all_plans)
        return plans, md

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.blobs[key], buf)
            buf.seek(0)
            with buf.getbuffer() as data:
                self.checksums[(key, None)] = C.sums(data)
            return buf
        offs = tuple(write_item.index.offset)
        t, _ = self.tensors[(key, offs)]
        # The values in C order on the CPU (the writer copies there anyway): the bytes of
        # the stored record, which the checksums cover.
        t = _compact(t.resolve_conj().resolve_neg()).cpu()
        self.checksums[(key, offs)] = C.sums(C.tensor_bytes(t))
        return t


class ChunkLoadPlanner(LoadPlanner):
    """Fills ``dests[key] = [(offsets, tensor), ...]`` (boxes of the global tensor) and
    loads ``blobs`` (keys of Python values) into ``self.values``."""

    def __init__(self, dests: Mapping[str, list[tuple[tuple[int, ...], torch.Tensor]]],
                 blobs: list[str]):
        self.dests = {k: list(v) for k, v in dests.items()}
        self.blobs = list(blobs)
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        md = self.metadata.state_dict_metadata
        for key, boxes in self.dests.items():
            tmd = md[key]
            assert isinstance(tmd, TensorStorageMetadata), key  # store.py checked
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape)
                      for o, t in boxes]
            items += create_read_items_for_chunk_list(key, tmd, chunks)
        for key in self.blobs:
            zero = torch.Size((0,))
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=zero, storage_index=MetadataIndex(key),
                                  storage_offsets=zero, lengths=zero))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        _, t = self.dests[read_item.dest_index.fqn][read_item.dest_index.index]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: already in place
