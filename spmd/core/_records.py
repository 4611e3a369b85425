"""Records open in ``with`` blocks (``comm_stats``, ``checkpoint.read_stats``), which
events anywhere in the process add to; bookkeeping only."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class OpenRecords(Generic[T]):
    """The records open now, in the order they were opened; thread-safe.

    Closed by identity, not equality: records are dataclasses, and two open by two rank
    threads compare equal while empty (``list.remove`` would take the other's).
    """

    def __init__(self) -> None:
        self._open: list[T] = []
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._open)  # unlocked: a cheap "anything open?" before the work

    @contextmanager
    def opened(self, record: T) -> Iterator[T]:
        """``record`` open for the block."""
        with self._lock:
            self._open.append(record)
        try:
            yield record
        finally:
            with self._lock:
                del self._open[next(i for i, r in enumerate(self._open) if r is record)]

    def each(self, add: Callable[[T], None]) -> None:
        """``add(record)`` for every open record, under the lock."""
        with self._lock:
            for r in self._open:
                add(r)
