"""``Mesh``: ranks arranged in an n-d grid with named axes."""
from __future__ import annotations

import functools
import itertools
import math
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .errors import SpecError, check_timeout

__all__ = ["Mesh", "Group", "check_mesh"]

BACKENDS = ("threads", "torch")
DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Group:
    """The ranks that meet in a collective over ``axes``, seen from one rank.

    ``ranks`` are global ranks in the order of the axes' linearised index (the first
    axis major), and ``index`` is the position of the calling rank among them.
    ``channel`` names an independent stream of collectives among the same ranks: each
    channel has its own order (and, on torch.distributed, its own process group), so
    collectives on one never meet collectives on another. ``""`` is the one every
    collective uses unless it asks for another (GradSync's buckets run on their own).
    """

    axes: tuple[str, ...]
    ranks: tuple[int, ...]
    index: int
    channel: str = ""
    # derived, read at every collective: plain attributes rather than properties
    size: int = field(init=False, repr=False, compare=False)
    rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", len(self.ranks))
        object.__setattr__(self, "rank", self.ranks[self.index])


_uids = itertools.count()
_by_uid: weakref.WeakValueDictionary[int, Mesh] = weakref.WeakValueDictionary()


def mesh_by_uid(uid: int) -> Mesh:
    """The live mesh whose ``_uid`` is ``uid`` (compiled graphs name meshes by it)."""
    m = _by_uid.get(uid)
    if m is None:
        raise SpecError(f"mesh #{uid} of a compiled graph no longer exists; compile again "
                        f"with the mesh the code runs on")
    return m


