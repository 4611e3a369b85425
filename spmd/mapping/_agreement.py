"""What every process must pass ``shard_map`` alike (global arguments, parameters),
checked by fingerprint across the mesh."""
from __future__ import annotations

import zlib
from typing import Any

import torch

from ..comm import comm_of
from ..core.errors import SpecError
from ..core.mesh import Mesh
from ..transforms.sharded import Sharded



def _fingerprint(x: Any) -> int:
    """63 bits that differ, but for a collision, where two ranks' values differ: the
    tensor's dtype, shape and bytes (two weighted sums of its 32-bit words, in bounded
    chunks), or a plain Python value's repr; other objects give 0 (not compared)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous().view(-1)
        h = zlib.crc32(f"{t.dtype}{tuple(x.shape)}".encode())
        b = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        words = b.view(torch.int32) if b.numel() % 4 == 0 else b
        s1 = s2 = 0
        for off in range(0, words.numel(), _CHUNK):
            v = words[off:off + _CHUNK].to(torch.int64)
            w = torch.arange(off, off + v.numel(), device=v.device) % 65521 + 1
            s1, s2 = s1 + int(v.sum()), s2 + int((v * w).sum())
        return hash((h, s1, s2)) & _MASK  # ints hash alike in every process
    if isinstance(x, Sharded):  # each rank holds its own shards: compare how they are cut
        return zlib.crc32(f"{x.layout!r} {x.dtype}".encode()) + 1
    if isinstance(x, list):
        return hash(tuple(_fingerprint(v) for v in x)) & _MASK
    if x is None or isinstance(x, (bool, int, float, str, complex)):
        return zlib.crc32(repr(x).encode()) + 1
    return 0


_CHUNK = 1 << 20
_MASK = (1 << 63) - 1


def _check_same_across(mesh: Mesh, named: list[tuple[str, Any]], what: str) -> None:
    group = mesh.group(mesh.axis_names, mesh.rank)
    mine = torch.tensor([_fingerprint(v) for _, v in named], dtype=torch.int64,
                        device=mesh.device)
    got = [t.tolist() for t in comm_of(mesh).all_gather(mine, group, 0, name=f"{what} check")]
    for i, row in enumerate(got):
        if len(row) != len(got[0]):
            raise SpecError(f"{what}: rank {group.ranks[i]} passed {len(row)} arguments and "
                            f"parameters, rank {group.ranks[0]} {len(got[0])}")
    for j, (name, _) in enumerate(named):
        differ = [group.ranks[i] for i, row in enumerate(got) if row[j] != got[0][j]]
        if differ:
            raise SpecError(
                f"{what} (SPMD_VALIDATE=1): {name} differs between ranks: rank "
                f"{group.ranks[0]} and rank{'s' * (len(differ) > 1)} "
                f"{', '.join(map(str, differ))} passed different values. Each process "
                f"splits its own copy of a global argument (and uses its own parameters) and "
                f"keeps its shard, so copies "
                f"that differ mix into a wrong result: give every rank the same value (seed "
                f"the initialisation alike, or broadcast it from one rank)")


def _same_py(a: Any, b: Any) -> bool:
    """Whether two non-tensor outputs are the same value (NaN equal to NaN: every rank
    computing NaN agrees)."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "__array__") and hasattr(a, "shape") and hasattr(a, "dtype"):
        import numpy as np  # numpy arrays (and the like): compared as arrays, not by ==
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return a is b


