"""spmd.testing.on_mesh: one test body on every rank, on threads and on gloo processes."""
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd.testing import on_mesh, run_on_mesh, runner

# -- what the decorated tests see ----------------------------------------------------------


@on_mesh((2, 2), ("dp", "sp"), backends=("threads", "gloo"))
def test_psum_counts_ranks(mesh):
    assert spmd.psum(torch.ones(()), ("dp", "sp")).item() == 4


@on_mesh((3, 2), ("dp", "sp"))
def test_body_sees_its_rank_of_the_mesh(mesh, spmd_backend):
    assert (mesh.shape, mesh.axis_names, mesh.backend) == ((3, 2), ("dp", "sp"), "threads")
    assert spmd_backend == "threads"
    one_hot = torch.nn.functional.one_hot(torch.tensor(mesh.rank), 6)
    assert spmd.psum(one_hot, ("dp", "sp")).tolist() == [1] * 6  # every rank exactly once
    assert mesh.coords(mesh.rank) == (spmd.axis_index("dp"), spmd.axis_index("sp"))


@pytest.mark.parametrize("k", [1, 3])
@on_mesh(2, "sp", backends=("threads", "gloo"))
@pytest.mark.parametrize("x", [torch.arange(3.0)], ids=["arange"])
def test_parametrize_args_reach_every_rank(mesh, x, k, spmd_backend):
    assert mesh.backend == {"threads": "threads", "gloo": "torch"}[spmd_backend]
    torch.testing.assert_close(spmd.psum(k * x, "sp"), 2 * k * torch.arange(3.0))


@on_mesh(2, "sp")
def test_fixtures_reach_every_rank(mesh, tmp_path):
    (tmp_path / f"rank{mesh.rank}").touch()
    spmd.psum(torch.ones(()), "sp")  # everyone has written before anyone looks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@settings(max_examples=10)
@given(n=st.integers(-5, 5))
@on_mesh(3, "sp")
def test_given_draws_one_example_for_all_ranks(mesh, n):
    assert spmd.psum(torch.tensor(n), "sp").item() == 3 * n


# -- failures name the rank ----------------------------------------------------------------


@on_mesh(3, "sp")
def _fails_on_rank_2(mesh):
    assert spmd.psum(torch.ones(()), "sp").item() == 3
    assert mesh.rank != 2, "rank 2 disagrees"


@on_mesh(2, "sp", backends=("threads", "gloo"))
def _raises_on_rank_1(mesh, n):
    if mesh.rank == 1:
        raise ValueError(f"bad n={n}")
    spmd.psum(torch.ones(()), "sp")  # rank 0 waits for a rank that never comes


@on_mesh(2, "sp", backends=("gloo",))
def _sums_ranks(mesh):
    assert spmd.psum(torch.tensor(mesh.rank), "sp").item() == 1


def test_failing_assertion_names_its_rank():
    with pytest.raises(AssertionError, match="rank 2: rank 2 disagrees"):
        _fails_on_rank_2(spmd_backend="threads")
    with pytest.raises(ValueError, match="rank 1: bad n=7"):
        _raises_on_rank_1(n=7, spmd_backend="threads")


@pytest.mark.gloo
def test_gloo_failure_names_its_rank_and_the_pool_recovers(gloo2):
    with pytest.raises(ValueError, match="rank 1: bad n=7"):
        _raises_on_rank_1(n=7, spmd_backend="gloo")
    assert not gloo2.started  # the failed run ended the processes ...
    _sums_ranks(spmd_backend="gloo")  # ... and the shared pool starts fresh ones
    assert runner.pool(2) is gloo2 and gloo2.started


def test_run_on_mesh_returns_the_ranks_results():
    assert run_on_mesh(lambda m: m.rank * 10, (2, 2), ("a", "b")) == [0, 10, 20, 30]
    with pytest.raises(spmd.SpecError, match="backend must be one of"):
        run_on_mesh(lambda m: None, 2, "sp", backend="nccl")


# -- what pytest sees ----------------------------------------------------------------------

INNER = """
    import pytest, torch, spmd
    from spmd.testing import on_mesh

    @pytest.mark.parametrize("k", [1, 2])
    @on_mesh(2, "sp", backends=("threads", "gloo"))
    def test_k(mesh, k):
        assert mesh.rank != 1 or k == 1, f"k={k}"

    @on_mesh(2, "sp")
    def test_plain(mesh):
        pass
"""


