"""spmd.perf: what estimate measures equals what a direct run does (bytes per rank and
per collective, saved bytes), predictions for larger meshes equal direct runs on those
meshes (the 3-per-axis re-measurement, and its face-area scaling), the network formulas
on hand-computed cases, the fit, and the errors.

Byte counts and saved bytes are integers and compared exactly. Times are not asserted
(the machine is shared and loaded): only their bookkeeping (step = sum of its parts,
efficiency = its formula) to 1e-12 relative, float rounding of a few additions.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import spmd
from spmd import P, demo
from spmd.perf import NETWORKS, Collective, Network, collective_time, mesh_shape_for
from spmd.perf._measure import Event, ordinals
from spmd.perf.model import exposed
from spmd.testing.memory import SavedBytes

SPEC = demo.SPEC  # (N, C, H, W), H split over "sp"
SPEC2 = P(None, None, "sx", "sy")
FAST = dict(repeats=1, warmup=0)
IB = NETWORKS["ib_ndr"]


def _direct(model, mesh, spec, x, seed=0):
    """comm_stats of the second step of shard_map(convert(model)) with backward from the
    same random cotangent estimate uses: per rank, (name, axes, pass, bytes) in order."""
    sharded = spmd.nn.convert(model, mesh, spec)
    f = spmd.shard_map(sharded, mesh, spec, spec)

    def step():
        y = f(x)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
        (y * w).sum().backward()

    step()
    with spmd.comm_stats() as st:
        step()
    per = {r: [] for r in range(mesh.size)}
    for name, axes, rank, pass_, nbytes in st.records:
        per[rank].append((name, axes, pass_, nbytes))
    return per


def _per_rank(est):
    return {r: [(c.name, c.axes, c.pass_, c.nbytes) for c in cs] for r, cs in est.comm.items()}


# -- what estimate measures -------------------------------------------------------------------

def test_bytes_per_rank_and_per_collective_equal_a_direct_run():
    model = demo.make_model(hidden=4)
    x = torch.randn(1, 2, 13, 8)  # 13 rows over 3 ranks: [5, 4, 4]
    mesh = spmd.Mesh((3,), ("sp",))
    est = spmd.estimate(model, mesh, SPEC, x, **FAST)
    direct = _direct(model, mesh, SPEC, x)
    assert _per_rank(est) == direct
    assert est.bytes_per_rank == {r: (sum(b for *_, p, b in d if p == "forward"),
                                      sum(b for *_, p, b in d if p == "backward"))
                                  for r, d in direct.items()}
    # The middle rank sends one row (W = 8, float32) to each neighbour per 3x3 conv, of
    # 2, 4 and 4 channels in forward; backward returns the halo rows' gradients, the
    # input's too (every rank runs a collective's backward, needed or not: anchors).
    assert est.bytes_per_rank[1] == (2 * 8 * 4 * (2 + 4 + 4),) * 2
    assert {c.kind for c in est.comm[1]} == {"all_to_all"}
    assert est.largest_rank == 0 and est.local_shapes == ((1, 2, 5, 8),)
    assert est.grad_bytes == {torch.float32: 4 * sum(p.numel() for p in model.parameters())}
    assert est.forward_s > 0 and est.backward_s > 0


def test_the_table_names_each_collective_as_comm_stats_records_it():
    """A conv's halo is listed under the conv's name, the name comm_stats() queries
    take, and says how it travels."""
    mesh = spmd.Mesh((3,), ("sp",))
    x = torch.randn(1, 2, 13, 8)
    est = spmd.estimate(demo.make_model(hidden=4), mesh, SPEC, x, **FAST)
    rows = [ln.split() for ln in est.table().splitlines() if ln.strip().startswith("conv2d")]
    assert {(r[0], r[1], r[3]) for r in rows} == {("conv2d", "all_to_all", "forward"),
                                                  ("conv2d", "all_to_all", "backward")}
    assert "travels as" in est.table() and "a halo travels as an all_to_all" in est.table()
    direct = _direct(demo.make_model(hidden=4), mesh, SPEC, x)
    assert {rec[0] for recs in direct.values() for rec in recs} == {"conv2d"}


def test_a_function_body_on_a_2d_mesh_matches_comm_stats_and_finds_its_weights():
    w = torch.randn(5, requires_grad=True)
    w.grad = torch.ones(5)  # estimate leaves it as it was

    def body(x):  # names axes only: runs on any mesh with them
        return spmd.psum((spmd.all_gather(x * w, "sp", tiled=True) ** 2).sum(), ("dp", "sp"))

    mesh = spmd.Mesh((2, 3), ("dp", "sp"))
    x = torch.randn(4, 6, 5)
    est = spmd.estimate(body, mesh, P("dp", "sp"), x, out_specs=P(), **FAST)
    assert est.grad_bytes == {torch.float32: 20}
    assert torch.equal(w.grad, torch.ones(5))
    f = spmd.shard_map(body, mesh, P("dp", "sp"), P())
    f(x).backward()
    with spmd.comm_stats() as st:
        y = f(x)
        (y * torch.randn((), generator=torch.Generator().manual_seed(0))).backward()
    assert sum(est.bytes_per_rank[r][0] + est.bytes_per_rank[r][1] for r in range(6)) == st.bytes()
    assert est.by_collective() == {(n, k, a, p): v for (n, a, p), v in st.by_op().items()
                                   for k in [{"psum": "all_reduce", "all_gather": "all_gather",
                                              "psum_scatter": "reduce_scatter"}[n]]}


def test_saved_bytes_equal_saved_tensors_hooks_on_one_device_for_a_1_rank_mesh():
    model = demo.make_model(hidden=4)
    x = torch.randn(1, 2, 12, 16)
    est = spmd.estimate(model, spmd.Mesh((1,), ("sp",)), SPEC, x, **FAST)
    with SavedBytes([*model.parameters(), x]) as one:
        y = model(x)
    assert est.saved_bytes == {0: one.total} and one.total > 0
    assert est.output_bytes == {0: y.nbytes}
    assert est.peak_activation_bytes == one.total + y.nbytes
    # The ops still call their (size-1) collectives, which move nothing.
    assert all(c.group_size == 1 and c.nbytes == 0 for c in est.comm[0])


def test_saved_bytes_per_rank_count_each_storage_once():
    def body(x):  # sin saves x * 2 (its input); exp saves its output; the input is skipped
        return (x * 2).sin().exp()

    x = torch.randn(12, 3, requires_grad=True)
    est = spmd.estimate(body, spmd.Mesh((3,), ("sp",)), P("sp"), x, out_specs=P("sp"), **FAST)
    assert est.saved_bytes == {r: 2 * 4 * 3 * 4 for r in range(3)}
    assert est.output_bytes == {r: 4 * 3 * 4 for r in range(3)}


def test_backward_off_measures_the_forward_only():
    model = demo.make_model(hidden=4)
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), SPEC, torch.randn(1, 2, 8, 8),
                        backward=False, **FAST)
    assert all(c.pass_ == "forward" for cs in est.comm.values() for c in cs)
    assert est.backward_s == 0 and est.saved_bytes == {0: 0, 1: 0}
    assert "forward" in str(est) and "Estimate(Mesh(sp=2)" in repr(est)


# -- predictions against direct runs on larger meshes ------------------------------------------

@pytest.mark.parametrize("ranks", [4, 6])
def test_predicted_halo_bytes_equal_a_direct_run_on_the_larger_mesh(ranks):
    model = demo.make_model(hidden=4)
    x = torch.randn(1, 2, 24, 8)
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), SPEC, x, **FAST)
    p = est.predict(ranks, network=IB)
    direct = _direct(model, spmd.Mesh((ranks,), ("sp",)), SPEC, x)
    busiest = max(sum(b for *_, b in d) for d in direct.values())
    assert p.comm_bytes == busiest
    assert p.local_shapes == ((1, 2, 24 // ranks, 8),) and p.mesh_shape == (ranks,)
    assert "measured on a 3 threads mesh" in p.notes[1]


def test_predicted_bytes_on_a_2d_mesh_equal_a_direct_run():
    model = demo.make_model(hidden=4)
    x = torch.randn(1, 2, 16, 16)
    est = spmd.estimate(model, spmd.Mesh((2, 2), ("sx", "sy")), SPEC2, x, **FAST)
    p = est.predict(mesh_shape=(4, 4), network=IB)
    direct = _direct(model, spmd.Mesh((4, 4), ("sx", "sy")), SPEC2, x)
    assert p.comm_bytes == max(sum(b for *_, b in d) for d in direct.values())
    assert p.ranks == 16


def test_face_area_scaling_gives_the_measured_halo_bytes():
    """Past max_elements the 3-rank mesh runs a smaller local shape and halo bytes are
    scaled by face area: exact for a width that halves evenly."""
    model = demo.make_model(hidden=4)
    x = torch.randn(1, 2, 24, 64)
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), SPEC, x, **FAST)
    exact = est.predict(4, network=IB)
    scaled = est.predict(4, network=IB, max_elements=3 * 2 * 6 * 64 // 2)
    assert "scaled by face area" in scaled.notes[1] and "scaled" not in exact.notes[1]
    assert scaled.comm_bytes == exact.comm_bytes
    assert scaled.comm_s == pytest.approx(exact.comm_s, rel=1e-12)


def test_weak_scaling_grows_the_global_shape_and_keeps_the_local_one():
    model = demo.make_model(hidden=4)
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), SPEC, torch.randn(1, 2, 8, 8), **FAST)
    p = est.predict(6, network=IB, scaling="weak")
    assert p.local_shapes == ((1, 2, 4, 8),) and p.global_shapes == ((1, 2, 24, 8),)
    assert p.efficiency == pytest.approx(p.serial_s / p.step_s, rel=1e-12)
    assert p.serial_s == pytest.approx(p.compute_s, rel=1e-12)


def test_step_is_the_sum_of_its_parts_and_strong_efficiency_its_formula():
    model = demo.make_model(hidden=4)
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), SPEC, torch.randn(1, 2, 8, 8), **FAST)
    slow = Network(1e-3, 1e6, name="slow")
    # compute / 1000: on a loaded machine the measured compute can hide every halo
    p = est.predict(4, network=slow, compute_scale=1000.0)
    assert p.step_s == pytest.approx(p.forward_s + p.backward_s + p.comm_s + p.grad_sync_s,
                                     rel=1e-12)
    assert p.efficiency == pytest.approx(p.serial_s / (4 * p.step_s), rel=1e-12)
    assert "compute divided by 1000" in p.notes[-1] and p.network == "slow"
    # every collective's time is exposed or hidden (2 neighbours vs 1: twice the halo)
    assert p.comm_s + p.hidden_s == pytest.approx(sum(
        c.time(slow, 4) for c in est.comm[0]) * 2, rel=1e-12)
    assert p.comm_s > 0 and p.hidden_s >= 0
    g = sum(est.grad_bytes.values())
    assert p.grad_bytes == g
    assert p.grad_sync_s == pytest.approx(
        collective_time(slow, "all_reduce", 4, payload=g)
        + collective_time(slow, "all_gather", 4, payload=32), rel=1e-12)
    none = est.predict(4, network=slow, grad_sync="none")
    assert none.grad_sync_s == 0


def test_overlapped_grad_sync_hides_all_but_the_last_bucket():
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 600, 3, padding=1),  # 7200 B
                                torch.nn.Conv1d(600, 1, 3, padding=1))  # 7204 B
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), P(None, None, "sp"),
                        torch.randn(1, 1, 16), **FAST)
    net = Network(0.0, 1e3)  # 1 kB/s: the all-reduce of one bucket takes seconds
    p = est.predict(2, network=net, grad_sync="overlap")
    # One bucket (under 1 MiB): the whole all-reduce is exposed, with one flag per parameter
    # and the bucket's alarm element.
    elems = sum(q.numel() for q in model.parameters()) + 4 + 1
    assert p.grad_sync_s == pytest.approx(collective_time(net, "all_reduce", 2, payload=4 * elems))


# -- overlap: a halo hides behind the compute between its start and its wait -------------------

def _ev(pass_, start, wait, name="conv2d", kind="all_to_all", ordinal=0):
    return Event(name, kind, pass_, ordinal, start, wait)


def test_exposed_time_by_hand():
    """Forward and backward take 1 s each; the halo is waited for half-way through."""
    f = b = 1.0
    halo = _ev("forward", 0.0, 0.5)
    assert exposed([0.4], [halo], f, b) == 0.0  # fits in the window
    assert exposed([0.7], [halo], f, b) == pytest.approx(0.2)  # 0.5 s of it hidden
    assert exposed([0.4], [_ev("forward", 0.5, 0.5)], f, b) == 0.4  # blocking: all exposed
    assert exposed([0.4], [None], f, b) == 0.4  # not on the one-rank run: all exposed
    # two started together go one after the other: the second ends at 0.8, 0.3 late
    both = [halo, _ev("forward", 0.0, 0.5, ordinal=1)]
    assert exposed([0.4, 0.4], both, f, b) == pytest.approx(0.3)
    # a stall delays what follows: the backward halo starts 0.3 s later than planned
    later = [halo, _ev("backward", 0.0, 0.2)]
    assert exposed([0.8, 0.2], later, f, b) == pytest.approx(0.3)
    assert exposed([0.8, 0.25], later, f, b) == pytest.approx(0.35)


def test_exposed_time_with_a_network_that_hides_part_of_each_collective():
    """``overlap`` 0: a CPU transport whose copies and wake-ups are the rank's own work,
    nothing hides; 0.5: half of each collective is the rank's, the other half may hide."""
    f = b = 1.0
    halo = _ev("forward", 0.0, 0.5)
    assert exposed([0.4], [halo], f, b, overlap=0.0) == pytest.approx(0.4)
    assert exposed([0.4], [halo], f, b, overlap=0.5) == pytest.approx(0.2)  # 0.2 hides
    # 1.4 s: 0.7 the rank's own, 0.7 in flight of which the 0.5 s window hides 0.5
    assert exposed([1.4], [halo], f, b, overlap=0.5) == pytest.approx(0.9)
    assert exposed([0.4], [None], f, b, overlap=0.5) == pytest.approx(0.4)
    assert exposed([0.4], [halo], f, b, overlap=1.0) == exposed([0.4], [halo], f, b)


