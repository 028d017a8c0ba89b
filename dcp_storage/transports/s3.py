"""The S3 transport (s3fs): metadata requests and writes on s3fs's client, one attempt at a time, under our retries.

S3 metadata requests (exists, size, list, delete) on s3fs's client, one attempt each.

s3fs runs these through its own retry wrapper (5 tries on connection errors and ``SlowDown``, unaware of
any deadline), under ours. Calling the botocore client directly leaves the transport's retry layer as the
only one, so a permanent fault costs exactly ``max_attempts`` requests and the final error's attempt
count is true. Semantics follow s3fs's for the cases the transport needs: a key is a file, a key prefix
followed by ``/`` is a directory.

The S3 transport (s3fs): requests made on s3fs's client one attempt at a time, under our retries.

Queries, deletes and listings are single API calls (:mod:`.s3_queries`). Ranged reads stream the body
straight into the destination buffers (:class:`~.s3_stream.ScatterSink`), check the answer's status and
``Content-Range`` (:mod:`.range_check`), and resume after a cut-off body from the first byte still
missing. Whole-file reads learn the size first, so a file over ``max_bytes`` is refused unread. Writes
are one ``PutObject`` or a multipart upload whose every request is retried on its own and which is
aborted if it finally fails (:mod:`.s3_upload`); create-if-absent is a ``PutObject`` with
``If-None-Match: *`` (:mod:`.exclusive`). Multipart uploads a killed writer left can be listed and
aborted (:mod:`.s3_pending`, the optional :class:`~.protocol.MultipartUploads`).
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Callable, Iterator
from typing import Any

from dcp_storage.transports.fsspec_transport import FsspecTransport, builtin_backend
from dcp_storage.transports.guards import ListingBound
from dcp_storage.transports.protocol import CountingWriter
from dcp_storage.transports.ranges import FetchGroup
from dcp_storage.transports.s3_stream import (
    PendingUpload,
    ScatterSink,
    abort_pending,
    can_stream,
    client_ready,
    list_pending,
    read_object,
    read_object_version,
    s3_call,
    s3_put_if_absent,
    stream_range,
)
from dcp_storage.transports.s3_upload import S3AtomicUpload, put_object

__all__ = ["S3Transport", "s3_delete", "s3_exists", "s3_list_names", "s3_size", "s3_size_version"]


def _split(fs: Any, path: str) -> tuple[str, str]:
    bucket, key, _ = fs.split_path(path)
    return bucket, key


def s3_size(fs: Any, path: str) -> int:
    """Size of the object at ``path`` (``HeadObject``); ``FileNotFoundError`` if there is none."""
    return s3_size_version(fs, path)[0]


def s3_size_version(fs: Any, path: str) -> tuple[int, str | None]:
    """Size and ETag of the object at ``path`` (one ``HeadObject``)."""
    bucket, key = _split(fs, path)
    head = s3_call(fs, "head_object", Bucket=bucket, Key=key)
    return int(head["ContentLength"]), head.get("ETag")


def s3_exists(fs: Any, path: str) -> bool:
    """Whether ``path`` is an object, or a prefix with objects under it (a directory), or a bucket."""
    bucket, key = _split(fs, path)
    if key:
        try:
            s3_call(fs, "head_object", Bucket=bucket, Key=key)
            return True
        except FileNotFoundError:
            pass
        prefix = key.rstrip("/") + "/"
        try:
            listed = s3_call(fs, "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
        except FileNotFoundError:  # NoSuchBucket
            return False
        return bool(listed.get("KeyCount") or listed.get("Contents") or listed.get("CommonPrefixes"))
    try:
        s3_call(fs, "head_bucket", Bucket=bucket)
        return True
    except FileNotFoundError:
        return False


def s3_list_names(fs: Any, path: str) -> list[str]:
    """Names of the objects and prefixes directly under ``path`` (sorted); empty if there are none."""
    bucket, key = _split(fs, path)
    prefix = key.rstrip("/") + "/" if key else ""
    names: set[str] = set()
    token: str | None = None
    bound = ListingBound(fs.unstrip_protocol(path))  # a listing that never ends is cut off (:mod:`.listing`)
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        if token:
            kwargs["ContinuationToken"] = token
        try:
            page = s3_call(fs, "list_objects_v2", **kwargs)
        except FileNotFoundError:  # NoSuchBucket
            return []
        for entry in page.get("Contents", ()):
            names.add(entry["Key"][len(prefix) :])
        for entry in page.get("CommonPrefixes", ()):
            names.add(posixpath.basename(entry["Prefix"].rstrip("/")))
        token = page.get("NextContinuationToken")
        done = not page.get("IsTruncated") or not token
        bound.page(len(page.get("Contents", ())) + len(page.get("CommonPrefixes", ())), None if done else token)
        if done:
            break
    names.discard("")  # a zero-byte "directory marker" object named like the prefix
    return sorted(names)


def s3_delete(fs: Any, path: str) -> None:
    """Delete the object at ``path``; deleting a missing key succeeds (S3 semantics), so retries are safe."""
    bucket, key = _split(fs, path)
    s3_call(fs, "delete_object", Bucket=bucket, Key=key)
    fs.invalidate_cache(path)


@builtin_backend
class S3Transport(FsspecTransport):
    """Objects in S3 or an S3-compatible store (``s3://``, ``s3a://``)."""

    serves = staticmethod(can_stream)  # the filesystems this class is the transport of

    def set_up_client(self) -> None:
        """Build s3fs's client now (:class:`~.protocol.ClientSetUp`). A failure is left to the first request, which
        builds it again under the retry policy and reports it as one of our errors, naming the URL."""
        with contextlib.suppress(Exception):
            client_ready(self.fs)

    def pending_uploads(self, path: str) -> list[PendingUpload]:
        """In-progress multipart uploads of ``path`` or under it (:mod:`.s3_pending`): the whole listing under
        the retry policy's deadline, and bounded in pages and entries (:mod:`.listing`)."""
        return self._retry(lambda: list_pending(self.fs, path), lambda: f"list multipart uploads {self.url(path)}")  # type: ignore[no-any-return]

    def abort_upload(self, path: str, upload: PendingUpload) -> bool:
        """Abort one of :meth:`pending_uploads`; ``False`` if it is gone meanwhile."""
        return abort_pending(self.fs, path, upload)

    def _exists(self, path: str) -> bool:
        return s3_exists(self.fs, path)

    def _size(self, path: str) -> int:
        return s3_size(self.fs, path)

    def _delete(self, path: str) -> None:
        s3_delete(self.fs, path)

    def _list_names(self, path: str) -> list[str]:
        return s3_list_names(self.fs, path)

    def _size_version(self, path: str) -> tuple[int, str | None]:
        return s3_size_version(self.fs, path)

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return read_object(self.fs, path, max_bytes)

    def _read_whole_version(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        return read_object_version(self.fs, path, max_bytes)

    def _put_if_absent(self, path: str, data: bytes) -> None:
        s3_put_if_absent(self.fs, path, data, self.url(path))

    def _group_fetch(self, group: FetchGroup, pieces: list[tuple[int, int, memoryview]]) -> Callable[[], None]:
        """One attempt at a fetch group, streamed into ``pieces``; a retry resumes after the bytes in place, on
        condition of the version pinned (:meth:`_pinned`), so it cannot append another version's bytes."""
        sink = ScatterSink(pieces)
        done = 0

        def fetch() -> None:
            nonlocal done
            base = done
            sink.reset()

            def emit(offset: int, chunk: memoryview) -> None:
                nonlocal done
                sink.write(base + offset, chunk)
                done = base + offset + len(chunk)

            def read(expected: str | None, saw: Callable[[str | None], None]) -> int:
                return stream_range(self.fs, group.path, group.start + base, group.end, emit, expected, saw)

            try:
                self._pinned(group.path, read)
            finally:
                self.counters.add(requests=1, bytes_read=done - base)
            if done != group.length:
                raise self._short_read(group, done)

        return fetch

    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """One ``PutObject``, retried."""
        self.versions.forget(path)
        put_object(self.fs, path, data, self._runner(path))
        self.counters.add(requests=1, bytes_written=memoryview(data).nbytes)

    def _open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """Every request of the upload retried on its own; aborted if it finally fails."""
        upload = S3AtomicUpload(
            self.fs, path, self.config.part_size, self._runner(path), self.executor(), self.parts_in_flight
        )
        writer = CountingWriter(upload, self.counters)  # type: ignore[arg-type]
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
