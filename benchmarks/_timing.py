"""What the benchmarks share: the median wall time of a call, after warm-up calls."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], calls: int, warmup: int = 2) -> float:
    """The median of ``calls`` timed calls of ``fn``, in milliseconds."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