def test_network_overlap_is_checked_and_shown():
    assert Network(1e-5, 1e9).overlap == 1.0
    assert repr(Network(1e-5, 1e9, name="n", overlap=0.25)) == \
        "Network('n': 10 us, 1 GB/s, tree, overlap 0.25)"
    for bad in (-0.1, 1.5, math.nan, True, "0.5"):
        with pytest.raises(ValueError, match="overlap must be a number in"):
            Network(1e-5, 1e9, overlap=bad)


def test_gradient_sync_hides_behind_backward_only_as_far_as_the_network_overlaps():
    """GradSync's buckets but the last start during backward: they hide behind it up to
    the network's overlap, and the rest adds to the step. Two parameters of 2.4 MB make
    two buckets (the first holds 1 MiB)."""
    from types import SimpleNamespace

    from spmd.perf.model import _grad_sync
    est = SimpleNamespace(grad_bytes={"a": 2_457_600, "b": 2_457_600},
                          _params=[((614_400,), torch.float32)] * 2)
    net = Network(1e-4, 1e8)
    whole, _, _ = _grad_sync(est, 4, dataclasses.replace(net, overlap=0.0), "overlap", 0.0)
    last, _, how = _grad_sync(est, 4, net, "overlap", 10.0)
    assert "2 bucket(s)" in how
    first = whole - last  # the bucket that starts during backward
    assert first > 0 and last > 0
    half, _, _ = _grad_sync(est, 4, dataclasses.replace(net, overlap=0.5), "overlap", 10.0)
    assert half == pytest.approx(last + first / 2)
    # a short backward hides only its own length of the in-flight half
    short, _, _ = _grad_sync(est, 4, dataclasses.replace(net, overlap=0.5), "overlap",
                             first / 4)
    assert short == pytest.approx(last + first / 2 + first / 4)


