"""The network model: a latency and a bandwidth, and the standard algorithm costs of each
collective kind; nominal presets; a least-squares fit from timed collectives.

One flat network (every pair of ranks alike). A mesh spanning many nodes is bounded by
its slowest links: give the inter-node figures (InfiniBand, Slingshot), not NVLink's.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..comm import comm_of
from ..core._context import current
from ..core.mesh import Mesh

__all__ = ["Network", "NETWORKS", "KINDS", "collective_time", "fit_network"]

#: The collective kinds of the comm protocol (``CommStats.details``) that have a cost.
KINDS = ("all_reduce", "all_reduce_async", "all_gather", "reduce_scatter", "all_to_all",
         "permute", "broadcast", "barrier")
ALGORITHMS = ("tree", "ring")


@dataclass(frozen=True)
class Network:
    """A flat network: every message costs ``latency_s`` plus its bytes over
    ``bandwidth_Bps`` (one direction of one rank's link), and every collective call
    ``overhead_s`` of software on top (the library's and the backend's per-call cost; 0
    in the presets: ``benchmarks/collective_overhead.py`` measures spmd's). ``overlap``
    is the fraction of a collective's time that goes on while its rank computes (a
    halo in flight behind the convolution of the shard): 1 in the presets (a NIC or
    NVLink moves the bytes), measured by ``fit_network(load_s=...)``; on CPU transports
    the rank's own cores do the copying and the waking, and little of it hides.

    Args:
        latency_s: seconds per message (alpha).
        bandwidth_Bps: bytes per second, one direction (1 / beta).
        overhead_s: seconds per collective call on each rank.
        overlap: the part of each collective's time that can hide behind compute, in
            [0, 1]; the rest adds to the step wherever the collective lies.
        algorithm: ``"tree"`` (recursive halving and doubling: ``2 log2 n`` latencies per
            all-reduce, ``log2 n`` per all-gather or reduce-scatter) or ``"ring"``
            (``2 (n - 1)`` and ``n - 1``). Both move the bandwidth-optimal bytes
            (see ``collective_time``). NCCL picks trees for small messages at scale,
            where a ring's ``2 (n - 1)`` latencies would dominate.
        name, source: what it is and where the figures come from.

    Example:
        >>> net = Network(latency_s=1e-6, bandwidth_Bps=1e9, name="toy")
        >>> net
        Network('toy': 1 us, 1 GB/s, tree)
        >>> net.collective_time("all_reduce", 4, payload=1000)  # 4 latencies + 1500 bytes
        5.5e-06
    """

    latency_s: float
    bandwidth_Bps: float
    overhead_s: float = 0.0
    algorithm: str = "tree"
    name: str = "custom"
    source: str = ""
    overlap: float = 1.0

    def __post_init__(self) -> None:
        for arg, v, positive in (("latency_s", self.latency_s, False),
                                 ("bandwidth_Bps", self.bandwidth_Bps, True),
                                 ("overhead_s", self.overhead_s, False)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0 or (positive and v == 0):
                need = "a positive" if positive else "a non-negative"
                raise ValueError(f"Network: {arg} must be {need} finite number, got {v!r}")
        ov = self.overlap
        if isinstance(ov, bool) or not isinstance(ov, (int, float)) or not 0 <= ov <= 1:
            raise ValueError(f"Network: overlap must be a number in [0, 1], got {ov!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"Network: algorithm must be one of {ALGORITHMS}, got "
                             f"{self.algorithm!r}")

    def __repr__(self) -> str:
        over = f" + {_secs(self.overhead_s)}/call" if self.overhead_s else ""
        hides = f", overlap {self.overlap:.2g}" if self.overlap < 1 else ""
        return (f"Network({self.name!r}: {_secs(self.latency_s)}, "
                f"{_rate(self.bandwidth_Bps)}, {self.algorithm}{over}{hides})")

    def collective_time(self, kind: str, group_size: int, *, payload: int, sent: int | None = None,
                        peers: int | None = None) -> float:
        """Seconds one rank spends in one collective; see ``collective_time``.

        Example:
            >>> Network(1e-6, 1e9).collective_time("permute", 2, payload=1000)
            2e-06
        """
        return collective_time(self, kind, group_size, payload=payload, sent=sent, peers=peers)

    @staticmethod
    def fit(samples: Iterable[Sequence], *, name: str = "fitted", algorithm: str = "tree",
            source: str = "") -> Network:
        """The latency and bandwidth that best explain timed collectives.

        Least squares on relative errors (each sample weighs alike whatever its
        duration) of ``time = latency x (latencies the kind takes) + (bytes it moves) /
        bandwidth``, the counts of ``collective_time``. At a fixed group size the
        per-call software overhead cannot be told from the latency: it is folded in
        (``overhead_s`` = 0).

        Args:
            samples: ``(kind, group_size, payload, seconds)`` or ``(kind, group_size,
                payload, sent, peers, seconds)`` tuples, at least two, of at least two
                sizes.

        Raises:
            ValueError: too few samples, or samples that leave the latency or the
                bandwidth undetermined or negative (only small payloads, noise).

        Example:
            >>> net = Network(2e-6, 5e9)
            >>> s = [("all_reduce", 4, b, net.collective_time("all_reduce", 4, payload=b))
            ...      for b in (8, 1 << 16, 1 << 20)]
            >>> fit = Network.fit(s)
            >>> round(fit.latency_s * 1e6, 6), round(fit.bandwidth_Bps / 1e9, 6)
            (2.0, 5.0)
        """
        rows, ts, moved = [], [], set()
        for s in samples:
            s = tuple(s)
            if len(s) == 4:
                kind, n, payload, t = s
                sent = peers = None
            elif len(s) == 6:
                kind, n, payload, sent, peers, t = s
            else:
                raise ValueError(f"Network.fit: a sample is (kind, group_size, payload, "
                                 f"seconds) or (kind, group_size, payload, sent, peers, "
                                 f"seconds), got {s!r}")
            if not t > 0:
                raise ValueError(f"Network.fit: a sample's seconds must be positive, got {s!r}")
            lat, nbytes = _counts(kind, n, payload, sent, peers, algorithm)
            rows.append((lat / t, nbytes / t))
            ts.append(1.0)
            moved.add(nbytes)
        if len(rows) < 2 or len(moved) < 2:
            raise ValueError(f"Network.fit: needs samples of at least two sizes, got "
                             f"{len(rows)} sample(s)")
        a = torch.tensor(rows, dtype=torch.float64)
        b = torch.tensor(ts, dtype=torch.float64)[:, None]
        alpha, inv_bw = torch.linalg.lstsq(a, b).solution[:, 0].tolist()
        if alpha < 0 and inv_bw > 0:  # a latency below the noise: none, and refit the rest
            alpha = 0.0
            inv_bw = torch.linalg.lstsq(a[:, 1:], b).solution[0, 0].item()
        if not (alpha >= 0 and inv_bw > 0):
            raise ValueError(
                f"Network.fit: the samples give latency {alpha:.3g} s and 1/bandwidth "
                f"{inv_bw:.3g} s/B; the bandwidth must come out positive. Time larger payloads (the "
                f"bandwidth shows above ~1 MiB) and more repeats (noise)")
        return Network(alpha, 1.0 / inv_bw, algorithm=algorithm, name=name, source=source)


def _secs(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.3g} GB/s" if bps >= 1e8 else f"{bps / 1e6:.3g} MB/s"


def _log2(n: int) -> int:
    return max(n - 1, 0).bit_length()  # ceil(log2 n), 0 for n = 1


def _counts(kind: str, n: int, payload: int, sent: int | None, peers: int | None,
            algorithm: str) -> tuple[float, float]:
    """(latencies, bytes on the wire) of one rank's part of one collective."""
    if kind not in KINDS:
        raise ValueError(f"collective_time: kind must be one of {KINDS}, got {kind!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"collective_time: group_size must be a positive int, got {n!r}")
    if n == 1:
        return 0.0, 0.0
    ring = algorithm == "ring"
    steps = (n - 1) if ring else _log2(n)
    if kind in ("all_reduce", "all_reduce_async"):
        return 2.0 * steps, 2.0 * (n - 1) / n * payload
    if kind == "all_gather":  # payload: this rank's part
        return float(steps), float((n - 1) * payload)
    if kind == "reduce_scatter":  # payload: the whole input, every block
        return float(steps), (n - 1) / n * payload
    if kind == "all_to_all":  # payload: every block; sent: the blocks for others
        p = (n - 1) if peers is None else peers
        s = (n - 1) / n * payload if sent is None else sent
        return float(p), float(s)
    if kind == "permute":  # each rank sends one message and waits for one
        return 1.0, float(payload)
    if kind == "broadcast":  # binomial tree: log2 n rounds of the whole message
        return float(_log2(n)), float(_log2(n) * payload)
    return float(_log2(n)), 0.0  # barrier: dissemination


def collective_time(network: Network, kind: str, group_size: int, *, payload: int,
                    sent: int | None = None, peers: int | None = None) -> float:
    """Seconds one rank spends in one collective of ``group_size`` ranks, with latency
    ``a`` and bandwidth ``B`` (bytes/s) of ``network``, plus its per-call overhead; a
    group of one costs nothing (spmd does not communicate):

    ==================  =========================================  ==========================
    kind                tree: latencies + bytes / B                ring: latencies
    ==================  =========================================  ==========================
    all_reduce          2 ceil(log2 n) a + 2 (n-1)/n payload / B   2 (n-1) a
    all_gather          ceil(log2 n) a + (n-1) part / B            (n-1) a
    reduce_scatter      ceil(log2 n) a + (n-1)/n payload / B       (n-1) a
    all_to_all          peers a + sent / B (one message per peer: halos send to their
                        neighbours only; default n-1 and (n-1)/n payload)
    permute             a + payload / B (one message out, one in, concurrently)
    broadcast           ceil(log2 n) (a + payload / B) (binomial tree)
    barrier             ceil(log2 n) a
    ==================  =========================================  ==========================

    ``payload`` is what ``CommStats.details`` records: the tensor passed in (all-reduce,
    permute, broadcast), this rank's part (all-gather), every block (reduce-scatter,
    all-to-all). Links are full duplex: what a rank receives arrives while it sends.

    Example:
        >>> from spmd.perf import Network, collective_time
        >>> net = Network(latency_s=1e-5, bandwidth_Bps=1e9)
        >>> collective_time(net, "all_reduce", 8, payload=8_000_000)  # 6 a + 14 MB / B
        0.01406
        >>> round(collective_time(net, "all_to_all", 8, payload=3000, sent=2000, peers=2), 9)
        2.2e-05
    """
    lat, nbytes = _counts(kind, group_size, payload, sent, peers, network.algorithm)
    if group_size == 1:
        return 0.0
    return network.overhead_s + lat * network.latency_s + nbytes / network.bandwidth_Bps


#: Nominal interconnect figures: bandwidths from vendors' data sheets, NOT measured here.
#: The latencies are orders of magnitude of published small-message (ping-pong) figures,
#: not data-sheet values; real collectives add software overhead (set ``overhead_s``;
#: spmd's own per call is measured by benchmarks/collective_overhead.py) and contention.
NETWORKS: dict[str, Network] = {
    "nvlink4": Network(
        1.5e-6, 450e9, name="nvlink4",
        source="nominal: NVIDIA H100 SXM data sheet, NVLink 900 GB/s per GPU in both "
               "directions (450 GB/s each way); latency ~1.5 us, the order of a GPU-to-GPU "
               "put within one node (NCCL adds a few us per collective: overhead_s)"),
    "ib_ndr": Network(
        2e-6, 50e9, name="ib_ndr",
        source="nominal: InfiniBand NDR, 400 Gb/s per port (50 GB/s each way; NVIDIA "
               "ConnectX-7 / Quantum-2); latency ~2 us end to end (switch < 1 us)"),
    "slingshot11": Network(
        2e-6, 25e9, name="slingshot11",
        source="nominal: HPE Slingshot 11, 200 Gb/s per NIC (25 GB/s each way; Frontier, "
               "Perlmutter); latency ~2 us end to end"),
    "ethernet_100g": Network(
        10e-6, 12.5e9, name="ethernet_100g",
        source="nominal: 100 Gb/s Ethernet (12.5 GB/s each way); latency ~10 us "
               "(RoCE/TCP, end to end)"),
}


def fit_network(mesh: Mesh | None = None, axis: str | None = None, *,
                sizes: Sequence[int] = (64, 1 << 16, 1 << 20, 1 << 22),
                kinds: Sequence[str] = ("all_reduce", "all_to_all"), repeats: int = 20,
                warmup: int = 3, load_s: float = 0.0, name: str = "fitted") -> Network:
    """Time spmd's all-reduce and all-to-all on this mesh and fit a ``Network`` to them
    (``Network.fit``): what the collectives of a step cost here, software included.

    Per-rank code: call it on every rank (inside ``spmd.launch``, a torchrun script
    within ``with mesh:``); every rank returns the same ``Network`` (the slowest rank's
    median times, after ``warmup`` calls). ``sizes`` are float32 payload bytes. On a
    threads mesh it fits the rendezvous of threads, not a network.

    With ``load_s`` > 0 every timed call follows about that much compute on the mesh's
    device (matrix products), as the collectives of a training step follow the layers
    between them, and is charged what it adds to that compute: the ranks arrive out of
    step, and a CPU transport's threads wake on cores that were computing. It also
    measures ``overlap``: how much of an all-to-all started before the compute (a halo
    in flight behind the convolution of the shard) is hidden by it, against the same
    two one after the other. Without a load the calls are timed back to back and
    ``overlap`` is 1 (not measured).

    Args:
        mesh: the mesh (default: the one this code runs on).
        axis: the mesh axis whose groups to time (default: the first axis of size > 1).
        sizes: payloads in bytes, multiples of 4; at least two distinct.
        kinds: among ``"all_reduce"`` and ``"all_to_all"`` (every block to every other
            rank of the group, shapes known as a halo exchange knows them).
        repeats: timed calls per kind and size.
        load_s: seconds of compute before each timed call (0: none).

    Raises:
        ValueError: bad sizes, kinds, load or axis; a mesh of one rank; a fit that fails.
        SpecError: called outside the ranks of a mesh.

    In a script (timings are noisy: a loaded machine can make a fit fail, which raises)::

        def fit(mesh):
            return spmd.perf.fit_network(repeats=50, load_s=2e-3)
        net = spmd.launch(fit, (2,), ("sp",), backend="gloo")[0]

    Example:
        >>> fit_network()  # outside the ranks: it times collectives, so it needs a mesh
        Traceback (most recent call last):
        ...
        spmd.core.errors.SpecError: fit_network needs a mesh: call it inside spmd.shard_map, ...
    """
    rc = current("fit_network")
    mesh = rc.mesh if mesh is None else mesh
    if rc.mesh is not mesh:
        raise ValueError(f"fit_network: called with {mesh!r} but this code runs on {rc.mesh!r}")
    sizes = [int(s) for s in sizes]
    if len(set(sizes)) < 2 or any(s < 4 or s % 4 for s in sizes):
        raise ValueError(f"fit_network: sizes must be at least two distinct multiples of 4 "
                         f"bytes, got {list(sizes)}")
    for k in kinds:
        if k not in ("all_reduce", "all_to_all"):
            raise ValueError(f"fit_network: kinds are 'all_reduce' and 'all_to_all', got {k!r}")
    if isinstance(load_s, bool) or not isinstance(load_s, (int, float)) \
            or not 0 <= load_s < 10:
        raise ValueError(f"fit_network: load_s must be seconds in [0, 10), got {load_s!r}")
    if axis is None:
        axis = next((a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1), None)
        if axis is None:
            raise ValueError(f"fit_network: {mesh!r} has no axis of more than one rank")
    mesh.check_axes(axis, "fit_network: axis")
    if mesh.axis_size(axis) < 2:
        raise ValueError(f"fit_network: axis {axis!r} of {mesh!r} has one rank; nothing to time")
    group = mesh.group(axis, rc.rank)
    comm = comm_of(mesh)
    n = group.size
    dev = mesh.device
    sync = torch.get_device_module(dev.type).synchronize if dev.type != "cpu" else None
    load = _Load(load_s, dev, sync) if load_s else None

    def timed(call) -> float:
        ts = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            call()
            if sync is not None:
                sync()
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    medians, meta, hidden = [], [], []
    for kind in kinds:
        for size in sizes:
            if kind == "all_reduce":
                x = torch.randn(size // 4, device=dev)
                call = lambda x=x: comm.all_reduce(x, "sum", group, name="fit_network")  # noqa: E731
                meta.append((kind, n, size, size, n - 1))
            else:
                per = max(size // 4 // n, 1)
                chunks = [torch.randn(per, device=dev) for _ in range(n)]
                shapes = [(per,)] * n
                call = lambda c=chunks, s=shapes: comm.all_to_all(  # noqa: E731
                    c, group, name="fit_network", shapes=s)
                meta.append((kind, n, per * 4 * n, per * 4 * (n - 1), n - 1))
            if load is None:
                medians.append(timed(call))
                continue
            alone = timed(load)
            medians.append(max(timed(lambda c=call: (load(), c())) - alone, 1e-9))
            if kind == "all_to_all":  # started, then the compute, then waited for
                hidden.append((alone, medians[-1], timed(lambda c=chunks, s=shapes: (
                    w := comm.all_to_all_async(c, group, name="fit_network", shapes=s),
                    load(), w.wait()))))
    # Every rank fits the slowest rank's times: the same Network everywhere.
    flat = medians + [t for h in hidden for t in h]
    med = comm.all_reduce(torch.tensor(flat, dtype=torch.float64, device=dev), "max", group,
                          name="fit_network").tolist()
    samples = [(*m, t) for m, t in zip(meta, med)]
    rest = med[len(medians):]
    overlap = _overlap([rest[i:i + 3] for i in range(0, len(rest), 3)])
    loaded = f", each after {_secs(load_s)} of compute" if load_s else ""
    source = (f"fitted: spmd {'/'.join(kinds)} on {mesh!r}, axis {axis!r}, payloads "
              f"{sizes[0]}..{sizes[-1]} B, median of {repeats}{loaded}")
    # The least squares of equal samples can differ in the last bit between processes
    # (BLAS threading): member 0 fits, and everyone takes its two numbers, so that every
    # rank holds the same Network (or raises alike: NaN means the fit failed).
    try:
        net = Network.fit(samples, name=name, source=source)
        got = [net.latency_s, net.bandwidth_Bps]
        why = None
    except ValueError as e:
        got, why = [math.nan, math.nan], e
    got = comm.broadcast(torch.tensor(got + [overlap], dtype=torch.float64, device=dev), 0,
                         group, name="fit_network").tolist()
    if math.isnan(got[0]):
        raise why if why is not None else ValueError(
            "fit_network: the fit failed on the group's first rank (see its error); time "
            "larger payloads and more repeats")
    return Network(got[0], got[1], name=name, source=source, overlap=got[2])


def _overlap(rows: list[list[float]]) -> float:
    """The median over sizes of the part of an all-to-all hidden by the compute after
    its start: ``(compute + call - together) / min(compute, call)``, in [0, 1] (1 when
    nothing was timed)."""
    parts = [min(max((load + call - both) / min(load, call), 0.0), 1.0)
             for load, call, both in rows if min(load, call) > 0]
    return statistics.median(parts) if parts else 1.0


class _Load:
    """About ``seconds`` of compute on ``device``: products of 128 x 128 matrices, their
    count set by timing them here."""

    def __init__(self, seconds: float, device, sync) -> None:
        self.a = torch.randn(128, 128, device=device)
        self.sync = sync
        self.reps = 1
        self()  # warm up
        t0 = time.perf_counter()
        for _ in range(5):
            self()
        one = (time.perf_counter() - t0) / 5
        self.reps = max(1, round(seconds / max(one, 1e-9)))

    def __call__(self) -> None:
        b = self.a
        for _ in range(self.reps):
            b = torch.mm(self.a, b).div_(128.0)
        if self.sync is not None:
            self.sync()
