"""The one save in flight: a background job, its error kept until the next ``save``/``wait``/``close``.

A job is a callable that runs the whole save of one step (staged state in, durable step out) on the
manager's single worker thread, so at most one save runs at a time and a new one first waits for the
one before. Its exception is never swallowed: :meth:`InFlight.settle` raises it once, and records the
step as failed (its folder is torn: the next save removes it, and it never counts as a step).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["InFlight"]


class InFlight:
    """The save running in the background, if any."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[Any] | None = None
        self._step: int | None = None
        self.failed: list[int] = []  # steps whose save failed, not yet cleaned up

    @property
    def step(self) -> int | None:
        return self._step

    def submit(self, step: int, job: Callable[[], Any]) -> None:
        """Run ``job`` in the background; the caller has :meth:`settle`-d the previous one."""
        if self._future is not None:
            raise RuntimeError("a save is already in flight: settle() it first")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-storage-manager")
        self._step = step
        self._future = self._pool.submit(job)

    def settle(self) -> Any:
        """Wait for the save in flight; raise its exception (once). Returns its result, or ``None``."""
        future, step = self._future, self._step
        if future is None:
            return None
        try:
            return future.result()
        except BaseException:  # torch's CheckpointException is a BaseException
            if future.done() and not future.cancelled() and future.exception() is not None and step is not None:
                self.failed.append(step)  # the save failed (not an interrupt of this wait)
            raise
        finally:
            if future.done():  # an interrupt while waiting leaves the save in flight
                self._future = None
                self._step = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