def test_the_one_rank_run_places_each_halo_before_the_compute_it_hides_behind():
    """The demo CNN's framed convs start their halo before the shard's own conv and wait
    after it; psum blocks. Every collective of the 3-rank run has its event, so with a
    network fast enough for every halo to fit its window, exactly the blocking
    collectives are exposed, and with no compute left to hide behind, nothing is
    hidden."""
    model = demo.make_model(hidden=4)
    mesh = spmd.Mesh((3,), ("sp",))
    build = lambda m: (lambda x: spmd.psum(spmd.nn.convert(model, m, SPEC)(x).square().sum(), "sp"))  # noqa: E731
    est = spmd.estimate(build, mesh, SPEC, torch.randn(1, 2, 24, 16), out_specs=P(), build=True,
                        repeats=3, warmup=1)
    events = est._events(list(est.local_shapes))
    halos = [e for e in events if e.kind == "all_to_all"]
    assert [e.pass_ for e in halos] == ["forward"] * 3 + ["backward"] * 3
    assert all(e.wait > e.start for e in halos)
    assert all(e.wait == e.start for e in events if e.kind == "all_reduce")
    mine = [(c.name, c.kind, c.pass_) for c in est.comm[1]]  # the middle rank's
    assert {(*k, i) for k, i in zip(mine, ordinals(mine))} <= {e.key for e in events}
    fast = Network(1e-12, 1e15, name="fast")
    p = est.predict(3, network=fast, grad_sync="none")
    assert p.comm_s == pytest.approx(sum(c.time(fast, 3) for c in est.comm[1]
                                         if c.kind != "all_to_all"), rel=1e-9)
    assert p.hidden_s == pytest.approx(sum(c.time(fast, 3) for c in est.comm[1]
                                           if c.kind == "all_to_all"), rel=1e-9)
    assert "overlap as on the one-rank run" in p.notes[1]
    slow = Network(1e-3, 1e6, name="slow")
    instant = est.predict(3, network=slow, compute_scale=1e12, grad_sync="none")
    assert instant.hidden_s < 1e-9 * instant.comm_s