def _inner_session(tmp_path, *args):
    """Run pytest on INNER in this process: ``(exit code, {test name: (has gloo mark,
    outcome, report)})``."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gloo: gloo processes\n")
    (tmp_path / "test_on_mesh_inner.py").write_text(textwrap.dedent(INNER))
    seen = {}

    class Record:
        def pytest_collection_modifyitems(self, items):
            seen.update({i.name: (bool(i.get_closest_marker("gloo")), None, "") for i in items})

        def pytest_runtest_logreport(self, report):
            name = report.nodeid.split("::")[1]
            if report.when == "call":
                seen[name] = (seen[name][0], report.outcome, str(report.longrepr))

    path = list(sys.path)
    try:
        code = pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", *args],
                           plugins=[Record()])
    finally:
        sys.path[:] = path
        sys.modules.pop("test_on_mesh_inner", None)
    return code, seen


def test_ids_and_gloo_marks(tmp_path):
    code, seen = _inner_session(tmp_path, "--collect-only")
    assert code == pytest.ExitCode.OK
    assert {name: gloo for name, (gloo, _, _) in seen.items()} == {
        "test_k[threads-1]": False, "test_k[threads-2]": False,
        "test_k[gloo-1]": True, "test_k[gloo-2]": True, "test_plain[threads]": False}


def test_pytest_reports_the_failing_rank(tmp_path):
    # Threads only: gloo pools started earlier cannot import a module in tmp_path.
    code, seen = _inner_session(tmp_path, "-m", "not gloo")
    assert code == pytest.ExitCode.TESTS_FAILED
    assert {name: outcome for name, (_, outcome, _) in seen.items() if outcome} == {
        "test_k[threads-1]": "passed", "test_k[threads-2]": "failed",
        "test_plain[threads]": "passed"}
    assert "AssertionError: rank 1: k=2" in seen["test_k[threads-2]"][2]


# -- errors --------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match=r"backends must be distinct names from \('threads', "
                                         r"'gloo'\), got \('nccl',\)"):
        on_mesh(2, "sp", backends=("nccl",))
    with pytest.raises(ValueError, match="distinct"):
        on_mesh(2, "sp", backends=("threads", "threads"))
    with pytest.raises(ValueError, match="got \\(\\)"):
        on_mesh(2, "sp", backends=())
    def body():
        pass

    with pytest.raises(TypeError, match=r"body must take the mesh as its first positional "
                                        r"parameter, as in def body\(mesh, ...\)"):
        on_mesh(2, "sp")(body)
    with pytest.raises(TypeError, match="put @given above @on_mesh"):
        on_mesh(2, "sp")(given(n=st.integers())(lambda mesh, n: None))


USER_SUITE = '''
import time

import torch
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import P
from spmd.testing import assert_matches_single_device, on_mesh
from spmd.testing import strategies as sst


@sst.settings(max_examples=3)
@given(n=st.integers(4, 9))
def test_user_property(n):
    time.sleep(0.3)  # a first example slower than hypothesis's default 200 ms deadline
    mesh = spmd.Mesh((2,), ("sp",))
    assert_matches_single_device(lambda x: x * 2, lambda x: x * 2, mesh, P("sp"), P("sp"),
                                 torch.randn(n))


@on_mesh((2,), ("sp",), backends=("threads", "gloo"))
def test_user_on_mesh(mesh):
    assert spmd.psum(torch.ones(1), "sp").item() == 2.0
'''


def test_a_users_suite_runs_with_default_settings_and_strict_markers(tmp_path):
    """As a user's project would: hypothesis's default profile (200 ms deadline) and
    --strict-markers with no marker registered. The gloo marker comes from spmd's pytest
    plugin, and sst.settings lifts the deadline for a sharded test's first example."""
    import subprocess
    import sys
    (tmp_path / "test_user.py").write_text(USER_SUITE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--strict-markers", "-p",
                        "no:cacheprovider", "-m", "not gloo", "test_user.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env={**__import__("os").environ, "HYPOTHESIS_PROFILE": "default"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed, 1 deselected" in r.stdout
