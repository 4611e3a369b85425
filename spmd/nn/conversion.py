"""``spmd.nn.convert``: a copy of a model with its layers swapped for their sharded twins."""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ..core.errors import SpecError
from ..core.mesh import Mesh
from ..core.spec import as_spec
from .modules import SHARDED

__all__ = ["convert", "UNSAFE"]

#: Layers that mix values across positions in ways the sharded model would get wrong
#: (statistics over the split dims, flattening, attention): ``convert`` refuses them
#: unless listed in ``allow`` (e.g. a norm whose statistics do not span split dims).
UNSAFE: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm,
    nn.LocalResponseNorm, nn.Flatten, nn.Unflatten, nn.Fold, nn.Unfold, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def convert(model: nn.Module, mesh: Mesh, spec: Any, *,
            types: Mapping[type[nn.Module], type] | None = None,
            allow: Iterable[type[nn.Module]] = ()) -> nn.Module:
    """A deep copy of ``model`` in which every layer with a sharded twin in ``spmd.nn``
    (convolutions, transposed convolutions, pools, upsampling, padding layers) is that
    twin, for activations of spec ``spec`` on ``mesh``.

    Parameters, buffers and ``state_dict`` keys are unchanged, so checkpoints load both
    ways; ``model`` itself is not modified. Pointwise layers (activations, dropout)
    need no twin. Run the result inside ``spmd.shard_map`` (or per-rank code).

    Args:
        model: the single-device model.
        mesh: the mesh.
        spec: the spec of the activations, e.g. ``P(None, None, "sp")`` for (N, C, H, W)
            split along H; every converted layer gets it (its input's spec).
        types: extra ``{torch layer type: sharded type}`` pairs (a sharded type has a
            ``from_torch(module, mesh, spec)`` classmethod).
        allow: layer types of ``UNSAFE`` that you know are right on shards here.

    Raises:
        SpecError: a layer of ``UNSAFE`` type not in ``allow`` (its path is named).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(),
        ...                           torch.nn.MaxPool2d(2))
        >>> sharded = spmd.nn.convert(net, mesh, P(None, None, "sp"))
        >>> [type(m).__module__.split(".")[0] for m in sharded]
        ['spmd', 'torch', 'spmd']
        >>> x = torch.randn(1, 1, 8, 8)
        >>> y = spmd.shard_map(sharded, mesh, P(None, None, "sp"), P(None, None, "sp"))(x)
        >>> torch.allclose(y, net(x), atol=1e-6)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    as_spec(spec)
    mapping = {**SHARDED, **(types or {})}
    allowed = tuple(allow)
    new = copy.deepcopy(model)
    if type(new) in mapping:
        return mapping[type(new)].from_torch(new, mesh, spec)
    swaps = []
    for path, parent in new.named_modules():
        for name, child in parent.named_children():
            full = f"{path}.{name}" if path else name
            twin = mapping.get(type(child))
            if twin is not None:
                swaps.append((parent, name, twin.from_torch(child, mesh, spec)))
            elif isinstance(child, UNSAFE) and not isinstance(child, allowed):
                raise SpecError(
                    f"convert: {full} is a {type(child).__name__}, which mixes values across "
                    f"positions (statistics, flattening or attention) and would be wrong on "
                    f"shards split by {spec!r}; replace it, or pass "
                    f"allow=({type(child).__name__},) if it does not span a split dim")
    for parent, name, twin in swaps:
        setattr(parent, name, twin)
    return new
