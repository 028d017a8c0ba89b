"""The thread pool a transport runs its storage requests on: made on first use, shut down by ``close``.

Every transport (the core's fsspec one, the obstore plugin's) needs the same thing: one pool per
transport, created lazily (a transport that only lists files starts no threads), safe to request from
several threads, and shut down once, after the requests running on it finish.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["WorkerPool"]


class WorkerPool:
    """A lazily created ``ThreadPoolExecutor`` of ``max_workers`` threads named ``<prefix>_N``."""

    def __init__(self, max_workers: int | None, prefix: str) -> None:
        self._max_workers = max_workers
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        """The pool, created on the first call (again after :meth:`shutdown`)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix=self._prefix)
            return self._pool

    def shutdown(self) -> None:
        """Wait for running requests, then stop the threads. Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
