"""The fsspec transport: bytes in and out of any fsspec URL, concurrent, retried, atomic.

It knows nothing about tensors. Formats ask it for byte ranges and for atomic file writes; it turns a URL
plus ``storage_options`` into an fsspec filesystem and adds what fsspec lacks for checkpoints:

* concurrent ranged reads with coalescing of near ranges and a cap on bytes in flight;
* retries with exponential backoff and jitter on transient errors (5xx, throttling, resets, truncation);
* atomic commit: on a local disk a temp file, ``fsync`` and ``rename``; on an object store a single PUT or
  a completed multipart upload (aborted on failure), never a rename and never an ``fsync``;
* counters of requests, bytes and retries.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, DcpStorageError, FileTooLargeError
from .access import access_errors
from .config import MiB, TransportConfig, resolve_config
from .counters import TransportCounters
from .exclusive import create_new
from .gcs_io import GcsAtomicUpload, gcs_delete, gcs_exists, gcs_list_names, gcs_put, gcs_size, is_gcs
from .local_io import LocalFiles, preadv_exact, read_whole, start_writeback
from .local_open import Confinement, stat_regular
from .range_check import RangeMismatchError
from .range_readers import buffered_range_reader, whole_file_reader
from .range_run import RangeRun
from .ranges import FetchGroup, RangeRequest, plan_fetches
from .retry import TruncatedReadError, call_with_retry, single_layer_client_options
from .s3_queries import s3_delete, s3_exists, s3_list_names, s3_size
from .s3_stream import ScatterSink, can_stream, read_object, stream_range
from .s3_upload import S3AtomicUpload, put_object
from .worker_pool import WorkerPool

__all__ = ["FsspecTransport", "TransportConfig"]


class _CountingWriter:
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


class _LocalWriter(_CountingWriter):
    """A local temp file's writer that starts writeback of every ``WRITEBACK_BYTES`` written
    (:func:`~dcp_storage.transports.local_io.start_writeback`); the commit still ``fsync``s."""

    WRITEBACK_BYTES = 32 * MiB

    def __init__(self, raw: Any, counters: TransportCounters) -> None:
        super().__init__(raw, counters)
        self._synced = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        step = self.WRITEBACK_BYTES
        for pos in range(0, max(view.nbytes, 1), step):  # a big tensor: writeback starts after each piece
            super().write(view[pos : pos + step])
            if self.written - self._synced >= step:
                self._raw.flush()
                start_writeback(self._raw.fileno(), self._synced, self.written - self._synced)
                self._synced = self.written
        return view.nbytes


class FsspecTransport:
    """Bytes-only access to one fsspec filesystem.

    Build it with :meth:`from_url`. Paths passed to its methods are paths of that filesystem (what
    ``fsspec.core.url_to_fs`` returns), joined with :meth:`join`.
    On a local disk it reads only regular files inside their checkpoint (``confinement``, :mod:`.local_open`).
    """

    def __init__(
        self, fs: fsspec.AbstractFileSystem, config: TransportConfig | None = None, *, scheme: str | None = None,
        confinement: Confinement | None = None,
    ) -> None:  # fmt: skip
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.confinement = confinement if self.is_local else None
        self._gcs = is_gcs(fs)  # gcsfs: requests made one attempt at a time (gcs_io), under our retries
        # The scheme the caller wrote, if ``fs`` answers to several (adlfs: abfs, az, abfss), so that errors
        # name the URL the user gave (``az://...``), not the filesystem's first alias.
        aliases = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._scheme = scheme if scheme in aliases else None
        self.config = resolve_config(config or TransportConfig(), self.is_local)
        self.counters = TransportCounters()
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
        options = single_layer_client_options(url, storage_options or {})
        fs, path = fsspec.core.url_to_fs(url, **options)
        scheme = url.split("://", 1)[0].lower() if "://" in url else None
        return cls(fs, config, scheme=scheme, confinement=Confinement(path)), path

    @property
    def protocol(self) -> str:
        proto = self.fs.protocol
        return proto[0] if isinstance(proto, (tuple, list)) else proto

    def url(self, path: str) -> str:
        """A human-readable URL for error messages."""
        if self.is_local:
            return path
        url = self.fs.unstrip_protocol(path)
        if self._scheme is not None and "://" in url:
            url = f"{self._scheme}://{url.split('://', 1)[1]}"
        return url

    def join(self, root: str, *names: str) -> str:
        if self.is_local:
            return os.path.join(root, *names)
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
        """A transport on the same filesystem, confinement and counters, with ``config``."""
        other = FsspecTransport(self.fs, config, scheme=self._scheme, confinement=self.confinement)
        other.counters = self.counters
        return other

    def local_files(self) -> LocalFiles:
        """Descriptors of this checkpoint's local files (regular files inside it only); ``close`` them."""
        if not self.is_local:
            raise TypeError(f"{self.url('')}: local_files() on a transport that is not local")
        return LocalFiles(self.confinement)

    def _retry(self, fn: Any, describe: Any) -> Any:
        with access_errors(describe):  # credential and permission failures: StorageAccessError naming the call
            return call_with_retry(fn, self.config.retry, describe, on_retry=lambda _e: self.counters.add(retries=1))

    def _runner(self, path: str) -> Any:
        """``runner(fn, what)`` for the S3 upload helpers: ``fn`` retried, errors naming ``what`` and the URL."""
        return lambda fn, what: self._retry(fn, lambda: f"{what} {self.url(path)}")

    # ------------------------------------------------------------------------------------ queries
    def exists(self, path: str) -> bool:
        if self.is_local:
            return os.path.exists(path)
        check = (lambda: s3_exists(self.fs, path)) if can_stream(self.fs) else (lambda: self.fs.exists(path))
        if self._gcs:
            check = functools.partial(gcs_exists, self.fs, path)
        return bool(self._retry(check, lambda: f"exists {self.url(path)}"))

    def size(self, path: str) -> int:
        """Size of the file at ``path``; :class:`CheckpointNotFoundError` if it does not exist (on a local
        disk, :class:`CorruptCheckpointError` if it is no regular file or lies outside the checkpoint)."""
        try:
            if self.is_local:
                return stat_regular(path, self.confinement).st_size
            stat = (lambda: s3_size(self.fs, path)) if can_stream(self.fs) else (lambda: self.fs.size(path))
            if self._gcs:
                stat = functools.partial(gcs_size, self.fs, path)
            return int(self._retry(stat, lambda: f"size of {self.url(path)}"))
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.url(path)}: no such file") from exc

    def makedirs(self, path: str) -> None:
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        else:
            self._retry(lambda: self.fs.makedirs(path, exist_ok=True), lambda: f"makedirs {self.url(path)}")

    def remove(self, path: str) -> None:
        """Delete one file if it exists."""
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return
        with contextlib.suppress(FileNotFoundError):
            delete = (lambda: s3_delete(self.fs, path)) if can_stream(self.fs) else (lambda: self.fs.rm_file(path))
            if self._gcs:
                delete = functools.partial(gcs_delete, self.fs, path)
            self._retry(delete, lambda: f"delete {self.url(path)}")

    def remove_tree(self, path: str) -> None:
        """Delete every file under ``path``; nothing if there is none."""
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(path)
            return
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.rm(path, recursive=True), lambda: f"delete {self.url(path)}")

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the files directly under ``path``; empty if it does not exist."""
        if self.is_local:
            try:
                names = os.listdir(path)
            except (FileNotFoundError, NotADirectoryError):
                return []
            # Hide in-progress atomic writes (see _open_atomic_local).
            return sorted(n for n in names if not (n.startswith(".") and n.endswith(".tmp")))
        if can_stream(self.fs):
            return self._retry(lambda: s3_list_names(self.fs, path), lambda: f"list {self.url(path)}")
        if self._gcs:
            return self._retry(lambda: gcs_list_names(self.fs, path), lambda: f"list {self.url(path)}")

        def ls() -> list[str]:
            self.fs.invalidate_cache(path)
            return list(self.fs.ls(path, detail=False))

        try:
            entries = self._retry(ls, lambda: f"list {self.url(path)}")
        except (FileNotFoundError, NotADirectoryError):
            return []
        if len(entries) == 1 and entries[0].rstrip("/") == path.rstrip("/"):
            return []  # fsspec lists a file as itself
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    # ------------------------------------------------------------------------------------ reading
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a whole (small) file, retrying transient errors. One over ``max_bytes`` raises ``FileTooLargeError``
        having read at most ``max_bytes + 1`` bytes of it (none where the size comes first: local, S3, Azure,
        other fsspec filesystems; GCS streams the body and stops there)."""

        def fetch() -> bytes:
            if self.is_local:
                data = read_whole(path, self.confinement, max_bytes)
            elif can_stream(self.fs):
                data = read_object(self.fs, path, max_bytes)
            else:
                data = whole_file_reader(self.fs)(path, max_bytes)
            self.counters.add(requests=1, bytes_read=len(data))
            if max_bytes is not None and len(data) > max_bytes:
                raise FileTooLargeError(self.url(path), None, max_bytes)
            return data

        try:
            return self._retry(fetch, lambda: f"read {self.url(path)}")
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
        if not self.is_local:
            return RangeRun(
                requests, groups, self._fetch_group_remote, self.executor(), cfg.max_inflight_bytes
            ).execute()
        files = LocalFiles(self.confinement)
        try:

            def fetch(group: FetchGroup, views: list[memoryview]) -> None:
                self._fetch_group_local(files.fd(group.path), group, views)

            return RangeRun(requests, groups, fetch, self.executor(), cfg.max_inflight_bytes).execute()
        finally:
            files.close()  # execute() returns only once no fetch runs any more

    def _fetch_group_local(self, fd: int, group: FetchGroup, views: list[memoryview]) -> None:
        buffers: list[memoryview] = []
        position = group.start
        for seg, view in zip(group.segments, views):
            if seg.start > position:
                buffers.append(memoryview(bytearray(seg.start - position)))
            buffers.append(view)
            position = seg.end
        calls = preadv_exact(fd, group.path, buffers, group.start)
        self.counters.add(requests=calls, bytes_read=group.length)

    def _fetch_group_remote(self, group: FetchGroup, views: list[memoryview]) -> None:
        pieces = [(seg.start - group.start, seg.end - group.start, view) for seg, view in zip(group.segments, views)]
        stream = can_stream(self.fs)
        fetch = self._streaming_fetch(group, ScatterSink(pieces)) if stream else self._buffered_fetch(group, pieces)

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

    def _buffered_fetch(self, group: FetchGroup, pieces: list[tuple[int, int, memoryview]]) -> Any:
        read = buffered_range_reader(self.fs)  # status and Content-Range checked where the client exposes them

        def fetch() -> None:
            data = read(group.path, group.start, group.end)
            self.counters.add(requests=1, bytes_read=len(data))
            if len(data) != group.length:
                raise self._short_read(group, len(data))
            src = memoryview(data)
            for lo, hi, view in pieces:
                view[:] = src[lo:hi]

        return fetch

    def _streaming_fetch(self, group: FetchGroup, sink: ScatterSink) -> Any:
        done = 0  # bytes already in place: a retry after a cut-off body resumes from here

        def fetch() -> None:
            nonlocal done
            base = done
            sink.reset()

            def emit(offset: int, chunk: memoryview) -> None:
                nonlocal done
                sink.write(base + offset, chunk)
                done = base + offset + len(chunk)

            try:
                stream_range(self.fs, group.path, group.start + base, group.end, emit)
            finally:
                self.counters.add(requests=1, bytes_read=done - base)
            if done != group.length:
                raise self._short_read(group, done)

        return fetch

    def _raise_if_ends_before(self, path: str, end: int, cause: BaseException | None = None) -> None:
        """Raise :class:`CorruptCheckpointError` if the object at ``path`` is shorter than ``end`` bytes."""
        try:
            self.fs.invalidate_cache(path)
            size = self.fs.size(path)
        except Exception:  # noqa: BLE001 - size unknown: the caller's own error stands
            return
        if size is not None and size < end:
            raise CorruptCheckpointError(
                f"{self.url(path)}: object ends at byte {size} but bytes up to {end} were expected (truncated file?)"
            ) from cause

    # ------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically write a whole small file (metadata, markers): one PUT, or temp+fsync+rename."""
        nbytes = memoryview(data).nbytes
        if self.is_local:
            with self.open_atomic(path) as f:
                f.write(data)
            return
        if can_stream(self.fs):
            put_object(self.fs, path, data, self._runner(path))
            self.counters.add(requests=1, bytes_written=nbytes)
            return

        def put() -> None:
            if self._gcs:
                gcs_put(self.fs, path, bytes(data), nbytes)
            else:
                self.fs.pipe_file(path, bytes(data))
            self.counters.add(requests=1, bytes_written=nbytes)

        self._retry(put, lambda: f"write {self.url(path)} ({nbytes} bytes)")

    def create_new(self, path: str, data: bytes) -> bool:
        """Write the small file ``path`` only if nothing is there, atomically: ``True`` if this call created it.

        Each store's create-if-absent primitive (see :mod:`~dcp_storage.transports.exclusive`): of two
        concurrent callers exactly one gets ``True``.
        """
        return create_new(self, path, data)

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[_CountingWriter]:
        """Open ``path`` for writing such that it appears whole or not at all.

        Local: a temp file beside it, ``fsync``, then ``os.replace`` (and the directory is synced).
        Object store: the client's buffered writer, which commits by a single PUT or by completing a
        multipart upload on close; on error the upload is aborted, so nothing becomes visible. On GCS
        (gcsfs) one media upload at close, sent from memory or a local spill file and retried as a whole
        (:mod:`~dcp_storage.transports.gcs_io`), and on error never sent; on Azure (adlfs) staged blocks committed as one block list at close, and on error never
        committed (uncommitted blocks are invisible, and the service drops them).
        """
        if self.is_local:
            yield from self._open_atomic_local(path)
        else:
            yield from self._open_atomic_remote(path)

    def _open_atomic_local(self, path: str) -> Iterator[_CountingWriter]:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        raw = open(tmp, "wb")  # noqa: SIM115 - closed in both branches below
        writer = _LocalWriter(raw, self.counters)
        try:
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
            raw.close()
            os.replace(tmp, path)
            self.counters.add(requests=1)
            _fsync_dir(directory)
        except BaseException:
            raw.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise

    def _open_atomic_remote(self, path: str) -> Iterator[_CountingWriter]:
        if isinstance(self.fs, MemoryFileSystem):
            # memory:// files are visible from open() on and never discarded: buffer, then one put.
            yield from self._open_atomic_buffered(path)
            return
        if can_stream(self.fs):
            yield from self._open_atomic_s3(path)
            return
        if self._gcs:
            yield from self._open_atomic_gcs(path)
            return
        describe = lambda: f"write {self.url(path)}"  # noqa: E731
        with access_errors(describe):
            raw = self.fs.open(path, "wb", block_size=self.config.part_size)
        writer = _CountingWriter(raw, self.counters)
        try:
            yield writer
        except BaseException:
            _abandon(raw)
            raise
        try:
            with access_errors(describe):
                raw.close()  # commits: the single PUT, or completing the multipart upload
        except BaseException:
            _abandon(raw)
            raise
        parts = max(1, -(-writer.written // self.config.part_size))
        self.counters.add(requests=parts if parts == 1 else parts + 2)

    def _open_atomic_s3(self, path: str) -> Iterator[_CountingWriter]:
        """S3: every request of the upload retried on its own; aborted if it finally fails."""
        upload = S3AtomicUpload(
            self.fs, path, self.config.part_size, self._runner(path), self.executor(), self.parts_in_flight
        )
        writer = _CountingWriter(upload, self.counters)  # type: ignore[arg-type]
        try:
            yield writer
            upload.commit()
        except BaseException as exc:
            upload.abandon(exc)
            if upload.failure is not None and upload.failure is not exc:
                raise upload.failure  # ours, not what a serializer in between made of it
            raise
        finally:
            self.counters.add(requests=upload.requests)

    def _open_atomic_gcs(self, path: str) -> Iterator[_CountingWriter]:
        """GCS: one media upload at close, retried as a whole (see :mod:`.gcs_io`); nothing sent on error."""
        upload = GcsAtomicUpload(self.fs, path, self.config.part_size, self._runner(path))
        writer = _CountingWriter(upload, self.counters)  # type: ignore[arg-type]
        try:
            yield writer
            upload.commit()
        finally:
            upload.abandon()
            self.counters.add(requests=upload.requests)

    def _open_atomic_buffered(self, path: str) -> Iterator[_CountingWriter]:
        buffer = io.BytesIO()
        yield _CountingWriter(buffer, self.counters)
        data = buffer.getvalue()
        self._retry(lambda: self.fs.pipe_file(path, data), lambda: f"write {self.url(path)} ({len(data)} bytes)")
        self.counters.add(requests=1)


def _abandon(raw: Any) -> None:
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


def _fsync_dir(directory: str) -> None:
    """Persist a rename: fsync the directory entry (POSIX only; a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
