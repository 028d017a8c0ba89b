"""Thread-safe I/O counters that benchmarks and the demo print."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["TransportCounters"]


@dataclass
class TransportCounters:
    """Requests made, bytes moved and retries taken by one transport.

    ``requests`` counts storage calls that move data or metadata (a ranged GET, a ``pread``, a PUT, a
    multipart part); ``bytes_read`` counts bytes fetched from storage, including coalescing gaps.
    """

    requests: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, requests: int = 0, bytes_read: int = 0, bytes_written: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written
            self.retries += retries

    def __getstate__(self) -> dict[str, int]:
        return self.snapshot()  # the lock stays behind

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "retries": self.retries,
            }

    def reset(self) -> None:
        with self._lock:
            self.requests = self.bytes_read = self.bytes_written = self.retries = 0
