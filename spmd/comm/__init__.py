"""The comm layer: one small protocol (``base.Comm``) and its two backends.

The only code in spmd that touches torch.distributed or thread rendezvous.
"""
from .base import REDUCE_OPS, Comm

__all__ = ["Comm", "REDUCE_OPS"]
