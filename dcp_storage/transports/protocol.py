"""The :class:`Transport` protocol, its config, and the small pieces every transport shares (client identity,
counters, pool, writers).

Which store client a transport talks through, for caches of what a store was seen to do.

A fact learnt about a store (for example, that it honours ``If-None-Match``, see
:mod:`dcp_storage.formats.commit_holder`) holds for every transport sharing one client. Only this layer knows
where a transport keeps its client; callers above get an opaque, weakly referenceable key.

The tuning knobs every transport takes: :class:`TransportConfig`.

Kept apart from any one transport so that the :class:`~dcp_storage.transports.protocol.Transport` protocol,
plugins and the core name it without importing the fsspec transport.

The thread pool a transport runs its storage requests on: made on first use, shut down by ``close``.

Every transport (the core's fsspec one, the obstore plugin's) needs the same thing: one pool per
transport, created lazily (a transport that only lists files starts no threads), safe to request from
several threads, and shut down once, after the requests running on it finish.

Thread-safe I/O counters that benchmarks and the demo print.

The writers an fsspec transport's :meth:`~.protocol.Transport.open_atomic` yields, and giving one up.

The :class:`Transport` protocol: everything the core asks of a transport, and nothing more.

Formats, strategies, storage classes and tools name this protocol, never a concrete transport; the
factory (:func:`~dcp_storage.transports.open_transport`) picks the implementation (the built-in
fsspec one, or a plugin registered under ``dcp_storage.transports``). A plugin transport implements these
members, plus a ``from_url(url, storage_options, config) -> (transport, path)`` class method for the
factory; :mod:`dcp_storage_testing.conformance` checks that it keeps the contract. A plugin subclassing
:class:`~dcp_storage.transports.base.BaseTransport` implements six store primitives and gets the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import IO, Any, Protocol, runtime_checkable

from dcp_storage.runtime import fork_safe
from dcp_storage.transports.local_io import LocalFiles
from dcp_storage.transports.ranges import RangeRequest, Region, RunsRead
from dcp_storage.transports.retry import RetryPolicy
from dcp_storage.transports.s3_upload import PendingUpload

__all__ = [
    "AtomicWriter",
    "ClientSetUp",
    "CountingWriter",
    "LocalFileAccess",
    "LocalRunReads",
    "MultipartUploads",
    "Transport",
    "TransportConfig",
    "TransportCounters",
    "WorkerPool",
    "abandon",
    "client_identity",
    "local_workers",
    "resolve_config",
]


def client_identity(transport: Any) -> Any:
    """The client object behind ``transport`` (an fsspec filesystem for fsspec-based transports), else the
    transport itself: two transports with one key talk to one store through one client."""
    return getattr(transport, "fs", None) or transport


MiB = 1024 * 1024


@dataclass(frozen=True)
class TransportConfig:
    """Tuning knobs; the defaults suit a local disk and an object store alike.

    ``max_workers``: concurrent storage requests. ``max_inflight_bytes``: bytes of requests running at
    once. ``coalesce_gap``: ranges of one file closer than this are fetched by one request (the gap bytes
    are read and dropped). ``max_request_bytes``: larger ranges are split into parts fetched concurrently.
    ``part_size``: multipart upload part size for object-store writes, and the size of the objects a save
    packs a rank's small items into. 16 MiB (AWS suggests 8-16 MB parts): one connection to a store carries
    tens of MB/s, so a save's speed comes from requests in flight, and at 16 MiB the writer (which counts
    each part three times: its buffer and the HTTP stack's copies) keeps ten in flight within the default
    512 MiB budget, against two at 64 MiB. S3 uploads double the size every 1,000 parts, so objects up to
    S3's 5 TiB limit still fit its 10,000 parts (:mod:`.s3_upload`). ``None`` picks per filesystem:
    a local disk gets one worker per core and a 4 KiB gap (a syscall is cheap, extra bytes are not), an
    object store 16 workers and a 256 KiB gap (a request costs a round trip).
    """

    max_workers: int | None = None
    max_inflight_bytes: int = 512 * MiB
    coalesce_gap: int | None = None
    max_request_bytes: int = 32 * MiB
    part_size: int = 16 * MiB
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"TransportConfig.max_workers must be >= 1, got {self.max_workers}")
        if self.max_inflight_bytes < 1 or self.max_request_bytes < 1:
            raise ValueError("TransportConfig byte limits must be >= 1")
        if self.coalesce_gap is not None and self.coalesce_gap < 0:
            raise ValueError(f"TransportConfig.coalesce_gap must be >= 0, got {self.coalesce_gap}")
        if not 5 * MiB <= self.part_size <= 5 * 1024 * MiB:
            raise ValueError(
                f"TransportConfig.part_size must be between 5 MiB and 5 GiB (S3's smallest and largest part), "
                f"got {self.part_size}"
            )


def resolve_config(config: TransportConfig, is_local: bool) -> TransportConfig:
    """Fill the ``None`` (auto) fields of ``config`` for a local or a remote filesystem."""
    workers = config.max_workers or (local_workers() if is_local else 16)
    gap = config.coalesce_gap if config.coalesce_gap is not None else (4096 if is_local else 256 * 1024)
    return dataclasses.replace(config, max_workers=workers, coalesce_gap=gap)


class WorkerPool:
    """A lazily created ``ThreadPoolExecutor`` of ``max_workers`` threads named ``<prefix>_N``.

    In a forked child (a ``DataLoader`` worker of a process that had read through the transport) the parent's
    pool is not used: its threads are not there, yet the executor counts them as idle and starts none, so
    every request waited forever. The child makes a pool (and a lock) of its own on first use."""

    def __init__(self, max_workers: int | None, prefix: str) -> None:
        self._max_workers = max_workers
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def get(self) -> ThreadPoolExecutor:
        """The pool, created on the first call (again after :meth:`shutdown`, and in a forked child)."""
        self._leave_the_parents()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix=self._prefix)
            return self._pool

    def shutdown(self) -> None:
        """Wait for running requests, then stop the threads. Idempotent."""
        self._leave_the_parents()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _leave_the_parents(self) -> None:
        """In a forked child: forget the parent's pool (none of its threads is here, and it is not this
        process's to stop) and its lock (a thread the fork left behind may have held it)."""
        if self._pid != os.getpid():
            self._lock, self._pool, self._pid = threading.Lock(), None, os.getpid()


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
    _lock: threading.Lock = field(default_factory=lambda: fork_safe(threading.Lock()), repr=False, compare=False)

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


