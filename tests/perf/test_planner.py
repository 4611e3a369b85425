"""spmd.perf.plan (spmd/perf/planner.py): for a U-Net, an FNO and a ViT at 4 and 8 ranks, every candidate the
planner keeps has the bytes per rank that comm_stats counts when it is run (exactly) and
the memory per rank that saved-tensor hooks count (within 10 %), both measured here
independently of the planner; the best is the minimum of its objective; refusals keep
their reason; the errors; the table.

Times are not asserted (the machine is shared): only that each is there and the ranking
follows them.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd import P
from spmd.demo import UNet
from spmd.perf import NETWORKS
from spmd.perf import _measure
from spmd.perf.planner import Candidate, Plan, factorizations
from spmd.testing.memory import SavedBytes

IB = NETWORKS["ib_ndr"]
FAST = dict(repeats=1, warmup=0)




class FNO(nn.Module):
    """Lift, one Fourier layer (spectral conv + pointwise skip), project."""

    def __init__(self, c: int = 2, w: int = 4, modes: tuple[int, int] = (4, 4)):
        super().__init__()
        self.lift = nn.Conv2d(c, w, 1)
        self.spectral = spmd.nn.SpectralConv2d(w, w, modes)
        self.skip = nn.Conv2d(w, w, 1)
        self.proj = nn.Conv2d(w, 1, 1)

    def forward(self, x):
        h = self.lift(x)
        return self.proj(F.gelu(self.spectral(h) + self.skip(h)))


class ViT(nn.Module):
    """Patches of a strided conv flattened into tokens, a learned positional table, one
    encoder block (attention over every token), a per-token head."""

    def __init__(self, c: int = 2, e: int = 8, patch: int = 4, tokens: int = 64):
        super().__init__()
        self.embed = nn.Conv2d(c, e, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, e))
        self.block = nn.TransformerEncoderLayer(e, 2, 2 * e, dropout=0.0, batch_first=True)
        self.head = nn.Linear(e, 1)

    def forward(self, x):
        return self.head(self.block(self.embed(x).flatten(2).transpose(1, 2) + self.pos))


def _case(name: str):
    torch.manual_seed(0)
    if name == "unet":
        return UNet(c=2, w=4, levels=2), torch.randn(1, 2, 16, 16)
    if name == "fno":
        return FNO(), torch.randn(1, 2, 16, 16)
    return ViT(), torch.randn(1, 2, 32, 32)


_PLANS: dict = {}
_RUNS: dict = {}


def _plan(name: str, ranks: int, **kw) -> Plan:
    """The plan of a case (made once per module: several tests read the same one)."""
    key = (name, ranks, tuple(sorted(kw.items())))
    if key not in _PLANS:
        model, x = _case(name)
        _PLANS[key] = spmd.plan(model, x, ranks=ranks, network=IB, **kw, **FAST)
    return _PLANS[key]


def _measure_case(name: str, c: Candidate):
    """``_run`` of a case's candidate (once per module)."""
    key = (name, c.mesh_shape, c.spec)
    if key not in _RUNS:
        model, x = _case(name)
        _RUNS[key] = _run(model, c, x)
    return _RUNS[key]


def _run(model: nn.Module, c: Candidate, x: torch.Tensor, seed: int = 1):
    """Run ``c`` as a user would (convert, shard_map, forward, backward from a random
    cotangent, twice: the second step is the steady state) and count per rank, by hand:
    the bytes comm_stats records, and the input shard + bytes autograd saves (hooks) +
    outputs + twice the trainable parameters."""
    mesh = c.mesh("threads")
    sharded = spmd.nn.convert(model, mesh, c.spec)
    params = [p for p in sharded.parameters() if p.requires_grad]
    names = mesh.axis_names
    saved: dict[int, int] = {}
    held: dict[int, int] = {}

    def body(xl):
        r = spmd.axis_index(names)
        with SavedBytes([*params, xl]) as s:
            y = sharded(xl)
        saved[r] = s.total
        held[r] = xl.nbytes + y.nbytes
        return y

    f = spmd.shard_map(body, mesh, c.spec, c.spec, params=params)

    def step():
        y = f(x)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
        (y * w).sum().backward()

    step()
    with spmd.comm_stats() as st:
        step()
    sent = {r: 0 for r in range(mesh.size)}
    for _name, _axes, rank, _pass, nbytes in st.records:
        sent[rank] += nbytes
    pbytes = sum(p.numel() * p.element_size() for p in params)
    for p in model.parameters():
        p.grad = None
    return sent, {r: saved[r] + held[r] + 2 * pbytes for r in range(mesh.size)}