def test_mesh_shapes_spread_ranks_over_the_used_axes():
    assert mesh_shape_for(4096, (2, 2)) == (64, 64)
    assert mesh_shape_for(512, (2, 2)) == (32, 16)
    assert mesh_shape_for(6, (3,)) == (6,)
    assert mesh_shape_for(8, (1, 1)) == (4, 2)


# -- the network model ---------------------------------------------------------------------

def test_collective_costs_by_hand():
    net = Network(latency_s=1e-5, bandwidth_Bps=1e6)  # 10 us, 1 byte per us
    us = lambda t: round(t * 1e6, 6)  # noqa: E731
    # all_reduce, tree: 2 ceil(log2 n) latencies + 2 (n-1)/n bytes
    assert us(collective_time(net, "all_reduce", 8, payload=800)) == 6 * 10 + 1400
    assert us(collective_time(net, "all_reduce", 5, payload=500)) == 6 * 10 + 800
    assert us(collective_time(net, "all_reduce_async", 2, payload=100)) == 2 * 10 + 100
    ring = Network(1e-5, 1e6, algorithm="ring")
    assert us(collective_time(ring, "all_reduce", 8, payload=800)) == 14 * 10 + 1400
    assert us(collective_time(ring, "all_gather", 8, payload=100)) == 7 * 10 + 700
    assert us(collective_time(net, "all_gather", 8, payload=100)) == 3 * 10 + 700
    assert us(collective_time(net, "reduce_scatter", 4, payload=400)) == 2 * 10 + 300
    assert us(collective_time(net, "all_to_all", 64, payload=96, sent=96, peers=2)) == 2 * 10 + 96
    assert us(collective_time(net, "all_to_all", 4, payload=400)) == 3 * 10 + 300
    assert us(collective_time(net, "permute", 16, payload=50)) == 10 + 50
    assert us(collective_time(net, "broadcast", 4, payload=50)) == 2 * (10 + 50)
    assert us(collective_time(net, "barrier", 9, payload=0)) == 4 * 10
    assert collective_time(net, "all_reduce", 1, payload=10 ** 9) == 0.0
    over = Network(1e-5, 1e6, overhead_s=2e-5)
    assert us(collective_time(over, "permute", 2, payload=50)) == 20 + 10 + 50
    # a transpose all_to_all priced at a larger group: every other rank gets a block
    c = Collective("fft", "all_to_all", ("sp",), "forward", 3, 2, 300, 200)
    assert c.dense and us(c.time(net, 6)) == 5 * 10 + 250
    halo = Collective("conv2d", "all_to_all", ("sp",), "forward", 3, 2, 200, 200)
    assert not halo.dense and us(halo.time(net, 6)) == 2 * 10 + 200


