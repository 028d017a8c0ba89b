"""Byte-range reads: planning (sort, coalesce, split), running them under a byte budget, and the local strided fast
path.

A blocking budget on bytes in flight, so concurrent reads cannot exhaust memory.

Planning byte-range reads: sort, coalesce near ranges, split large ones.

A checkpoint load asks for many ``(path, start, end)`` ranges. Fetching each one alone costs a request
(a ranged GET, a syscall) per item; fetching whole files wastes bytes when a rank needs only its slice.
:func:`plan_fetches` turns requests into *fetch groups*: one storage request each, covering requests whose
gap is at most ``coalesce_gap`` bytes, never longer than ``max_request_bytes`` unless one request alone is
(then it is split into parts that run concurrently).

Running one ``read_ranges`` call: destination buffers, the in-flight byte budget, completion callbacks.

Shared by every transport (the fsspec transport, and plugins such as dcp-storage-obstore): a transport
plans fetch groups with :func:`~dcp_storage.transports.ranges.plan_fetches` and supplies only ``fetch``, the
function that fills one group's views with its bytes. :class:`RangeRun` does the rest the same way for all
of them: each request's bytes land in ``request.into`` (or a fresh buffer), ``on_complete`` runs once all of
a request's segments have arrived (in the worker thread), no more than ``max_inflight_bytes`` are being
fetched at once, and the first failure stops submitting, waits for the work in flight and is raised.

The local strided-copy fast path: many equal byte runs of a local file, read without request objects.

A ``Shard(1)`` slice of a row-major tensor is one run per row: thousands of small, evenly spaced byte
runs. Through :meth:`~.protocol.Transport.read_ranges` each would be a request object; on a local disk
they are cheaper read directly. :class:`LocalRuns` offers the two ways (the core picks per slice,
:mod:`dcp_storage.formats.reading`): :meth:`~LocalRuns.read_runs`, a tight loop of ``preadv`` calls
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
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dcp_storage.errors import CorruptCheckpointError

__all__ = [
    "ByteBudget",
    "Crc32Pieces",
    "FetchGroup",
    "FetchGroupFn",
    "LocalRuns",
    "RangeRequest",
    "RangeRun",
    "ReadPiecesFn",
    "Region",
    "RunsRead",
    "Segment",
    "plan_fetches",
]


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


@dataclass
class RangeRequest:
    """Read bytes ``[start, end)`` of ``path``.

    ``into``: a writable buffer of exactly ``end - start`` bytes to fill (for example the memory of the
    destination tensor, so the bytes land without an extra copy). Without it the transport allocates one.
    ``on_complete``: called with the filled buffer in a worker thread as soon as this request's bytes are
    all in place; with it, the transport drops its reference afterwards, which keeps memory bounded.
    ``on_piece``: called as ``on_piece(offset, view)`` in the worker thread for each piece of the request's
    bytes as it lands, before ``on_complete``, in file order from one thread (such a request is never split
    into parts): a transport that reads in pieces (local files, ``RangeRun(hot_pieces=...)``) calls it
    after each piece of at most ``hot_pieces`` bytes, while the bytes are still in the CPU's cache; others
    once, with all of it. A transport that does not know it never calls it: ``on_complete`` must not rely
    on it. ``max_gap``: at most this many bytes nobody asked for (which another rank may be reading) are
    fetched to merge it with a neighbour; ``None``: the transport's ``coalesce_gap``.
    """

    path: str
    start: int
    end: int
    into: memoryview | None = None
    on_complete: Callable[[memoryview], None] | None = None
    on_piece: Callable[[int, memoryview], None] | None = None
    max_gap: int | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.end}) for {self.path}")
        if self.into is not None:
            view = memoryview(self.into).cast("B") if memoryview(self.into).format != "B" else memoryview(self.into)
            if view.readonly:
                raise ValueError(f"RangeRequest.into for {self.path} must be writable")
            if view.nbytes != self.end - self.start:
                raise ValueError(
                    f"RangeRequest.into for {self.path} [{self.start}, {self.end}) holds {view.nbytes} bytes, "
                    f"expected {self.end - self.start}"
                )
            self.into = view

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Segment:
    """The part ``[start, end)`` of request ``index`` served by one fetch group."""

    index: int
    start: int
    end: int


@dataclass
class FetchGroup:
    """One storage request: bytes ``[start, end)`` of ``path``, feeding ``segments`` in file order."""

    path: str
    start: int
    end: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start


def _split(index: int, req: RangeRequest, max_request_bytes: int) -> list[Segment]:
    if req.length <= max_request_bytes or req.on_piece is not None:  # pieces in order, from one thread
        return [Segment(index, req.start, req.end)]
    return [
        Segment(index, pos, min(pos + max_request_bytes, req.end))
        for pos in range(req.start, req.end, max_request_bytes)
    ]


def plan_fetches(requests: Sequence[RangeRequest], coalesce_gap: int, max_request_bytes: int) -> list[FetchGroup]:
    """Group ``requests`` into storage requests.

    Ranges of the same path are merged when the gap between them is at most ``coalesce_gap`` and the
    merged request stays within ``max_request_bytes``; overlapping ranges start a new group (a group's
    segments never overlap, so they can be filled by one vectored read). A request with ``on_piece`` is
    never split (its pieces must arrive in order). No request is merged across more than its ``max_gap``.
    """
    if coalesce_gap < 0 or max_request_bytes <= 0:
        raise ValueError("coalesce_gap must be >= 0 and max_request_bytes > 0")
    pieces = [seg for i, req in enumerate(requests) if req.length > 0 for seg in _split(i, req, max_request_bytes)]
    pieces.sort(key=lambda s: (requests[s.index].path, s.start, s.end))
    groups: list[FetchGroup] = []
    for seg in pieces:
        path = requests[seg.index].path
        last = groups[-1] if groups else None
        if (
            last is not None
            and last.path == path
            and last.end <= seg.start
            and seg.start - last.end <= coalesce_gap
            and (seg.start == last.end or _bridges(requests, last, seg))
            and seg.end - last.start <= max_request_bytes
        ):
            last.segments.append(seg)
            last.end = seg.end
        else:
            groups.append(FetchGroup(path, seg.start, seg.end, [seg]))
    return groups


def _bridges(requests: Sequence[RangeRequest], group: FetchGroup, seg: Segment) -> bool:
    """Whether ``seg`` may be merged into ``group`` across the gap between them: within both requests' ``max_gap``."""
    gap = seg.start - group.end
    mine, theirs = requests[seg.index].max_gap, requests[group.segments[-1].index].max_gap
    return (mine is None or gap <= mine) and (theirs is None or gap <= theirs)