class Mesh:
    """Ranks in an n-d grid with named axes.

    Args:
        shape: ranks per axis, e.g. ``(2, 4)``.
        axis_names: one name per axis, e.g. ``("dp", "sp")``.
        backend: ``"threads"`` (every rank a thread of this process: notebooks, tests) or
            ``"torch"`` (processes under torch.distributed: gloo on CPU, NCCL on CUDA).
            Default: ``"torch"`` when a process group is initialised, else ``"threads"``.
        device: the device rank tensors live on. Default: torch's default device for
            ``threads``; for ``torch``, CUDA under NCCL (``cuda:<local rank>``), else CPU.
        timeout: seconds any blocking wait may take before ``CommTimeout``.
        rng: on a threads mesh, ``"per_rank"`` (default): in a ``shard_map`` body each
            rank's random draws (dropout, ``torch.rand``, ...) come from a generator of
            its own, seeded by one draw of the caller's generator at each call, so a
            seeded program is reproducible and ranks draw independently, as processes
            do; ``spmd.manual_seed`` seeds one rank's generator. On rank greenlets
            (``schedule``) each rank's state is swapped into torch's generator at every
            switch, so ``torch.manual_seed`` in a body seeds that rank only. On rank
            threads (and in ``spmd.launch``'s per-rank programs) every torch call goes
            through a mode that draws from the rank's state (on 2 cores a trivial 8-rank
            call takes 1.4x as long), and ``torch.manual_seed`` there would seed the one
            generator the threads share: the next draw raises. ``"shared"``: torch's one
            generator, drawn in whatever order the threads run. Processes always have
            their own.
        schedule: on a threads mesh, how a ``shard_map`` call runs its ranks:
            ``"greenlets"`` (default, where the ``greenlet`` package is installed): every
            rank a greenlet of the calling thread, switching at collectives (a switch
            costs under a microsecond; a rank that never reaches a collective is named
            at once); ``"threads"``: a thread per rank, for bodies that block until
            another rank acts (a queue or a lock between ranks), which greenlets cannot
            run. The environment variable ``SPMD_SCHEDULE`` sets the default.

    Example:
        >>> mesh = Mesh((2, 4), ("dp", "sp"), backend="threads")
        >>> mesh
        Mesh(dp=2, sp=4, backend='threads')
        >>> mesh.coords(5), mesh.rank_of((1, 1)), mesh.axis_size("sp")
        ((1, 1), 5, 4)
    """

    def __init__(self, shape: Sequence[int] | int, axis_names: Sequence[str] | str,
                 backend: str | None = None, *, device: torch.device | str | None = None,
                 timeout: float | None = None, rng: str = "per_rank",
                 schedule: str | None = None):
        if isinstance(shape, int):
            shape = (shape,)
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        shape, axis_names = tuple(shape), tuple(axis_names)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
            raise SpecError(f"Mesh shape must be positive ints, got {shape}")
        if not all(isinstance(a, str) and a for a in axis_names):
            raise SpecError(f"Mesh axis names must be non-empty strings, got {axis_names}")
        if len(shape) != len(axis_names):
            raise SpecError(
                f"Mesh shape {shape} has {len(shape)} axes but {len(axis_names)} names "
                f"{axis_names}; give one name per axis")
        if len(set(axis_names)) != len(axis_names):
            raise SpecError(f"Mesh axis names must be distinct, got {axis_names}")
        if backend is None:
            backend = "torch" if _dist_initialized() else "threads"
        if backend not in BACKENDS:
            raise SpecError(f"Mesh backend must be one of {BACKENDS}, got {backend!r}")
        if rng not in ("per_rank", "shared"):
            raise SpecError(f"Mesh rng must be 'per_rank' or 'shared', got {rng!r}")
        self.rng: str = rng
        if schedule is None:
            schedule = os.environ.get("SPMD_SCHEDULE") or \
                ("greenlets" if _has_greenlet() else "threads")
        if schedule not in ("greenlets", "threads"):
            raise SpecError(f"Mesh schedule must be 'greenlets' or 'threads', got {schedule!r}")
        if schedule == "greenlets" and not _has_greenlet():
            raise SpecError("Mesh schedule='greenlets' needs the greenlet package "
                            "(pip install greenlet), or pass schedule='threads'")
        self.schedule: str = schedule
        self.shape: tuple[int, ...] = shape
        self.axis_names: tuple[str, ...] = axis_names
        self.backend: str = backend
        self.size: int = math.prod(shape)
        self.timeout: float = DEFAULT_TIMEOUT if timeout is None else \
            check_timeout(timeout, f"Mesh{shape}")
        self._device = None if device is None else torch.device(device)
        # an int that names this mesh in compiled graphs (see collectives.compiled)
        self._uid: int = next(_uids)
        _by_uid[self._uid] = self
        self._groups: dict[tuple, Group] = {}
        self._checked: dict[str | tuple, tuple[str, ...]] = {}
        # The backend's communicator: spmd.comm.comm_of builds it on first use and keeps
        # it here, so the data layer never imports a backend.
        self._comm: object | None = None
        if backend == "torch":
            if not _dist_initialized():
                raise SpecError(
                    "Mesh(backend='torch') needs an initialised process group; start the "
                    "script with torchrun or spmd.launch(..., backend='gloo'), or use "
                    "backend='threads'")
            import torch.distributed as dist
            if dist.get_world_size() != self.size:
                raise SpecError(
                    f"Mesh{shape} has {self.size} ranks but the process group has "
                    f"{dist.get_world_size()}; the mesh must cover every process")

    # A mesh is a handle on ranks and their communicators, like a process group: copying
    # a model that holds one (copy.deepcopy of a converted model, an EMA copy) must keep
    # the same mesh, or its layers would run on a mesh no rank is running.
    def __copy__(self) -> Mesh:
        return self

    def __deepcopy__(self, memo: dict) -> Mesh:
        return self

    # -- geometry -----------------------------------------------------------------

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({axes}, backend={self.backend!r})"

    def axis_size(self, name: str | Sequence[str]) -> int:
        """Ranks along ``name`` (the product for a tuple of axes)."""
        return math.prod(self.shape[self._axis_pos(a)] for a in _axes_tuple(name))

    def coords(self, rank: int) -> tuple[int, ...]:
        """The coordinates of ``rank`` (row-major: the last axis varies fastest)."""
        if not 0 <= rank < self.size:
            raise SpecError(f"rank {rank} is outside {self!r} (ranks 0..{self.size - 1})")
        return coords_of(self.shape, rank)

    def rank_of(self, coords: Sequence[int]) -> int:
        """The rank at ``coords``."""
        if len(coords) != len(self.shape) or not all(0 <= c < s for c, s in zip(coords, self.shape)):
            raise SpecError(f"coordinates {tuple(coords)} are outside {self!r}")
        r = 0
        for c, s in zip(coords, self.shape):
            r = r * s + c
        return r

    def axis_index(self, name: str | Sequence[str], rank: int | None = None) -> int:
        """Index of ``rank`` (default: the calling rank) along ``name``; for a tuple of
        axes, the linearised index with the first axis major."""
        c = self.coords(self.rank if rank is None else rank)
        idx = 0
        for a in _axes_tuple(name):
            p = self._axis_pos(a)
            idx = idx * self.shape[p] + c[p]
        return idx

    def group(self, axes: str | Sequence[str], rank: int | None = None, *,
              channel: str = "") -> Group:
        """The ranks meeting with ``rank`` in a collective over ``axes`` (on ``channel``,
        see ``Group``)."""
        rank = self.rank if rank is None else rank
        try:  # asked as given (a name, or a tuple of names): one look-up
            g = self._groups.get((axes, rank, channel))
        except TypeError:  # a list of names
            g = None
        if g is not None:
            return g
        given = axes
        axes = _axes_tuple(axes)
        key = (axes, rank, channel)
        g = self._groups.get(key)
        if g is None:
            pos = [self._axis_pos(a) for a in axes]
            if len(set(pos)) != len(pos):
                raise SpecError(f"axis names {axes} repeat an axis of {self!r}")
            base = list(self.coords(rank))
            members = []
            for lin in range(math.prod(self.shape[p] for p in pos)):
                c = list(base)
                for p in reversed(pos):
                    c[p] = lin % self.shape[p]
                    lin //= self.shape[p]
                members.append(self.rank_of(c))
            g = Group(axes, tuple(members), members.index(rank), channel)
            self._groups[key] = g
        if isinstance(given, str):  # a tuple of names is asked as its key already
            self._groups[(given, rank, channel)] = g
        return g

    def _axis_pos(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise SpecError(
                f"{name!r} is not an axis of {self!r}; its axes are {list(self.axis_names)}"
            ) from None

    def check_axes(self, axes: str | Sequence[str], what: str) -> tuple[str, ...]:
        """Validate axis names for ``what`` (an op name) before any communication."""
        try:
            t = self._checked.get(axes)  # names checked before (valid for any op)
        except TypeError:  # a list, or names that cannot be
            t = None
        if t is not None:
            return t
        t = _axes_tuple(axes, what)
        for a in t:
            if a not in self.axis_names:
                raise SpecError(
                    f"{what}: {a!r} is not an axis of {self!r}; its axes are "
                    f"{list(self.axis_names)}")
        if len(set(t)) != len(t):
            raise SpecError(f"{what}: axis names {t} repeat an axis")
        if isinstance(axes, (str, tuple)):
            self._checked[axes] = t
        return t

    # -- ranks and communication -------------------------------------------------------

    @property
    def rank(self) -> int:
        """The calling rank (inside shard_map, spmd.launch, or a torch process)."""
        from ._context import current_rank
        return current_rank(self)

    @property
    def device(self) -> torch.device:
        """The device rank tensors live on (``device=`` if given; else torch's default
        device on a threads mesh, ``cuda:<local rank>`` under NCCL, the CPU under gloo)."""
        if self._device is None:
            if self.backend == "torch":
                self._device = _torch_device()
            else:
                self._device = torch.get_default_device()
        return self._device

    def __enter__(self) -> Mesh:
        """``with mesh:`` makes collectives in per-rank code (torch processes) use it."""
        from ._context import push
        push(self, None)
        return self

    def __exit__(self, *exc) -> None:
        from ._context import pop
        pop()


def coords_of(shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` in a grid of ``shape``."""
    out = []
    for s in reversed(shape):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def _axes_tuple(axes: object, what: str = "axis_name") -> tuple[str, ...]:
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, (tuple, list)) and axes and all(isinstance(a, str) for a in axes):
        return tuple(axes)
    raise SpecError(f"{what}: expected a mesh axis name or a tuple of names, got {axes!r}")


@functools.cache
def _has_greenlet() -> bool:
    import importlib.util
    return importlib.util.find_spec("greenlet") is not None


def _dist_initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _torch_device() -> torch.device:
    import os

    import torch.distributed as dist
    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return torch.device("cpu")


def check_mesh(mesh: object, what: str, *, optional: bool = False) -> None:
    """A ``TypeError`` naming ``what`` unless ``mesh`` is a ``spmd.Mesh`` (or, with
    ``optional``, None: a layer's one-device form)."""
    if not isinstance(mesh, Mesh) and not (optional and mesh is None):
        from ._format import describe
        alt = " (or None for one device)" if optional else ""
        raise TypeError(f"{what}: mesh must be a spmd.Mesh{alt}, got {describe(mesh)}")
