"""A count mismatch under torchrun: processes started by ``torch.distributed.run``, the
mesh built on the process group they initialise (docs/cluster.md), default settings."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    import torch.distributed as dist
    import spmd
    from spmd.core.errors import CommError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = spmd.Mesh((2,), ("sp",), timeout=30)
    try:
        with mesh:
            spmd.psum(torch.ones(1000 + rank), "sp")  # 4000 and 4004 bytes: a ring reduction
    except CommError as e:
        with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
            f.write(str(e))
        with mesh:
            spmd.psum(torch.ones(()), "sp")  # still in step: both ranks leave together
        raise
    ''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gloo
def test_a_count_mismatch_under_torchrun_raises_on_both_ranks(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("SPMD_VALIDATE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), str(script), str(tmp_path)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:  # the agent and its workers: one process group
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode != 0, out
    assert "SIGABRT" not in out and "Signal 6" not in out and "doesn't match" not in out, out
    for rank in (0, 1):
        msg = (tmp_path / f"rank{rank}.txt").read_text()
        assert ("psum over axis 'sp': rank 0 passed f32[1000] but rank 1 passed f32[1001]; "
                "every rank must pass the same dtype and shape") in msg, msg
    assert out.count("CommError: ") >= 2, out  # each rank's traceback