# Fill ``views`` (one per segment of the group, in order) with the group's bytes.
FetchGroupFn = Callable[[FetchGroup, list[memoryview]], None]

# ``read_pieces(path, offset, view, piece_bytes, on_piece)``: fill ``view`` with the bytes of ``path`` from
# ``offset`` in pieces of ``piece_bytes``, calling ``on_piece(piece_offset, piece_view)`` after each one, before the
# next is read (and count the reads): a transport whose reads cost no request (local files), in one call per segment.
ReadPiecesFn = Callable[[str, int, memoryview, int, Callable[[int, memoryview], None]], None]


@runtime_checkable
class Crc32Pieces(Protocol):
    """An ``on_piece`` that only checks zip's CRC-32 of consecutive blocks of its request's bytes.

    A transport that reads and hashes in one native loop (local files:
    :func:`~dcp_storage.transports.local_io.pread_crc32`) asks :meth:`crc32_blocks` for the block layout of
    the bytes it is about to read and hands the CRC-32s to :meth:`crc32_digested` instead of calling it
    piece by piece: no Python call per piece. Any other transport just calls it.
    """

    def __call__(self, offset: int, view: memoryview) -> None: ...

    def crc32_blocks(self, offset: int, nbytes: int) -> tuple[int, int] | None:
        """``(first, block)``: the blocks of ``[offset, offset + nbytes)`` are its first ``first`` bytes, then every
        ``block`` bytes, the last one ending with it; ``None``: call it with the pieces instead."""

    def crc32_digested(self, offset: int, nbytes: int, crcs: Sequence[int]) -> None:
        """The CRC-32 of each of those blocks, in order, all of ``[offset, offset + nbytes)`` read."""


