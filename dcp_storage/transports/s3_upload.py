"""Atomic S3 writes whose every request is retried: one PUT, or a streamed multipart upload.

s3fs's buffered writer (``fs.open(path, "wb")``) uploads parts from inside ``write``/``flush``; when a part
upload fails, the buffer and part list are left in a state a caller cannot retry from, so one dropped
connection during a save loses the whole file. :class:`S3AtomicUpload` keeps each part's bytes until S3
has acknowledged them, so each request (create, every part, complete, or the single PUT) is retried on
its own by the transport's retry layer. An upload that finally fails is aborted; nothing becomes visible.

Parts go up concurrently when the caller gives an executor: up to ``max_pending * part_size`` bytes of
parts are in flight (at least one part) while the writer fills the next one, so serialising and uploading
overlap and memory stays at ``max_pending * part_size`` plus the part being filled
(:func:`upload_memory`). Each part's bytes are the buffer they were gathered in (handed over,
never copied again).

S3 allows 10,000 parts per upload. So that a small ``part_size`` (more parts in flight within the same
memory) does not also cap the object's size, the part size doubles after every 1,000 parts
(:func:`part_size_at`): from 16 MiB, the first 15.6 GiB go in 16 MiB parts and 10,000 parts reach S3's
5 TiB object limit; only objects beyond 15.6 GiB pay more memory, for the larger part being filled.

Requests go to s3fs's botocore client directly (:func:`~dcp_storage.transports.s3_stream.s3_call`), with
the credentials, endpoint and ``s3_additional_kwargs`` of the filesystem.

In-progress S3 multipart uploads under a prefix: list them, abort one (s3fs's client).

A writer that is killed cannot abort its multipart upload; its parts stay in the bucket, billed, until
someone aborts it. :class:`~.s3_transport.S3Transport` offers these as the optional
:class:`~.protocol.MultipartUploads` protocol, which ``verify`` (:mod:`dcp_storage.inspection.checks`)
uses; other transports have no multipart uploads to list.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

from dcp_storage.errors import DcpStorageError, TransportError
from dcp_storage.transports.guards import ListingBound
from dcp_storage.transports.retry import error_code, http_status
from dcp_storage.transports.s3_stream import client_ready, s3_call

try:  # ISA-L's CRC-32 (zip's and S3's polynomial); zlib's where no wheel exists
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency
    from zlib import crc32

__all__ = [
    "MAX_PARTS",
    "PendingUpload",
    "Runner",
    "S3AtomicUpload",
    "abort_pending",
    "body_checksum",
    "list_pending",
    "part_size_at",
    "put_object",
    "s3_put_if_absent",
    "upload_memory",
]

T = TypeVar("T")
_log = logging.getLogger(__name__)
# ``runner(fn, what)`` calls ``fn`` under the transport's retry policy; ``what`` names the request for
# the final error ("upload part 3 (67108864 bytes) of"); the runner appends the URL.
Runner = Callable[[Callable[[], Any], str], Any]


MAX_PARTS = 10_000  # S3's limit per multipart upload
_PARTS_PER_SIZE = 1_000  # parts uploaded at one size before it doubles
_MAX_PART = 5 * 1024**3  # S3's largest part


def part_size_at(number: int, base: int) -> int:
    """The size of part ``number`` (1-based) of an upload that starts at ``base``: doubled every 1,000 parts,
    at most S3's 5 GiB."""
    return min(base << ((number - 1) // _PARTS_PER_SIZE), _MAX_PART)


def upload_memory(size: int, base: int, max_pending: int) -> int:
    """The most bytes an upload of a ``size``-byte object holds: parts in flight, and the part being filled
    (the largest one it reaches: parts grow past ``base`` only beyond 1,000 parts)."""
    done, number = 0, 1
    while True:
        part = part_size_at(number, base)
        if size <= done + _PARTS_PER_SIZE * part or part == _MAX_PART:
            return min(size, max_pending * base + part)
        done += _PARTS_PER_SIZE * part
        number += _PARTS_PER_SIZE


def body_checksum(fs: Any, body: bytes | bytearray | memoryview) -> dict[str, str]:
    """``{"ChecksumCRC32": ...}`` for a ``PutObject`` or ``UploadPart`` body, computed here by ISA-L, where
    botocore would compute the same CRC-32 itself with zlib; ``{}`` where it would not.

    botocore adds a CRC-32 of every upload body by default (``request_checksum_calculation="when_supported"``)
    and computes it with zlib, about 2.4 GB/s here: 0.1 s of CPU per 256 MiB saved, on the thread that sends.
    Given the value, it sends the same ``x-amz-checksum-crc32`` and computes nothing (ISA-L: 17-60 GB/s). A
    client configured ``"when_required"`` (a store that refuses checksum headers), or a caller whose
    ``s3_additional_kwargs`` name a checksum, gets none from us.
    """
    client_ready(fs)
    client = getattr(fs, "_s3", None)
    config = getattr(getattr(client, "meta", None), "config", None)
    if getattr(config, "request_checksum_calculation", None) != "when_supported":
        return {}
    if any(k.startswith("Checksum") for k in getattr(fs, "s3_additional_kwargs", None) or {}):
        return {}
    return {"ChecksumCRC32": base64.b64encode(crc32(body).to_bytes(4, "big")).decode("ascii")}


def put_object(fs: Any, path: str, data: bytes | bytearray | memoryview, runner: Runner) -> None:
    """One retried ``PutObject`` of ``data`` (a whole small file: metadata, an index)."""
    bucket, key, _ = fs.split_path(path)
    body = data if isinstance(data, (bytes, bytearray)) else bytes(data)  # sent as it is: no copy
    sums = body_checksum(fs, body)
    runner(lambda: s3_call(fs, "put_object", Bucket=bucket, Key=key, Body=body, **sums), f"write ({len(body)} bytes)")
    fs.invalidate_cache(path)  # s3fs caches listings; its own writers invalidate them the same way


class S3AtomicUpload:
    """A write-only file: buffered up to ``part_size``, committed by :meth:`commit`, undone by :meth:`abort`.

    Files smaller than one part are one ``PutObject`` at commit. Larger ones start a multipart upload at
    the first full part and upload each part as it fills: inline, or on ``executor`` with up to
    ``max_pending`` parts in flight; :meth:`commit` uploads the tail, waits for every part and completes
    the upload. ``requests`` counts successful requests.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        part_size: int,
        runner: Runner,
        executor: Executor | None = None,
        max_pending: int = 1,
    ) -> None:
        self.fs = fs
        self.path = path
        self.part_size = part_size
        self.bucket, self.key, _ = fs.split_path(path)
        self._run = runner
        self._executor = executor
        self._max_pending = max(1, max_pending)
        self._pending: deque[tuple[int, Future[None]]] = deque()  # (bytes, upload) of parts in flight
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: dict[int, dict[str, Any]] = {}
        self._numbers = 0
        self._lock = threading.Lock()  # requests and parts are updated by part uploads on other threads
        self.size = 0
        self.requests = 0
        self._finished = False
        # The error that ended the upload, kept because a caller in between (torch's zip writer) may
        # replace it with its own ("unexpected pos"); the transport re-raises this one.
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------------------ file protocol
    def write(self, data: Any) -> int:
        if self._finished:
            raise ValueError(f"{self.path}: write after commit or abort")
        view = memoryview(data).cast("B")
        # Consume the write one part at a time: memory holds the parts in flight plus the one filling
        # (a 256 MiB tensor written at once costs parts, not a second 256 MiB buffer).
        pos, end = 0, view.nbytes
        try:
            while pos < end:
                size = part_size_at(self._numbers + 1, self.part_size)
                take = min(size - len(self._buffer), end - pos)
                self._buffer += view[pos : pos + take]
                pos += take
                if len(self._buffer) == size:
                    part, self._buffer = self._buffer, bytearray()
                    self._send(part)
        except BaseException as exc:
            self.failure = self.failure or exc
            raise
        self.size += end
        return end

    def flush(self) -> None:
        """Nothing to do: parts go out when full, the rest at :meth:`commit`."""

    # ------------------------------------------------------------------------------ requests
    def _call(self, method: str, what: str, **kwargs: Any) -> Any:
        out = self._run(lambda: s3_call(self.fs, method, Bucket=self.bucket, Key=self.key, **kwargs), what)
        with self._lock:
            self.requests += 1
        return out

    def _send(self, body: bytearray) -> None:
        """Upload ``body`` as the next part: now, or on the executor once the parts out leave room for it."""
        if self._upload_id is None:
            created = self._call("create_multipart_upload", "start multipart upload of")
            self._upload_id = str(created["UploadId"])
        if self._numbers >= MAX_PARTS:
            raise TransportError(
                f"{self.fs.unstrip_protocol(self.path)}: more than S3's {MAX_PARTS} parts (the object is over "
                f"{sum(part_size_at(n, self.part_size) for n in range(1, MAX_PARTS + 1))} bytes)"
            )
        self._numbers += 1
        if self._executor is None:
            self._upload_part(self._numbers, body)
            return
        # Bytes, not parts, are bounded: parts that doubled leave fewer in flight (at least one), so memory
        # stays within ``max_pending * part_size`` (what the writer's budget counts) as the object grows.
        limit = self._max_pending * self.part_size
        while self._pending and sum(n for n, _ in self._pending) + len(body) > limit:
            self._pending.popleft()[1].result()  # the oldest part's failure, if any, ends the upload here
        self._pending.append((len(body), self._executor.submit(self._upload_part, self._numbers, body)))

    def _upload_part(self, number: int, body: bytearray) -> None:
        out = self._call(
            "upload_part",
            f"upload part {number} ({len(body)} bytes) of",
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
            **body_checksum(self.fs, body),
        )
        part: dict[str, Any] = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:  # as s3fs does: only a checksum the caller asked for
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        with self._lock:
            self._parts[number] = part

    def _drain(self) -> None:
        """Wait for every part in flight; the first failure is raised after all have ended."""
        first: BaseException | None = None
        while self._pending:
            try:
                self._pending.popleft()[1].result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once nothing runs any more
                first = first or exc
        if first is not None:
            raise first

    def commit(self) -> None:
        """Make the object visible: the single PUT, or the last part and ``CompleteMultipartUpload``."""
        if self._finished:
            raise ValueError(f"{self.path}: already committed or aborted")
        try:
            if self._upload_id is None:
                body, self._buffer = self._buffer, bytearray()
                self._call("put_object", f"write ({len(body)} bytes)", Body=body, **body_checksum(self.fs, body))
            else:
                if self._buffer:
                    tail, self._buffer = self._buffer, bytearray()
                    self._send(tail)
                self._drain()
                self._complete()
        except BaseException as exc:
            self.failure = self.failure or exc
            raise
        self._finished = True
        self.fs.invalidate_cache(self.path)  # s3fs caches listings; its own writers invalidate them the same way

    def _complete(self) -> None:
        attempts = 0

        def complete() -> Any:
            nonlocal attempts
            attempts += 1
            try:
                return s3_call(
                    self.fs,
                    "complete_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": [self._parts[n] for n in sorted(self._parts)]},
                )
            except FileNotFoundError as exc:  # NoSuchUpload
                # An earlier attempt may have completed the upload and lost only its response.
                if attempts > 1 and self._is_our_object():
                    return None
                raise TransportError(
                    f"{self.fs.unstrip_protocol(self.path)}: multipart upload {self._upload_id} vanished before "
                    f"it was completed ({exc})"
                ) from exc

        try:
            self._run(complete, f"complete multipart upload ({len(self._parts)} parts, {self.size} bytes) of")
        except TransportError:
            # Every attempt failed as far as we know, but one may have completed and lost its response
            # (a timeout after the store acted). One last look decides.
            try:
                ours = self._is_our_object()
            except Exception:  # noqa: BLE001 - the store is still failing: the TransportError stands
                ours = False
            if not ours:
                raise
        self.requests += 1

    def _is_our_object(self) -> bool:
        """Whether the object now at the key is this upload's result (size and multipart ETag agree)."""
        try:
            head = s3_call(self.fs, "head_object", Bucket=self.bucket, Key=self.key)
        except FileNotFoundError:
            return False
        etag = str(head.get("ETag", "")).strip('"')
        if int(head.get("ContentLength", -1)) != self.size:
            return False
        expected = _multipart_etag([str(self._parts[n]["ETag"]) for n in sorted(self._parts)])
        return etag == expected if expected is not None else etag.endswith(f"-{len(self._parts)}")

    def abort(self) -> None:
        """Drop the upload: abort the multipart upload (retried) so no part lingers; idempotent."""
        self._finished = True
        self._buffer = bytearray()
        with contextlib.suppress(BaseException):  # parts still in flight end first (their errors: see failure)
            self._drain()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        self._call("abort_multipart_upload", f"abort multipart upload {upload_id} of", UploadId=upload_id)

    def abandon(self, cause: BaseException) -> None:
        """:meth:`abort` after ``cause`` ended the write; an abort that fails too is reported, not raised.

        ``NoSuchUpload`` means an earlier abort attempt worked and lost its response. Any other failure
        leaves parts behind (billed until a lifecycle rule removes them): logged, and noted on ``cause``.
        """
        try:
            self.abort()
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - ``cause`` is the error the caller must see
            note = f"aborting the upload of {self.fs.unstrip_protocol(self.path)} failed too, parts may remain: {exc}"
            _log.warning(note)
            if hasattr(cause, "add_note"):  # Python >= 3.11
                cause.add_note(note)


def _multipart_etag(part_etags: list[str]) -> str | None:
    """S3's ETag of a completed upload: MD5 of the parts' binary MD5s, ``-N``; ``None`` if parts are not MD5s.

    (Parts encrypted with SSE-KMS/SSE-C have opaque ETags; then only size and part count can be checked.)
    """
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        hexdigest = etag.strip('"')
        if len(hexdigest) != 32:
            return None
        try:
            digest.update(bytes.fromhex(hexdigest))
        except ValueError:
            return None
    return f"{digest.hexdigest()}-{len(part_etags)}"


@dataclass(frozen=True)
class PendingUpload:
    """An in-progress (never completed, never aborted) multipart upload."""

    url: str  # the object it would create
    key: str
    upload_id: str
    initiated: _dt.datetime | None  # timezone-aware (UTC) when the store reports it

    def age(self, now: _dt.datetime | None = None) -> _dt.timedelta | None:
        if self.initiated is None:
            return None
        return (now or _dt.datetime.now(_dt.timezone.utc)) - self.initiated

    def describe(self) -> str:
        when = f", started {self.initiated.isoformat(timespec='seconds')}" if self.initiated else ""
        return f"{self.url} (upload {self.upload_id[:16]}{'...' if len(self.upload_id) > 16 else ''}{when})"


def list_pending(fs: Any, path: str) -> list[PendingUpload]:
    """Every in-progress multipart upload for ``path`` or for objects under it (``path/...``), sorted.

    Raises :class:`DcpStorageError` naming the bucket if the store refuses the listing (e.g. no
    ``s3:ListBucketMultipartUploads``), :class:`~dcp_storage.errors.ListingTooLongError` if the listing passes
    its bound (:mod:`.listing`). Each page is one request on s3fs's client (no retries of s3fs's own), under
    the caller's deadline.
    """
    bucket, key, _version = fs.split_path(path)
    key = key.rstrip("/")
    found: list[PendingUpload] = []
    markers: dict[str, str] = {}
    bound = ListingBound(f"s3://{bucket}/{key}", "in-progress multipart uploads")
    while True:
        try:
            page = s3_call(fs, "list_multipart_uploads", Bucket=bucket, Prefix=key, **markers)
        except Exception as exc:
            raise DcpStorageError(
                f"s3://{bucket}/{key}: cannot list in-progress multipart uploads ({type(exc).__name__}: {exc})"
            ) from exc
        for upload in page.get("Uploads", []) or []:
            name = upload.get("Key", "")
            if key and name != key and not name.startswith(key + "/"):
                continue  # "ckpt" must not match "ckpt2/..."
            initiated = upload.get("Initiated")
            if isinstance(initiated, _dt.datetime) and initiated.tzinfo is None:
                initiated = initiated.replace(tzinfo=_dt.timezone.utc)
            found.append(
                PendingUpload(f"s3://{bucket}/{name}", name, upload["UploadId"], initiated if initiated else None)
            )
        truncated = bool(page.get("IsTruncated"))
        markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        bound.page(
            len(page.get("Uploads", []) or []),
            f"{markers['KeyMarker']}\0{markers['UploadIdMarker']}" if truncated else None,
        )
        if not truncated:
            break
    return sorted(found, key=lambda u: (u.key, u.initiated or _dt.datetime.min.replace(tzinfo=_dt.timezone.utc)))


def abort_pending(fs: Any, path: str, upload: PendingUpload) -> bool:
    """Abort ``upload`` (one found under ``path``); ``False`` if it is gone (completed or aborted meanwhile)."""
    bucket, _key, _version = fs.split_path(path)
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload.key, UploadId=upload.upload_id)
    except FileNotFoundError:  # s3fs maps NoSuchUpload to FileNotFoundError: it finished meanwhile
        return False
    except Exception as exc:
        raise DcpStorageError(f"{upload.describe()}: cannot abort ({type(exc).__name__}: {exc})") from exc
    return True


def s3_put_if_absent(fs: Any, path: str, data: bytes, url: str) -> None:
    """One conditional ``PutObject``; ``FileExistsError`` if an object is at ``path``."""
    bucket, key, _ = fs.split_path(path)
    try:
        s3_call(fs, "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except OSError as exc:
        if _precondition_failed(exc):
            raise FileExistsError(f"{url} exists") from exc
        raise
    fs.invalidate_cache(path)


def _precondition_failed(exc: BaseException) -> bool:
    """Whether S3 refused the write because the key exists (412 ``PreconditionFailed``)."""
    current: BaseException | None = exc
    while current is not None:  # along ``raise ... from`` only: a 412 handled earlier is not this answer
        if isinstance(getattr(current, "response", None), dict) and (
            error_code(current) == "PreconditionFailed" or http_status(current) == 412
        ):
            return True
        current = current.__cause__
    return False