@pytest.mark.parametrize("ranks", [4, 8])
@pytest.mark.parametrize("name", ["unet", "fno", "vit"])
def test_every_kept_candidate_has_the_bytes_and_memory_of_a_run(name, ranks):
    model, x = _case(name)
    plan = _plan(name, ranks)
    kept = [c for c in plan.candidates if c.status != "refused"]
    assert kept and plan.ranked
    for c in kept:
        assert c.measured_mesh and c.ranks == ranks
        sent, memory = _measure_case(name, c)
        assert c.bytes_per_rank == sent, (c, sent)
        assert c.comm_bytes == max(sent.values())
        for r, m in memory.items():  # exact here; 10 % is what a plan promises
            assert abs(c.memory_per_rank[r] - m) <= 0.1 * m, (c, r, c.memory_per_rank[r], m)
        assert c.memory_per_rank == memory
        assert c.memory_bytes == max(c.memory_per_rank.values())
        p = c.prediction
        assert p.step_s == pytest.approx(p.compute_s + p.comm_s + p.grad_sync_s, rel=1e-12)
        assert p.compute_s > 0 and p.grad_bytes == c.param_bytes > 0
        # what was measured and what modelled, per candidate
        assert c.measured[0].startswith("bytes per rank: comm_stats")
        if c.compute == "timed":
            assert c.measured[-1].startswith("compute: timed on a 1-rank mesh")
        else:  # the ViT's table and the FNO's modes need the global sizes
            assert c.compute == "scaled" and "(the volume ratio: the model refuses the " \
                f"shard {list(c.local_shape)}" in c.measured[-1]
        assert any("gradient all-reduce" in m and "modelled" not in m for m in c.modelled)
    # refused ones say why, and convert refuses them alike
    for c in plan.candidates:
        if c.status == "refused" and not c.reason.startswith("empty"):
            with pytest.raises((spmd.SpecError, RuntimeError)):
                _run(model, c, x)


def test_what_each_model_refuses():
    """The ViT's tokens are its patch rows: a split of the columns is refused by convert
    (a flatten behind a split dim), and the reason is kept."""
    plan = _plan("vit", 4)
    assert [(c.mesh_shape, c.spec) for c in plan.ranked] == [((4,), P(None, None, "d2"))]
    refused = {c.spec: c.reason for c in plan.candidates if c.status == "refused"}
    assert set(refused) == {P(None, None, None, "d3"), P(None, None, "d2", "d3")}
    assert all("flatten" in why for why in refused.values())


@pytest.mark.parametrize("objective", ["bytes", "memory"])
def test_the_best_is_the_minimum_of_the_objective_as_measured(objective):
    plan = _plan("unet", 4, objective=objective)
    assert len(plan.ranked) == 3
    measured = {}
    for c in plan.ranked:
        sent, memory = _measure_case("unet", c)
        measured[(c.mesh_shape, c.spec)] = (max(sent.values()) if objective == "bytes"
                                            else max(memory.values()))
    best = (plan.best.mesh_shape, plan.best.spec)
    assert measured[best] == min(measured.values())
    own = [c.comm_bytes if objective == "bytes" else c.memory_bytes for c in plan.ranked]
    assert own == sorted(own)


def test_ranked_by_time_and_the_best_builds_what_convert_takes():
    model, x = _case("unet")
    plan = _plan("unet", 4)
    steps = [c.step_s for c in plan.ranked]
    assert steps == sorted(steps) and plan.best is plan.ranked[0]
    mesh = plan.best.mesh()
    assert mesh.shape == plan.best.mesh_shape and mesh.axis_names == plan.best.axis_names
    y = spmd.shard_map(spmd.nn.convert(model, mesh, plan.best.spec), mesh, plan.best.spec,
                       plan.best.spec)(x)
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-6)


def test_memory_budget_marks_candidates_over_it_and_keeps_them_in_the_table():
    model, x = _case("unet")
    full = _plan("unet", 4)
    mems = sorted(c.memory_bytes for c in full.ranked)
    budget = mems[0]  # only the least-memory candidate fits
    plan = spmd.plan(model, x, ranks=4, network=IB, memory_per_rank=budget, **FAST)
    assert [c.memory_bytes for c in plan.ranked] == [budget] * len(plan.ranked)
    over = [c for c in plan.candidates if c.status == "over budget"]
    assert len(over) == sum(m > budget for m in mems) > 0
    assert all(f"> {budget:,} B" in c.reason for c in over)
    assert "over budget" in str(plan)


