"""A rank whose converted forward leaves the plan raises on every rank, never a hang
(spmd/nn/steps.py): the rank that leaves raises a SpecError naming the line and the step
the plan expected, before the step sends anything; the others raise CommAborted naming
it, on rank threads and on gloo processes, well within the mesh's timeout."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import spmd
from spmd import P
from spmd.comm.rank_threads import run_on_threads

H = P(None, None, "sp")
F64 = torch.float64

#: Python state that differs between ranks: each rank thread sets its own.
_RANK = threading.local()


class Branchy(nn.Module):
    """``mode`` (this rank's Python state) decides the forward's collectives: ``"extra"``
    makes one more mean over the split rows in the middle, ``"short"`` stops before the
    second conv."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        mode = getattr(_RANK, "mode", None) or getattr(self, "mode", "plain")
        h = torch.tanh(self.a(x))
        if mode == "extra":
            h = h - h.mean((2, 3), keepdim=True)
        if mode == "short":
            return h
        return self.b(h)


def _line(text: str) -> str:
    import inspect
    src, first = inspect.getsourcelines(Branchy.forward)
    k = next(i for i, s in enumerate(src) if text in s)
    return f"test_conversion_steps.py:{first + k}"


def _ranks(model, mesh, x, modes):
    """Every rank's outcome: None, or (error type, message)."""
    def body(rank):
        _RANK.mode = modes[rank]
        try:
            spmd.shard_map(model, mesh, H, H)(x)
        except Exception as e:  # noqa: BLE001 - each rank's own outcome is the result
            return type(e).__name__, str(e)
        finally:
            _RANK.mode = None
        return None
    return run_on_threads(mesh, body)


@pytest.mark.parametrize("mode, left", [
    ("extra", "it is about to run mean {mean}, where the plan's step #1 is "
              "torch.conv2d {b}"),
    ("short", "its forward ended after 1 of the plan's 2 steps; the plan's step #1 is "
              "torch.conv2d {b}"),
])
def test_a_rank_that_leaves_the_plan_raises_and_the_others_stop_threads(mode, left):
    mesh = spmd.Mesh((4,), ("sp",), timeout=30)
    x = torch.randn(2, 1, 11, 5, dtype=F64)
    model = spmd.nn.convert(Branchy().double(), mesh, H)
    assert _ranks(model, mesh, x, ["plain"] * 4) == [None] * 4  # the plan: "plain"
    assert [c for _, c, _ in model.spmd_plan.steps] == ["torch.conv2d", "torch.conv2d"]
    got = _ranks(model, mesh, x, ["plain", "plain", mode, "plain"])
    kind, msg = got[2]
    assert kind == "SpecError", got
    where = {"mean": "in Branchy (" + _line("h.mean((2, 3)") + ")",
             "b": "in 'b' (" + _line("self.b(h)") + ")"}
    assert ("convert: rank 2 left the plan of Branchy's forward at its communicating step "
            "#1: " + left.format(**where) + ". Every rank must run") in msg
    for r in (0, 1, 3):
        kind, msg = got[r]
        assert kind == "CommAborted", got[r]
        assert "cancelled because rank 2 failed" in msg and "left the plan" in msg


def test_ranks_that_agree_with_the_plan_run_as_one_device():
    mesh = spmd.Mesh((4,), ("sp",))
    x = torch.randn(2, 1, 11, 5, dtype=F64)
    net = Branchy().double()
    net.mode = "extra"
    model = spmd.nn.convert(net, mesh, H)
    y = spmd.shard_map(model, mesh, H, H)(x)
    torch.testing.assert_close(y, net(x))
    assert [c for _, c, _ in model.spmd_plan.steps] == [
        "torch.conv2d", "mean", "torch.conv2d"]


def _leave_on_processes(mesh, x, mode):
    """Per-rank (gloo processes): plan with every rank "plain", then rank 1 runs ``mode``;
    each rank's outcome, as on threads."""
    model = spmd.nn.convert(Branchy().double(), mesh, H)
    spmd.shard_map(model, mesh, H, H)(x)
    model.mode = mode if mesh.rank == 1 else "plain"
    try:
        spmd.shard_map(model, mesh, H, H)(x)
    except Exception as e:  # noqa: BLE001 - each rank's own outcome is the result
        return type(e).__name__, str(e)
    return None


@pytest.mark.gloo
def test_a_rank_that_leaves_the_plan_raises_and_the_other_stops_gloo():
    from spmd.run.processes import ProcessPool
    x = torch.randn(2, 1, 11, 5, dtype=F64)
    # A pool of its own: the processes' groups are spent after a rank left (timeout 20 s:
    # a CommTimeout would be the other outcome)
    with ProcessPool(2, timeout=20) as pool:
        got = pool.run(_leave_on_processes, (2,), ("sp",), args=(x, "extra"))
    kind, msg = got[1]
    assert kind == "SpecError" and "rank 1 left the plan of Branchy's forward at its " \
        "communicating step #1: it is about to run mean" in msg
    kind, msg = got[0]
    assert kind == "CommAborted", got[0]
    assert "rank 1 left the converted model's plan at its communicating step #1 and " \
        "raised there" in msg and "rank 0 stops here instead of waiting for it" in msg
