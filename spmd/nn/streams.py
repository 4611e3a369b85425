"""The random streams the ranks of a converted model share, for draws whose result is the
same on several ranks (replicated, or split over some mesh axes only).

Every rank keeps, per converted model, one generator per *group key*: the coordinates of
the rank along the mesh axes the draw is split over (none for a replicated draw). Ranks
that hold the same block of the result have the same key; their generators start from the
same seed and advance alike, because every rank makes the same draws in the same order
(the forward is one program, and its plan is the same on every rank). The seed comes
from one value agreed at the model's first such draw: every rank draws an int64 from its
own generator (the process's, or a rank thread's) and rank 0's is broadcast (8 bytes,
once per converted model and process). A draw is run with its group's generator state
swapped in for the rank's default one, so torch's own kernels (dropout, ``rand``,
``x.uniform_()``) draw it, and the rank's own stream is left where it was.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .. import random as invariant
from ..comm import comm_of, rank_threads
from ..comm.threads import in_rank_greenlet
from ..core import _context
from ..core._local import RankLocal
from ..core.errors import SpecError

__all__ = ["use", "rank_of", "snapshot", "replaying"]

_lock = threading.Lock()
_streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Config -> {rank: _Streams}


class _Streams:
    """One rank's generators for one converted model, by group key and device."""

    def __init__(self, base: int):
        self.base = base
        self.gens: dict[tuple, torch.Generator] = {}

    def generator(self, key: tuple, device: torch.device) -> torch.Generator:
        k = (key, device.type, device.index)
        g = self.gens.get(k)
        if g is None:
            h = hashlib.blake2b(repr((self.base, key)).encode(), digest_size=8).digest()
            g = torch.Generator(device=device)
            g.manual_seed(int.from_bytes(h, "little") >> 1)
            self.gens[k] = g
        return g

    def copy(self) -> _Streams:
        """Another set of generators at the states these are in now."""
        new = _Streams(self.base)
        for k, g in self.gens.items():
            c = torch.Generator(device=g.device)
            c.set_state(g.get_state())
            new.gens[k] = c
        return new


_replay = RankLocal()  # a checkpoint's recompute: (Config, rank, _Streams)


def snapshot(run: Any) -> tuple:
    """This rank's shared streams of ``run``'s model as they are now (a checkpoint region
    opens): its recompute in backward draws from copies of them at these states."""
    rank = rank_of(run)
    with _lock:
        s = _streams.get(run.cfg, {}).get(rank)
    return run.cfg, rank, s.copy() if s is not None else None


@contextlib.contextmanager
def replaying(snap: tuple) -> Iterator[None]:
    """Shared draws inside come from the streams as ``snapshot`` found them (streams made
    since then start from their seeds again), so a recompute draws what the forward drew."""
    cfg, rank, s = snap
    if s is None:
        with _lock:
            live = _streams.get(cfg, {}).get(rank)
        s = _Streams(live.base) if live is not None else None
    else:
        s = s.copy()  # a second backward replays from the region's start again
    prev = getattr(_replay, "on", None)
    _replay.on = (cfg, rank, s) if s is not None else None
    try:
        yield
    finally:
        _replay.on = prev


def rank_of(run: Any) -> int:
    prev = _context.set_converting(False)
    try:
        return _context.current("convert").rank
    finally:
        _context.set_converting(prev)


def _of(run: Any, rank: int) -> _Streams:
    with _lock:
        s = _streams.setdefault(run.cfg, {}).get(rank)
    if s is None:
        s = _Streams(_agree(run.mesh, rank))
        with _lock:
            _streams[run.cfg][rank] = s
    return s


def _agree(mesh: Any, rank: int) -> int:
    """Rank 0's draw of one int64, on every rank (one broadcast over the mesh)."""
    prev = _context.set_converting(False)
    try:
        with invariant.paused():
            t = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=mesh.device)
        t = comm_of(mesh).broadcast(t, 0, mesh.group(mesh.axis_names, rank),
                                    name="convert: seed of the shared random streams")
        return int(t.item())
    finally:
        _context.set_converting(prev)


def _get(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


@contextlib.contextmanager
def use(run: Any, key: tuple, device: torch.device) -> Iterator[None]:
    """Random calls inside draw from the group ``key``'s generator (this rank's copy)."""
    rank = rank_of(run)
    replay = getattr(_replay, "on", None)
    s = replay[2] if replay is not None and replay[:2] == (run.cfg, rank) else _of(run, rank)
    g = s.generator(key, device)
    mode = getattr(rank_threads._active, "mode", None)  # a rank thread's own generator
    if mode is not None and device.type == "cpu":
        saved, mode.state = mode.state, g.get_state()
        try:
            yield
        finally:
            g.set_state(mode.state)
            mode.state = saved
        return
    if run.mesh.backend == "threads" and run.mesh.size > 1 and not in_rank_greenlet():
        raise SpecError(
            f"convert: a random draw on {device} replicated over ranks of a threads mesh "
            f"needs each rank thread's own generator, which spmd keeps for the CPU only "
            f"(and with the mesh's rng='per_rank'); draw it on the CPU, or outside the "
            f"converted forward")
    with _lock:  # processes: this process's generator, swapped
        saved = _get(device)
        _set(device, g.get_state())
    try:
        yield
    finally:
        g.set_state(_get(device))
        _set(device, saved)
