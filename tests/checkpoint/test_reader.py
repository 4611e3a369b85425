"""ShardReader: loading a box of a DCP checkpoint reads only the box's bytes.

Checkpoints are written by plain DCP (FileSystemWriter, no process group); a test-local
LoadPlanner asks for one box of each global tensor, as a resharding load does.
"""
import io
import math
import tempfile
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from spmd.checkpoint._reader import CorruptCheckpointError, ShardReader, _box_runs

# dcp.save/load with no_dist=True warn that there is no process group: that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

OVERHEAD_PER_ITEM = 4096  # zip directory + local headers + data.pkl of one stored chunk


def _narrow(t, offsets, lengths):
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


def _box(t, offsets, lengths):
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


class BoxPlanner(LoadPlanner):
    """Loads the box at ``offsets[fqn]`` of each global tensor into ``state_dict[fqn]``
    (whose shape is the box's), as a rank of a new sharding would."""

    def __init__(self, offsets, items=None):
        self.offsets, self.items, self.committed = offsets, items, []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata = state_dict, metadata

    def create_local_plan(self):
        if self.items is not None:
            return LoadPlan(self.items)
        items = []
        for fqn, dest in self.state_dict.items():
            box = ChunkStorageMetadata(torch.Size(self.offsets[fqn]), dest.size())
            md = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, md, [box])
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise AssertionError("no bytes items here")

    def resolve_tensor(self, read_item):
        dest = self.state_dict[read_item.dest_index.fqn]
        return _narrow(dest, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        self.committed.append(read_item)


class RowChunkSavePlanner(DefaultSavePlanner):
    """Stores each tensor as chunks of ``rows`` rows, as ranks of a row sharding would."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def create_local_plan(self):
        items = []
        for fqn, t in self.state_dict.items():
            for start in range(0, t.shape[0], self.rows):
                chunk = ChunkStorageMetadata(
                    torch.Size([start] + [0] * (t.dim() - 1)),
                    torch.Size([min(self.rows, t.shape[0] - start), *t.shape[1:]]))
                items.append(WriteItem(
                    index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(t),
                                                t.size())))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item):
        t = self.state_dict[write_item.index.fqn]
        return t.narrow(0, write_item.index.offset[0], write_item.tensor_data.chunk.sizes[0])


def _save(path, state_dict, planner=None):
    writer = FileSystemWriter(path, sync_files=False)  # no fsync: fast, and nothing crashes
    dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)


def _load_box(path, fqn, shape_or_dest, offsets, dtype=None, reader=None, items=None):
    dest = (shape_or_dest if isinstance(shape_or_dest, torch.Tensor)
            else torch.full(shape_or_dest, 7, dtype=dtype))
    reader = reader or ShardReader(path)
    planner = BoxPlanner({fqn: offsets}, items)
    dcp.load({fqn: dest}, storage_reader=reader, planner=planner, no_dist=True)
    return dest, reader, planner


def _sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g).to(dtype)


def _check_fast(reader, box_numel, dtype, items=1):
    assert reader.fallbacks == 0
    assert reader.payload_bytes == box_numel * dtype.itemsize
    assert 0 < reader.overhead_bytes < OVERHEAD_PER_ITEM * items


BOXES = [  # (global shape, box offsets, box lengths)
    ((10,), (3,), (4,)),
    ((10,), (0,), (10,)),
    ((8, 6), (2, 1), (3, 4)),          # middle
    ((8, 6), (0, 2), (8, 2)),          # column strip: one run per row
    ((8, 6), (3, 0), (2, 6)),          # whole rows: one run
    ((8, 6), (0, 0), (8, 6)),          # full box
    ((5, 4, 3), (1, 1, 1), (3, 2, 2)),
    ((5, 4, 3), (1, 0, 0), (2, 4, 3)),
    ((5, 4, 3), (0, 0, 2), (5, 4, 1)),
    ((5, 1, 3), (2, 0, 0), (2, 1, 3)),
]


@pytest.mark.parametrize("shape, offsets, lengths", BOXES)
def test_box_is_read_exactly(tmp_path, shape, offsets, lengths):
    t = _sample(shape, torch.float32)
    _save(tmp_path, {"w": t})
    out, reader, planner = _load_box(tmp_path, "w", lengths, offsets, torch.float32)
    assert torch.equal(out, _box(t, offsets, lengths))
    assert len(planner.committed) == 1
    _check_fast(reader, out.numel(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.bool, torch.complex64, torch.float16, torch.uint8])
def test_dtypes_are_bit_exact(tmp_path, dtype):
    t = _sample((6, 5), dtype)
    _save(tmp_path, {"w": t})
    out, reader, _ = _load_box(tmp_path, "w", (3, 2), (2, 1), dtype)
    assert out.dtype == dtype and torch.equal(out, t[2:5, 1:3])
    _check_fast(reader, 6, dtype)


def test_new_dtypes_saved_untyped_are_read_exactly(tmp_path):
    # uint16 and float8 go through torch.save's _rebuild_tensor_v3 (UntypedStorage + dtype)
    for dtype in (torch.uint16, torch.float8_e4m3fn):
        bits = torch.arange(40, dtype=torch.int16).reshape(8, 5)
        t = bits.view(torch.uint16) if dtype == torch.uint16 else bits.to(torch.int8).view(dtype)
        path = tmp_path / str(dtype)
        _save(path, {"w": t})
        out, reader, _ = _load_box(path, "w", torch.empty(2, 5, dtype=dtype), (3, 0))
        raw = torch.int16 if dtype.itemsize == 2 else torch.int8
        assert torch.equal(out.view(raw), t[3:5].view(raw))
        _check_fast(reader, 10, dtype)


def test_scalar(tmp_path):
    t = torch.tensor(2.5, dtype=torch.float64)
    _save(tmp_path, {"s": t})
    out, reader, _ = _load_box(tmp_path, "s", (), (), torch.float64)
    assert torch.equal(out, t)
    _check_fast(reader, 1, torch.float64)


def test_empty_box_reads_no_tensor_bytes(tmp_path):
    t = _sample((6, 4), torch.float32)
    _save(tmp_path, {"w": t})
    out, reader, planner = _load_box(tmp_path, "w", (0, 4), (2, 0), torch.float32)
    assert out.shape == (0, 4) and len(planner.committed) == 1
    _check_fast(reader, 0, torch.float32)


def test_empty_tensor_reads_nothing(tmp_path):
    _save(tmp_path, {"w": torch.zeros(0, 3)})
    out, reader, planner = _load_box(tmp_path, "w", (0, 3), (0, 0), torch.float32)
    assert planner.committed == []  # DCP asks for no read of an empty chunk
    assert (reader.payload_bytes, reader.overhead_bytes, reader.fallbacks) == (0, 0, 0)


def test_box_across_stored_chunks(tmp_path):
    t = _sample((10, 6), torch.float32)
    _save(tmp_path, {"w": t}, RowChunkSavePlanner(rows=3))  # chunks at rows 0, 3, 6, 9
    assert len(FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"].chunks) == 4
    out, reader, planner = _load_box(tmp_path, "w", (6, 3), (2, 2), torch.float32)
    assert torch.equal(out, t[2:8, 2:5])
    assert len(planner.committed) == 3  # rows 2, 3-5, 6-7
    _check_fast(reader, out.numel(), torch.float32, items=3)


def test_each_stored_chunk_is_probed_once_per_load(tmp_path):
    t = _sample((4, 8), torch.float32)
    _save(tmp_path, {"w": t})
    # two reads of one stored chunk (a rank with two local chunks): one probe
    md = FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"]
    items = [create_read_items_for_chunk_list("w", md, [ChunkStorageMetadata(
        torch.Size([0, c]), torch.Size([4, 4]))])[0] for c in (0, 4)]
    items = [ReadItem(it.type, MetadataIndex("w", torch.Size([0, 0])),
                      torch.Size([0, c]), it.storage_index, it.storage_offsets, it.lengths)
             for it, c in zip(items, (0, 4))]
    once = ShardReader(tmp_path)
    _load_box(tmp_path, "w", torch.empty(4, 4), (0, 0), items=items[:1], reader=once)
    both = ShardReader(tmp_path)
    out, _, _ = _load_box(tmp_path, "w", torch.empty(4, 8), (0, 0), items=items, reader=both)
    assert torch.equal(out, t)
    assert both.overhead_bytes == once.overhead_bytes
    assert both.payload_bytes == t.numel() * 4 and both.fallbacks == 0


def test_dtype_conversion_on_copy_matches_stock_reader(tmp_path):
    t = _sample((6, 5), torch.float32)
    _save(tmp_path, {"w": t})
    out, reader, _ = _load_box(tmp_path, "w", (2, 5), (1, 0), torch.float64)
    want, _, _ = _load_box(tmp_path, "w", (2, 5), (1, 0), torch.float64,
                           reader=FileSystemReader(tmp_path))
    assert torch.equal(out, want) and torch.equal(out, t[1:3].double())
    _check_fast(reader, 10, torch.float32)


def test_non_contiguous_chunk_falls_back(tmp_path):
    # DCP does not make tensors contiguous: a transposed view is stored with its strides
    t = _sample((4, 6), torch.float32)
    _save(tmp_path, {"w": t.t()})
    out, reader, _ = _load_box(tmp_path, "w", (3, 2), (2, 1), torch.float32)
    assert torch.equal(out, t.t()[2:5, 1:3])
    assert reader.fallbacks == 1
    item = FileSystemReader(tmp_path)
    item.set_up_storage_reader(item.read_metadata(), True)
    item_length = next(iter(item.storage_data.values())).length
    assert reader.payload_bytes >= item_length  # torch.load read the whole item
    assert 0 < reader.overhead_bytes < OVERHEAD_PER_ITEM


def test_conj_tensor_falls_back(tmp_path):
    # a conj view is stored as its raw bytes plus a conj bit: not the values themselves
    t = _sample((5,), torch.complex64).conj()
    _save(tmp_path, {"w": t})
    out, reader, _ = _load_box(tmp_path, "w", (3,), (1,), torch.complex64)
    assert torch.equal(out, t[1:4]) and reader.fallbacks == 1


def test_counters_accumulate_until_reset(tmp_path):
    t = _sample((6, 5), torch.float32)
    _save(tmp_path, {"w": t})
    reader = ShardReader(tmp_path)
    _load_box(tmp_path, "w", (2, 5), (0, 0), torch.float32, reader=reader)
    _load_box(tmp_path, "w", (1, 5), (4, 0), torch.float32, reader=reader)
    assert reader.payload_bytes == 15 * 4
    reader.reset_counters()
    assert (reader.payload_bytes, reader.overhead_bytes, reader.fallbacks) == (0, 0, 0)


def test_bytes_items_and_default_planner(tmp_path):
    t = _sample((3, 4), torch.float32)
    _save(tmp_path, {"w": t, "step": 7})
    state = {"w": torch.empty(3, 4), "step": 0}
    reader = ShardReader(tmp_path)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["w"], t) and state["step"] == 7
    assert reader.fallbacks == 0 and reader.payload_bytes == t.numel() * 4
    assert reader.overhead_bytes > 0  # the pickled int counts here


def _header_flipped(blob, info):
    item = zipfile.ZipFile(io.BytesIO(blob[info.offset:info.offset + info.length]))
    record = next(r for r in item.infolist() if "/data/" in r.filename)
    blob[info.offset + record.header_offset] ^= 0xFF  # the storage record's local header
    return blob


def _damage(tmp_path, damage):
    t = _sample((6, 5), torch.float32)
    _save(tmp_path, {"w": t})
    reader = FileSystemReader(tmp_path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    info = next(iter(reader.storage_data.values()))
    path = tmp_path / info.relative_path
    path.write_bytes(bytes(damage(bytearray(path.read_bytes()), info)))


def test_corrupt_item_names_file_and_item(tmp_path):
    _damage(tmp_path, _header_flipped)
    with pytest.raises(CheckpointException) as caught:  # DCP wraps each rank's error
        _load_box(tmp_path, "w", (2, 5), (1, 0), torch.float32)
    error = caught.value.failures[0][0]
    assert isinstance(error, CorruptCheckpointError)
    assert "__0_0.distcp" in str(error) and "'w'" in str(error)
    assert "bad local zip header" in str(error)  # found by the probe


def test_truncated_file_is_found_when_the_metadata_is_read(tmp_path):
    _damage(tmp_path, lambda blob, info: blob[:info.offset + info.length - 100])
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp: truncated: the item 'w' "
                                                     r"lies at bytes \[0, \d+\) but the file "
                                                     r"has \d+ bytes"):
        ShardReader(tmp_path).read_metadata()


def test_runs_are_maximal():
    # (run length, number of runs) in elements
    def runs(size, offsets, lengths):
        run, starts = _box_runs(size, offsets, lengths)
        return run, list(starts)

    assert runs((8, 6), (0, 2), (8, 2)) == (2, [2 + 6 * i for i in range(8)])
    assert runs((8, 6), (3, 0), (2, 6)) == (12, [18])
    assert runs((5, 4, 3), (1, 0, 0), (2, 4, 3)) == (24, [12])
    assert runs((5, 4, 3), (1, 1, 0), (2, 2, 3)) == (6, [15, 27])
    assert runs((5, 1, 3), (1, 0, 1), (2, 1, 2)) == (2, [4, 7])
    assert runs((), (), ()) == (1, [0])


@st.composite
def _cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
    lengths = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offsets))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                  torch.complex64]))
    rows = draw(st.integers(1, 3))  # stored chunk height, when the tensor is chunked
    return shape, offsets, lengths, dtype, rows


@given(_cases())
def test_any_box_of_any_chunking_is_read_exactly(case):
    shape, offsets, lengths, dtype, rows = case
    t = _sample(shape, dtype, seed=len(shape))
    with tempfile.TemporaryDirectory() as path:
        _save(path, {"w": t}, RowChunkSavePlanner(rows) if shape else None)
        out, reader, planner = _load_box(path, "w", lengths, offsets, dtype)
    assert torch.equal(out, _box(t, offsets, lengths))
    assert reader.fallbacks == 0
    assert reader.payload_bytes == math.prod(lengths) * dtype.itemsize
    assert reader.overhead_bytes < OVERHEAD_PER_ITEM * max(1, len(planner.committed))
    assert all(r.type == LoadItemType.TENSOR for r in planner.committed)
