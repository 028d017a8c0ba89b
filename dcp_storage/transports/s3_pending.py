"""In-progress S3 multipart uploads under a prefix: list them, abort one (s3fs's client).

A writer that is killed cannot abort its multipart upload; its parts stay in the bucket, billed, until
someone aborts it. :class:`~.s3_transport.S3Transport` offers these as the optional
:class:`~.protocol.MultipartUploads` protocol, which ``verify`` (:mod:`dcp_storage.inspection.uploads`)
uses; other transports have no multipart uploads to list.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.transports.listing import ListingBound
from dcp_storage.transports.s3_stream import s3_call

__all__ = ["PendingUpload", "abort_pending", "list_pending"]


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
