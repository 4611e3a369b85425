import os

import pytest
from hypothesis import HealthCheck, settings

# ci: derandomized, no deadline, modest example counts (CI is a 2-core machine).
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=300,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session", autouse=True)
def _close_gloo_pools():
    """No gloo process outlives the session (the pools are spmd.testing's shared ones)."""
    yield
    from spmd.testing import runner
    runner.close_pools()


@pytest.fixture(scope="session")
def gloo2():
    """The persistent pool of 2 gloo processes that ``@spmd.testing.on_mesh`` uses too."""
    from spmd.testing import runner
    return runner.pool(2)


@pytest.fixture(scope="session")
def gloo4():
    """The persistent pool of 4 gloo processes (oversubscribed on 2 cores: few tests)."""
    from spmd.testing import runner
    return runner.pool(4)
