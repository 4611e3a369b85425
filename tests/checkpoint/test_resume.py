"""Resume a training run on another mesh: 3 Adam steps of the demo CNN on gloo world 4,
save, 3 more on gloo world 2 and on a 3-rank threads mesh, equal to 6 uninterrupted
steps on one device (float64; rtol = atol = 1e-10: the ranks add the loss and the
gradient sums in another order than one device, a few ulps that 6 Adam steps barely
grow).

Everything a run needs comes back from the checkpoint: the model's parameters, Adam's
moments and step counts (AS_SAVED: the new optimizer has no state to template), the
step counter, and the data itself, saved as Sharded over 4 ranks and loaded in the new
mesh's layout. The resumed model starts from other weights, so a load that did nothing
would fail.
"""
from __future__ import annotations

import pytest
import torch

import spmd
import spmd.checkpoint as ck
from spmd import Layout, P, Sharded, demo
from spmd.parallel import GradSync

F64 = torch.float64
SPEC = P(None, None, "sp")
LR = 0.05


def _data():
    return demo.heat_data(2, 13, 8, dtype=F64)


def _steps(mesh, model, opt, x, t, n):
    """Per-rank: each rank backprops its part of the global MSE; GradSync sums them."""
    sync = GradSync(model, mesh, {"sp": "sum"})
    sync.attach(opt)
    count = t.numel()
    for _ in range(n):
        opt.zero_grad()
        loss = ((model(x.local) - t.local) ** 2).sum() / count
        loss.backward()
        opt.step()


def first_run(mesh, path):
    model = spmd.nn.convert(demo.make_model(hidden=4, seed=0, dtype=F64), mesh, SPEC)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, t = (Sharded.from_global(v, mesh, SPEC) for v in _data())
    _steps(mesh, model, opt, x, t, 3)
    ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
             "data": {"x": x, "t": t}}, path, mesh)


def resumed_run(mesh, path):
    model = spmd.nn.convert(demo.make_model(hidden=4, seed=1, dtype=F64), mesh, SPEC)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    lx, lt = (Layout(v.shape, SPEC, mesh) for v in _data())
    state = ck.load({"model": model.state_dict(), "optim": ck.AS_SAVED, "step": 0,
                     "data": {"x": lx, "t": lt}}, path, mesh)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    x, t = state["data"]["x"], state["data"]["t"]
    assert state["step"] == 3 and x.layout == lx
    _steps(mesh, model, opt, x, t, 3)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _uninterrupted():
    model = demo.make_model(hidden=4, seed=0, dtype=F64)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, t = _data()
    for _ in range(6):
        opt.zero_grad()
        ((model(x) - t) ** 2).mean().backward()
        opt.step()
    return dict(model.named_parameters())


def _check(got):
    want = _uninterrupted()
    assert set(got) == set(want)
    for k, p in want.items():
        torch.testing.assert_close(got[k], p.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.gloo
def test_resume_world_4_on_world_2_and_on_threads(tmp_path):
    path = str(tmp_path / "ckpt")
    spmd.launch(first_run, (4,), ("sp",), backend="gloo", args=(path,))
    got = spmd.launch(resumed_run, (2,), ("sp",), backend="gloo", args=(path,))
    _check(got[0])
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)
    got = spmd.launch(resumed_run, (3,), ("sp",), backend="threads", args=(path,))
    _check(got[0])
