"""GradSync's arguments, checked before anything is built or moves: the synchronised
axes and their ops, and the parameters declared varying over some axes.

Example:
    >>> check_axes("dp", Mesh((2,), ("dp",)), "GradSync")
    {'dp': 'mean'}
"""
from __future__ import annotations

from collections.abc import Mapping

from ..core._format import describe
from ..core.errors import SpecError
from ..core.mesh import Mesh

__all__ = ["OPS", "check_axes", "check_varying"]

OPS = ("sum", "mean")


def check_varying(varying: object, known: set[str], ignore: set[str], mesh: Mesh,
                   what: str) -> dict[str, frozenset[str]]:
    if varying is None:
        return {}
    if not isinstance(varying, Mapping):
        raise TypeError(f"{what}: varying must be a {{name: axis or axes}} dict, got "
                        f"{describe(varying)}")
    out = {}
    for n, axes in varying.items():
        if n not in known:
            raise SpecError(f"{what}: varying names {n!r}, which is not a parameter or "
                            f"buffer of the module")
        if n in ignore:
            raise SpecError(f"{what}: {n!r} is both ignored and varying; ignore leaves it "
                            f"alone entirely, varying only over the axes it names: pick one")
        out[n] = frozenset(mesh.check_axes(axes, f"{what}: varying[{n!r}]"))
    return out


def check_axes(axes: object, mesh: Mesh, what: str) -> dict[str, str]:
    given = axes
    if isinstance(axes, str):
        axes = [(axes, "mean")]
    elif isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
        axes = [(a, "mean") for a in axes]
    elif isinstance(axes, Mapping):
        axes = list(axes.items())
    else:
        axes = []
    if not axes:
        raise SpecError(f"{what}: axes must be a non-empty {{axis: 'sum' | 'mean'}} dict (or "
                        f"axis names, meaning 'mean'), got {given!r}")
    for a, op in axes:
        if not isinstance(a, str):
            raise SpecError(f"{what}: axes must map mesh axis names to ops, got key {a!r}")
        mesh.check_axes(a, what)
        if op not in OPS:
            raise SpecError(f"{what}: the op for axis {a!r} must be 'sum' or 'mean', got "
                            f"{op!r}")
    names = [a for a, _ in axes]
    if len(set(names)) != len(names):
        raise SpecError(f"{what}: axes {names} repeat an axis")
    return dict(axes)
