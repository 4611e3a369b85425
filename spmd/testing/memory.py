"""A process's peak resident memory, for proving a memory bound (Linux only).

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

__all__ = ["peak", "reset_peak"]


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