def test_presets_are_nominal_and_documented():
    assert {"nvlink4", "ib_ndr", "slingshot11"} <= set(NETWORKS)
    for name, net in NETWORKS.items():
        assert net.name == name and net.source.startswith("nominal")
    assert repr(NETWORKS["ib_ndr"]) == "Network('ib_ndr': 2 us, 50 GB/s, tree)"


def test_fit_recovers_latency_and_bandwidth():
    truth = Network(3e-5, 2e9)
    samples = [(k, 2, b, truth.collective_time(k, 2, payload=b))
               for k in ("all_reduce", "all_to_all") for b in (64, 1 << 16, 1 << 20, 1 << 22)]
    samples.append(("all_to_all", 4, 300, 200, 2, truth.collective_time(
        "all_to_all", 4, payload=300, sent=200, peers=2)))
    fit = Network.fit(samples, name="x")
    assert fit.latency_s == pytest.approx(3e-5, rel=1e-9)
    assert fit.bandwidth_Bps == pytest.approx(2e9, rel=1e-9)
    assert fit.name == "x" and fit.overhead_s == 0


def test_comm_stats_details_are_parallel_to_records():
    mesh = spmd.Mesh((4,), ("sp",))

    def body(x):
        y = spmd.ppermute(x, "sp", [(0, 1), (1, 2)])
        z = spmd.all_to_all(x.repeat(2, 1), "sp", 0, 0, tiled=True)  # 4 blocks of a row
        return spmd.psum(y.sum() + z.sum(), "sp")

    with spmd.comm_stats() as st:
        spmd.shard_map(body, mesh, P("sp"), P())(torch.ones(8, 3))
    assert len(st.details) == len(st.records)
    by = {(r[0], r[2]): d for r, d in zip(st.records, st.details)}
    assert by[("ppermute", 0)] == ("permute", 4, 1, 24) and by[("ppermute", 3)] == ("permute", 4, 0, 24)
    assert by[("all_to_all", 2)] == ("all_to_all", 4, 3, 48)
    assert by[("psum", 1)] == ("all_reduce", 4, 3, 4)
    # times: when each call started; an asynchronous all-to-all also when it was waited for
    assert len(st.times) == len(st.records)
    for (name, *_), (s, w) in zip(st.records, st.times):  # these calls all block:
        assert w is None if name != "all_to_all" else w >= s  # threads waits at once


