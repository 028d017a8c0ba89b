"""``ObstoreTransport``: the dcp-storage transport on obstore (the Rust ``object_store`` client).

The :class:`dcp_storage.plugin_api.Transport` protocol for ``s3://`` URLs: concurrent, coalesced
ranged reads straight into the caller's buffers within an in-flight byte budget, retries with backoff
under the core's :class:`~dcp_storage.plugin_api.RetryPolicy`, atomic writes (one PUT, or a multipart
upload completed on success and aborted on failure), counters, and errors that name the URL and range.

How reads run: :func:`~dcp_storage.plugin_api.plan_fetches` groups the requests; each group is one
ranged GET run by a worker thread, which blocks inside obstore's Tokio runtime with the GIL released and
copies each body chunk into the destination views as it arrives (so a body cut short resumes from the
last byte in place, and no whole-range buffer is ever held). Worker threads rather than an asyncio loop
so that ``on_complete`` callbacks (which decode tensors) run in parallel, as with the fsspec transport.
object_store checks that each answer is the range asked for (status ``206`` and ``Content-Range``); a
mismatch is retried, and a ``200`` is taken only for a whole object (:func:`_get_range`). An answer with a
``Content-Encoding``, or a body longer than its range, is refused the same way.

Retries: reads use a store with obstore's own retries off, so every retry goes through the policy and
is counted; streamed uploads use a second store whose obstore retries follow the same policy (a part
must be re-sent by obstore, which holds it), and those retries are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import posixpath
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import obstore
from dcp_storage.plugin_api import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    FetchGroup,
    FileTooLargeError,
    RangeMismatchError,
    RangeRequest,
    RangeRun,
    RetryPolicy,
    ScatterSink,
    TransportConfig,
    TransportCounters,
    TransportError,
    TruncatedReadError,
    VersionPins,
    WorkerPool,
    call_with_retry,
    holds,
    is_transient,
    plan_fetches,
    range_mismatch,
    resolve_config,
)
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

from dcp_storage_obstore.errors import (
    is_not_found,
    is_not_partial,
    is_range_mismatch,
    is_transient_obstore,
    range_not_satisfiable,
    short_message,
)
from dcp_storage_obstore.options import S3Settings, s3_settings
from dcp_storage_obstore.writer import CopyingWriter

__all__ = ["ObstoreTransport"]

MiB = 1024 * 1024
T = TypeVar("T")
SCHEMES = ("s3", "s3a")
# Body chunks handed from Rust to Python while streaming a range: small enough to stay in cache and to
# reuse allocator memory, large enough that per-chunk Python work is negligible (measured: 64 KiB-1 MiB
# all within noise on s3rver; 256 KiB chosen).
STREAM_CHUNK = 256 * 1024
STAGE_BYTES = 8 * MiB  # small writes are gathered into private buffers of this size (see writer.py)
UPLOAD_CONCURRENCY = 2  # multipart parts in flight per open file: memory is about part_size * (this + 1)


class ObstoreTransport:
    """Bytes-only access to S3 (or an S3-compatible server) through obstore.

    Build it with :meth:`from_url`. Paths are ``bucket/key`` (what :meth:`from_url` and :meth:`strip_url`
    return), joined with :meth:`join`. Thread-safe; :meth:`close` stops its worker threads.
    """

    is_local = False
    protocol = "s3"

    def __init__(self, settings: S3Settings, config: TransportConfig | None = None) -> None:
        self.settings = settings
        self.config = resolve_config(config or TransportConfig(), is_local=False)
        self.counters = TransportCounters()
        self.versions = VersionPins()  # each object's ETag as this load first saw it (dcp_storage...versions)
        self._classify = _classifier(self.config.retry)
        self._stores: dict[tuple[str, bool], S3Store] = {}
        self._lock = threading.Lock()  # guards _stores
        self._workers = WorkerPool(self.config.max_workers, "dcp-obstore-io")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (async_save's checkpoint process) as its settings and config: stores, lock and worker
        # threads are rebuilt by the receiving process on first use.
        return (type(self), (self.settings, self.config))

    def __repr__(self) -> str:
        where = f", endpoint={self.settings.endpoint!r}" if self.settings.endpoint else ""
        region = f", region={self.settings.region!r}" if self.settings.region else ""
        return f"ObstoreTransport(s3{where}{region}, max_workers={self.config.max_workers})"

    # ----------------------------------------------------------------------------------------- building
    @classmethod
    def from_url(
        cls,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        config: TransportConfig | None = None,
    ) -> tuple[ObstoreTransport, str]:
        """Return the transport for ``url`` (``s3://bucket/prefix``) and the path of ``url`` on it."""
        transport = cls(s3_settings(storage_options), config)
        return transport, transport.strip_url(os.fspath(url))

    def strip_url(self, url: str | os.PathLike[str]) -> str:
        """``s3://bucket/key`` -> ``bucket/key`` (a path already without a scheme is returned as is)."""
        url = os.fspath(url)
        scheme, sep, rest = url.partition("://")
        if not sep:
            rest = url
        elif scheme not in SCHEMES:
            raise ValueError(f"{url}: the obstore transport serves {', '.join(s + '://' for s in SCHEMES)} URLs")
        rest = rest.strip("/")
        if not rest:
            raise ValueError(f"{url}: no bucket in the URL")
        return rest

    def url(self, path: str) -> str:
        """A human-readable URL for error messages."""
        return f"s3://{path}"

    def join(self, root: str, *names: str) -> str:
        return posixpath.join(root.rstrip("/"), *names)

    def close(self) -> None:
        self._workers.shutdown()

    def __enter__(self) -> ObstoreTransport:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def executor(self) -> ThreadPoolExecutor:
        """The worker threads ranged reads run on (made on first use)."""
        return self._workers.get()

    def reconfigured(self, config: TransportConfig) -> ObstoreTransport:
        """A transport on the same store settings and counters with ``config``; close it after use."""
        other = ObstoreTransport(self.settings, config)
        other.counters = self.counters
        other.versions = self.versions
        return other

    def begin_load(self) -> None:
        """Forget the ETags pinned so far (a reader's ``reset``, at the start of each load)."""
        self.versions.forget()

    def _locate(self, path: str, uploads: bool = False) -> tuple[S3Store, str]:
        """The store for ``path``'s bucket and the key inside it."""
        bucket, _, key = path.partition("/")
        if not bucket:
            raise ValueError(f"{self.url(path)}: no bucket in the path")
        with self._lock:
            store = self._stores.get((bucket, uploads))
            if store is None:
                retry = _obstore_retry(self.config.retry) if uploads else {"max_retries": 0}
                store = S3Store(**self.settings.store_kwargs(bucket, self.config.retry.deadline), retry_config=retry)
                self._stores[(bucket, uploads)] = store
        return store, key

    def _retry(self, fn: Callable[[], T], describe: Callable[[], str]) -> T:
        policy = dataclasses.replace(self.config.retry, classify=self._classify)
        return call_with_retry(fn, policy, describe, on_retry=lambda _e: self.counters.add(retries=1))

    def _call(self, fn: Callable[[], T], path: str, what: str) -> T:
        """Run one storage call with retries; map obstore's errors to the project's, naming the URL."""
        try:
            return self._retry(fn, lambda: f"{what} {self.url(path)}")
        except DcpStorageError:
            raise
        except Exception as exc:
            if is_not_found(exc):
                raise CheckpointNotFoundError(f"{self.url(path)}: no such file") from exc
            raise TransportError(f"{what} {self.url(path)} failed: {short_message(exc)}") from exc

    # ------------------------------------------------------------------------------------ queries
    def _head(self, path: str) -> dict[str, Any]:
        store, key = self._locate(path)
        return self._call(lambda: obstore.head(store, key), path, "head")

    def exists(self, path: str) -> bool:
        """Whether an object, or any object under the prefix ``path/``, exists."""
        try:
            self._head(path)
            return True
        except CheckpointNotFoundError:
            pass
        store, key = self._locate(path)
        prefix = key.rstrip("/") + "/" if key else ""
        listing = self._call(lambda: obstore.list_with_delimiter(store, prefix or None), path, "list")
        return bool(listing["objects"] or listing["common_prefixes"])

    def size(self, path: str) -> int:
        """Size of the object at ``path``; :class:`CheckpointNotFoundError` if it does not exist."""
        return int(self._head(path)["size"])

    def makedirs(self, path: str) -> None:
        """Object stores have no directories: nothing to do."""

    def remove(self, path: str) -> None:
        """Delete one object if it exists."""
        store, key = self._locate(path)
        with contextlib.suppress(CheckpointNotFoundError):
            self._call(lambda: obstore.delete(store, key), path, "delete")

    def remove_tree(self, path: str) -> None:
        """Delete every object under the prefix ``path/``; nothing if there is none."""
        store, key = self._locate(path)
        prefix = key.rstrip("/") + "/" if key else None
        objects = self._call(lambda: obstore.list(store, prefix).collect(), path, "list")
        paths = [entry["path"] for entry in objects]
        if paths:
            self._call(lambda: obstore.delete(store, paths), path, "delete")

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the objects and prefixes directly under ``path``; empty if none."""
        store, key = self._locate(path)
        prefix = key.rstrip("/") + "/" if key else None
        listing = self._call(lambda: obstore.list_with_delimiter(store, prefix), path, "list")
        names = [posixpath.basename(o["path"].rstrip("/")) for o in listing["objects"]]
        names += [posixpath.basename(p.rstrip("/")) for p in listing["common_prefixes"]]
        return sorted(set(names))

    # ------------------------------------------------------------------------------------ reading
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a whole (small) object, retrying transient errors; one larger than ``max_bytes`` raises
        :class:`~dcp_storage.errors.FileTooLargeError` before its body is read (the size comes first)."""
        store, key = self._locate(path)

        def fetch() -> bytes:
            result = obstore.get(store, key)
            size = result.meta["size"]
            if max_bytes is not None and size > max_bytes:
                raise FileTooLargeError(self.url(path), size, max_bytes)
            data = bytes(result.bytes())
            self.counters.add(requests=1, bytes_read=len(data))
            return data

        return self._call(fetch, path, "read")

    def read_range(self, path: str, start: int, end: int) -> memoryview:
        """Read bytes ``[start, end)`` of one object (a convenience over :meth:`read_ranges`)."""
        return self.read_ranges([RangeRequest(path, start, end)])[0]  # type: ignore[return-value]

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[memoryview | None]:
        """Fetch every request, concurrently, coalesced, within the in-flight byte budget.

        Returns, per request, its filled buffer, or ``None`` for requests with ``on_complete`` (the
        callback got the buffer, in a worker thread). Raises the first failure after in-flight work has
        stopped; an object that ends early raises :class:`CorruptCheckpointError` naming it.
        """
        cfg = self.config
        groups = plan_fetches(requests, cfg.coalesce_gap, cfg.max_request_bytes)  # type: ignore[arg-type]
        return RangeRun(requests, groups, self._fetch_group, self.executor(), cfg.max_inflight_bytes).execute()

    def _fetch_group(self, group: FetchGroup, views: list[memoryview]) -> None:
        """One ranged GET for ``group``, streamed into ``views``; resumes after a body cut short."""
        store, key = self._locate(group.path)
        sink = ScatterSink(
            [(seg.start - group.start, seg.end - group.start, v) for seg, v in zip(group.segments, views)]
        )
        done = 0  # bytes already in place

        def fetch() -> None:
            nonlocal done
            base = done
            sink.reset()
            got = 0
            url = self.url(group.path)
            try:
                try:  # on condition of the ETag this load saw first: a replaced object is refused, not mixed
                    result = _get_range(store, key, group.start + base, group.end, self.versions.expected(group.path))
                except PreconditionError as exc:
                    raise self.versions.changed(group.path, url) from exc
                self.versions.saw(group.path, (result.meta or {}).get("e_tag"), url)
                for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
                    view = memoryview(chunk)
                    if len(view) > group.length - base - got:  # never cut to the range: not its bytes
                        raise range_mismatch(group.start + base, group.end, f"a longer body ({len(view)} bytes more)")
                    sink.write(base + got, view)
                    got += len(view)
                    done = base + got
                    if got == group.length - base:
                        break
            except RangeMismatchError as exc:
                self._raise_if_ends_before(group.path, group.end, exc)  # a short object is not transient
                raise
            finally:
                self.counters.add(requests=1, bytes_read=got)
            if done != group.length:
                self._raise_if_ends_before(group.path, group.end)
                raise TruncatedReadError(
                    f"{self.url(group.path)}: got {done} of {group.length} bytes for [{group.start}, {group.end})"
                )

        where = f"{self.url(group.path)} bytes [{group.start}, {group.end})"
        try:
            self._retry(fetch, lambda: f"read {where}")
        except DcpStorageError:
            raise
        except Exception as exc:
            if is_not_found(exc):
                raise CheckpointNotFoundError(f"{self.url(group.path)}: no such file") from exc
            if range_not_satisfiable(exc):
                self._raise_if_ends_before(group.path, group.end, exc)
            raise TransportError(f"read {where} failed: {short_message(exc)}") from exc

    def _raise_if_ends_before(self, path: str, end: int, cause: BaseException | None = None) -> None:
        """Raise :class:`CorruptCheckpointError` if the object at ``path`` is shorter than ``end`` bytes."""
        try:
            size = self.size(path)
        except DcpStorageError:
            return  # size unknown: the caller's own error stands
        if size < end:
            raise CorruptCheckpointError(
                f"{self.url(path)}: object ends at byte {size} but bytes up to {end} were expected (truncated file?)"
            ) from cause

    # ------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically write a whole small object: one PUT (a multipart upload above ``part_size``)."""
        payload = bytes(data)  # private and immutable: a retry re-sends exactly these bytes
        store, key = self._locate(path)
        nbytes = len(payload)
        part = self.config.part_size
        multipart = nbytes > part

        def put() -> None:
            obstore.put(
                store, key, payload, use_multipart=multipart, chunk_size=part, max_concurrency=UPLOAD_CONCURRENCY
            )

        self._call(put, path, f"write ({nbytes} bytes)")
        self.counters.add(requests=_put_requests(nbytes, part), bytes_written=nbytes)

    def create_new(self, path: str, data: bytes) -> bool:
        """Write the small object ``path`` only if none is there (``PutMode.Create``: ``If-None-Match: *``).

        ``True`` if this call created it, also when a retry after a lost answer finds its own bytes
        (:func:`~dcp_storage.transports.base.holds`); ``False`` if another writer's object is there.
        Counted as one request, not in ``bytes_written`` (a claim does not stay; see the core's transport).
        """
        payload = bytes(data)
        store, key = self._locate(path)
        self.counters.add(requests=1)
        try:
            self._retry(lambda: obstore.put(store, key, payload, mode="create"), lambda: f"create {self.url(path)}")
        except AlreadyExistsError:
            return holds(self, path, payload)
        return True

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[CopyingWriter]:
        """Open ``path`` for writing such that it appears whole or not at all.

        The bytes written are spooled (in memory up to ``part_size``, then in a temporary file) and sent at
        the end of the block by one ``obstore.put``: a single PUT up to ``part_size``, a multipart upload
        above it. That put runs under the transport's retry policy as a whole, so any failed request (a
        part, the completion, or a cut-off answer to ``CreateMultipartUpload``, which obstore does not
        retry and whose upload id never reaches us) costs a resend of the file, not the save. On an
        exception inside the block nothing is sent. Every buffer written is copied (see :mod:`.writer`).
        """
        store, key = self._locate(path, uploads=True)
        part = self.config.part_size
        with tempfile.SpooledTemporaryFile(max_size=part) as spool:
            writer = CopyingWriter(spool, self.counters, min(STAGE_BYTES, part))
            yield writer
            writer.finish()
            nbytes = writer.written
            multipart = nbytes > part

            def put() -> None:
                spool.seek(0)
                body: Any = spool if multipart else spool.read()
                try:
                    obstore.put(
                        store, key, body, use_multipart=multipart, chunk_size=part, max_concurrency=UPLOAD_CONCURRENCY
                    )
                except Exception as exc:
                    if multipart and is_not_found(exc) and _completed(store, key, nbytes, part):
                        return  # the completion's answer was lost and its retry met NoSuchUpload: it is written
                    raise

            self._call(put, path, f"write ({nbytes} bytes)")
        self.counters.add(requests=_put_requests(nbytes, part))


def _get_range(store: S3Store, key: str, start: int, end: int, etag: str | None = None) -> Any:
    """``obstore.get`` of bytes ``[start, end)``: their answer, or :class:`RangeMismatchError` (retried).

    object_store itself refuses an answer that is not a ``206`` naming exactly that range; its error becomes
    ours, so the core's retry layer retries it. A ``200`` (the store ignored ``Range``) is the answer only
    when the range was the whole object: then one GET without ``Range`` is taken, if its object is exactly
    ``end`` bytes long (its headers are checked before any byte of its body is read). With ``etag``, every GET
    is conditional on it (``If-Match``; a ``412`` raises obstore's ``PreconditionError``).
    """
    condition: dict[str, Any] = {"if_match": etag} if etag else {}
    try:
        return _not_encoded(obstore.get(store, key, options={"range": (start, end), **condition}), start, end, 206)
    except Exception as exc:
        if not is_range_mismatch(exc):
            raise
        if not (start == 0 and is_not_partial(exc)):
            raise range_mismatch(start, end, short_message(exc)) from exc
    whole = obstore.get(store, key, options=condition)  # type: ignore[arg-type]
    size = whole.meta["size"]
    if size != end:
        raise range_mismatch(0, end, f"status 200 (Range ignored) for an object of {size} bytes")
    return _not_encoded(whole, start, end, 200)


def _not_encoded(result: Any, start: int, end: int, status: int) -> Any:
    """``result``, unless its answer had a ``Content-Encoding``: then not the stored bytes (a compressing cache
    in between; object_store hands the encoded bytes on as the object's), a :class:`RangeMismatchError`."""
    encoding = str((result.attributes or {}).get("Content-Encoding") or "").strip()
    if encoding.lower() not in ("", "identity"):
        raise range_mismatch(start, end, f"status {status}, Content-Encoding {encoding[:80]!r} (not the stored bytes)")
    return result


def _put_requests(nbytes: int, part_size: int) -> int:
    parts = max(1, -(-nbytes // part_size))
    return 1 if parts == 1 else parts + 2  # create + parts + complete


def _classifier(policy: RetryPolicy) -> Callable[[BaseException], bool]:
    """The policy's classifier, taught obstore's errors when it is the default one."""
    return is_transient_obstore if policy.classify is is_transient else policy.classify


def _obstore_retry(policy: RetryPolicy) -> dict[str, Any]:
    """obstore's ``RetryConfig`` following ``policy`` (for multipart parts, which obstore re-sends)."""
    retry: dict[str, Any] = {
        "max_retries": policy.max_attempts - 1,
        "backoff": {
            "init_backoff": datetime.timedelta(seconds=policy.initial_backoff),
            "max_backoff": datetime.timedelta(seconds=policy.max_backoff),
            "base": 2,
        },
    }
    if policy.deadline is not None:
        retry["retry_timeout"] = datetime.timedelta(seconds=policy.deadline)
    return retry


def _completed(store: S3Store, key: str, nbytes: int, part: int) -> bool:
    """Whether ``key`` holds a completed multipart upload of ``nbytes`` in parts of ``part`` bytes: its size,
    and the ``-N`` part count S3 appends to a multipart object's ETag. A ``CompleteMultipartUpload`` whose
    answer is lost is retried, and the retry finds no such upload because the first one completed it."""
    try:
        meta = obstore.head(store, key)
    except Exception:  # noqa: BLE001 - nothing there (or unreadable): the put's own error stands
        return False
    parts = -(-nbytes // part)
    etag = str(meta.get("e_tag") or "").strip('"')
    return int(meta.get("size", -1)) == nbytes and etag.endswith(f"-{parts}")
