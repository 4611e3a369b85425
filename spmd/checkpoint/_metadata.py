"""DCP's ``.metadata`` read as data: a restricted unpickler, then a check of what it says.

``FileSystemReader.read_metadata`` calls ``pickle.load``, which runs whatever the file
asks for. Here the file may name only the globals DCP's metadata is made of (its
dataclasses, ``torch.Size``, dtypes, layouts, the memory-format enum, ``pathlib`` paths);
``BUILD`` may fill in only instances of those dataclasses, never a class or a constant.
The result is then checked: every tensor's chunks lie inside it and tile it, every
non-empty chunk and Python value has a stored item, every item lies inside a file of the
version directory (after symlinks) and inside that file's bytes. A file that breaks any of
this raises, naming the file and what is wrong, before any tensor bytes are read.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..core.errors import SpecError
from . import _checksums as C

__all__ = ["CorruptCheckpointError", "inside", "read_metadata"]

METADATA_FILE = ".metadata"


class CorruptCheckpointError(SpecError, RuntimeError):
    """A checkpoint file is damaged: truncated, unreadable, or not what its metadata says
    (a checksum, a size, a record that does not match). The message names the file."""


_DCP_MD = "torch.distributed.checkpoint.metadata"
# The classes DCP's metadata pickles (found by pickling real metadata and listing the
# globals with pickletools), and the callables its __reduce__ methods name.
_CLASSES: dict[tuple[str, str], Any] = {
    (_DCP_MD, "Metadata"): Metadata,
    (_DCP_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_MD, "TensorProperties"): TensorProperties,
    (_DCP_MD, "MetadataIndex"): MetadataIndex,
    (_DCP_MD, "StorageMeta"): StorageMeta,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
}
_BUILDABLE = frozenset(_CLASSES.values())
_CALLABLES: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,   # an Enum, called with an int
    ("torch.serialization", "_get_layout"): lambda name: _LAYOUTS[name],
    ("collections", "OrderedDict"): collections.OrderedDict,
}
# StorageMeta.checkpoint_id may be a path; build pure paths, which touch no filesystem.
for _module in ("pathlib", "pathlib._local"):
    for _name in ("Path", "PosixPath", "PurePath", "PurePosixPath"):
        _CALLABLES[(_module, _name)] = pathlib.PurePosixPath
    for _name in ("WindowsPath", "PureWindowsPath"):
        _CALLABLES[(_module, _name)] = pathlib.PureWindowsPath
_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


class _Refused(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's own unpickler (Python), admitting DCP's metadata and nothing else.

    The Python implementation, not the C one: its ``BUILD`` can be checked, so a pickle
    cannot set attributes on an allowed class or constant (``setattr(Metadata, ...)``).
    """

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _CLASSES:
            return _CLASSES[key]
        if key in _CALLABLES:
            return _CALLABLES[key]
        if module == "torch" and isinstance(getattr(torch, name, None), _CONSTANTS):
            return getattr(torch, name)
        raise _Refused(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:60]!r}")

    def load_build(self) -> None:
        inst = self.stack[-2]  # below the state
        if type(inst) not in _BUILDABLE:
            raise _Refused(f"BUILD of a {type(inst).__name__}")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def inside(d: str, relative: Any, what: str) -> str:
    """``d/relative`` if it names a regular file inside the directory ``d`` once symlinks
    are resolved; else SpecError naming it."""
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise CorruptCheckpointError(f"{what}: names the file {relative!r}, which is not a "
                                     f"file name")
    path = os.path.join(d, relative)
    real, top = os.path.realpath(path), os.path.realpath(d)
    if os.path.isabs(relative) or os.path.commonpath([real, top]) != top or real == top:
        raise SpecError(f"{what}: names the file {relative!r}, which resolves to {real!r}, "
                        f"outside the checkpoint directory {top!r}: refusing to read it")
    if not os.path.isfile(real):
        raise CorruptCheckpointError(f"{what}: names the file {path!r}, which "
                                     f"{'is not a file' if os.path.exists(real) else 'is missing'}")
    return path


