"""A checkpoint directory of versions, and the atomic switch from one to the next.

    path/LATEST        "v000002": the last save that finished on every rank
    path/v000002/      .metadata + __<rank>_0.distcp files (DCP's FileSystemWriter)

A save writes a new version and, once every rank's files and DCP's metadata (written
last) are on disk, replaces ``LATEST`` atomically (``os.replace`` of a synced file);
then it deletes older versions. A save cut short leaves ``LATEST`` naming the previous
version, which still loads; the next save removes the partial directory.

``LATEST`` is followed only to a version of this directory: ``v`` and digits, a directory
whose real path (symlinks resolved) lies directly in ``path``. Anything else is refused.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading

import torch

from ..comm import comm_of
from ..core.errors import SpecError
from ..core.mesh import Mesh
from ._metadata import METADATA_FILE, CorruptCheckpointError

__all__ = ["begin", "check_root", "commit", "latest", "read_dir"]

LATEST_FILE = "LATEST"
VERSION = re.compile(r"^v(\d{6,})$")


def latest(path: str | os.PathLike) -> str | None:
    """The directory of the last finished version under ``path``, or None.

    Raises:
        SpecError: ``LATEST`` names something other than a version of ``path`` (``..``,
            an absolute path, a symlink out of ``path``).
        CorruptCheckpointError: ``LATEST`` is not a version name at all (not text,
            empty, damaged).
    """
    root = os.fspath(path)
    file = os.path.join(root, LATEST_FILE)
    try:
        with open(file, "rb") as f:
            raw = f.read(256)  # "v000001\n"; anything longer is not a version name
    except FileNotFoundError:
        return None
    except OSError as ex:
        raise CorruptCheckpointError(f"spmd.checkpoint: {file!r} cannot be read "
                                     f"({type(ex).__name__}: {ex})") from None
    expected = "expected 'v' and 6 or more digits, as spmd.checkpoint.save writes"
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"spmd.checkpoint: {file!r} is not text (it starts "
                                     f"{raw[:16]!r}); {expected}; the file is damaged") \
            from None
    if not name:
        raise CorruptCheckpointError(f"spmd.checkpoint: {file!r} is empty; {expected}; "
                                     f"the file is damaged")
    if not VERSION.match(name):
        raise SpecError(f"spmd.checkpoint: {file!r} names {name[:80]!r}, not a version of "
                        f"{root!r} ({expected}); refusing to follow it")
    d = os.path.join(root, name)
    real = os.path.realpath(d)
    if os.path.dirname(real) != os.path.realpath(root):
        raise SpecError(f"spmd.checkpoint: {file!r} names {name!r}, a link to {real!r}, "
                        f"outside {root!r}; refusing to follow it")
    return d


def check_root(root: str) -> None:
    if os.path.isfile(root):
        raise SpecError(f"spmd.checkpoint.save: {root!r} is a file; give a directory")
    if os.path.isdir(root):
        names = os.listdir(root)
        ours = [n for n in names if n == LATEST_FILE or VERSION.match(n) or n.startswith(".tmp")]
        if names and not ours:
            raise SpecError(f"spmd.checkpoint.save: {root!r} holds files that are not an "
                            f"spmd checkpoint ({sorted(names)[:4]}); refusing to write "
                            f"there: give a new or an spmd checkpoint directory")


def begin(root: str, mesh: Mesh, held: tuple[int, ...]) -> str:
    """The new version's name, chosen by rank 0 and known to every rank."""
    n = 0
    if 0 in held:
        os.makedirs(root, exist_ok=True)
        n = max((num for num, _ in _versions(root)), default=0) + 1
    if mesh.backend == "torch":
        t = torch.tensor([n], dtype=torch.int64, device=mesh.device)
        n = int(comm_of(mesh).broadcast(t, 0, mesh.group(mesh.axis_names),
                                        name="spmd.checkpoint.save").item())
    return f"v{n:06d}"


def commit(root: str, version: str, keep: int) -> None:
    tmp = os.path.join(root, f".tmp-{LATEST_FILE}-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST_FILE))
    with contextlib.suppress(OSError):  # not every filesystem can fsync a directory
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    # Keep the newest `keep` finished versions (with DCP's .metadata, written last);
    # remove older ones and those a save cut short left without it.
    cur = int(version[1:])
    vs = _versions(root)
    done = [name for num, name in vs if num <= cur
            and os.path.isfile(os.path.join(root, name, ".metadata"))]
    for num, name in vs:
        if num <= cur and name not in done[-keep:]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _versions(root: str) -> list[tuple[int, str]]:
    """``(number, directory name)`` of every version under ``root``, finished or not,
    oldest first."""
    return sorted((int(m.group(1)), m.group(0)) for m in map(VERSION.match, os.listdir(root))
                  if m)


def read_dir(path: str) -> str:
    """The version directory a load reads: ``path`` itself if it holds DCP metadata, else
    the version ``LATEST`` names."""
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    d = latest(path)
    if d is None:
        what = "does not exist" if not os.path.exists(path) else \
            "holds no finished checkpoint (no LATEST, no .metadata)"
        raise SpecError(f"spmd.checkpoint.load: {path!r} {what}")
    if not os.path.isfile(os.path.join(d, ".metadata")):
        raise SpecError(f"spmd.checkpoint.load: {path!r} names version {d!r}, which has no "
                        f".metadata: the directory was damaged after the save finished")
    return d
