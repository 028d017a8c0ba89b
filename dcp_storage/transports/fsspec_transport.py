"""The fsspec transports' common base, and the registry of which built-in class serves which filesystem.

Which built-in transport class serves a filesystem: the registry of fsspec backends.

Each backend module (:mod:`.local_transport`, :mod:`.s3_transport`, ...) registers its class with
:func:`builtin_backend`; importing :mod:`dcp_storage.transports` loads them all. A class serves the
filesystems its ``serves(fs)`` accepts; a filesystem no backend serves gets
:class:`~.fsspec_transport.FsspecTransport`, the common base, which works through plain fsspec calls.

The fsspec transports' common base, which is also the transport of any fsspec filesystem without its own.

Transports know nothing about tensors: formats ask them for byte ranges and atomic file writes. Over an
fsspec filesystem they add what fsspec lacks for checkpoints: concurrent ranged reads with coalescing of
near ranges and a cap on bytes in flight; retries with backoff and jitter on transient errors (5xx,
throttling, resets, truncation); atomic commits (a local temp file, ``fsync`` and ``rename``; on an object
store one PUT or a completed multipart upload, aborted on failure); counters of requests, bytes, retries.

:class:`FsspecTransport` holds what every store shares (configuration, counters, worker threads, retries,
the range runner, atomic-write bookkeeping) and reaches the store through one-call hooks (``_exists``,
``_size``, ``_read_whole``, ``_read_range``, ``_put``, ...) made of plain fsspec calls. Each store with
calls of its own subclasses it in its own module: local disk (:mod:`.local_transport`), S3
(:mod:`.s3_transport`), GCS (:mod:`.gcs_transport`), Azure (:mod:`.azure_transport`), HTTP
(:mod:`.http_transport`). :func:`transport_class_for` picks the class serving the filesystem a URL's scheme
resolves to, for :meth:`FsspecTransport.from_url` (which the factory calls) and for ``FsspecTransport(fs)``
(:mod:`.backends`): code written against the single class of earlier versions, subclasses included,
still gets each store's behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import posixpath
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from dcp_storage.errors import CheckpointNotFoundError, DcpStorageError, FileTooLargeError
from dcp_storage.runtime import fork_safe
from dcp_storage.transports.access import access_errors
from dcp_storage.transports.base import holds
from dcp_storage.transports.guards import (
    PinnedReads,
    RangeMismatchError,
    VersionPins,
    http_redirect_options,
    raise_if_short,
)
from dcp_storage.transports.local_io import Confinement
from dcp_storage.transports.protocol import (
    CountingWriter,
    TransportConfig,
    TransportCounters,
    WorkerPool,
    abandon,
    resolve_config,
)
from dcp_storage.transports.ranges import FetchGroup, RangeRequest, RangeRun, plan_fetches
from dcp_storage.transports.retry import TruncatedReadError, bounded_call, call_with_retry, single_layer_client_options

__all__ = [
    "FsspecTransport",
    "TransportConfig",
    "backend_for",
    "builtin_backend",
    "class_to_build",
    "restore",
    "transport_class_for",
]


# Classes are typed ``type`` here: this module imports nothing of the base (which imports it).
_BACKENDS: list[type] = []
_T = TypeVar("_T", bound=type)
_MEMORY_LOCK = fork_safe(threading.Lock())  # conditional writes to memory:// (process-wide, as its store is)


def builtin_backend(cls: _T) -> _T:
    """Register ``cls`` as the transport of the filesystems its ``serves(fs)`` accepts."""
    _BACKENDS.append(cls)
    return cls


def backend_for(fs: Any) -> Any:
    """The registered class serving ``fs``; ``None`` if none does (the base class serves it)."""
    return next((cls for cls in _BACKENDS if cls.serves(fs)), None)


def class_to_build(cls: type, fs: Any, base: type) -> type:
    """The class ``cls(fs, ...)`` builds: the backend serving ``fs`` for ``base`` itself; a backend class (or a
    subclass of one) as named; any other subclass of ``base`` combined with the backend (its methods first)."""
    backend = backend_for(fs) or base
    if cls is base:
        return backend
    if issubclass(cls, (backend, *_BACKENDS)):
        return cls
    return _combined(cls, backend)


@functools.cache
def _combined(declared: type, backend: type) -> type:
    """``declared`` on ``backend``; pickled as ``declared`` (see ``FsspecTransport.__reduce__``)."""
    namespace = {"__module__": declared.__module__, "__qualname__": declared.__qualname__, "_declared": declared}
    return type(declared.__name__, (declared, backend), namespace)


def restore(cls: type, state: dict[str, Any]) -> Any:
    """Unpickle a transport of class ``cls`` (its ``__reduce__``): built for ``state["fs"]``, then its state."""
    transport = cls.__new__(cls, state["fs"])  # type: ignore[call-arg]
    transport.__setstate__(state)
    return transport


def transport_class_for(fs: fsspec.AbstractFileSystem) -> type[FsspecTransport]:
    """The built-in transport class serving ``fs``: its backend's, or :class:`FsspecTransport` for any other."""
    return backend_for(fs) or FsspecTransport


