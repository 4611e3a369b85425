"""spmd.launch's processes (spmd/run/processes.py) and threads: a rank that exits or stops is
an error naming it; scripts guarded by a compound main test start processes."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import spmd
from spmd.run.processes import _is_main_test


def _exits(mesh, code):
    if mesh.rank == 1:
        sys.exit(code)
    return mesh.rank


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_in_a_rank_is_an_error_naming_it_on_threads(code):
    with pytest.raises(RuntimeError, match=rf"rank 1: fn called sys.exit\({code}\) "
                       r"\(SystemExit\)"):
        spmd.launch(_exits, (2,), "sp", args=(code,), timeout=10)


@pytest.mark.gloo
def test_sys_exit_in_a_rank_is_an_error_naming_it_on_gloo(gloo2):
    with pytest.raises(RuntimeError, match=r"rank 1: fn called sys.exit\(0\) \(SystemExit\); "
                       r"the run has no result from that rank"):
        gloo2.run(_exits, (2,), ("sp",), args=(0,))


@pytest.mark.parametrize("src, ok", [
    ('__name__ == "__main__"', True),
    ('"__main__" == __name__', True),
    ('__name__ == "__main__" and "--go" in sys.argv', True),
    ('ready and __name__ == "__main__"', True),
    ('a and (b and __name__ == "__main__")', True),
    ('__name__ == "__main__" or "--go" in sys.argv', False),  # runs in children too
    ('not __name__ == "__main__"', False),
    ('__name__ != "__main__"', False),
    ('__name__ == "main"', False),
])
def test_compound_main_guards_are_recognised(src, ok):
    assert _is_main_test(ast.parse(src, mode="eval").body) is ok


SCRIPT = '''
import sys
import torch
import spmd


def body(mesh):
    return spmd.psum(torch.ones(1), "sp").item()


if __name__ == "__main__" and "--go" in sys.argv:
    print(spmd.launch(body, (2,), ("sp",), backend="gloo"))
'''


@pytest.mark.gloo
def test_a_compound_main_guard_starts_processes(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), "--go"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[2.0, 2.0]", r.stderr


def _rank(mesh):
    return mesh.rank


def _stops(mesh):
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return spmd.psum(torch.ones(1), "sp").item()


@pytest.mark.gloo
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")
def test_a_stopped_rank_is_named_within_the_timeout_and_a_second(gloo2):
    assert gloo2.run(_rank, (2,), ("sp",)) == [0, 1]  # started: the time below is the run's
    timeout = 3.0
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1: process stopped \(state T: SIGSTOP, job "
                       r"control or a debugger\) for 3 s"):
        gloo2.run(_stops, (2,), ("sp",), timeout=timeout)
    assert time.monotonic() - t0 < timeout + 1.0
    assert gloo2.run(_rank, (2,), ("sp",)) == [0, 1]  # the pool starts afresh
