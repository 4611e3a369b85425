"""Running a save or a load on every rank: agree first, then one DCP call per process.

Each rank checks its own part (``job.local_check()``: a digest of what must match, and
its error) and names its directory (``job.place()``); the ranks agree on all three in one
small exchange, so an error is raised on every rank before any data moves. Then
``job.run`` does the work once per process.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..comm import comm_of
from ..core._context import in_rank_of
from ..core.errors import SpecError
from ..core.mesh import Mesh

__all__ = ["run_on_ranks"]


def run_on_ranks(mesh: Mesh, job: Any, what: str) -> Any:
    """Agree on ``job.local_check()`` (a digest of what must match, and this rank's
    error) and on ``job.place()`` (the directory, resolved), then run
    ``job.run(held, jobs)`` once per process (``jobs``: every rank thread's own, on rank
    threads; else None).

    Processes: one all_gather of (digest, failed, hash of the place) so every rank raises
    when any rank would (a second one, of the places, only to name them when they
    differ), then DCP's own collectives. Rank threads: one exchange; its last arrival
    runs the whole job for every rank (one DCP call in this process) and each rank takes
    its part. Ordinary code on a threads mesh: this process holds every rank.
    """
    digest, err = job.local_check()
    place = job.place()
    if mesh.backend == "torch":
        comm = comm_of(mesh)
        group = mesh.group(mesh.axis_names)
        ranks = list(group.ranks)
        mine = torch.tensor([digest, 0 if err is None else 1, _fingerprint(place)],
                            dtype=torch.int64, device=mesh.device)
        rows = [t.tolist() for t in comm.all_gather(mine, group, 0, name=what)]
        _agree_failures(rows, err, what, ranks)
        if len({row[2] for row in rows}) > 1:
            raw = torch.tensor(list(place.encode()), dtype=torch.uint8, device=mesh.device)
            got = comm.all_gather(raw, group, 0, name=what)
            _agree_places({r: bytes(t.tolist()).decode(errors="replace")
                           for r, t in zip(ranks, got)}, what)
        _agree_digests(rows, what, ranks)
        return job.run((mesh.rank,), None)
    if not in_rank_of(mesh):
        if err is not None:
            raise err
        return job.run(tuple(range(mesh.size)), None)
    comm = comm_of(mesh)
    group = mesh.group(mesh.axis_names)
    rank = mesh.rank

    def combine(payloads: list) -> Any:
        errs = {r: p[1] for r, p in zip(group.ranks, payloads) if p[1] is not None}
        if errs:
            r0 = min(errs)
            raise _again(errs[r0], str(errs[r0]) if len(errs) == 1 else
                         f"{errs[r0]} (and on ranks {sorted(errs)[1:]})")
        _agree_places({r: p[2].place() for r, p in zip(group.ranks, payloads)}, what)
        _agree_digests([[p[0]] for p in payloads], what, list(group.ranks))
        return payloads[0][2].run(tuple(group.ranks), [p[2] for p in payloads])

    out = comm.exchange(group, what, (digest, err, job), name=what, combine=combine)
    return out[rank] if isinstance(out, dict) else out


def _again(err: SpecError, message: str) -> SpecError:
    """``err``'s kind of error (a damaged file stays a CorruptCheckpointError) with
    ``message``, to raise on every rank."""
    return (type(err) if isinstance(err, SpecError) else SpecError)(message)


def _fingerprint(place: str) -> int:
    return int.from_bytes(hashlib.blake2b(place.encode(), digest_size=7).digest(), "little")


def _agree_failures(rows: list[list[int]], err: SpecError | None, what: str,
                    ranks: list[int]) -> None:
    failed = [r for r, row in zip(ranks, rows) if row[1]]
    if err is not None:
        raise err
    if failed:
        raise SpecError(f"{what}: ranks {failed} cannot run this call (each of them raised "
                        f"the reason); nothing was read or written")


def _agree_places(places: dict[int, str], what: str) -> None:
    if len(set(places.values())) <= 1:
        return
    groups: dict[str, list[int]] = {}
    for r, p in places.items():
        groups.setdefault(p, []).append(r)
    said = "; ".join(f"ranks {rs}: {p!r}" for p, rs in groups.items())
    raise SpecError(f"{what}: the ranks were given different checkpoint directories ({said}); "
                    f"every rank must pass the same directory, on a filesystem they share; "
                    f"nothing was written")


def _agree_digests(rows: list[list[int]], what: str, ranks: list[int]) -> None:
    digests = {row[0] for row in rows}
    if len(digests) > 1:
        groups: dict[int, list[int]] = {}
        for r, row in zip(ranks, rows):
            groups.setdefault(row[0], []).append(r)
        raise SpecError(f"{what}: the state differs between ranks (keys, global shapes, "
                        f"dtypes, layouts, Python values, or the values of replicated "
                        f"tensors; wrap per-rank values in PerRank): ranks "
                        f"{' vs '.join(str(v) for v in groups.values())} agree among "
                        f"themselves; every rank must pass the same structure")
