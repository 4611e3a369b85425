"""What the interpreter shares with the code it runs in backward (``backward.py``,
``hooks.py``): the run on this thread, a plan's entry, a call's arguments flattened.
Kept apart so that those modules need not import the interpreter."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core._local import RankLocal

__all__ = ["_Entry", "_flat", "_local"]

#: ``run``: the converted forward running on this thread (``interpreter._Run``);
#: ``frames``: the layers it is inside.
_local = RankLocal()


@dataclass
class _Entry:
    kind: str  # "swapped", "passed", "refused", "allowed"
    where: str
    call: str
    detail: str = ""


def _flat(args: tuple, kwargs: dict):
    for a in list(args) + list(kwargs.values()):
        yield a
        if isinstance(a, (tuple, list)) and not isinstance(a, torch.Size):
            yield from a
        elif isinstance(a, slice):
            yield from (a.start, a.stop, a.step)
