"""A DCP storage reader that reads only the bytes of each requested box.

DCP's ``FileSystemWriter`` stores every tensor chunk as a torch.save zip archive inside a
``.distcp`` file. The stock ``FileSystemReader`` torch.loads a whole chunk and then narrows
it, so a rank that needs a quarter of a stored chunk reads all of it. :class:`ShardReader`
reads the archive's zip directory and its small ``data.pkl`` (a few hundred bytes), finds
where the chunk's raw bytes lie (``_archive.py``), and reads just the contiguous runs of
the requested box. Anything it does not recognise is read the stock way.

Nothing is unpickled beyond data: the metadata by ``_metadata.read_metadata``, a chunk's
``data.pkl`` by an unpickler that builds nothing, anything else by
``torch.load(weights_only=True)``. The checksums ``save`` records are verified on the
bytes read (``_checksums.py``).
"""
from __future__ import annotations

import io
import itertools
import math
import os
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import _checksums as C
from ._archive import _Layout, _probe, _Window
from ._metadata import CorruptCheckpointError, inside, read_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["ShardReader", "CorruptCheckpointError"]


# -- reading a box --------------------------------------------------------------------


def _box_runs(size: tuple[int, ...], offsets: tuple[int, ...],
              lengths: tuple[int, ...]) -> tuple[int, Iterator[int]]:
    """The box as (run length, start of every run), in elements, C order.

    A run spans the largest trailing block of dims the box covers whole, plus the next dim
    (partially), so runs are maximal: two consecutive ones are never adjacent.
    """
    n = len(size)
    if n == 0:
        return 1, iter([0])
    strides = [math.prod(size[d + 1:]) for d in range(n)]
    k = n - 1
    while k > 0 and offsets[k] == 0 and lengths[k] == size[k]:
        k -= 1
    base = sum(o * s for o, s in zip(offsets, strides))
    outer = itertools.product(*(range(length) for length in lengths[:k]))
    starts = (base + sum(i * s for i, s in zip(index, strides)) for index in outer)
    return lengths[k] * strides[k], starts


def _read_box(view: _Window, layout: _Layout, offsets: tuple[int, ...],
              lengths: tuple[int, ...], blocks: C.Blocks) -> tuple[torch.Tensor, int, int]:
    """The box, read run by run and verified block by block (``blocks``); also the bytes
    read only to complete blocks for verifying, and the box's bytes left unverified."""
    numel = math.prod(lengths)
    if numel == 0:
        return torch.empty(lengths, dtype=layout.dtype), 0, 0
    itemsize = layout.dtype.itemsize
    buffer = bytearray(numel * itemsize)
    out = memoryview(buffer)
    run, starts = _box_runs(layout.size, offsets, lengths)
    run_bytes, filled, extra, unverified = run * itemsize, 0, 0, 0
    for start in starts:
        a, b = start * itemsize, start * itemsize + run_bytes
        lo, hi = blocks.span(a, b)
        run_out = out[filled:filled + run_bytes]
        got = run_out if (lo, hi) == (a, b) else memoryview(bytearray(hi - lo))
        view.pread_exact(layout.data_start + lo, got)
        _checked(blocks, lo, got, view.where)
        if got is not run_out:
            run_out[:] = got[a - lo:b - lo]
            extra += hi - lo - run_bytes
        unverified += blocks.unverified(a, b)
        filled += run_bytes
    return torch.frombuffer(buffer, dtype=layout.dtype).reshape(lengths), extra, unverified


def _checked(blocks: C.Blocks, start: int, data: memoryview, where: str) -> None:
    bad = blocks.check(start, data)
    if bad is not None:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch in bytes [{bad[0]}, {bad[1]}) of the stored "
            f"values; the file was damaged after it was written")


