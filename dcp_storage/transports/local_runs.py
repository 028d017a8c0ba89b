"""The local strided-copy fast path: many equal byte runs of a local file, read without request objects.

A ``Shard(1)`` slice of a row-major tensor is one run per row: thousands of small, evenly spaced byte
runs. Through :meth:`~.protocol.Transport.read_ranges` each would be a request object; on a local disk
they are cheaper read directly. :class:`LocalRuns` offers the two ways (the core picks per slice,
:mod:`dcp_storage.formats.tensor_reads`): :meth:`~LocalRuns.read_runs`, a tight loop of ``preadv`` calls
per run spread over the transport's worker threads (``preadv`` drops the GIL), for runs of a MiB or more;
and :meth:`~LocalRuns.map_regions`, private read-only memory maps of each span, for many tiny runs copied
out with one strided copy. Bytes only: the caller lays its tensor over the map.

It works over any transport with :class:`~.protocol.LocalFileAccess` (regular files inside the checkpoint
only, :mod:`.local_open`); :class:`~.local_transport.LocalTransport` offers it as its own methods (the
optional :class:`~.protocol.LocalRunReads` protocol).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from dcp_storage.errors import CorruptCheckpointError

__all__ = ["LocalRuns", "Region", "RunsRead"]

_RUNS_PER_JOB = 4096


@dataclass(frozen=True)
class RunsRead:
    """Runs of ``run_bytes`` bytes at ``starts`` of the local file ``path``, back to back into ``into``."""

    path: str
    starts: Sequence[int]
    run_bytes: int
    into: memoryview
    where: str = ""  # how errors name it ("/ckpt/__0_0.distcp (tensor 'w')"); the path if empty


@dataclass(frozen=True)
class Region:
    """Bytes ``[start, end)`` of the local file ``path``, to be mapped."""

    path: str
    start: int
    end: int
    where: str = ""


class LocalRuns:
    """The fast path over ``transport``'s :meth:`~.protocol.LocalFileAccess.local_files`, executor and counters."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def read_runs(self, reads: Sequence[RunsRead]) -> None:
        """Fill every ``read.into`` with its runs, one ``preadv`` per run; a short file raises
        :class:`CorruptCheckpointError` naming it. Returns once no read runs any more."""
        files = self._transport.local_files()
        futures: list[Future[None]] = []
        try:
            jobs = []
            for read in reads:
                fd = files.fd(read.path, read.where or None)
                for lo in range(0, len(read.starts), _RUNS_PER_JOB):
                    starts = read.starts[lo : lo + _RUNS_PER_JOB]
                    jobs.append((fd, read.where or read.path, starts, read.run_bytes, read.into, lo))
                self._transport.counters.add(requests=len(read.starts), bytes_read=len(read.starts) * read.run_bytes)
            pool = self._transport.executor()
            futures = [pool.submit(_pread_runs, *job) for job in jobs]
            for future in futures:
                future.result()
        finally:
            wait(futures)  # no job may still read a descriptor closed below
            files.close()

    def map_regions(self, regions: Sequence[Region]) -> Iterator[tuple[mmap.mmap, int]]:
        """Private, never-written maps of each region in turn: ``(map, offset of region.start in it)``.

        Each map is closed when the next is asked for (or, while a view of it is still alive, when that view
        is collected); close the iterator (``contextlib.closing``) to close the last. A file shorter than
        ``region.end`` raises :class:`CorruptCheckpointError`. The caller counts what it copies.
        """
        files = self._transport.local_files()
        try:
            for region in regions:
                fd = files.fd(region.path, region.where or None)
                size = os.fstat(fd).st_size
                if region.end > size:
                    raise CorruptCheckpointError(
                        f"{region.where or region.path}: the data ends at byte {region.end} but the file has "
                        f"{size} (truncated?)"
                    )
                aligned = region.start - region.start % mmap.ALLOCATIONGRANULARITY
                mm = mmap.mmap(fd, region.end - aligned, offset=aligned, access=mmap.ACCESS_COPY)
                try:
                    yield mm, region.start - aligned
                finally:
                    with contextlib.suppress(BufferError):  # a view is still alive: closed when it is collected
                        mm.close()
        finally:
            files.close()


def _pread_runs(fd: int, where: str, starts: Sequence[int], run_bytes: int, view: memoryview, first: int) -> None:
    pread = os.preadv
    pos = first * run_bytes
    for start in starts:
        got = pread(fd, [view[pos : pos + run_bytes]], start)
        if got != run_bytes:
            raise CorruptCheckpointError(
                f"{where}: short read at byte {start} ({got} of {run_bytes} bytes; truncated file?)"
            )
        pos += run_bytes
