"""Doctests of spmd's docstrings run with these names in scope."""
import pytest
import torch

import spmd
from spmd import Layout, Mesh, P, Placeholder


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(torch=torch, spmd=spmd, P=P, Mesh=Mesh, Layout=Layout,
                             Placeholder=Placeholder)