def test_comm_stats_times_say_when_a_halo_was_waited_for():
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(1, 1, 6, 4)
    w = torch.randn(1, 1, 3, 3)
    body = lambda x: spmd.ops.conv2d(x, w, padding=1, mesh=mesh, spec=P(None, None, "sp"))  # noqa: E731
    f = spmd.shard_map(body, mesh, P(None, None, "sp"), P(None, None, "sp"))
    f(x)
    with spmd.comm_stats() as st:
        f(x)
    assert [r[0] for r in st.records] == ["conv2d", "conv2d"]
    assert all(w is not None and w >= s for s, w in st.times)


# -- errors --------------------------------------------------------------------------------------

def test_errors_name_what_was_expected():
    model = demo.make_model(hidden=4)
    mesh = spmd.Mesh((2,), ("sp",))
    x = torch.randn(1, 2, 8, 8)
    with pytest.raises(spmd.SpecError, match="names axis 'tp'"):
        spmd.estimate(model, mesh, P(None, None, "tp"), x, **FAST)
    with pytest.raises(spmd.SpecError, match="tied to one mesh.*made by spmd.nn.convert.*plain model"):
        spmd.estimate(spmd.nn.convert(model, mesh, SPEC), mesh, SPEC, x, **FAST)
    with pytest.raises(spmd.SpecError, match="out_specs is required for a function body"):
        spmd.estimate(lambda x: x, mesh, SPEC, x, **FAST)
    with pytest.raises(spmd.SpecError, match="no output of the body requires grad.*backward=False"):
        spmd.estimate(lambda x: x * 2, mesh, SPEC, x, out_specs=SPEC, **FAST)
    with pytest.raises(TypeError, match="mesh must be a spmd.Mesh"):
        spmd.estimate(model, (2,), SPEC, x)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        spmd.estimate(model, mesh, SPEC, x, repeats=0)

    def inside(x):
        spmd.estimate(model, mesh, SPEC, torch.randn(1, 2, 8, 8), **FAST)
        return x

    with pytest.raises(RuntimeError, match="called on a rank of a threads mesh"):
        spmd.shard_map(inside, mesh, P("sp"), P("sp"))(torch.ones(4))


def test_a_body_bound_to_its_mesh_is_refused_with_the_fix():
    model = demo.make_model(hidden=4)
    mesh = spmd.Mesh((2,), ("sp",))
    sharded = spmd.nn.convert(model, mesh, SPEC)
    with pytest.raises(spmd.SpecError, match="cannot run on the meshes estimate needs.*build=True"):
        spmd.estimate(lambda x: sharded(x), mesh, SPEC, torch.randn(1, 2, 8, 8), out_specs=SPEC,
                      **FAST)


