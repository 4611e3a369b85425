"""Memory, for proving a memory bound: what autograd saves (``SavedBytes``, exact and
portable) and a process's peak resident memory (``peak``/``reset_peak``, Linux only).

``reset_peak()`` returns freed heap memory to the system and resets the kernel's
high-water mark (VmHWM) to the current resident size; ``peak()`` reads the mark. The
difference is what the code in between added at its peak, torch's CPU allocations
included (which tracemalloc does not see).

Example:
    >>> from spmd.testing.memory import peak, reset_peak
    >>> base = reset_peak()
    >>> x = torch.ones(1 << 22)  # 16 MiB
    >>> base is None or peak() - base >= 15 << 20
    True
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch

__all__ = ["SavedBytes", "peak", "reset_peak"]


class SavedBytes:
    """The bytes autograd saves for backward on this thread while the block is open,
    counted by distinct storage (a tensor saved by two nodes, or two views of one
    storage, count once: what stays alive), leaving out the storages of ``skip``
    (tensors the caller keeps anyway: parameters, the input) and meta tensors.

    ``saved_tensors_hooks`` are thread-local: in a ``shard_map`` body, open it inside
    the body to count that rank.

    Example:
        >>> x = torch.ones(1000, requires_grad=True)
        >>> with SavedBytes() as saved:
        ...     y = (x * 2).sin()  # sin saves x * 2: 4000 bytes; mul by a number saves nothing
        >>> saved.total
        4000
    """

    def __init__(self, skip: Iterable[torch.Tensor] = ()):
        self._skip = {t.untyped_storage().data_ptr() for t in skip}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if t.device.type != "meta" and st.data_ptr() not in self._skip:
            self.storages[st.data_ptr()] = max(self.storages.get(st.data_ptr(), 0), st.nbytes())
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        """The bytes counted so far."""
        return sum(self.storages.values())


def _status(field: str) -> int | None:
    """``field`` of /proc/self/status in bytes (None where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> int | None:
    """Trim the heap, reset the high-water mark; the resident bytes now (None where
    Linux's /proc/self/clear_refs is not there or not writable)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status("VmRSS")


def peak() -> int | None:
    """The resident bytes' high-water mark since the last ``reset_peak`` (or start)."""
    return _status("VmHWM")
