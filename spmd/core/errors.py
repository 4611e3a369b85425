"""Exceptions raised by spmd.

Every error names what was expected, what was given, and how to fix it.
"""
from __future__ import annotations

import math
import threading

__all__ = ["SpecError", "CommTimeout", "CommError", "CommAborted", "tag_rank",
           "check_timeout"]


class SpecError(ValueError):
    """A spec, layout, axis name or shape does not fit the mesh or the tensor."""


class CommError(RuntimeError):
    """A collective failed: ranks disagreed about it (different ops, shapes or dtypes),
    one did not arrive, or one failed.

    Attributes:
        op: the collective, e.g. ``"psum"``.
        axes: the mesh axes it ran over.
        missing: global ranks that did not arrive or failed (empty when the backend
            cannot tell).
    """

    def __init__(self, message: str, *, op: str = "", axes: tuple[str, ...] = (),
                 missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.op = op
        self.axes = axes
        self.missing = missing

    def __reduce__(self):  # keep op, axes and missing across processes (pickle)
        return (_rebuild, (type(self), self.args, self.op, self.axes, self.missing))


def _rebuild(cls, args, op, axes, missing):
    return cls(*args, op=op, axes=axes, missing=missing)


class CommTimeout(CommError, TimeoutError):
    """A blocking wait ran past its timeout; ``missing`` names the ranks that did not
    arrive."""


class CommAborted(CommError):
    """Another rank failed (or its process died), so this rank's pending collective was
    cancelled; ``missing`` names that rank where the backend can tell."""


def tag_rank(exc: BaseException, rank: int) -> BaseException:
    """Put ``rank R: `` in front of an exception's message (type and attributes kept)."""
    prefix = f"rank {rank}: "
    if exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith(prefix):
            exc.args = (prefix + exc.args[0],) + exc.args[1:]
    elif hasattr(exc, "add_note"):
        exc.add_note(f"raised on rank {rank}")
    return exc


def check_timeout(value: object, what: str) -> float:
    """``value`` as a timeout in seconds: a finite positive number no larger than what the
    waits of threads and process groups take (``threading.TIMEOUT_MAX``).

    NaN never expires (a wait hangs), infinity overflows them, zero and negatives expire
    at once: each is refused here, before anything waits.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: timeout must be a number of seconds, got "
                        f"{type(value).__name__} {value!r}")
    v = float(value)
    if math.isnan(v) or not 0 < v <= threading.TIMEOUT_MAX:
        raise SpecError(f"{what}: timeout must be a positive, finite number of seconds (at "
                        f"most {threading.TIMEOUT_MAX:.3g}), got {value!r}")
    return v