class CountingWriter:
    """File wrapper that counts bytes written (and forwards everything else)."""

    def __init__(self, raw: IO[bytes], counters: TransportCounters) -> None:
        self._raw = raw
        self._counters = counters
        self.written = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes  # fsspec files return len(data): elements, not bytes, for typed views
        self._raw.write(data)
        self.written += n
        self._counters.add(bytes_written=n)
        return n

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True


def abandon(raw: Any) -> None:
    """Give up an object-store upload: abort it, and keep its finalizer from committing it.

    ``discard`` aborts a multipart upload; marking the file closed stops ``__del__`` from flushing the
    buffer (s3fs's would raise on the discarded buffer; other filesystems would commit a partial file).
    """
    discard = getattr(raw, "discard", None)
    if callable(discard):
        with contextlib.suppress(Exception):
            discard()
    with contextlib.suppress(Exception):
        raw.closed = True


@runtime_checkable
class AtomicWriter(Protocol):
    """The file object :meth:`Transport.open_atomic` yields: sequential writes, nothing visible until commit."""

    def write(self, data: Any) -> int: ...

    def tell(self) -> int: ...

    def flush(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Bytes-only access to one store (a local disk, a bucket, ...): concurrent, retried, atomic.

    **Paths.** Methods take paths of the store (what ``from_url`` or :meth:`strip_url` return for a URL),
    built with :meth:`join`, never URLs; :meth:`url` turns one back into a URL for messages.

    **Who calls what.** Every rank opens its own transport (through the factory) for the checkpoint it
    reads or writes, and calls any method: on load, each rank (or, under a broadcasting strategy, the
    coordinator only) calls :meth:`read_file` for per-load files and :meth:`read_ranges` for its slices; on
    save, each rank writes its own data files through :meth:`open_atomic`, and the coordinator writes the
    commit marker last (:meth:`write_file`). Tools (``inspect``, ``verify``, ``convert``, ``merge``) run
    in one process and use the same methods.

    **Threads.** Every method may be called from several threads at once. ``read_ranges`` runs its
    requests on :meth:`executor`'s threads and calls each request's ``on_complete`` there; the core also
    submits its own CPU-bound work (decoding, strided local copies) to that executor. :meth:`close`
    waits for running requests, then stops the threads; a closed transport is not used again.

    **Errors.** Only the project's hierarchy (:mod:`dcp_storage.errors`): a missing file raises
    :class:`~dcp_storage.errors.CheckpointNotFoundError`, a file that ends before a requested range or is
    larger than ``max_bytes`` :class:`~dcp_storage.errors.CorruptCheckpointError` (``FileTooLargeError``),
    a store that keeps failing after the retries of ``config.retry``
    :class:`~dcp_storage.errors.TransportError`; every message names the URL. Transient errors are retried
    under ``config.retry`` and counted in ``counters.retries``.

    **Atomicity.** A file written by :meth:`write_file` or :meth:`open_atomic` appears whole or not at
    all: on an exception inside the ``with`` block nothing becomes visible.

    **Create-if-absent.** :meth:`create_new` takes a save's lock (``.dcp_storage.lock``), so that of two saves
    racing to one location one wins and the other raises ``CheckpointExistsError``. A store that has no such
    primitive raises ``NotImplementedError`` from it: the lock is then checked, then written, with a warning.

    **Pickling.** A writer pickles for ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` and a rank
    pickles its reader for multi-process tools, so a transport passed to them (``transport=``) must pickle
    too: without threads, clients, sockets or locks (drop them in ``__getstate__``; :class:`~.worker_pool.WorkerPool`
    pickles empty), keeping the URL, ``config`` and ``counters``, and building its client again on first use
    in the receiving process. ``tests/storage/test_async_save.py`` and the conformance suite check it.
    """

    is_local: bool
    """Whether paths are local file-system paths (which enables the core's ``mmap``/``preadv`` fast paths)."""
    config: TransportConfig
    """The resolved tuning knobs (``None`` fields filled for this store)."""
    counters: TransportCounters
    """Requests, bytes and retries made so far."""

    # ------------------------------------------------------------------------------------------ names
    def url(self, path: str) -> str:
        """A URL for ``path``, for messages."""
        ...

    def strip_url(self, url: str) -> str:
        """The path on this transport of ``url`` (a path without a scheme is returned as is)."""
        ...

    def join(self, root: str, *names: str) -> str:
        """``root`` joined with ``names``, in this store's path syntax."""
        ...

    # ------------------------------------------------------------------------------------------ queries
    def exists(self, path: str) -> bool:
        """Whether a file (or, on object stores, any object under the prefix ``path/``) exists."""
        ...

    def size(self, path: str) -> int:
        """Size in bytes of the file at ``path``; ``CheckpointNotFoundError`` if there is none."""
        ...

    def listdir(self, path: str) -> list[str]:
        """Sorted names (not paths) of the entries directly under ``path``; empty if there are none."""
        ...

    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` and its parents (a no-op on object stores)."""
        ...

    def remove(self, path: str) -> None:
        """Delete one file, if it exists."""
        ...

    def remove_tree(self, path: str) -> None:
        """Delete every file under ``path`` (a whole checkpoint); nothing if there is none."""
        ...

    # ------------------------------------------------------------------------------------------ reading
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """A whole (small) file; one over ``max_bytes`` raises ``FileTooLargeError`` after reading at most
        ``max_bytes + 1`` bytes of it."""
        ...

    def read_range(self, path: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of one file."""
        ...

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[memoryview | None]:
        """Every request, concurrently, coalesced, within ``config.max_inflight_bytes``.

        Returns, per request, its filled buffer, or ``None`` for a request with ``on_complete`` (which got
        the buffer, on an executor thread). Raises the first failure once no request runs any more. A
        request's ``on_piece`` (its bytes as they land, in order) is optional to honour: :class:`RangeRun`
        does; a transport that ignores it only loses the early look (``on_complete`` must not rely on it).
        """
        ...

    # ------------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically write a whole small file (metadata, commit markers)."""
        ...

    def open_atomic(self, path: str) -> AbstractContextManager[AtomicWriter]:
        """A writer for ``path`` whose bytes appear whole when the block exits, and never on an exception."""
        ...

    def create_new(self, path: str, data: bytes) -> bool:
        """Write the small file ``path`` only if nothing is there, atomically: ``True`` if this call created it.

        Of two concurrent callers exactly one gets ``True``. Use the store's own primitive (``O_CREAT |
        O_EXCL``, S3 ``If-None-Match: *``, a GCS generation-0 precondition, ...); a request retried after a lost
        response finds its own object, so answer "exists" by comparing the stored bytes with ``data``
        (:func:`~dcp_storage.transports.base.holds`, exported by the plugin API). Not in ``bytes_written``
        (a lock is removed when its save commits). ``NotImplementedError`` where the store cannot (see above).
        """
        ...

    # ------------------------------------------------------------------------------------------ resources
    def executor(self) -> Executor:
        """The transport's worker threads (made on first use), for work that runs beside its requests."""
        ...

    def reconfigured(self, config: TransportConfig) -> Transport:
        """A transport on the same store and counters with another ``config``; close it after use."""
        ...

    def close(self) -> None:
        """Wait for running requests, then release threads and clients. Idempotent."""
        ...

    def __enter__(self) -> Transport: ...  # noqa: PYI034 - Self needs Python 3.11

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class LocalFileAccess(Protocol):
    """What a local transport (``is_local``) adds: positioned reads and maps of its files, for the core's
    strided-copy fast path (:mod:`dcp_storage.formats.reading`). Optional: other transports lack it."""

    def local_files(self) -> LocalFiles:
        """Read-only descriptors of the checkpoint's regular files, opened on first use; ``close()`` them."""
        ...


@runtime_checkable
class LocalRunReads(Protocol):
    """The local strided-copy fast path as a transport's own methods (optional; :mod:`.local_runs`).

    A ``Shard(1)`` slice of a local file is thousands of equal byte runs; the core reads them with these
    instead of one range request each. A transport with only :class:`LocalFileAccess` gets the same path
    from :class:`~.local_runs.LocalRuns` over its ``local_files()``.
    """

    def read_runs(self, reads: Sequence[RunsRead]) -> None:
        """Fill each ``read.into`` with its runs (one ``preadv`` per run, on :meth:`Transport.executor`)."""
        ...

    def map_regions(self, regions: Sequence[Region]) -> Iterator[tuple[mmap.mmap, int]]:
        """Private read-only maps of each region in turn: ``(map, offset of region.start in it)``."""
        ...


@runtime_checkable
class ClientSetUp(Protocol):
    """What a store whose first request builds a client adds (optional): building it ahead.

    An S3 client loads botocore's service model and endpoint rules (70 ms of CPU alone, 200 ms with two ranks
    doing it at once on two cores). A rank that waits for another's ``.metadata`` builds its own meanwhile
    instead of at its first data request.
    """

    def set_up_client(self) -> None:
        """Build the client now, if it is not built yet (no request is sent); never raises: a client that
        cannot be built is reported by the first request."""
        ...


@runtime_checkable
class ListedSizes(Protocol):
    """What a store that lists files with their sizes adds (optional): many sizes from one listing.

    ``describe`` shows every data file's size; a checkpoint of a million data files (one per tensor) would
    otherwise cost a million :meth:`Transport.size` calls. Each size given must be what ``size`` would
    answer, with the same checks passed; an entry the listing cannot vouch for maps to ``None`` (the caller
    asks ``size`` for it).
    """

    def listed_sizes(self, path: str) -> dict[str, int | None]:
        """``{name: size or None}`` of every entry directly under ``path`` (hidden temp files too), from one
        listing; empty if there are none or the listing failed (the caller then lists and asks as usual)."""
        ...


@runtime_checkable
class MultipartUploads(Protocol):
    """What a store with multipart uploads adds (optional): the uploads a killed writer left behind.

    ``verify`` lists them and ``verify --cleanup`` aborts the stale ones
    (:mod:`dcp_storage.inspection.checks`); a transport without it has none to list.
    """

    def pending_uploads(self, path: str) -> list[PendingUpload]:
        """Every in-progress multipart upload of ``path`` or of an object under ``path/``."""
        ...

    def abort_upload(self, path: str, upload: PendingUpload) -> bool:
        """Abort ``upload`` (found under ``path``); ``False`` if it is gone meanwhile."""
        ...


def local_workers() -> int:
    """Threads for local requests: the CPUs this process may use, shared by the ranks of its host
    (``LOCAL_WORLD_SIZE``, as torchrun sets it), at least one; a process alone gets at least two.

    Local reads are copies out of the page cache, bound by CPU: more threads than cores only contend. Two
    ranks on two cores loading a 2 GiB safetensors checkpoint (``Shard(0)``), one run of 7 rounds: 6.5 GB/s
    best with two threads each, 7.3 with one (medians 6.1 and 5.7: within that machine's noise).
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    try:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        ranks = 1
    return max(1, cpus // ranks) if ranks > 1 else max(2, cpus)
