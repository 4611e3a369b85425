"""``spmd.demo`` and ``python -m spmd demo``: the sharded heat-diffusion CNN trains like
the one-device model, and the CLI prints its verdict, on threads, gloo and torchrun.

Tolerances: float64, 1e-10 (the sharded run only reorders sums: a few ulps after a few
Adam steps); float32, 1e-5 on parameters (the CLI's PASS threshold; measured ~1e-7).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import spmd
from spmd import __main__ as spmd_main
from spmd.demo import cli as _demo
from spmd.demo import heat as demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_sharded_trains_like_one_device_on_uneven_shards(dtype, tol):
    x, t = demo.heat_data(batch=2, size=10, width=8, seed=1, dtype=dtype)  # rows [4, 3, 3]
    model = demo.make_model(hidden=4, seed=1, dtype=dtype)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    one = demo.train_single(model, (x, t), steps=4)
    sharded = demo.train_sharded(model, spmd.Mesh((3,), ("sp",)), (x, t), steps=4)
    torch.testing.assert_close(torch.tensor(sharded.losses), torch.tensor(one.losses),
                               rtol=tol, atol=tol)
    assert demo.max_param_diff(sharded, one) < tol
    assert one.losses[-1] < one.losses[0]  # it learns
    for k, p in model.named_parameters():  # both trained copies
        assert torch.equal(p, before[k])
    assert any((one.params[k] - before[k]).abs().max() > 1e-4 for k in before)


def test_bytes_per_step_are_the_halo_rows():
    B, H, W, h = 2, 10, 8, 4
    x, t = demo.heat_data(B, H, W, dtype=torch.float64)
    hist = demo.train_sharded(demo.make_model(h, dtype=torch.float64),
                              spmd.Mesh((3,), ("sp",)), (x, t), steps=2)
    row = B * W * 8                        # one float64 row of one channel
    per_edge = row * (2 + h + h)           # the inputs of the 3 convs: 2, h, h channels
    assert hist.bytes_by_op["conv2d"] == (4 * per_edge, 4 * per_edge)  # 2 edges, both ways
    assert hist.bytes_by_op["psum"] == (3 * 8, 3 * 8)
    f0, b0 = hist.bytes_per_step[0]
    f1, b1 = hist.bytes_per_step[1]
    assert b0 == per_edge + 8 and b1 == 2 * per_edge + 8  # the middle rank has two neighbours
    assert f1 - f0 == per_edge


def test_heat_data_is_seeded_and_physical():
    x, t = demo.heat_data(2, 12, 10, seed=3, dtype=torch.float64)
    x2, _ = demo.heat_data(2, 12, 10, seed=3, dtype=torch.float64)
    assert torch.equal(x, x2) and not torch.equal(x, demo.heat_data(2, 12, 10, seed=4)[0])
    u, kappa = x[:, :1], x[:, 1:]
    assert 0.05 <= kappa.min() and kappa.max() <= 0.7 + 1e-12
    # Diffusion smooths: the field's total variation drops over the step.
    tv = lambda v: v.diff(dim=2).abs().sum() + v.diff(dim=3).abs().sum()  # noqa: E731
    assert tv(t) < tv(u)


def test_report_fails_above_tolerance(capsys):
    good = demo.History([1.0, 0.5], {"w": torch.zeros(3)}, 0.01, 0.02)
    bad = demo.History([1.0, 0.5], {"w": torch.tensor([0.0, 2e-5, 0.0])}, 0.01, 0.02)
    args = _demo._parser().parse_args(["--steps", "2"])
    assert not _demo._report(args, bad, good, {0: (10, 20)}, {"psum": (10, 20)}, "")
    out = capsys.readouterr().out
    assert "2.00e-05  FAIL" in out and out.rstrip().endswith("FAIL")
    assert _demo._report(args, good, good, {0: (10, 20)}, {"psum": (10, 20)}, "")
    # On processes, ranks whose copies drifted apart fail too.
    assert not _demo._report(args, good, good, {0: (10, 20)}, {}, "", spread=1e-4)


def test_cli_threads():
    r = _run([sys.executable, "-m", "spmd", "demo", "--steps", "3", "--size", "14"], 60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rows split [4, 4, 3, 3]" in r.stdout
    assert "largest |parameter difference| after 3 steps" in r.stdout
    assert r.stdout.rstrip().endswith("PASS")
    assert "step    3/3" in r.stdout and "\r" not in r.stdout  # not a tty: plain lines


def test_cli_usage_and_bad_flags(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["spmd"])
    assert spmd_main._main() == 2 and "python -m spmd demo" in capsys.readouterr().err
    for flag in ("--help", "-h"):  # asking for help is not an error (it exited 2)
        monkeypatch.setattr(sys, "argv", ["spmd", flag])
        assert spmd_main._main() == 0 and "python -m spmd demo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        _demo.main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err


@pytest.mark.gloo
def test_cli_gloo(capfd):
    # In this process (its torch is imported already); the ranks are fresh processes.
    code = _demo.main(["--backend", "gloo", "--ranks", "2", "--steps", "2", "--size", "9",
                       "--width", "8", "--batch", "2"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "2 gloo processes" in out and "rows split [5, 4]" in out
    assert "training sharded     step    2/2" in out  # rank 0's progress
    assert "shard_map backward" in out  # the processes all-reduce gradients
    assert "between the ranks' copies of the parameters: 0.00e+00" in out
    assert out.rstrip().endswith("PASS")


@pytest.mark.gloo
def test_cli_torchrun():
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "-m", "spmd", "demo", "--steps", "2", "--size", "9",
              "--width", "8", "--batch", "2"], 120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torchrun world 2" in r.stdout and "rows split [5, 4]" in r.stdout
    assert r.stdout.count("largest |parameter difference|") == 1  # rank 0 reports
    assert r.stdout.rstrip().endswith("PASS")


def test_the_readme_shows_the_default_demos_bytes():
    """The sample output in README.md is what `python -m spmd demo` prints."""
    repo = os.path.dirname(ROOT)
    readme = open(os.path.join(repo, "README.md"), encoding="utf-8").read()
    sample = readme[readme.index("bytes sent per step (spmd.comm_stats()):"):]
    rows = [ln for ln in sample.splitlines()[1:4] if "|" in ln]
    assert len(rows) == 3, rows  # the header and ranks 0 and 1
    r = _run([sys.executable, "-m", "spmd", "demo"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for row in rows:
        assert row in r.stdout, (row, r.stdout)