def test_a_budget_nothing_fits_names_the_least_memory_candidate():
    model, x = _case("unet")
    full = _plan("unet", 4)
    low = min(full.ranked, key=lambda c: c.memory_bytes)
    with pytest.raises(ValueError, match="every candidate needs more than") as e:
        spmd.plan(model, x, ranks=4, network=IB, memory_per_rank=1000, **FAST)
    assert f"{low.memory_bytes:,} B per rank" in str(e.value)
    assert str(low.spec) in str(e.value)


@pytest.mark.parametrize("ranks", [0, -2, 1, True, 2.0])
def test_ranks_must_be_an_int_of_at_least_two(ranks):
    model, x = _case("unet")
    with pytest.raises(ValueError, match="ranks must be an int >= 2"):
        spmd.plan(model, x, ranks=ranks, network=IB)


def test_bad_arguments():
    model, x = _case("unet")
    for kw, match in [(dict(dims=(4,)), r"dims must be dims of the example"),
                      (dict(objective="speed"), "objective must be one of"),
                      (dict(max_axes=4), "max_axes must be 1, 2 or 3"),
                      (dict(memory_per_rank=0), "memory_per_rank must be a positive int"),
                      (dict(dims=(2,), specs=[P(None, None, "s")]), "dims or specs, not both"),
                      (dict(specs=[(P(None, None, "a", "b"), (2, 4))]), "product 4")]:
        with pytest.raises(ValueError, match=match):
            spmd.plan(model, x, ranks=4, network=IB, **kw)
    for kw, match in [(dict(grad_sync="later"), "grad_sync must be one of"),
                      (dict(measure_ranks=0), "measure_ranks must be an int >= 1"),
                      (dict(compute_scale=0), "compute_scale must be a positive number")]:
        with pytest.raises(ValueError, match=match):
            spmd.plan(model, x, ranks=4, network=IB, **kw)
    with pytest.raises(TypeError, match="network must be a spmd.perf.Network"):
        spmd.plan(model, x, ranks=4, network="ib_ndr")
    with pytest.raises(spmd.SpecError, match="tied to one mesh .*pass the plain model"):
        spmd.plan(spmd.nn.convert(model, spmd.Mesh((4,), ("d2",)), P(None, None, "d2")), x,
                  ranks=4, network=IB)


def test_the_models_state_is_left_as_it_was():
    """Planning runs training steps on converted copies: BatchNorm's running statistics
    and the gradients are what they were."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spmd.plan(model, torch.randn(2, 1, 8, 8), ranks=2, network=IB, **FAST)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_no_splittable_dim():
    with pytest.raises(ValueError, match=r"no dim of the example f32\[4, 8\] can be split"):
        spmd.plan(nn.Linear(8, 2), torch.randn(4, 8), ranks=2, network=IB)
    with pytest.raises(ValueError, match="no dim"):  # dims 2 and 3 of size 1
        spmd.plan(nn.Conv2d(2, 2, 1), torch.randn(1, 2, 1, 1), ranks=2, network=IB)


class Mixer(nn.Module):
    """Mixes every position with a dense layer over the flattened domain: no split
    is exact."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x.flatten(2)).view(x.shape)


def test_a_model_no_split_works_for_names_every_reason():
    with pytest.raises(spmd.SpecError, match="no decomposition") as e:
        spmd.plan(Mixer(), torch.randn(1, 1, 8, 8), ranks=2, network=IB, **FAST)
    msg = str(e.value)
    assert "2 P(None, None, 'd2')" in msg and "2 P(None, None, None, 'd3')" in msg


def test_empty_shards_are_refused_with_the_reason():
    plan = spmd.plan(nn.Conv2d(1, 1, 3, padding=1), torch.randn(1, 1, 16, 4), ranks=8,
                     network=IB, **FAST)
    refused = {c.spec: c.reason for c in plan.candidates if c.status == "refused"}
    assert refused[P(None, None, None, "d3")] == "empty shards: dim 3 of size 4 over 8 ranks"


