"""The :class:`Transport` protocol: everything the core asks of a transport, and nothing more.

Formats, strategies, storage classes and tools name this protocol, never a concrete transport; the
factory (:func:`~dcp_storage.transports.factory.open_transport`) picks the implementation (the built-in
fsspec one, or a plugin registered under ``dcp_storage.transports``). A plugin transport implements these
members, plus a ``from_url(url, storage_options, config) -> (transport, path)`` class method for the
factory; :mod:`dcp_storage.testing.conformance` checks that it keeps the contract.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from dcp_storage.transports.config import TransportConfig
from dcp_storage.transports.counters import TransportCounters
from dcp_storage.transports.local_io import LocalFiles
from dcp_storage.transports.local_runs import Region, RunsRead
from dcp_storage.transports.ranges import RangeRequest
from dcp_storage.transports.s3_pending import PendingUpload

__all__ = ["AtomicWriter", "LocalFileAccess", "LocalRunReads", "MultipartUploads", "Transport"]


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

    **Create-if-absent (optional).** ``create_new(path, data: bytes) -> bool`` writes the small file ``path``
    only if nothing is there, atomically, and returns whether this call created it: of two concurrent
    callers exactly one gets ``True``. Writers take a save's lock (``.dcp_storage.lock``) with it, so that of
    two saves racing to one location one wins and the other raises ``CheckpointExistsError``. Use the store's
    own primitive (``O_CREAT | O_EXCL``, S3 ``If-None-Match: *``, a GCS generation-0 precondition, ...); a
    request retried after a lost response finds its own object, so answer "exists" by comparing the stored
    bytes with ``data`` (:func:`~dcp_storage.transports.exclusive.holds`, exported by the plugin API). A
    transport without it still works: the lock is then checked, then written, with a warning.

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
        the buffer, on an executor thread). Raises the first failure once no request runs any more.
        """
        ...

    # ------------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically write a whole small file (metadata, commit markers)."""
        ...

    def open_atomic(self, path: str) -> AbstractContextManager[AtomicWriter]:
        """A writer for ``path`` whose bytes appear whole when the block exits, and never on an exception."""
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
    strided-copy fast path (:mod:`dcp_storage.formats.tensor_reads`). Optional: other transports lack it."""

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
class MultipartUploads(Protocol):
    """What a store with multipart uploads adds (optional): the uploads a killed writer left behind.

    ``verify`` lists them and ``verify --cleanup`` aborts the stale ones
    (:mod:`dcp_storage.inspection.uploads`); a transport without it has none to list.
    """

    def pending_uploads(self, path: str) -> list[PendingUpload]:
        """Every in-progress multipart upload of ``path`` or of an object under ``path/``."""
        ...

    def abort_upload(self, path: str, upload: PendingUpload) -> bool:
        """Abort ``upload`` (found under ``path``); ``False`` if it is gone meanwhile."""
        ...
