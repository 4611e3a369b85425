"""Every public name of spmd has a docstring, and so has every public method and property
of its public classes (those spmd defines, not the ones inherited from torch)."""
from __future__ import annotations

import inspect

import spmd
import spmd.checkpoint
import spmd.nn
import spmd.ops
import spmd.parallel
import spmd.perf
import spmd.random
import spmd.testing

PACKAGES = [spmd, spmd.ops, spmd.fft, spmd.nn, spmd.parallel, spmd.checkpoint, spmd.testing,
            spmd.testing.strategies, spmd.perf, spmd.random]


def _public():
    seen = set()
    for pkg in PACKAGES:
        for name in pkg.__all__:
            obj = getattr(pkg, name)
            if inspect.ismodule(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{pkg.__name__}.{name}", obj


def _undocumented():
    missing = []
    for where, obj in _public():
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        if not inspect.getdoc(obj):
            missing.append(where)
        if not inspect.isclass(obj):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if not (callable(fn) or isinstance(value, property)):
                continue
            # inherited docstrings count (forward, extra_repr: torch's own words)
            doc = inspect.getdoc(value) if isinstance(value, property) else \
                inspect.getdoc(getattr(obj, attr))
            if not (doc or "").strip():
                missing.append(f"{where}.{attr}")
    return missing


def test_public_names_methods_and_properties_have_docstrings():
    missing = _undocumented()
    assert not missing, f"{len(missing)} without a docstring: {missing}"
