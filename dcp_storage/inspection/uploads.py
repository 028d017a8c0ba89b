"""Abandoned multipart uploads under a checkpoint prefix: list them, and abort the stale ones.

Object-store writes commit by completing a multipart upload (see :mod:`dcp_storage.transports`); a writer
that fails aborts its upload, but one that is killed (SIGKILL, OOM, a preempted node) cannot. Its parts
stay in the bucket, invisible to listings and reads but billed, until someone aborts the upload or a
bucket lifecycle rule (``AbortIncompleteMultipartUpload``) does. They never make a checkpoint look
complete; they only cost storage. ``verify`` names them, ``verify --cleanup`` /
:func:`abort_stale_uploads` aborts those older than a threshold (a younger one may belong to a save that
is still running).

Only S3-compatible filesystems (s3fs: anything with ``call_s3``) have multipart uploads; for other
filesystems the list is empty.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from typing import Any

from ..errors import DcpStorageError
from ..transports.factory import open_transport

__all__ = ["PendingUpload", "abort_stale_uploads", "list_pending_uploads"]

DEFAULT_OLDER_THAN = _dt.timedelta(hours=1)


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


def _s3_target(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str, str] | None:
    """``(filesystem, bucket, key prefix)`` for an s3fs URL, else ``None``."""
    transport, path = open_transport(url, storage_options)
    fs = getattr(transport, "fs", None)
    if fs is None or not callable(getattr(fs, "call_s3", None)) or not callable(getattr(fs, "split_path", None)):
        return None
    bucket, key, _version = fs.split_path(path)
    return fs, bucket, key.rstrip("/")


def list_pending_uploads(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> list[PendingUpload]:
    """Every in-progress multipart upload for ``url`` or for objects under it (``url/...``).

    Empty for filesystems without multipart uploads. Raises :class:`~dcp_storage.errors.DcpStorageError`
    naming the bucket if the store refuses the listing (e.g. no ``s3:ListBucketMultipartUploads``).
    """
    url = os.fspath(url)
    target = _s3_target(url, storage_options)
    if target is None:
        return []
    fs, bucket, key = target
    found: list[PendingUpload] = []
    markers: dict[str, str] = {}
    while True:
        try:
            page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key, **markers)
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
        if not page.get("IsTruncated"):
            break
        markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
    return sorted(found, key=lambda u: (u.key, u.initiated or _dt.datetime.min.replace(tzinfo=_dt.timezone.utc)))


def abort_stale_uploads(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    older_than: float | _dt.timedelta = DEFAULT_OLDER_THAN,
) -> list[PendingUpload]:
    """Abort the in-progress multipart uploads under ``url`` started more than ``older_than`` ago.

    ``older_than``: a :class:`~datetime.timedelta` or seconds (default one hour: an upload younger than
    that may belong to a save still running; ``0`` aborts every one). Uploads whose start time the store
    does not report are aborted only with ``older_than=0``. Returns the aborted uploads. An upload that
    is gone by the time it is aborted (completed or aborted meanwhile) is skipped.
    """
    limit = older_than if isinstance(older_than, _dt.timedelta) else _dt.timedelta(seconds=float(older_than))
    if limit < _dt.timedelta(0):
        raise ValueError(f"older_than must be >= 0, got {older_than!r}")
    url = os.fspath(url)
    target = _s3_target(url, storage_options)
    if target is None:
        return []
    fs, bucket, _key = target
    now = _dt.datetime.now(_dt.timezone.utc)
    aborted: list[PendingUpload] = []
    for upload in list_pending_uploads(url, storage_options):
        age = upload.age(now)
        if limit and (age is None or age < limit):
            continue
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload.key, UploadId=upload.upload_id)
        except FileNotFoundError:  # s3fs maps NoSuchUpload to FileNotFoundError: it finished meanwhile
            continue
        except Exception as exc:
            raise DcpStorageError(f"{upload.describe()}: cannot abort ({type(exc).__name__}: {exc})") from exc
        aborted.append(upload)
    return aborted
