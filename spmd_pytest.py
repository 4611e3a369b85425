"""spmd's pytest plugin (an entry point, loaded by pytest wherever spmd is installed).

It registers the ``gloo`` marker that ``spmd.testing.on_mesh`` puts on its gloo runs, so
users' suites need not (and ``--strict-markers`` accepts it). It imports nothing of spmd
or torch: pytest starts as fast as before.
"""
from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "gloo: runs real torch.distributed processes (gloo on 127.0.0.1); "
        "deselect with -m 'not gloo'")
