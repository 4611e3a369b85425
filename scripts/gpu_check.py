"""GPU checks that CI (CPU only) cannot run: spmd on CUDA tensors, and NCCL under torchrun.

    python scripts/gpu_check.py                 # CUDA; prints "skipped" and exits 0 without it
    python scripts/gpu_check.py --device cpu    # the same checks on the CPU (what the tests run)

Each check compares a sharded run with one device, values and gradients:
- ``spmd.ops`` layers (conv2d with stride and uneven shards, circular halo_pad, max_pool2d,
  bilinear interpolate) on a 4-rank threads mesh whose tensors live on the device, in float64
  (tolerance 1e-10: sums reordered across ranks) through
  ``spmd.testing.assert_matches_single_device``;
- the same ops in float32 against the float64 reference (its float32 tolerance);
- the demo's CNN trained 10 Adam steps on the threads mesh and on one device (parameters
  within 1e-5);
- ``spmd.checkpoint``: a device ``Sharded`` saved on a 4-rank threads mesh and loaded on a
  3-rank one in another layout (shards back on the device, bit-exact);
- with two or more GPUs: ``torchrun --nproc-per-node 2 -m spmd demo`` over NCCL.

Prints one line per check and exits 1 if any failed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

import spmd
from spmd import P, demo
from spmd.testing import assert_matches_single_device


def _ops_match(device: torch.device, dtype: torch.dtype) -> None:
    mesh = spmd.Mesh((4,), ("sp",))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 18, 7, generator=g, dtype=torch.float64).to(device)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64).to(device)
    b = torch.randn(4, generator=g, dtype=torch.float64).to(device)
    s = P(None, None, "sp")
    uneven = spmd.Layout(x.shape, s, mesh, sizes={2: [7, 0, 5, 6]})
    conv_out = spmd.ops.conv2d.output_layout(uneven, w.shape, stride=2, padding=1)
    cases: list[tuple[str, Callable, Callable, object, object, tuple]] = [
        ("conv2d stride 2", lambda x, w, b: spmd.ops.conv2d(x, w, b, stride=2, padding=1,
                                                            mesh=mesh, spec=uneven),
         lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), uneven, conv_out, (w, b)),
        ("max_pool2d", lambda x: spmd.ops.max_pool2d(x, 3, 2, 1, mesh=mesh, spec=uneven),
         lambda x: F.max_pool2d(x, 3, 2, 1), uneven,
         spmd.ops.max_pool2d.output_layout(uneven, 3, 2, 1), ()),
        ("interpolate bilinear", lambda x: spmd.ops.interpolate(
            x, scale_factor=1.5, mode="bilinear", mesh=mesh, spec=uneven),
         lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear"), uneven, s, ()),
    ]
    for name, local, ref, ins, outs, params in cases:
        try:
            assert_matches_single_device(local, ref, mesh, ins, outs, x, params=params,
                                         dtype=dtype)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    # halo_pad returns each rank's shard plus its halos: compare them rank by rank
    full = F.pad(x, (0, 0, 2, 3), mode="circular")

    def padded(m):
        return spmd.halo_pad(uneven.shard(x, m.rank).to(dtype), m, "sp", 2, (2, 3),
                             mode="circular")

    got = spmd.launch(padded, (4,), ("sp",))
    start = 0
    for r, y in enumerate(got):
        n = uneven.sizes[2][r]
        want = full[:, :, start:start + n + 5].to(dtype)
        torch.testing.assert_close(y, want, rtol=0, atol=0,
                                   msg=lambda m, r=r: f"halo_pad circular, rank {r}: {m}")
        start += n


def _demo_trains(device: torch.device) -> None:
    data = demo.heat_data(4, 21, 16, seed=1, device=device)
    model = demo.make_model(hidden=8, seed=1, device=device)
    one = demo.train_single(model, data, steps=10)
    sharded = demo.train_sharded(model, spmd.Mesh((4,), ("sp",)), data, steps=10)
    diff = demo.max_param_diff(one, sharded)
    assert diff < 1e-5, f"parameters differ by {diff:.2e} after 10 steps (tolerance 1e-5)"


def _checkpoint_moves(device: torch.device) -> None:
    import tempfile

    import spmd.checkpoint as ck
    x = torch.randn(13, 6, 5, dtype=torch.float64, device=device)
    m4 = spmd.Mesh((2, 2), ("a", "b"), device=device)
    m3 = spmd.Mesh((3,), ("sp",), device=device)
    with tempfile.TemporaryDirectory() as path:
        ck.save({"x": spmd.Sharded.from_global(x, m4, P("a", "b"))}, path, m4)
        lay = spmd.Layout(x.shape, P(None, None, "sp"), m3, sizes={2: [0, 4, 1]})
        got = ck.load({"x": lay}, path, m3)["x"]
    for r in range(3):
        assert got.shards[r].device == x.device, f"shard {r} on {got.shards[r].device}"
        assert torch.equal(got.shards[r], lay.shard(x, r)), f"shard {r} differs"


def _torchrun_nccl() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "spmd", "demo", "--steps", "5", "--size", "29"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout, (
        f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device: skipped")
        return 0
    checks: list[tuple[str, Callable[[], None]]] = [
        ("ops, float64", lambda: _ops_match(device, torch.float64)),
        ("ops, float32", lambda: _ops_match(device, torch.float32)),
        ("demo CNN, 10 Adam steps", lambda: _demo_trains(device)),
        ("checkpoint, 4 ranks -> 3", lambda: _checkpoint_moves(device)),
    ]
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        checks.append(("torchrun NCCL demo", _torchrun_nccl))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check on {where}, torch {torch.__version__}")
    failed = 0
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            check()
            status = "PASS"
        except Exception:  # noqa: BLE001 - reported, and the exit status says so
            status = "FAIL\n" + traceback.format_exc()
            failed += 1
        print(f"  {name:<26} {time.perf_counter() - t0:6.1f} s  {status}")
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        print("  (torchrun NCCL demo: needs 2 GPUs, skipped)")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
