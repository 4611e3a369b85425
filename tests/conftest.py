import os

import pytest
from hypothesis import HealthCheck, settings

# ci: derandomized, no deadline, modest example counts (CI is a 2-core machine).
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=300,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def gloo2():
    """A persistent pool of 2 gloo processes (started once per session)."""
    from spmd._procs import ProcessPool
    with ProcessPool(2, timeout=60) as pool:
        yield pool


@pytest.fixture(scope="session")
def gloo4():
    """A persistent pool of 4 gloo processes (oversubscribed on 2 cores: few tests)."""
    from spmd._procs import ProcessPool
    with ProcessPool(4, timeout=60) as pool:
        yield pool