class RangeRun:
    """One ``read_ranges`` call. Build it, call :meth:`execute` once; not reusable."""

    def __init__(
        self,
        requests: Sequence[RangeRequest],
        groups: list[FetchGroup],
        fetch: FetchGroupFn,
        pool: Executor,
        max_inflight_bytes: int,
        hot_pieces: int = 0,
        read_pieces: ReadPiecesFn | None = None,
    ) -> None:
        """``hot_pieces``: when positive, a group feeding requests with ``on_complete`` or ``on_piece`` is
        fetched in pieces of about this many bytes (requests with ``on_piece`` cut inside, every ``hot_pieces``
        bytes), each piece handed to ``on_piece`` and its finished requests completed before the next piece is
        read, so a check there hashes bytes still in the CPU's cache. Only for a transport where a fetch costs
        no request (local files: a ``preadv`` per piece); an object store keeps one GET. ``read_pieces``: how a
        segment with ``on_piece`` is read (:data:`ReadPiecesFn`; else by ``fetch`` of a group per piece)."""
        self.hot_pieces = hot_pieces
        self.read_pieces = read_pieces
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
            requests = self.requests
            if self.hot_pieces > 0 and any(
                requests[s.index].on_complete is not None or requests[s.index].on_piece is not None
                for s in group.segments
            ):
                self._run_hot(group, views)
            else:
                self.fetch(group, views)
                self._landed(group.segments, views)
        except BaseException:
            self.failed.set()
            raise
        finally:
            self.budget.release(group.length)

    def _landed(self, segments: list[Segment], views: list[memoryview]) -> None:
        """``segments`` are in their views: hand each to its request's ``on_piece``, then complete it."""
        for seg, view in zip(segments, views):
            on_piece = self.requests[seg.index].on_piece
            if on_piece is not None:
                on_piece(seg.start, view)
            self._segment_done(seg.index)

    def _run_hot(self, group: FetchGroup, views: list[memoryview]) -> None:
        """``group`` in pieces of at most :attr:`hot_pieces` bytes, each handed over before the next is read: a
        segment with ``on_piece`` every ``hot_pieces`` bytes from its start (by :attr:`read_pieces` when given),
        the others whole, together up to ``hot_pieces`` bytes."""
        hot, requests, read = self.hot_pieces, self.requests, self.read_pieces
        batch: list[Segment] = []
        batch_views: list[memoryview] = []

        def flush() -> None:
            if batch:
                self.fetch(FetchGroup(group.path, batch[0].start, batch[-1].end, batch[:]), batch_views[:])
                self._landed(batch, batch_views)
                batch.clear()
                batch_views.clear()

        for seg, view in zip(group.segments, views):
            on_piece = requests[seg.index].on_piece
            if on_piece is None:
                if batch and seg.end - batch[0].start > hot:
                    flush()
                batch.append(seg)
                batch_views.append(view)
                continue
            flush()
            if read is not None:
                read(group.path, seg.start, view, hot, on_piece)
            else:
                for pos in range(seg.start, seg.end, hot):
                    end = min(pos + hot, seg.end)
                    part = view[pos - seg.start : end - seg.start]
                    self.fetch(FetchGroup(group.path, pos, end, [Segment(seg.index, pos, end)]), [part])
                    on_piece(pos, part)
            self._segment_done(seg.index)
        flush()

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
