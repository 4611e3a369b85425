"""A DCP storage reader that reads only the bytes of each requested box.

DCP's ``FileSystemWriter`` stores every tensor chunk as a torch.save zip archive inside a
``.distcp`` file. The stock ``FileSystemReader`` torch.loads a whole chunk and then narrows
it, so a rank that needs a quarter of a stored chunk reads all of it. :class:`ShardReader`
reads the archive's zip directory and its small ``data.pkl`` (a few hundred bytes), finds
where the chunk's raw bytes lie, and reads just the contiguous runs of the requested box.
Anything it does not recognise is read the stock way.

Nothing is unpickled beyond data: the metadata by ``_metadata.read_metadata``, a chunk's
``data.pkl`` by an unpickler that builds nothing, anything else by
``torch.load(weights_only=True)``. The checksums ``save`` records are verified on the
bytes read (``_checksums.py``).
"""
from __future__ import annotations

import collections
import io
import itertools
import math
import os
import pickle
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, NamedTuple

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
from ._metadata import CorruptCheckpointError, inside, read_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["ShardReader", "CorruptCheckpointError"]


# -- the window onto one stored item ----------------------------------------------------


class _Window(io.RawIOBase):
    """Read-only view of ``[start, start + length)`` of a raw file that counts bytes read.

    Every read of an item, by zipfile, by us or by torch.load, goes through one of these, so
    the reader's byte counters are exact.
    """

    def __init__(self, raw: IO[bytes], start: int, length: int, where: str):
        super().__init__()
        self._raw, self._start, self._length, self._pos = raw, start, length, 0
        self.where = where  # "file F, item I" for error messages
        self.nread = 0
        try:
            self._fd: int | None = raw.fileno() if hasattr(os, "preadv") else None
        except (OSError, io.UnsupportedOperation):
            self._fd = None

    @property
    def length(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self._length - self._pos))
        if n == 0:
            return 0
        self._raw.seek(self._start + self._pos)
        got = self._raw.readinto(out[:n]) or 0
        self._pos += got
        self.nread += got
        return got

    def pread_exact(self, pos: int, out: memoryview) -> None:
        """``read_exact`` in one system call where the file allows (``os.preadv``): a
        column strip is one read per row, and a seek plus a read through the io layers
        costs twice as much per row."""
        n = len(out)
        if self._fd is None or n == 0 or pos < 0 or pos + n > self._length:
            self.read_exact(pos, out)
            return
        got = os.preadv(self._fd, [out], self._start + pos)
        self.nread += got
        if got < n:
            self.read_exact(pos + got, out[got:])

    def read_exact(self, pos: int, out: memoryview) -> None:
        """Fill ``out`` from ``pos`` on; running out of data means the item is truncated."""
        self.seek(pos)
        got = 0
        while got < len(out):
            n = self.readinto(out[got:])
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.where}: truncated, wanted {len(out)} bytes at item offset {pos}, "
                    f"got {got}")
            got += n


# -- what torch.save wrote for one plain tensor -------------------------------------------


class _Storage(NamedTuple):
    key: str
    nbytes: int
    dtype: torch.dtype | None  # None: an UntypedStorage (bytes)


@dataclass(frozen=True)
class _Layout:
    """Where a stored C-contiguous tensor's bytes start in its item, and its shape."""

    data_start: int  # item offset of element 0 of the tensor (storage offset included)
    dtype: torch.dtype
    size: tuple[int, ...]


class _NotPlain(Exception):
    """The pickle is not torch.save of one plain dense tensor: use the stock path."""


# torch.save names the storage class of every dtype older than torch 2.3 (legacy classes);
# newer dtypes (uint16, float8, ...) go as UntypedStorage plus a dtype (_rebuild_tensor_v3).
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


class _StorageClass(NamedTuple):
    """Stands for a storage class in the pickle: its dtype, None for UntypedStorage."""

    dtype: torch.dtype | None


