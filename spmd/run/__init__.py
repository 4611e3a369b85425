"""Starting ranks: ``launch`` runs one function on every rank, as threads or as gloo
processes (``processes.ProcessPool`` keeps them alive between runs, for tests)."""
from .launcher import launch

__all__ = ["launch"]
