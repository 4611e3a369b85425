"""Pictures of layouts: ``visualize`` draws how a tensor is split, as text or a figure."""
from .picture import visualize

__all__ = ["visualize"]