def read_metadata(d: str) -> Metadata:
    """The checked metadata of the DCP checkpoint directory ``d``.

    Raises:
        SpecError: the file names a global that is not part of DCP's metadata (naming
            it), or an item outside ``d``.
        CorruptCheckpointError: the file is empty, truncated or damaged, or contradicts
            the data files (naming the file and what is wrong).
    """
    path = inside(d, METADATA_FILE, f"checkpoint {d!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as ex:
        raise SpecError(f"{path}: cannot be read ({type(ex).__name__}: {ex})") from None
    if not raw:
        raise CorruptCheckpointError(f"{path}: empty (0 bytes): the checkpoint's metadata "
                                     f"was truncated or never written")
    stream = io.BytesIO(raw)
    try:
        md = _MetadataUnpickler(stream).load()
    except _Refused as ex:
        raise SpecError(f"{path}: refused to load the {ex.what}: a DCP .metadata file holds "
                        f"only DCP's metadata classes, torch.Size, dtypes and plain "
                        f"containers; this file is damaged or was crafted to run code, and "
                        f"nothing in it was run") from None
    except Exception as ex:  # noqa: BLE001 - any failure of a damaged pickle, reworded
        why = f"{type(ex).__name__}: {ex}" if str(ex) else \
            "it ends before its last record" if isinstance(ex, EOFError) else type(ex).__name__
        raise CorruptCheckpointError(
            f"{path}: cannot be read as DCP metadata ({why}); the file ({len(raw)} bytes) is "
            f"truncated or damaged") from None
    if stream.tell() != len(raw):
        raise CorruptCheckpointError(f"{path}: {len(raw) - stream.tell()} bytes follow the "
                                     f"end of the metadata; the file is damaged")
    try:
        _check(md, d, path)
    except SpecError:
        raise
    except Exception as ex:  # noqa: BLE001 - a field missing or of another type
        raise _bad(path, f"it does not hold what DCP writes ({type(ex).__name__}: "
                         f"{ex})") from None
    return md


def _bad(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}; the metadata is damaged")


def _dims(x: Any) -> bool:
    return isinstance(x, tuple) and all(type(n) is int and n >= 0 for n in x)


def _check(md: Any, d: str, path: str) -> None:
    if type(md) is not Metadata:
        raise _bad(path, f"holds a {type(md).__name__}, not DCP's Metadata")
    sdm, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise _bad(path, "its state_dict_metadata or storage_data is not a dict")
    for idx, info in storage.items():
        if type(idx) is not MetadataIndex or not isinstance(idx.fqn, str) or not (
                idx.offset is None or _dims(idx.offset)):
            raise _bad(path, f"storage_data has the key {idx!r}, not an item index")
        if type(info) is not _StorageInfo or type(info.offset) is not int or \
                type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise _bad(path, f"the storage record of {idx.fqn!r} is {info!r}")
        td = getattr(info, "transform_descriptors", None)
        if td is not None and not (isinstance(td, (list, tuple))
                                   and all(isinstance(s, str) for s in td)):
            raise _bad(path, f"the storage record of {idx.fqn!r} has transforms {td!r}")
    wanted: dict[Any, int | None] = {}  # stored items and their payload bytes (checksums)
    for key, m in sdm.items():
        if not isinstance(key, str):
            raise _bad(path, f"state_dict_metadata has the key {key!r}, not a string")
        if type(m) is BytesStorageMetadata:
            wanted[MetadataIndex(key)] = None
        elif type(m) is TensorStorageMetadata:
            for c in _check_tensor(key, m, path):
                wanted[MetadataIndex(key, torch.Size(c.offsets))] = \
                    math.prod(c.sizes) * m.properties.dtype.itemsize
        else:
            raise _bad(path, f"{key!r} is described by a {type(m).__name__}")
    files: dict[str, str] = {}  # relative path -> path, once checked
    sizes: dict[str, int] = {}
    for idx, nbytes in wanted.items():
        info = storage.get(idx)
        if info is None:
            raise _bad(path, f"{idx.fqn!r} (chunk at {list(idx.offset or ())}) has no "
                             f"storage record")
        rel = info.relative_path
        file = files.get(rel) if isinstance(rel, str) else None
        if file is None:
            file = files[rel] = inside(d, rel, f"{path}: the item {idx.fqn!r}")
            sizes[file] = os.path.getsize(file)
        if info.offset + info.length > sizes[file]:
            raise CorruptCheckpointError(
                f"{file}: truncated: the item {idx.fqn!r} lies at bytes [{info.offset}, "
                f"{info.offset + info.length}) but the file has {sizes[file]} bytes")
        if nbytes is not None and info.length < nbytes and \
                not getattr(info, "transform_descriptors", None):
            # an uncompressed archive holds at least its values: this also bounds what a
            # load allocates for a crafted size by the bytes on disk
            raise _bad(path, f"the item {idx.fqn!r} (chunk at {list(idx.offset or ())}) is "
                             f"{info.length} bytes long but its values take {nbytes}")
        if not C.fits(info, info.length if nbytes is None else nbytes):
            raise _bad(path, f"the checksum record of {idx.fqn!r} does not fit its bytes")


def _check_tensor(key: str, m: TensorStorageMetadata, path: str) -> list:
    """The chunks of ``key`` that hold bytes, once checked to tile the tensor."""
    p = m.properties
    if not _dims(m.size) or type(p) is not TensorProperties or \
            not isinstance(p.dtype, torch.dtype) or not isinstance(m.chunks, list):
        raise _bad(path, f"the tensor {key!r} has size {m.size!r}, properties {p!r}")
    total, stored, boxes = 0, [], []
    for c in m.chunks:
        if type(c) is not ChunkStorageMetadata or not _dims(c.offsets) or \
                not _dims(c.sizes) or not len(c.offsets) == len(c.sizes) == len(m.size) or \
                any(o + n > s for o, n, s in zip(c.offsets, c.sizes, m.size)):
            raise _bad(path, f"the tensor {key!r} of size {list(m.size)} has the chunk {c!r}")
        n = math.prod(c.sizes)
        total += n
        if n:
            stored.append(c)
            boxes.append((c.offsets, c.sizes))
    if total != math.prod(m.size) or _overlap(boxes):
        raise _bad(path, f"the chunks of {key!r} do not tile its size {list(m.size)} "
                         f"({len(m.chunks)} chunks holding {total} elements)")
    return stored


def _overlap(boxes: list) -> bool:
    """Whether two non-empty boxes overlap (with the element count equal to the tensor's,
    an overlap is also a gap); past 4096 chunks only the count is checked."""
    if len(boxes) < 2 or len(boxes) > 4096 or not boxes[0][0]:
        return False
    lo = torch.tensor([o for o, _ in boxes], dtype=torch.int64)
    hi = lo + torch.tensor([s for _, s in boxes], dtype=torch.int64)
    meet = ((lo[:, None] < hi[None]) & (lo[None] < hi[:, None])).all(-1)
    meet.fill_diagonal_(False)
    return bool(meet.any())
