"""Running one ``read_ranges`` call: destination buffers, the in-flight byte budget, completion callbacks.

Shared by every transport (the fsspec transport, and plugins such as dcp-storage-obstore): a transport
plans fetch groups with :func:`~dcp_storage.transports.ranges.plan_fetches` and supplies only ``fetch``, the
function that fills one group's views with its bytes. :class:`RangeRun` does the rest the same way for all
of them: each request's bytes land in ``request.into`` (or a fresh buffer), ``on_complete`` runs once all of
a request's segments have arrived (in the worker thread), no more than ``max_inflight_bytes`` are being
fetched at once, and the first failure stops submitting, waits for the work in flight and is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait

from dcp_storage.transports.budget import ByteBudget
from dcp_storage.transports.ranges import FetchGroup, RangeRequest

__all__ = ["FetchGroupFn", "RangeRun"]

# Fill ``views`` (one per segment of the group, in order) with the group's bytes.
FetchGroupFn = Callable[[FetchGroup, list[memoryview]], None]


class RangeRun:
    """One ``read_ranges`` call. Build it, call :meth:`execute` once; not reusable."""

    def __init__(
        self,
        requests: Sequence[RangeRequest],
        groups: list[FetchGroup],
        fetch: FetchGroupFn,
        pool: Executor,
        max_inflight_bytes: int,
    ) -> None:
        self.requests = requests
        self.groups = groups
        self.fetch = fetch
        self.pool = pool
        self.results: list[memoryview | None] = [None] * len(requests)
        self.remaining = [0] * len(requests)
        for g in groups:
            for seg in g.segments:
                self.remaining[seg.index] += 1
        self.lock = threading.Lock()
        self.budget = ByteBudget(max_inflight_bytes)
        self.failed = threading.Event()

    def _buffer(self, index: int) -> memoryview:
        with self.lock:
            buf = self.results[index]
            if buf is None:
                req = self.requests[index]
                buf = req.into if req.into is not None else memoryview(bytearray(req.length))
                self.results[index] = buf
            return buf

    def _run_group(self, group: FetchGroup) -> None:
        try:
            if self.failed.is_set():
                return
            views = []
            for seg in group.segments:
                req = self.requests[seg.index]
                views.append(self._buffer(seg.index)[seg.start - req.start : seg.end - req.start])
            self.fetch(group, views)
            for seg in group.segments:
                self._segment_done(seg.index)
        except BaseException:
            self.failed.set()
            raise
        finally:
            self.budget.release(group.length)

    def _segment_done(self, index: int) -> None:
        with self.lock:
            self.remaining[index] -= 1
            done = self.remaining[index] == 0
        req = self.requests[index]
        if done and req.on_complete is not None:
            buf = self.results[index]
            req.on_complete(buf if buf is not None else memoryview(b""))
            with self.lock:
                self.results[index] = None

    def execute(self) -> list[memoryview | None]:
        """Fetch everything; per request its buffer, or ``None`` where ``on_complete`` took it.

        Returns (or raises) only once no fetch is running any more, so callers may release what ``fetch``
        uses (open file descriptors, say) right after.
        """
        for i, req in enumerate(self.requests):
            if req.length == 0:
                self._buffer(i)
                self.remaining[i] = 1
                self._segment_done(i)
        futures: list[Future[None]] = []
        try:
            for group in self.groups:
                if self.failed.is_set():
                    break
                self.budget.acquire(group.length)
                try:
                    futures.append(self.pool.submit(self._run_group, group))
                except BaseException:
                    self.budget.release(group.length)
                    raise
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            wait(futures)
            return self.results
        finally:
            for f in futures:
                f.cancel()
            wait(futures)
