"""Checksums of stored items: crc32 per block of bytes, kept in DCP's own metadata.

``save`` records, on the storage record of every item it writes (DCP's ``_StorageInfo``),
the attribute ``spmd_crc32 = (block, crcs)``: the crc32 of each ``block`` bytes, packed
as 4 little-endian bytes each into one ``bytes`` (plain data, small and quick to read;
DCP and older spmd ignore the attribute). For a tensor chunk the bytes are its values in
C order (the bytes of the torch.save storage record, which is what a partial read
reads); for a Python value, the item's bytes. A load verifies every block it reads
whole: a whole chunk or value entirely; a part of a chunk, the blocks inside the runs it
reads, and those at a run's edges where reading the rest of them costs at most the run
itself (or 4 KiB); else those edge blocks stay unverified, and ``read_stats`` counts
them. Items without the attribute (checkpoints written by plain DCP or older spmd) load
unverified.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

__all__ = ["ATTR", "BLOCK", "Blocks", "ChecksumWriter", "fits", "stored", "sums",
           "tensor_bytes"]

ATTR = "spmd_crc32"
#: Bytes per checksum: 64 KiB adds 4 bytes of metadata per 64 KiB stored (64 KiB per
#: GiB) while a rank reading rows of a chunk verifies all but < 64 KiB at each edge.
BLOCK = 1 << 16


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a C-contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def sums(data: memoryview, block: int | None = None) -> tuple[int, bytes]:
    """``(block, crc32 of each block of data, packed)``: the value ``save`` records."""
    block = block or BLOCK
    return block, b"".join(zlib.crc32(data[i:i + block]).to_bytes(4, "little")
                           for i in range(0, len(data), block))


def stored(info: Any) -> tuple[int, bytes] | None:
    """The checksums recorded for a storage record (None: none recorded)."""
    return getattr(info, ATTR, None)


def fits(info: Any, nbytes: int) -> bool:
    """Whether the checksums of a record (if any) are well formed for ``nbytes`` bytes."""
    got = stored(info)
    if got is None:
        return True
    return (isinstance(got, tuple) and len(got) == 2 and type(got[0]) is int and got[0] > 0
            and type(got[1]) is bytes and len(got[1]) == 4 * -(-nbytes // got[0]))


class Blocks:
    """The checksums of one stored item (``total`` bytes) and the blocks a load has
    verified so far; an item without checksums has none (every byte unverified)."""

    def __init__(self, info: Any, total: int):
        self.block, self.crcs = stored(info) or (0, b"")
        self.total = total
        self.done: set[int] = set()

    def span(self, a: int, b: int, slack: int = 4096) -> tuple[int, int]:
        """The bytes to read for the run ``[a, b)``: widened to the edges of the blocks it
        cuts, so they can be verified, where that reads at most ``max(b - a, slack)``
        bytes more; else ``[a, b)`` itself (its edge blocks stay unverified)."""
        if not self.block or a >= b:
            return a, b
        k0, k1 = a // self.block, (b - 1) // self.block
        lo = a if k0 in self.done else k0 * self.block
        hi = b if k1 in self.done else min((k1 + 1) * self.block, self.total)
        return (lo, hi) if (a - lo) + (hi - b) <= max(b - a, slack) else (a, b)

    def check(self, start: int, data: memoryview) -> tuple[int, int] | None:
        """Verify the blocks lying wholly in ``data`` (the item's bytes from ``start``);
        the first that fails, as ``(lo, hi)``, or None."""
        if not self.block:
            return None
        for k in range(-(-start // self.block), len(self.crcs) // 4):
            lo, hi = k * self.block, min((k + 1) * self.block, self.total)
            if hi > start + len(data):
                break
            if k in self.done:
                continue
            crc = zlib.crc32(data[lo - start:hi - start]).to_bytes(4, "little")
            if crc != self.crcs[4 * k:4 * k + 4]:
                return lo, hi
            self.done.add(k)
        return None

    def unverified(self, a: int, b: int) -> int:
        """How many of the bytes ``[a, b)`` lie in blocks not verified."""
        if not self.block:
            return b - a
        out = 0
        for k in range(a // self.block, (b - 1) // self.block + 1 if b > a else 0):
            if k not in self.done:
                out += min(b, (k + 1) * self.block) - max(a, k * self.block)
        return out


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that records on each item's storage record the checksums the
    planner computed of its bytes (``planner.checksums[(key, offsets or None)]``); they
    travel to the coordinator with DCP's write results, into ``.metadata``."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = super().write_data(plan, planner).wait()  # written by now (synchronous)
        table = getattr(planner, "checksums", {})
        for wr in results:
            off = wr.index.offset
            got = table.get((wr.index.fqn, None if off is None else tuple(off)))
            if got is not None:
                setattr(wr.storage_data, ATTR, got)
        fut: Future = Future()
        fut.set_result(results)
        return fut