def test_specs_and_dims_choose_the_candidates_and_each_local_shape_is_timed_once(monkeypatch):
    """Two specs with the same shards (dim 2 over one axis of 4, or over two of 2): the
    shard's compute is timed once."""
    calls = []
    real = _measure.time_compute

    def counting(setup, names, args, *a, **k):
        calls.append(tuple(args[0].shape))
        return real(setup, names, args, *a, **k)

    monkeypatch.setattr(_measure, "time_compute", counting)
    model, x = _case("unet")
    plan = spmd.plan(model, x, ranks=4, network=IB, specs=[P(None, None, "s"),
                                                           P(None, None, ("a", "b"))], **FAST)
    assert {(c.mesh_shape, c.spec) for c in plan.candidates} == {
        ((4,), P(None, None, "s")), ((2, 2), P(None, None, ("a", "b")))}
    assert len(calls) == len(set(calls)) == len(plan.timed_shapes)
    assert set(calls) == {(1, 2, 4, 16), (1, 2, 16, 16)}  # the shard, and the whole (efficiency)
    assert plan.candidates[0].bytes_per_rank == plan.candidates[1].bytes_per_rank
    one = spmd.plan(model, x, ranks=4, network=IB, dims=(3,), **FAST)
    assert [c.spec for c in one.candidates] == [P(None, None, None, "d3")]


def test_a_shard_the_model_refuses_as_a_whole_input_takes_a_timed_shards_compute():
    """The FNO keeps 4 modes per dim: a shard of 2 rows cannot be timed as a whole input
    (2 frequencies); it takes the compute of the timed shard nearest in volume, times the
    volume ratio (1 here: every shard of 8 ranks has 64 positions)."""
    plan = _plan("fno", 8)
    timed = [c for c in plan.ranked if c.compute == "timed"]
    scaled = [c for c in plan.ranked if c.compute == "scaled"]
    assert [c.local_shape for c in timed] == [(1, 2, 4, 8)] and len(scaled) == 3
    assert (1, 2, 2, 16) not in plan.timed_shapes and (1, 2, 4, 8) in plan.timed_shapes
    for c in scaled:
        assert c.prediction.compute_s == timed[0].prediction.compute_s
        assert "the shard [1, 2, 4, 8]'s (timed) x 1 (the volume ratio" in c.measured[-1]
        assert "SpectralConv2d: modes 4" in c.measured[-1]


def test_candidates_enumerated_for_a_rank_count():
    assert factorizations(8, 2) == [(2, 4), (4, 2)] and factorizations(12, 3) == [
        (2, 2, 3), (2, 3, 2), (3, 2, 2)]
    plan = spmd.plan(nn.Conv3d(1, 1, 3, padding=1), torch.randn(1, 1, 8, 8, 8), ranks=8,
                     network=IB, max_axes=3, **FAST)
    got = {(c.mesh_shape, c.spec) for c in plan.candidates}
    assert ((2, 2, 2), P(None, None, "d2", "d3", "d4")) in got
    assert len(got) == 3 + 3 * 2 + 1  # one dim, two dims (2x4, 4x2), three dims


def test_the_table():
    plan = _plan("vit", 4, memory_per_rank=1 << 30)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == ("plan for 4 ranks, input [1, 2, 32, 32], on ib_ndr, by time, memory "
                        "per rank <= 1,073,741,824 B")
    assert lines[1].split() == ["#", "mesh", "spec", "local", "sent", "B/rank", "memory",
                                "B/rank", "step", "ms", "comm", "ms", "eff", "%", "compute",
                                "status"]
    best = plan.best
    row = lines[2]
    assert row.split()[:2] == ["1", "4"] and str(best.spec) in row
    assert f"{best.comm_bytes:,}" in row and f"{best.memory_bytes:,}" in row
    assert row.rstrip().endswith("measured")
    assert sum("refused: convert: in ViT" in ln and "flatten" in ln for ln in lines) == 2
    assert any(ln.startswith("measured: bytes per rank: comm_stats") for ln in lines)
    assert any(ln.startswith("modelled: collective times: ib_ndr") and "gradient all-reduce"
               in ln for ln in lines)
    assert isinstance(plan, Plan) and "1 usable" in repr(plan)


def test_plot():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    plan = _plan("unet", 4, memory_per_rank=1 << 30)
    ax = plan.plot()
    pts = [p for coll in ax.collections for p in coll.get_offsets().tolist()]
    assert sorted(pts) == sorted([c.memory_bytes / 2 ** 20, c.step_s * 1e3] for c in plan.ranked)
    assert ax.get_ylabel() == "predicted step (ms) on ib_ndr"


