"""A blocking budget on bytes in flight, so concurrent reads cannot exhaust memory."""

from __future__ import annotations

import threading

__all__ = ["ByteBudget"]


class ByteBudget:
    """Counting semaphore over bytes.

    ``acquire(n)`` blocks until ``n`` more bytes fit under ``capacity``. A single request larger than the
    whole capacity is admitted when nothing else is in flight, so it can never deadlock.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"byte budget capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            while self._used > 0 and self._used + nbytes > self.capacity:
                self._cond.wait()
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._used