def test_predict_errors():
    model = demo.make_model(hidden=4)
    est = spmd.estimate(model, spmd.Mesh((2,), ("sp",)), SPEC, torch.randn(1, 2, 8, 8), **FAST)
    with pytest.raises(TypeError, match="network must be a spmd.perf.Network"):
        est.predict(4, network="ib")
    with pytest.raises(ValueError, match="scaling must be one of"):
        est.predict(4, network=IB, scaling="linear")
    with pytest.raises(ValueError, match="grad_sync must be one of"):
        est.predict(4, network=IB, grad_sync="later")
    with pytest.raises(ValueError, match=r"mesh_shape \(2,\) has 2 ranks, not 8"):
        est.predict(8, network=IB, mesh_shape=(2,))
    with pytest.raises(ValueError, match="a positive int for each of the axes"):
        est.predict(network=IB, mesh_shape=(2, 2))
    with pytest.raises(ValueError, match="leaves some ranks an empty shard"):
        est.predict(16, network=IB)
    with pytest.raises(ValueError, match="shapes must give the global shape"):
        est.predict(4, network=IB, shapes=[(8, 8)])
    with pytest.raises(ValueError, match="bandwidth_Bps must be a positive"):
        Network(1e-6, 0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        Network(1e-6, 1e9, algorithm="butterfly")
    with pytest.raises(ValueError, match="kind must be one of"):
        collective_time(IB, "gather", 4, payload=4)
    with pytest.raises(ValueError, match="at least two sizes"):
        Network.fit([("all_reduce", 2, 64, 1e-5)] * 3)


@pytest.mark.gloo
def test_estimate_and_fit_network_on_gloo_processes(gloo2):
    got = gloo2.run(_on_gloo, (2,), ("sp",))
    assert got[0] == got[1]
    bytes_per_rank, latency = got[0]
    # Each rank sends one row (W = 16) per conv: 2, 4, 4 channels; backward the same.
    assert bytes_per_rank == {r: (16 * 4 * (2 + 4 + 4),) * 2 for r in (0, 1)}
    assert latency >= 0


def _on_gloo(mesh):
    """A torch mesh: estimate runs a threads mesh of its shape in this process; fit_network
    times the real gloo group (2 MiB and 64 B: a positive slope even on a loaded box;
    medians of 9, since a 64-byte call's p90 reaches several ms on a busy 2-core VM)."""
    est = spmd.estimate(demo.make_model(hidden=4), mesh, SPEC, torch.ones(1, 2, 12, 16), **FAST)
    net = spmd.perf.fit_network(sizes=(64, 1 << 21), kinds=("all_reduce",), repeats=9, warmup=1)
    assert math.isfinite(net.bandwidth_Bps)
    return est.bytes_per_rank, net.latency_s


def test_overlap_of_timed_calls():
    from spmd.perf.network import _overlap
    # (compute, call, both): hidden = compute + call - both, over the shorter of the two
    assert _overlap([[1.0, 0.5, 1.5]]) == 0.0  # one after the other: nothing hidden
    assert _overlap([[1.0, 0.5, 1.0]]) == 1.0  # the call entirely behind the compute
    assert _overlap([[1.0, 0.5, 1.25], [1.0, 0.4, 1.0], [1.0, 0.5, 1.6]]) == 0.5
    assert _overlap([]) == 1.0


def test_fit_network_under_load_on_a_threads_mesh():
    """Each timed call after ~0.2 ms of compute; the fit gives the same Network on every
    rank, with a measured overlap."""
    def fit(mesh):
        return spmd.perf.fit_network(sizes=(64, 1 << 22), kinds=("all_to_all",), repeats=3,
                                     warmup=1, load_s=2e-4)

    nets = spmd.launch(fit, (2,), ("sp",), backend="threads")
    assert nets[0] == nets[1]
    assert 0.0 <= nets[0].overlap <= 1.0 and nets[0].bandwidth_Bps > 0
    assert "after 200 us of compute" in nets[0].source


def test_fit_network_checks_its_load():
    def fit(mesh, load):
        return spmd.perf.fit_network(sizes=(64, 128), load_s=load)

    for bad in (-1e-3, 10.0, True, "1"):
        with pytest.raises(ValueError, match="load_s must be seconds"):
            spmd.launch(fit, (2,), ("sp",), backend="threads", args=(bad,))
