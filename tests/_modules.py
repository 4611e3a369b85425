"""Small modules and checks shared by the tests of ``spmd.nn.convert``."""
from __future__ import annotations

import pytest
from torch import nn

import spmd
from spmd import P


class Fn(nn.Module):
    """A module whose forward is ``f(self, x)``, with sub-layers in ``self.layers``."""

    def __init__(self, f, *layers):
        super().__init__()
        self.f = f
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return self.f(self, x)


def assert_refused_before_anything_runs(model, mesh, spec, x, phrase: str) -> None:
    """``convert`` refuses ``model`` with a message holding ``phrase``: at once with
    ``example=``, and without it at the first forward, before any collective."""
    with pytest.raises(spmd.SpecError, match="would be wrong on shards") as e:
        spmd.nn.convert(model, mesh, spec, example=x)
    assert phrase in str(e.value)
    with spmd.comm_stats() as stats, pytest.raises(spmd.SpecError, match="nothing has run"):
        spmd.shard_map(spmd.nn.convert(model, mesh, spec), mesh, spec, P())(x)
    assert stats.calls() == 0
