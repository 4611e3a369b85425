"""What every process must pass ``shard_map`` alike (global arguments, parameters),
checked by fingerprint across the mesh."""
from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from ..comm import comm_of
from ..comm.stats import uncounted
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


_RG_WORDS = 2  # requires_grad of the first 2 * 62 input leaves, bit by bit; a hash beyond


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


_spec_crcs: dict[int, tuple[Any, int]] = {}


def _spec_crc(specs: Any) -> int:
    """``_crc(repr(specs))``, found once per specs object: a ``shard_map`` passes the
    same ones on every call, and their repr costs more than the rest of the check.
    Only hashable specs (tuples, ``P``: immutable) are kept, by identity (the entry holds
    them, so the id stays theirs); a list may change between calls."""
    hit = _spec_crcs.get(id(specs))
    if hit is not None and hit[0] is specs:
        return hit[1]
    crc = _crc(repr(specs))
    try:
        hash(specs)
    except TypeError:
        return crc
    if len(_spec_crcs) >= 256:  # a program that builds specs per call: start over
        _spec_crcs.clear()
    _spec_crcs[id(specs)] = (specs, crc)
    return crc


def _check_call_agrees(mesh: Mesh, in_specs: Any, out_specs: Any, grad_on: bool,
                       needs_grad: list[bool], paths: Callable[[], list[str]]) -> None:
    """On processes, with default settings: every rank calls ``shard_map`` with the same
    ``in_specs`` and ``out_specs``, in the same grad mode, with the same inputs requiring
    gradients. Ranks that differ would run different collectives (an output gathered on
    one rank and not on another, a backward on one rank only) and meet nothing but a
    timeout; one all_gather of a few int64 before the body runs makes it a SpecError on
    every rank, naming what differs and the ranks.

    ``needs_grad``: per input leaf (``paths()`` names them), whether it requires grad."""
    group = mesh.group(mesh.axis_names, mesh.rank)
    bits = [0] * _RG_WORDS
    for i, g in enumerate(needs_grad[:62 * _RG_WORDS]):
        bits[i // 62] |= int(g) << (i % 62)
    row = [_spec_crc(in_specs), _spec_crc(out_specs), int(grad_on), len(needs_grad), *bits,
           _crc(repr(needs_grad[62 * _RG_WORDS:]))]
    mine = torch.tensor([row], dtype=torch.int64, device=mesh.device)
    with uncounted():  # an agreement check, not the program's communication
        rows = [t[0].tolist() for t in comm_of(mesh).all_gather(
            mine, group, 0, name="shard_map check", sizes=(1,) * group.size)]
    ranks = group.ranks

    def differ(k: int) -> list[int]:
        return [ranks[i] for i, r in enumerate(rows) if r[k] != rows[0][k]]

    def who(d: list[int]) -> str:
        return (f"rank {ranks[0]} and rank{'s' * (len(d) > 1)} {', '.join(map(str, d))}")

    for k, label, value in ((0, "in_specs", in_specs), (1, "out_specs", out_specs)):
        d = differ(k)
        if d:
            raise SpecError(f"shard_map: {label} differ between {who(d)} (rank {mesh.rank} "
                            f"passed {value!r}); every rank must pass the same {label}: they "
                            f"decide which collectives run")
    d = differ(2)
    if d:
        modes = ", ".join(f"rank {ranks[i]}: {'on' if r[2] else 'off'}"
                          for i, r in enumerate(rows))
        raise SpecError(f"shard_map: grad mode differs between {who(d)} ({modes}); call it "
                        f"under torch.no_grad() on every rank or on none: the backward's "
                        f"collectives run only where gradients are needed")
    if differ(3):
        return  # another argument structure: the layouts' own checks name it
    for k in range(4, 5 + _RG_WORDS):
        d = differ(k)
        if not d:
            continue
        j, other = 0, None
        if k < 4 + _RG_WORDS:
            first = rows[0][k] ^ next(r[k] for r in rows if r[k] != rows[0][k])
            j = 62 * (k - 4) + (first & -first).bit_length() - 1
        where = paths()[j] if k < 4 + _RG_WORDS else f"an input after the first {62 * _RG_WORDS}"
        if k < 4 + _RG_WORDS:
            other = [ranks[i] for i, r in enumerate(rows) if (r[k] >> (j - 62 * (k - 4))) & 1]
        have = (f" (it does on rank{'s' * (len(other) > 1)} {', '.join(map(str, other))} "
                f"only)" if other is not None else "")
        raise SpecError(f"shard_map: whether {where} requires grad differs between {who(d)}"
                        f"{have}; every rank must pass inputs that require grad alike: the "
                        f"backward's collectives run only where gradients are needed")


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


