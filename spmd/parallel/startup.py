"""Start-up consistency: every rank of a group starts from the same parameters.

Three steps, each a fixed number of collectives (none per tensor):

1. ``check_same_names`` over the whole mesh (so that every rank takes the same steps
   next), then ``check_same_tensors`` over each group of replicas: the ranks hold the
   same tensors (names, dtypes, shapes), compared as int64 metadata, so that nothing
   later all-reduces buffers of different sizes (gloo aborts the process on that).
   Always run.
2. ``broadcast_from_first``: copy member 0's values everywhere, one broadcast per
   (dtype, device).
3. ``verify_equal``: or compare instead, with one all_gather of a float64 checksum
   (CRC-32 of the bytes: exact, bit for bit) per tensor.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from ..comm import comm_of
from ..core._format import axis_phrase, shape_str
from ..core.errors import SpecError
from ..core.mesh import Group, Mesh

__all__ = ["check_same_names", "check_same_tensors", "broadcast_from_first", "verify_equal",
           "start_up"]

_MAXDIM = 8


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


def _row(name: str, t: torch.Tensor) -> list[int]:
    shape = list(t.shape)
    dims = shape[:_MAXDIM] + [-1] * (_MAXDIM - min(len(shape), _MAXDIM))
    return [_crc(name), _crc(str(t.dtype)), t.dim(), *dims, _crc(repr(shape))]


def _gather(mesh: Mesh, group: Group, vec: torch.Tensor, what: str) -> list[torch.Tensor]:
    return comm_of(mesh).all_gather(vec, group, 0, name=what, sizes=(vec.shape[0],) * group.size)


def _axes(group: Group) -> str:
    return axis_phrase(group.axes)


def _same_signature(mesh: Mesh, group: Group, count: int, sig: int, what: str) -> bool:
    """One small all_gather of (count, signature): whether every member has the same;
    the same SpecError on every member where the counts differ."""
    first = [v.tolist() for v in _gather(
        mesh, group, torch.tensor([count, sig], dtype=torch.int64, device=mesh.device), what)]
    if all(v == first[0] for v in first):
        return True
    if any(v[0] != first[0][0] for v in first):
        counts = ", ".join(f"rank {r}: {v[0]}" for r, v in zip(group.ranks, first))
        raise SpecError(f"{what}: the ranks of {_axes(group)} hold different numbers of "
                        f"parameters and buffers ({counts}); every rank must build the same "
                        f"model (and pass the same ignore=... and varying=...)")
    return False


def check_same_names(mesh: Mesh, group: Group, entries: Sequence[tuple[str, object]],
                     what: str) -> None:
    """Raise the same SpecError on every member unless all hold the same entries (a name
    and what is declared of it), in the same order."""
    crcs = [_crc(repr(e)) for e in entries]
    if _same_signature(mesh, group, len(crcs), _crc(repr(crcs)), what):
        return
    got = [v.tolist() for v in _gather(mesh, group, torch.tensor(crcs, dtype=torch.int64,
                                                                 device=mesh.device), what)]
    i = next(i for i in range(len(crcs)) if any(g[i] != got[0][i] for g in got))
    k = next(k for k, g in enumerate(got) if g[i] != got[0][i])
    name, decl = entries[i]
    raise SpecError(f"{what}: the ranks of {_axes(group)} disagree about entry {i} of the "
                    f"parameters and buffers (on rank {group.ranks[group.index]}: {name!r}, "
                    f"varying over {decl}): rank {group.ranks[k]} differs from rank "
                    f"{group.ranks[0]}; every rank must build the same model and pass the "
                    f"same varying=...")


def check_same_tensors(mesh: Mesh, group: Group, named: Sequence[tuple[str, torch.Tensor]],
                       what: str) -> None:
    """Raise the same SpecError on every member unless all hold the same names, dtypes
    and shapes, in the same order."""
    rows = [_row(n, t) for n, t in named]
    if _same_signature(mesh, group, len(rows), _crc(repr(rows)), what):
        return
    mine = torch.tensor(rows, dtype=torch.int64, device=mesh.device).view(-1)
    got = [v.view(len(rows), -1).tolist() for v in _gather(mesh, group, mine, what)]
    for i, (name, _) in enumerate(named):
        for k, g in enumerate(got[1:], 1):
            a, b = got[0][i], g[i]
            if a == b:
                continue
            r0, rk = group.ranks[0], group.ranks[k]
            if a[0] != b[0]:
                detail = (f"entry {i} is {name!r} on rank {group.ranks[group.index]} but has "
                          f"another name on rank {rk if group.index == 0 else r0}")
            elif a[1] != b[1] or a[-1] != b[-1]:
                sa = "?" if a[2] > _MAXDIM else shape_str(a[3:3 + a[2]])
                sb = "?" if b[2] > _MAXDIM else shape_str(b[3:3 + b[2]])
                same_dtype = "same dtype" if a[1] == b[1] else "different dtypes"
                detail = (f"parameter {name!r} has shape {sa} on rank {r0} but {sb} on rank "
                          f"{rk} ({same_dtype}); a parameter sharded over a mesh axis is not "
                          f"replicated there: declare it with varying={{{name!r}: axis}}, or "
                          f"leave it out with ignore=[{name!r}]")
            else:
                detail = f"parameter {name!r} differs between rank {r0} and rank {rk}"
            raise SpecError(f"{what}: the ranks of {_axes(group)} hold different tensors: "
                            f"{detail}")


def broadcast_from_first(mesh: Mesh, group: Group, tensors: Sequence[torch.Tensor],
                         what: str) -> None:
    """Overwrite every member's ``tensors`` with member 0's, one broadcast per
    (dtype, device)."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_key.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            flat = comm_of(mesh).broadcast(flat, 0, group, name=what)
            for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(part.view(t.shape))