class _Tensor(NamedTuple):
    storage: _Storage
    offset: int  # in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _plain(storage: Any, storage_offset: Any, size: Any, stride: Any, backward_hooks: Any,
           metadata: Any, dtype: Any) -> _Tensor:
    # metadata carries the conj/neg bits: those tensors are not their raw bytes.
    if not isinstance(dtype, torch.dtype) or backward_hooks or metadata:
        raise _NotPlain("not a plain tensor")
    return _Tensor(storage, int(storage_offset), tuple(map(int, size)),
                   tuple(map(int, stride)), dtype)


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles torch.save's data.pkl of one dense tensor into a :class:`_Tensor`.

    Only the globals torch.save writes for that are allowed, and nothing is built: the
    storage becomes its key and size, ``_rebuild_tensor_v2/v3`` record their arguments.
    """

    def __init__(self, file: IO[bytes]):
        super().__init__(file)
        self.storages: list[_Storage] = []

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return self._rebuild_v3
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageClass(None)
        if module == "torch" and name in _LEGACY_STORAGES:
            return _StorageClass(_LEGACY_STORAGES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _NotPlain(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        # torch.save writes ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain(f"persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageClass):
            raise _NotPlain(f"storage type {kind!r}")
        itemsize = 1 if kind.dtype is None else kind.dtype.itemsize  # untyped: numel is bytes
        storage = _Storage(str(key), int(numel) * itemsize, kind.dtype)
        self.storages.append(storage)
        return storage

    def _rebuild_v2(self, storage: Any, storage_offset: Any, size: Any, stride: Any,
                    requires_grad: Any, backward_hooks: Any, metadata: Any = None) -> _Tensor:
        # v2: the storage is typed and gives the dtype
        if not isinstance(storage, _Storage) or storage.dtype is None:
            raise _NotPlain("v2 tensor without a typed storage")
        return _plain(storage, storage_offset, size, stride, backward_hooks, metadata,
                      storage.dtype)

    def _rebuild_v3(self, storage: Any, storage_offset: Any, size: Any, stride: Any,
                    requires_grad: Any, backward_hooks: Any, dtype: Any,
                    metadata: Any = None) -> _Tensor:
        # v3 (dtypes newer than the legacy storage classes): untyped storage plus a dtype
        if not isinstance(storage, _Storage) or storage.dtype is not None:
            raise _NotPlain("v3 tensor without an untyped storage")
        return _plain(storage, storage_offset, size, stride, backward_hooks, metadata, dtype)


_MAX_PICKLE = 64 * 1024  # a plain tensor's data.pkl is ~200 bytes; bigger is something else


def _is_c_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _probe(view: _Window) -> _Layout | None:
    """The layout of a torch.saved plain C-contiguous tensor in ``view``, or None.

    None means "read it the stock way" (a format this does not handle); raises
    :class:`CorruptCheckpointError` where the archive contradicts itself.
    """
    try:
        archive = zipfile.ZipFile(view)
    except Exception:  # not a zip archive (legacy torch.save?), or damaged: torch.load judges
        return None
    with archive:
        names = {info.filename: info for info in archive.infolist()}
        pkls = [n for n in names if n.endswith("/data.pkl")]
        if len(pkls) != 1 or names[pkls[0]].file_size > _MAX_PICKLE:
            return None
        prefix = pkls[0][: -len("data.pkl")]
        try:
            # torch.load takes an archive without a byteorder record as little-endian
            order = b"little"
            if prefix + "byteorder" in names:
                order = archive.read(prefix + "byteorder")
            unpickler = _TensorUnpickler(io.BytesIO(archive.read(pkls[0])))
            tensor = unpickler.load()
        except zipfile.BadZipFile as e:  # the directory was readable, a record is not
            raise CorruptCheckpointError(f"{view.where}: {e}") from e
        except Exception:  # _NotPlain, or a pickle torch.load may still understand
            return None
        if (order.decode(errors="replace") != sys.byteorder or not isinstance(tensor, _Tensor)
                or len(unpickler.storages) != 1 or len(tensor.size) != len(tensor.stride)
                or not _is_c_contiguous(tensor.size, tensor.stride)):
            return None
        record = names.get(prefix + "data/" + tensor.storage.key)
        if record is None:
            raise CorruptCheckpointError(
                f"{view.where}: no record for storage {tensor.storage.key!r}")
        if record.compress_type != zipfile.ZIP_STORED:
            return None
        if record.file_size != tensor.storage.nbytes:
            raise CorruptCheckpointError(
                f"{view.where}: storage record {record.filename!r} holds {record.file_size} "
                f"bytes, its pickle says {tensor.storage.nbytes}")
        itemsize = tensor.dtype.itemsize
        end = (tensor.offset + math.prod(tensor.size)) * itemsize
        if math.prod(tensor.size) and end > record.file_size:
            raise CorruptCheckpointError(
                f"{view.where}: tensor of size {list(tensor.size)} at storage offset "
                f"{tensor.offset} ends at byte {end} of a {record.file_size}-byte storage")
        data_start = _record_data_start(view, record)
        if data_start + record.file_size > view.length:
            raise CorruptCheckpointError(f"{view.where}: storage record runs past the item")
        return _Layout(data_start + tensor.offset * itemsize, tensor.dtype, tensor.size)


def _record_data_start(view: _Window, record: zipfile.ZipInfo) -> int:
    """Item offset of a zip record's bytes: after its local header, name and extra field."""
    name = record.filename.encode()
    header = bytearray(30 + len(name))
    view.read_exact(record.header_offset, memoryview(header))
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    if header[:4] != b"PK\x03\x04" or name_len != len(name) or header[30:] != name:
        raise CorruptCheckpointError(
            f"{view.where}: bad local zip header for record {record.filename!r}")
    return record.header_offset + 30 + name_len + extra_len


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