def test_past_measure_ranks_a_candidate_is_predicted_from_a_small_mesh():
    """At 16 ranks with measure_ranks=8: measured on a 3-rank mesh whose shards have the
    target's shape; the interior rank's bytes are those of a direct 16-rank run's busiest
    rank (even shards)."""
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 1, 3, padding=1))
    x = torch.randn(1, 1, 32, 32)
    plan = spmd.plan(net, x, ranks=16, network=IB, measure_ranks=8, **FAST)
    assert {c.mesh_shape for c in plan.candidates} == {(16,), (2, 8), (4, 4), (8, 2)}
    assert all(not c.measured_mesh and c.bytes_per_rank is None for c in plan.candidates)
    for c in plan.candidates:
        sent, memory = _run(net, c, x)
        assert c.comm_bytes == max(sent.values())
        assert abs(c.memory_bytes - max(memory.values())) <= 0.1 * max(memory.values())
        assert "Estimate.predict" in c.measured[0]


# -- priced again: another network, an overhead calibrated from a measured step ------------

def test_priced_on_another_network_equals_a_plan_made_on_it():
    """Nothing re-runs: the same collectives and compute, priced on the other network,
    give what planning on it gives (same timings: the plan's own)."""
    plan = _plan("unet", 4)
    slow = spmd.perf.Network(2e-3, 1e7, name="slow", overlap=0.5)
    again = plan.priced(slow)
    assert again.network is slow and plan.network is IB  # the original is left as it was
    for c in again.ranked:
        mine = next(d for d in plan.ranked if d.spec == c.spec and d.mesh_shape == c.mesh_shape)
        direct = spmd.perf.pricing.measured_step(mine.estimate, slow, grad_sync="end",
                                                  compute_scale=1.0)
        assert c.step_s == direct.step_s and c.comm_bytes == mine.comm_bytes
        assert c.step_s > mine.step_s
        assert "slow's latency" in c.modelled[0] and "at most 50% of each hidden" in c.modelled[0]
    assert [c.step_s for c in again.ranked] == sorted(c.step_s for c in again.ranked)
    assert "slow" in str(again).splitlines()[0]


def test_calibrated_overhead_makes_the_candidate_what_was_measured_and_reranks():
    """The 2x2 split makes twice the collectives of a 1-D one: a large measured step for
    one 1-D candidate, explained as per-collective overhead, adds more to the 2x2 split's
    step than to the other 1-D one's."""
    plan = _plan("unet", 4)
    calls = {(c.mesh_shape, c.spec): sum(len(cs) for cs in c.estimate.comm.values())
             // c.ranks for c in plan.ranked}
    one_d = next(c for c in plan.ranked if len(c.mesh_shape) == 1)
    cal = plan.calibrated(one_d, one_d.step_s + 0.5)
    mine = next(c for c in cal.ranked if c.spec == one_d.spec)
    assert mine.step_s == pytest.approx(one_d.step_s + 0.5, rel=1e-9)
    over = cal.network.overhead_s
    assert over > 0 and "calibrated" in cal.network.name
    assert "ms a collective" in str(cal).splitlines()[0]
    assert all(f"+{over * 1e3:.3g} ms a call" in c.modelled[0] for c in cal.ranked)
    before = {(c.mesh_shape, c.spec): c.step_s for c in plan.ranked}
    added = {(c.mesh_shape, c.spec): c.step_s - before[(c.mesh_shape, c.spec)]
             for c in cal.ranked}
    assert sorted(calls.values()) == [16, 16, 32]
    two_d, other = (max(calls, key=calls.get),
                    next(k for k in calls if calls[k] == 16 and k[1] != one_d.spec))
    assert added[two_d] > 1.5 * added[other] > 0
    # a measured step no slower than the prediction adds no overhead
    same = plan.calibrated(one_d, one_d.step_s / 2)
    assert same.network.overhead_s == 0


def test_calibrated_refuses_what_it_cannot_use():
    plan = _plan("unet", 4)
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="step_s must be a positive number"):
            plan.calibrated(plan.best, bad)
    stranger = Candidate((4,), ("d9",), P(None, None, None, None, "d9"))
    with pytest.raises(ValueError, match="is not a priced candidate of this plan"):
        plan.calibrated(stranger, 1.0)
