"""Gradient synchronisation for replicated parameters: bucketed, overlapped with
backward, one code path for every backend and device.

``GradSync(module, mesh, {"dp": "mean", "sp": "sum"})`` in a per-rank training loop;
see its docstring.
"""
from .buckets import BucketInfo
from .grad_sync import GradSync

__all__ = ["GradSync", "BucketInfo"]