def _checksum(t: torch.Tensor) -> float:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return float(zlib.crc32(data))


def verify_equal(mesh: Mesh, group: Group, named: Sequence[tuple[str, torch.Tensor]],
                 what: str) -> None:
    """Raise the same SpecError on every member, naming the first tensor (in module
    order) whose bytes differ between members."""
    if not named:
        return
    mine = torch.tensor([_checksum(t) for _, t in named], dtype=torch.float64,
                        device=mesh.device)
    got = [v.tolist() for v in _gather(mesh, group, mine, what)]
    for i, (name, t) in enumerate(named):
        for k, g in enumerate(got[1:], 1):
            if g[i] != got[0][i]:
                raise SpecError(
                    f"{what}: parameter {name!r} ({shape_str(t.shape, t.dtype)}) differs "
                    f"between rank {group.ranks[0]} and rank {group.ranks[k]} of "
                    f"{_axes(group)} (checksums {int(got[0][i]):#010x} and {int(g[i]):#010x}); "
                    f"parameters must be replicated over every mesh axis they do not vary "
                    f"over: build them from the same seed, use init='broadcast', or declare "
                    f"one that differs over an axis with varying={{{name!r}: axis}}")


def start_up(mesh: Mesh, rank: int, state: list[tuple[str, torch.Tensor]],
              varying: Mapping[str, frozenset[str]], init: str | None, what: str) -> None:
    """Every replica of every tensor equal (or checked), over every mesh axis it does not
    vary over: first the names over the whole mesh (so every rank takes the same steps
    below), then per set of replica axes, in mesh axis order."""
    whole = mesh.group(mesh.axis_names, rank)
    if whole.size == 1:
        return
    check_same_names(mesh, whole, [(n, sorted(varying.get(n, ()))) for n, _ in state], what)
    by_axes: dict[tuple[str, ...], list[tuple[str, torch.Tensor]]] = {}
    for n, t in state:
        axes = tuple(a for a in mesh.axis_names if a not in varying.get(n, ()))
        by_axes.setdefault(axes, []).append((n, t))
    for axes in sorted(by_axes, key=lambda ax: [mesh.axis_names.index(a) for a in ax]):
        group = mesh.group(axes, rank) if axes else None
        if group is None or group.size == 1:
            continue
        named = by_axes[axes]
        check_same_tensors(mesh, group, named, what)
        if init == "broadcast":
            broadcast_from_first(mesh, group, [t for _, t in named], what)
        elif init == "verify":
            verify_equal(mesh, group, named, what)