class FsspecTransport(PinnedReads):
    """Bytes-only access to one fsspec filesystem (the :class:`~.protocol.Transport` protocol).

    Build it with :meth:`from_url` (through :func:`~dcp_storage.transports.open_transport`). Paths passed to its methods
    are paths of that filesystem (what ``fsspec.core.url_to_fs`` returns), joined with :meth:`join`.
    """

    is_local = False

    @staticmethod
    def serves(fs: fsspec.AbstractFileSystem) -> bool:
        """Whether this class is the transport for ``fs`` (each backend says; the base serves any)."""
        return True

    def __new__(cls, fs: fsspec.AbstractFileSystem | None = None, *args: Any, **kwargs: Any) -> FsspecTransport:
        """``FsspecTransport(fs)`` builds the backend class serving ``fs``; a subclass written outside this
        package is combined with that backend (its own methods win); a backend class is built as named."""
        return super().__new__(cls if fs is None else class_to_build(cls, fs, FsspecTransport))

    def __init__(
        self, fs: fsspec.AbstractFileSystem, config: TransportConfig | None = None, *, scheme: str | None = None,
        confinement: Confinement | None = None,
    ) -> None:  # fmt: skip
        self.fs = fs
        self.confinement = confinement if self.is_local else None
        # The scheme the caller wrote, if ``fs`` answers to several (adlfs: abfs, az, abfss), so that errors
        # name the URL the user gave (``az://...``), not the filesystem's first alias.
        aliases = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._scheme = scheme if scheme in aliases else None
        self.config = resolve_config(config or TransportConfig(), self.is_local)
        self.counters = TransportCounters()
        self.versions = VersionPins()  # the version of each object this load saw first (see .versions)
        self._workers = WorkerPool(self.config.max_workers, "dcp-storage-io")

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its thread pool (started again on first use); ``fs`` pickles as fsspec's
        constructor arguments, so the receiving process builds its own client and session."""
        state = self.__dict__.copy()
        del state["_workers"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._workers = WorkerPool(self.config.max_workers, "dcp-storage-io")

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt by class (a combined class by the subclass it was made for), then :meth:`__setstate__`."""
        return restore, (vars(type(self)).get("_declared", type(self)), self.__getstate__())

    # ----------------------------------------------------------------------------------------- building
    @classmethod
    def from_url(
        cls,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        config: TransportConfig | None = None,
    ) -> tuple[FsspecTransport, str]:
        """Return the transport for ``url`` and the path of ``url`` on its filesystem.

        For object stores whose client retries on its own, the client is set to one attempt per call
        unless ``storage_options`` configure its retries (see :mod:`dcp_storage.transports.retry`).
        """
        url = os.fspath(url)
        options = http_redirect_options(url, single_layer_client_options(url, storage_options or {}))
        fs, path = fsspec.core.url_to_fs(url, **options)
        scheme = url.split("://", 1)[0].lower() if "://" in url else None
        return cls(fs, config, scheme=scheme, confinement=Confinement(path)), path

    @property
    def protocol(self) -> str:
        proto = self.fs.protocol
        return proto[0] if isinstance(proto, (tuple, list)) else proto

    def url(self, path: str) -> str:
        """A human-readable URL for error messages."""
        url = self.fs.unstrip_protocol(path)
        if self._scheme is not None and "://" in url:
            url = f"{self._scheme}://{url.split('://', 1)[1]}"
        return url

    def join(self, root: str, *names: str) -> str:
        return posixpath.join(root.rstrip("/"), *names)

    def close(self) -> None:
        self._workers.shutdown()

    def __enter__(self) -> FsspecTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def parts_in_flight(self) -> int:
        """Multipart parts one upload keeps in flight: a quarter of the in-flight budget (at least one), so a
        few files can upload at once within it; memory per upload: :func:`~.s3_upload.upload_memory`."""
        return max(1, min(8, self.config.max_inflight_bytes // self.config.part_size // 4))

    def executor(self) -> ThreadPoolExecutor:
        """The worker threads requests run on (made on first use; see :class:`.protocol.Transport`)."""
        return self._workers.get()

    def strip_url(self, url: str) -> str:
        """The path of ``url`` on this transport's filesystem."""
        return self.fs._strip_protocol(os.fspath(url))

    def reconfigured(self, config: TransportConfig) -> FsspecTransport:
        """A transport of the same class on the same filesystem, confinement and counters, with ``config``."""
        other = type(self)(self.fs, config, scheme=self._scheme, confinement=self.confinement)
        other.counters = self.counters
        other.versions = self.versions  # the same load: the same pins
        return other

    def _retry(self, fn: Callable[[], Any], describe: Callable[[], str]) -> Any:
        with access_errors(describe):  # credential and permission failures: StorageAccessError naming the call
            return call_with_retry(fn, self.config.retry, describe, on_retry=lambda _e: self.counters.add(retries=1))

    def _runner(self, path: str) -> Any:
        """``runner(fn, what)`` for the upload helpers: ``fn`` retried, errors naming ``what`` and the URL."""
        return lambda fn, what: self._retry(fn, lambda: f"{what} {self.url(path)}")

    # ------------------------------------------------------------------ one-call hooks (one attempt each)
    def _exists(self, path: str) -> bool:
        return bool(bounded_call(self.fs, "exists", path))

    def _size(self, path: str) -> int:
        return int(bounded_call(self.fs, "size", path))

    def _delete(self, path: str) -> None:
        bounded_call(self.fs, "rm_file", path)

    def _list_names(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            entries = list(bounded_call(self.fs, "ls", path, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []
        if len(entries) == 1 and entries[0].rstrip("/") == path.rstrip("/"):
            return []  # fsspec lists a file as itself
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        """A whole file; with ``max_bytes`` the size comes first (nothing is read of a larger file), then at most
        ``max_bytes + 1`` bytes: up to the limit, not the size seen, which a cached listing may have made stale
        (a file that grew comes back whole, or past the limit and refused, never cut to its old size)."""
        if max_bytes is None:
            return bytes(bounded_call(self.fs, "cat_file", path))
        # None: a store that does not say (an HTTP server without Content-Length)
        size = bounded_call(self.fs, "size", path)
        if size is not None and int(size) > max_bytes:
            raise FileTooLargeError(self.url(path), int(size), max_bytes)
        return bytes(bounded_call(self.fs, "cat_file", path, start=0, end=max_bytes + 1))

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; the caller checks the length (backends also check status and headers)."""
        return bytes(bounded_call(self.fs, "cat_file", path, start=start, end=end))

    def _put(self, path: str, data: bytes, nbytes: int) -> None:
        bounded_call(self.fs, "pipe_file", path, data)

    def _put_if_absent(self, path: str, data: bytes) -> None:
        """One conditional write; ``FileExistsError`` if an object is at ``path`` (see :mod:`.exclusive`)."""
        if isinstance(self.fs, MemoryFileSystem):
            with _MEMORY_LOCK:  # memory:// looks, then creates: one such write at a time in the process
                self.fs.pipe_file(path, data, mode="create")
        else:
            bounded_call(self.fs, "pipe_file", path, data, mode="create")

    # ------------------------------------------------------------------------------------ queries
    def exists(self, path: str) -> bool:
        return bool(self._retry(lambda: self._exists(path), lambda: f"exists {self.url(path)}"))

    def size(self, path: str) -> int:
        """Size of the file at ``path``; :class:`CheckpointNotFoundError` if it does not exist."""
        try:
            return int(self._retry(lambda: self._pinned_size(path), lambda: f"size of {self.url(path)}"))
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.url(path)}: no such file") from exc

    def makedirs(self, path: str) -> None:
        self._retry(
            lambda: bounded_call(self.fs, "makedirs", path, exist_ok=True), lambda: f"makedirs {self.url(path)}"
        )

    def remove(self, path: str) -> None:
        """Delete one file if it exists."""
        self.versions.forget(path)
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self._delete(path), lambda: f"delete {self.url(path)}")

    def remove_tree(self, path: str) -> None:
        """Delete every file under ``path``; nothing if there is none."""
        self.versions.forget(path)
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: bounded_call(self.fs, "rm", path, recursive=True), lambda: f"delete {self.url(path)}")

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the files directly under ``path``; empty if it does not exist."""
        return list(self._retry(lambda: self._list_names(path), lambda: f"list {self.url(path)}"))

    # ------------------------------------------------------------------------------------ reading
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a whole (small) file, retrying transient errors. One over ``max_bytes`` raises ``FileTooLargeError``
        having read at most ``max_bytes + 1`` bytes of it (none where the size comes first: local, S3, Azure,
        other fsspec filesystems; GCS streams the body and stops there)."""

        def fetch() -> bytes:
            data, version = self._read_whole_version(path, max_bytes)
            self.versions.repin(path, version)  # one consistent answer: later ranges must match it
            self.counters.add(requests=1, bytes_read=len(data))
            if max_bytes is not None and len(data) > max_bytes:
                raise FileTooLargeError(self.url(path), None, max_bytes)
            return data

        try:
            return self._retry(fetch, lambda: f"read {self.url(path)}")  # type: ignore[no-any-return]
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.url(path)}: no such file") from exc

    def read_range(self, path: str, start: int, end: int) -> memoryview:
        """Read bytes ``[start, end)`` of one file (a convenience over :meth:`read_ranges`)."""
        return self.read_ranges([RangeRequest(path, start, end)])[0]  # type: ignore[return-value]

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[memoryview | None]:
        """Fetch every request, concurrently, coalesced, within the in-flight byte budget.

        Returns, per request, its filled buffer, or ``None`` for requests with ``on_complete`` (the
        callback got the buffer). Raises the first failure after in-flight work has stopped; a file that
        ends early raises :class:`~dcp_storage.errors.CorruptCheckpointError` naming it.
        """
        cfg = self.config
        groups = plan_fetches(requests, cfg.coalesce_gap, cfg.max_request_bytes)
        return RangeRun(requests, groups, self._fetch_group, self.executor(), cfg.max_inflight_bytes).execute()

    def _fetch_group(self, group: FetchGroup, views: list[memoryview]) -> None:
        pieces = [(seg.start - group.start, seg.end - group.start, view) for seg, view in zip(group.segments, views)]
        fetch = self._group_fetch(group, pieces)

        def checked() -> None:  # a short body, or other bytes than asked: retried, unless the object is short
            try:
                fetch()
            except (TruncatedReadError, RangeMismatchError) as exc:
                self._raise_if_ends_before(group.path, group.end, exc)  # a short object is not transient
                raise

        try:
            self._retry(checked, lambda: f"read {self.url(group.path)} bytes [{group.start}, {group.end})")
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.url(group.path)}: no such file") from exc
        except DcpStorageError:
            raise
        except Exception as exc:
            # A range starting past the end fails outright (S3: 416 InvalidRange, s3fs: OSError EINVAL).
            self._raise_if_ends_before(group.path, group.end, exc)
            raise

    def _short_read(self, group: FetchGroup, got: int) -> OSError:
        error = TruncatedReadError if got < group.length else RangeMismatchError  # longer: not the range asked
        return error(f"{self.url(group.path)}: got {got} of {group.length} bytes for [{group.start}, {group.end})")

    def _group_fetch(self, group: FetchGroup, pieces: list[tuple[int, int, memoryview]]) -> Callable[[], None]:
        """One attempt at a fetch group: the whole range buffered, then scattered into ``pieces``."""

        def fetch() -> None:
            data = self._pinned(group.path, partial(self._read_range_version, group.path, group.start, group.end))
            self.counters.add(requests=1, bytes_read=len(data))
            if len(data) != group.length:
                raise self._short_read(group, len(data))
            src = memoryview(data)
            for lo, hi, view in pieces:
                view[:] = src[lo:hi]

        return fetch

    def _raise_if_ends_before(self, path: str, end: int, cause: BaseException | None = None) -> None:
        """Raise :class:`CorruptCheckpointError` if the object at ``path`` is shorter than ``end`` bytes."""
        raise_if_short(self.fs, path, self.url(path), end, cause)

    # ------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically write a whole small file (metadata, markers): one PUT."""
        nbytes = memoryview(data).nbytes
        self.versions.forget(path)

        def put() -> None:
            self._put(path, bytes(data), nbytes)
            self.counters.add(requests=1, bytes_written=nbytes)

        self._retry(put, lambda: f"write {self.url(path)} ({nbytes} bytes)")

    def create_new(self, path: str, data: bytes) -> bool:
        """Write the small file ``path`` only if nothing is there, atomically: ``True`` if this call created it.

        Each store's create-if-absent primitive (``_put_if_absent``; see :mod:`.exclusive`): of two
        concurrent callers exactly one gets ``True``. A request retried after a lost response sees its own
        object, so "exists" is checked against ``data`` (which carries a random save id). Counted as one
        request; the bytes are not added to ``bytes_written`` (a claim is removed when its save commits).
        """
        self.counters.add(requests=1)
        try:
            self._retry(lambda: self._put_if_absent(path, data), lambda: f"create {self.url(path)} if absent")
        except FileExistsError:
            return holds(self, path, data)
        return True

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """Open ``path`` for writing such that it appears whole or not at all.

        Here: the client's buffered writer, which commits by a single PUT or by completing a multipart
        upload on close; on error the upload is aborted, so nothing becomes visible (on Azure, adlfs's
        staged blocks are never committed, and the service drops them). Backends with their own uploads
        (local disk, S3, GCS) say how they commit in ``_open_atomic``.
        """
        self.versions.forget(path)
        yield from self._open_atomic(path)

    def _open_atomic(self, path: str) -> Iterator[CountingWriter]:
        if isinstance(self.fs, MemoryFileSystem):
            # memory:// files are visible from open() on and never discarded: buffer, then one put.
            buffer = io.BytesIO()
            yield CountingWriter(buffer, self.counters)
            data = buffer.getvalue()
            self._retry(lambda: self.fs.pipe_file(path, data), lambda: f"write {self.url(path)} ({len(data)} bytes)")
            self.counters.add(requests=1)
            return
        describe = lambda: f"write {self.url(path)}"  # noqa: E731
        with access_errors(describe):
            raw = self.fs.open(path, "wb", block_size=self.config.part_size)
        writer = CountingWriter(raw, self.counters)
        try:
            yield writer
        except BaseException:
            abandon(raw)
            raise
        try:
            with access_errors(describe):
                raw.close()  # commits: the single PUT, or completing the multipart upload
        except BaseException:
            abandon(raw)
            raise
        parts = max(1, -(-writer.written // self.config.part_size))
        self.counters.add(requests=parts if parts == 1 else parts + 2)