def _narrow(tensor: torch.Tensor, offsets: tuple[int, ...],
            lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class ShardReader(FileSystemReader):
    """``FileSystemReader`` whose tensor reads fetch only the requested box of each chunk.

    A tensor chunk saved by ``FileSystemWriter`` (torch.save format, no stream transforms)
    as one C-contiguous dense tensor is read run by run: a box that covers whole trailing
    dims is one read, a column strip of a matrix one read per row. Any other item
    (transforms, compression, non-contiguous or unusual tensors, bytes items) is read
    whole and narrowed, as ``FileSystemReader`` does.

    Counters, accumulated over ``read_data`` calls until :meth:`reset_counters`:
        payload_bytes: tensor bytes read for boxes, plus all that torch.load read of
            tensor items read the stock way (the whole item, and a few KiB again).
        overhead_bytes: zip directories, local headers and pickles read to find the boxes,
            and bytes items (pickled Python values).
        fallbacks: tensor items read the stock way.
        check_bytes: bytes read only to complete a checksum block (not in a box).
        unverified_bytes: bytes of tensor and Python values loaded that no checksum
            covered (items without checksums; a partial read's edge blocks, see
            ``_checksums.py``).

    Example (one process; ``no_dist`` makes DCP warn that it assumes so):
        >>> import tempfile, warnings, torch, torch.distributed.checkpoint as dcp
        >>> warnings.filterwarnings("ignore", "torch.distributed is disabled")
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = dcp.save({"w": torch.arange(8.0)}, checkpoint_id=path, no_dist=True)
        ...     reader, out = ShardReader(path), {"w": torch.empty(8)}
        ...     dcp.load(out, storage_reader=reader, no_dist=True)
        >>> out["w"][:3], reader.payload_bytes, reader.fallbacks
        (tensor([0., 1., 2.]), 32, 0)
    """

    def __init__(self, path: str | os.PathLike, *, metadata: Metadata | None = None,
                 **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._metadata: Metadata | None = None
        self._read = metadata  # read and checked already (store.py)
        self.reset_counters()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read as data and checked (``_metadata.py``); never
        ``pickle.load``."""
        md = self._read if self._read is not None else read_metadata(os.fspath(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def reset_counters(self) -> None:
        """Set every counter to 0."""
        self.payload_bytes = 0
        self.overhead_bytes = 0
        self.fallbacks = 0
        self.check_bytes = 0
        self.unverified_bytes = 0

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata  # chunk sizes and dtypes, to cross-check each item

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # self.storage_data maps each MetadataIndex to FileSystemReader's _StorageInfo
        # (relative_path, offset, length, transform_descriptors): private, but it is the
        # only record of where an item lies, and the stock reader reads it the same way.
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path,
                                []).append(req)
        layouts: dict[MetadataIndex, _Layout | None] = {}  # a chunk read by several reqs
        blocks: dict[MetadataIndex, C.Blocks] = {}  # and the blocks they verified
        for relative_path, reqs in per_file.items():
            # read_metadata checked this; the metadata may come from elsewhere (a planner)
            path = inside(os.fspath(self.path), relative_path,
                          f"checkpoint {os.fspath(self.path)!r}")
            # Unbuffered: a byte counted is a byte asked of the OS, and a column strip does
            # not pull a buffer's worth of neighbours with each row.
            with open(path, "rb", buffering=0) as raw:
                # in file order: the reads move forwards
                reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                for req in reqs:
                    self._read_item(raw, path, req, planner, layouts, blocks)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, raw: IO[bytes], path: Any, req: ReadItem, planner: LoadPlanner,
                   layouts: dict[MetadataIndex, _Layout | None],
                   blocks: dict[MetadataIndex, C.Blocks]) -> None:
        info: _StorageInfo = self.storage_data[req.storage_index]
        index = req.storage_index
        where = f"checkpoint file {path}, item {index.fqn!r}"
        if index.offset is not None:
            where += f" (chunk at {list(index.offset)})"
        view = _Window(raw, info.offset, info.length, where)
        transforms = getattr(info, "transform_descriptors", None) or ()
        # self.transforms (FileSystemReader's stream-transform extensions, experimental) is
        # applied to every item read the stock way, as FileSystemReader.read_data does.
        if req.type == LoadItemType.BYTE_IO:
            if transforms:
                stream = self.transforms.transform_load_stream(req, transforms, view)
                data = io.BytesIO(stream.read(-1))
                self.unverified_bytes += len(data.getbuffer())
            else:
                blob = bytearray(info.length)
                view.read_exact(0, memoryview(blob))
                item = C.Blocks(info, info.length)
                _checked(item, 0, memoryview(blob), where)
                self.unverified_bytes += item.unverified(0, info.length)
                data = io.BytesIO(blob)
            self.overhead_bytes += view.nread  # a pickled Python value, not tensor data
            try:
                planner.load_bytes(req, data)
            except Exception as e:  # noqa: BLE001 - torch.load(weights_only) refused it
                raise CorruptCheckpointError(
                    f"{where}: the stored Python value cannot be read with "
                    f"torch.load(weights_only=True) ({type(e).__name__}: {e})") from None
            return

        if index not in layouts:
            layouts[index] = None if transforms else self._fast_layout(view, index)
            self.overhead_bytes += view.nread
            view.nread = 0
        layout = layouts[index]
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if layout is not None and len(offsets) == len(layout.size) and all(
                0 <= o and 0 <= n and o + n <= s
                for o, n, s in zip(offsets, lengths, layout.size)):
            if index not in blocks:
                blocks[index] = C.Blocks(info, math.prod(layout.size) * layout.dtype.itemsize)
            tensor, extra, unverified = _read_box(view, layout, offsets, lengths,
                                                  blocks[index])
            view.nread -= extra
            self.check_bytes += extra
            self.unverified_bytes += unverified
        else:
            self.fallbacks += 1
            view.seek(0)  # the probe moved it; torch.load reads from where the stream is
            stream = self.transforms.transform_load_stream(req, transforms, view)
            if not stream.seekable():  # torch.load needs to seek
                stream = io.BytesIO(stream.read(-1))
            try:
                whole = torch.load(stream, map_location="cpu", weights_only=True)
            except Exception as e:
                raise CorruptCheckpointError(f"{view.where}: torch.load failed: {e}") from e
            self._check_whole(whole, info, index, where)
            tensor = _narrow(whole, offsets, lengths)
        self.payload_bytes += view.nread

        # As FileSystemReader.read_data does: copy_ converts dtype, commit_tensor finishes.
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{where}: the stored chunk gives a box of size {list(tensor.size())} where "
                f"the metadata says {list(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _check_whole(self, whole: Any, info: Any, index: MetadataIndex, where: str) -> None:
        """A chunk read the stock way: it must be the tensor the metadata describes, and
        match its checksums (which cover its values in C order)."""
        md = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata else None
        chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())),
                     None) if isinstance(md, TensorStorageMetadata) else None
        if not isinstance(whole, torch.Tensor) or (chunk is not None and (
                tuple(whole.shape) != tuple(chunk.sizes)
                or whole.dtype != md.properties.dtype)):
            got = (f"{whole.dtype} {list(whole.shape)}" if isinstance(whole, torch.Tensor)
                   else type(whole).__name__)
            raise CorruptCheckpointError(f"{where}: the stored chunk is a {got}, not what "
                                         f"the metadata says")
        values = whole.resolve_conj().resolve_neg().contiguous()
        item = C.Blocks(info, values.nbytes)
        _checked(item, 0, C.tensor_bytes(values), where)
        self.unverified_bytes += item.unverified(0, values.nbytes)

    def _fast_layout(self, view: _Window, index: MetadataIndex) -> _Layout | None:
        """The item's layout if it is the chunk the metadata describes, else None."""
        layout = _probe(view)
        md = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata else None
        if layout is None or not isinstance(md, TensorStorageMetadata):
            return layout
        chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())),
                     None)
        # A disagreement is left to the stock path, which reads the item as it is.
        if (chunk is None or tuple(chunk.sizes) != layout.size
                or md.properties.dtype != layout.dtype):
            return None
        return layout
