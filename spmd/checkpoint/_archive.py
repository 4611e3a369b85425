"""A stored item of a DCP checkpoint file, and where torch.save put a tensor's values in it.

DCP's ``FileSystemWriter`` stores every tensor chunk as a torch.save zip archive inside a
``.distcp`` file. :class:`_Window` is a read-only, byte-counting view of one item;
:func:`_probe` reads the archive's zip directory and its small ``data.pkl`` (with an
unpickler that builds nothing and admits only what torch.save writes for one dense
tensor) and says where the tensor's raw bytes start, so ``_reader.py`` can read a box of
them.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
import zipfile
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import torch

from ._metadata import CorruptCheckpointError

__all__ = ["_Layout", "_Window", "_probe"]


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
